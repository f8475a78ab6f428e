"""The rank-side metric children and MetricSet: semantics, presets, label checks, wire samples."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.catalog import MetricType, catalog_from_data, default_catalog
from exporter.client import RankClient
from exporter.client.metrics import CounterChild, GaugeChild, HistogramChild, LabelError, MetricSet
from exporter.errors import UnknownFamilyError
from exporter.protocol.framing import FrameDecoder, encode_message, encode_payload
from exporter.protocol.messages import HistogramSample, ScalarSample, Snapshot, is_histogram, parse_client_message

UNFULFILLED_REASONS = (
    "below_threshold", "host_capacity", "device_capacity", "device_covered", "storage_transfer",
    "deadline", "anchor_lost", "aux_window_trim", "device_overlap", "cache_admission_shortfall", "dropped",
)


def buckets_of(child: HistogramChild) -> dict:
    return {bound: count for bound, count in child.sample("h").buckets}


# --- counters and gauges ----------------------------------------------------------------------


def test_counter_starts_at_zero_and_adds():
    c = CounterChild()
    assert c.sample("c") == ScalarSample("c", 0)
    c.inc()
    c.inc(64)
    c.inc(0.5)
    c.inc(0)
    assert c.value == 65.5
    assert c.sample("c", {"pool": "kv"}) == ScalarSample("c", 65.5, {"pool": "kv"})


def test_counter_negative_inc_raises_and_changes_nothing():
    c = CounterChild()
    c.inc(10)
    with pytest.raises(ValueError):
        c.inc(-1)
    with pytest.raises(ValueError):
        c.inc(-0.001)
    assert c.value == 10


def test_gauge_set_inc_dec():
    g = GaugeChild()
    assert g.sample("g") == ScalarSample("g", 0)
    g.set(512)
    g.inc(8)
    g.dec(20)
    assert g.value == 500
    g.dec(600)
    assert g.sample("g").value == -100  # gauges may go down and below zero
    g.inc()
    g.dec()
    assert g.value == -100


# --- histograms -------------------------------------------------------------------------------

BOUNDS = (0.001, 0.01, 0.1)


def test_histogram_upper_bounds_are_inclusive():
    h = HistogramChild(BOUNDS)
    h.observe(0.001)
    assert buckets_of(h) == {0.001: 1, 0.01: 1, 0.1: 1, "+Inf": 1}
    h.observe(0.01)
    assert buckets_of(h) == {0.001: 1, 0.01: 2, 0.1: 2, "+Inf": 2}
    h.observe(0.0010000001)  # just above a bound: the next bucket
    assert buckets_of(h) == {0.001: 1, 0.01: 3, 0.1: 3, "+Inf": 3}


def test_histogram_above_the_last_bound_lands_only_in_inf():
    h = HistogramChild(BOUNDS)
    h.observe(0.1000001)
    h.observe(1e9)
    sample = h.sample("h")
    assert sample.buckets == [(0.001, 0), (0.01, 0), (0.1, 0), ("+Inf", 2)]
    assert sample.count == 2


def test_histogram_sample_shape_is_cumulative_with_sum_and_count():
    h = HistogramChild(BOUNDS)
    for value in (0.0005, 0.002, 0.003, 0.05, 0.5):
        h.observe(value)
    sample = h.sample("h", {"pool": "kv"})
    assert sample.buckets == [(0.001, 1), (0.01, 3), (0.1, 4), ("+Inf", 5)]
    assert sample.count == 5 == sample.buckets[-1][1]
    assert sample.sum == pytest.approx(0.5555)
    assert is_histogram(sample) and sample.family == "h" and sample.labels == {"pool": "kv"}


def test_empty_histogram_sample():
    sample = HistogramChild(BOUNDS).sample("h")
    assert sample == HistogramSample("h", [(0.001, 0), (0.01, 0), (0.1, 0), ("+Inf", 0)], 0.0, 0)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(min_value=-10, max_value=10, allow_nan=False), max_size=50))
def test_histogram_counts_match_a_direct_count(values):
    h = HistogramChild(BOUNDS)
    for value in values:
        h.observe(value)
    sample = h.sample("h")
    for bound, count in sample.buckets[:-1]:
        assert count == sum(1 for v in values if v <= bound)
    assert sample.buckets[-1] == ("+Inf", len(values))
    assert sample.count == len(values)
    assert sample.sum == pytest.approx(math.fsum(values), abs=1e-9)
    counts = [c for _, c in sample.buckets]
    assert counts == sorted(counts)


# --- MetricSet --------------------------------------------------------------------------------


@pytest.fixture
def metrics() -> MetricSet:
    m = MetricSet(default_catalog())
    m.preset()
    return m


def test_preset_creates_every_unlabelled_family_and_every_preset_reason(metrics):
    catalog = default_catalog()
    expected = {(f.name, ()) for f in catalog if not f.labels}
    expected |= {("storage_prefetch_unfulfilled_tokens_total", (r,)) for r in UNFULFILLED_REASONS}
    expected |= {("storage_prefetch_deferred_tokens_total", (r,)) for r in ("host_capacity", "device_capacity")}
    expected |= {("prefill_effective_tokens_total", (m,)) for m in ("input", "device_hit", "host_hit", "storage_hit")}
    assert set(metrics) == expected
    for (family, _), child in metrics.items():
        spec = catalog.get(family)
        if spec.type is MetricType.HISTOGRAM:
            assert isinstance(child, HistogramChild)
            assert child.sample(family).count == 0 and child.sample(family).sum == 0
        else:
            assert isinstance(child, CounterChild if spec.type is MetricType.COUNTER else GaugeChild)
            assert child.value == 0


def test_preset_reasons_appear_in_samples_at_zero(metrics):
    reasons = [
        s["labels"]["reason"] for s in metrics.samples()
        if s["family"] == "storage_prefetch_unfulfilled_tokens_total"
    ]
    assert sorted(reasons) == sorted(UNFULFILLED_REASONS)
    assert all(
        s["value"] == 0 for s in metrics.samples() if s["family"] == "storage_prefetch_unfulfilled_tokens_total"
    )


def test_preset_is_idempotent_and_keeps_values(metrics):
    metrics.child("evicted_tokens_total", {}).inc(5)
    before = set(metrics)
    metrics.preset()
    assert set(metrics) == before
    assert metrics.child("evicted_tokens_total", {}).value == 5


def test_preset_with_a_custom_catalog():
    catalog = catalog_from_data({"families": [
        {"name": "a_total", "type": "counter", "semantics": "replicated", "help": "h",
         "labels": ["kind", "pool"], "preset": {"kind": ["x", "y"], "pool": ["kv"]}},
        {"name": "b_total", "type": "counter", "semantics": "replicated", "help": "h",
         "labels": ["kind", "pool"], "preset": {"kind": ["x"]}},
        {"name": "c", "type": "gauge", "semantics": "replicated", "help": "h"},
    ]})
    m = MetricSet(catalog)
    m.preset()
    assert set(m) == {("a_total", ("x", "kv")), ("a_total", ("y", "kv")), ("c", ())}


def test_same_labels_give_the_same_child(metrics):
    a = metrics.child("load_back_tokens_total", {"pool": "kv"})
    assert metrics.child("load_back_tokens_total", {"pool": "kv"}) is a
    assert metrics.child("load_back_tokens_total", {"pool": "host"}) is not a
    assert metrics.child("hicache_dropped_tokens_total", {"pool": "kv", "reason": "host_pressure"}) is (
        metrics.child("hicache_dropped_tokens_total", {"reason": "host_pressure", "pool": "kv"})
    )


@pytest.mark.parametrize(
    "family, labels, expected",
    [
        ("load_back_tokens_total", {}, "pool"),
        ("load_back_tokens_total", {"pol": "kv"}, "pool"),
        ("load_back_tokens_total", {"pool": "kv", "reason": "x"}, "pool"),
        ("hicache_dropped_tokens_total", {"reason": "host_pressure"}, "'reason', 'pool'"),
        ("evicted_tokens_total", {"pool": "kv"}, "[]"),
        ("load_back_tokens_total", {"tp_rank": "0"}, "pool"),
    ],
)
def test_label_mismatch_names_the_expected_labels(metrics, family, labels, expected):
    with pytest.raises(LabelError) as info:
        metrics.child(family, labels)
    assert family in str(info.value)
    assert expected in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_family_raises(metrics):
    with pytest.raises(UnknownFamilyError) as info:
        metrics.child("no_such_total", {})
    assert "no_such_total" in str(info.value)


@pytest.mark.parametrize(
    "family, expect",
    [
        ("load_back_bytes_total", MetricType.GAUGE),
        ("load_back_bytes_total", MetricType.HISTOGRAM),
        ("hicache_host_used_tokens", MetricType.COUNTER),
        ("load_back_duration_seconds", MetricType.COUNTER),
    ],
)
def test_asking_a_family_as_another_type_raises(metrics, family, expect):
    with pytest.raises(LabelError) as info:
        metrics.child(family, {}, expect)
    assert family in str(info.value)
    right = default_catalog().get(family).type
    assert metrics.child(family, {}, right) is metrics.child(family, {})  # the right type is fine


def test_rank_client_binding_checks_the_type():
    client = RankClient("/nonexistent/metrics.sock")  # never started: nothing connects
    with pytest.raises(LabelError):
        client.gauge("load_back_bytes_total")
    with pytest.raises(LabelError):
        client.counter("hicache_host_used_tokens")
    with pytest.raises(LabelError):
        client.histogram("load_back_bytes_total")
    with pytest.raises(LabelError):
        client.counter("load_back_tokens_total")  # missing pool
    assert isinstance(client.counter("load_back_tokens_total", pool="kv"), CounterChild)
    assert isinstance(client.gauge("hicache_host_used_tokens"), GaugeChild)
    assert isinstance(client.histogram("load_back_duration_seconds"), HistogramChild)


def test_a_histogram_may_take_the_engines_buckets_and_keeps_its_first_layout():
    client = RankClient("/nonexistent/metrics.sock", preset=False)  # a preset series has the catalog's layout
    child = client.histogram("load_back_duration_seconds", buckets=[0.002, 0.25])
    assert child.bounds == (0.002, 0.25)
    child.observe(0.1)
    assert buckets_of(child) == {0.002: 0, 0.25: 1, "+Inf": 1}
    assert client.histogram("load_back_duration_seconds", buckets=(0.002, 0.25)) is child
    assert client.histogram("load_back_duration_seconds") is child  # no buckets: the series as it is
    with pytest.raises(LabelError, match="already has the buckets"):
        client.histogram("load_back_duration_seconds", buckets=[0.5])
    for bad in ([], [0.5, 0.1], [0.1, 0.1], [0.1, math.inf], [math.nan]):
        with pytest.raises(LabelError, match="strictly ascending"):
            client.histogram("eviction_duration_seconds", buckets=bad)
    with pytest.raises(LabelError, match="only a histogram"):
        client.metrics.child("load_back_bytes_total", {}, bounds=[1.0])


def test_without_preset_a_client_pushes_only_what_is_bound():
    client = RankClient("/nonexistent/metrics.sock", preset=False)
    assert client.metrics.samples() == []
    client.counter("storage_prefetch_unfulfilled_tokens_total", reason="deadline").inc(5)
    assert client.metrics.samples() == [
        {"family": "storage_prefetch_unfulfilled_tokens_total", "labels": {"reason": "deadline"}, "value": 5}]


# --- samples on the wire ----------------------------------------------------------------------


def _exercise(metrics: MetricSet) -> None:
    metrics.child("load_back_tokens_total", {"pool": "kv"}).inc(4096)
    metrics.child("load_back_bytes_total", {}).inc(8388608)
    metrics.child("load_back_duration_seconds", {}).observe(0.004)
    metrics.child("load_back_duration_seconds", {}).observe(2.0)
    metrics.child("hicache_host_used_tokens", {}).set(512)
    metrics.child("hicache_host_pool_used_tokens", {"pool": 7}).set(-3)
    metrics.child("storage_prefetch_unfulfilled_tokens_total", {"reason": "shrunk"}).inc(3)
    metrics.child("storage_prefetch_unfulfilled_tokens_total", {"reason": "anchor_lost"}).inc(2.5)
    metrics.child("hicache_dropped_tokens_total", {"reason": "host_pressure", "pool": "kv"}).inc()


def test_samples_validate_as_a_snapshot(metrics):
    _exercise(metrics)
    samples = metrics.samples()
    payload = json.dumps({"type": "snapshot", "seq": 1, "time": 1764400000.25, "samples": samples}).encode()
    snap = parse_client_message(payload)
    assert isinstance(snap, Snapshot)
    assert len(snap.samples) == len(samples) == len(set(metrics))
    by_key = {(s.family, tuple(sorted(s.labels.items()))): s for s in snap.samples}
    tokens = by_key[("load_back_tokens_total", (("pool", "kv"),))]
    assert not is_histogram(tokens) and tokens.value == 4096
    assert by_key[("hicache_host_pool_used_tokens", (("pool", "7"),))].value == -3
    assert by_key[("storage_prefetch_unfulfilled_tokens_total", (("reason", "shrunk"),))].value == 3
    duration = by_key[("load_back_duration_seconds", ())]
    assert is_histogram(duration)
    assert duration.count == 2 and duration.buckets[-1] == ("+Inf", 2)
    assert duration.sum == pytest.approx(2.004)
    assert [b for b, _ in duration.buckets[:-1]] == list(default_catalog().get("load_back_duration_seconds").buckets)
    assert dict(duration.buckets)[0.004] == 1 and dict(duration.buckets)[1.0] == 1


def test_samples_go_through_the_framing(metrics):
    _exercise(metrics)
    sent = Snapshot(seq=2, time=1.0, samples=metrics.wire_samples())
    (payload,) = FrameDecoder().feed(encode_message(sent))
    snap = parse_client_message(payload)
    assert isinstance(snap, Snapshot) and len(snap.samples) == len(set(metrics))
    assert snap == sent  # the sidecar decodes exactly the structs the client built


def test_samples_are_the_wire_samples_as_plain_objects(metrics):
    _exercise(metrics)
    wire = json.loads(encode_payload(Snapshot(seq=1, time=1.0, samples=metrics.wire_samples())))["samples"]
    assert json.loads(json.dumps(metrics.samples())) == wire


def test_preset_only_samples_validate(metrics):
    payload = json.dumps({"type": "snapshot", "seq": 0, "time": 0.0, "samples": metrics.samples()}).encode()
    assert isinstance(parse_client_message(payload), Snapshot)


def test_non_finite_gauge_is_left_out_and_the_rest_still_validates(metrics):
    metrics.child("hicache_host_used_tokens", {}).set(float("nan"))
    metrics.child("hicache_host_total_tokens", {}).set(float("inf"))
    samples = metrics.samples()
    families = {s["family"] for s in samples}
    assert families == {s.family for s in metrics.wire_samples()}
    assert "hicache_host_used_tokens" not in families
    assert "hicache_host_total_tokens" not in families
    assert "evicted_tokens_total" in families
    payload = json.dumps({"type": "snapshot", "seq": 0, "time": 0.0, "samples": samples}, allow_nan=False)
    assert isinstance(parse_client_message(payload.encode()), Snapshot)
