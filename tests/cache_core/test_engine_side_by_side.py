"""cache_core's series side by side with the released engine's collectors (sglang 0.5.23, compiled from
its wheel by tests.upstream_sglang) fed the same events.

A rank runs a workload; every series its three clients hold is replayed into the released
RadixCacheMetricsCollector, StorageMetricsCollector and SchedulerMetricsCollector, built with the
labels the engine gives that rank (its own rules, written out here, not cache_core's), through the
collectors' own logging methods: a counter's total once, a histogram's observations one by one,
a gauge's value. The engine's exposition (namespace `sglang:`) and cache_core's then hold the same
families, the same label names and values per series, the same values and bucket bounds. A series
that cache_core holds at 0 but the engine would not create (its methods log positive amounts only),
or that the engine pre-seeds and cache_core lacks, shows up as a difference.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cache_core.geometry import ModelGeometry
from cache_core.hicache import HiCacheConfig
from cache_core.rank import CACHE_TYPE, ENGINE_TYPE, MODEL_NAME, STORAGE_BACKEND, RankSpec, build_rank, run_batch
from cache_core.workload import Workload, WorkloadConfig
from exporter.catalog import default_catalog
from exporter.client import HistogramChild
from tests.upstream_sglang import WheelUnavailable

PS = 4
WORKLOAD = WorkloadConfig(seed=5, system_prompts=4, system_prompt_tokens=(24, 64), turn_tokens=(4, 16),
                          reply_tokens=(4, 12), max_turns=4, active_sessions=6, vocab=1000)


@pytest.fixture
def released(monkeypatch: pytest.MonkeyPatch) -> Any:
    try:
        from tests import upstream_sglang

        module = upstream_sglang.install()
    except WheelUnavailable as err:
        pytest.fail(f"the released SGLang collectors are needed: {err}", pytrace=False)
    # The scheduler collector's heatmap gauges (no catalog family) register in prometheus_client's
    # default registry, bypassing the DI hooks: a second collector in one process would collide.
    monkeypatch.setattr(module, "GaugeHistogram", lambda *args, **kwargs: SimpleNamespace())
    return module


def engine_labels(spec: RankSpec, released: Any) -> dict[str, dict[str, Any]]:
    """The three label sets the engine gives this rank, by its own rules."""
    attn_tp, cp, dp = spec.attn_tp_size, spec.attn_cp_size, spec.dp_size
    tp_rank = (spec.dp_rank * cp + spec.attn_cp_rank) * attn_tp + spec.attn_tp_rank  # derive_attention_ranks
    dp_attention = dp > 1
    parallel = SimpleNamespace(tp_rank=tp_rank, attn_tp_rank=spec.attn_tp_rank, attn_dp_rank=spec.dp_rank,
                               pp_rank=spec.pp_rank)
    radix = released.radix_cache_metric_labels(CACHE_TYPE, parallel, dp_attention)
    storage = {  # storage_attachment.py:324-333, with cache_controller.py:756-763's tp and dp ranks
        "storage_backend": STORAGE_BACKEND,
        "tp_rank": spec.attn_tp_rank if dp_attention else tp_rank,
        "dp_rank": spec.dp_rank if dp_attention else 0,
        "pp_rank": spec.pp_rank, "pp_size": spec.pp_size,
        "attn_cp_rank": spec.attn_cp_rank, "attn_cp_size": cp,
    }
    scheduler = {"model_name": MODEL_NAME, "engine_type": ENGINE_TYPE, "tp_rank": tp_rank, "pp_rank": spec.pp_rank,
                 "moe_ep_rank": 0}  # init_new, metrics_collector.py:1380-1394
    if dp_attention:  # parallel.dp_rank is None without DP attention: no dp_rank label
        scheduler["dp_rank"] = spec.dp_rank
    return {"radix": radix, "storage": storage, "scheduler": scheduler}


def private(released: Any, base: type, registry: Any) -> type:
    """The released collector class with prometheus_client metrics in `registry` (its DI hooks)."""
    from prometheus_client import Counter, Gauge, Histogram

    def bind(cls: Any) -> Any:
        return staticmethod(lambda *a, **kw: cls(*a, registry=registry, **kw))

    return type(base.__name__, (base,), {"_counter_cls": bind(Counter), "_gauge_cls": bind(Gauge),
                                         "_histogram_cls": bind(Histogram)})


def run_rank(tmp_path: Path, spec_kw: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> tuple[RankSpec, Any, dict]:
    """Run a workload on one rank; returns its spec, its clients and every histogram observation."""
    observed: dict[int, list[float]] = defaultdict(list)
    plain_observe = HistogramChild.observe

    def observe(self: HistogramChild, value: float) -> None:
        observed[id(self)].append(value)
        plain_observe(self, value)

    monkeypatch.setattr(HistogramChild, "observe", observe)
    spec = RankSpec(socket_path=str(tmp_path / "none.sock"), storage_root=str(tmp_path / "l3"),
                    geometry=ModelGeometry(layers=3, kv_heads=4, head_dim=8, page_size=PS),
                    cache=HiCacheConfig(device_pages=24, host_pages=32, prefetch_threshold=2 * PS),
                    **spec_kw)
    clients, cache = build_rank(spec)
    workload = Workload(WORKLOAD, spec.dp_rank)
    try:
        for _ in range(15):
            run_batch(cache, [workload.next_request() for _ in range(4)])
    finally:
        cache.close()
    return spec, clients, observed


def replay(released: Any, labels: dict[str, dict[str, Any]], clients: Any, observed: dict) -> Any:
    """Feed every series the clients hold into the released collectors; returns their registry."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    radix = private(released, released.RadixCacheMetricsCollector, registry)(labels=labels["radix"])
    storage = private(released, released.StorageMetricsCollector, registry)(labels=labels["storage"])
    scheduler = None
    if clients.scheduler is not None:
        scheduler = private(released, released.SchedulerMetricsCollector, registry)(
            labels=labels["scheduler"], server_args=None, enable_hierarchical_cache=True)
    catalog = default_catalog()
    pages: dict[str, list[float]] = defaultdict(list)
    prefill: dict[str, float] = {}
    for client in clients.all():
        for (family, values), child in client.metrics.items():
            spec = catalog.get(family)
            if spec.beyond_upstream:
                continue
            extra = dict(zip(spec.labels, values))
            value = getattr(child, "value", None)
            samples = observed.get(id(child), [])
            if family == "evicted_tokens_total":
                radix.increment_eviction_num_tokens(value)
            elif family == "load_back_tokens_total":
                radix.increment_load_back_num_tokens(value, extra["pool"])
            elif family == "load_back_bytes_total":
                radix.increment_load_back_num_bytes(value)
            elif family == "hicache_backup_tokens_total":
                radix.increment_backup_num_tokens(value, extra["pool"])
            elif family == "hicache_backup_bytes_total":
                radix.increment_backup_num_bytes(value)
            elif family == "hicache_dropped_tokens_total":
                radix.increment_dropped_tokens(value, extra["reason"], extra["pool"])
            elif family in ("eviction_duration_seconds", "load_back_duration_seconds", "hicache_backup_duration_seconds"):
                method = {"eviction_duration_seconds": radix.observe_eviction_duration,
                          "load_back_duration_seconds": radix.observe_load_back_duration,
                          "hicache_backup_duration_seconds": radix.observe_backup_duration}[family]
                for x in samples:
                    method(x)
            elif family == "prefetched_tokens_total":
                storage.log_prefetched_tokens(value)
            elif family == "backuped_tokens_total":
                storage.log_backuped_tokens(value)
            elif family == "storage_prefetch_hit_tokens_total":
                storage.log_storage_prefetch_hit_tokens(value)
            elif family == "storage_prefetch_unfulfilled_tokens_total":
                storage.log_storage_prefetch_unfulfilled_tokens(value, extra["reason"])
            elif family == "storage_prefetch_deferred_tokens_total":
                storage.log_storage_prefetch_deferred_tokens(value, extra["reason"])
            elif family in ("prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth"):
                pages[family] = samples
            elif family in ("hicache_host_used_tokens", "hicache_host_total_tokens"):
                assert scheduler is not None
                scheduler._log_gauge(getattr(scheduler, family), value)  # what log_stats does with stats
            elif family == "prefill_effective_tokens_total":
                prefill[extra["mode"]] = value
            else:
                raise AssertionError(f"no engine method replays {family}")
    storage.log_storage_metrics(released.StorageMetrics(**pages))
    if scheduler is not None:
        scheduler.increment_effective_prefill_tokens(
            input_tokens=prefill["input"], device_hit_tokens=prefill["device_hit"],
            host_hit_tokens=prefill["host_hit"], storage_hit_tokens=prefill["storage_hit"])
    return registry


