"""WindowHistory and the window's readings: active bandwidth and replica spread."""

from __future__ import annotations

import pytest

from exporter.catalog import Catalog, FamilySpec, MetricType, Semantics
from exporter.config import RanksConfig
from exporter.protocol.messages import HistogramSample, Sample, ScalarSample
from exporter.sidecar.core.history import WindowHistory
from exporter.sidecar.core.keys import SeriesKey
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.window import Bandwidth
from tests.exporter.sidecar.harness import (
    BYTES,
    DROPPED,
    DURATION,
    STATIC_KEY,
    TOKENS,
    Harness,
    bytes_,
    dropped,
    hist,
    one_hot,
    rollup_key,
    tokens,
)

A: SeriesKey = ("family_a", ())
B: SeriesKey = ("family_b", ())

# --- WindowHistory ---


def test_increase_is_current_minus_the_last_entry_at_or_before_the_windows_start() -> None:
    history = WindowHistory(60.0, 1.0)
    history.record(0.0, {A: 10.0})
    history.record(30.0, {A: 40.0})
    history.record(70.0, {A: 100.0})
    assert history.increases(70.0, {A: 100.0}) == {A: 90.0}  # base: the entry at 0 (start is 10)
    assert history.increases(95.0, {A: 100.0}) == {A: 60.0}  # base: the entry at 30 (start is 35)
    assert len(history) == 3  # a read prunes nothing (reading never changes state)
    history.record(95.0, {A: 100.0})
    assert len(history) == 3  # the record pruned the entry at 0: one entry before the window is enough
    assert history.increases(130.0, {A: 100.0}) == {A: 0.0}  # base: the entry at 70


def test_an_entry_exactly_at_the_windows_start_is_the_base() -> None:
    history = WindowHistory(60.0, 1.0)
    history.record(0.0, {A: 10.0})
    assert history.base(59.5) is None
    assert history.base(60.0) == {A: 10.0}
    assert history.increases(60.0, {A: 25.0}) == {A: 15.0}


def test_everything_seen_inside_the_window_counts_from_zero() -> None:
    history = WindowHistory(60.0, 1.0)
    history.record(0.0, {A: 10.0})
    history.record(20.0, {A: 20.0})
    assert history.base(30.0) is None
    assert history.increases(30.0, {A: 25.0}) == {A: 25.0}
    assert WindowHistory(60.0, 1.0).increases(0.0, {A: 3.0}) == {A: 3.0}  # no entry at all


def test_a_series_missing_from_the_base_counts_from_zero() -> None:
    history = WindowHistory(60.0, 1.0)
    history.record(0.0, {A: 5.0})
    assert history.increases(61.0, {A: 8.0, B: 3.0}) == {A: 3.0, B: 3.0}


def test_record_copies_the_positions() -> None:
    history = WindowHistory(60.0, 1.0)
    positions = {A: 5.0}
    history.record(0.0, positions)
    positions[A] = 50.0
    assert history.base(60.0) == {A: 5.0}


def test_entries_closer_than_the_resolution_replace_each_other() -> None:
    history = WindowHistory(60.0, 10.0)
    for now in (0.0, 1.0, 2.0, 3.0):
        history.record(now, {A: now})
    assert len(history) == 2  # the entry at 0 and the latest
    history.record(12.0, {A: 12.0})
    assert len(history) == 3
    assert history.increases(63.0, {A: 63.0}) == {A: 63.0 - 3.0}  # base: the entry kept at 3


def test_history_stays_bounded_at_any_push_rate() -> None:
    window, resolution = 60.0, 1.0
    history = WindowHistory(window, resolution)
    now = 0.0
    for _ in range(20_000):
        now += 0.05
        history.record(now, {A: now})
    assert len(history) <= 2 * window / resolution + 2
    increase = history.increases(now, {A: now})[A]
    assert window <= increase <= window + 2 * resolution


# --- active bandwidth ---


def transfer(moved: float, seconds: float, loads: int) -> list[Sample]:
    """Cumulative bytes moved and seconds spent over `loads` loads (one DURATION observation each)."""
    return [bytes_(moved), hist(DURATION, one_hot(DURATION, 18, loads), seconds)]


