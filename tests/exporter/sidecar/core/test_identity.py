"""One constructor per key: the rank identity (core/ranks.rank_identity) and the upstream health's messages."""

from __future__ import annotations

import re
from pathlib import Path

from exporter.protocol.messages import World
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.ranks import rank_identity
from exporter.sidecar.core.state import SidecarState
from tests.exporter.sidecar.harness import STATIC_KEY, Harness

ROOT = Path(__file__).resolve().parents[4]


def test_a_rank_without_a_context_parallel_axis_is_cp_rank_0() -> None:
    static = (("model", "m"),)
    assert rank_identity(1, 2, 3, None, static) == rank_identity(1, 2, 3, 0, static) == (1, 2, 3, 0, static)
    h = Harness()
    _, rank = h.hello(tp=1, pp=2, dp=3)  # no attn_cp_rank
    assert rank.identity == rank_identity(1, 2, 3, None, STATIC_KEY) and h.state.rank(rank.identity) is rank


def test_a_source_changes_the_world_a_rank_is_expected_in_through_the_facade() -> None:
    """Before: the upstream feed wrote `rank.world` itself, the one field a source wrote past the facade."""
    h = Harness()
    conn, rank = h.hello()
    world = World(tp_size=2, pp_size=1, dp_size=1)
    state: SidecarState = h.state
    state.expect(rank, world)
    assert rank.world == world and rank.connection is conn  # no hello: no reconnect


def test_the_identity_tuple_is_written_in_one_module() -> None:
    """Before: it was written by hand in four modules (seven places), and only some read a missing attn_cp_rank as 0."""
    by_hand = re.compile(r"(\w*)\(\s*[\w.]*tp\w*\s*,\s*[\w.]*pp\w*\s*,\s*[\w.]*dp_rank\s*,\s*[\w.]*(?:cp|attn_cp_rank)"
                         r"[\w. ]*(?:or 0)?\s*,\s*[^()]*?static")
    found = [f"{path.relative_to(ROOT)}: {match.group(0)[:60]}" for path in sorted((ROOT / "exporter").rglob("*.py"))
             if path != ROOT / "exporter/sidecar/core/ranks.py"
             for match in by_hand.finditer(path.read_text()) if match.group(1) != "rank_identity"]
    assert found == []


def test_an_upstream_error_is_counted_by_kind_and_shown_by_kind_and_line_only() -> None:
    """Its message may quote the upstream's text (a secret behind a redirect): the log says it, the health
    keeps nothing of it."""
    health = UpstreamHealth("u", "http://engine/metrics")
    health.error("connect")
    health.error("parse", line=3)
    assert health.errors == {"connect": 1, "parse": 1} and health.last_error == "parse at line 3"
    health.error("connect")
    assert health.errors == {"connect": 2, "parse": 1} and health.last_error == "connect"
