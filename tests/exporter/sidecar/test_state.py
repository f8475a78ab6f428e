"""Unit tests of SidecarState: hellos, snapshots, rejections, liveness and the rollup contracts.

Every test drives the state with an injected clock; no sockets, no sleeps.
"""

from __future__ import annotations

import itertools
from typing import Sequence

import pytest

from exporter.catalog import Catalog, FamilySpec, MetricType, Semantics, default_catalog
from exporter.config import RanksConfig
from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.messages import Hello, HistogramSample, RankId, Sample, ScalarSample, Snapshot
from exporter.sidecar.derived import gauge_rollups
from exporter.sidecar.ranks import RankState, RankStatus
from exporter.sidecar.series import HistValue, RollupKey, StaticKey
from exporter.sidecar.state import SidecarState

STATIC: dict[str, str] = {"cache_type": "UnifiedRadixCache"}
STATIC_KEY: StaticKey = (("cache_type", "UnifiedRadixCache"),)

BYTES = "load_back_bytes_total"  # per_shard counter, no labels
TOKENS = "load_back_tokens_total"  # replicated counter, label pool
DURATION = "load_back_duration_seconds"  # per_shard histogram
PGS = "prefetch_pgs"  # replicated histogram
USED = "hicache_host_used_tokens"  # replicated gauge
SHARD_GAUGE = "test_shard_resident_bytes"  # per_shard gauge (added to the catalog by a fixture)


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    """A SidecarState with a fake clock and helpers that build protocol messages."""

    def __init__(self, catalog: Catalog | None = None, ranks_config: RanksConfig | None = None) -> None:
        self.clock = FakeClock()
        self.wall = FakeClock(1_764_400_000.0)
        self.catalog = catalog or default_catalog()
        self.state = SidecarState(
            self.catalog, ranks_config=ranks_config, clock=self.clock, wall_clock=self.wall
        )
        self._seq = itertools.count(1)

    def hello(
        self,
        tp: int = 0,
        pp: int = 0,
        dp: int = 0,
        epoch: str = "epoch-a",
        labels: dict[str, str] | None = None,
        connection: object | None = None,
    ) -> tuple[object, RankState]:
        """Say hello on a fresh connection token; return (connection, rank)."""
        conn = connection if connection is not None else object()
        msg = Hello(
            protocol=1,
            epoch=epoch,
            pid=4242,
            rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp),
            labels=dict(STATIC if labels is None else labels),
        )
        result = self.state.hello(conn, msg)
        return conn, result.rank

    def push(self, rank: RankState, *samples: ScalarSample | HistogramSample, seq: int | None = None):
        """Send one snapshot with a rising seq (or the given one)."""
        msg = Snapshot(seq=next(self._seq) if seq is None else seq, time=self.wall(), samples=list(samples))
        return self.state.snapshot(rank, msg)

    def counter(self, family: str, *label_values: str, static: StaticKey = STATIC_KEY) -> float | None:
        return self.state.rollups.counters.get(rollup_key(family, *label_values, static=static))

    def histogram(self, family: str, *label_values: str, static: StaticKey = STATIC_KEY):
        return self.state.rollups.histograms.get(rollup_key(family, *label_values, static=static))


def rollup_key(family: str, *label_values: str, static: StaticKey = STATIC_KEY) -> RollupKey:
    return (family, static, tuple(label_values))


def bytes_(value: float) -> ScalarSample:
    return ScalarSample(family=BYTES, labels={}, value=value)


def tokens(value: float, pool: str = "kv") -> ScalarSample:
    return ScalarSample(family=TOKENS, labels={"pool": pool}, value=value)


def used(value: float) -> ScalarSample:
    return ScalarSample(family=USED, labels={}, value=value)


def bounds(family: str) -> tuple[float, ...]:
    spec = default_catalog().get(family)
    assert spec.buckets is not None
    return spec.buckets


def hist(family: str, per_bucket: Sequence[int], total: float) -> HistogramSample:
    """A histogram sample from non-cumulative per-bucket counts (the last entry is the +Inf bucket)."""
    bnds = bounds(family)
    assert len(per_bucket) == len(bnds) + 1
    cumulative = list(itertools.accumulate(per_bucket))
    pairs: list[tuple[float | str, int]] = [(b, c) for b, c in zip((*bnds, "+Inf"), cumulative)]
    return HistogramSample(family=family, labels={}, buckets=pairs, sum=total, count=cumulative[-1])


def one_hot(family: str, index: int, n: int = 1) -> list[int]:
    counts = [0] * (len(bounds(family)) + 1)
    counts[index] = n
    return counts


def codes(result) -> list[ErrorCode]:
    return [r.code for r in result.rejections]


@pytest.fixture
def h() -> Harness:
    return Harness()


# --- counter rollups ---


def test_per_shard_counter_rollup_is_sum_of_ranks(h: Harness) -> None:
    values = {(0, 0): 100.0, (1, 0): 250.0, (0, 1): 7.0, (1, 1): 0.0}
    ranks = {key: h.hello(tp=key[0], pp=key[1])[1] for key in values}
    for key, rank in ranks.items():
        h.push(rank, bytes_(values[key]))
    assert h.counter(BYTES) == sum(values.values())
    h.push(ranks[(1, 0)], bytes_(300.0))
    assert h.counter(BYTES) == sum(values.values()) + 50.0


