"""RollupLedger: the rollup rules of its module docstring, with exact expected values.

* per_shard counters and histograms: the sum of the ranks' positions;
* replicated ones: per replica group, the watermark (the furthest position any replica
  reported; per bucket and for the sum of histograms), summed over groups;
* positions continue across a rank's restarts;
* gauges: per_shard sums current ranks, replicated takes each group's lowest current replica;
* a histogram whose layout differs from its rollup's is left out and counted.

Most replicated scenarios are chosen so that summing the replicas, or following any one
replica (such as the old leader rule's lowest live rank), gives another number.
"""

from __future__ import annotations

import itertools

import pytest

from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.sidecar.core.keys import HistValue, RollupKey
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.state import SidecarState
from tests.exporter.sidecar.harness import (
    BYTES,
    DURATION,
    PGS,
    SHARD_GAUGE,
    STATIC,
    STATIC_KEY,
    TOKENS,
    USED,
    Harness,
    bounds,
    bytes_,
    codes,
    hist,
    layout,
    one_hot,
    rollup_key,
    shard,
    static_of,
    tokens,
    used,
)

# --- per_shard counters ---


def test_per_shard_counter_rollup_is_sum_of_ranks(h: Harness) -> None:
    values = {(0, 0): 100.0, (1, 0): 250.0, (0, 1): 7.0, (1, 1): 0.0}
    ranks = {key: h.hello(tp=key[0], pp=key[1])[1] for key in values}
    for key, rank in ranks.items():
        h.push(rank, bytes_(values[key]))
    assert h.counter(BYTES) == sum(values.values())
    h.push(ranks[(1, 0)], bytes_(300.0))
    assert h.counter(BYTES) == sum(values.values()) + 50.0


def test_per_shard_counts_every_rank_whoever_comes_and_goes(h: Harness) -> None:
    conn_low, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(high, bytes_(10.0))
    h.push(low, bytes_(20.0))
    assert h.counter(BYTES) == 30.0
    h.state.disconnect(conn_low, low)
    h.push(high, bytes_(15.0))
    assert h.counter(BYTES) == 35.0


# --- replicated counters: one watermark per replica group ---


def test_replicated_counter_rollup_counts_each_dp_group_once() -> None:
    """tp=2, pp=2, dp=2: each dp group counts its logical tokens once; groups are summed."""
    h = Harness()
    per_group = {0: 100.0, 1: 40.0}
    ranks: dict[tuple[int, int, int], RankState] = {}
    for dp, pp, tp in itertools.product(range(2), range(2), range(2)):
        ranks[(dp, pp, tp)] = h.hello(tp=tp, pp=pp, dp=dp)[1]
    for rank in ranks.values():
        h.push(rank, tokens(per_group[rank.dp_rank]), bytes_(10.0))
    total = h.counter(TOKENS, "kv")
    assert total == 140.0
    assert total != 8 * 70.0 and total != 4 * 140.0
    # per_shard on the same ranks is the plain sum.
    assert h.counter(BYTES) == 80.0
    # The highest-order replica of dp 0 reports first: the rollup follows the furthest replica,
    # not the lowest-order one (which still says 100).
    h.push(ranks[(0, 1, 1)], tokens(130.0))
    assert h.counter(TOKENS, "kv") == 170.0
    h.push(ranks[(0, 0, 0)], tokens(120.0))  # behind the group's watermark: no change
    assert h.counter(TOKENS, "kv") == 170.0
    h.push(ranks[(1, 0, 0)], tokens(45.0))
    assert h.counter(TOKENS, "kv") == 175.0
    for key, rank in ranks.items():  # every replica catches up: nothing more
        h.push(rank, tokens(130.0 if key[0] == 0 else 45.0))
    assert h.counter(TOKENS, "kv") == 175.0
    marks = h.state.ledger.watermarks
    assert marks[(0, STATIC_KEY)][(TOKENS, ("kv",))].value == 130.0  # type: ignore[union-attr]
    assert marks[(1, STATIC_KEY)][(TOKENS, ("kv",))].value == 45.0  # type: ignore[union-attr]


