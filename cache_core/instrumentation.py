"""The cache's metric children, bound once through the rank client, named as the catalog says."""

from __future__ import annotations

from exporter.catalog import default_catalog
from exporter.client import CounterChild, RankClient

UNFULFILLED = "storage_prefetch_unfulfilled_tokens_total"
DEFERRED = "storage_prefetch_deferred_tokens_total"
DROPPED = "hicache_dropped_tokens_total"
DROP_REASONS = ("host_pressure", "write_through_unbacked_eviction")
GB = 1e9


class CacheMetrics:
    """Every family the cache produces, bound to this rank's labels; increments are plain adds."""

    def __init__(self, client: RankClient, page_size: int, pool: str = "kv") -> None:
        self.client = client
        self.page_size = page_size
        self.pool = pool
        c = client
        self.evicted_tokens = c.counter("evicted_tokens_total")
        self.eviction_duration = c.histogram("eviction_duration_seconds")
        self.load_back_tokens = c.counter("load_back_tokens_total", pool=pool)
        self.load_back_bytes = c.counter("load_back_bytes_total")
        self.load_back_duration = c.histogram("load_back_duration_seconds")
        self.host_evicted_tokens = c.counter("hicache_host_pool_evicted_tokens_total", pool=pool)
        self.backup_tokens = c.counter("hicache_backup_tokens_total", pool=pool)
        self.backup_bytes = c.counter("hicache_backup_bytes_total")
        self.backup_duration = c.histogram("hicache_backup_duration_seconds")
        self.dropped = {reason: c.counter(DROPPED, reason=reason, pool=pool) for reason in DROP_REASONS}
        self.prefetched_tokens = c.counter("prefetched_tokens_total")
        self.backuped_tokens = c.counter("backuped_tokens_total")
        self.prefetch_hit_tokens = c.counter("storage_prefetch_hit_tokens_total")
        self.backup_dropped_tokens = c.counter("hicache_backup_dropped_tokens_total")
        self.prefetch_pgs = c.histogram("prefetch_pgs")
        self.backup_pgs = c.histogram("backup_pgs")
        self.prefetch_bandwidth = c.histogram("prefetch_bandwidth")
        self.backup_bandwidth = c.histogram("backup_bandwidth")
        self.storage_prefetch_bytes = c.counter("storage_prefetch_bytes_total")
        self.storage_backup_bytes = c.counter("storage_backup_bytes_total")
        self.storage_prefetch_duration = c.histogram("storage_prefetch_duration_seconds")
        self.storage_backup_duration = c.histogram("storage_backup_duration_seconds")
        self.host_used = c.gauge("hicache_host_used_tokens")
        self.host_total = c.gauge("hicache_host_total_tokens")
        self.host_pool_used = c.gauge("hicache_host_pool_used_tokens", pool=pool)
        self.host_pool_total = c.gauge("hicache_host_pool_total_tokens", pool=pool)
        catalog = default_catalog()
        # Pre-set reasons are bound up front; `shrunk` is bound lazily by the re-fetch path.
        self._unfulfilled = {r: c.counter(UNFULFILLED, reason=r) for r in catalog.get(UNFULFILLED).preset["reason"]}
        self._deferred = {r: c.counter(DEFERRED, reason=r) for r in catalog.get(DEFERRED).preset["reason"]}

    def unfulfilled(self, reason: str) -> CounterChild:
        child = self._unfulfilled.get(reason)
        if child is None:
            child = self._unfulfilled[reason] = self.client.counter(UNFULFILLED, reason=reason)
        return child

    def deferred(self, reason: str) -> CounterChild:
        return self._deferred[reason]

    def host_occupancy(self, used_tokens: int, total_tokens: int) -> None:
        self.host_used.set(used_tokens)
        self.host_total.set(total_tokens)
        self.host_pool_used.set(used_tokens)
        self.host_pool_total.set(total_tokens)

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
