"""HiCache: one rank's hierarchical KV cache, device (L1) ⇄ host (L2) ⇄ storage (L3).

The scheduler thread drives a request through begin → admit → finish (or abort, or retract
and admit again). Every counter is incremented here, on that thread; the storage worker only
moves bytes. Decisions use a logical clock, never wall time (except the `timeout` stop policy,
as in the engine), so the replicas of a data-parallel group that see the same requests make the
same decisions and count the same tokens.

It models the engine's cache-mode HiCache (sglang 0.5.23 mem_cache/unified_radix_cache.py with a
resident host cache, not `buffer_only`): each storage-accounting step below names the engine
function it follows, and only that mode's unfulfilled reasons are emitted.
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
    prefetch_policy: str = "wait_complete"  # the engine's --hicache-storage-prefetch-policy
    prefetch_threshold: int = 256  # tokens; floored at the page size
    prefetch_timeout: float = 1.0  # seconds: the timeout policy's base (prefetch_timeout_base)
    prefetch_timeout_per_ki_token: float = 0.25  # seconds added per 1024 requested tokens
    load_back_threshold: int = 10  # tokens: smaller host spans are recomputed (unified_radix_cache.py:576)
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
    NO_ROOM = "no_room"  # the pages beyond the device prefix do not fit on the device now


@dataclass(eq=False)
class Request:
    """One request's passage through the cache."""

    tokens: list[int]
    pages: list[PageKey]
    hashes: list[bytes]
    state: str = "begun"  # begun -> admitted -> finished | aborted; retract: admitted -> begun
    retracted: bool = False  # the engine's retracted_stain: its next admission is not accounted
    storage_hit_tokens: int = 0  # rank-agreed L3 hits, summed over the request's attempts
    storage_open: int | None = None  # hit tokens not resolved yet (_storage_prefetch_hit_remaining_by_reqid)
    storage_accounted: int = 0  # hit tokens resolved: fulfilled, given a reason, covered or discarded
    storage_fulfilled: int = 0  # hit tokens that became the admitted device prefix
    storage_covered: int = 0  # hit tokens the tree already held when the prefetch was inserted (no reason)
    storage_discarded: int = 0  # hit tokens of an aborted or retracted request (no reason)
    prefetch: StorageJob | None = None
    prefetch_start: int = 0  # first page of the prefetched span
    anchor: Node | None = None  # the node the prefetch hangs from, locked while it runs
    loaded_start: int | None = None  # token offset of the span loaded from L3 (prefetch_loaded_storage_start)
    loaded_tokens: int = 0  # tokens loaded from L3 and not already in the tree (prefetch_loaded_tokens)
    l3_nodes: list[Node] = field(default_factory=list)
    path: list[Node] = field(default_factory=list)
    new_device_pages: list[int] = field(default_factory=list)
    cached_tokens: int = 0  # prefix tokens on device at admission
    host_hit_tokens: int = 0  # host-only prefix at admission (host_hit_length)
    host_loaded_tokens: int = 0  # of which loaded back (host_loaded_length)

    @property
    def uncached_tokens(self) -> int:
        return len(self.tokens) - self.cached_tokens


