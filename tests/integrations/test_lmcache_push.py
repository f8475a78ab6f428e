"""The push door for LMCache: the released `PrometheusLogger`, its classes set by exporter.integrations.lmcache,
pushing to a real `hicache-exporter serve --profile lmcache` sidecar.

Two vLLM DP replicas of a TP-4 engine: 8 spawned processes, one per worker, each with LMCache's metadata
as vLLM fills it (worker_id 0-3 in each replica, world_size 4, engine_id `<uuid>_dp0` / `_dp1`, the
suffix vLLM appends per DP engine). Each makes its logger through `PrometheusLogger.GetOrCreate` after
`install()` (replica 0) or `register()` (replica 1, vLLM's general plugin), counts its replica's
requests (every TP worker alike, different per replica) and its own shard's bytes through the released
`LMCStatsMonitor`, and makes `LMCacheStatsLogger`'s one step, `log_prometheus(monitor.get_stats_and_clear())`
(observability.py:1975-1982). Worker 0 of each replica also holds the replica's scheduler logger (a
label view, observability.py:1919-1929, as in vLLM's in-process executor), whose per-engine gauge
`scheduler_unfinished_requests_count` is fed by `set_function`, as the connector does.

Then worker 2 of replica 1 calls `reset_counters()` in its process (its prometheus_client counter drops
to 0: prometheus_client was imported before LMCache set PROMETHEUS_MULTIPROC_DIR, so values are in-process),
and every worker counts a second interval: every rollup stays where it was across the reset and ends
exact, while that worker's own series start again in a new epoch.
"""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import wait_until
from tests.integrations.support import SPAWN, ServeProcess, run_processes
from tests.upstream_lmcache import wheel_path

pytestmark = pytest.mark.usefixtures("released_wheel")  # the wheel checked once, before any process starts

REPO = Path(__file__).resolve().parents[2]
TP = 4
DP = 2
MODEL = "Qwen/Qwen3-8B"
SERVED = "qwen3-8b"
RESET = (1, 2)  # (replica, worker) that resets its counters
SYNC_TIMEOUT = 120  # a barrier a process never reaches breaks after this, failing the test
SETTLE = 60.0

# Per replica, what every one of its TP workers retrieves alike: (tokens requested, tokens hit).
RETRIEVES_1 = {0: ((768, 768), (2048, 1792)), 1: ((1024, 512),)}
RETRIEVES_2 = {0: ((1024, 1024),), 1: ((256, 256),)}
HIT_1 = {0: 2560, 1: 512}
HIT_2 = {0: 1024, 1: 256}
UNFINISHED = {0: 3, 1: 5}  # each replica's scheduler: requests not finished yet (a set_function gauge)


def read_bytes_1(replica: int, worker: int) -> int:
    """What a worker reads of its own KV shard in interval 1: distinct for each of the 8."""
    return (replica * TP + worker + 1) * 1_048_576


def read_bytes_2(replica: int, worker: int) -> int:
    return (replica * TP + worker + 1) * 65_536


def hot_cache(replica: int, worker: int) -> int:
    """What a worker's hot-cache gauge callback returns (a set_function gauge, local_cpu_backend.py:113-119)."""
    return 100 + 10 * replica + worker


def labels(replica: int, worker: int, role: str = "worker") -> dict[str, str]:
    return {"model_name": MODEL, "worker_id": str(worker), "role": role, "served_model_name": SERVED}


