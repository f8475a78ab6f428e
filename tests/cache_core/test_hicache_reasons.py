"""`storage_prefetch_unfulfilled_tokens_total{reason}`: one constructed situation per reason.

Each test asserts the whole delta over every reason series, so exactly the expected reason
moves, by the expected token count, and every storage hit token ends up either fulfilled
(loaded into the device prefix) or with exactly one reason.
"""

from __future__ import annotations

from cache_core.hicache import AdmitStatus, HiCache
from cache_core.instrumentation import UNFULFILLED
from tests.cache_core.support import PRESET_REASONS, PS, SHARD, deferred, delta, seed_l3, series, toks, unfulfilled

# Reason tests: no write-through to L3, so that L3 holds exactly what a test seeds.
BASE = dict(device_pages=16, host_pages=16, write_policy="write_back", prefetch_threshold=2 * PS, storage_backup=False)


def cfg(**overrides):
    return {**BASE, **overrides}


def settled(req) -> None:
    assert req.storage_accounted == req.storage_hit_tokens, "every storage hit token is fulfilled or given a reason"


def fulfilled(cache: HiCache, req) -> int:
    """Storage hit tokens of `req` that became device prefix."""
    in_prefix = {id(n) for n in req.path}
    return sum(1 for n in req.l3_nodes if id(n) in in_prefix) * PS


# --- the pre-set label set ---

def test_reasons_are_preset_at_zero_in_the_documented_order(make_cache) -> None:
    cache = make_cache(**cfg())
    reasons = [values[0] for values in series(cache, UNFULFILLED)]
    assert reasons == list(PRESET_REASONS)
    assert set(unfulfilled(cache).values()) == {0}
    assert deferred(cache) == {"host_capacity": 0, "device_capacity": 0}
    assert "shrunk" not in unfulfilled(cache)


# --- one test per reason ---

def test_below_threshold(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=4 * PS))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens, indices=[0, 1])  # 2 pages = 8 tokens < 16
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is None and req.storage_hit_tokens == 2 * PS
    assert cache.metrics.prefetch_hit_tokens.value == 2 * PS
    assert delta(before, unfulfilled(cache)) == {"below_threshold": 2 * PS}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    cache.finish(req)
    settled(req)
    assert delta(before, unfulfilled(cache)) == {"below_threshold": 2 * PS}
    assert cache.metrics.prefetched_tokens.value == 0


def test_hits_at_the_threshold_are_prefetched(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=2 * PS))
    tokens = toks(3, 100)
    seed_l3(cache.storage, tokens, indices=[0, 1])
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is not None
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(cache, req) == 2 * PS
    settled(req)


def test_host_capacity_on_partial_host_allocation(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=2))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    req = cache.begin(tokens)
    assert req.storage_hit_tokens == 4 * PS
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 2 * PS}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 2 * PS}
    assert delta(before_deferred, deferred(cache)) == {}
    assert fulfilled(cache, req) == 2 * PS
    assert cache.metrics.prefetched_tokens.value == 2 * PS
    settled(req)
    cache.finish(req)


def test_deferred_host_capacity_then_refetch_gives_up_with_host_capacity(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=4))
    first, second = toks(4, 100), toks(4, 500)
    seed_l3(cache.storage, first)
    seed_l3(cache.storage, second)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    r1 = cache.begin(first)  # its in-flight prefetch holds every host page
    r2 = cache.begin(second)
    assert r2.prefetch is None and r2.deferred_span == (0, 4)
    assert delta(before_deferred, deferred(cache)) == {"host_capacity": 4 * PS}
    assert delta(before, unfulfilled(cache)) == {}
    # r1 is still not committed: the re-fetch finds no host room and gives up.
    assert cache.admit(r2) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 4 * PS}
    assert delta(before_deferred, deferred(cache)) == {"host_capacity": 4 * PS}
    assert "shrunk" not in unfulfilled(cache), "a re-fetch that lost nothing does not create `shrunk`"
    settled(r2)
    cache.finish(r2)
    assert cache.admit(r1) is AdmitStatus.ADMITTED
    settled(r1)
    assert fulfilled(cache, r1) == 4 * PS


def test_device_capacity_when_the_device_cannot_take_l3_loaded_pages(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=6))
    holder = cache.begin(toks(4, 900))  # admitted, not finished: holds 4 of 6 device pages
    assert cache.admit(holder) is AdmitStatus.ADMITTED
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    req = cache.begin(tokens)
    status = cache.admit(req)
    assert delta(before, unfulfilled(cache)) == {"device_capacity": 2 * PS}
    assert cache.metrics.load_back_tokens.value == 2 * PS
    settled(req)  # 16 hit tokens: 8 loaded into the device prefix, 8 device_capacity
    assert status is AdmitStatus.NO_ROOM  # the two uncovered pages find no device room either
    cache.finish(holder)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"device_capacity": 2 * PS}, "attempt-level: counted once"
    assert delta(before_deferred, deferred(cache)) == {}
    settled(req)