def engine_series(registry: Any) -> dict[str, dict[frozenset, Any]]:
    """The released collectors' catalog families: family -> {label items: value or (buckets, sum, count)}."""
    catalog = default_catalog()
    out: dict[str, dict[frozenset, Any]] = defaultdict(dict)
    for metric in registry.collect():
        family = metric.name.removeprefix("sglang:")
        if not metric.name.startswith("sglang:") or family not in catalog and family + "_total" not in catalog:
            continue
        family = family if family in catalog else family + "_total"
        if not metric.samples:
            continue  # a family whose series were never created is not exposed
        if metric.type == "histogram":
            grouped: dict[frozenset, dict] = defaultdict(lambda: {"buckets": []})
            for s in metric.samples:
                base = frozenset((k, v) for k, v in s.labels.items() if k != "le")
                if s.name.endswith("_bucket"):
                    grouped[base]["buckets"].append((float(s.labels["le"]), s.value))
                elif s.name.endswith("_sum"):
                    grouped[base]["sum"] = s.value
                elif s.name.endswith("_count"):
                    grouped[base]["count"] = s.value
            out[family] = {k: (tuple(v["buckets"]), v["sum"], v["count"]) for k, v in grouped.items()}
        else:
            out[family] = {frozenset(s.labels.items()): s.value for s in metric.samples
                           if not s.name.endswith("_created")}
    return out


