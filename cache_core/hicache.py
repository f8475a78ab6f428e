"""HiCache: one rank's hierarchical KV cache, device (L1) ⇄ host (L2) ⇄ storage (L3).

The scheduler thread drives a request through begin → admit → finish (or abort). Every
counter is incremented here, on that thread; the storage worker only moves bytes. Decisions
use a logical clock, never wall time, so the replicas of a data-parallel group that see the
same requests make the same decisions and count the same tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum

import torch

from cache_core.geometry import ShardGeometry
from cache_core.instrumentation import CacheMetrics
from cache_core.io_worker import StorageJob, StorageWorker
from cache_core.pools import PagePool
from cache_core.radix import Node, PageKey, RadixTree
from cache_core.storage import FileStorage, chained_hashes
from cache_core.transfer import PageMover

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class HiCacheConfig:
    """Pool sizes (in pages, equal on every rank) and policies."""

    device_pages: int = 64
    host_pages: int = 256
    write_policy: str = "write_through"
    prefetch_policy: str = "wait_complete"
    prefetch_threshold: int = 256  # tokens; floored at the page size
    prefetch_timeout: float = 1.0
    storage_backup: bool = True  # write host pages through to L3
    pool: str = "kv"

    def __post_init__(self) -> None:
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(f"write_policy {self.write_policy!r} is not one of {WRITE_POLICIES}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"prefetch_policy {self.prefetch_policy!r} is not one of {PREFETCH_POLICIES}")
        if self.device_pages < 1 or self.host_pages < 1:
            raise ValueError("device_pages and host_pages must be positive")


class AdmitStatus(Enum):
    """What `admit` decided."""

    ADMITTED = "admitted"
    DEFERRED = "deferred"  # host hits wait for device pages held by running requests
    NO_ROOM = "no_room"  # the uncached pages do not fit on the device now


@dataclass(eq=False)
class Request:
    """One request's passage through the cache."""

    tokens: list[int]
    pages: list[PageKey]
    hashes: list[bytes]
    state: str = "begun"
    storage_hit_tokens: int = 0
    storage_accounted: int = 0  # hit tokens already fulfilled or given a reason
    prefetch: StorageJob | None = None
    prefetch_start: int = 0
    deferred_span: tuple[int, int] | None = None  # (first page, pages) waiting for host room
    device_deferred: bool = False  # admission already waited once for device pages
    anchor: Node | None = None
    anchor_on_device: bool = False
    l3_nodes: list[Node] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)
    new_device_pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prefix tokens on device at admission

    @property
    def uncached_tokens(self) -> int:
        return len(self.tokens) - self.cached_tokens