def test_deferred_device_capacity_when_no_device_page_is_free(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=4))
    holder = cache.begin(toks(4, 900))
    assert cache.admit(holder) is AdmitStatus.ADMITTED  # every device page is held by a running request
    tokens = toks(2, 100)
    seed_l3(cache.storage, tokens)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.DEFERRED
    assert delta(before_deferred, deferred(cache)) == {"device_capacity": 2 * PS}
    assert delta(before, unfulfilled(cache)) == {}
    cache.finish(holder)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(cache, req) == 2 * PS
    settled(req)


def test_device_covered_when_computed_on_device_during_the_prefetch(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100)
    computing = cache.begin(tokens[:2 * PS])  # no L3 hits yet: it computes the first two pages
    assert computing.storage_hit_tokens == 0
    assert cache.admit(computing) is AdmitStatus.ADMITTED
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)  # the tree has nothing yet: prefetch all four pages
    assert req.storage_hit_tokens == 4 * PS and req.prefetch is not None
    cache.finish(computing)  # pages 0-1 land on the device while the I/O is in flight
    cache.poll(wait=True)
    assert delta(before, unfulfilled(cache)) == {"device_covered": 2 * PS}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"device_covered": 2 * PS}
    assert fulfilled(cache, req) == 2 * PS
    assert cache.metrics.load_back_tokens.value == 2 * PS
    settled(req)


def test_storage_transfer_on_a_truncated_l3_file(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100)
    hashes = seed_l3(cache.storage, tokens)
    cache.storage.path(hashes[2]).write_bytes(b"torn")  # exists (a hit), but cannot be read
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.storage_hit_tokens == 4 * PS
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"storage_transfer": 2 * PS}
    assert cache.metrics.prefetched_tokens.value == 2 * PS
    assert cache.metrics.storage_prefetch_bytes.value == 2 * SHARD.page_bytes
    assert fulfilled(cache, req) == 2 * PS
    assert cache.host_pool.used_pages == 2, "the unread page went back to the pool"
    settled(req)


def test_anchor_lost_when_the_device_anchor_is_evicted_before_commit(make_cache) -> None:
    for policy in ("write_back", "write_through_selective"):  # anchor demoted to host / anchor destroyed
        cache = make_cache(l3=f"l3-{policy}", **cfg(device_pages=4, write_policy=policy))
        tokens = toks(6, 100)
        first = cache.begin(tokens[:2 * PS])
        assert cache.admit(first) is AdmitStatus.ADMITTED
        cache.finish(first)  # pages 0-1 on the device
        seed_l3(cache.storage, tokens, indices=range(2, 6))
        before = unfulfilled(cache)
        req = cache.begin(tokens)
        assert req.anchor is not None and req.anchor.on_device and req.prefetch is not None
        other = cache.begin(toks(4, 900))  # needs the whole device: evicts the anchor and its parent
        assert cache.admit(other) is AdmitStatus.ADMITTED
        assert not req.anchor.on_device
        cache.poll(wait=True)
        assert delta(before, unfulfilled(cache)) == {"anchor_lost": 4 * PS}, policy
        assert cache.metrics.prefetched_tokens.value == 4 * PS, "the I/O itself happened"
        assert cache.host_pool.used_pages == (2 if policy == "write_back" else 0), "loaded pages were freed"
        cache.finish(other)
        settled(req)
        cache.abort(req)
        assert delta(before, unfulfilled(cache)) == {"anchor_lost": 4 * PS}, policy


def test_cache_admission_shortfall_when_the_committed_span_is_evicted_from_host(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=4, write_policy="write_through"))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    cache.poll(wait=True)  # committed: four host-only pages in the tree
    assert req.prefetch is None and len(req.l3_nodes) == 4
    assert cache.host_pool.used_pages == 4
    other = cache.begin(toks(2, 900))
    assert cache.admit(other) is AdmitStatus.ADMITTED
    cache.finish(other)  # its write-through backup evicts the two deepest committed pages
    assert cache.metrics.host_evicted_tokens.value == 2 * PS
    assert delta(before, unfulfilled(cache)) == {}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"cache_admission_shortfall": 2 * PS}
    assert fulfilled(cache, req) == 2 * PS
    settled(req)


