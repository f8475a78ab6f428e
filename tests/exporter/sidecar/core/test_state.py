"""SidecarState as a facade: hello → snapshot (registry → reader → ledger → window) → disconnect; rank status read from the clock.

The rules themselves are tested per module: test_registry, test_reader, test_ledger, test_window.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.config import RanksConfig, SidecarConfig
from exporter.errors import ErrorCode
from exporter.protocol.framing import encode_message
from exporter.protocol.messages import Sample, Snapshot, parse_client_message
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.history import WindowHistory
from exporter.sidecar.core.ranks import SEQ_JUMP_PER_SECOND, SEQ_JUMP_SLACK, RankStatus
from exporter.sidecar.core.state import SidecarState, SnapshotResult
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.expose.status import StatusView, rank_rows
from tests.exporter.sidecar.expose.reference import ReferenceCollector
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
from tests.helpers import Scrape


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


def test_disconnect_expiry_and_exposed_ranks_delegate_to_the_registry() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, a = h.hello(tp=1)
    _, b = h.hello(tp=0)
    h.push(a, bytes_(1.0))
    h.push(b, bytes_(2.0))
    assert h.state.exposed_ranks() == [b, a]
    h.state.disconnect(conn, a)
    assert a.status is RankStatus.DEPARTED
    h.clock.advance(30.0)
    assert a.status is RankStatus.EXPIRED and b.status is RankStatus.EXPIRED
    assert h.state.exposed_ranks() == []
    assert h.counter(BYTES) == 3.0


# --- two writers of one epoch (issue 19, finding 10) ---

MAX_SEQ = 2**64 - 1  # the largest seq the protocol decodes (an unsigned 64-bit count)


def _wire_snapshot(seq: int, *samples: Sample) -> Snapshot:
    """A snapshot as the sidecar decodes it from a frame: the seq must survive the protocol."""
    message = parse_client_message(encode_message(Snapshot(seq=seq, time=1.0, samples=list(samples)))[4:])
    assert isinstance(message, Snapshot) and message.seq == seq
    return message


def _per_rank_bytes(state: SidecarState) -> float:
    """The per-rank load_back_bytes_total of rank tp 0 on /metrics."""
    text = TextRenderer(SidecarCollector(state, SidecarHealth(), "sglang_")).render().decode()
    scrape = Scrape(text)
    return scrape.value("sglang_load_back_bytes_total", tp_rank="0")


def test_an_impostor_reusing_a_rank_epoch_cannot_freeze_the_rank(h: Harness) -> None:
    """After a sidecar restart, an impostor says hello first with the real rank's (public) epoch
    and seq 2**64-1; once it leaves, the real rank's reconnect must flow, not drop as old_seq."""
    impostor, rank = h.hello(epoch="real")
    assert not h.state.snapshot(rank, _wire_snapshot(MAX_SEQ, bytes_(5_000_000.0))).ignored
    h.state.disconnect(impostor, rank)
    _, result = h.hello_result(epoch="real")
    assert result.reconnect and result.rank is rank
    outcome = h.state.snapshot(rank, _wire_snapshot(50, bytes_(400.0)))
    assert not outcome.ignored and outcome.applied == 1 and outcome.rejections == []
    assert outcome.conflict is not None and outcome.conflict[0] is ErrorCode.EPOCH_CONFLICT
    assert "another process pushed with this epoch" in outcome.conflict[1]
    assert rank.epoch_conflicts == 1 and rank.restarts == 0 and rank.epoch == "real"
    assert _per_rank_bytes(h.state) == 400.0
    assert h.counter(BYTES) == 5_000_400.0  # positions continue: the rollup never falls
    # Later pushes apply, as increases of the real rank's own values.
    later = h.state.snapshot(rank, _wire_snapshot(51, bytes_(450.0)))
    assert not later.ignored and later.conflict is None
    assert _per_rank_bytes(h.state) == 450.0 and h.counter(BYTES) == 5_000_450.0


