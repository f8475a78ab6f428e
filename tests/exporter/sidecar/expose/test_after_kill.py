"""What /metrics shows after a SIGKILL of the sidecar between two saves of its state file.

Real processes (`hicache-exporter serve` with --persistence.file), a real socket and HTTP. The
state file holds the state as of its last write; a SIGKILL (an OOM kill) loses what came in
since. The new sidecar serves the rollups of the last write at once: present, but below what was
scraped before the kill until the ranks push again. Then, the same epoch reconnecting, the
rollups catch up exactly: nothing lost, nothing counted twice. docs/kubernetes.md ("What the
state does not cover") states this bound; a scrape in between reads a false counter reset.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.protocol.messages import Welcome
from tests.helpers import RawClient, Scrape, counter, free_port, hello, http_get, snapshot, wait_ready, wait_until

ROLLUP = "sglang_rollup_load_back_bytes_total"
PER_RANK = "sglang_load_back_bytes_total"


class Sidecar:
    """One `hicache-exporter serve` process on a state file that saves only at stop (an hour's interval)."""

    def __init__(self, directory: Path) -> None:
        self.port = free_port()
        self.socket = str(directory / "ingest.sock")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
             "--socket", self.socket, "--persistence.file", str(directory / "state"), "--persistence.interval", "1h"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        wait_ready(self.proc, self.ready)

    def ready(self) -> bool:
        try:
            return http_get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200
        except OSError:
            return False

    def scrape(self) -> Scrape:
        return Scrape(http_get(f"http://127.0.0.1:{self.port}/metrics")[1].decode())

    def stop(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(60)


def push(sidecar: Sidecar, seq: int, value: float) -> None:
    """The rank (tp 0, epoch e1) connects, pushes its cumulative bytes and leaves; the sidecar has applied it."""
    client = RawClient(sidecar.socket)
    try:
        client.send(hello(epoch="e1", cache_type="HiRadixCache"))
        assert isinstance(client.recv(), Welcome)
        client.send(snapshot(seq, counter("load_back_bytes_total", value)))
        wait_until(lambda: bool(sidecar.scrape().find(PER_RANK)) and sidecar.scrape().value(PER_RANK) == value, 60)
    finally:
        client.close()


@pytest.fixture
def started(tmp_path: Path) -> Iterator[list[Sidecar]]:
    sidecars: list[Sidecar] = []
    yield sidecars
    for sidecar in sidecars:
        sidecar.stop(signal.SIGKILL)


def test_a_sigkill_loses_until_the_ranks_push_again_what_came_in_since_the_last_save(
        tmp_path: Path, started: list[Sidecar]) -> None:
    first = Sidecar(tmp_path)
    started.append(first)
    push(first, 1, 100.0)
    first.stop(signal.SIGTERM)  # the save at stop: the file holds 100
    second = Sidecar(tmp_path)
    started.append(second)
    assert second.scrape().value(ROLLUP) == 100  # taken back at once, before any rank is back
    push(second, 2, 250.0)  # the same epoch reconnects: it continues
    assert second.scrape().value(ROLLUP) == 250
    second.stop(signal.SIGKILL)  # no save since the load: the file still holds 100
    third = Sidecar(tmp_path)
    started.append(third)
    # Present at once, but the last save's value: below the 250 scraped before the kill (a false counter
    # reset to a scrape now), by what came in since that save.
    assert third.scrape().value(ROLLUP) == 100
    push(third, 3, 250.0)  # the rank pushes its cumulative value again
    assert third.scrape().value(ROLLUP) == 250  # exact: the 150 counted once
