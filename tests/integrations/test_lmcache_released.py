"""LMCache 0.5.6's own `PrometheusLogger` in its own multiprocess mode: a characterization of the released code.

Four spawned worker processes, `worker_id` 0-3 of one TP-4 engine, each build the released logger
(tests.upstream_lmcache) for their metadata, with `PROMETHEUS_MULTIPROC_DIR` set to a temporary
directory set before they start (LMCache's own multiprocess mode). They count the same lookups and retrieves (every TP worker
counts each request alike) and their own shard's bytes, through the released `LMCStatsMonitor`, and
make the one step of `LMCacheStatsLogger.log_worker` (observability.py:1975-1982),
`log_prometheus(monitor.get_stats_and_clear())`. The test reads the directory with prometheus_client's
`MultiProcessCollector`, as a `/metrics` served over that directory does. No sidecar here: this is
what the sidecar's rollup will be compared with.

What the released code does, as asserted below: the sum over worker_id of a token counter every
worker counts alike is TP (4) times the engine's tokens; per-worker bytes are each worker's own.
`reset_counters()` in one worker changes nothing in the files (prometheus_client cannot clear in
multiprocess mode; the re-made children read their values back), so its counters go on from where
they were; only where the directory was set after prometheus_client's import (then values are
in-process and no file is written at all) does a reset drop a counter to 0.

Families the logger registers (read from the running logger, `registered_families`; names below
without their `lmcache:` prefix), 94 in all, every one labelled model_name, worker_id, role,
served_model_name (observability.py:1905-1913):
* 23 counters (observability.py:935-1063, 1449-1458): num_retrieve_requests, num_store_requests,
  num_lookup_requests, num_requested_tokens, num_hit_tokens, num_stored_tokens, num_lookup_tokens,
  num_lookup_hits, num_vllm_hit_tokens, num_prompt_tokens, num_remote_read_requests,
  num_remote_read_bytes, num_remote_write_requests, num_remote_write_bytes, local_cpu_evict_count,
  local_cpu_evict_keys_count, local_cpu_evict_failed_count, forced_unpin_count,
  lookup_0_hit_requests, num_slow_retrieval_by_time, num_slow_retrieval_by_speed,
  remote_ping_errors, remote_ping_successes;
* 20 histograms: time_to_retrieve, time_to_store, time_to_lookup, retrieve_process_tokens_time,
  retrieve_broadcast_time, retrieve_to_gpu_time, remote_backend_batched_get_blocking_time,
  instrumented_connector_batched_get_time, store_process_tokens_time, store_from_gpu_time,
  store_put_time, retrieve_speed, store_speed, p2p_time_to_transfer, p2p_transfer_speed,
  remote_time_to_get, remote_time_to_put, remote_time_to_get_sync, request_cache_hit_rate,
  request_cache_lifespan;
* 8 gauges with multiprocess_mode "sum": local_cache_usage, remote_cache_usage, local_storage_usage,
  active_memory_objs_count, pinned_memory_objs_count (1079-1113), and the dynamic
  storage_events_{ongoing,done,not_found}_count (1549-1557);
* 43 gauges with multiprocess_mode "livemostrecent": retrieve_hit_rate, lookup_hit_rate (1065-1077),
  remote_ping_latency, remote_ping_error_code (1443-1464), and 39 dynamic ones (1495-1675):
  local_cpu_hot_cache_count, local_cpu_keys_in_request_count, kv_msg_queue_size,
  remote_put_task_num, pin_monitor_pinned_objects_count, lmcache_is_healthy,
  get_blocking_failed_count, put_failed_count, chunk_statistics_{enabled, total_requests,
  total_chunks, unique_chunks, reuse_rate, bloom_filter_size_mb, bloom_filter_fill_rate,
  file_count, current_file_size}, scheduler_unfinished_requests_count,
  connector_{load_specs, request_trackers, kv_caches, layerwise_retrievers, invalid_block_ids,
  requests_priority}_count, periodic_threads_{total, running, active}_count and
  periodic_threads_{critical, high, medium, low}_{total, running, active}.

The dynamic gauges get their values from `set_function` callbacks (e.g.
v1/storage_backend/local_cpu_backend.py:117, storage_manager.py:308), which prometheus_client's
multiprocess mode never writes to the files (metrics.py:489-501 replaces the in-process sample
only): read from the directory, a "sum" one stays 0 and a "livemostrecent" one, never set with a
timestamp, is absent (multiprocess.py:119-124).
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from tests.integrations.support import SPAWN, run_processes

pytestmark = pytest.mark.usefixtures("released_wheel")  # the wheel checked once, before any process starts

TP = 4
MODEL = "Qwen/Qwen3-8B"
SERVED = "qwen3-8b"
LABEL_NAMES = {"model_name", "worker_id", "role", "served_model_name"}
RESET_WORKER = 2
SYNC_TIMEOUT = 60  # a barrier a process never reaches breaks after this, failing the test

# The requests every TP worker sees alike: (tokens looked up, tokens hit), (tokens retrieved, tokens loaded).
LOOKUPS_1 = ((1024, 768), (512, 0), (2048, 2048))
RETRIEVES_1 = ((768, 768), (2048, 1792))
LOOKUPS_2 = ((4096, 1024),)
RETRIEVES_2 = ((1024, 1024),)
# What each worker reads of its own KV shard and holds in its local cache: distinct per worker, so
# that a series carrying another worker's number shows.
READ_BYTES_1 = {0: 1_048_576, 1: 2_097_152, 2: 3_145_728, 3: 4_194_304}
READ_BYTES_2 = {0: 65_536, 1: 131_072, 2: 196_608, 3: 262_144}
CACHE_BYTES = {0: 10_000_000, 1: 20_000_000, 2: 30_000_000, 3: 40_000_000}
HOT_CACHE_ENTRIES = 7  # what two dynamic gauges' callbacks return in every worker
ONGOING_EVENTS = 5

Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def labels(worker_id: int) -> tuple[tuple[str, str], ...]:
    """One worker's label set, as `_metadata_to_labels` makes it (observability.py:1905-1913), sorted."""
    return (("model_name", MODEL), ("role", "worker"), ("served_model_name", SERVED), ("worker_id", str(worker_id)))