def test_replicas_reporting_at_different_instants(h: Harness) -> None:
    """Three replicas push one logical count at interleaved instants, each at its own pace."""
    r = [h.hello(tp=tp)[1] for tp in range(3)]
    steps = [(2, 10.0, 10.0), (0, 20.0, 20.0), (1, 15.0, 20.0), (2, 30.0, 30.0), (0, 25.0, 30.0), (1, 30.0, 30.0),
             (1, 40.0, 40.0), (0, 40.0, 40.0)]
    for tp, value, expected in steps:
        h.push(r[tp], tokens(value))
        assert h.counter(TOKENS, "kv") == expected, (tp, value)
    # Summing the replicas would say 110; following tp 0 would have said 25 at step five.


def test_first_replica_of_a_group_counts_its_whole_value(h: Harness) -> None:
    _, replica = h.hello(tp=1)
    h.push(replica, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0


def test_a_lower_order_replica_joining_changes_nothing(h: Harness) -> None:
    """The old rule handed the group to tp 0 here and ignored tp 1's 180."""
    _, replica = h.hello(tp=1)
    h.push(replica, tokens(100.0))
    _, low = h.hello(tp=0)
    h.push(low, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(replica, tokens(180.0))
    assert h.counter(TOKENS, "kv") == 180.0
    h.push(low, tokens(170.0))
    assert h.counter(TOKENS, "kv") == 180.0
    h.push(low, tokens(190.0))
    assert h.counter(TOKENS, "kv") == 190.0


def test_hand_over_after_a_replica_ran_ahead_and_left_keeps_the_furthest_value() -> None:
    """The case the old leader rule lost a third of the tokens on.

    tp 0 and tp 1 both report 200. tp 1 reports 300 first, then its server stops: tp 1
    leaves, and tp 0 leaves without having pushed its 300. The leader rule followed tp 0
    (the lowest live rank) and kept 200; the watermark keeps 300, whoever expires, and
    counts nothing twice when tp 0 comes back and catches up.
    """
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn0, tp0 = h.hello(tp=0)
    conn1, tp1 = h.hello(tp=1)
    h.push(tp0, tokens(200.0))
    h.push(tp1, tokens(200.0))
    assert h.counter(TOKENS, "kv") == 200.0
    h.push(tp1, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.state.disconnect(conn1, tp1)
    assert h.counter(TOKENS, "kv") == 300.0
    h.state.disconnect(conn0, tp0)
    h.clock.advance(31.0)
    assert tp0.expired and tp1.expired
    assert h.counter(TOKENS, "kv") == 300.0
    h.hello(tp=0)  # same epoch: a reconnect
    h.push(tp0, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.push(tp0, tokens(310.0))
    assert h.counter(TOKENS, "kv") == 310.0


def test_hand_over_to_the_next_replica_loses_nothing(h: Harness) -> None:
    """tp 0 leaves; tp 1 goes on. The old rule took tp 1's first value as a baseline (150 -> 100)."""
    conn_low, low = h.hello(tp=0, epoch="low")
    _, high = h.hello(tp=1, epoch="high")
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.state.disconnect(conn_low, low)
    h.push(high, tokens(150.0))
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(high, tokens(170.0))
    assert h.counter(TOKENS, "kv") == 170.0
    h.hello(tp=0, epoch="low")  # back, same epoch: it has missed 100 -> 170
    h.push(low, tokens(180.0))
    assert h.counter(TOKENS, "kv") == 180.0
    h.push(high, tokens(200.0))
    assert h.counter(TOKENS, "kv") == 200.0
    h.push(low, tokens(220.0))
    assert h.counter(TOKENS, "kv") == 220.0


def test_replica_rejoining_does_not_recount_what_another_replica_counted(h: Harness) -> None:
    """Nothing counted twice: tp 1's step 100 -> 300 covers tokens tp 0 already reported."""
    conn_low, low = h.hello(tp=0)
    conn_high, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.state.disconnect(conn_high, high)
    h.push(low, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.state.disconnect(conn_low, low)
    h.hello(tp=1)
    h.push(high, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.push(high, tokens(320.0))
    assert h.counter(TOKENS, "kv") == 320.0


def test_a_replicated_series_missing_from_a_snapshot_is_not_recounted(h: Harness) -> None:
    """Partial snapshots: tp 1's last tokens value is 100 while tp 0 reported 300; tp 0 leaves,
    tp 1 pushes bytes only, then tokens=320. The logical total is 320."""
    conn_low, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.push(low, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.state.disconnect(conn_low, low)
    h.push(high, bytes_(1.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.push(high, tokens(320.0))
    assert h.counter(TOKENS, "kv") == 320.0


def test_a_series_a_replica_names_only_later_is_not_recounted(h: Harness) -> None:
    """tp 1 never pushed tokens before tp 0 left; its first tokens=100 are the same 100 tp 0 reported."""
    conn_low, low = h.hello(tp=0)
    h.push(low, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.state.disconnect(conn_low, low)
    _, high = h.hello(tp=1)
    h.push(high, bytes_(1.0))
    h.push(high, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(high, tokens(101.0))
    assert h.counter(TOKENS, "kv") == 101.0


def test_sole_rank_reconnecting_counts_its_gap(h: Harness) -> None:
    """With no other replica, the gap between a rank's pushes was counted by nobody: it counts."""
    conn, rank = h.hello()
    h.push(rank, tokens(100.0))
    h.state.disconnect(conn, rank)
    h.hello()
    h.push(rank, tokens(160.0))
    assert h.counter(TOKENS, "kv") == 160.0


def test_stale_replica_neither_holds_back_nor_adds() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=300.0))
    _, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.clock.advance(6.0)
    h.push(high, tokens(110.0))
    assert h.counter(TOKENS, "kv") == 110.0
    h.clock.advance(5.0)
    # low silent 11 s: stale
    assert low.stale and not high.stale
    h.push(high, tokens(130.0))
    assert h.counter(TOKENS, "kv") == 130.0
    h.push(high, tokens(150.0))
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(low, tokens(135.0))  # back, behind the watermark
    assert not low.stale
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(low, tokens(140.0))
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(low, tokens(160.0))
    assert h.counter(TOKENS, "kv") == 160.0


# --- restarts: positions continue ---


def test_restart_continues_from_the_last_value_and_rollup_never_decreases(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(1000.0), tokens(500.0))
    h.state.disconnect(conn, rank)
    assert h.counter(BYTES) == 1000.0
    conn, again = h.hello(epoch="two")
    assert again is rank
    h.push(rank, bytes_(300.0), tokens(200.0))
    assert h.counter(BYTES) == 1300.0
    assert h.counter(TOKENS, "kv") == 700.0
    assert rank.values[(BYTES, ())] == 300.0
    assert rank.positions[(BYTES, ())] == 1300.0 and rank.positions[(TOKENS, ("kv",))] == 700.0
    h.push(rank, bytes_(400.0), tokens(250.0))
    assert h.counter(BYTES) == 1400.0
    assert h.counter(TOKENS, "kv") == 750.0


def test_a_series_an_epoch_skipped_keeps_its_position_across_the_next_restart(h: Harness) -> None:
    """Epoch one counts a token, epoch two reports only bytes (its token series not made yet, as a
    lazily made reason), epoch three counts a token again: the replica's position is 2, not 1."""
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(10.0), tokens(1.0))
    h.state.disconnect(conn, rank)
    conn, _ = h.hello(epoch="two")
    h.push(rank, bytes_(5.0))
    h.state.disconnect(conn, rank)
    h.hello(epoch="three")
    h.push(rank, bytes_(1.0), tokens(1.0))
    assert rank.positions[(TOKENS, ("kv",))] == 2.0
    assert h.counter(TOKENS, "kv") == 2.0 and h.counter(BYTES) == 16.0


def test_restarted_replica_continues_its_own_position(h: Harness) -> None:
    """tp 0 restarts while tp 1 runs on: tp 0's new epoch continues from its own 100."""
    conn_low, low = h.hello(tp=0, epoch="low-1")
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.state.disconnect(conn_low, low)
    h.push(high, tokens(110.0))
    h.push(high, tokens(125.0))
    assert h.counter(TOKENS, "kv") == 125.0
    h.hello(tp=0, epoch="low-2")
    h.push(low, tokens(30.0))  # position 100 + 30
    assert low.positions[(TOKENS, ("kv",))] == 130.0
    assert h.counter(TOKENS, "kv") == 130.0
    h.push(low, tokens(50.0))
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(high, tokens(160.0))
    assert h.counter(TOKENS, "kv") == 160.0


def test_restarted_replica_with_nobody_else_reporting_continues(h: Harness) -> None:
    conn_low, low = h.hello(tp=0, epoch="low-1")
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.state.disconnect(conn_low, low)
    h.hello(tp=0, epoch="low-2")
    h.push(low, tokens(30.0))
    assert h.counter(TOKENS, "kv") == 130.0


def test_whole_group_restart_takes_the_furthest_replica(h: Harness) -> None:
    """Both replicas restart; tp 1's new epoch reports first and furthest."""
    conns = {}
    ranks = {}
    for tp in (0, 1):
        conns[tp], ranks[tp] = h.hello(tp=tp, epoch=f"{tp}-a")
        h.push(ranks[tp], tokens(100.0))
    for tp in (0, 1):
        h.state.disconnect(conns[tp], ranks[tp])
        h.hello(tp=tp, epoch=f"{tp}-b")
    h.push(ranks[1], tokens(40.0))
    assert h.counter(TOKENS, "kv") == 140.0
    h.push(ranks[0], tokens(25.0))
    assert h.counter(TOKENS, "kv") == 140.0
    h.push(ranks[0], tokens(50.0))
    assert h.counter(TOKENS, "kv") == 150.0
    h.push(ranks[1], tokens(50.0))
    assert h.counter(TOKENS, "kv") == 150.0


def _rollup_snapshot(state: SidecarState) -> tuple[dict[RollupKey, float], dict[RollupKey, list[int]]]:
    return dict(state.ledger.counters), {k: list(v.counts) for k, v in state.ledger.histograms.items()}


def _never_decreased(
    before: tuple[dict[RollupKey, float], dict[RollupKey, list[int]]],
    after: tuple[dict[RollupKey, float], dict[RollupKey, list[int]]],
) -> bool:
    counters_ok = all(after[0].get(k, -1.0) >= v for k, v in before[0].items())
    hists_ok = all(all(x >= y for x, y in zip(after[1][k], v)) for k, v in before[1].items())
    return counters_ok and hists_ok


def test_rollups_never_decrease_across_a_mixed_scenario(h: Harness) -> None:
    """A scripted scenario mixing restarts, hand-overs and rejections; checked after each step."""
    conn0, r0 = h.hello(tp=0, epoch="a0")
    conn1, r1 = h.hello(tp=1, epoch="a1")
    previous = _rollup_snapshot(h.state)

    def check() -> None:
        nonlocal previous
        now = _rollup_snapshot(h.state)
        assert _never_decreased(previous, now)
        previous = now

    h.push(r1, tokens(50.0), bytes_(5.0)); check()  # noqa: E702
    h.push(r0, tokens(60.0), bytes_(6.0)); check()  # noqa: E702
    assert codes(h.push(r0, tokens(10.0), bytes_(1.0))) == [ErrorCode.COUNTER_DECREASED] * 2; check()  # noqa: E702
    h.state.disconnect(conn0, r0); check()  # noqa: E702
    conn0, _ = h.hello(tp=0, epoch="b0"); check()  # noqa: E702
    h.push(r0, tokens(1.0), bytes_(1.0)); check()  # noqa: E702  r0 at 61 and 7
    h.push(r1, tokens(70.0), bytes_(9.0)); check()  # noqa: E702
    h.state.disconnect(conn1, r1); check()  # noqa: E702
    h.push(r0, tokens(2.0), bytes_(2.0)); check()  # noqa: E702  r0 at 62 and 8
    # tokens: r1's 70 is the furthest (the replicas' sum would be 132, r0 alone 62);
    # bytes: r0's 8 plus r1's 9.
    assert h.counter(TOKENS, "kv") == 70.0 and h.counter(BYTES) == 17.0


# --- gauges ---


def test_per_shard_gauge_rollup_sums_live_ranks(gauge_harness: Harness) -> None:
    h = gauge_harness
    conns: dict[tuple[int, int], object] = {}
    ranks: dict[tuple[int, int], RankState] = {}
    for tp, dp in itertools.product(range(2), range(2)):
        conns[(tp, dp)], ranks[(tp, dp)] = h.hello(tp=tp, dp=dp)
        h.push(ranks[(tp, dp)], shard(10.0 * (1 + tp + 2 * dp)))
    key = rollup_key(SHARD_GAUGE)
    assert h.gauges()[key] == 10.0 + 20.0 + 30.0 + 40.0
    # Gauges are current values: a lower value replaces, it is not a decrease error.
    result = h.push(ranks[(0, 0)], shard(1.0))
    assert result.rejections == []
    assert h.gauges()[key] == 91.0
    h.state.disconnect(conns[(1, 1)], ranks[(1, 1)])
    assert h.gauges()[key] == 51.0
    h.clock.advance(10.0)
    for rank in (ranks[(0, 0)], ranks[(0, 1)]):
        h.push(rank, shard(5.0))
    # (1, 0) is now stale
    assert h.gauges()[key] == 10.0


def test_replicated_gauge_rollup_is_lowest_current_replica_of_each_group(gauge_harness: Harness) -> None:
    h = gauge_harness
    conns: dict[tuple[int, int], object] = {}
    ranks: dict[tuple[int, int], RankState] = {}
    for dp, tp in itertools.product(range(2), range(2)):
        conns[(tp, dp)], ranks[(tp, dp)] = h.hello(tp=tp, dp=dp)
        h.push(ranks[(tp, dp)], used(100.0 * (dp + 1) + tp))
    key = rollup_key(USED)
    assert h.gauges()[key] == 100.0 + 200.0
    h.state.disconnect(conns[(0, 1)], ranks[(0, 1)])  # group dp=1 falls to tp=1
    assert h.gauges()[key] == 100.0 + 201.0
    h.state.disconnect(conns[(1, 1)], ranks[(1, 1)])  # group dp=1 has no live rank
    assert h.gauges()[key] == 100.0


def test_replicated_gauge_skips_replicas_that_are_not_current_or_lack_the_series(gauge_harness: Harness) -> None:
    h = gauge_harness
    key = rollup_key(USED)
    _, tp2 = h.hello(tp=2)
    h.push(tp2, used(12.0))
    _, pp1 = h.hello(tp=0, pp=1)  # order (1, 0): after every pp 0 replica
    h.push(pp1, used(99.0))
    assert h.gauges()[key] == 12.0
    conn1, tp1 = h.hello(tp=1)
    h.push(tp1, bytes_(1.0))  # current, but without the gauge
    assert h.gauges()[key] == 12.0
    h.push(tp1, used(11.0))
    assert h.gauges()[key] == 11.0
    h.state.disconnect(conn1, tp1)
    h.hello(tp=1)  # reconnected, not pushed since: its gauge is not current
    assert h.gauges()[key] == 12.0
    h.push(tp1, bytes_(2.0))  # any push makes its last gauge value current again
    assert h.gauges()[key] == 11.0
    h.clock.advance(10.0)
    h.push(pp1, used(98.0))
    # tp1 and tp2 are stale
    assert h.gauges()[key] == 98.0


def test_replicated_gauge_groups_are_told_apart_by_static_labels(gauge_harness: Harness) -> None:
    h = gauge_harness
    a, b = {**STATIC, "replica": "a"}, {**STATIC, "replica": "b"}
    for labels, value in ((a, 1.0), (b, 2.0)):
        _, rank = h.hello(labels=labels)
        h.push(rank, used(value))
    gauges = h.gauges()
    assert gauges[rollup_key(USED, static=static_of(a))] == 1.0
    assert gauges[rollup_key(USED, static=static_of(b))] == 2.0


def test_a_restart_clears_gauges_until_the_new_epoch_sends_them(gauge_harness: Harness) -> None:
    h = gauge_harness
    conn, rank = h.hello(epoch="one")
    h.push(rank, used(5.0), shard(6.0))
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    h.push(rank, bytes_(1.0))
    assert h.gauges() == {}


# --- histograms ---


def test_per_shard_histogram_rollup_sums_buckets_sum_and_count(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, hist(DURATION, one_hot(DURATION, 0, 3), 0.003))
    h.push(b, hist(DURATION, one_hot(DURATION, 18, 2), 4.0))
    acc = h.histogram(DURATION)
    assert acc is not None
    n = len(bounds(DURATION)) + 1
    assert acc.bounds == layout(DURATION)
    assert acc.counts == [3] * (n - 1) + [5]
    assert acc.sum == pytest.approx(4.003)
    a_counts = [a + b for a, b in zip(one_hot(DURATION, 0, 3), one_hot(DURATION, 5, 4))]
    h.push(a, hist(DURATION, a_counts, 0.03))
    acc = h.histogram(DURATION)
    assert acc is not None
    assert acc.counts == [3] * 5 + [7] * (n - 6) + [9]
    assert acc.sum == pytest.approx(4.03)


def test_replicated_histogram_rollup_is_the_groups_watermarks_summed(h: Harness) -> None:
    for dp in range(2):
        for tp in range(2):
            _, rank = h.hello(tp=tp, dp=dp)
            h.push(rank, hist(PGS, one_hot(PGS, 1, 10 * (dp + 1) + tp), 1.0))
    acc = h.histogram(PGS)
    assert acc is not None
    # dp 0: max(10, 11); dp 1: max(20, 21). Every rank summed would be 62, the tp 0 ranks 30.
    assert acc.counts == [0] + [32] * 5
    assert acc.sum == pytest.approx(2.0)


def test_replicated_histogram_watermark_is_per_bucket_and_for_the_sum(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, hist(PGS, [3, 0, 0, 0, 0, 0], 3.0))  # cumulative 3 3 3 3 3 3
    h.push(b, hist(PGS, [1, 0, 4, 0, 0, 0], 2.5))  # cumulative 1 1 5 5 5 5
    acc = h.histogram(PGS)
    assert acc is not None
    assert acc.counts == [3, 3, 5, 5, 5, 5] and acc.sum == 3.0
    h.push(b, hist(PGS, [1, 0, 5, 0, 0, 0], 3.5))  # cumulative 1 1 6 6 6 6: b now leads the sum too
    assert acc.counts == [3, 3, 6, 6, 6, 6] and acc.sum == 3.5
    h.push(a, hist(PGS, [3, 0, 4, 0, 0, 0], 4.0))  # cumulative 3 3 7 7 7 7
    assert acc.counts == [3, 3, 7, 7, 7, 7] and acc.sum == 4.0


def test_histogram_restart_continues_from_the_last_value(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, hist(DURATION, one_hot(DURATION, 2, 5), 0.015))
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    h.push(rank, hist(DURATION, one_hot(DURATION, 2, 1), 0.003))
    acc = h.histogram(DURATION)
    assert acc is not None
    assert acc.counts[-1] == 6 and acc.counts[2] == 6 and acc.counts[1] == 0
    assert acc.sum == pytest.approx(0.018)
    assert rank.positions[(DURATION, ())] == pytest.approx(0.018)  # a histogram's position is its sum's


def test_replicated_histogram_restart_continues_the_replicas_position(h: Harness) -> None:
    conn_a, a = h.hello(tp=0, epoch="a-1")
    _, b = h.hello(tp=1)
    h.push(a, hist(PGS, one_hot(PGS, 1, 4), 8.0))
    h.push(b, hist(PGS, one_hot(PGS, 1, 4), 8.0))
    h.state.disconnect(conn_a, a)
    h.hello(tp=0, epoch="a-2")
    h.push(a, hist(PGS, one_hot(PGS, 1, 1), 2.0))  # a's position: 5 observations, sum 10
    acc = h.histogram(PGS)
    assert acc is not None
    assert acc.counts == [0] + [5] * 5 and acc.sum == 10.0
    h.push(b, hist(PGS, one_hot(PGS, 1, 5), 10.0))
    assert acc.counts == [0] + [5] * 5 and acc.sum == 10.0
    h.push(b, hist(PGS, one_hot(PGS, 1, 6), 12.0))
    assert acc.counts == [0] + [6] * 5 and acc.sum == 12.0


# --- histogram layouts ---

CUSTOM = (0.5, 1.0)


def test_a_rank_in_another_layout_is_left_out_of_the_rollup_and_counted(h: Harness) -> None:
    _, a = h.hello(tp=0)
    conn_b, b = h.hello(tp=1, epoch="b-1")
    h.push(a, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    assert codes(h.push(b, hist(DURATION, [1, 1, 1], 2.0, finite=CUSTOM))) == []
    acc = h.histogram(DURATION)
    assert acc is not None and acc.bounds == layout(DURATION)
    assert acc.counts[-1] == 2 and acc.sum == 0.002
    assert h.state.ledger.layout_conflicts == {DURATION: 1}
    assert b.values[(DURATION, ())] == HistValue((0.5, 1.0, "+Inf"), (1, 2, 3), 2.0)  # still exposed per rank
    h.push(b, hist(DURATION, [2, 1, 1], 2.2, finite=CUSTOM))  # counted once per rank, series and epoch
    assert h.state.ledger.layout_conflicts == {DURATION: 1}
    assert acc.counts[-1] == 2 and acc.sum == 0.002
    h.push(a, hist(DURATION, one_hot(DURATION, 0, 3), 0.003))
    assert acc.counts[-1] == 3 and acc.sum == 0.003
    # A new epoch in the same other layout is counted again...
    h.state.disconnect(conn_b, b)
    conn_b, _ = h.hello(tp=1, epoch="b-2")
    h.push(b, hist(DURATION, [1, 0, 0], 0.1, finite=CUSTOM))
    assert h.state.ledger.layout_conflicts == {DURATION: 2}
    assert acc.counts[-1] == 3
    # ...and one in the rollup's layout is in the rollup again.
    h.state.disconnect(conn_b, b)
    h.hello(tp=1, epoch="b-3")
    h.push(b, hist(DURATION, one_hot(DURATION, 1, 4), 0.008))
    assert h.state.ledger.layout_conflicts == {DURATION: 2}
    assert acc.counts == [3] + [7] * (len(bounds(DURATION)))
    assert acc.sum == pytest.approx(0.011)


def test_the_rollup_takes_the_layout_of_the_first_value_it_saw(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, hist(DURATION, [1, 1, 1], 2.0, finite=CUSTOM))
    h.push(b, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    acc = h.histogram(DURATION)
    assert acc is not None
    assert acc.bounds == (0.5, 1.0, "+Inf") and acc.counts == [1, 2, 3] and acc.sum == 2.0
    assert h.state.ledger.layout_conflicts == {DURATION: 1}


def test_a_replica_in_another_layout_is_left_out_of_its_groups_watermark(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, hist(PGS, one_hot(PGS, 1, 4), 8.0))
    h.push(b, hist(PGS, [9, 0, 0], 90.0, finite=(2.0, 3.0)))
    acc = h.histogram(PGS)
    assert acc is not None
    assert acc.counts == [0] + [4] * 5 and acc.sum == 8.0
    assert h.state.ledger.layout_conflicts == {PGS: 1}


def test_rollups_of_other_static_labels_have_their_own_layouts(h: Harness) -> None:
    other = {"cache_type": "HiRadixCache"}
    _, a = h.hello()
    _, b = h.hello(labels=other)
    h.push(a, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    h.push(b, hist(DURATION, [1, 1, 1], 2.0, finite=CUSTOM))
    assert h.state.ledger.layout_conflicts == {}
    theirs = h.histogram(DURATION, static=static_of(other))
    assert theirs is not None and theirs.bounds == (0.5, 1.0, "+Inf") and theirs.counts == [1, 2, 3]



def test_context_parallel_peers_count_tokens_once_and_sum_bytes(h: Harness) -> None:
    """CP peers of one dp group are replicas: their tokens are one watermark, their bytes a sum."""
    peers = [h.hello(tp=tp, cp=cp)[1] for cp in (0, 1) for tp in (0, 1)]
    for i, rank in enumerate(peers):
        h.push(rank, tokens(300.0), bytes_(1000.0 + i))
    assert h.counter(TOKENS, "kv") == 300.0  # not 4 x 300
    assert h.counter(BYTES) == 4006.0
    h.push(peers[3], tokens(350.0))  # the last CP peer runs ahead
    assert h.counter(TOKENS, "kv") == 350.0


def test_a_label_derived_from_the_tp_rank_does_not_split_a_replica_group(h: Harness) -> None:
    """SGLang derives moe_ep_rank from the global tp rank: four replicas of one dp group under two
    expert-parallel ranks are still one group, for counters and gauges alike."""
    ranks = [h.hello(tp=tp, labels={**STATIC, "moe_ep_rank": str(tp // 2)})[1] for tp in range(4)]
    for rank in ranks:
        h.push(rank, tokens(100.0), used(30.0))
    assert h.counter(TOKENS, "kv") == 100.0  # not 200: one replica per dp group
    assert h.gauges()[rollup_key(USED)] == 30.0
    assert {dict(r.static)["moe_ep_rank"] for r in ranks} == {"0", "1"}  # per-rank series keep the label
    assert len(h.state.registry.groups()) == 1


# --- the series budget: a rollup cell weighs the labels its line writes (keys.series_cost) ---


def test_a_rollup_cell_weighs_its_own_labels_once_however_many_ranks_feed_it(h: Harness) -> None:
    """A rollup line writes the static labels its group shares and the family's own values: not the rank
    axes, nor a derived label (moe_ep_rank), which the ranks' lines write and are weighed by."""
    derived = [h.hello(tp=tp, labels={**STATIC, "moe_ep_rank": str(tp) + "e" * 999})[1] for tp in (0, 1)]
    for rank in derived:
        assert rank.label_chars == 36 + 31 + 1015 and rank.shared_chars == 31
        assert codes(h.push(rank, tokens(1.0), bytes_(1.0), hist(PGS, one_hot(PGS, 0), 1.0))) == []
        assert rank.cost == 5 + 3 + 17  # tokens: 1,092 x 2 lines; bytes: 1,082; PGS: 1,082 x 8 lines
    budget = h.state.registry.budget
    assert (budget.per_rank, budget.rollup) == (2 * 25, 3)  # three cells of short labels, one each
    # Long shared labels weigh the rollup: cache_type of 1,000 characters writes 1,014, with pool="kv" 1,024.
    shared = {"cache_type": "c" * 1000}
    for tp in (0, 1):
        _, rank = h.hello(tp=tp, labels=shared)
        assert codes(h.push(rank, tokens(1.0), bytes_(1.0), hist(PGS, one_hot(PGS, 0), 1.0))) == []
    assert budget.rollup == 3 + 2 + 2 + 16  # tokens 1,024; bytes 1,014; PGS 1,014 x 8 lines: once for both ranks