def worker_process(replica: int, worker: int, engine_id: str, socket_path: str, barrier: Any, conn: Any) -> None:
    """One vLLM worker of one DP replica, with LMCache's logger pushing to the sidecar."""
    import os

    import prometheus_client  # before LMCache sets PROMETHEUS_MULTIPROC_DIR: values stay in-process
    from prometheus_client import REGISTRY

    from tests.upstream_lmcache import install as install_released

    lmcache = install_released()
    import exporter.integrations.lmcache as hook

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(os.path.dirname(socket_path), "mp")  # not /tmp's
    if replica == 0:
        hook.install(socket_path, interval=0.05)
    else:
        os.environ["HICACHE_EXPORTER_SOCKET"] = socket_path
        os.environ["HICACHE_EXPORTER_PUSH_INTERVAL"] = "0.05"
        hook.register()
        hook.register()
    assert lmcache.PrometheusLogger._counter_cls is hook.PushingCounter

    def metadata(role: str) -> Any:
        # As vllm_service_factory.py:145-159 fills it; engine_id from vllm/v1/engine/core.py:1374-1382.
        return lmcache.LMCacheMetadata(
            model_name=MODEL, world_size=TP, local_world_size=TP * DP, worker_id=worker,
            local_worker_id=worker + replica * TP, kv_dtype=None, kv_shape=(36, 2, 256, 8 // TP, 128),
            role=role, served_model_name=SERVED, engine_id=engine_id)

    logger = lmcache.PrometheusLogger.GetOrCreate(metadata("worker"))
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    logger.local_cpu_hot_cache_count.set_function(lambda: hot_cache(replica, worker))
    if worker == 0:
        scheduler = lmcache.PrometheusLogger.GetOrCreate(metadata("scheduler"))
        scheduler.scheduler_unfinished_requests_count.set_function(lambda: UNFINISHED[replica])

    def interval(retrieves: tuple[tuple[int, int], ...], read_bytes: int) -> None:
        for tokens, hit in retrieves:
            monitor.on_retrieve_finished(monitor.on_retrieve_request(tokens), hit)  # observability.py:391-409
        monitor.update_interval_remote_read_metrics(read_bytes)  # num_remote_read_{requests,bytes} (531-533)
        logger.log_prometheus(monitor.get_stats_and_clear())

    def own_hit_tokens() -> float | None:
        return REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", labels(replica, worker))

    interval(RETRIEVES_1[replica], read_bytes_1(replica, worker))
    report: dict[str, Any] = {"hit_tokens": [own_hit_tokens()]}
    barrier.wait(SYNC_TIMEOUT)  # interval 1 is counted
    barrier.wait(SYNC_TIMEOUT)  # the parent has read the sidecar
    if (replica, worker) == RESET:
        logger.reset_counters()
        logger.reset_histograms()
        report["hit_tokens"].append(own_hit_tokens())
    barrier.wait(SYNC_TIMEOUT)  # the reset is done
    barrier.wait(SYNC_TIMEOUT)  # the parent has read the sidecar again
    interval(RETRIEVES_2[replica], read_bytes_2(replica, worker))
    report["hit_tokens"].append(own_hit_tokens())
    report["prometheus_class"] = type(logger.counter_num_hit_tokens).__mro__[1:3]
    report["prometheus_class"] = [cls.__name__ for cls in report["prometheus_class"]]
    report["is_prometheus_counter"] = isinstance(logger.counter_num_hit_tokens, prometheus_client.Counter)
    barrier.wait(SYNC_TIMEOUT)  # interval 2 is counted
    barrier.wait(SYNC_TIMEOUT)  # the parent has read the sidecar a last time
    conn.send(report)


class Serve(ServeProcess):
    """The sidecar serving the lmcache profile to ranks that push."""

    def __init__(self, directory: Path) -> None:
        super().__init__(directory, {}, ["--profile", "lmcache"])

    def ranks(self) -> list[dict[str, Any]]:
        ranks: list[dict[str, Any]] = self.get_json("/api/v1/ranks")["ranks"]
        return ranks


def settled(sidecar: Serve, expected: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> bool:
    """Every expected (name, labels) has exactly one sample, of exactly the expected value."""
    scrape = sidecar.scrape()
    for (name, wanted), value in expected.items():
        found = scrape.find(name, **dict(wanted))
        if len(found) != 1 or found[0].value != value:
            return False
    return True


# A rollup keeps the static labels but worker_id (the profile's derived label).
ROLLUP = (("model_name", MODEL), ("role", "worker"), ("served_model_name", SERVED))


def rank_series(replica: int, worker: int, role: str = "worker") -> tuple[tuple[str, str], ...]:
    return (("tp_rank", str(worker)), ("pp_rank", "0"), ("dp_rank", str(replica)), ("role", role),
            ("worker_id", str(worker)))


def expected_at(step: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What the sidecar shows after interval 1 (step 1), after the reset (2) and after interval 2 (3)."""
    hit = {r: HIT_1[r] + (HIT_2[r] if step == 3 else 0) for r in range(DP)}
    read = {(r, w): read_bytes_1(r, w) + (read_bytes_2(r, w) if step == 3 else 0) for r in range(DP) for w in range(TP)}
    expected = {
        # Replicated: each replica's furthest worker, summed over the replicas: ONE worker's count per replica.
        ("lmcache_rollup_num_hit_tokens_total", ROLLUP): float(sum(hit.values())),
        # Per shard: every worker's own bytes, summed over all 8.
        ("lmcache_rollup_num_remote_read_bytes_total", ROLLUP): float(sum(read.values())),
        # Per engine: the two schedulers' gauges, summed.
        ("lmcache_rollup_scheduler_unfinished_requests_count", (("role", "scheduler"),)): float(sum(UNFINISHED.values())),
    }
    for r in range(DP):
        for w in range(TP):
            restarted = (r, w) == RESET and step >= 2
            expected[("lmcache_num_hit_tokens_total", rank_series(r, w))] = float(
                (HIT_2[r] if step == 3 else 0) if restarted else hit[r])
            expected[("lmcache_num_remote_read_bytes_total", rank_series(r, w))] = float(
                (read_bytes_2(r, w) if step == 3 else 0) if restarted else read[(r, w)])
            expected[("lmcache_local_cpu_hot_cache_count", rank_series(r, w))] = float(hot_cache(r, w))
        expected[("lmcache_scheduler_unfinished_requests_count", rank_series(r, 0, "scheduler"))] = float(UNFINISHED[r])
    return expected



def test_two_dp_replicas_of_tp4_push_per_rank_series_and_exact_rollups_through_a_reset(
    socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)  # LMCache's in-process mode: a reset drops to 0
    monkeypatch.setenv("HICACHE_LMCACHE_WHEEL", str(wheel_path()))
    sidecar = Serve(socket_dir)
    base = uuid.uuid4().hex
    barrier = SPAWN.Barrier(DP * TP + 1)
    arguments = [(r, w, f"{base}_dp{r}", sidecar.socket_path, barrier) for r in range(DP) for w in range(TP)]
    observed: dict[str, Any] = {}
    try:
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(run_processes, worker_process, arguments, receive=True, timeout=SYNC_TIMEOUT * 4)
            try:
                barrier.wait(SYNC_TIMEOUT)
                wait_until(lambda: settled(sidecar, expected_at(1)), SETTLE)
                scrape = sidecar.scrape()
                observed["labels"] = sorted(scrape.find("lmcache_num_hit_tokens_total", dp_rank="1", tp_rank="3")[0].labels)
                observed["hit_series"] = len(scrape.find("lmcache_num_hit_tokens_total"))
                observed["rollup_labels"] = [s.labels for s in scrape.find("lmcache_rollup_num_hit_tokens_total")]
                barrier.wait(SYNC_TIMEOUT)
                barrier.wait(SYNC_TIMEOUT)
                # The reset worker's client said hello in a new epoch: a restart of that rank only.
                wait_until(lambda: sorted(r["restarts"] for r in sidecar.ranks()) == [0] * (DP * TP + DP - 1) + [1],
                           SETTLE)
                wait_until(lambda: settled(sidecar, expected_at(2)), SETTLE)
                observed["restarted"] = [(r["tp_rank"], r["dp_rank"]) for r in sidecar.ranks() if r["restarts"]]
                barrier.wait(SYNC_TIMEOUT)
                barrier.wait(SYNC_TIMEOUT)
                wait_until(lambda: settled(sidecar, expected_at(3)), SETTLE)
                barrier.wait(SYNC_TIMEOUT)
            except BaseException:
                barrier.abort()
                running.exception()
                raise
            reports = running.result()
    finally:
        log = sidecar.stop()
    assert "Traceback" not in log, log
    assert observed["labels"] == ["dp_rank", "model_name", "pp_rank", "role", "served_model_name", "tp_rank", "worker_id"]
    assert observed["hit_series"] == DP * TP  # the schedulers count no tokens: no series for them
    assert observed["rollup_labels"] == [dict(ROLLUP)]
    assert observed["restarted"] == [(RESET[1], RESET[0])]
    by_worker = dict(zip([(r, w) for r in range(DP) for w in range(TP)], reports))
    # The engine's own prometheus_client counters: what LMCache intends, the reset included.
    assert by_worker[RESET]["hit_tokens"] == [512.0, 0.0, 256.0]
    assert by_worker[(0, 1)]["hit_tokens"] == [2560.0, 3584.0]
    assert all(report["is_prometheus_counter"] for report in reports)
    assert reports[0]["prometheus_class"] == ["_Pushing", "Counter"]