def record(monitor: Any, lookups: tuple[tuple[int, int], ...], retrieves: tuple[tuple[int, int], ...],
           read_bytes: int) -> None:
    """Count requests and a shard read through the released monitor, as the vLLM adapter does."""
    for tokens, hit in lookups:
        # on_lookup_request: num_lookup_requests += 1, num_lookup_tokens += tokens (observability.py:346-347);
        # on_lookup_finished: num_lookup_hits += hit, and lookup_0_hit_requests on a miss (372-374).
        monitor.on_lookup_finished(monitor.on_lookup_request(tokens), hit)
    for tokens, loaded in retrieves:
        # on_retrieve_request: num_requested_tokens, num_retrieve_requests (391-392);
        # on_retrieve_finished: num_hit_tokens += loaded (409).
        monitor.on_retrieve_finished(monitor.on_retrieve_request(tokens), loaded)
    monitor.update_interval_remote_read_metrics(read_bytes)  # num_remote_read_{requests,bytes} (531-533)


def registered_families(registry: Any, before: set[Any]) -> dict[str, tuple[str, str | None]]:
    """Every family registered since `before`: name -> (type, multiprocess_mode for a gauge)."""
    # prometheus_client keeps no public list of a registry's collectors; `_collector_to_names` and a
    # gauge's `_multiprocess_mode` are its own attributes (0.26).
    return {
        metric.name: (metric.type, getattr(collector, "_multiprocess_mode", None) if metric.type == "gauge" else None)
        for collector in set(registry._collector_to_names) - before
        for metric in collector.describe()
    }


