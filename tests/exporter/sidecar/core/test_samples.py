"""SampleReader: every sample rejection, the route index and by-place caches, series limits and
histogram bucket layouts."""

from __future__ import annotations

import pytest

from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.protocol.messages import BucketBound, HistogramSample, Sample, ScalarSample
from exporter.sidecar.core.keys import BUCKETS_PER_SERIES, HistValue, histogram_cost
from exporter.sidecar.core.ranks import OLDER_POSITIONS_KEPT
from exporter.sidecar.core.samples import below
from tests.exporter.sidecar.harness import (
    BYTES,
    DROPPED,
    DURATION,
    PGS,
    TOKENS,
    USED,
    Harness,
    bounds,
    bytes_,
    codes,
    cumulative,
    dropped,
    hist,
    layout,
    one_hot,
    tokens,
    used,
)

# --- sample rejections ---

GOOD_LB_BUCKETS = [(b, 0) for b in bounds(DURATION)]
ONE_FAST_LOAD = hist(DURATION, one_hot(DURATION, 0), 0.001).buckets


def empty_hist(buckets: list[tuple[BucketBound, int]]) -> Sample:
    return HistogramSample(family=DURATION, buckets=buckets, sum=0.0, count=0)


BAD_SAMPLES: list[tuple[str, Sample, ErrorCode]] = [
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
    ("negative_bucket_count", empty_hist([(0.001, -1), ("+Inf", 0)]), ErrorCode.INVALID_VALUE),
    ("missing_inf", empty_hist([*GOOD_LB_BUCKETS, (2.0, 0)]), ErrorCode.BUCKET_MISMATCH),
    ("inf_first", empty_hist([("+Inf", 0), *GOOD_LB_BUCKETS]), ErrorCode.BUCKET_MISMATCH),
    ("inf_twice", empty_hist([*GOOD_LB_BUCKETS, ("+Inf", 0), ("+Inf", 0)]), ErrorCode.BUCKET_MISMATCH),
    ("unsorted_bounds", empty_hist([(0.002, 0), (0.001, 0), ("+Inf", 0)]), ErrorCode.BUCKET_MISMATCH),
    ("repeated_bound", empty_hist([(0.001, 0), (0.001, 0), ("+Inf", 0)]), ErrorCode.BUCKET_MISMATCH),
    ("lowercase_inf", empty_hist([(0.001, 0), ("+inf", 0)]), ErrorCode.BUCKET_MISMATCH),
    ("nan_bound_string", empty_hist([("NaN", 0), ("+Inf", 0)]), ErrorCode.BUCKET_MISMATCH),
    ("huge_count", HistogramSample(family=DURATION, buckets=[(1.0, 10**400), ("+Inf", 10**400)], sum=1.0, count=10**400),
     ErrorCode.INVALID_VALUE),
    ("count_past_2_53", HistogramSample(family=PGS, buckets=[("+Inf", 2**53 + 1)], sum=1.0, count=2**53 + 1),
     ErrorCode.INVALID_VALUE),
    ("huge_sum", HistogramSample(family=DURATION, buckets=[("+Inf", 1)], sum=1e300, count=1), ErrorCode.INVALID_VALUE),
    ("huge_counter", ScalarSample(family=BYTES, value=1e300), ErrorCode.INVALID_VALUE),
    ("huge_negative_gauge", ScalarSample(family=USED, value=-1e300), ErrorCode.INVALID_VALUE),
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
def test_bad_sample_rejected_rest_of_snapshot_applies(h: Harness, bad: Sample, code: ErrorCode) -> None:
    _, rank = h.hello()
    result = h.push(rank, bytes_(10.0), bad, tokens(7.0), hist(DURATION, one_hot(DURATION, 2), 0.003))
    assert codes(result) == [code]
    assert result.applied == 3 and not result.ignored
    assert h.counter(BYTES) == 10.0
    assert h.counter(TOKENS, "kv") == 7.0
    acc = h.histogram(DURATION)
    assert acc is not None and acc.counts[-1] == 1
    # The rejected sample added no series and left the rank's other values as they were.
    assert set(rank.values) == {(BYTES, ()), (TOKENS, ("kv",)), (DURATION, ())}
    assert rank.values[(TOKENS, ("kv",))] == 7.0
    assert rank.values[(DURATION, ())] == HistValue(layout(DURATION), tuple(cumulative(one_hot(DURATION, 2))), 0.003)


def test_a_rejection_is_plain_data_naming_its_family(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(100.0))
    result = h.push(rank, bytes_(90.0))
    assert len(result.rejections) == 1
    code, message = result.rejections[0]
    assert type(result.rejections[0]) is tuple
    assert code is ErrorCode.COUNTER_DECREASED and isinstance(message, str)
    assert BYTES in message and "100.0" in message and "90.0" in message


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


def test_a_gauge_may_go_down(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, used(100.0))
    result = h.push(rank, used(-3.5))
    assert codes(result) == [] and rank.values[(USED, ())] == -3.5


def test_histogram_count_decreased_within_epoch_rejected(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 3, 4), 0.016))
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 3, 2), 0.008), bytes_(5.0))
    assert codes(result) == [ErrorCode.COUNTER_DECREASED]
    acc = h.histogram(DURATION)
    assert acc is not None and acc.counts[-1] == 4
    assert h.counter(BYTES) == 5.0