def core_series(clients: Any) -> dict[str, dict[frozenset, Any]]:
    """cache_core's series of the same families, labelled as the sidecar exposes them per rank."""
    catalog = default_catalog()
    out: dict[str, dict[frozenset, Any]] = defaultdict(dict)
    for client in clients.all():
        base = {**{k: str(v) for k, v in client.rank.items()}, **client.labels}
        for (family, values), child in client.metrics.items():
            spec = catalog.get(family)
            if spec.beyond_upstream:
                continue
            labels = frozenset({**base, **dict(zip(spec.labels, values))}.items())
            if isinstance(child, HistogramChild):
                cumulative, total = child.cumulative()
                buckets = tuple(zip((*map(float, child.bounds), float("inf")), map(float, cumulative)))
                out[family][labels] = (buckets, total, float(cumulative[-1]))
            else:
                out[family][labels] = float(child.value)
    return out


def compare(engine: dict, core: dict) -> None:
    assert sorted(core) == sorted(engine), "the same families"
    for family in engine:
        assert set(core[family]) == set(engine[family]), (family, sorted(map(sorted, core[family])),
                                                          sorted(map(sorted, engine[family])))
        for labels, value in engine[family].items():
            mine = core[family][labels]
            if isinstance(value, tuple):
                assert [b for b, _ in mine[0]] == [b for b, _ in value[0]], (family, "bucket bounds")
                assert [c for _, c in mine[0]] == [c for _, c in value[0]], (family, "bucket counts")
                assert mine[1] == pytest.approx(value[1], rel=1e-12) and mine[2] == value[2], family
            else:
                assert mine == value, (family, sorted(labels), mine, value)


LAYOUTS = {
    # DP attention: the radix and storage tp_rank is the attention tp rank.
    "dp-attention": dict(attn_tp_rank=0, pp_rank=1, dp_rank=1, attn_tp_size=2, pp_size=2, dp_size=2),
    "dp-attention-other-rank": dict(attn_tp_rank=1, pp_rank=0, dp_rank=1, attn_tp_size=2, pp_size=2, dp_size=2),
    # Context parallelism without DP attention: the global tp rank tells cp peers apart.
    "cp-peer": dict(attn_tp_rank=0, pp_rank=0, dp_rank=0, attn_tp_size=2, pp_size=1, dp_size=1,
                    attn_cp_rank=1, attn_cp_size=2),
}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cache_core_matches_the_released_collectors_family_for_family(tmp_path, monkeypatch, released, layout) -> None:
    spec, clients, observed = run_rank(tmp_path, LAYOUTS[layout], monkeypatch)
    engine = engine_series(replay(released, engine_labels(spec, released), clients, observed))
    core = core_series(clients)
    assert core["storage_prefetch_hit_tokens_total"] and core["load_back_tokens_total"], "the run exercised L2 and L3"
    compare(engine, core)


def test_the_logging_rank_without_dp_attention_differs_only_by_dp_rank(tmp_path, monkeypatch, released) -> None:
    """Without DP attention the engine's scheduler series have no dp_rank; a rank identity needs one."""
    spec, clients, observed = run_rank(tmp_path, dict(attn_tp_rank=0, pp_rank=0, dp_rank=0, attn_tp_size=2,
                                                      pp_size=1, dp_size=1), monkeypatch)
    assert clients.scheduler is not None
    engine = engine_series(replay(released, engine_labels(spec, released), clients, observed))
    core = core_series(clients)
    scheduler_families = {f.name for f in default_catalog() if f.collector and f.collector.value == "scheduler"}
    for family in scheduler_families & set(engine):
        core[family] = {frozenset((k, v) for k, v in labels if k != "dp_rank"): value
                        for labels, value in core[family].items()}
    compare(engine, core)