def test_replicated_counter_rollup_follows_one_leader_per_dp_group() -> None:
    """tp=2, pp=2, dp=2: each dp group counts its logical tokens once; groups are summed."""
    h = Harness()
    per_group = {0: 100.0, 1: 40.0}
    ranks: list[RankState] = []
    for dp, pp, tp in itertools.product(range(2), range(2), range(2)):
        ranks.append(h.hello(tp=tp, pp=pp, dp=dp)[1])
    for rank in ranks:
        h.push(rank, tokens(per_group[rank.dp_rank]), bytes_(10.0))
    total = h.counter(TOKENS, "kv")
    assert total == 140.0
    assert total != 8 * 70.0 and total != 4 * 140.0
    # per_shard on the same ranks is the plain sum.
    assert h.counter(BYTES) == 80.0
    # Only the leader (lowest (pp, tp)) of each group moves the rollup.
    leaders = {r.dp_rank: r for r in ranks if (r.pp_rank, r.tp_rank) == (0, 0)}
    for rank in ranks:
        if rank not in leaders.values():
            h.push(rank, tokens(per_group[rank.dp_rank] + 1000.0))
    assert h.counter(TOKENS, "kv") == 140.0
    h.push(leaders[0], tokens(130.0))
    h.push(leaders[1], tokens(45.0))
    assert h.counter(TOKENS, "kv") == 175.0


def test_replica_groups_are_told_apart_by_static_labels(h: Harness) -> None:
    """Two replica groups at dp_rank 0 with a distinguishing static label are two groups."""
    labels_a = {**STATIC, "replica": "a"}
    labels_b = {**STATIC, "replica": "b"}
    _, a = h.hello(labels=labels_a)
    _, b = h.hello(labels=labels_b)
    h.push(a, tokens(10.0))
    h.push(b, tokens(20.0))
    assert h.counter(TOKENS, "kv", static=tuple(sorted(labels_a.items()))) == 10.0
    assert h.counter(TOKENS, "kv", static=tuple(sorted(labels_b.items()))) == 20.0


# --- restart / reconnect ---


def test_restart_counts_new_epoch_from_zero_and_rollup_never_decreases(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(1000.0), tokens(500.0))
    h.state.disconnect(conn, rank)
    assert h.counter(BYTES) == 1000.0
    conn, again = h.hello(epoch="two")
    assert again is rank
    assert rank.restarts == 1
    assert rank.values == {}
    h.push(rank, bytes_(300.0), tokens(200.0))
    assert h.counter(BYTES) == 1300.0
    assert h.counter(TOKENS, "kv") == 700.0
    assert rank.values[(BYTES, ())] == 300.0
    h.push(rank, bytes_(400.0), tokens(250.0))
    assert h.counter(BYTES) == 1400.0
    assert h.counter(TOKENS, "kv") == 750.0