def test_histogram_sum_decreased_within_epoch_rejected(h: Harness) -> None:
    """New observations with a lower sum: the rollup _sum would go down."""
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 3, 4), 0.016))
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 3, 5), 0.010), bytes_(5.0))
    assert codes(result) == [ErrorCode.COUNTER_DECREASED]
    acc = h.histogram(DURATION)
    assert acc is not None and acc.counts[-1] == 4 and acc.sum == 0.016
    assert rank.values[(DURATION, ())].sum == 0.016  # type: ignore[union-attr]
    assert h.counter(BYTES) == 5.0


def test_histogram_sum_moving_without_observations_rejected(h: Harness) -> None:
    """With the same counts the sum cannot change; a lower sum would pull the rollup _sum down."""
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    result = h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.001), bytes_(1.0))
    assert codes(result) == [ErrorCode.INVALID_VALUE]
    acc = h.histogram(DURATION)
    assert acc is not None and acc.sum == 0.002
    assert h.counter(BYTES) == 1.0


def test_an_unchanged_histogram_with_a_wrong_count_is_still_rejected(h: Harness) -> None:
    """The idle-histogram fast path (same layout, counts and sum) still checks +Inf == count."""
    _, rank = h.hello()
    good = hist(DURATION, one_hot(DURATION, 0, 2), 0.002)
    h.push(rank, good)
    wrong_count = HistogramSample(family=DURATION, buckets=good.buckets, sum=0.002, count=7)  # type: ignore[arg-type]
    assert codes(h.push(rank, wrong_count)) == [ErrorCode.BUCKET_MISMATCH]


def test_negative_histogram_bucket_count_rejected(h: Harness) -> None:
    """A negative bucket count would make a rollup bucket go down (and is not a valid histogram).

    The protocol model accepts any int as a bucket count (only `count` is ge=0), so buckets
    such as [-5, -5, ..., 0] with count 0 reach the reader, which must refuse them.
    """
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    acc = h.histogram(DURATION)
    assert acc is not None
    before = list(acc.counts)
    bad = HistogramSample(
        family=DURATION, buckets=[*((b, -5) for b in bounds(DURATION)), ("+Inf", 0)], sum=0.0, count=0
    )
    _, other = h.hello(tp=1)
    result = h.push(other, bad, bytes_(1.0))
    assert codes(result) == [ErrorCode.INVALID_VALUE]
    after = acc.counts
    assert all(a >= b for a, b in zip(after, before)), f"rollup buckets went down: {before} -> {after}"
    assert (DURATION, ()) not in other.values


# --- what the reader hands the ledger ---


def test_read_returns_one_update_per_series_that_moved(h: Harness) -> None:
    _, rank = h.hello()
    reader = h.state.reader
    first = [bytes_(10.0), used(3.0), hist(DURATION, one_hot(DURATION, 1, 2), 0.004)]
    updates, rejections = reader.read(rank, first)
    assert rejections == []
    assert [(route.key, amount, None if deltas is None else list(deltas)) for route, amount, deltas in updates] == [
        ((BYTES, ()), 10.0, None),
        ((DURATION, ()), 0.004, cumulative(one_hot(DURATION, 1, 2))),
    ]  # a gauge needs no update: its rollup is read from current values
    more = [a + b for a, b in zip(one_hot(DURATION, 1, 2), one_hot(DURATION, 4))]
    second = [bytes_(25.0), used(1.0), hist(DURATION, more, 0.009)]
    updates, rejections = reader.read(rank, second)
    assert rejections == []
    assert [(route.key, amount, None if deltas is None else list(deltas)) for route, amount, deltas in updates] == [
        ((BYTES, ()), 15.0, None),
        ((DURATION, ()), pytest.approx(0.005), cumulative(one_hot(DURATION, 4))),
    ]
    assert rank.values[(USED, ())] == 1.0
    assert reader.read(rank, second) == ([], [])  # nothing moved


