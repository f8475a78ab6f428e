"""The one log throttle (exporter.log_throttle): once per interval per key, bounded, on an injected clock."""

from __future__ import annotations

import subprocess
import sys

from exporter.log_throttle import LogThrottle


def test_a_key_is_due_once_per_interval() -> None:
    now = [0.0]
    throttle = LogThrottle(60.0, clock=lambda: now[0])
    assert throttle.due("a") and not throttle.due("a") and throttle.quiet("a")
    assert throttle.due("b")  # another key is its own
    now[0] = 59.9
    assert not throttle.due("a")
    now[0] = 60.0
    assert not throttle.quiet("a") and throttle.due("a") and not throttle.due("a")


def test_quiet_notes_nothing() -> None:
    throttle = LogThrottle(60.0, clock=lambda: 0.0)
    assert not throttle.quiet("a") and len(throttle) == 0 and throttle.due("a")


def test_the_oldest_keys_are_forgotten_past_the_bound() -> None:
    throttle = LogThrottle(60.0, max_keys=3, clock=lambda: 0.0)
    for key in "abcd":
        assert throttle.due(key)
    assert len(throttle) == 3
    assert throttle.due("a") and not throttle.due("d")  # "a", the oldest, was forgotten: logged again, once


def test_it_imports_nothing_heavy() -> None:
    """The engine-side client may use it: it must not pull in the sidecar's stack."""
    code = ("import sys, exporter.log_throttle; heavy = {'yaml', 'aiohttp', 'pydantic', 'prometheus_client'}; "
            "print(sorted(heavy & set(sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