def test_restart_hello_result_flags(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.state.disconnect(conn, rank)
    msg = Hello(protocol=1, epoch="two", pid=1, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels=STATIC)
    result = h.state.hello(object(), msg)
    assert result.restart and not result.reconnect


def test_reconnect_same_epoch_continues_deltas(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, bytes_(1000.0), tokens(100.0), seq=5)
    h.state.disconnect(conn, rank)
    msg = Hello(protocol=1, epoch="one", pid=1, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels=STATIC)
    result = h.state.hello(object(), msg)
    assert result.reconnect and not result.restart
    assert rank.reconnects == 1 and rank.restarts == 0
    # A seq from before the reconnect is still old within the epoch.
    assert h.push(rank, bytes_(5000.0), seq=5).ignored
    h.push(rank, bytes_(1200.0), tokens(150.0), seq=6)
    assert h.counter(BYTES) == 1200.0
    assert h.counter(TOKENS, "kv") == 150.0


def test_duplicate_rank_refused_while_connected(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    for epoch in ("one", "two"):
        with pytest.raises(ProtocolError) as err:
            h.hello(epoch=epoch)
        assert err.value.code is ErrorCode.DUPLICATE_RANK
    # The refused hellos changed nothing: the holder keeps its connection and epoch.
    assert rank.connection is conn and rank.epoch == "one"
    # Another static label is another identity, not a duplicate.
    h.hello(epoch="one", labels={**STATIC, "replica": "b"})
    h.state.disconnect(conn, rank)
    h.hello(epoch="one")


def test_disconnect_of_an_old_connection_is_ignored(h: Harness) -> None:
    old, rank = h.hello(epoch="one")
    h.state.disconnect(old, rank)
    new, _ = h.hello(epoch="one")
    h.state.disconnect(old, rank)
    assert rank.connection is new


def test_stale_epoch_refused(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.state.disconnect(conn, rank)
    conn, _ = h.hello(epoch="two")
    h.state.disconnect(conn, rank)
    with pytest.raises(ProtocolError) as err:
        h.hello(epoch="one")
    assert err.value.code is ErrorCode.STALE_EPOCH
    assert rank.epoch == "two" and not rank.connected


def test_old_seq_ignored(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(100.0), seq=10)
    for seq in (10, 3):
        result = h.push(rank, bytes_(900.0), seq=seq)
        assert result.ignored and result.applied == 0
    assert h.counter(BYTES) == 100.0
    assert rank.values[(BYTES, ())] == 100.0
    assert not h.push(rank, bytes_(150.0), seq=11).ignored
    assert h.counter(BYTES) == 150.0


# --- sample rejections ---

GOOD_LB_BUCKETS = [(b, 0) for b in bounds(DURATION)]

ONE_FAST_LOAD = hist(DURATION, one_hot(DURATION, 0), 0.001).buckets
BAD_SAMPLES: list[tuple[str, ScalarSample | HistogramSample, ErrorCode]] = [
    ("unknown_family", ScalarSample(family="no_such_family_total", value=1.0), ErrorCode.UNKNOWN_FAMILY),
    ("missing_label", ScalarSample(family=TOKENS, labels={}, value=1.0), ErrorCode.WRONG_LABELS),
    ("extra_label", ScalarSample(family=TOKENS, labels={"pool": "kv", "x": "y"}, value=1.0), ErrorCode.WRONG_LABELS),
    ("other_label", ScalarSample(family=TOKENS, labels={"reason": "kv"}, value=1.0), ErrorCode.WRONG_LABELS),
    ("label_on_unlabelled", ScalarSample(family=BYTES, labels={"pool": "kv"}, value=1.0), ErrorCode.WRONG_LABELS),
    ("long_label_value", ScalarSample(family=TOKENS, labels={"pool": "x" * 129}, value=1.0), ErrorCode.WRONG_LABELS),
    ("scalar_for_histogram", ScalarSample(family=DURATION, value=1.0), ErrorCode.TYPE_MISMATCH),
    (
        "histogram_for_counter",
        HistogramSample(family=TOKENS, labels={"pool": "kv"}, buckets=[("+Inf", 1)], sum=1.0, count=1),
        ErrorCode.TYPE_MISMATCH,
    ),
    (
        "histogram_for_gauge",
        HistogramSample(family=USED, buckets=[("+Inf", 1)], sum=1.0, count=1),
        ErrorCode.TYPE_MISMATCH,
    ),
    ("counter_with_buckets_too", Sample(family=BYTES, value=1.0, buckets=[("+Inf", 1)], sum=1.0, count=1),
     ErrorCode.TYPE_MISMATCH),
    ("gauge_with_a_sum", Sample(family=USED, value=1.0, sum=1.0), ErrorCode.TYPE_MISMATCH),
    ("counter_without_value", Sample(family=BYTES), ErrorCode.TYPE_MISMATCH),
    ("histogram_with_value_too", Sample(family=DURATION, value=1.0, buckets=ONE_FAST_LOAD, sum=0.001, count=1),
     ErrorCode.TYPE_MISMATCH),
    ("histogram_without_sum", Sample(family=DURATION, buckets=ONE_FAST_LOAD, count=1), ErrorCode.TYPE_MISMATCH),
    ("histogram_without_count", Sample(family=DURATION, buckets=ONE_FAST_LOAD, sum=0.001), ErrorCode.TYPE_MISMATCH),
    ("negative_counter", ScalarSample(family=TOKENS, labels={"pool": "kv"}, value=-1.0), ErrorCode.INVALID_VALUE),
    (
        "wrong_bound",
        HistogramSample(
            family=DURATION, buckets=[(0.0015, 0), *GOOD_LB_BUCKETS[1:], ("+Inf", 0)], sum=0.0, count=0
        ),
        ErrorCode.BUCKET_MISMATCH,
    ),
    (
        "too_few_buckets",
        HistogramSample(family=DURATION, buckets=[*GOOD_LB_BUCKETS[:-1], ("+Inf", 0)], sum=0.0, count=0),
        ErrorCode.BUCKET_MISMATCH,
    ),
    (
        "missing_inf",
        HistogramSample(family=DURATION, buckets=[*GOOD_LB_BUCKETS, (2.0, 0)], sum=0.0, count=0),
        ErrorCode.BUCKET_MISMATCH,
    ),
    (
        "other_histograms_bounds",
        HistogramSample(
            family=DURATION,
            buckets=[*((b, 0) for b in bounds("hicache_backup_duration_seconds")), ("+Inf", 0)],
            sum=0.0,
            count=0,
        ),
        ErrorCode.BUCKET_MISMATCH,
    ),
    (
        "non_cumulative",
        HistogramSample(
            family=DURATION,
            buckets=[(bounds(DURATION)[0], 5), *((b, 3) for b in bounds(DURATION)[1:]), ("+Inf", 5)],
            sum=0.01,
            count=5,
        ),
        ErrorCode.BUCKET_MISMATCH,
    ),
    (
        "inf_not_count",
        HistogramSample(
            family=DURATION, buckets=[*((b, 2) for b in bounds(DURATION)), ("+Inf", 3)], sum=0.01, count=4
        ),
        ErrorCode.BUCKET_MISMATCH,
    ),
]


@pytest.mark.parametrize(("bad", "code"), [(s, c) for _, s, c in BAD_SAMPLES], ids=[n for n, _, _ in BAD_SAMPLES])
def test_bad_sample_rejected_rest_of_snapshot_applies(
    h: Harness, bad: ScalarSample | HistogramSample, code: ErrorCode
) -> None:
    _, rank = h.hello()
    result = h.push(rank, bytes_(10.0), bad, tokens(7.0), hist(DURATION, one_hot(DURATION, 2), 0.003))
    assert codes(result) == [code]
    assert result.applied == 3 and not result.ignored
    assert h.counter(BYTES) == 10.0
    assert h.counter(TOKENS, "kv") == 7.0
    assert h.histogram(DURATION).counts[-1] == 1.0
    # The rejected sample added no series and left the rank's other values as they were.
    assert set(rank.values) == {(BYTES, ()), (TOKENS, ("kv",)), (DURATION, ())}
    assert rank.values[(TOKENS, ("kv",))] == 7.0
    assert rank.values[(DURATION, ())] == HistValue(tuple(itertools.accumulate(one_hot(DURATION, 2))), 0.003)


def test_counter_decreased_within_epoch_rejected(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(100.0), tokens(50.0))
    result = h.push(rank, bytes_(90.0), tokens(60.0))
    assert codes(result) == [ErrorCode.COUNTER_DECREASED]
    assert result.applied == 1
    assert h.counter(BYTES) == 100.0
    assert h.counter(TOKENS, "kv") == 60.0
    assert rank.values[(BYTES, ())] == 100.0
    # The counter goes on from its last accepted value.
    h.push(rank, bytes_(130.0))
    assert h.counter(BYTES) == 130.0


def test_histogram_count_decreased_within_epoch_rejected(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 3, 4), 0.016))
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 3, 2), 0.008), bytes_(5.0))
    assert codes(result) == [ErrorCode.COUNTER_DECREASED]
    assert h.histogram(DURATION).counts[-1] == 4.0
    assert h.counter(BYTES) == 5.0


