"""The cache's metric children, each bound through the client of the engine collector that emits it.

A rank process of the engine labels its series three ways, one label set per collector (radix,
storage, scheduler; see the catalog header). cache_core gives each collector its own RankClient
(one connection, one rank identity) whose catalog holds only that collector's families, and binds
every family through the client its catalog entry names: a family bound on another collector's
client is an error.

cache_core models the engine's cache-mode HiCache (`--hicache-mem-layout` with a resident host
cache, not `buffer_only`), so it emits only the storage reasons of that mode's code paths.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exporter.catalog import Catalog, Collector, default_catalog
from exporter.client import CounterChild, GaugeChild, HistogramChild, RankClient

UNFULFILLED = "storage_prefetch_unfulfilled_tokens_total"
DEFERRED = "storage_prefetch_deferred_tokens_total"
DROPPED = "hicache_dropped_tokens_total"
PREFILL = "prefill_effective_tokens_total"
PREFILL_MODES = ("input", "device_hit", "host_hit", "storage_hit")
GB = 1e9

# Unfulfilled reasons that the engine's cache-mode paths emit. The others are pre-set at 0 (the
# catalog's preset) and stay there: device_covered, anchor_lost and shrunk come from buffer-mode
# paths (unified_radix_cache.py:3063-3105, buffer_mode/pipeline.py:1588), unservable_prefix too
# (unified_radix_cache.py:3087), aux_window_trim and device_overlap have no code path.
CACHE_MODE_REASONS = (
    "below_threshold", "host_capacity", "device_capacity", "storage_transfer", "deadline",
    "cache_admission_shortfall", "dropped",
)
# Deferred reasons of cache mode: a host-capacity miss (unified_radix_cache.py:3124); deferred
# device_capacity comes from the buffer-mode admission (buffer_mode/pipeline.py:1701).
CACHE_MODE_DEFERRED = ("host_capacity",)

# Catalog families that cache_core's engine paths never emit, left out of its clients' catalogs so
# that the clients do not create them at 0 either (the engine creates a series when it logs one).
NOT_EMITTED = {
    "hicache_backup_dropped_tokens_total": "buffer-mode L3 backups only (buffer_mode/pipeline.py:516)",
    "hicache_prefetch_aux_alloc_failed_tokens_total": "aux host pools (SWA windows) only (unified_radix_cache.py:2939)",
    "hicache_host_mamba_used_states": "hybrid-SSM host pools only (metrics_collector.py:1737-1745)",
    "hicache_host_mamba_total_states": "hybrid-SSM host pools only (metrics_collector.py:1737-1745)",
}


def client_catalog(collector: Collector | str, catalog: Catalog | None = None) -> Catalog:
    """The catalog of one collector's RankClient: that collector's families that cache_core emits.
    Give it to `RankClient(..., catalog=..., preset=False)`."""
    part = (catalog or default_catalog()).for_collector(collector)
    return Catalog(families=tuple(f for f in part if f.name not in NOT_EMITTED))


class LazyCounter:
    """A counter child created on its first positive increment, as the engine's collectors create
    a series only when they first log it (`.labels(...).inc(n)` behind `if n > 0`)."""

    __slots__ = ("_bind", "_child")

    def __init__(self, bind: Callable[[], CounterChild]) -> None:
        self._bind = bind
        self._child: CounterChild | None = None

    def inc(self, amount: float = 1.0) -> None:
        if amount <= 0:
            return
        if self._child is None:
            self._child = self._bind()
        self._child.inc(amount)

    @property
    def bound(self) -> bool:
        return self._child is not None

    @property
    def value(self) -> float:
        return self._child.value if self._child is not None else 0.0


class LazyHistogram:
    """A histogram child created on its first observation (the engine's `.labels(...).observe(x)`)."""

    __slots__ = ("_bind", "_child", "bounds")

    def __init__(self, bind: Callable[[], HistogramChild], bounds: tuple[float, ...]) -> None:
        self._bind = bind
        self._child: HistogramChild | None = None
        self.bounds = bounds

    def observe(self, value: float) -> None:
        if self._child is None:
            self._child = self._bind()
        self._child.observe(value)

    @property
    def bound(self) -> bool:
        return self._child is not None

    @property
    def sum(self) -> float:
        return self._child.sum if self._child is not None else 0.0

    def cumulative(self) -> tuple[list[int], float]:
        if self._child is None:
            return [0] * (len(self.bounds) + 1), 0.0
        return self._child.cumulative()


class CacheMetrics:
    """Every family the cache produces, bound to the client of its collector.

    The clients start with no series (`RankClient(preset=False)`). What the engine's collectors
    pre-seed at construction is bound here at 0 (every pre-set reason and mode, the dropped
    reasons of the write policy), and so are the host gauges, set from the start; every other
    series is created on its first positive increment or observation, as the engine creates them.
    `storage` is None on a rank without an L3 backend (the engine creates no storage collector
    there), `scheduler` None on ranks that do not log scheduler statistics (attn_tp_rank or
    attn_cp_rank not 0).
    """

    def __init__(
        self,
        radix: RankClient,
        storage: RankClient | None = None,
        scheduler: RankClient | None = None,
        *,
        page_size: int,
        pool: str = "kv",
        write_policy: str = "write_through",
    ) -> None:
        self.clients: dict[str, RankClient | None] = {
            Collector.RADIX.value: radix, Collector.STORAGE.value: storage, Collector.SCHEDULER.value: scheduler}
        for collector, client in self.clients.items():
            if client is not None:
                _check_client(collector, client)
        self.page_size = page_size
        self.pool = pool

        # radix collector: L1 eviction, L2 -> L1 load-back, L1 -> L2 backup
        self.evicted_tokens = self.lazy_counter("evicted_tokens_total")
        self.eviction_duration = self.lazy_histogram("eviction_duration_seconds")
        self.load_back_tokens = self.lazy_counter("load_back_tokens_total", pool=pool)
        self.load_back_bytes = self.lazy_counter("load_back_bytes_total")
        self.load_back_duration = self.lazy_histogram("load_back_duration_seconds")
        self.host_evicted_tokens = self.lazy_counter("hicache_host_pool_evicted_tokens_total", pool=pool)
        self.backup_tokens = self.lazy_counter("hicache_backup_tokens_total", pool=pool)
        self.backup_bytes = self.lazy_counter("hicache_backup_bytes_total")
        self.backup_duration = self.lazy_histogram("hicache_backup_duration_seconds")
        # Pre-seeded as the engine does: host_pressure always, write_through_unbacked_eviction
        # only under write_through (unified_radix_cache.py:565-575, 1060-1065).
        reasons = ["host_pressure"] + (["write_through_unbacked_eviction"] if write_policy == "write_through" else [])
        self.dropped: dict[str, CounterChild] = {r: self.counter(DROPPED, reason=r, pool=pool) for r in reasons}

        # storage collector: L2 <-> L3
        self.has_storage = storage is not None
        if storage is not None:
            self.prefetched_tokens = self.lazy_counter("prefetched_tokens_total")
            self.backuped_tokens = self.lazy_counter("backuped_tokens_total")
            self.prefetch_hit_tokens = self.lazy_counter("storage_prefetch_hit_tokens_total")
            self.prefetch_pgs = self.lazy_histogram("prefetch_pgs")
            self.backup_pgs = self.lazy_histogram("backup_pgs")
            self.prefetch_bandwidth = self.lazy_histogram("prefetch_bandwidth")
            self.backup_bandwidth = self.lazy_histogram("backup_bandwidth")
            self.storage_prefetch_bytes = self.lazy_counter("storage_prefetch_bytes_total")
            self.storage_backup_bytes = self.lazy_counter("storage_backup_bytes_total")
            self.storage_prefetch_duration = self.lazy_histogram("storage_prefetch_duration_seconds")
            self.storage_backup_duration = self.lazy_histogram("storage_backup_duration_seconds")
            # Every pre-set reason exists at 0 (metrics_collector.py:2247-2263); only cache-mode ones move.
            preset = {r: self.counter(UNFULFILLED, reason=r) for r in self._preset(UNFULFILLED, "reason")}
            self._unfulfilled = {r: preset[r] for r in CACHE_MODE_REASONS}
            deferred = {r: self.counter(DEFERRED, reason=r) for r in self._preset(DEFERRED, "reason")}
            self._deferred = {r: deferred[r] for r in CACHE_MODE_DEFERRED}

        # scheduler collector: host occupancy and the final per-tier prefill count
        self.has_scheduler = scheduler is not None
        if scheduler is not None:
            # Set from the cache's construction on, as the engine's first log_stats sets them.
            self.host_used = self.gauge("hicache_host_used_tokens")
            self.host_total = self.gauge("hicache_host_total_tokens")
            self.host_pool_used = self.gauge("hicache_host_pool_used_tokens", pool=pool)
            self.host_pool_total = self.gauge("hicache_host_pool_total_tokens", pool=pool)
            # Pre-seeded at 0 (metrics_collector.py:1052-1053).
            self.prefill_tokens = {m: self.counter(PREFILL, mode=m) for m in self._preset(PREFILL, "mode")}

    # --- binding, routed by the family's collector ---

    def client_for(self, family: str) -> RankClient:
        """The client of the collector that emits `family`."""
        spec = default_catalog().get(family)
        if spec.collector is None:
            raise ValueError(f"family {family!r} names no collector: cache_core cannot route it")
        collector = Collector(spec.collector).value
        client = self.clients[collector]
        if client is None:
            raise ValueError(f"family {family!r} is a {collector} family and this rank has no {collector} collector")
        return client

    def counter(self, family: str, **labels: Any) -> CounterChild:
        """A child created now, at 0 (what the engine pre-seeds)."""
        return self.client_for(family).counter(family, **labels)

    def gauge(self, family: str, **labels: Any) -> GaugeChild:
        return self.client_for(family).gauge(family, **labels)

    def lazy_counter(self, family: str, **labels: Any) -> LazyCounter:
        client = self._checked(family)
        return LazyCounter(lambda: client.counter(family, **labels))

    def lazy_histogram(self, family: str, **labels: Any) -> LazyHistogram:
        client = self._checked(family)
        bounds = client.metrics.catalog.get(family).buckets or ()
        return LazyHistogram(lambda: client.histogram(family, **labels), tuple(bounds))

    def _checked(self, family: str) -> RankClient:
        client = self.client_for(family)
        client.metrics.catalog.get(family)  # an unknown family fails now, not at the first use
        return client

    def _preset(self, family: str, label: str) -> tuple[str, ...]:
        return self.client_for(family).metrics.catalog.get(family).preset[label]

    # --- the cache's accounting calls ---

    def unfulfilled(self, reason: str) -> CounterChild:
        child = self._unfulfilled.get(reason)
        if child is None:
            raise ValueError(f"unfulfilled reason {reason!r} has no cache-mode code path in the engine")
        return child

    def deferred(self, reason: str) -> CounterChild:
        child = self._deferred.get(reason)
        if child is None:
            raise ValueError(f"deferred reason {reason!r} has no cache-mode code path in the engine")
        return child

    def host_occupancy(self, used_tokens: int, total_tokens: int) -> None:
        if not self.has_scheduler:
            return
        self.host_used.set(used_tokens)
        self.host_total.set(total_tokens)
        self.host_pool_used.set(used_tokens)
        self.host_pool_total.set(total_tokens)

    def prefill(self, input_tokens: int, device_hit: int, host_hit: int, storage_hit: int) -> None:
        """One admitted prefill's tokens by tier (metrics_collector.py:1580-1596: positive deltas only)."""
        if not self.has_scheduler:
            return
        for mode, tokens in zip(PREFILL_MODES, (input_tokens, device_hit, host_hit, storage_hit)):
            if tokens > 0:
                self.prefill_tokens[mode].inc(tokens)

    def l3_transfer(self, kind: str, pages: int, moved: int, seconds: float) -> None:
        """Account one finished storage batch (prefetch or backup) that moved `pages` pages."""
        if kind == "prefetch":
            tokens, byte_counter, duration, pgs, bandwidth = (
                self.prefetched_tokens, self.storage_prefetch_bytes, self.storage_prefetch_duration,
                self.prefetch_pgs, self.prefetch_bandwidth)
        else:
            tokens, byte_counter, duration, pgs, bandwidth = (
                self.backuped_tokens, self.storage_backup_bytes, self.storage_backup_duration,
                self.backup_pgs, self.backup_bandwidth)
        if pages <= 0:
            return
        tokens.inc(pages * self.page_size)
        byte_counter.inc(moved)
        duration.observe(seconds)
        pgs.observe(pages)
        if seconds > 0:
            bandwidth.observe(moved / seconds / GB)


def _check_client(collector: str, client: RankClient) -> None:
    """A collector's client may hold only that collector's families (else its presets leak others')."""
    foreign = [f for f in client.metrics.catalog if f.collector != collector]
    if foreign:
        names = ", ".join(f"{f.name} ({getattr(f.collector, 'value', f.collector) or 'no collector'})"
                          for f in foreign[:3])
        raise ValueError(f"the {collector} client's catalog holds other collectors' families ({names}, ...): "
                         f"build it with cache_core.instrumentation.client_catalog({collector!r})")