# --- series limits ---


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


def test_series_total_limit_counts_every_ranks_series_and_the_rollups() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_total=5))
    _, a = h.hello(tp=0)
    # b's labels write 62 characters on each of the histogram's 8 lines (496 of LABEL_CHARS_PER_UNIT): its
    # buckets weigh it (the harness's cache_type writes 67, which would make it 2: test_series_cost below).
    _, b = h.hello(tp=1, labels={"cache_type": "HiRadixCache"})
    assert codes(h.push(a, bytes_(1.0), used(1.0))) == []  # 2 rank series, 1 rollup series (gauges have none)
    result = h.push(b, hist(PGS, one_hot(PGS, 0), 1.0), tokens(1.0))  # the histogram (6 buckets: 1) makes it 5
    assert codes(result) == [ErrorCode.SERIES_LIMIT]
    assert set(b.values) == {(PGS, ())}
    assert h.state.series_budget().per_rank == 3 and h.state.registry.budget.rollup == 2
    assert codes(h.push(a, bytes_(2.0))) == []  # known series still update


def test_a_restart_frees_its_epochs_series_but_not_the_rollups() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_total=5))
    conn, a = h.hello(tp=0, epoch="one")
    _, b = h.hello(tp=1)
    h.push(a, bytes_(1.0), tokens(1.0))  # 2 + 2; a new series needs room for itself and a rollup
    assert codes(h.push(b, bytes_(1.0))) == [ErrorCode.SERIES_LIMIT]
    h.state.disconnect(conn, a)
    h.hello(tp=0, epoch="two")
    assert h.state.series_budget().per_rank == 0 and h.state.registry.budget.rollup == 2  # rollups keep a's part
    assert codes(h.push(b, bytes_(1.0))) == []  # its rollup series exists already
    assert codes(h.push(a, bytes_(1.0), tokens(1.0))) == [ErrorCode.SERIES_LIMIT]
    assert h.state.series_budget().per_rank == 2


def test_epoch_churn_with_new_label_values_stays_within_the_total() -> None:
    """Each epoch bringing new series once grew rollups, positions and interned keys without bound."""
    limit = 60
    h = Harness(ranks_config=RanksConfig(max_series_total=limit))
    conn, rank = h.hello(tp=0, epoch="e0")
    refused = 0
    for epoch in range(1, 30):
        result = h.push(rank, *(tokens(1.0, pool=f"e{epoch}-{i}") for i in range(10)))
        refused += codes(result).count(ErrorCode.SERIES_LIMIT)
        budget = h.state.registry.budget
        assert budget.per_rank + budget.rollup <= limit
        # this epoch's series, the ended epoch's (carried on) and at most OLDER_POSITIONS_KEPT older ones
        assert len(rank.positions) <= 10 + 10 + OLDER_POSITIONS_KEPT
        h.state.disconnect(conn, rank)
        conn, rank = h.hello(tp=0, epoch=f"e{epoch}")
    assert refused > 0  # counted as rejections, not silently held
    assert len(h.state.reader._interned) < 4 * limit  # refused series are not interned first


# --- the per-rank route index (validated series, looked up by how samples name them) ---


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
    assert rank.routes == {} and rank.values == {} and rank.by_place == []


def test_route_index_is_bounded_by_max_series_per_rank() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=3))
    _, rank = h.hello()
    for pool in range(10):
        h.push(rank, tokens(1.0, pool=f"p{pool}"))
    assert len(rank.values) == 3 and len(rank.routes) == 3