def test_a_reconnect_whose_seq_jumps_absurdly_is_refused(h: Harness) -> None:
    conn, rank = h.hello(epoch="real")
    h.push(rank, bytes_(400.0), seq=50)
    h.state.disconnect(conn, rank)
    h.clock.advance(10.0)
    h.hello(epoch="real")  # someone with the public epoch, while the rank is away
    result = h.state.snapshot(rank, _wire_snapshot(MAX_SEQ, bytes_(5_000_000.0)))
    assert result.ignored and result.applied == 0 and result.refused is not None
    assert result.refused[0] is ErrorCode.SEQ_JUMP and "seq 50" in result.refused[1]
    assert rank.values[(BYTES, ())] == 400.0 and h.counter(BYTES) == 400.0 and rank.seq == 50
    # A seq the epoch could have reached is let through (the one-per-push rule is the client's).
    allowed = 50 + SEQ_JUMP_SLACK + 10 * SEQ_JUMP_PER_SECOND
    assert h.state.snapshot(rank, _wire_snapshot(allowed + 1, bytes_(401.0))).refused is not None
    assert not h.state.snapshot(rank, _wire_snapshot(allowed, bytes_(401.0))).ignored
    assert h.counter(BYTES) == 401.0


def test_a_reconnect_continues_exactly_and_compares_seq_within_its_connection(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(100.0), hist(DURATION, one_hot(DURATION, 0), 0.001), seq=7)
    h.state.disconnect(conn, rank)
    h.hello(epoch="one")
    # A client whose seq started over (it lost count) is not held back by its earlier connection.
    result = h.push(rank, bytes_(130.0), hist(DURATION, one_hot(DURATION, 0, n=2), 0.002), seq=1)
    assert not result.ignored and result.conflict is None and result.rejections == []
    assert h.counter(BYTES) == 130.0 and rank.values[(BYTES, ())] == 130.0
    assert rank.epoch_conflicts == 0 and rank.reconnects == 1
    assert h.push(rank, bytes_(999.0), seq=1).ignored  # within the connection, seq still rises


def test_a_histogram_going_down_on_a_reconnect_is_an_epoch_conflict(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, n=5), 0.005))
    h.state.disconnect(conn, rank)
    h.hello(epoch="one")
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 0, n=2), 0.002))
    assert result.conflict is not None and result.rejections == []
    histogram = h.histogram(DURATION)
    assert histogram is not None and histogram.counts[-1] == 7  # 5 before, then the new writer's 2
    assert rank.values[(DURATION, ())].count == 2  # type: ignore[union-attr]


def test_a_gauge_going_down_on_a_reconnect_is_no_conflict(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(10.0), used(50.0))
    h.state.disconnect(conn, rank)
    h.hello(epoch="one")
    result = h.push(rank, bytes_(10.0), used(3.0))
    assert result.conflict is None and rank.epoch_conflicts == 0 and rank.values[(USED, ())] == 3.0


def test_after_an_epoch_conflict_metrics_shows_the_new_writers_series_only(h: Harness) -> None:
    """The epoch starting over in place must not reuse /metrics lines cached for the old writer's
    series, even when the new writer sends as many series as it did."""
    renderer = TextRenderer(SidecarCollector(h.state, SidecarHealth(), "sglang_"))
    impostor, rank = h.hello(epoch="real")
    h.push(rank, bytes_(5_000_000.0), tokens(100.0))
    scrape = Scrape(renderer.render().decode())
    assert scrape.value("sglang_load_back_tokens_total", tp_rank="0", pool="kv") == 100.0
    h.state.disconnect(impostor, rank)
    h.hello(epoch="real")
    assert h.push(rank, bytes_(400.0), used(3.0)).conflict is not None
    scrape = Scrape(renderer.render().decode())
    assert scrape.find("sglang_load_back_tokens_total", tp_rank="0") == []
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 400.0
    assert scrape.value("sglang_hicache_host_used_tokens", tp_rank="0") == 3.0


# --- two writers taking turns on one epoch (review 19, finding 6) ---


def _turn(h: Harness, epoch: str, *samples: Sample) -> tuple[object, SnapshotResult]:
    """One writer's turn: a reconnect with `epoch` and one snapshot; the connection is left open."""
    conn, rank = h.hello(epoch=epoch)
    return conn, h.push(rank, *samples)


