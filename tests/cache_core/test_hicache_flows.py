"""HiCache flows: write policies, dropped tokens, load-back, eviction, gauges and L3 transfers."""

from __future__ import annotations

import pytest
import torch

from cache_core.geometry import ModelGeometry
from cache_core.hicache import AdmitStatus, HiCache, HiCacheConfig
from exporter.catalog import Collector
from tests.cache_core.support import (
    PRESET_REASONS,
    PS,
    SHARD,
    all_children,
    delta,
    hashes_of,
    hist_count,
    seed_l3,
    toks,
    unfulfilled,
)

SHARD_3L = ModelGeometry(layers=3, kv_heads=4, head_dim=8, page_size=4).shard(1, 2, 0, 1)  # 3 layers, 2 heads


def run(cache: HiCache, tokens: list[int]):
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    cache.finish(req)
    return req


def nodes_for(cache: HiCache, tokens: list[int]):
    """Tree nodes along `tokens`, whatever they hold (stops where the tree stops)."""
    node, out = cache.tree.root, []
    for i in range(len(tokens) // PS):
        node = node.children.get(tuple(tokens[i * PS:(i + 1) * PS]))
        if node is None:
            break
        out.append(node)
    return out


def expected_page(cache: HiCache, key_hash: bytes) -> torch.Tensor:
    return torch.full(cache.shard.page_shape, (key_hash[0] - 128) / 32.0, dtype=cache.shard.model.torch_dtype)


def dropped(cache: HiCache) -> dict[str, float]:
    return {reason: child.value for reason, child in cache.metrics.dropped.items()}


# --- write policies ---

def test_write_through_backs_up_on_finish_and_writes_l3(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, write_policy="write_through")
    m = cache.metrics
    tokens = toks(3, 100, extra=2)  # the loose tokens are not a full page: never cached
    run(cache, tokens)
    nodes = nodes_for(cache, tokens)
    assert len(nodes) == 3 and all(n.on_host and n.on_device for n in nodes)
    assert m.backup_tokens.value == 3 * PS
    assert m.backup_bytes.value == 3 * SHARD.page_bytes
    assert hist_count(m.backup_duration) == 1, "one merged device->host copy"
    # Host copies are bit-identical to the device pages.
    for node in nodes:
        assert torch.equal(cache.host_pool.data[node.host_page], cache.device_pool.data[node.device_page])
    cache.flush()
    assert m.backuped_tokens.value == 3 * PS
    assert m.storage_backup_bytes.value == 3 * SHARD.page_bytes
    counts, total = m.backup_pgs.cumulative()
    assert m.backup_pgs.bounds == (1, 5, 10, 50, 100)
    assert counts == [0, 1, 1, 1, 1, 1] and total == 3, "one L3 batch of 3 pages"
    assert hist_count(m.storage_backup_duration) == 1
    assert cache.storage.exists(hashes_of(tokens)) == [True] * 3
    for node in nodes:
        assert node.in_storage and node.io_lock == 0
        stored = torch.frombuffer(bytearray(cache.storage.get(node.hash)), dtype=torch.float16).view(SHARD.page_shape)
        assert torch.equal(stored, cache.host_pool.data[node.host_page])


def test_write_through_selective_backs_up_on_the_second_hit_only(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, write_policy="write_through_selective")
    m = cache.metrics
    tokens = toks(3, 100)
    run(cache, tokens)
    assert m.backup_tokens.value == 0
    assert not any(n.on_host for n in nodes_for(cache, tokens))
    assert m.host_used.value == 0
    longer = tokens + toks(1, 900)
    req = run(cache, longer)  # pages 0-2 are hit a second time, page 3 a first time
    assert req.cached_tokens == 3 * PS
    assert m.backup_tokens.value == 3 * PS
    assert [n.on_host for n in nodes_for(cache, longer)] == [True, True, True, False]
    assert m.host_used.value == 3 * PS
    cache.flush()
    assert m.backuped_tokens.value == 3 * PS


def test_write_back_backs_up_on_eviction(make_cache) -> None:
    cache = make_cache(device_pages=3, host_pages=16, write_policy="write_back")
    m = cache.metrics
    first = toks(3, 100)
    run(cache, first)
    assert m.backup_tokens.value == 0 and m.evicted_tokens.value == 0
    run(cache, toks(3, 500))  # needs the whole device: evicts (and so backs up) the first request
    assert m.backup_tokens.value == 3 * PS
    assert m.backup_bytes.value == 3 * SHARD.page_bytes
    assert m.evicted_tokens.value == 3 * PS
    assert hist_count(m.eviction_duration) == 1, "one eviction pass"
    assert dropped(cache) == {"host_pressure": 0}, "write_through_unbacked_eviction is pre-set under write_through only"
    assert all(n.on_host and not n.on_device for n in nodes_for(cache, first))
    cache.flush()
    assert m.backuped_tokens.value == 3 * PS
    assert m.storage_backup_bytes.value == 3 * SHARD.page_bytes


# --- dropped device tokens ---

def test_host_pressure_when_the_write_back_found_no_host_room(make_cache) -> None:
    cache = make_cache(device_pages=3, host_pages=2, write_policy="write_back", storage_backup=False,
                       prefetch_threshold=PS)
    held = toks(2, 700)
    seed_l3(cache.storage, held)
    holder = cache.begin(held)  # its prefetch holds both host pages, outside the tree: not evictable
    assert holder.prefetch is not None and cache.host_pool.free_pages == 0
    run(cache, toks(3, 100))
    assert cache.metrics.backup_tokens.value == 0, "write_back backs up on eviction only"
    run(cache, toks(3, 500))  # evicts the first request: its write-back finds no host room
    assert cache.metrics.backup_tokens.value == 0
    assert dropped(cache) == {"host_pressure": 3 * PS}
    assert cache.metrics.evicted_tokens.value == 3 * PS
    cache.abort(holder)


def test_write_through_eviction_of_a_page_whose_backup_found_no_host_room(make_cache) -> None:
    cache = make_cache(device_pages=3, host_pages=1, write_policy="write_through", storage_backup=False)
    first = toks(3, 100)
    run(cache, first)
    assert cache.metrics.backup_tokens.value == PS, "only one host page"
    assert [n.backup_failed for n in nodes_for(cache, first)] == [False, True, True]
    run(cache, toks(3, 500))
    # The engine counts every unbacked eviction under write_through as such, whatever kept the
    # backup from landing (unified_radix_cache.py:910-928).
    assert dropped(cache) == {"host_pressure": 0, "write_through_unbacked_eviction": 2 * PS}
    assert cache.metrics.evicted_tokens.value == 3 * PS


def test_unbacked_eviction_under_write_through_selective_is_not_counted(make_cache) -> None:
    cache = make_cache(device_pages=3, host_pages=16, write_policy="write_through_selective", storage_backup=False)
    run(cache, toks(3, 100))
    run(cache, toks(3, 500))
    assert dropped(cache) == {"host_pressure": 0}, "_tracks_write_through_unbacked_evictions: write_through only"
    assert cache.metrics.evicted_tokens.value == 3 * PS


def test_unbacked_eviction_under_write_through_after_the_host_copy_was_evicted(make_cache) -> None:
    cache = make_cache(device_pages=6, host_pages=3, write_policy="write_through", storage_backup=False)
    m = cache.metrics
    run(cache, toks(3, 100))  # backed up: the host is full
    run(cache, toks(3, 500))  # its backup evicts the first request's host copies
    assert m.host_evicted_tokens.value == 3 * PS
    assert m.backup_tokens.value == 6 * PS
    run(cache, toks(3, 900))  # device full: LRU frontier pages go, the first request's unbacked
    assert m.evicted_tokens.value == 3 * PS
    assert dropped(cache) == {"host_pressure": 0, "write_through_unbacked_eviction": 2 * PS}


# --- load-back and eviction ---

@pytest.mark.parametrize("shard", [SHARD, SHARD_3L], ids=["2layers", "3layers"])
def test_load_back_counts_tokens_bytes_and_duration(make_cache, shard) -> None:
    cache = make_cache(shard=shard, device_pages=4, host_pages=16, write_policy="write_through", storage_backup=False)
    m = cache.metrics
    first = toks(4, 100, extra=1)
    run(cache, first)
    run(cache, toks(4, 500))  # evicts the first request from the device (it keeps its host copy)
    assert m.evicted_tokens.value == 4 * PS
    assert hist_count(m.eviction_duration) == 1
    assert m.eviction_duration.sum >= 0
    assert all(n.on_host and not n.on_device for n in nodes_for(cache, first))
    assert m.load_back_tokens.value == 0
    req = cache.begin(first)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert req.cached_tokens == 4 * PS and req.uncached_tokens == 1
    assert m.load_back_tokens.value == 4 * PS
    assert m.load_back_bytes.value == 4 * PS * shard.bytes_per_token
    assert m.load_back_bytes.value == 4 * shard.page_bytes
    assert hist_count(m.load_back_duration) == 1
    assert m.evicted_tokens.value == 8 * PS, "loading back evicted the second request"
    assert hist_count(m.eviction_duration) == 2
    # The loaded-back pages hold exactly what was computed for them.
    for node in req.path:
        assert torch.equal(cache.device_pool.data[node.device_page], expected_page(cache, node.hash))
    cache.finish(req)


def test_host_pool_gauges(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=10, write_policy="write_through", storage_backup=False)
    m = cache.metrics
    assert (m.host_used.value, m.host_total.value) == (0, 10 * PS)
    assert (m.host_pool_used.value, m.host_pool_total.value) == (0, 10 * PS)
    run(cache, toks(3, 100))
    assert (m.host_used.value, m.host_total.value) == (3 * PS, 10 * PS)
    assert (m.host_pool_used.value, m.host_pool_total.value) == (3 * PS, 10 * PS)
    series = {(name, values): child for (name, values), child in m.client_for("hicache_host_pool_used_tokens").metrics.items()}
    assert series[("hicache_host_pool_used_tokens", ("kv",))] is m.host_pool_used


def test_host_gauges_live_on_the_scheduler_client_only(make_cache) -> None:
    cache = make_cache(scheduler=False, device_pages=16, host_pages=10, storage_backup=False)
    m = cache.metrics
    assert not m.has_scheduler and m.clients[Collector.SCHEDULER] is None
    run(cache, toks(3, 100))  # no scheduler statistics on this rank: nothing to set, nothing fails
    assert m.backup_tokens.value == 3 * PS


def test_l3_prefetch_counters_and_data_round_trip(make_cache) -> None:
    writer = make_cache(l3="shared", device_pages=16, host_pages=16, write_policy="write_through")
    tokens = toks(4, 100, extra=3)
    run(writer, tokens)
    writer.close()  # flushes: the pages are in L3
    assert writer.metrics.backuped_tokens.value == 4 * PS
    reader = make_cache(l3="shared", device_pages=16, host_pages=16, prefetch_threshold=PS)
    m = reader.metrics
    req = reader.begin(tokens)
    assert req.storage_hit_tokens == 4 * PS
    assert m.prefetch_hit_tokens.value == 4 * PS
    assert m.host_used.value == 4 * PS, "the prefetch holds its host pages"
    assert reader.admit(req) is AdmitStatus.ADMITTED
    assert m.prefetched_tokens.value == 4 * PS
    assert m.storage_prefetch_bytes.value == 4 * SHARD.page_bytes
    assert hist_count(m.storage_prefetch_duration) == 1
    counts, total = m.prefetch_pgs.cumulative()
    assert counts == [0, 1, 1, 1, 1, 1] and total == 4
    assert m.load_back_tokens.value == 4 * PS
    assert req.cached_tokens == 4 * PS
    assert req.storage_accounted == req.storage_hit_tokens
    # device <- host <- file <- host <- device: the KV written by the writer comes back bit-identical.
    for node in req.path:
        assert torch.equal(reader.device_pool.data[node.device_page], expected_page(reader, node.hash))
    reader.finish(req)


def test_timeout_prefetch_policy_with_ample_time_fulfills_everything(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, prefetch_policy="timeout", prefetch_timeout=30.0,
                       prefetch_threshold=PS, storage_backup=False)
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert req.cached_tokens == 4 * PS


# --- host gauges stay true when host pages go back without a new allocation ---

def test_host_gauge_after_abort_of_a_prefetch(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, prefetch_threshold=PS, storage_backup=False)
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    req = cache.begin(tokens)
    assert cache.metrics.host_used.value == 4 * PS
    cache.abort(req)
    assert cache.host_pool.used_pages == 0
    assert cache.metrics.host_used.value == cache.host_pool.used_pages * PS, "hicache_host_used_tokens is stale"
    assert cache.metrics.host_pool_used.value == 0


def test_host_gauge_after_a_failed_prefetch(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, prefetch_threshold=PS, storage_backup=False)
    tokens = toks(3, 100)
    hashes = seed_l3(cache.storage, tokens)
    cache.storage.path(hashes[0]).write_bytes(b"")  # nothing can be read
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert unfulfilled(cache)["storage_transfer"] == 3 * PS
    assert cache.host_pool.used_pages == 0
    assert cache.metrics.host_used.value == 0, "hicache_host_used_tokens is stale"


def test_host_gauge_after_a_dropped_refill(make_cache) -> None:
    cache = make_cache(device_pages=8, host_pages=16, write_policy="write_through_selective",
                       prefetch_threshold=PS, storage_backup=False)
    tokens = toks(6, 100)
    run(cache, tokens[:2 * PS])  # hit once: on the device, no host copy
    seed_l3(cache.storage, tokens, indices=range(2, 6))
    cache.begin(tokens)
    cache.poll(wait=True)
    assert unfulfilled(cache)["dropped"] == 4 * PS
    assert cache.host_pool.used_pages == 0
    assert cache.metrics.host_used.value == 0, "hicache_host_used_tokens is stale"


# --- config and lifecycle ---

@pytest.mark.parametrize("kwargs", [{"write_policy": "write_around"}, {"prefetch_policy": "eager"},
                                    {"device_pages": 0}, {"host_pages": 0}])
def test_config_is_validated(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        HiCacheConfig(**kwargs)


def test_lifecycle_order_is_enforced(make_cache) -> None:
    cache = make_cache(l3=None)
    req = cache.begin(toks(2, 1))
    with pytest.raises(ValueError):
        cache.finish(req)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    with pytest.raises(ValueError):
        cache.admit(req)
    cache.finish(req)
    with pytest.raises(ValueError):
        cache.finish(req)
    cache.abort(req)  # no-op on a finished request
    assert req.state == "finished"


def test_without_storage_nothing_touches_l3(make_cache) -> None:
    cache = make_cache(l3=None, device_pages=3, host_pages=6)
    run(cache, toks(3, 100))
    run(cache, toks(3, 500))
    run(cache, toks(3, 100))
    cache.flush()
    m = cache.metrics
    assert not m.has_storage and m.clients[Collector.STORAGE] is None, "no storage collector without a backend"
    assert m.load_back_tokens.value > 0


def test_l3_write_that_never_lands_is_not_counted(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, write_policy="write_through")
    cache.storage.page_bytes = 1  # every put is refused as a wrong-size page
    tokens = toks(3, 100)
    run(cache, tokens)
    cache.flush()
    m = cache.metrics
    # Cache mode logs the completed tokens of a backup; hicache_backup_dropped_tokens_total is a
    # buffer-mode family, which cache_core's storage client does not even hold.
    assert "hicache_backup_dropped_tokens_total" not in m.clients[Collector.STORAGE].metrics.catalog
    assert m.backuped_tokens.value == 0 and m.storage_backup_bytes.value == 0
    assert hist_count(m.backup_pgs) == 0
    assert all(not n.in_storage and n.io_lock == 0 for n in nodes_for(cache, tokens))
    assert m.backup_tokens.value == 3 * PS, "the L1->L2 backup itself happened"


def test_poll_without_wait_commits_only_finished_prefetches(make_cache) -> None:
    cache = make_cache(device_pages=16, host_pages=16, prefetch_threshold=PS, storage_backup=False)
    tokens = toks(3, 100)
    seed_l3(cache.storage, tokens)
    req = cache.begin(tokens)
    job = req.prefetch
    assert job is not None and job.finished.wait(10)
    cache.poll()
    assert req.prefetch is None and len(req.l3_nodes) == 3
    assert cache.metrics.prefetched_tokens.value == 3 * PS
    assert [n.on_host and not n.on_device for n in req.l3_nodes] == [True] * 3
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert req.storage_accounted == req.storage_hit_tokens == 3 * PS


# --- which series exist: what the engine pre-seeds, then what was logged ---

@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
def test_a_fresh_cache_holds_only_what_the_engine_pre_seeds(make_cache, policy) -> None:
    cache = make_cache(write_policy=policy, device_pages=16, host_pages=16)
    families = {}
    for (family, values) in all_children(cache):
        families.setdefault(family, []).append(values)
    dropped_reasons = [("host_pressure", "kv")] + ([("write_through_unbacked_eviction", "kv")]
                                                  if policy == "write_through" else [])
    assert families == {
        "hicache_dropped_tokens_total": dropped_reasons,
        "storage_prefetch_unfulfilled_tokens_total": [(r,) for r in PRESET_REASONS],
        "storage_prefetch_deferred_tokens_total": [("host_capacity",), ("device_capacity",)],
        "prefill_effective_tokens_total": [(m,) for m in ("input", "device_hit", "host_hit", "storage_hit")],
        "hicache_host_used_tokens": [()], "hicache_host_total_tokens": [()],
        "hicache_host_pool_used_tokens": [("kv",)], "hicache_host_pool_total_tokens": [("kv",)],
    }
    run(cache, toks(3, 100))
    new = {family for family, _ in all_children(cache)} - set(families)
    assert "hicache_backup_tokens_total" in new if policy == "write_through" else "hicache_backup_tokens_total" not in new
    assert "evicted_tokens_total" not in new and "load_back_tokens_total" not in new, "nothing was evicted or loaded"
