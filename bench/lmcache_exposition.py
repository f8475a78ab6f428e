"""vLLM's /metrics with LMCache 0.5.6's families for E engines x TP workers, one text per read (bench/proxy.py's lmcache case).

    python -m bench.lmcache_exposition --engines 8 --tp 8 --reads 11 --out DIR

Run as its own process with `PROMETHEUS_MULTIPROC_DIR` set before it starts: that is the only mode in
which vLLM's /metrics shows LMCache's series (docs/lmcache-0.5.6.md section 1), and prometheus_client
picks it when it is imported. The text of every read is what vLLM's /metrics writes then:
`generate_latest` of a registry holding one `MultiProcessCollector` over that directory (counters as
`_total` without `_created`, histograms with the logger's buckets, the gauges the files hold).

Source of the series, in order of preference:
* `released`: LMCache 0.5.6's own `PrometheusLogger` compiled from its hash-pinned wheel
  (tests/upstream_lmcache.py; fetched as the tests fetch it). `GetOrCreate` once per worker's metadata
  (the label views of one set of collectors, observability.py:1851-1870); per read and worker, the
  released `LMCStatsMonitor` counts that engine's requests (alike on every worker of an engine) and the
  worker's own shard bytes, then the logger's one step `log_prometheus(monitor.get_stats_and_clear())`.
* `catalog`: where the wheel cannot be had, prometheus_client metric objects of the lmcache profile's
  families (exporter/defaults/lmcache.yaml: the same names, types, labels, buckets and gauge modes).

The engines differ by model: engine e serves model `bench/model-e` (both `model_name` and
`served_model_name`), each with `worker_id` 0..tp-1 and role "worker", as 8 engines of 8 different
models behind one sidecar would. Files written: `read-<n>.txt` per read, and `source.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from exporter.catalog import MetricType, load_profile

PREFIX = "lmcache:"


def model(engine: int) -> str:
    return f"bench/model-{engine}"


def labels(engine: int, worker: int) -> dict[str, str]:
    """One worker's labels, as `PrometheusLogger._metadata_to_labels` makes them (observability.py:1905-1913)."""
    return {"model_name": model(engine), "worker_id": str(worker), "role": "worker", "served_model_name": model(engine)}