class HiCache:
    """Radix tree + device/host page pools + L3 storage, instrumented per the metric catalog."""

    def __init__(
        self,
        shard: ShardGeometry,
        config: HiCacheConfig,
        metrics: CacheMetrics,
        storage: FileStorage | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        self.shard = shard
        self.config = config
        self.metrics = metrics
        self.page_size = shard.model.page_size
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device_pool = PagePool("device", shard, config.device_pages, resolved)
        self.host_pool = PagePool("host", shard, config.host_pages, "cpu", pin_memory=resolved.type == "cuda")
        self.mover = PageMover(resolved)
        self.tree = RadixTree()
        self.storage = storage
        self.worker = StorageWorker(storage, self.host_pool) if storage is not None else None
        self.threshold = max(config.prefetch_threshold, self.page_size)
        self.clock = 0
        self._inflight: list[Request] = []
        self._pending_writes: list[tuple[StorageJob, list[Node]]] = []
        self._update_host_gauges()

    # --- the request lifecycle ---

    def begin(self, tokens: Sequence[int]) -> Request:
        """Match the prefix and start a storage prefetch for what L3 holds beyond it."""
        ps = self.page_size
        full = len(tokens) // ps
        pages = [tuple(tokens[i * ps:(i + 1) * ps]) for i in range(full)]
        req = Request(tokens=list(tokens), pages=pages, hashes=chained_hashes(pages))
        self.clock += 1
        path = self.tree.match(pages)
        for node in path:
            node.last_access = self.clock
        start = len(path)
        if self.storage is None or start == len(pages):
            return req
        hits = self.storage.prefix_hits(req.hashes[start:])
        if hits == 0:
            return req
        req.storage_hit_tokens = hits * ps
        self.metrics.prefetch_hit_tokens.inc(hits * ps)
        if hits * ps < self.threshold:
            self._account(req, "below_threshold", hits * ps)
            return req
        req.anchor = path[-1] if path else self.tree.root
        req.anchor_on_device = req.anchor.on_device
        self._start_prefetch(req, start, hits, refetch=False)
        return req

    def poll(self, wait: bool = False) -> None:
        """Account finished storage writes and commit finished prefetches into the host tier.

        With `wait`, every prefetch in flight is first waited for: replicas that must stay in
        lock-step commit the same prefetches at the same step (a real TP group all-reduces
        prefetch progress for the same reason), instead of whatever the I/O timing allowed.
        """
        if wait:
            for req in self._inflight:
                if req.prefetch is not None:
                    req.prefetch.finished.wait()
        for req in [r for r in self._inflight if r.prefetch is not None and r.prefetch.finished.is_set()]:
            self._commit(req)
        still_pending = []
        for job, nodes in self._pending_writes:
            if job.finished.is_set():
                self._write_finished(job, nodes)
            else:
                still_pending.append((job, nodes))
        self._pending_writes = still_pending

    def admit(self, req: Request) -> AdmitStatus:
        """Settle the prefetch, load host hits back to the device, and allocate pages for the rest."""
        if req.state != "begun":
            raise ValueError(f"cannot admit a request that is {req.state}")
        if req.deferred_span is not None:
            self._refetch(req)
        if req.prefetch is not None:
            self._wait_for_prefetch(req.prefetch)
            self._commit(req)
        self.clock += 1
        path = self.tree.match(req.pages)
        on_device = next((i for i, node in enumerate(path) if not node.on_device), len(path))
        host_nodes = path[on_device:]
        for node in path:
            node.lock += 1
            node.last_access = self.clock
        short = False
        if host_nodes:
            pages = self._device_alloc(len(host_nodes), partial=True)
            if not pages:
                self._unlock(path)
                if not req.device_deferred:  # count the storage tokens that wait, once per request
                    req.device_deferred = True
                    waiting = {id(node) for node in host_nodes}
                    from_storage = sum(1 for node in req.l3_nodes if id(node) in waiting)
                    if from_storage:
                        self.metrics.deferred("device_capacity").inc(from_storage * self.page_size)
                return AdmitStatus.DEFERRED
            self._load_back(host_nodes[:len(pages)], pages)
            short = len(pages) < len(host_nodes)
            self._unlock(host_nodes[len(pages):])
            path = path[:on_device + len(pages)]
        self._settle_storage_hits(req, path, load_back_short=short)
        new_pages = self._device_alloc(len(req.pages) - len(path), partial=False)
        if len(new_pages) != len(req.pages) - len(path):
            self._unlock(path)
            return AdmitStatus.NO_ROOM
        for page, key_hash in zip(new_pages, req.hashes[len(path):]):
            self._compute_page(page, key_hash)
        req.path = path
        req.new_device_pages = new_pages
        req.cached_tokens = len(path) * self.page_size
        req.state = "admitted"
        return AdmitStatus.ADMITTED

    def finish(self, req: Request) -> None:
        """Insert the computed pages, apply the write policy, release the request's pages."""
        if req.state != "admitted":
            raise ValueError(f"cannot finish a request that is {req.state}")
        self.clock += 1
        parent = req.path[-1] if req.path else self.tree.root
        new_nodes: list[Node] = []
        for offset, page in enumerate(req.new_device_pages):
            index = len(req.path) + offset
            node = self.tree.child(parent, req.pages[index], req.hashes[index])
            if node.on_device:
                self.device_pool.free([page])  # another request computed it meanwhile
            else:
                node.device_page = page
            node.lock += 1
            new_nodes.append(node)
            parent = node
        nodes = req.path + new_nodes
        for node in nodes:
            node.hits += 1
            node.last_access = self.clock
        policy = self.config.write_policy
        if policy == "write_through":
            self._backup([n for n in nodes if not n.on_host])
        elif policy == "write_through_selective":
            self._backup([n for n in nodes if not n.on_host and n.hits >= 2])
        self._unlock(nodes)
        req.state = "finished"
        self._update_host_gauges()

    def abort(self, req: Request) -> None:
        """Drop a request: cancel its prefetch, release its pages; unsettled hits become `dropped`."""
        if req.state in ("finished", "aborted"):
            return
        if req.prefetch is not None:
            job = req.prefetch
            job.cancel()
            job.finished.wait()
            self._inflight.remove(req)
            req.prefetch = None
            self.metrics.l3_transfer("prefetch", job.done_pages, job.done_pages * self.shard.page_bytes, job.seconds)
            self.host_pool.free(job.host_pages)
        if req.state == "admitted":
            self._unlock(req.path)
            self.device_pool.free(req.new_device_pages)
        remaining = req.storage_hit_tokens - req.storage_accounted
        if remaining > 0:
            self._account(req, "dropped", remaining)
        req.deferred_span = None
        req.state = "aborted"
        self._update_host_gauges()

    def flush(self) -> None:
        """Wait for every storage write in flight and account it."""
        for job, _ in self._pending_writes:
            job.finished.wait()
        self.poll()

    def close(self) -> None:
        self.flush()
        if self.worker is not None:
            self.worker.close()

    # --- storage prefetch ---

    def _account(self, req: Request, reason: str, tokens: int) -> None:
        self.metrics.unfulfilled(reason).inc(tokens)
        req.storage_accounted += tokens

    def _start_prefetch(self, req: Request, start: int, count: int, refetch: bool) -> None:
        assert self.worker is not None and req.anchor is not None
        req.anchor.lock += 1  # making room must not evict the very prefix this prefetch extends
        pages = self._host_alloc(count, partial=True)
        req.anchor.lock -= 1
        if not pages:
            if refetch:  # deferred once already: give up on this attempt
                self._account(req, "host_capacity", count * self.page_size)
            else:
                self.metrics.deferred("host_capacity").inc(count * self.page_size)
                req.deferred_span = (start, count)
            return
        if len(pages) < count:
            self._account(req, "host_capacity", (count - len(pages)) * self.page_size)
        req.prefetch = self.worker.submit(StorageJob("prefetch", req.hashes[start:start + len(pages)], pages, owner=req))
        req.prefetch_start = start
        self._inflight.append(req)

    def _refetch(self, req: Request) -> None:
        """Re-issue a deferred prefetch; hits that left storage meanwhile are `shrunk`."""
        assert req.deferred_span is not None and self.storage is not None
        start, count = req.deferred_span
        req.deferred_span = None
        still = self.storage.prefix_hits(req.hashes[start:start + count])
        if still < count:
            self._account(req, "shrunk", (count - still) * self.page_size)
        if still:
            self._start_prefetch(req, start, still, refetch=True)

    def _wait_for_prefetch(self, job: StorageJob) -> None:
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            job.finished.wait()
            return
        if policy == "timeout":
            job.finished.wait(self.config.prefetch_timeout)
        if not job.finished.is_set():  # best_effort takes what has landed; timeout ran out
            job.cancel()
            job.finished.wait()

    def _anchor_lost(self, req: Request) -> bool:
        anchor = req.anchor
        if anchor is None or anchor is self.tree.root:
            return False
        return anchor.detached or not anchor.cached or (req.anchor_on_device and not anchor.on_device)

    def _commit(self, req: Request) -> None:
        """Attach a finished prefetch's pages to the tree as host copies, or give them a reason."""
        try:
            self._attach_prefetched(req)
        finally:
            self._update_host_gauges()

    def _attach_prefetched(self, req: Request) -> None:
        job = req.prefetch
        assert job is not None
        req.prefetch = None
        self._inflight.remove(req)
        ps = self.page_size
        done = job.done_pages
        self.metrics.l3_transfer("prefetch", done, done * self.shard.page_bytes, job.seconds)
        if done < len(job.host_pages):
            self._account(req, "storage_transfer", (len(job.host_pages) - done) * ps)
            self.host_pool.free(job.host_pages[done:])
        loaded = job.host_pages[:done]
        if not loaded:
            return
        if self._anchor_lost(req):
            self._account(req, "anchor_lost", done * ps)
            self.host_pool.free(loaded)
            return
        node = req.anchor
        assert node is not None
        for offset, page in enumerate(loaded):
            index = req.prefetch_start + offset
            child = self.tree.child(node, req.pages[index], req.hashes[index])
            child.in_storage = True
            child.last_access = self.clock
            if child.on_device:
                self._account(req, "device_covered", ps)  # computed on the device while the I/O ran
                if child.on_host:
                    self.host_pool.free([page])
                else:
                    child.host_page = page
            elif child.on_host:
                self.host_pool.free([page])  # loaded twice: the existing host copy serves
                req.l3_nodes.append(child)
            else:
                child.host_page = page
                req.l3_nodes.append(child)
            node = child

    def _settle_storage_hits(self, req: Request, prefix: list[Node], load_back_short: bool) -> None:
        """At admission, L3 hits that did not become device prefix get their final reason."""
        open_tokens = req.storage_hit_tokens - req.storage_accounted
        if open_tokens <= 0:
            return
        in_prefix = {id(node) for node in prefix}
        fulfilled = sum(1 for node in req.l3_nodes if id(node) in in_prefix) * self.page_size
        req.storage_accounted += fulfilled
        missing = open_tokens - fulfilled
        if missing > 0:
            # A host shortfall at admission is a device capacity problem; anything else means the
            # L3-loaded span was no longer reusable when admission ran.
            self._account(req, "device_capacity" if load_back_short else "cache_admission_shortfall", missing)

    # --- device and host tiers ---

    def _compute_page(self, page: int, key_hash: bytes) -> None:
        """Stand-in for the model's prefill: deterministic KV content derived from the page hash."""
        self.device_pool.data[page].fill_((key_hash[0] - 128) / 32.0)

    def _load_back(self, nodes: list[Node], pages: list[int]) -> None:
        result = self.mover.copy(self.host_pool, [n.host_page for n in nodes], self.device_pool, pages)  # type: ignore[misc]
        for node, page in zip(nodes, pages):
            node.device_page = page
        tokens = len(nodes) * self.page_size
        self.metrics.load_back_tokens.inc(tokens)
        self.metrics.load_back_bytes.inc(result.bytes)
        self.metrics.load_back_duration.observe(result.seconds)

    def _backup(self, nodes: list[Node]) -> None:
        """Copy device pages to host in one merged operation; what finds no host room is marked."""
        nodes = [n for n in nodes if n.on_device and not n.on_host]
        if not nodes:
            return
        pages = self._host_alloc(len(nodes), partial=True)
        backed = nodes[:len(pages)]
        for node in nodes[len(pages):]:
            node.backup_failed = True
        if backed:
            result = self.mover.copy(self.device_pool, [n.device_page for n in backed], self.host_pool, pages)  # type: ignore[misc]
            for node, page in zip(backed, pages):
                node.host_page = page
                node.backup_failed = False
            self.metrics.backup_tokens.inc(len(backed) * self.page_size)
            self.metrics.backup_bytes.inc(result.bytes)
            self.metrics.backup_duration.observe(result.seconds)
            self._write_to_storage(backed)
        self._update_host_gauges()

    def _device_alloc(self, count: int, partial: bool) -> list[int]:
        return self._alloc(self.device_pool, self._evict_device, count, partial)

    def _host_alloc(self, count: int, partial: bool) -> list[int]:
        pages = self._alloc(self.host_pool, self._evict_host, count, partial)
        self._update_host_gauges()
        return pages

    @staticmethod
    def _alloc(pool: PagePool, evict: Callable[[int], None], count: int, partial: bool) -> list[int]:
        """`count` pages, evicting for room; with `partial`, as many as could be freed."""
        if count <= 0:
            return []
        if pool.free_pages < count:
            evict(count - pool.free_pages)
        take = min(count, pool.free_pages)
        if take < count and not partial:
            return []
        return pool.alloc(take)

    def _evict_device(self, need: int) -> None:
        """Free device pages, least recently used frontier first: demote, back up, or drop."""
        started = time.perf_counter()
        evicted = 0
        write_back = self.config.write_policy == "write_back"
        while need > 0:
            victims = self.tree.device_frontier()[:need]
            if not victims:
                break
            if write_back:
                self._backup([v for v in victims if not v.backup_failed])
            for node in victims:
                if not node.on_host:
                    reason = "host_pressure" if (write_back or node.backup_failed) else "write_through_unbacked_eviction"
                    self.metrics.dropped[reason].inc(self.page_size)
                self.device_pool.free([node.device_page])  # type: ignore[list-item]
                node.device_page = None
                self.tree.prune(node)
            evicted += len(victims)
            need -= len(victims)
        if evicted:
            self.metrics.evicted_tokens.inc(evicted * self.page_size)
            self.metrics.eviction_duration.observe(time.perf_counter() - started)

    def _evict_host(self, need: int) -> None:
        while need > 0:
            victims = self.tree.host_frontier()[:need]
            if not victims:
                return
            for node in victims:
                self.host_pool.free([node.host_page])  # type: ignore[list-item]
                node.host_page = None
                self.tree.prune(node)
            self.metrics.host_evicted_tokens.inc(len(victims) * self.page_size)
            need -= len(victims)

    def _write_to_storage(self, nodes: list[Node]) -> None:
        if self.worker is None or not self.config.storage_backup:
            return
        pending = [n for n in nodes if not n.in_storage]
        if not pending:
            return
        for node in pending:
            node.io_lock += 1
        job = StorageJob("backup", [n.hash for n in pending], [n.host_page for n in pending])  # type: ignore[misc]
        self._pending_writes.append((self.worker.submit(job), pending))

    def _write_finished(self, job: StorageJob, nodes: list[Node]) -> None:
        done = job.done_pages
        self.metrics.l3_transfer("backup", done, done * self.shard.page_bytes, job.seconds)
        if done < len(nodes):
            self.metrics.backup_dropped_tokens.inc((len(nodes) - done) * self.page_size)
        for node in nodes[:done]:
            node.in_storage = True
        for node in nodes:
            node.io_lock -= 1
            self.tree.prune(node)

    def _unlock(self, nodes: list[Node]) -> None:
        for node in nodes:
            node.lock -= 1

    def _update_host_gauges(self) -> None:
        ps = self.page_size
        self.metrics.host_occupancy(self.host_pool.used_pages * ps, self.host_pool.num_pages * ps)