def test_routes_outlive_a_restart_and_the_new_epoch_is_checked_from_scratch(h: Harness) -> None:
    conn, rank = h.hello()
    h.push(rank, bytes_(10.0), tokens(4.0))
    h.state.disconnect(conn, rank)
    _, again = h.hello(epoch="epoch-b")
    assert again is rank and len(rank.routes) == 2
    # Lower values are no decrease in a new epoch; the rollups continue from the last epoch's values.
    assert codes(h.push(rank, bytes_(3.0), tokens(1.0))) == []
    assert h.counter(BYTES) == 13.0 and h.counter(TOKENS, "kv") == 5.0
    assert codes(h.push(rank, bytes_(2.0))) == [ErrorCode.COUNTER_DECREASED]


def test_samples_that_change_places_between_pushes_reach_their_own_series(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, tokens(1.0, pool="kv"), tokens(10.0, pool="host"), bytes_(100.0))
    assert [entry[2].key for entry in rank.by_place] == [(TOKENS, ("kv",)), (TOKENS, ("host",)), (BYTES, ())]
    # Swapped places: each place's remembered series no longer matches and is looked up again.
    h.push(rank, bytes_(101.0), tokens(12.0, pool="host"), tokens(3.0, pool="kv"))
    assert rank.values == {(TOKENS, ("kv",)): 3.0, (TOKENS, ("host",)): 12.0, (BYTES, ()): 101.0}
    assert [entry[2].key for entry in rank.by_place] == [(BYTES, ()), (TOKENS, ("host",)), (TOKENS, ("kv",))]
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
    assert len(rank.by_place) == 3 and len(rank.values) == 3


def test_ranks_with_the_same_static_labels_share_routes(h: Harness) -> None:
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    _, other = h.hello(labels={"cache_type": "HiRadixCache"})
    for rank in (a, b, other):
        h.push(rank, tokens(1.0))
    route_a, route_b, route_other = (r.by_place[0][2] for r in (a, b, other))
    assert route_a is route_b
    assert route_other is not route_a and route_other.key is route_a.key  # same series key, other rollup
    assert route_other.rollup_key != route_a.rollup_key


# --- histogram bucket layouts ---

CUSTOM = (0.5, 1.0)  # finite bounds of a layout that is not the catalog's


def test_a_valid_non_default_layout_is_accepted(h: Harness) -> None:
    _, rank = h.hello()
    result = h.push(rank, hist(DURATION, [1, 2, 3], 4.5, finite=CUSTOM))
    assert codes(result) == []
    assert rank.values[(DURATION, ())] == HistValue((0.5, 1.0, "+Inf"), (1, 3, 6), 4.5)
    assert rank.values[(DURATION, ())].count == 6  # type: ignore[union-attr]
    # Its next push, in the same layout, moves it on.
    assert codes(h.push(rank, hist(DURATION, [2, 2, 3], 4.9, finite=CUSTOM))) == []
    assert rank.values[(DURATION, ())] == HistValue((0.5, 1.0, "+Inf"), (2, 4, 7), 4.9)


def test_a_layout_of_only_inf_is_valid(h: Harness) -> None:
    _, rank = h.hello()
    assert codes(h.push(rank, HistogramSample(family=DURATION, buckets=[("+Inf", 3)], sum=0.5, count=3))) == []
    assert rank.values[(DURATION, ())] == HistValue(("+Inf",), (3,), 0.5)


def test_series_with_one_layout_share_one_layout_object(h: Harness) -> None:
    ranks = [h.hello(tp=tp)[1] for tp in range(3)]
    h.push(ranks[0], hist(DURATION, [1, 0, 0], 0.1, finite=CUSTOM))
    h.push(ranks[1], hist(DURATION, [0, 1, 0], 0.7, finite=CUSTOM))
    h.push(ranks[2], hist(DURATION, one_hot(DURATION, 0), 0.001))
    first, second, default = (r.values[(DURATION, ())].bounds for r in ranks)  # type: ignore[union-attr]
    assert first is second and first == (0.5, 1.0, "+Inf")
    assert default == layout(DURATION)


@pytest.mark.parametrize("other", [CUSTOM, (*bounds(DURATION), 2.0), bounds(DURATION)[:-1]],
                         ids=["custom", "one_more", "one_fewer"])