def test_series_limit_rejects_new_series_only() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=2))
    _, rank = h.hello()
    result = h.push(rank, bytes_(1.0), tokens(1.0, pool="kv"), tokens(1.0, pool="mamba"))
    assert codes(result) == [ErrorCode.SERIES_LIMIT]
    assert result.applied == 2
    assert (TOKENS, ("mamba",)) not in rank.values
    assert h.counter(TOKENS, "mamba") is None
    # Series the rank already has keep updating; new ones stay refused.
    result = h.push(rank, bytes_(3.0), tokens(4.0, pool="kv"), used(5.0))
    assert codes(result) == [ErrorCode.SERIES_LIMIT]
    assert h.counter(BYTES) == 3.0 and h.counter(TOKENS, "kv") == 4.0


# --- the per-rank route index (validated series, looked up by how samples name them) ---

DROPPED = "hicache_dropped_tokens_total"  # replicated counter, labels (reason, pool)


def dropped(value: float, **labels: str) -> ScalarSample:
    return ScalarSample(family=DROPPED, labels=labels, value=value)


def test_labels_sent_in_another_order_reach_the_same_series_and_are_not_indexed(h: Harness) -> None:
    _, rank = h.hello()
    assert h.push(rank, dropped(2.0, reason="host_pressure", pool="kv")).applied == 1
    assert h.push(rank, dropped(5.0, pool="kv", reason="host_pressure")).applied == 1
    assert rank.values == {(DROPPED, ("host_pressure", "kv")): 5.0}
    assert h.counter(DROPPED, "host_pressure", "kv") == 5.0
    assert list(rank.routes) == [(DROPPED, (("reason", "host_pressure"), ("pool", "kv")))]
    # A decrease is refused whichever order names the series.
    assert codes(h.push(rank, dropped(4.0, pool="kv", reason="host_pressure"))) == [ErrorCode.COUNTER_DECREASED]


def test_an_indexed_series_is_still_checked_on_every_push(h: Harness) -> None:
    _, rank = h.hello()
    assert h.push(rank, bytes_(1.0), hist(DURATION, one_hot(DURATION, 0), 0.001)).applied == 2
    assert len(rank.routes) == 2
    wrong_shape = ScalarSample(family=DURATION, labels={}, value=3.0)
    wrong_bounds = HistogramSample(family=BYTES, labels={}, buckets=[("+Inf", 1)], sum=1.0, count=1)
    assert codes(h.push(rank, wrong_shape, wrong_bounds)) == [ErrorCode.TYPE_MISMATCH, ErrorCode.TYPE_MISMATCH]
    assert codes(h.push(rank, bytes_(-1.0))) == [ErrorCode.INVALID_VALUE]
    assert codes(h.push(rank, bytes_(0.5))) == [ErrorCode.COUNTER_DECREASED]
    assert h.counter(BYTES) == 1.0


def test_unknown_families_and_wrong_labels_are_never_indexed(h: Harness) -> None:
    _, rank = h.hello()
    bad = [ScalarSample(family="no_such_family_total", labels={}, value=1.0),
           ScalarSample(family=TOKENS, labels={"pool": "kv", "extra": "x"}, value=1.0),
           ScalarSample(family=BYTES, labels={"pool": "kv"}, value=1.0)]
    for _ in range(2):
        assert codes(h.push(rank, *bad)) == [ErrorCode.UNKNOWN_FAMILY, ErrorCode.WRONG_LABELS, ErrorCode.WRONG_LABELS]
    assert rank.routes == {} and rank.values == {}


def test_route_index_is_bounded_by_max_series_per_rank() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=3))
    _, rank = h.hello()
    for pool in range(10):
        h.push(rank, tokens(1.0, pool=f"p{pool}"))
    assert len(rank.values) == 3 and len(rank.routes) == 3


def test_routes_outlive_a_restart_and_the_new_epoch_counts_from_zero(h: Harness) -> None:
    conn, rank = h.hello()
    h.push(rank, bytes_(10.0), tokens(4.0))
    h.state.disconnect(conn, rank)
    _, again = h.hello(epoch="epoch-b")
    assert again is rank and len(rank.routes) == 2
    h.push(rank, bytes_(3.0), tokens(1.0))
    assert h.counter(BYTES) == 13.0 and h.counter(TOKENS, "kv") == 5.0