def test_an_impostor_taking_turns_on_a_ranks_epoch_adds_only_its_own_increases(h: Harness) -> None:
    """The real rank at 1,050 leaves; an impostor reuses its epoch and pushes 5, then 1 on every
    later turn: each time the real rank returns it continued from its own values, not from the
    impostor's (ten turns once added 12,611 for 1,051 of the rank's own and the impostor's 5)."""
    conn, rank = h.hello(epoch="E")
    h.push(rank, bytes_(1050.0))
    h.state.disconnect(conn, rank)
    conn, result = _turn(h, "E", bytes_(5.0))
    assert result.conflict is not None and "below what that epoch pushed" in result.conflict[1]
    assert h.counter(BYTES) == 1055.0 and rank.values[(BYTES, ())] == 5.0
    h.state.disconnect(conn, rank)
    conn, result = _turn(h, "E", bytes_(1051.0))  # the real rank: at or above both writers', nearer its own
    assert result.conflict is not None and result.conflict[0] is ErrorCode.EPOCH_CONFLICT
    assert "continue those another writer of that epoch pushed" in result.conflict[1]
    assert h.counter(BYTES) == 1056.0 and _per_rank_bytes(h.state) == 1051.0
    for _ in range(10):
        h.state.disconnect(conn, rank)
        conn, _ = _turn(h, "E", bytes_(1.0))  # the impostor, below both: a new writer from 1
        h.state.disconnect(conn, rank)
        conn, _ = _turn(h, "E", bytes_(1051.0))  # the real rank continues its own 1,051
        assert _per_rank_bytes(h.state) == 1051.0
    assert h.counter(BYTES) == 1057.0  # 1,051 of the real rank's, 5 then 1 of the impostor's two starts
    assert rank.epoch_conflicts == 22 and rank.restarts == 0 and rank.epoch == "E"
    h.push(rank, bytes_(1060.0))  # and the real rank's increases count
    assert h.counter(BYTES) == 1066.0


def test_a_writer_at_or_above_the_last_writers_values_continues_them_without_conflict(h: Harness) -> None:
    conn, rank = h.hello(epoch="E")
    h.push(rank, bytes_(100.0))
    h.state.disconnect(conn, rank)
    conn, _ = _turn(h, "E", bytes_(5.0))  # a second writer: the first is set aside at 100
    h.state.disconnect(conn, rank)
    conn, result = _turn(h, "E", bytes_(7.0))  # above the last writer's 5, below the other's 100
    assert result.conflict is None and h.counter(BYTES) == 107.0
    h.state.disconnect(conn, rank)
    _, result = _turn(h, "E", bytes_(130.0))  # at or above both, nearer the other writer's 100
    assert result.conflict is not None and h.counter(BYTES) == 137.0 and rank.values[(BYTES, ())] == 130.0


def test_two_writers_taking_turns_on_a_histogram_add_only_their_own_observations(h: Harness) -> None:
    conn, rank = h.hello(epoch="E")
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, n=5), 0.005))
    h.state.disconnect(conn, rank)
    conn, _ = _turn(h, "E", hist(DURATION, one_hot(DURATION, 0, n=2), 0.002))
    h.state.disconnect(conn, rank)
    _, result = _turn(h, "E", hist(DURATION, one_hot(DURATION, 0, n=6), 0.006))
    assert result.conflict is not None and result.rejections == []
    histogram = h.histogram(DURATION)
    assert histogram is not None and histogram.counts[-1] == 8  # 5 and 1 of the real rank's, 2 of the other's
    assert histogram.sum == pytest.approx(0.008)


def test_the_other_writers_values_count_in_the_series_budget_until_the_epoch_ends(h: Harness) -> None:
    conn, rank = h.hello(epoch="E")
    h.push(rank, bytes_(100.0), tokens(10.0))
    h.state.disconnect(conn, rank)
    conn, _ = _turn(h, "E", bytes_(5.0))
    assert rank.other_writer is not None and rank.other_writer.cost == 2
    assert h.state.series_budget().per_rank == 3  # the set-aside writer's two and the new writer's one
    h.state.disconnect(conn, rank)
    conn, _ = _turn(h, "E", bytes_(1.0))  # a third writer: the one set aside before is dropped
    assert h.state.series_budget().per_rank == 2 and rank.other_writer.cost == 1  # type: ignore[union-attr]
    h.state.disconnect(conn, rank)
    h.hello(epoch="F")  # a restart: the other writer wrote the replaced epoch
    assert rank.other_writer is None and h.state.series_budget().per_rank == 0