def test_dropped_on_abort_with_a_prefetch_in_flight(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is not None
    cache.abort(req)
    assert delta(before, unfulfilled(cache)) == {"dropped": 4 * PS}
    assert cache.host_pool.used_pages == 0, "the prefetch's host pages were released"
    assert req.state == "aborted" and not cache._inflight
    cache.abort(req)  # idempotent
    assert delta(before, unfulfilled(cache)) == {"dropped": 4 * PS}
    settled(req)


def test_dropped_on_abort_of_a_deferred_request(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=2))
    blocker = toks(2, 700)
    seed_l3(cache.storage, blocker)
    tokens = toks(3, 100)
    seed_l3(cache.storage, tokens)
    r1 = cache.begin(blocker)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.deferred_span == (0, 3)
    cache.abort(req)
    assert delta(before, unfulfilled(cache)) == {"dropped": 3 * PS}
    settled(req)
    cache.abort(r1)


def test_abort_after_admission_drops_nothing(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100, extra=2)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    used = cache.device_pool.used_pages
    cache.abort(req)
    assert delta(before, unfulfilled(cache)) == {}
    assert cache.device_pool.used_pages == used, "no new pages were computed: the prefix stays cached"
    settled(req)


def test_shrunk_is_emitted_lazily_by_the_refetch_path(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=4))
    first, second = toks(4, 100), toks(4, 500)
    seed_l3(cache.storage, first)
    hashes = seed_l3(cache.storage, second)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    _r1 = cache.begin(first)
    r2 = cache.begin(second)
    assert r2.deferred_span == (0, 4)
    assert delta(before_deferred, deferred(cache)) == {"host_capacity": 4 * PS}
    cache.poll(wait=True)  # r1 commits: its host pages become evictable tree pages
    cache.storage.delete(hashes[2])  # the deferred span lost pages 2-3 (usable prefix: 2 pages)
    assert "shrunk" not in unfulfilled(cache)
    assert (UNFULFILLED, ("shrunk",)) not in set(cache.metrics.client.metrics)
    assert cache.admit(r2) is AdmitStatus.ADMITTED
    assert "shrunk" in unfulfilled(cache)
    assert delta(before, unfulfilled(cache)) == {"shrunk": 2 * PS}
    assert fulfilled(cache, r2) == 2 * PS
    settled(r2)
    sample = [s for s in cache.metrics.client.metrics.samples()
              if s["family"] == UNFULFILLED and s["labels"]["reason"] == "shrunk"]
    assert sample == [{"family": UNFULFILLED, "labels": {"reason": "shrunk"}, "value": 2 * PS}]


def test_mixed_reasons_in_one_cache_leave_aux_window_trim_and_device_overlap_at_zero(make_cache) -> None:
    """Drive all of the above in one cache; aux_window_trim and device_overlap stay at 0 throughout."""
    cache = make_cache(**cfg(device_pages=6, host_pages=4, prefetch_threshold=3 * PS))
    a = toks(2, 100)
    seed_l3(cache.storage, a)
    req = cache.begin(a)  # below threshold
    cache.admit(req)
    cache.finish(req)
    b = toks(4, 300)
    hb = seed_l3(cache.storage, b)
    cache.storage.path(hb[3]).write_bytes(b"")
    req = cache.begin(b)  # storage_transfer for the last page
    cache.admit(req)
    cache.finish(req)
    c = toks(4, 600)
    seed_l3(cache.storage, c)
    req = cache.begin(c)
    cache.abort(req)  # dropped
    values = unfulfilled(cache)
    assert values["below_threshold"] == 2 * PS
    assert values["storage_transfer"] == PS
    assert values["dropped"] == 4 * PS
    assert values["aux_window_trim"] == 0 and values["device_overlap"] == 0


def test_threshold_is_floored_at_the_page_size(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=0))
    assert cache.threshold == PS
    tokens = toks(2, 100)
    seed_l3(cache.storage, tokens, indices=[0])
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is not None, "one page of hits reaches a threshold floored at one page"
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    settled(req)


def test_deferred_counts_only_storage_prefetch_tokens(make_cache) -> None:
    """A cache with no L3 at all has no storage prefetch, so nothing can be a deferred storage prefetch token."""
    cache = make_cache(l3=None, **cfg(device_pages=4, host_pages=8, write_policy="write_through"))
    first = toks(4, 100)
    req = cache.begin(first)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    cache.finish(req)  # backed up to host
    holder = cache.begin(toks(4, 900))
    assert cache.admit(holder) is AdmitStatus.ADMITTED  # evicts `first` to host and holds the whole device
    again = cache.begin(first)
    assert cache.admit(again) is AdmitStatus.DEFERRED  # host hits wait for the device
    assert again.storage_hit_tokens == 0 and cache.metrics.prefetch_hit_tokens.value == 0
    assert deferred(cache) == {"host_capacity": 0, "device_capacity": 0}, \
        "storage_prefetch_deferred_tokens_total moved without any storage prefetch"
