"""One simulated rank process: a HiCache on the workload, pushing its metrics to the sidecar."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cache_core.geometry import ModelGeometry
from cache_core.hicache import AdmitStatus, HiCache, HiCacheConfig, Request
from cache_core.instrumentation import CacheMetrics, client_catalog
from cache_core.parallel import ParallelState
from cache_core.storage import FileStorage
from cache_core.workload import Workload, WorkloadConfig
from exporter.catalog import Collector
from exporter.client import RankClient
from exporter.labels import split_rank_labels

log = logging.getLogger("cache_core.rank")
CACHE_TYPE = "UnifiedRadixCache"  # the engine's cache class name, its radix label cache_type
STORAGE_BACKEND = "file"  # the engine's HiCacheFile backend, its storage label storage_backend
MODEL_NAME = "cache-core-demo"  # the scheduler label model_name (served_model_name)
ENGINE_TYPE = "unified"  # the scheduler label engine_type without PD disaggregation
BARRIER_SECONDS = 120.0


@dataclass(frozen=True)
class RankSpec:
    """Everything a rank process needs, picklable for multiprocessing spawn."""

    attn_tp_rank: int
    pp_rank: int
    dp_rank: int
    attn_tp_size: int  # attention tp ranks per dp group (and cp rank)
    pp_size: int
    dp_size: int
    socket_path: str
    storage_root: str
    attn_cp_rank: int = 0
    attn_cp_size: int = 1
    interval: float = 1.0
    requests: int | None = None  # per dp group
    batch: int = 4
    step_delay: float = 0.2  # keeps eight ranks on two cores at a watchable pace
    geometry: ModelGeometry = field(default_factory=lambda: ModelGeometry(layers=5))
    # Small pools, so that a short run already evicts, loads back and prefetches from L3.
    cache: HiCacheConfig = field(default_factory=lambda: HiCacheConfig(device_pages=48, host_pages=96, prefetch_threshold=128))
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    extra_labels: tuple[tuple[str, str], ...] = ()
    # The L3 budget of the whole server (every rank's store together); None: unbounded.
    storage_capacity_bytes: int | None = None

    @property
    def parallel(self) -> ParallelState:
        return ParallelState.from_layout(self.attn_tp_rank, self.pp_rank, self.dp_rank, self.attn_tp_size,
                                         self.pp_size, self.dp_size, self.attn_cp_rank, self.attn_cp_size)


@dataclass
class RankClients:
    """One rank process's connections, one per engine collector (one label set each)."""

    radix: RankClient
    storage: RankClient
    scheduler: RankClient | None  # only on ranks that log scheduler statistics

    def all(self) -> list[RankClient]:
        return [c for c in (self.radix, self.storage, self.scheduler) if c is not None]

    def start(self) -> None:
        for client in self.all():
            client.start()

    def close(self) -> None:
        for client in self.all():
            client.close()


def _client(spec: RankSpec, collector: Collector, labels: dict[str, Any]) -> RankClient:
    rank, static = split_rank_labels(labels)
    return RankClient(spec.socket_path, rank=rank, labels=static, interval=spec.interval,
                      catalog=client_catalog(collector), preset=False, world=spec.parallel.server_world)


def storage_capacity_pages(spec: RankSpec) -> int | None:
    """Each rank's L3 capacity in pages: the server's budget over the bytes one page takes on
    every rank together, the same number on every rank, so that replicas keep the same pages."""
    if spec.storage_capacity_bytes is None:
        return None
    parallel = spec.parallel
    page_all_ranks = parallel.dp_size * sum(
        spec.geometry.shard(tp, parallel.attn_tp_size, pp, parallel.pp_size, cp, parallel.attn_cp_size).page_bytes
        for tp in range(parallel.attn_tp_size) for pp in range(parallel.pp_size) for cp in range(parallel.attn_cp_size))
    return max(1, spec.storage_capacity_bytes // page_all_ranks)


def build_rank(spec: RankSpec) -> tuple[RankClients, HiCache]:
    """The rank's clients and cache, labelled exactly as the engine's three collectors label them."""
    parallel = spec.parallel
    extra = dict(spec.extra_labels)
    clients = RankClients(
        radix=_client(spec, Collector.RADIX, parallel.radix_labels(CACHE_TYPE, extra)),
        storage=_client(spec, Collector.STORAGE, parallel.storage_labels(STORAGE_BACKEND, extra)),
        # Only the attention-TP leaders log scheduler statistics, at their global tp rank, which the
        # sidecar maps to its rank's position through the world.
        scheduler=(_client(spec, Collector.SCHEDULER, parallel.scheduler_labels(MODEL_NAME, ENGINE_TYPE, extra))
                   if parallel.is_stats_logging_rank else None),
    )
    # The KV heads are split over the attention tp group, each cp rank holds its slice of every page.
    shard = spec.geometry.shard(parallel.attn_tp_rank, parallel.attn_tp_size, parallel.pp_rank, parallel.pp_size,
                                parallel.attn_cp_rank, parallel.attn_cp_size)
    storage = FileStorage(Path(spec.storage_root) / f"tp{parallel.tp_rank}-pp{parallel.pp_rank}", shard.page_bytes,
                          storage_capacity_pages(spec))
    metrics = CacheMetrics(clients.radix, clients.storage, clients.scheduler, page_size=shard.model.page_size,
                           pool=spec.cache.pool, write_policy=spec.cache.write_policy)
    cache = HiCache(shard, spec.cache, metrics, storage)
    return clients, cache


def run_batch(cache: HiCache, batch: list[list[int]]) -> int:
    """Run requests through the cache as a scheduler would; returns how many completed."""
    requests = [cache.begin(tokens) for tokens in batch]
    cache.poll(wait=True)  # deterministic: replicas commit the same prefetches at the same step
    running: list[Request] = []
    completed = 0
    for req in requests:
        status = cache.admit(req)
        if status is not AdmitStatus.ADMITTED and running:
            # Running requests hold the device pages we need: let them finish, then retry once.
            for done in running:
                cache.finish(done)
            completed += len(running)
            running = []
            status = cache.admit(req)
        if status is AdmitStatus.ADMITTED:
            running.append(req)
        else:
            cache.abort(req)
    for req in running:
        cache.finish(req)
    cache.flush()  # storage writes land before the next step, so replicas query the same L3 state
    return completed + len(running)


def run_rank(spec: RankSpec, slot: int, steps: Any, completed: Any, stop_step: Any, stop: Any, group_barrier: Any) -> None:
    """Process entry point: run until the request budget, the shared stop step, or `stop` is set.

    `group_barrier` holds the replicas of this dp group in lock-step, one step at a time, as the
    collectives of a real TP group do; the last wait before closing makes every replica's final
    snapshot carry the same totals, so no leader hand-over at shutdown can count work twice.
    """
    torch.set_num_threads(1)
    clients, cache = build_rank(spec)
    workload = Workload(spec.workload, spec.dp_rank)
    clients.start()
    step = done = 0
    try:
        while not stop.is_set():
            if spec.requests is not None and done >= spec.requests:
                break
            if 0 <= stop_step.value <= step:
                break
            size = spec.batch if spec.requests is None else min(spec.batch, spec.requests - done)
            run_batch(cache, [workload.next_request() for _ in range(size)])
            done += size
            step += 1
            steps[slot] = step
            completed[slot] = done
            group_barrier.wait(BARRIER_SECONDS)
            if spec.step_delay:
                time.sleep(spec.step_delay)
    except threading.BrokenBarrierError:
        log.warning("rank %d left the lock-step early (a replica stopped)", slot)
    finally:
        cache.close()
        clients.close()