def readings(h: Harness) -> tuple[dict[int, float], dict, dict]:
    state = h.state
    known = list(state.ranks.values())
    increases = state.window.increases(known, h.clock.now)
    per_rank, rolled = state.window.bandwidths(known, increases)
    by_rank = {}
    for spec, rank, labels, bw in per_rank:
        assert spec.name == BYTES and labels == ()
        by_rank[rank.tp_rank] = bw.value
    return by_rank, rolled, increases


def test_bandwidth_is_the_windows_bytes_over_its_duration_sum(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, *transfer(1000.0, 2.0, 1))
    h.clock.advance(10.0)
    h.push(rank, *transfer(4000.0, 3.0, 2))
    by_rank, rolled, _ = readings(h)
    assert by_rank == {0: pytest.approx(4000.0 / 3.0)}  # all inside the window: from zero
    h.clock.advance(60.0)
    h.push(rank, *transfer(7000.0, 5.0, 3))
    by_rank, rolled, increases = readings(h)
    assert increases[id(rank)][(BYTES, ())] == 3000.0
    assert by_rank == {0: pytest.approx(1500.0)}  # (7000 - 4000) / (5 - 3)
    assert rolled == {rollup_key(BYTES): Bandwidth(3000.0, pytest.approx(2.0))}  # type: ignore[arg-type]


def test_rolled_up_bandwidth_sums_bytes_and_seconds_over_ranks(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, *transfer(3000.0, 2.0, 1))
    h.push(b, *transfer(1000.0, 3.0, 1))
    by_rank, rolled, _ = readings(h)
    assert by_rank == {0: 1500.0, 1: pytest.approx(1000.0 / 3.0)}
    assert rolled[rollup_key(BYTES)].value == 800.0  # 4000 / 5, not the mean of the ratios


def test_no_bandwidth_without_transfer_time(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, bytes_(500.0))  # bytes, but no duration histogram
    h.push(b, *transfer(100.0, 0.0, 1))  # a load that took no time
    by_rank, rolled, _ = readings(h)
    assert by_rank == {} and rolled == {}


def test_no_bandwidth_when_the_window_saw_no_transfer() -> None:
    h = Harness()
    _, rank = h.hello()
    h.push(rank, *transfer(1000.0, 2.0, 1))
    h.clock.advance(61.0)
    h.push(rank, *transfer(1000.0, 2.0, 1))
    by_rank, rolled, _ = readings(h)
    assert by_rank == {} and rolled == {}


def test_an_expired_rank_leaves_the_per_rank_readings_but_not_the_rollup() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=1.0, expire_after_seconds=2.0))
    conn, gone = h.hello(tp=0)
    _, kept = h.hello(tp=1)
    h.push(gone, *transfer(1000.0, 1.0, 1))
    h.state.disconnect(conn, gone)
    h.clock.advance(3.0)
    h.push(kept, *transfer(1000.0, 3.0, 1))
    assert gone.expired and not kept.expired
    by_rank, rolled, _ = readings(h)
    assert by_rank == {1: pytest.approx(1000.0 / 3.0)}
    assert rolled[rollup_key(BYTES)].value == 500.0  # 2000 / 4


def test_bandwidth_over_a_restart_uses_the_continued_positions() -> None:
    h = Harness()
    conn, rank = h.hello(epoch="one")
    h.push(rank, *transfer(1000.0, 1.0, 1))
    h.clock.advance(61.0)
    h.push(rank, *transfer(2000.0, 2.0, 2))
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    h.clock.advance(1.0)
    h.push(rank, *transfer(500.0, 0.5, 1))  # the new epoch counts from zero; its position continues
    by_rank, rolled, increases = readings(h)
    assert increases[id(rank)] == {(BYTES, ()): 1500.0, (DURATION, ()): pytest.approx(1.5)}
    assert by_rank == {0: pytest.approx(1000.0)}