def test_a_layout_change_within_an_epoch_is_refused(h: Harness, other: tuple[float, ...]) -> None:
    _, rank = h.hello()
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    moved = hist(DURATION, one_hot(DURATION, 0, 5, finite=other), 0.005, finite=other)
    result = h.push(rank, moved, bytes_(1.0))
    assert codes(result) == [ErrorCode.BUCKET_MISMATCH]
    assert rank.values[(DURATION, ())] == HistValue(layout(DURATION), tuple(cumulative(one_hot(DURATION, 0, 2))), 0.002)
    acc = h.histogram(DURATION)
    assert acc is not None and acc.counts[-1] == 2 and acc.sum == 0.002
    assert h.counter(BYTES) == 1.0


def test_a_change_from_a_custom_layout_to_the_catalogs_is_refused_too(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, hist(DURATION, [1, 0, 0], 0.1, finite=CUSTOM))
    assert codes(h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))) == [ErrorCode.BUCKET_MISMATCH]
    assert rank.values[(DURATION, ())].bounds == (0.5, 1.0, "+Inf")  # type: ignore[union-attr]


def test_a_new_layout_is_accepted_after_a_restart(h: Harness) -> None:
    conn, rank = h.hello(epoch="one")
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, 2), 0.002))
    h.state.disconnect(conn, rank)
    h.hello(epoch="two")
    result = h.push(rank, hist(DURATION, [1, 1, 1], 2.0, finite=CUSTOM))
    assert codes(result) == []
    assert rank.values[(DURATION, ())] == HistValue((0.5, 1.0, "+Inf"), (1, 2, 3), 2.0)
    # ...and it is that epoch's layout from then on.
    assert codes(h.push(rank, hist(DURATION, one_hot(DURATION, 0, 3), 2.5))) == [ErrorCode.BUCKET_MISMATCH]


def test_every_histogram_family_takes_its_own_layout(h: Harness) -> None:
    _, rank = h.hello()
    samples = [hist(family, one_hot(family, 0), 0.001) for family in (DURATION, "hicache_backup_duration_seconds")]
    samples.append(hist("prefetch_pgs", [1, 0, 0], 1.0, finite=(2.0, 3.0)))
    assert codes(h.push(rank, *samples)) == []
    assert [rank.values[(s.family, ())].bounds for s in samples] == [  # type: ignore[union-attr]
        layout(DURATION), layout("hicache_backup_duration_seconds"), (2.0, 3.0, "+Inf"),
    ]



# --- buckets count toward the series limits (issue 19, finding 8) ---

WIDE = [float(i + 1) for i in range(1023)]  # 1,024 buckets with +Inf: the most the protocol takes


def test_a_histogram_weighs_one_series_plus_one_per_eight_buckets() -> None:
    assert [histogram_cost(layout(family)) for family in (PGS, DURATION)] == [1, 3]  # 6 and 19 buckets
    assert histogram_cost((*WIDE, "+Inf")) == 1 + 1024 // BUCKETS_PER_SERIES == 129


# Labels writing at most 64 characters on a line keep a 1,024-bucket histogram (1,026 lines) at its buckets'
# weight, 129 (the harness's write 67: 135, test_series_cost below).
SHORT = {"cache_type": "c"}


def test_wide_histograms_fill_the_series_total_by_their_buckets() -> None:
    """40 ranks x 9 histograms x 1,024 buckets counted as 369 series made a 38 MiB /metrics."""
    h = Harness(ranks_config=RanksConfig(max_series_total=300))
    _, rank = h.hello(labels=SHORT)
    wide = [hist(family, one_hot(family, 0, finite=WIDE), 1.0, finite=WIDE) for family in (DURATION, PGS)]
    result = h.push(rank, *wide, bytes_(1.0))
    assert codes(result) == [ErrorCode.SERIES_LIMIT]  # the second needs 2 x 129 more
    assert "max_series_total=300" in result.rejections[0][1] and "counts 129" in result.rejections[0][1]
    budget = h.state.registry.budget
    assert (budget.per_rank, budget.rollup) == (129 + 1, 129 + 1) and rank.cost == 130
    assert set(rank.values) == {(DURATION, ()), (BYTES, ())}


def test_wide_histograms_fill_max_series_per_rank_by_their_buckets() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=200))
    _, rank = h.hello(labels=SHORT)
    result = h.push(rank, *(hist(family, one_hot(family, 0, finite=WIDE), 1.0, finite=WIDE) for family in (DURATION, PGS)))
    assert codes(result) == [ErrorCode.SERIES_LIMIT] and "max_series_per_rank=200" in result.rejections[0][1]
    assert set(rank.values) == {(DURATION, ())} and rank.cost == 129