def test_samples_that_change_places_between_pushes_reach_their_own_series(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, tokens(1.0, pool="kv"), tokens(10.0, pool="host"), bytes_(100.0))
    assert [entry[2].key for entry in rank.recent] == [(TOKENS, ("kv",)), (TOKENS, ("host",)), (BYTES, ())]
    # Swapped places: each position's remembered series no longer matches and is looked up again.
    h.push(rank, bytes_(101.0), tokens(12.0, pool="host"), tokens(3.0, pool="kv"))
    assert rank.values == {(TOKENS, ("kv",)): 3.0, (TOKENS, ("host",)): 12.0, (BYTES, ()): 101.0}
    assert [entry[2].key for entry in rank.recent] == [(BYTES, ()), (TOKENS, ("host",)), (TOKENS, ("kv",))]
    assert h.counter(TOKENS, "kv") == 3.0 and h.counter(TOKENS, "host") == 12.0 and h.counter(BYTES) == 101.0
    # Same place, other label value: a different series, still checked against its own history.
    assert codes(h.push(rank, bytes_(102.0), tokens(11.0, pool="kv"), tokens(12.0, pool="host"))) == []
    assert codes(h.push(rank, bytes_(102.0), tokens(11.0, pool="host"))) == [ErrorCode.COUNTER_DECREASED]


def test_a_remembered_place_still_checks_every_value(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, dropped(5.0, reason="host_pressure", pool="kv"), hist(DURATION, one_hot(DURATION, 1), 0.002))
    # Labels in another order match the remembered place (dict equality) and name the same series.
    assert h.push(rank, dropped(6.0, pool="kv", reason="host_pressure")).applied == 1
    assert codes(h.push(rank, dropped(4.0, reason="host_pressure", pool="kv"))) == [ErrorCode.COUNTER_DECREASED]
    assert codes(h.push(rank, ScalarSample(family=DURATION, labels={}, value=1.0))) == [ErrorCode.TYPE_MISMATCH]
    assert rank.values[(DROPPED, ("host_pressure", "kv"))] == 6.0


def test_one_series_at_two_places_in_one_snapshot_applies_in_order(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(1.0), bytes_(4.0))
    h.push(rank, bytes_(6.0), bytes_(9.0))
    assert rank.values == {(BYTES, ()): 9.0} and h.counter(BYTES) == 9.0
    assert codes(h.push(rank, bytes_(10.0), bytes_(8.0))) == [ErrorCode.COUNTER_DECREASED]


def test_remembered_places_are_bounded_by_max_series_per_rank() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=3))
    _, rank = h.hello()
    h.push(rank, *(tokens(1.0, pool=f"p{pool}") for pool in range(10)))
    assert len(rank.recent) == 3 and len(rank.values) == 3


def test_negative_histogram_bucket_count_rejected(h: Harness) -> None:
    """A negative bucket count would make a rollup bucket go down (and is not a valid histogram).

    The protocol model accepts any int as a bucket count (only `count` is ge=0), and the
    state's checks only look at bounds, cumulativeness and +Inf == count, so buckets such as
    [-5, -5, ..., 0] with count 0 pass and subtract 5 from every finite rollup bucket.
    """
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    before = list(h.histogram(DURATION).counts)
    bad = HistogramSample(
        family=DURATION, buckets=[*((b, -5) for b in bounds(DURATION)), ("+Inf", 0)], sum=0.0, count=0
    )
    _, other = h.hello(tp=1)
    result = h.push(other, bad, bytes_(1.0))
    assert [r.code for r in result.rejections] in ([ErrorCode.INVALID_VALUE], [ErrorCode.BUCKET_MISMATCH])
    after = h.histogram(DURATION).counts
    assert all(a >= b for a, b in zip(after, before)), f"rollup buckets went down: {before} -> {after}"


# --- hello validation ---


@pytest.mark.parametrize(
    "labels",
    [
        {"le": "x"},
        {"quantile": "x"},
        {"tp_rank": "0"},
        {"dp_rank": "0"},
        {"__meta": "x"},
        {"1abc": "x"},
        {"bad-name": "x"},
        {"pool": "kv"},
        {"reason": "x"},
        {f"l{i}": "v" for i in range(9)},
        {"cache_type": "x" * 129},
    ],
    ids=[
        "le", "quantile", "tp_rank", "dp_rank", "dunder", "digit_first", "dash",
        "family_label_pool", "family_label_reason", "too_many", "too_long_value",
    ],
)
def test_invalid_static_labels_refused(h: Harness, labels: dict[str, str]) -> None:
    with pytest.raises(ProtocolError) as err:
        h.hello(labels=labels)
    assert err.value.code is ErrorCode.INVALID_HELLO
    assert h.state.ranks == {}


def test_static_label_limits_are_inclusive(h: Harness) -> None:
    h.hello(labels={f"l{i}": "v" for i in range(8)})
    h.hello(labels={"cache_type": "x" * 128})
    assert len(h.state.ranks) == 2


def test_static_label_limits_follow_config() -> None:
    h = Harness(ranks_config=RanksConfig(max_static_labels=1, max_label_value_length=4))
    h.hello(labels={"a": "1234"})
    for labels in ({"a": "1", "b": "2"}, {"a": "12345"}):
        with pytest.raises(ProtocolError) as err:
            h.hello(labels=labels)
        assert err.value.code is ErrorCode.INVALID_HELLO