def test_labelled_bandwidth_pairs_are_read_per_label_set() -> None:
    catalog = Catalog(families=(
        FamilySpec(name="x_bytes_total", type=MetricType.COUNTER, semantics=Semantics.PER_SHARD, help="x",
                   labels=("pool",), duration_histogram="x_duration_seconds"),
        FamilySpec(name="x_duration_seconds", type=MetricType.HISTOGRAM, semantics=Semantics.PER_SHARD, help="x",
                   labels=("pool",), buckets=(1.0,)),
    ))
    h = Harness(catalog=catalog)
    _, rank = h.hello()

    def pool(name: str, moved: float, seconds: float) -> list[Sample]:
        return [ScalarSample(family="x_bytes_total", labels={"pool": name}, value=moved),
                HistogramSample(family="x_duration_seconds", labels={"pool": name},
                                buckets=[(1.0, 1), ("+Inf", 1)], sum=seconds, count=1)]

    h.push(rank, *pool("kv", 100.0, 2.0), *pool("host", 90.0, 3.0))
    known = list(h.state.ranks.values())
    per_rank, rolled = h.state.window.bandwidths(known, h.state.window.increases(known, h.clock.now))
    assert sorted((labels, bw.value) for _, _, labels, bw in per_rank) == [(("host",), 30.0), (("kv",), 50.0)]
    assert {key: bw.value for key, bw in rolled.items()} == {
        ("x_bytes_total", STATIC_KEY, ("kv",)): 50.0, ("x_bytes_total", STATIC_KEY, ("host",)): 30.0,
    }


# --- replica spread ---


def spreads(h: Harness) -> dict:
    state = h.state
    known = list(state.ranks.values())
    return state.window.spreads(state.registry.groups(), state.window.increases(known, h.clock.now))


def group_key(dp: int = 0) -> tuple[int, tuple[tuple[str, str], ...]]:
    return (dp, STATIC_KEY)


def test_spread_is_max_minus_min_over_max_of_the_windows_increases() -> None:
    h = Harness()
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    for rank in (a, b):
        h.push(rank, tokens(1000.0), bytes_(5.0))
    h.clock.advance(61.0)
    h.push(a, tokens(1100.0), bytes_(50.0))
    h.push(b, tokens(1090.0), bytes_(6.0))
    # Over the window: 100 and 90 (cumulative values would say 0.009); per_shard bytes have no spread.
    assert spreads(h) == {(TOKENS, group_key(), ("kv",)): pytest.approx(0.1)}


def test_spread_needs_two_current_replicas(h: Harness) -> None:
    conn, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, tokens(100.0))
    assert spreads(h) == {}  # b has not pushed since it connected
    h.push(b, tokens(50.0))
    assert spreads(h) == {(TOKENS, group_key(), ("kv",)): 0.5}
    h.state.disconnect(conn, a)
    assert spreads(h) == {}


def test_spread_is_per_replica_group(h: Harness) -> None:
    ranks = {(dp, tp): h.hello(tp=tp, dp=dp)[1] for dp in (0, 1) for tp in (0, 1)}
    values = {(0, 0): 100.0, (0, 1): 75.0, (1, 0): 40.0, (1, 1): 40.0}
    for key, rank in ranks.items():
        h.push(rank, tokens(values[key]))
    assert spreads(h) == {(TOKENS, group_key(0), ("kv",)): 0.25, (TOKENS, group_key(1), ("kv",)): 0.0}


def test_a_replica_without_a_series_has_counted_none_of_it(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, tokens(10.0), dropped(4.0, reason="host_pressure", pool="kv"))
    h.push(b, tokens(10.0))
    assert spreads(h) == {
        (TOKENS, group_key(), ("kv",)): 0.0,
        (DROPPED, group_key(), ("host_pressure", "kv")): 1.0,
    }


def test_no_increase_anywhere_is_no_spread(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    for rank in (a, b):
        h.push(rank, tokens(0.0))
    assert spreads(h) == {(TOKENS, group_key(), ("kv",)): 0.0}


def test_spread_of_a_stale_replica_is_not_read() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    ranks: list[RankState] = [h.hello(tp=tp)[1] for tp in range(3)]
    for rank, value in zip(ranks, (100.0, 90.0, 10.0)):
        h.push(rank, tokens(value))
    h.clock.advance(10.0)
    h.push(ranks[0], tokens(100.0))
    h.push(ranks[1], tokens(90.0))
    # tp 2, far behind, is stale
    assert spreads(h) == {(TOKENS, group_key(), ("kv",)): pytest.approx(0.1)}