def test_a_writer_that_resumes_its_values_shows_its_own_series_on_metrics(h: Harness) -> None:
    renderer = TextRenderer(SidecarCollector(h.state, SidecarHealth(), "sglang_"))
    conn, rank = h.hello(epoch="E")
    h.push(rank, bytes_(100.0), used(3.0))
    h.state.disconnect(conn, rank)
    conn, _ = _turn(h, "E", bytes_(5.0), tokens(9.0))
    assert Scrape(renderer.render().decode()).value("sglang_load_back_tokens_total", tp_rank="0", pool="kv") == 9.0
    h.state.disconnect(conn, rank)
    _turn(h, "E", bytes_(101.0))
    scrape = Scrape(renderer.render().decode())
    assert scrape.find("sglang_load_back_tokens_total", tp_rank="0") == []
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 101.0
    assert scrape.value("sglang_hicache_host_used_tokens", tp_rank="0") == 3.0


def test_an_impostor_whose_conflicting_snapshot_is_refused_cannot_have_the_rank_counted_again(h: Harness) -> None:
    """A conflict whose samples are all refused leaves the new writer with no values: the real
    rank returning must still continue its own values, not count them from zero again."""
    conn, rank = h.hello(epoch="E")
    h.push(rank, bytes_(1050.0))
    h.state.disconnect(conn, rank)
    conn, result = _turn(h, "E", bytes_(-1.0))  # below the epoch's 1,050, then refused as negative
    assert result.conflict is not None and codes(result) == [ErrorCode.INVALID_VALUE] and rank.values == {}
    h.state.disconnect(conn, rank)
    _, result = _turn(h, "E", bytes_(1051.0))
    assert result.conflict is not None and h.counter(BYTES) == 1051.0 and rank.values[(BYTES, ())] == 1051.0


# --- reading never changes state (issue 20): status is derived from the clock, never ticked ---


def _fingerprint(h: Harness) -> str:
    """Everything a read could change: every rank's fields and position history, the rollups and the budget."""
    ranks = [(repr(rank), repr([getattr(rank.history, slot) for slot in WindowHistory.__slots__]))
             for rank in h.state.known_ranks()]
    return repr((ranks, h.state.rollup_counters(), h.state.rollup_histograms(), h.state.layout_conflicts(),
                 h.state.series_budget()))


def test_reading_never_changes_state_and_status_follows_the_clock() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    collector = ReferenceCollector(h.state, SidecarHealth(), "sglang_")
    renderer = TextRenderer(collector)
    view = StatusView(SidecarConfig(), h.state, SidecarHealth())
    conn, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    for step in range(1, 9):  # 80 s of pushes: older history than the window (60 s), which a read must not prune
        h.clock.advance(10.0)
        h.push(a, bytes_(100.0 * step), tokens(10.0 * step), hist(DURATION, one_hot(DURATION, 1, step), 0.5 * step))
        h.push(b, bytes_(90.0 * step), tokens(9.0 * step))
    h.state.disconnect(conn, a)
    expected = ((0.0, RankStatus.DEPARTED, RankStatus.LIVE), (10.0, RankStatus.DEPARTED, RankStatus.STALE),
                (20.0, RankStatus.EXPIRED, RankStatus.EXPIRED))
    for advance, status_a, status_b in expected:
        h.clock.advance(advance)
        before = _fingerprint(h)
        for _ in range(2):
            renderer.render()
            renderer.render(openmetrics=True)
            list(collector.collect())
            view.document()
            rank_rows(h.state)
            h.state.window_increases(h.state.known_ranks())
        assert _fingerprint(h) == before
        assert (a.status, b.status) == (status_a, status_b)
    assert h.state.exposed_ranks() == []
    assert h.state.ranks_by_status()[RankStatus.EXPIRED] == 2


def test_nothing_outside_the_core_reaches_past_the_facade() -> None:
    """The facade is the only door: the sources, views and tools ask SidecarState, never its parts."""
    root = Path(__file__).resolve().parents[4]
    parts = re.compile(r"(?:state|STATE\])\.(?:registry|ledger|window|reader|ranks)\b")
    core = root / "exporter" / "sidecar" / "core"
    found = [f"{path.relative_to(root)}:{number}: {line.strip()}"
             for top in ("exporter", "bench") for path in sorted((root / top).rglob("*.py")) if core not in path.parents
             for number, line in enumerate(path.read_text().splitlines(), 1) if parts.search(line)]
    assert found == []