def metadata(lmcache: Any, worker_id: int) -> Any:
    """A vLLM worker's metadata, as create_lmcache_metadata fills it in (integration/vllm/utils.py:429-442)."""
    return lmcache.LMCacheMetadata(
        model_name=MODEL, world_size=TP, local_world_size=TP, worker_id=worker_id, local_worker_id=worker_id,
        kv_dtype=None, kv_shape=(36, 2, 256, 8 // TP, 128), role="worker", served_model_name=SERVED,
    )


def worker(worker_id: int, barrier: Any, conn: Any) -> None:
    """One LMCache worker of the TP-4 engine: two logged intervals, with the parent reading the files between."""
    from prometheus_client import REGISTRY

    from tests.upstream_lmcache import install

    lmcache = install()
    before = set(REGISTRY._collector_to_names)
    prometheus_logger = lmcache.PrometheusLogger.GetOrCreate(metadata(lmcache, worker_id))  # as the vLLM adapter does
    families = registered_families(REGISTRY, before)
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    # As the storage backends do (local_cpu_backend.py:117, storage_manager.py:308).
    prometheus_logger.local_cpu_hot_cache_count.set_function(lambda: HOT_CACHE_ENTRIES)
    prometheus_logger.storage_events_ongoing_count.set_function(lambda: ONGOING_EVENTS)

    record(monitor, LOOKUPS_1, RETRIEVES_1, READ_BYTES_1[worker_id])
    monitor.update_local_cache_usage(CACHE_BYTES[worker_id])  # gauge lmcache:local_cache_usage (520, 1080)
    prometheus_logger.log_prometheus(monitor.get_stats_and_clear())
    barrier.wait(SYNC_TIMEOUT)  # interval 1 is in the files
    barrier.wait(SYNC_TIMEOUT)  # the parent has read them
    reset_warnings: list[str] = []
    if worker_id == RESET_WORKER:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prometheus_logger.reset_counters()
        reset_warnings = [str(warning.message) for warning in caught]
    barrier.wait(SYNC_TIMEOUT)  # the reset is done
    barrier.wait(SYNC_TIMEOUT)  # the parent has read the files again
    record(monitor, LOOKUPS_2, RETRIEVES_2, READ_BYTES_2[worker_id])
    prometheus_logger.log_prometheus(monitor.get_stats_and_clear())
    conn.send({"families": families, "reset_warnings": reset_warnings})


def late_directory_worker(directory: str, conn: Any) -> None:
    """A worker whose PROMETHEUS_MULTIPROC_DIR is set only after prometheus_client was imported."""
    # As LMCache's `_ensure_multiprocess_dir` (observability.py:909-915) sets its default when none is set.
    import os

    from prometheus_client import REGISTRY

    from tests.upstream_lmcache import install

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory  # a temporary stand-in for /tmp/lmcache_prometheus
    lmcache = install()
    prometheus_logger = lmcache.PrometheusLogger.GetOrCreate(metadata(lmcache, 0))
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    record(monitor, LOOKUPS_1, RETRIEVES_1, READ_BYTES_1[0])
    prometheus_logger.log_prometheus(monitor.get_stats_and_clear())
    hit_tokens = [REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", dict(labels(0)))]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prometheus_logger.reset_counters()
    hit_tokens.append(REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", dict(labels(0))))
    conn.send({"hit_tokens": hit_tokens, "reset_warnings": len(caught), "files": sorted(os.listdir(directory))})


def read(directory: Path) -> Series:
    """Every series in the multiprocess directory, as a `/metrics` over it serves them: (sample name, labels) -> value."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in registry.collect()
        for sample in family.samples
    }


def value(series: Series, name: str, worker_id: int) -> float:
    return series[(name, labels(worker_id))]


def summed(series: Series, name: str) -> float:
    """The sum over worker_id of one family's series: what a dashboard's `sum(...)` shows."""
    return sum(v for (sample, _), v in series.items() if sample == name)


def run_engine(directory: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Series], list[dict[str, Any]]]:
    """Run the four workers; return the directory read after interval 1, after the reset and at the end, and their reports."""
    # Set before the workers import prometheus_client, which picks its multiprocess value class on import
    # (prometheus_client/values.py:152-163); set later, it changes nothing (the last test).
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    barrier = SPAWN.Barrier(TP + 1)
    reads: list[Series] = []

    def step() -> None:
        barrier.wait(SYNC_TIMEOUT)

    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_processes, worker, [(worker_id, barrier) for worker_id in range(TP)], receive=True)
        try:
            step()
            reads.append(read(directory))
            step()
            step()
            reads.append(read(directory))
            step()
        except BaseException:
            barrier.abort()  # the workers stop waiting (their tracebacks are in the captured stderr)
            running.exception()
            raise
        reports = running.result()
    reads.append(read(directory))
    return reads, reports



@pytest.fixture(scope="module")
def engine(released_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Series], list[dict[str, Any]]]:
    """One run of the four workers, shared by the tests of this module (spawning them costs seconds)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return run_engine(tmp_path_factory.mktemp("lmcache_prometheus"), monkeypatch)


def test_every_family_is_labelled_per_worker_and_the_logger_registers_94(engine) -> None:
    (after_1, _, after_2), reports = engine
    families = reports[0]["families"]
    assert all(report["families"] == families for report in reports)
    kinds = sorted((kind, mode or "") for kind, mode in families.values())
    assert {kind: kinds.count(kind) for kind in set(kinds)} == {
        ("counter", ""): 23, ("histogram", ""): 20, ("gauge", "sum"): 8, ("gauge", "livemostrecent"): 43}
    assert len(families) == 94
    assert families["lmcache:num_hit_tokens"] == ("counter", None)
    assert families["lmcache:num_remote_read_bytes"] == ("counter", None)
    assert families["lmcache:local_cache_usage"] == ("gauge", "sum")
    assert families["lmcache:lookup_hit_rate"] == ("gauge", "livemostrecent")
    assert families["lmcache:time_to_retrieve"] == ("histogram", None)
    for series in (after_1, after_2):
        for name, label_set in series:
            assert LABEL_NAMES <= dict(label_set).keys(), name
        assert {dict(label_set)["worker_id"] for _, label_set in series} == {"0", "1", "2", "3"}


def test_per_worker_series_hold_each_workers_own_bytes(engine) -> None:
    (after_1, _, after_2), _ = engine
    for worker_id in range(TP):
        assert value(after_1, "lmcache:num_remote_read_bytes_total", worker_id) == READ_BYTES_1[worker_id]
        assert value(after_2, "lmcache:num_remote_read_bytes_total", worker_id) == (
            READ_BYTES_1[worker_id] + READ_BYTES_2[worker_id])
        assert value(after_2, "lmcache:num_remote_read_requests_total", worker_id) == 2
        # multiprocess_mode "sum" adds up processes with the same labels; worker_id keeps them apart.
        assert value(after_2, "lmcache:local_cache_usage", worker_id) == CACHE_BYTES[worker_id]
    assert summed(after_2, "lmcache:num_remote_read_bytes_total") == 10_485_760 + 655_360  # bytes do add up


def test_the_sum_over_worker_id_of_a_replicated_counter_is_tp_times_what_one_worker_counted(engine) -> None:
    (after_1, _, after_2), _ = engine
    # Every worker counted the same 4 lookups of 7680 tokens, 3840 of them hit, and 3 retrieves of
    # 3840 tokens, 3584 of them loaded: the engine's truth.
    for worker_id in range(TP):
        assert value(after_1, "lmcache:num_lookup_tokens_total", worker_id) == 3584
        assert value(after_2, "lmcache:num_lookup_tokens_total", worker_id) == 7680
        assert value(after_2, "lmcache:num_lookup_hits_total", worker_id) == 3840
        assert value(after_2, "lmcache:num_lookup_requests_total", worker_id) == 4
        assert value(after_2, "lmcache:lookup_0_hit_requests_total", worker_id) == 1
        assert value(after_2, "lmcache:num_requested_tokens_total", worker_id) == 3840
        assert value(after_2, "lmcache:num_hit_tokens_total", worker_id) == 3584
        assert value(after_2, "lmcache:num_retrieve_requests_total", worker_id) == 3
        # A livemostrecent gauge of the last interval alone (get_stats_and_clear, observability.py:697, 826).
        assert value(after_2, "lmcache:lookup_hit_rate", worker_id) == 0.25
    # LMCache's over-count under TP: the sum over worker_id is 4x the engine's tokens.
    assert summed(after_2, "lmcache:num_hit_tokens_total") == 14_336 == TP * 3584
    assert summed(after_2, "lmcache:num_lookup_tokens_total") == 30_720 == TP * 7680
    assert summed(after_2, "lmcache:num_lookup_hits_total") == 15_360 == TP * 3840


def test_reset_counters_in_multiprocess_mode_leaves_the_files_as_they_were(engine) -> None:
    (after_1, after_reset, after_2), reports = engine
    # reset_counters() calls clear() on each counter, then labels() again (observability.py:1879-1889).
    # prometheus_client does not clear in multiprocess mode (metrics.py:255-264: it warns and drops
    # only the in-process children), and the child labels() makes anew reads its value back from the
    # process's file (values.py:101). So the worker's counters fall nowhere, not even in the process:
    assert reports[RESET_WORKER]["reset_warnings"] == [
        "Clearing labels has not been implemented in multi-process mode yet"] * 23
    assert [report["reset_warnings"] for worker_id, report in enumerate(reports) if worker_id != RESET_WORKER] == [[]] * 3
    assert after_reset == after_1
    assert value(after_reset, "lmcache:num_hit_tokens_total", RESET_WORKER) == 2560
    assert value(after_reset, "lmcache:num_remote_read_bytes_total", RESET_WORKER) == READ_BYTES_1[RESET_WORKER]
    # ... and the next interval counts on from there, like the workers that did not reset.
    assert value(after_2, "lmcache:num_hit_tokens_total", RESET_WORKER) == 3584
    assert value(after_2, "lmcache:num_lookup_tokens_total", RESET_WORKER) == 7680
    assert value(after_2, "lmcache:num_remote_read_bytes_total", RESET_WORKER) == (
        READ_BYTES_1[RESET_WORKER] + READ_BYTES_2[RESET_WORKER])


def test_gauges_fed_by_callbacks_never_reach_the_multiprocess_files(engine) -> None:
    (_, _, after_2), _ = engine
    names = {name for name, _ in after_2}
    assert "lmcache:local_cpu_hot_cache_count" not in names  # livemostrecent, never set: absent
    assert not any(name.startswith("lmcache:periodic_threads_") or name.startswith("lmcache:chunk_statistics_")
                   for name in names)
    for worker_id in range(TP):  # "sum": the child's file entry, 0, whatever the callback returns
        assert value(after_2, "lmcache:storage_events_ongoing_count", worker_id) == 0
    # What the directory does hold: the 23 counters (log_prometheus increments each, by 0 if need be,
    # observability.py:1681-1686), the 8 "sum" gauges, the 4 livemostrecent gauges log_prometheus
    # sets, and the 4 histograms the two intervals observed.
    counted = {name.removesuffix("_total") for name in names if name.endswith("_total")}
    assert len(counted) == 23
    histograms = {name.removesuffix("_bucket") for name in names if name.endswith("_bucket")}
    # Durations, speeds and hit rates of zero are dropped (observability.py:703-722, 762-766), so the timed ones are there
    # when the clock moved between a request and its end, as it does but need not.
    timed = {"lmcache:retrieve_speed", "lmcache:time_to_lookup", "lmcache:time_to_retrieve"}
    assert histograms - timed == {"lmcache:request_cache_hit_rate"}
    for worker_id in range(TP):  # the hit rate of each finished lookup that hit: 0.75, 1.0, then 0.25
        assert value(after_2, "lmcache:request_cache_hit_rate_count", worker_id) == 3
        assert value(after_2, "lmcache:request_cache_hit_rate_sum", worker_id) == 2.0
    gauges = names - {f"{name}_total" for name in counted} - {
        f"{name}{suffix}" for name in histograms for suffix in ("_bucket", "_count", "_sum")}
    assert gauges == {
        "lmcache:local_cache_usage", "lmcache:remote_cache_usage", "lmcache:local_storage_usage",
        "lmcache:active_memory_objs_count", "lmcache:pinned_memory_objs_count",
        "lmcache:storage_events_ongoing_count", "lmcache:storage_events_done_count",
        "lmcache:storage_events_not_found_count",
        "lmcache:retrieve_hit_rate", "lmcache:lookup_hit_rate", "lmcache:remote_ping_latency",
        "lmcache:remote_ping_error_code",
    }


def test_a_directory_set_after_prometheus_client_is_imported_gets_no_files_and_a_reset_zeroes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # prometheus_client picks in-process or file-backed values once, on import (values.py:152-163):
    # LMCache setting the variable later changes only clear()'s warning, not where values live.
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    [report] = run_processes(late_directory_worker, [(str(tmp_path),)], receive=True)
    assert report == {"hit_tokens": [2560.0, 0.0], "reset_warnings": 23, "files": []}