def test_a_restart_frees_a_histograms_whole_weight(h: Harness) -> None:
    conn, rank = h.hello(epoch="one", labels=SHORT)
    h.push(rank, hist(DURATION, one_hot(DURATION, 0, finite=WIDE), 1.0, finite=WIDE), bytes_(1.0))
    budget = h.state.registry.budget
    assert budget.per_rank == rank.cost == 130
    h.state.disconnect(conn, rank)
    h.hello(epoch="two", labels=SHORT)
    assert budget.per_rank == rank.cost == 0 and budget.rollup == 130  # the rollups keep theirs


# --- labels weigh what their lines write (keys.series_cost) ---

# The longest static labels the limits allow: 8 values sharing max_static_label_chars (2,304), with the rank axes
# 2,388 characters a line; a family's own values at max_family_label_value_length (128).
LONGEST = {f"l{i}": chr(97 + i) * 288 for i in range(8)}


def longest_dropped(j: int, value: float = 1.0) -> Sample:
    """hicache_dropped_tokens_total (replicated: its line and its group's spread line) with own values of 128:
    2,662 characters a line with LONGEST, 11 units; its rollup cell's 2,626 on one line, 6."""
    return dropped(value, reason=f"{j:03d}" + "r" * 125, pool="p" * 128)


def test_long_labels_fill_the_series_total_sooner() -> None:
    short = Harness(ranks_config=RanksConfig(max_series_total=100))
    _, rank = short.hello()
    assert codes(short.push(rank, *(dropped(1.0, reason=f"{j:03d}", pool="kv") for j in range(12)))) == []
    assert (short.state.registry.budget.per_rank, short.state.registry.budget.rollup) == (12, 12)

    h = Harness(ranks_config=RanksConfig(max_series_total=100))
    _, rank = h.hello(labels=LONGEST)
    assert rank.label_chars == 2388
    result = h.push(rank, *(longest_dropped(j) for j in range(12)))
    assert codes(result) == [ErrorCode.SERIES_LIMIT] * 7  # 5 x (11 + 6) = 85; a sixth needs 17 more
    assert "max_series_total=100" in result.rejections[0][1]
    assert "write 2662 characters on each of its 2 lines counts 11" in result.rejections[0][1]
    budget = h.state.registry.budget
    assert (budget.per_rank, budget.rollup, rank.cost, len(rank.values)) == (55, 30, 55, 5)
    # The series it holds keep updating; new ones stay refused.
    result = h.push(rank, *(longest_dropped(j, 2.0) for j in range(6)))
    assert codes(result) == [ErrorCode.SERIES_LIMIT]
    assert h.counter(DROPPED, f"{4:03d}" + "r" * 125, "p" * 128, static=tuple(sorted(LONGEST.items()))) == 2.0


def test_long_labels_fill_max_series_per_rank_sooner() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=30))
    _, rank = h.hello(labels=LONGEST)
    result = h.push(rank, *(longest_dropped(j) for j in range(3)))
    assert codes(result) == [ErrorCode.SERIES_LIMIT] and "max_series_per_rank=30" in result.rejections[0][1]
    assert (rank.cost, len(rank.values)) == (22, 2)


def test_a_series_weighs_its_lines_by_family_kind() -> None:
    """Labels writing 300 characters a line: a per_shard counter's one line weighs 1; a replicated counter
    (and its group's spread line) and a gauge (and the rollup line made of it) 2; a histogram its lines'."""
    h = Harness()
    static = {"cache_type": "c" * 250}  # with the rank axes: 36 + 264 = 300
    _, rank = h.hello(labels=static)
    assert rank.label_chars == 300
    costs = []
    for sample in (bytes_(1.0), used(1.0), tokens(1.0, pool="kv"), hist(PGS, one_hot(PGS, 0), 1.0)):
        before = rank.cost
        assert codes(h.push(rank, sample)) == []
        costs.append(rank.cost - before)
    assert costs == [1, 2, 2, 5]  # tokens' pool="kv" writes 10 more: 310 x 2 lines; the histogram's 8 lines: 2,400


