"""Shared helpers for the cache_core tests: a small geometry, L3 seeding and counter snapshots."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from cache_core.geometry import ModelGeometry
from cache_core.hicache import HiCache
from cache_core.instrumentation import DEFERRED, UNFULFILLED
from cache_core.storage import FileStorage, chained_hashes

GEOM = ModelGeometry(layers=2, kv_heads=2, head_dim=8, page_size=4)
SHARD = GEOM.shard(0, 1, 0, 1)
PS = GEOM.page_size

# The contract (DESIGN.md section 4): pre-set reasons, in this order.
PRESET_REASONS = (
    "below_threshold", "host_capacity", "device_capacity", "device_covered", "storage_transfer",
    "deadline", "anchor_lost", "aux_window_trim", "device_overlap", "cache_admission_shortfall", "dropped",
)


def toks(pages: int, base: int, extra: int = 0) -> list[int]:
    """`pages` full pages of distinct token ids starting at `base`, plus `extra` loose tokens."""
    return list(range(base, base + pages * PS + extra))


def pages_of(tokens: Sequence[int]) -> list[tuple[int, ...]]:
    return [tuple(tokens[i * PS:(i + 1) * PS]) for i in range(len(tokens) // PS)]


def hashes_of(tokens: Sequence[int]) -> list[bytes]:
    return chained_hashes(pages_of(tokens))


def seed_l3(storage: FileStorage, tokens: Sequence[int], indices: Sequence[int] | None = None, seed: int = 0) -> list[bytes]:
    """Put the pages `indices` (default: all full pages) of `tokens` into L3 with random bytes."""
    hashes = hashes_of(tokens)
    rng = random.Random(seed)
    for i in (range(len(hashes)) if indices is None else indices):
        storage.put(hashes[i], rng.randbytes(storage.page_bytes))
    return hashes


def series(cache: HiCache, family: str) -> dict[tuple[str, ...], float]:
    """Every child of `family` held by the client of its collector, by label values."""
    return {values: child.value for (name, values), child in cache.metrics.client_for(family).metrics.items()  # type: ignore[union-attr]
            if name == family}


def all_children(cache: HiCache) -> dict:
    """Every child of every client of the cache, by (family, label values)."""
    out: dict = {}
    for client in cache.metrics.clients.values():
        if client is not None:
            out.update(client.metrics.items())
    return out


def unfulfilled(cache: HiCache) -> dict[str, float]:
    return {values[0]: value for values, value in series(cache, UNFULFILLED).items()}


def deferred(cache: HiCache) -> dict[str, float]:
    return {values[0]: value for values, value in series(cache, DEFERRED).items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """The reasons that moved, with how much (a reason absent before counts from 0)."""
    moved = {key: after[key] - before.get(key, 0) for key in after}
    return {key: value for key, value in moved.items() if value != 0}


def hist_count(hist: Any) -> int:
    return hist.cumulative()[0][-1]