# --- leadership ---


def test_first_rank_of_leaderless_group_counts_from_zero(h: Harness) -> None:
    _, replica = h.hello(tp=1)
    h.push(replica, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    assert h.state.groups[replica.group].leader is replica


def test_takeover_snapshot_adds_nothing_then_next_delta_counts(h: Harness) -> None:
    """A lower-order rank joining a group with a leader takes over from its next delta."""
    _, replica = h.hello(tp=1)
    h.push(replica, tokens(100.0))
    _, low = h.hello(tp=0)
    h.push(low, tokens(100.0))  # takeover snapshot
    assert h.state.groups[low.group].leader is low
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(replica, tokens(180.0))  # no longer the leader
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(low, tokens(170.0))
    assert h.counter(TOKENS, "kv") == 170.0


def test_leader_change_on_disconnect_takes_over_from_next_delta(h: Harness) -> None:
    """When the leader leaves, the next rank's first snapshot as leader is only its baseline."""
    conn_low, low = h.hello(tp=0, epoch="low")
    _, high = h.hello(tp=1, epoch="high")
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.state.disconnect(conn_low, low)
    assert h.state.groups[low.group].leader is high
    h.push(high, tokens(150.0))  # takeover snapshot: adds nothing
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(high, tokens(170.0))  # its next delta counts
    assert h.counter(TOKENS, "kv") == 120.0
    h.hello(tp=0, epoch="low")
    h.push(low, tokens(180.0))  # takeover back: adds nothing
    assert h.state.groups[low.group].leader is low
    assert h.counter(TOKENS, "kv") == 120.0
    h.push(high, tokens(200.0))  # a replica again: not counted
    assert h.counter(TOKENS, "kv") == 120.0
    h.push(low, tokens(220.0))
    assert h.counter(TOKENS, "kv") == 160.0


def test_restarted_leader_takes_back_from_another_leader_without_copying(h: Harness) -> None:
    conn_low, low = h.hello(tp=0, epoch="low-1")
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.state.disconnect(conn_low, low)
    h.push(high, tokens(110.0))  # high leads meanwhile (baseline)
    h.push(high, tokens(125.0))
    assert h.counter(TOKENS, "kv") == 115.0
    h.hello(tp=0, epoch="low-2")
    h.push(low, tokens(30.0))  # takeover snapshot of the new epoch: nothing copied in
    assert h.counter(TOKENS, "kv") == 115.0
    h.push(low, tokens(50.0))
    assert h.counter(TOKENS, "kv") == 135.0


def test_restarted_leader_with_no_leader_in_between_counts_from_zero(h: Harness) -> None:
    """No other rank led while it was away: the new epoch's values count from zero."""
    conn_low, low = h.hello(tp=0, epoch="low-1")
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.state.disconnect(conn_low, low)
    h.hello(tp=0, epoch="low-2")
    h.push(low, tokens(30.0))
    assert h.counter(TOKENS, "kv") == 130.0


def test_replica_rejoining_a_leaderless_group_does_not_recount_the_leaders_span(h: Harness) -> None:
    """Nothing counted twice (DESIGN 6): a replica's delta spanning another leader's reign is not added.

    tp0 leads and counts 100 -> 300 while tp1 is away; tp0 leaves; tp1 reconnects (same
    epoch) into the now leaderless group and pushes 300. Its delta 100 -> 300 covers tokens the
    old leader already counted, so the rollup must stay 300 (it becomes 500 when the
    leaderless-group exception applies to a rank that is not counting from zero).
    """
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


def test_takeover_baseline_covers_series_missing_from_the_takeover_snapshot(h: Harness) -> None:
    """Nothing counted twice, with partial snapshots ("a snapshot updates the samples it names").

    tp0 leads and counts tokens up to 300; tp1 last pushed tokens=100. tp0 leaves; tp1's first
    snapshot as leader names only bytes, so it is tp1's baseline without a tokens value. When
    tp1 then pushes tokens=320, the logical total is 320: a rollup above that has counted tp1's
    stale 100 -> 300 span, which tp0 already counted.
    """
    conn_low, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.push(low, tokens(300.0))
    assert h.counter(TOKENS, "kv") == 300.0
    h.state.disconnect(conn_low, low)
    h.push(high, bytes_(1.0))  # takeover snapshot without the replicated series
    assert h.state.groups[high.group].leader is high
    h.push(high, tokens(320.0))
    assert h.counter(TOKENS, "kv") <= 320.0


def test_takeover_baseline_covers_series_the_new_leader_never_pushed(h: Harness) -> None:
    """Nothing counted twice, when the new leader names a replicated series only after it leads.

    tp0 leads and counts tokens=100. tp0 leaves; tp1 (which never pushed tokens: a lazily
    created series, or a partial snapshot) takes over with a snapshot naming only bytes, then
    pushes tokens=100 - the same 100 logical tokens tp0 already counted.
    """
    conn_low, low = h.hello(tp=0)
    h.push(low, tokens(100.0))
    assert h.counter(TOKENS, "kv") == 100.0
    h.state.disconnect(conn_low, low)
    _, high = h.hello(tp=1)
    h.push(high, bytes_(1.0))  # takeover snapshot without the replicated series
    assert h.state.groups[high.group].leader is high
    h.push(high, tokens(100.0))
    assert h.counter(TOKENS, "kv") <= 100.0


def test_sole_rank_reconnecting_counts_its_gap(h: Harness) -> None:
    """With no other replica, the gap between a rank's pushes was counted by nobody: it counts."""
    conn, rank = h.hello()
    h.push(rank, tokens(100.0))
    h.state.disconnect(conn, rank)
    assert h.state.groups[rank.group].leader is None
    h.hello()
    h.push(rank, tokens(160.0))
    assert h.counter(TOKENS, "kv") == 160.0


def test_per_shard_counts_every_rank_whatever_the_leadership(h: Harness) -> None:
    conn_low, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(high, bytes_(10.0))
    h.push(low, bytes_(20.0))  # takeover snapshot: per_shard still counts
    assert h.counter(BYTES) == 30.0
    h.state.disconnect(conn_low, low)
    h.push(high, bytes_(15.0))
    assert h.counter(BYTES) == 35.0


# --- liveness ---


def test_stale_then_expired_transitions() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    _, rank = h.hello()
    h.push(rank, bytes_(100.0), tokens(40.0))
    h.clock.advance(9.5)
    h.state.tick()
    assert rank.status is RankStatus.LIVE and rank in h.state.live_ranks()
    h.clock.advance(0.5)
    h.state.tick()
    assert rank.status is RankStatus.STALE
    assert rank not in h.state.live_ranks()
    assert rank in h.state.exposed_ranks()
    h.clock.advance(20.0)
    h.state.tick()
    assert rank.status is RankStatus.EXPIRED
    assert rank not in h.state.exposed_ranks()
    assert h.counter(BYTES) == 100.0 and h.counter(TOKENS, "kv") == 40.0
    # A push brings it back, continuing its deltas.
    h.push(rank, bytes_(110.0))
    assert rank.status is RankStatus.LIVE and rank in h.state.exposed_ranks()
    assert h.counter(BYTES) == 110.0


def test_departed_rank_expires_but_keeps_its_rollup_contribution() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
    conn, gone = h.hello(tp=0)
    _, kept = h.hello(tp=1)
    h.push(gone, bytes_(100.0), tokens(70.0))
    h.push(kept, bytes_(1.0), tokens(70.0))
    h.state.disconnect(conn, gone)
    assert gone.status is RankStatus.DEPARTED and gone in h.state.exposed_ranks()
    for _ in range(4):
        h.clock.advance(9.0)
        h.push(kept, bytes_(1.0 + h.clock.now % 7))
        h.state.tick()
    assert gone.status is RankStatus.EXPIRED
    assert h.state.exposed_ranks() == [kept]
    assert h.counter(BYTES) >= 101.0
    assert h.counter(TOKENS, "kv") == 70.0


def test_stale_leader_hands_over_and_takes_back_from_next_delta() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=300.0))
    _, low = h.hello(tp=0)
    _, high = h.hello(tp=1)
    h.push(low, tokens(100.0))
    h.push(high, tokens(100.0))
    h.clock.advance(6.0)
    h.push(high, tokens(110.0))  # replica: not counted
    h.clock.advance(5.0)
    h.state.tick()  # low silent 11 s: stale
    assert low.stale and not high.stale
    assert h.state.groups[low.group].leader is high
    h.push(high, tokens(130.0))  # takeover snapshot
    assert h.counter(TOKENS, "kv") == 100.0
    h.push(high, tokens(150.0))
    assert h.counter(TOKENS, "kv") == 120.0
    h.push(low, tokens(135.0))  # back: a takeover snapshot, adds nothing
    assert h.state.groups[low.group].leader is low
    assert h.counter(TOKENS, "kv") == 120.0
    h.push(low, tokens(140.0))
    assert h.counter(TOKENS, "kv") == 125.0


