"""The fast renderer against prometheus_client's own exposition of the same collector."""

from __future__ import annotations

import json
import math

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.catalog import MetricType, default_catalog
from exporter.client import RankClient
from exporter.protocol.messages import Hello, RankId, ScalarSample, Snapshot, parse_client_message
from exporter.sidecar.exposition import SidecarCollector
from exporter.sidecar.render import TextRenderer
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import SidecarStats


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


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (sorted(a.keys() - b.keys())[:5], sorted(b.keys() - a.keys())[:5])
    for key, value in a.items():
        assert value == b[key] or (math.isnan(value) and math.isnan(b[key])), key


@pytest.fixture
def populated() -> tuple[SidecarState, SidecarCollector, Clock]:
    clock = Clock()
    state = SidecarState(default_catalog(), clock=clock, wall_clock=lambda: 1.7e9)
    collector = SidecarCollector(state, SidecarStats(), "sglang_")
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


def test_text_renderer_gives_exactly_prometheus_clients_samples(populated: tuple[SidecarState, SidecarCollector, Clock]) -> None:
    state, collector, _ = populated
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    renderer = TextRenderer(collector)
    fast = renderer.render().decode()
    reference = generate_latest(registry).decode()
    _same(_samples(parse_text(fast)), _samples(parse_text(reference)))
    # Family headers match too (names and types).
    headers = lambda text: sorted(line for line in text.splitlines() if line.startswith("#"))  # noqa: E731
    assert headers(fast) == headers(reference)
    # Later scrapes with nothing pushed reuse the rank lines, first as filled pieces, then joined
    # per family: the same body every time (self-metrics aside, which count the scrapes).
    per_rank_part = lambda text: [line for line in text.splitlines() if not line.startswith("hicache_exporter_")]  # noqa: E731
    assert per_rank_part(renderer.render().decode()) == per_rank_part(fast)
    assert per_rank_part(renderer.render().decode()) == per_rank_part(fast)


Populated = tuple[SidecarState, SidecarCollector, Clock]


def test_openmetrics_renderer_gives_exactly_prometheus_clients_samples(populated: Populated) -> None:
    _, collector, _ = populated
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    fast = TextRenderer(collector).render(openmetrics=True).decode()
    reference = generate_openmetrics(registry).decode()
    assert fast.endswith("# EOF\n")
    _same(_samples(parse_openmetrics(fast)), _samples(parse_openmetrics(reference)))


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
    from tests.exporter.sidecar.test_exposition import golden_state

    renderer, _ = golden_state()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(renderer.collector)
    reference = generate_latest(registry).decode()
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