class Released:
    """The released logger: one label view per worker, fed through the released stats monitor."""

    name = "released"

    def __init__(self, lmcache: Any, version: str, engines: int, tp: int) -> None:
        self.lmcache = lmcache
        self.monitor = lmcache.LMCStatsMonitor.GetOrCreate()
        self.views = {(e, w): lmcache.PrometheusLogger.GetOrCreate(self.metadata(e, w, tp))
                      for e in range(engines) for w in range(tp)}
        self.note = f"LMCache {version}'s own PrometheusLogger ({Path(lmcache.__released_from__).name})"

    def metadata(self, engine: int, worker: int, tp: int) -> Any:
        """A vLLM worker's metadata, as create_lmcache_metadata fills it in (integration/vllm/utils.py:429-442)."""
        return self.lmcache.LMCacheMetadata(
            model_name=model(engine), world_size=tp, local_world_size=tp, worker_id=worker, local_worker_id=worker,
            kv_dtype=None, kv_shape=(32, 2, 256, 8, 128), role="worker", served_model_name=model(engine))

    def step(self, rng: random.Random, engine: int, worker: int, requests: list[tuple[int, int]]) -> None:
        """One logging interval of one worker: the engine's requests (every worker sees them alike), its own bytes."""
        monitor = self.monitor
        for tokens, hit in requests:
            monitor.on_lookup_finished(monitor.on_lookup_request(tokens), hit)
            retrieve = monitor.on_retrieve_request(tokens)
            retrieve.process_tokens_time = 1e-4 * (1 + worker)  # as cache_engine.py sets them on the request's stats
            retrieve.broadcast_time = 2e-5
            retrieve.to_gpu_time = 3e-4
            retrieve.detailed_metrics["remote_backend_batched_get_blocking_time"] = rng.uniform(1e-4, 1e-2)
            retrieve.detailed_metrics["instrumented_connector_batched_get_time"] = rng.uniform(1e-4, 1e-2)
            monitor.on_retrieve_finished(retrieve, hit)
            store = monitor.on_store_request(tokens - hit)
            store.process_tokens_time, store.from_gpu_time, store.put_time = 1e-4, 2e-4, 5e-4
            monitor.on_store_finished(store)
            monitor.update_interval_remote_read_metrics(hit * 4096 // (worker + 1))
            monitor.update_interval_remote_write_metrics((tokens - hit) * 4096)
            monitor.update_interval_remote_time_to_get(rng.uniform(1e-3, 0.1))
            monitor.update_interval_remote_time_to_put(rng.uniform(1e-3, 0.1))
            monitor.update_interval_remote_time_to_get_sync(rng.uniform(1e-3, 0.1))
            monitor.on_chunk_reuse(rng.uniform(1.0, 600.0))
            transfer = monitor.on_p2p_transfer_request(hit)
            monitor.p2p_requests[transfer].start_time -= rng.uniform(1e-3, 0.5)  # a transfer that took that long
            monitor.on_p2p_transfer_finished(transfer)
            monitor.update_interval_vllm_hit_tokens(hit // 2)
            monitor.update_interval_prompt_tokens(tokens)
        monitor.update_local_cpu_evict_metrics(rng.randint(1, 64))
        monitor.update_forced_unpin_count(rng.randint(0, 2))
        monitor.update_remote_ping_latency(rng.uniform(1e-4, 1e-2))
        monitor.update_remote_ping_error_code(0)
        monitor.update_local_cache_usage(rng.randint(1 << 30, 1 << 34))
        monitor.update_local_storage_usage(rng.randint(1 << 30, 1 << 36))
        monitor.update_active_memory_objs_count(rng.randint(0, 4096))
        monitor.update_pinned_memory_objs_count(rng.randint(-8, 8))
        self.views[(engine, worker)].log_prometheus(monitor.get_stats_and_clear())


class FromCatalog:
    """prometheus_client metric objects of the lmcache profile's families, advanced like a busy worker's."""

    name = "catalog"

    def __init__(self, engines: int, tp: int, why: str) -> None:
        self.note = f"prometheus_client objects of exporter/defaults/lmcache.yaml's families (released logger: {why})"
        self.children: dict[tuple[int, int], list[tuple[MetricType, Any, tuple[float, ...]]]] = {}
        metrics = []
        for spec in load_profile("lmcache"):
            name = PREFIX + (spec.name.removesuffix("_total") if spec.type is MetricType.COUNTER else spec.name)
            labelnames = ["model_name", "worker_id", "role", "served_model_name"]
            if spec.type is MetricType.COUNTER:
                metric: Any = Counter(name, spec.help, labelnames)
            elif spec.type is MetricType.HISTOGRAM:
                metric = Histogram(name, spec.help, labelnames, buckets=spec.buckets or (1.0,))
            else:
                metric = Gauge(name, spec.help, labelnames, multiprocess_mode=spec.multiprocess_mode or "all")
            metrics.append((spec.type, metric, spec.buckets or (1.0,)))
        for e in range(engines):
            for w in range(tp):
                self.children[(e, w)] = [(kind, metric.labels(**labels(e, w)), buckets) for kind, metric, buckets in metrics]

    def step(self, rng: random.Random, engine: int, worker: int, requests: list[tuple[int, int]]) -> None:
        tokens = sum(t for t, _ in requests)
        for kind, child, buckets in self.children[(engine, worker)]:
            if kind is MetricType.COUNTER:
                child.inc(tokens)
            elif kind is MetricType.HISTOGRAM:
                for _ in requests:
                    child.observe(rng.uniform(0, buckets[-1] * 1.1))
            else:
                child.set(rng.randint(0, 1 << 20))


def source(engines: int, tp: int, wanted: str) -> Released | FromCatalog:
    """The released logger where its wheel can be had (unless `catalog` is asked for), else the catalog's objects."""
    if wanted == "catalog":
        return FromCatalog(engines, tp, "not asked for")
    from tests.upstream_lmcache import LMCACHE_VERSION, WheelUnavailable, install

    try:
        return Released(install(), LMCACHE_VERSION, engines, tp)
    except WheelUnavailable as err:
        if wanted == "released":
            raise
        return FromCatalog(engines, tp, str(err))


def write(engines: int, tp: int, reads: int, out: Path, wanted: str = "auto", seed: int = 0) -> dict[str, Any]:
    """Write `reads` texts of the engines' /metrics into `out`, every worker's series moved between two reads."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if not directory or not os.path.isdir(directory) or os.listdir(directory):
        raise SystemExit("bench.lmcache_exposition: PROMETHEUS_MULTIPROC_DIR must name an empty directory, set before start")
    rng = random.Random(seed)
    writer = source(engines, tp, wanted)
    registry = CollectorRegistry()  # what vLLM's /metrics builds over the directory (vllm/v1/metrics/prometheus.py)
    MultiProcessCollector(registry, path=directory)
    out.mkdir(parents=True, exist_ok=True)
    for n in range(reads):
        for e in range(engines):
            requests = [(t, rng.randint(0, t)) for t in (rng.randint(256, 8192) for _ in range(rng.randint(1, 6)))]
            for w in range(tp):
                writer.step(rng, e, w, requests)
        (out / f"read-{n}.txt").write_bytes(generate_latest(registry))
    meta = {"source": writer.name, "note": writer.note, "engines": engines, "tp": tp, "reads": reads}
    (out / "source.json").write_text(json.dumps(meta))
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=8)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--reads", type=int, default=11)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--source", choices=("auto", "released", "catalog"), default="auto")
    args = parser.parse_args(argv)
    meta = write(args.engines, args.tp, args.reads, args.out, args.source)
    print(json.dumps(meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
