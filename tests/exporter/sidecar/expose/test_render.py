"""The fast renderer against prometheus_client's own exposition of the same collector."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.utils import floatToGoString

from exporter.catalog import MetricType, default_catalog
from exporter.client import RankClient
from exporter.protocol.messages import Hello, HistogramSample, RankId, ScalarSample, Snapshot, parse_client_message
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.render import TextRenderer, spell_value
from tests.exporter.sidecar.expose.reference import ReferenceCollector


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _samples(families: object) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for family in families:  # type: ignore[attr-defined]
        for s in family.samples:
            key = (s.name, frozenset(s.labels.items()))
            assert key not in out, f"duplicate sample {key}"
            out[key] = s.value
    return out


def reference_004(registry: CollectorRegistry) -> str:
    """prometheus_client's 0.0.4 exposition without its `<name>_created` gauges. The 0.0.4 text
    format has no `_created` sample, so the library writes each counter's and histogram's as a
    gauge family of its own after it; the sidecar leaves them out of that format (shown in
    OpenMetrics only), and so does the reference here. Only rollup counters and histograms have one."""
    text = generate_latest(registry).decode()
    created = {f.name for f in parse_text(text) if f.name.endswith("_created")}
    assert all(name.startswith(("sglang_rollup_", "sglang:rollup_")) for name in created), created
    kept = [line for line in text.splitlines(keepends=True)
            if (line.split(" ")[2] if line.startswith("#") else line.split("{")[0].split(" ")[0]) not in created]
    return "".join(kept)


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (sorted(a.keys() - b.keys())[:5], sorted(b.keys() - a.keys())[:5])
    for key, value in a.items():
        assert value == b[key] or (math.isnan(value) and math.isnan(b[key])), key


@pytest.fixture
def populated() -> tuple[SidecarState, ReferenceCollector, Clock]:
    clock = Clock()
    state = SidecarState(default_catalog(), clock=clock, wall_clock=lambda: 1.7e9)
    collector = ReferenceCollector(state, SidecarHealth(), "sglang_")
    for tp in range(3):
        client = RankClient("/nonexistent.sock", rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0},
                            labels={"cache_type": "HiRadixCache", "zone": 'we"ird\n{value} %s\\'})
        for spec in default_catalog():
            labels = {name: ("kv" if name == "pool" else 'quote"d\n{new}') for name in spec.labels}
            child = client.metrics.child(spec.name, labels)
            if spec.type is MetricType.HISTOGRAM:
                child.observe(0.004 * (tp + 1))  # type: ignore[union-attr]
            elif spec.type is MetricType.GAUGE:
                child.set(-1.5 * tp)  # type: ignore[union-attr]
            else:
                child.inc(10 ** (tp + 3) + 0.25)  # type: ignore[union-attr]
        hello = Hello(protocol=1, epoch=f"e{tp}", pid=1, rank=RankId(tp_rank=tp, pp_rank=0, dp_rank=0), labels=client.labels)
        rank = state.hello(object(), hello).rank
        wire = json.dumps({"type": "snapshot", "seq": 1, "time": 1.0, "samples": client.metrics.samples()})
        snapshot = parse_client_message(wire.encode())
        assert isinstance(snapshot, Snapshot)
        state.snapshot(rank, snapshot)
        clock.now += 1
    return state, collector, clock


def test_text_renderer_gives_exactly_prometheus_clients_samples(
        populated: tuple[SidecarState, ReferenceCollector, Clock]) -> None:
    state, collector, _ = populated
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    renderer = TextRenderer(collector)
    fast = renderer.render().decode()
    reference = reference_004(registry)
    _same(_samples(parse_text(fast)), _samples(parse_text(reference)))
    # Family headers match too (names and types).
    headers = lambda text: sorted(line for line in text.splitlines() if line.startswith("#"))  # noqa: E731
    assert headers(fast) == headers(reference)
    # Later scrapes with nothing pushed reuse each rank's family blocks: the same body every time
    # (self-metrics aside, which count the scrapes).
    per_rank_part = lambda text: [line for line in text.splitlines() if not line.startswith("hicache_exporter_")]  # noqa: E731
    assert per_rank_part(renderer.render().decode()) == per_rank_part(fast)
    assert per_rank_part(renderer.render().decode()) == per_rank_part(fast)


Populated = tuple[SidecarState, ReferenceCollector, Clock]


def test_openmetrics_renderer_gives_exactly_prometheus_clients_samples(populated: Populated) -> None:
    _, collector, _ = populated
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    fast = TextRenderer(collector).render(openmetrics=True).decode()
    reference = generate_openmetrics(registry).decode()
    assert fast.endswith("# EOF\n")
    _same(_samples(parse_openmetrics(fast)), _samples(parse_openmetrics(reference)))
    headers = lambda text: sorted(line for line in text.splitlines() if line.startswith("#"))  # noqa: E731
    assert headers(fast) == headers(reference)  # counters named without `_total` here, HELP escaped as OpenMetrics says


def test_cached_rank_lines_follow_new_snapshots_restarts_and_expiry(populated: Populated) -> None:
    state, collector, clock = populated
    renderer = TextRenderer(collector)
    before = _samples(parse_text(renderer.render().decode()))
    rank = next(r for r in state.ranks.values() if r.tp_rank == 1)
    key = ("sglang_evicted_tokens_total", frozenset({"tp_rank": "1", "pp_rank": "0", "dp_rank": "0",
                                                      "cache_type": "HiRadixCache", "zone": 'we"ird\n{value} %s\\'}.items()))
    assert before[key] == 10 ** 4 + 0.25
    state.snapshot(rank, Snapshot(seq=2, time=2.0, samples=[ScalarSample("evicted_tokens_total", 99999.0)]))
    assert _samples(parse_text(renderer.render().decode()))[key] == 99999.0
    state.disconnect(rank.connection, rank)
    rank_id = RankId(tp_rank=1, pp_rank=0, dp_rank=0)
    state.hello(object(), Hello(protocol=1, epoch="new", pid=2, rank=rank_id, labels=dict(rank.static)))
    state.snapshot(rank, Snapshot(seq=1, time=3.0, samples=[ScalarSample("evicted_tokens_total", 7.0)]))
    after = _samples(parse_text(renderer.render().decode()))
    assert after[key] == 7.0 and len([k for k in after if k[0] == "sglang_load_back_bytes_total"]) == 2
    clock.now += 10_000
    expired = _samples(parse_text(renderer.render().decode()))
    assert not [k for k in expired if k[0] == "sglang_evicted_tokens_total"]
    assert [k for k in expired if k[0] == "sglang_rollup_evicted_tokens_total"]


def test_renderer_matches_prometheus_client_with_several_bucket_layouts() -> None:
    """Per-series layouts (one rank with the operator's, one with the catalog's) render as the library renders them."""
    from tests.exporter.sidecar.expose.test_collector import golden_state

    renderer, _ = golden_state()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(renderer.collector)
    reference = reference_004(registry)
    ours = renderer.render().decode()
    _same(_samples(parse_text(ours)), _samples(parse_text(reference)))
    assert 'le="0.5"' in ours and 'le="0.009"' in ours


def test_a_render_pauses_garbage_collection_and_restores_it(populated: Populated) -> None:
    import gc

    _, collector, _ = populated
    renderer = TextRenderer(collector)
    seen: list[bool] = []
    original = renderer._render
    renderer._render = lambda openmetrics: (seen.append(gc.isenabled()), original(openmetrics))[1]  # type: ignore[method-assign]
    assert gc.isenabled()
    body = renderer.render()
    assert seen == [False] and gc.isenabled() and body.startswith(b"# HELP")
    gc.disable()
    try:
        renderer.render()
        assert not gc.isenabled()  # a caller that had it off keeps it off
    finally:
        gc.enable()


# The per-rank fast path spells values with bytes %-formatting: `%r` for floats, `%d` for bucket
# counts. These properties hold the spellings to what prometheus_client writes, and a rank pushed
# with such values to the reference collector's samples, bit for bit (-0.0 included).

FLOATS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 2.2250738585072014e-308, 1e16, 1e16 + 2, 2.0**53, 2.0**53 + 2,
                     9.007199254740993e15, 2.0**63, -(2.0**63), 1e22, 1.7976931348623157e308, 123456789.0, 0.1]),
)


def _bits(value: float) -> str:
    return "nan" if math.isnan(value) else float.hex(float(value))  # the parser reads "0" as an int


@settings(max_examples=500, deadline=None)
@given(FLOATS)
def test_percent_r_parses_to_what_floattogostring_writes(value: float) -> None:
    spelled = (b"%r" % value).decode()
    assert spelled == spell_value(value) or not math.isfinite(value)  # non-finite: Go's spelling instead
    assert _bits(float(spell_value(value))) == _bits(float(floatToGoString(value))) == _bits(value)
    if math.isfinite(value):
        assert _bits(float(spelled)) == _bits(value)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.integers(min_value=0, max_value=2**53), st.integers(min_value=0, max_value=2**200)))
def test_percent_d_spells_ints_as_repr_does(count: int) -> None:
    assert (b"%d" % count).decode() == repr(count)
    assert float((b"%d" % count).decode()) == float(floatToGoString(float(count))) or count > 2**53


INGEST_FLOATS = FLOATS.filter(lambda v: math.isfinite(v) and abs(v) <= 2.0**63)


@settings(max_examples=25, deadline=None)
@given(
    scalars=st.lists(INGEST_FLOATS, min_size=1, max_size=40),
    counts=st.lists(st.integers(min_value=0, max_value=2**53), min_size=1, max_size=30),
    total=INGEST_FLOATS,
)
def test_a_rank_with_any_values_renders_the_reference_samples(scalars: list[float], counts: list[int], total: float) -> None:
    state = SidecarState(default_catalog(), clock=Clock(), wall_clock=lambda: 1.7e9)
    collector = ReferenceCollector(state, SidecarHealth(), "sglang_")
    rank = state.hello(object(), Hello(protocol=1, epoch="e", pid=1, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0),
                                       labels={"cache_type": "HiRadixCache"})).rank
    samples: list[ScalarSample | HistogramSample] = []
    values = iter(scalars * 40)
    for spec in default_catalog():
        labels = {name: "kv" if name == "pool" else "x" for name in spec.labels}
        if spec.type is MetricType.HISTOGRAM:
            cumulative = sorted(counts)
            bounds = (*spec.buckets, "+Inf")
            buckets = list(zip(bounds, (cumulative * len(bounds))[:len(bounds)]))
            buckets = list(zip(bounds, sorted(c for _, c in buckets)))
            samples.append(HistogramSample(spec.name, buckets, abs(total), buckets[-1][1], labels))
        else:
            value = next(values)
            samples.append(ScalarSample(spec.name, abs(value) if spec.type is MetricType.COUNTER else value, labels))
    result = state.snapshot(rank, Snapshot(seq=1, time=1.0, samples=samples))
    assert result.rejections == []
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    ours = _samples(parse_text(TextRenderer(collector).render().decode()))
    reference = _samples(parse_text(reference_004(registry)))
    assert ours.keys() == reference.keys()
    per_rank = [key for key in ours if 'tp_rank' in dict(key[1]) and not key[0].startswith("hicache_exporter_")]
    assert per_rank
    for key in ours:
        assert _bits(ours[key]) == _bits(reference[key]), key