def test_tick_without_changes_keeps_generation() -> None:
    h = Harness()
    _, rank = h.hello()
    h.push(rank, bytes_(1.0))
    generation = h.state.generation
    h.clock.advance(1.0)
    h.state.tick()
    assert h.state.generation == generation


# --- gauges ---


@pytest.fixture
def gauge_harness() -> Harness:
    spec = FamilySpec(
        name=SHARD_GAUGE, type=MetricType.GAUGE, semantics=Semantics.PER_SHARD, help="Resident bytes of a shard."
    )
    catalog = Catalog(families=(*default_catalog().families, spec))
    return Harness(catalog=catalog, ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))


def shard(value: float) -> ScalarSample:
    return ScalarSample(family=SHARD_GAUGE, labels={}, value=value)


def test_per_shard_gauge_rollup_sums_live_ranks(gauge_harness: Harness) -> None:
    h = gauge_harness
    conns: dict[tuple[int, int], object] = {}
    ranks: dict[tuple[int, int], RankState] = {}
    for tp, dp in itertools.product(range(2), range(2)):
        conns[(tp, dp)], ranks[(tp, dp)] = h.hello(tp=tp, dp=dp)
        h.push(ranks[(tp, dp)], shard(10.0 * (1 + tp + 2 * dp)))
    key = rollup_key(SHARD_GAUGE)
    assert gauge_rollups(h.state)[key] == 10.0 + 20.0 + 30.0 + 40.0
    # Gauges are current values: a lower value replaces, it is not a decrease error.
    result = h.push(ranks[(0, 0)], shard(1.0))
    assert result.rejections == []
    assert gauge_rollups(h.state)[key] == 91.0
    h.state.disconnect(conns[(1, 1)], ranks[(1, 1)])
    assert gauge_rollups(h.state)[key] == 51.0
    h.clock.advance(10.0)
    for rank in (ranks[(0, 0)], ranks[(0, 1)]):
        h.push(rank, shard(5.0))
    h.state.tick()  # (1, 0) is now stale
    assert gauge_rollups(h.state)[key] == 10.0


