"""Fixtures: HiCache instances on CPU with a never-started rank client, closed after each test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cache_core.geometry import ShardGeometry
from cache_core.hicache import HiCache, HiCacheConfig
from cache_core.instrumentation import CacheMetrics
from cache_core.storage import FileStorage
from exporter.client import RankClient
from tests.cache_core.support import SHARD

MakeCache = Callable[..., HiCache]


@pytest.fixture
def make_cache(tmp_path: Path) -> Iterator[MakeCache]:
    """Build caches: make_cache(shard=SHARD, l3="l3", cls=HiCache, **HiCacheConfig fields); l3=None: no storage."""
    caches: list[HiCache] = []

    def build(shard: ShardGeometry = SHARD, l3: str | None = "l3", cls: type[HiCache] = HiCache, **config: Any) -> HiCache:
        client = RankClient("/tmp/x-nonexistent.sock")  # never started: no sidecar needed
        metrics = CacheMetrics(client, shard.model.page_size)
        storage = FileStorage(tmp_path / l3, shard.page_bytes) if l3 is not None else None
        cache = cls(shard, HiCacheConfig(**config), metrics, storage, device="cpu")
        caches.append(cache)
        return cache

    yield build
    for cache in caches:
        cache.close()
        if cache.worker is not None:
            assert not cache.worker._thread.is_alive(), "the storage worker thread must end on close()"
