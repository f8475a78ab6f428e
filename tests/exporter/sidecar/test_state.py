"""SidecarState as a facade: hello → snapshot (registry → reader → ledger → window) → disconnect → tick.

The rules themselves are tested per module: test_registry, test_reader, test_ledger, test_window.
"""

from __future__ import annotations

from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.sidecar.registry import RankStatus
from tests.exporter.sidecar.harness import (
    BYTES,
    DURATION,
    TOKENS,
    USED,
    Harness,
    bytes_,
    codes,
    hist,
    one_hot,
    rollup_key,
    tokens,
    used,
)


def test_the_facade_wires_one_registry_reader_ledger_and_window(h: Harness) -> None:
    state = h.state
    assert state.ranks is state.registry.ranks
    assert state.reader.registry is state.registry
    assert state.registry.clock is h.clock and state.registry.wall_clock is h.wall
    assert state.registry.window == 60.0


def test_a_snapshot_flows_through_to_values_positions_rollups_and_history(h: Harness) -> None:
    _, rank = h.hello()
    result = h.push(rank, bytes_(10.0), tokens(4.0), used(7.0), hist(DURATION, one_hot(DURATION, 0), 0.001))
    assert result.applied == 4 and not result.ignored and result.rejections == []
    assert rank.values[(BYTES, ())] == 10.0 and rank.values[(USED, ())] == 7.0
    assert rank.positions == {(BYTES, ()): 10.0, (TOKENS, ("kv",)): 4.0, (DURATION, ()): 0.001}
    assert h.counter(BYTES) == 10.0 and h.counter(TOKENS, "kv") == 4.0
    assert h.gauges() == {rollup_key(USED): 7.0}
    assert len(rank.history) == 1
    h.clock.advance(5.0)
    h.push(rank, bytes_(10.0))  # unchanged: applied, nothing moves, history still recorded
    assert len(rank.history) == 2 and h.counter(BYTES) == 10.0


def test_snapshot_result_counts_rejections_as_plain_tuples(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(10.0))
    result = h.push(rank, bytes_(5.0), tokens(1.0), tokens(-1.0, pool="host"))
    assert result.applied == 1
    assert codes(result) == [ErrorCode.COUNTER_DECREASED, ErrorCode.INVALID_VALUE]
    assert all(type(r) is tuple and isinstance(r[1], str) for r in result.rejections)


def test_an_ignored_snapshot_changes_nothing(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(10.0), seq=3)
    result = h.push(rank, bytes_(99.0), seq=3)
    assert result.ignored and result.applied == 0 and result.rejections == []
    assert rank.values[(BYTES, ())] == 10.0 and h.counter(BYTES) == 10.0
    assert len(rank.history) == 1 and rank.snapshots == 1


def test_disconnect_tick_and_exposed_ranks_delegate_to_the_registry() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, a = h.hello(tp=1)
    _, b = h.hello(tp=0)
    h.push(a, bytes_(1.0))
    h.push(b, bytes_(2.0))
    assert h.state.exposed_ranks() == [b, a]
    h.state.disconnect(conn, a)
    assert a.status is RankStatus.DEPARTED
    h.clock.advance(30.0)
    h.state.tick()
    assert a.status is RankStatus.EXPIRED and b.status is RankStatus.EXPIRED
    assert h.state.exposed_ranks() == []
    assert h.counter(BYTES) == 3.0