def test_a_label_outside_latin_1_weighs_the_width_of_its_line() -> None:
    h = Harness()
    _, narrow = h.hello(tp=0, labels={"cache_type": "c" * 250})
    _, wide = h.hello(tp=1, labels={"cache_type": "😀" + "c" * 249})
    assert (narrow.label_chars, narrow.label_width, wide.label_chars, wide.label_width) == (300, 1, 300, 4)
    assert codes(h.push(narrow, bytes_(1.0))) == codes(h.push(wide, bytes_(1.0))) == []
    assert (narrow.cost, wide.cost) == (1, 3)  # 1,200 "characters" held for 300
    # A family's own value of the BMP widens the line of a Latin-1 rank: its labels weigh 2 bytes a character.
    assert codes(h.push(narrow, tokens(1.0, pool="ā" * 40))) == []
    assert narrow.cost == 1 + 3  # (300 + 48) x 2 bytes, on 2 lines: 1,392


def test_a_restart_frees_a_long_labelled_series_whole_weight(h: Harness) -> None:
    conn, rank = h.hello(labels=LONGEST, epoch="one")
    h.push(rank, *(longest_dropped(j) for j in range(3)))
    budget = h.state.registry.budget
    assert (budget.per_rank, budget.rollup, rank.cost) == (33, 18, 33)
    h.state.disconnect(conn, rank)
    conn, _ = h.hello(labels=LONGEST, epoch="two")
    assert (budget.per_rank, budget.rollup, rank.cost) == (0, 18, 0)  # the rollups keep theirs
    # A restart that adds attn_cp_rank counts the rank's labels again: 17 characters more a line.
    h.state.disconnect(conn, rank)
    _, again = h.hello(labels=LONGEST, epoch="three", cp=0)
    assert again is rank and rank.label_chars == 2388 + 17


# --- telling an epoch's writers apart (review 19, finding 6) ---


def test_first_values_name_a_snapshots_counters_and_histograms_not_its_gauges(h: Harness) -> None:
    _, rank = h.hello()
    h.push(rank, bytes_(1.0))  # a known route, and series found by catalog and labels alike
    samples = [bytes_(5.0), tokens(7.0), used(9.0), hist(DURATION, one_hot(DURATION, 1, n=2), 0.5),
               ScalarSample(family="no_such_family", labels={}, value=1.0), tokens(3.0, pool="bad pool")]
    firsts = h.state.reader.first_values(rank, samples)
    duration = firsts.pop((DURATION, ()))
    assert isinstance(duration, HistValue) and duration.count == 2 and duration.sum == 0.5
    assert duration.counts == tuple(cumulative(one_hot(DURATION, 1, n=2)))
    assert firsts == {(BYTES, ()): 5.0, (TOKENS, ("kv",)): 7.0, (TOKENS, ("bad pool",)): 3.0}


def test_below_compares_every_part_and_counts_a_missing_series_as_zero() -> None:
    lay = layout(DURATION)
    low = HistValue(lay, tuple(cumulative(one_hot(DURATION, 0, n=2))), 0.2)
    shifted = HistValue(lay, tuple(cumulative(one_hot(DURATION, 1, n=2))), 0.2)  # same count, a lower first bucket
    a, b, h_ = (BYTES, ()), (TOKENS, ("kv",)), (DURATION, ())
    assert below({a: 1.0}, {a: 2.0}, [a]) and not below({a: 2.0}, {a: 2.0}, [a])
    assert below({h_: shifted}, {h_: low}, [h_]) and not below({h_: low}, {h_: shifted}, [h_])
    assert below({h_: low}, {h_: HistValue(lay, low.counts, 0.3)}, [h_])  # the sum alone
    assert not below({a: 1.0}, {a: 2.0}, [b])  # only the keys asked about
    assert not below({a: 1.0}, {}, [a])  # a series the old values lack is not compared
    assert below({}, {a: 2.0}, [a]) and not below({}, {a: 0.0}, [a])  # one the new values lack counts as zero
    assert below({}, {h_: low}, [h_])


def test_an_unknown_family_names_the_profiles_served(h: Harness) -> None:
    """An LMCache rank pushing to a sidecar that serves only sglang learns what to change."""
    _, rank = h.hello()
    result = h.push(rank, ScalarSample(family="num_hit_tokens_total", value=1.0))
    assert result.rejections == [(ErrorCode.UNKNOWN_FAMILY, (
        "family 'num_hit_tokens_total' is not in the catalog of the profiles served (sglang); another engine's "
        "needs its profile served (--profile)"))]