def split_cached_prefix_by_tier(
    prefix_len: int, host_hit_len: int, storage_hit_len: int, storage_hit_start: int | None,
) -> tuple[int, int, int]:
    """(device, host, storage) tokens of an admitted prefix (schedule_batch.py:231-266, cache mode)."""
    host_hit_len = min(prefix_len, host_hit_len)
    host_start = prefix_len - host_hit_len
    if storage_hit_start is None:
        storage = min(host_hit_len, storage_hit_len)
        host = host_hit_len - storage
    else:
        storage_end = storage_hit_start + storage_hit_len
        storage = max(0, min(prefix_len, storage_end) - max(0, storage_hit_start))
        storage_in_host = max(0, min(prefix_len, storage_end) - max(host_start, storage_hit_start))
        host = host_hit_len - storage_in_host
    return prefix_len - host - storage, host, storage


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
        if storage is not None and not metrics.has_storage:
            raise ValueError("a cache with L3 storage needs a storage client in its metrics")
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
        self._start_attempt(req)
        return req

    def poll(self, wait: bool = False) -> None:
        """Account finished storage writes and insert finished prefetches into the host tier.

        With `wait`, every prefetch in flight is first waited for: replicas that must stay in
        lock-step insert the same prefetches at the same step (the engine drains its ack queues
        by a rank-agreed count for the same reason), instead of whatever the I/O timing allowed.
        """
        if wait:
            for req in self._inflight:
                if req.prefetch is not None:
                    req.prefetch.finished.wait()
        for req in [r for r in self._inflight if r.prefetch is not None and r.prefetch.finished.is_set()]:
            self._handle_prefetch_result(req)
        still_pending = []
        for job, nodes in self._pending_writes:
            if job.finished.is_set():
                self._write_finished(job, nodes)
            else:
                still_pending.append((job, nodes))
        self._pending_writes = still_pending

    def admit(self, req: Request) -> AdmitStatus:
        """Settle the prefetch, load the host span back (all or nothing), allocate the rest, account.

        NO_ROOM leaves the request waiting with its accounting open, as the engine's admission
        does when a request does not fit (no reason is given until it is admitted).
        """
        if req.state != "begun":
            raise ValueError(f"cannot admit a request that is {req.state}")
        if req.prefetch is not None:
            self._check_prefetch_progress(req)
        self.clock += 1
        ps = self.page_size
        path = self.tree.match(req.pages)
        on_device = next((i for i, node in enumerate(path) if not node.on_device), len(path))
        host_nodes = path[on_device:]
        for node in path:
            node.lock += 1
            node.last_access = self.clock
        # A host span below the load-back threshold is recomputed instead (_load_back_transfers,
        # unified_radix_cache.py:1875-1881): a device_capacity miss for its storage tokens.
        load = host_nodes if len(host_nodes) * ps >= max(1, self.config.load_back_threshold) else []
        new_count = len(req.pages) - on_device - len(load)
        pages = self._device_alloc(len(load) + new_count, partial=False)
        if len(pages) != len(load) + new_count:
            self._unlock(path)
            return AdmitStatus.NO_ROOM
        if load:
            self._load_back(load, pages[:len(load)])
        self._unlock(host_nodes[len(load):])
        prefix = path[:on_device + len(load)]
        req.host_hit_tokens = len(host_nodes) * ps
        req.host_loaded_tokens = len(load) * ps
        self._account_admission(req, len(prefix) * ps)
        new_pages = pages[len(load):]
        for page, key_hash in zip(new_pages, req.hashes[len(prefix):]):
            self._compute_page(page, key_hash)
        req.path = prefix
        req.new_device_pages = new_pages
        req.cached_tokens = len(prefix) * ps
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
        """Drop a request (release_aborted_request, unified_radix_cache.py:2764-2800).

        Its open storage accounting is discarded first: an abort is no `dropped`. A prefetch in
        flight is terminated and its host pages released, its transfer unaccounted (its completed
        tokens never reach log_prefetched_tokens).
        """
        if req.state in ("finished", "aborted"):
            return
        self._discard_accounting(req)
        if req.prefetch is not None:
            job = req.prefetch
            job.cancel()
            job.finished.wait()
            self._inflight.remove(req)
            req.prefetch = None
            self.host_pool.free(job.host_pages)
            self._release_anchor(req)
        if req.state == "admitted":
            self._unlock(req.path)
            self.device_pool.free(req.new_device_pages)
        req.state = "aborted"
        self._update_host_gauges()

    def retract(self, req: Request) -> None:
        """Send a running request back to the waiting queue: its computed pages go, its cached
        prefix stays, and it starts over (a new L3 attempt if storage holds what it lost).

        Its next admission discards its storage accounting and counts no prefill tokens
        (the engine's retracted_stain, schedule_policy.py:963-972, 946-950).
        """
        if req.state != "admitted":
            raise ValueError(f"cannot retract a request that is {req.state}")
        self._unlock(req.path)
        self.device_pool.free(req.new_device_pages)
        req.path, req.new_device_pages, req.cached_tokens = [], [], 0
        req.retracted = True
        req.state = "begun"
        self._start_attempt(req)

    def flush(self) -> None:
        """Wait for every storage write in flight and account it."""
        for job, _ in self._pending_writes:
            job.finished.wait()
        self.poll()

    def close(self) -> None:
        self.flush()
        if self.worker is not None:
            self.worker.close()

    # --- storage accounting: the engine's per-request hit ledger ---

    def _account(self, req: Request, reason: str, tokens: int) -> None:
        """Count `tokens` of `req` under `reason` (the only place a reason is counted)."""
        self.metrics.unfulfilled(reason).inc(tokens)
        req.storage_accounted += tokens

    def _record_hit(self, req: Request, tokens: int) -> None:
        """Open the accounting of one rank-agreed L3 hit (_record_storage_prefetch_hit, 2646-2664)."""
        if req.storage_open is not None:  # a new attempt replaces an unresolved one
            self._discard_accounting(req)
        req.storage_open = tokens
        req.storage_hit_tokens += tokens
        self.metrics.prefetch_hit_tokens.inc(tokens)

    def _resolve(self, req: Request, tokens: int, reason: str | None = None) -> None:
        """Resolve part of the open hit (_resolve_storage_prefetch_tokens, 2666-2692); no reason:
        the tokens were already in the tree, nothing to count."""
        if tokens <= 0 or req.storage_open is None:
            return
        resolved = min(tokens, req.storage_open)
        if reason is not None:
            self._account(req, reason, resolved)
        else:
            req.storage_covered += resolved
            req.storage_accounted += resolved
        req.storage_open -= resolved
        if req.storage_open == 0:
            req.storage_open = None

    def _finish_accounting(self, req: Request, fulfilled: int, reason: str | None) -> None:
        """Close the open hit: `fulfilled` tokens served, the rest under `reason`
        (_finish_storage_prefetch, 2694-2713)."""
        remaining = req.storage_open
        if remaining is None:
            return
        req.storage_open = None
        served = min(fulfilled, remaining)
        req.storage_fulfilled += served
        req.storage_accounted += served
        rest = remaining - served
        if rest > 0:
            if reason is not None:
                self._account(req, reason, rest)
            else:
                req.storage_covered += rest
                req.storage_accounted += rest

    def _discard_accounting(self, req: Request) -> None:
        """Drop the open hit with no reason (discard_storage_prefetch_accounting, 2739-2741)."""
        if req.storage_open is not None:
            req.storage_discarded += req.storage_open
            req.storage_accounted += req.storage_open
            req.storage_open = None

    def _account_admission(self, req: Request, prefix_tokens: int) -> None:
        """The prefill tier split and the storage verdict of an admitted request
        (_account_prefill_cache_admission, schedule_policy.py:962-997)."""
        if req.retracted:
            self._discard_accounting(req)
            return
        host_hit = min(req.host_hit_tokens, req.host_loaded_tokens)  # materialized_host_hit_len
        device, host, storage = split_cached_prefix_by_tier(prefix_tokens, host_hit, req.loaded_tokens, req.loaded_start)
        self.metrics.prefill(len(req.tokens) - prefix_tokens, device, host, storage)
        if req.loaded_start is None:  # fulfilled_storage_hit_len (schedule_batch.py:1537-1545)
            fulfilled = min(prefix_tokens, req.loaded_tokens)
        else:
            fulfilled = max(0, min(prefix_tokens, req.loaded_start + req.loaded_tokens) - req.loaded_start)
        reason = None
        if fulfilled < req.loaded_tokens:
            short_load_back = req.host_hit_tokens > 0 and req.host_loaded_tokens < req.host_hit_tokens
            reason = "device_capacity" if short_load_back else "cache_admission_shortfall"
        self._finish_accounting(req, fulfilled, reason)

    # --- storage prefetch ---

    def _start_attempt(self, req: Request) -> None:
        """One L3 attempt: prefetch_from_storage (2080-2258), its rank-agreed hit query and the
        hit drain (_drain_and_alloc_storage_hit, 3150-3197; _try_alloc_storage_hit, 3107-3148)."""
        ps = self.page_size
        self.clock += 1
        path = self.tree.match(req.pages)
        for node in path:
            node.last_access = self.clock
        start = len(path)
        req.loaded_start, req.loaded_tokens, req.l3_nodes = None, 0, []
        if self.storage is None or start == len(req.pages):
            return
        if (len(req.pages) - start) * ps < self.threshold:
            return  # too short to be worth a lookup: no query is issued (2147-2155)
        hits = self.storage.prefix_hits(req.hashes[start:])
        if hits == 0:
            return
        self._record_hit(req, hits * ps)
        if hits * ps < self.threshold:  # below-threshold hits are not worth the transfer
            self._finish_accounting(req, 0, "below_threshold")
            return
        anchor = path[-1] if path else self.tree.root
        anchor.lock += 1  # the anchor is pinned while the prefetch runs (inc_host_lock_ref, 2160-2164)
        req.anchor = anchor
        pages, alloc_pages = self._allocate_storage_hit(hits)
        if pages is None:
            # Nothing worth fetching fits: the whole attempt is host_capacity, and counted as
            # deferred too (the engine re-issues it later; cache_core does not model that retry).
            self._finish_accounting(req, 0, "host_capacity")
            self.metrics.deferred("host_capacity").inc(max(alloc_pages, hits) * ps)
            self._release_anchor(req)
            return
        self._resolve(req, (hits - len(pages)) * ps, "host_capacity")
        req.prefetch = self.worker.submit(StorageJob("prefetch", req.hashes[start:start + len(pages)], pages, owner=req))  # type: ignore[union-attr]
        req.prefetch_start = start
        self._inflight.append(req)

    def _allocate_storage_hit(self, count: int) -> tuple[list[int] | None, int]:
        """Host pages for `count` hit pages: all after evicting, else as many as are free if that
        reaches the threshold (allocate_storage_hit, hybrid_cache_controller.py:796-829)."""
        pool = self.host_pool
        if pool.free_pages < count:
            self._evict_host(count)  # the engine evicts the hit's size, not just the shortfall
        take = min(count, pool.free_pages)
        if take == count or take * self.page_size >= self.threshold:
            pages = pool.alloc(take)
            self._update_host_gauges()
            return pages, take
        return None, take

    def _prefetch_timeout(self, job: StorageJob) -> float:
        """The timeout policy's budget: base + per 1024 requested tokens (_start_storage_prefetch_wait)."""
        tokens = len(job.keys) * self.page_size
        return self.config.prefetch_timeout + tokens / 1024 * self.config.prefetch_timeout_per_ki_token

    def _check_prefetch_progress(self, req: Request) -> None:
        """Settle the prefetch by the stop policy, then insert it (check_prefetch_progress, 2390-2419).

        wait_complete waits for the read; best_effort terminates it at once; timeout waits for its
        budget and then terminates it with the deadline verdict.
        """
        job = req.prefetch
        assert job is not None
        policy = self.config.prefetch_policy
        if not job.finished.is_set():
            if policy == "wait_complete":
                job.finished.wait()
            elif policy == "timeout":
                if not job.finished.wait(self._prefetch_timeout(job)):
                    job.deadline_expired = True  # _mark_prefetch_deadline_expired
                    job.cancel()
                    job.finished.wait()
            else:  # best_effort: _can_terminate_prefetch is true at once
                job.cancel()
                job.finished.wait()
        self._handle_prefetch_result(req)

    def _release_anchor(self, req: Request) -> None:
        if req.anchor is not None:
            req.anchor.lock -= 1
            self.tree.prune(req.anchor)
            req.anchor = None

    def _handle_prefetch_result(self, req: Request) -> None:
        """Insert a finished prefetch into the host tier (_handle_prefetch_result, 2433-2533)."""
        job = req.prefetch
        assert job is not None
        req.prefetch = None
        self._inflight.remove(req)
        ps = self.page_size
        try:
            done = job.done_pages
            if done < len(job.host_pages):
                # An unread tail: the stop policy's deadline, else a failed read.
                self._resolve(req, (len(job.host_pages) - done) * ps,
                              "deadline" if job.deadline_expired else "storage_transfer")
                self.host_pool.free(job.host_pages[done:])
            self.metrics.l3_transfer("prefetch", done, done * self.shard.page_bytes, job.seconds)
            loaded = job.host_pages[:done]
            if not loaded:
                return
            assert req.anchor is not None
            covered, nodes = self._insert_host(req, req.anchor, loaded)
            self._resolve(req, covered * ps)  # already in the tree: no reason
            if nodes is None:
                # A refill under a node with no host copy is dropped under write-through
                # (unified_tree_core.py:2466-2474): the rest of the hit is `dropped`.
                self._finish_accounting(req, 0, "dropped")
                return
            req.l3_nodes = nodes
            req.loaded_tokens = (done - covered) * ps
            req.loaded_start = (req.prefetch_start + covered) * ps if req.loaded_tokens else None
        finally:
            self._release_anchor(req)
            self._update_host_gauges()

    def _insert_host(self, req: Request, anchor: Node, pages: list[int]) -> tuple[int, list[Node] | None]:
        """Hang loaded host pages below `anchor` (tree_core.insert_host, unified_tree_core.py:2400-2490).

        Returns (pages the tree already held, the nodes now holding loaded pages), or (covered,
        None) when the refill was dropped. Under write_back every matched page counts as held;
        under write-through only matched pages with a host copy do, and matched pages without
        one take the loaded copy.
        """
        write_back = self.config.write_policy == "write_back"
        node, index, covered = anchor, 0, 0
        nodes: list[Node] = []
        while index < len(pages):
            page_index = req.prefetch_start + index
            child = node.children.get(req.pages[page_index])
            if child is None:
                break
            if write_back or child.on_host:
                covered += 1
                self.host_pool.free([pages[index]])
            else:
                child.host_page = pages[index]
                nodes.append(child)
            child.in_storage = True
            child.last_access = self.clock
            node, index = child, index + 1
        if index == len(pages):
            return covered, nodes
        if node is not self.tree.root and not node.on_host and not write_back:
            # (Only with nothing matched: a matched node has or took a host copy.)
            self.host_pool.free(pages[index:])
            return covered, None
        for offset, page in enumerate(pages[index:]):
            page_index = req.prefetch_start + index + offset
            child = self.tree.child(node, req.pages[page_index], req.hashes[page_index])
            child.host_page = page
            child.in_storage = True
            child.last_access = self.clock
            nodes.append(child)
            node = child
        return covered, nodes

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
                    # write_back: the write-back found no host room, the drop fallback
                    # (_drop_subtree_no_host); write_through: any unbacked eviction; the
                    # selective policy's unbacked evictions are not counted (unified_radix_cache.py:910-948).
                    reason = "host_pressure" if write_back else "write_through_unbacked_eviction"
                    child = self.metrics.dropped.get(reason)
                    if child is not None:
                        child.inc(self.page_size)
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
        """Account a finished L3 write: what completed (_drain_backup logs completed_tokens); a
        write that failed is not counted (hicache_backup_dropped_tokens_total is buffer-mode only)."""
        done = job.done_pages
        self.metrics.l3_transfer("backup", done, done * self.shard.page_bytes, job.seconds)
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
