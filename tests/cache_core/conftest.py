"""Fixtures: HiCache instances on CPU with never-started rank clients (one per collector), closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_core.geometry import ShardGeometry
from cache_core.hicache import HiCache, HiCacheConfig
from cache_core.instrumentation import CacheMetrics, client_catalog
from cache_core.storage import FileStorage
from exporter.catalog import Collector
from exporter.client import RankClient
from tests.cache_core.support import SHARD

MakeCache = Callable[..., HiCache]
NOWHERE = "/tmp/x-nonexistent.sock"  # the clients are never started: no sidecar needed


def clients(storage: bool = True, scheduler: bool = True) -> tuple[RankClient, RankClient | None, RankClient | None]:
    """Radix, storage and scheduler clients, each with its collector's catalog."""
    def make(collector: Collector) -> RankClient:
        return RankClient(NOWHERE, catalog=client_catalog(collector), preset=False)

    return (make(Collector.RADIX), make(Collector.STORAGE) if storage else None,
            make(Collector.SCHEDULER) if scheduler else None)


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[MakeCache]:
    """Build caches: make_cache(shard=SHARD, l3="l3", cls=HiCache, scheduler=True, **HiCacheConfig fields);
    l3=None: no storage (and no storage client); scheduler=False: a rank that logs no scheduler statistics."""
    caches: list[HiCache] = []

    def build(shard: ShardGeometry = SHARD, l3: str | None = "l3", cls: type[HiCache] = HiCache,
              scheduler: bool = True, **config: Any) -> HiCache:
        cfg = HiCacheConfig(**config)
        radix, storage_client, scheduler_client = clients(storage=l3 is not None, scheduler=scheduler)
        metrics = CacheMetrics(radix, storage_client, scheduler_client, page_size=shard.model.page_size,
                               pool=cfg.pool, write_policy=cfg.write_policy)
        storage = FileStorage(tmp_path / l3, shard.page_bytes) if l3 is not None else None
        cache = cls(shard, cfg, metrics, storage, device="cpu")
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()
        if cache.worker is not None:
            assert not cache.worker._thread.is_alive(), "the storage worker thread must end on close()"
