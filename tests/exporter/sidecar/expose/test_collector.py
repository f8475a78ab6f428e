"""What /metrics shows: a golden exposition pinning every family, and histogram layouts end to end.

The golden file pins each exposed family's name, TYPE, HELP and labels (per rank, rollup,
bandwidth, spread and self-metrics), so any rename is a visible diff. Regenerate it after an
intended change with `HICACHE_UPDATE_GOLDEN=1 .venv/bin/python -m pytest tests/exporter/sidecar/expose/test_collector.py`.
"""

from __future__ import annotations

import logging
import os
import platform
from pathlib import Path

import pytest

from exporter.catalog import FamilySpec, MetricType, default_catalog
from exporter.protocol.messages import Hello, HistogramSample, RankId, Sample, ScalarSample, Snapshot
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.collector import SidecarCollector, build_revision
from exporter.sidecar.expose.render import TextRenderer
from tests.exporter.sidecar.expose.reference import ReferenceCollector
from tests.helpers import Scrape

GOLDEN = Path(__file__).parents[1] / "golden" / "metrics.txt"
CATALOG = default_catalog()
STATIC = {"cache_type": "HiRadixCache"}
CUSTOM = (0.5, 2.0, "+Inf")  # a layout an operator chose (SGLANG_BUCKET_LOAD_BACK_DURATION)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _label_sets(spec: FamilySpec) -> list[dict[str, str]]:
    return spec.preset_label_sets() or [{name: ("kv" if name == "pool" else "host_pressure") for name in spec.labels}]


def _samples(tp: int, step: int, layout: dict[str, tuple[float | str, ...]]) -> list[Sample]:
    """Every catalog family at values that grow with `step` (cumulative) and differ by rank."""
    samples: list[Sample] = []
    for spec in CATALOG:
        for labels in _label_sets(spec):
            if spec.type is MetricType.HISTOGRAM:
                bounds = layout.get(spec.name, (*spec.buckets, "+Inf"))  # type: ignore[misc]
                counts = [step * (i + 1) for i in range(len(bounds))]
                counts[-1] = counts[-2] if len(counts) > 1 else counts[-1]
                samples.append(HistogramSample(spec.name, list(zip(bounds, counts)), 0.25 * step * (tp + 1), counts[-1], labels))
            elif spec.type is MetricType.GAUGE:
                samples.append(ScalarSample(spec.name, float(100 * step + tp), labels))
            else:
                samples.append(ScalarSample(spec.name, float(64 * step * (tp + 1)), labels))
    return samples


def golden_state() -> tuple[TextRenderer, SidecarHealth]:
    """Two replicas of dp group 0, two pushes each; tp 1 uses its own load-back duration layout."""
    clock = Clock()
    state = SidecarState(CATALOG, clock=clock, wall_clock=lambda: 1_764_400_000.0)
    stats = SidecarHealth()
    renderer = TextRenderer(ReferenceCollector(state, stats, "sglang_"))
    ranks = [state.hello(object(), Hello(protocol=1, epoch=f"e{tp}", pid=100 + tp,
                                         rank=RankId(tp_rank=tp, pp_rank=0, dp_rank=0), labels=STATIC)).rank
             for tp in (0, 1)]
    for step in (1, 2):
        for tp, rank in enumerate(ranks):
            layout = {"load_back_duration_seconds": CUSTOM} if tp == 1 else {}
            result = state.snapshot(rank, Snapshot(seq=step, time=float(step), samples=_samples(tp, step, layout)))
            assert result.rejections == []
        clock.now += 5
    stats.rejections["unknown_family"] = 3
    return renderer, stats


def _normalised(body: str) -> str:
    body = body.replace(f'revision="{build_revision()}"', 'revision="REVISION"')
    return body.replace(f'python_version="{platform.python_version()}"', 'python_version="X.Y.Z"')


def test_golden_exposition() -> None:
    renderer, _ = golden_state()
    body = _normalised(renderer.render().decode())
    if os.environ.get("HICACHE_UPDATE_GOLDEN"):
        GOLDEN.write_text(body)
    assert body == GOLDEN.read_text(), "the exposition changed; regenerate the golden file if that was intended"


def test_golden_exposition_holds_every_kind_of_family() -> None:
    """The golden state is full: a family missing from it would not be pinned."""
    scrape = Scrape(GOLDEN.read_text())
    names = {s.name for s in scrape.samples}
    for spec in CATALOG:
        stem = "sglang_" + spec.name
        assert any(n.startswith(stem) for n in names), spec.name
        assert any(n.startswith("sglang_rollup_" + spec.name) for n in names) or spec.type is MetricType.GAUGE, spec.name
    for name in ("sglang_load_back_active_bandwidth_bytes_per_second",
                 "sglang_rollup_load_back_active_bandwidth_bytes_per_second",
                 "sglang_load_back_tokens_replica_spread_ratio", "hicache_exporter_rollup_layout_conflicts_total",
                 "hicache_exporter_rank_up", "hicache_exporter_scrape_duration_seconds_bucket"):
        assert name in names, name