def test_replicated_gauge_rollup_is_leader_of_each_group(gauge_harness: Harness) -> None:
    h = gauge_harness
    conns: dict[tuple[int, int], object] = {}
    ranks: dict[tuple[int, int], RankState] = {}
    for dp, tp in itertools.product(range(2), range(2)):
        conns[(tp, dp)], ranks[(tp, dp)] = h.hello(tp=tp, dp=dp)
        h.push(ranks[(tp, dp)], used(100.0 * (dp + 1) + tp))
    key = rollup_key(USED)
    assert gauge_rollups(h.state)[key] == 100.0 + 200.0
    h.state.disconnect(conns[(0, 1)], ranks[(0, 1)])  # group dp=1 falls to tp=1
    assert gauge_rollups(h.state)[key] == 100.0 + 201.0
    h.state.disconnect(conns[(1, 1)], ranks[(1, 1)])  # group dp=1 has no live rank
    assert gauge_rollups(h.state)[key] == 100.0


# --- histograms ---


def test_per_shard_histogram_rollup_sums_buckets_sum_and_count(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    h.push(a, hist(DURATION, one_hot(DURATION, 0, 3), 0.003))
    h.push(b, hist(DURATION, one_hot(DURATION, 18, 2), 4.0))
    acc = h.histogram(DURATION)
    n = len(bounds(DURATION)) + 1
    assert acc.counts == [3.0] * (n - 1) + [5.0]
    assert acc.sum == pytest.approx(4.003)
    a_counts = [a + b for a, b in zip(one_hot(DURATION, 0, 3), one_hot(DURATION, 5, 4))]
    h.push(a, hist(DURATION, a_counts, 0.03))
    acc = h.histogram(DURATION)
    assert acc.counts == [3.0] * 5 + [7.0] * (n - 6) + [9.0]
    assert acc.sum == pytest.approx(4.03)


def test_replicated_histogram_rollup_follows_leaders(h: Harness) -> None:
    for dp in range(2):
        for tp in range(2):
            _, rank = h.hello(tp=tp, dp=dp)
            h.push(rank, hist(PGS, one_hot(PGS, 1, 10 * (dp + 1) + tp), 1.0))
    acc = h.histogram(PGS)
    assert acc.counts == [0.0] + [30.0] * 5
    assert acc.sum == pytest.approx(2.0)


def test_histogram_restart_counts_new_epoch_from_zero(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, hist(DURATION, one_hot(DURATION, 2, 5), 0.015))
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    h.push(rank, hist(DURATION, one_hot(DURATION, 2, 1), 0.003))
    acc = h.histogram(DURATION)
    assert acc.counts[-1] == 6.0 and acc.counts[2] == 6.0
    assert acc.sum == pytest.approx(0.018)


def _rollup_snapshot(state: SidecarState) -> tuple[dict[RollupKey, float], dict[RollupKey, list[float]]]:
    return dict(state.rollups.counters), {k: list(v.counts) for k, v in state.rollups.histograms.items()}


def _never_decreased(
    before: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]],
    after: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]],
) -> bool:
    counters_ok = all(after[0].get(k, -1.0) >= v for k, v in before[0].items())
    hists_ok = all(all(x >= y for x, y in zip(after[1][k], v)) for k, v in before[1].items())
    return counters_ok and hists_ok


def test_rollups_never_decrease_across_a_mixed_scenario(h: Harness) -> None:
    """A scripted scenario mixing restarts, takeovers and rejections; checked after each step."""
    conn0, r0 = h.hello(tp=0, epoch="a0")
    conn1, r1 = h.hello(tp=1, epoch="a1")
    previous = _rollup_snapshot(h.state)

    def check() -> None:
        nonlocal previous
        now = _rollup_snapshot(h.state)
        assert _never_decreased(previous, now)
        previous = now

    h.push(r1, tokens(50.0), bytes_(5.0)); check()
    h.push(r0, tokens(60.0), bytes_(6.0)); check()
    h.push(r0, tokens(10.0), bytes_(1.0)); check()  # both rejected: decreased
    h.state.disconnect(conn0, r0); check()
    conn0, _ = h.hello(tp=0, epoch="b0"); check()
    h.push(r0, tokens(1.0), bytes_(1.0)); check()
    h.push(r1, tokens(70.0), bytes_(9.0)); check()
    h.state.disconnect(conn1, r1); check()
    h.push(r0, tokens(2.0), bytes_(2.0)); check()
    assert h.counter(TOKENS, "kv") == 52.0 and h.counter(BYTES) == 17.0


def test_histogram_sum_moving_without_observations_rejected(h: Harness) -> None:
    """With the same counts the sum cannot change; a lower sum would pull the rollup _sum down."""
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.001), bytes_(1.0))
    assert [r.code for r in result.rejections] == [ErrorCode.INVALID_VALUE]
    assert h.histogram(DURATION).sum == 0.002
    assert h.counter(BYTES) == 1.0