def test_a_non_default_layout_is_exposed_rolled_up_and_gives_bandwidth(caplog: pytest.LogCaptureFixture) -> None:
    """Two ranks with the operator's layout roll up together; a third with the catalog's is left out, counted and logged."""
    clock = Clock()
    state = SidecarState(CATALOG, clock=clock, wall_clock=lambda: 1_764_400_000.0)
    renderer = TextRenderer(SidecarCollector(state, SidecarHealth(), "sglang_"))
    default = (*(CATALOG.get("load_back_duration_seconds").buckets or ()), "+Inf")
    with caplog.at_level(logging.WARNING, logger="hicache_exporter.ledger"):
        for tp, bounds in ((0, CUSTOM), (1, CUSTOM), (2, default)):
            rank = state.hello(object(), Hello(protocol=1, epoch=f"e{tp}", pid=1, rank=RankId(tp_rank=tp, pp_rank=0, dp_rank=0),
                                               labels=STATIC)).rank
            seconds = 0.25 * (tp + 1)  # one observation, in the 0.5 bucket of CUSTOM
            counts = [0 if b != "+Inf" and b < seconds else 1 for b in bounds]  # type: ignore[operator]
            samples = [HistogramSample("load_back_duration_seconds", list(zip(bounds, counts)), seconds, 1),
                       ScalarSample("load_back_bytes_total", 1000.0 * (tp + 1))]
            assert state.snapshot(rank, Snapshot(seq=1, time=1.0, samples=samples)).rejections == []
    scrape = Scrape(renderer.render().decode())
    rank0 = {s.labels["le"]: s.value for s in scrape.find("sglang_load_back_duration_seconds_bucket", tp_rank="0")}
    assert rank0 == {"0.5": 1.0, "2.0": 1.0, "+Inf": 1.0}  # exposed as pushed
    rank2 = [s.labels["le"] for s in scrape.find("sglang_load_back_duration_seconds_bucket", tp_rank="2")]
    assert len(rank2) == len(default) and rank2[-1] == "+Inf"
    rollup = {s.labels["le"]: s.value for s in scrape.find("sglang_rollup_load_back_duration_seconds_bucket")}
    assert rollup == {"0.5": 2.0, "2.0": 2.0, "+Inf": 2.0}  # tp 0 and 1; tp 2 left out
    assert scrape.value("sglang_rollup_load_back_duration_seconds_sum") == 0.25 + 0.5
    assert scrape.value("hicache_exporter_rollup_layout_conflicts_total", family="load_back_duration_seconds") == 1
    assert [r for r in caplog.records if "tp=2" in r.getMessage() and "load_back_duration_seconds" in r.getMessage()]
    for tp in range(3):  # bandwidth reads the sum, whatever the layout: every rank has it
        assert scrape.value("sglang_load_back_active_bandwidth_bytes_per_second", tp_rank=str(tp)) == 4000.0
    assert scrape.value("sglang_rollup_load_back_active_bandwidth_bytes_per_second") == 6000.0 / 1.5


def test_rollups_only_shows_no_per_rank_catalog_series_and_both_renderers_agree() -> None:
    """per_rank_series: false leaves out every per-rank series derived from the catalog (the
    per-rank bandwidth too); the sidecar's own per-rank health (rank_up, ...) stays."""
    from prometheus_client import CollectorRegistry

    from tests.exporter.sidecar.expose.test_render import reference_004  # the library's, less its `_created` gauges

    renderer, stats = golden_state()
    collector = ReferenceCollector(renderer.state, stats, "sglang_", per_rank_series=False)
    fast = Scrape(TextRenderer(collector).render().decode())
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    reference = Scrape(reference_004(registry))
    for scrape in (fast, reference):
        ranked = {s.name for s in scrape.samples if "tp_rank" in s.labels}
        assert ranked == {"hicache_exporter_rank_up", "hicache_exporter_rank_last_push_timestamp_seconds",
                          "hicache_exporter_rank_restarts_total"}
        assert "# TYPE sglang_load_back_active_bandwidth_bytes_per_second" not in scrape.text
        assert scrape.value("sglang_rollup_load_back_active_bandwidth_bytes_per_second") > 0
    assert {(s.name, tuple(sorted(s.labels.items()))) for s in fast.samples if not s.name.startswith("hicache_exporter_")} \
        == {(s.name, tuple(sorted(s.labels.items()))) for s in reference.samples if not s.name.startswith("hicache_exporter_")}


def test_self_durations_keep_their_names_buckets_and_values() -> None:
    """The durations are prometheus_client histograms: a value on a bound counts in it, as `le`
    says, beyond the last bound only in +Inf; exposed under the family's name without `_created`."""
    stats = SidecarHealth()
    for seconds in (0.0001, 0.3, 5.0):
        stats.scrape_duration.observe(seconds)
    stats.ingest_duration.observe(0.002)
    state = SidecarState(CATALOG, clock=Clock(), wall_clock=lambda: 1_764_400_000.0)
    body = TextRenderer(SidecarCollector(state, stats, "sglang_")).render().decode()
    scrape = Scrape(body)
    buckets = {s.labels["le"]: s.value for s in scrape.find("hicache_exporter_scrape_duration_seconds_bucket")}
    assert list(buckets) == ["0.0001", "0.00025", "0.0005", "0.001", "0.0025", "0.005", "0.01", "0.025", "0.05",
                             "0.1", "0.25", "0.5", "1.0", "+Inf"]
    assert [buckets[le] for le in ("0.0001", "0.25", "0.5", "1.0", "+Inf")] == [1, 1, 2, 2, 3]
    assert scrape.value("hicache_exporter_scrape_duration_seconds_count") == 3
    assert scrape.value("hicache_exporter_scrape_duration_seconds_sum") == 0.0001 + 0.3 + 5.0
    assert scrape.value("hicache_exporter_ingest_duration_seconds_bucket", le="0.001") == 0
    assert scrape.value("hicache_exporter_ingest_duration_seconds_bucket", le="0.0025") == 1
    assert "_created" not in body
