"""`storage_prefetch_unfulfilled_tokens_total{reason}`: one constructed situation per reason, each at
the decision point of the engine's cache mode (sglang 0.5.23) that it names.

Each test asserts the whole delta over every reason series, so exactly the expected reason
moves, by the expected token count, and every storage hit token ends up fulfilled (the admitted
device prefix), with exactly one reason, covered by the tree already (no reason), or discarded
with its request (no reason).
"""

from __future__ import annotations

import threading

import pytest

from cache_core.hicache import AdmitStatus, HiCache
from cache_core.instrumentation import CACHE_MODE_REASONS, UNFULFILLED
from tests.cache_core.support import (
    PRESET_REASONS,
    PS,
    SHARD,
    all_children,
    deferred,
    delta,
    seed_l3,
    series,
    toks,
    unfulfilled,
)

# Reason tests: no write-through to L3, so that L3 holds exactly what a test seeds; a one-page
# host span is worth loading back (the engine's 10-token threshold is tested on its own).
BASE = dict(device_pages=16, host_pages=16, write_policy="write_back", prefetch_threshold=2 * PS,
            storage_backup=False, load_back_threshold=PS)


def cfg(**overrides):
    return {**BASE, **overrides}


def settled(req) -> None:
    assert req.storage_open is None, "nothing left open"
    assert req.storage_accounted == req.storage_hit_tokens, "every storage hit token is resolved exactly once"


def fulfilled(req) -> int:
    return req.storage_fulfilled


def gate_reads(cache: HiCache, key: bytes) -> tuple[threading.Event, threading.Event]:
    """Make the storage worker stop inside the read of `key` until `release` is set; `entered`
    tells that it got there (so a termination finds that page in progress, deterministically)."""
    entered, release = threading.Event(), threading.Event()
    storage = cache.storage
    assert storage is not None
    plain_get = storage.get

    def get(k: bytes) -> bytes:
        if k == key:
            entered.set()
            assert release.wait(10), "the test never released the read"
        return plain_get(k)

    storage.get = get  # type: ignore[method-assign]
    return entered, release


def release_on_cancel(req, release: threading.Event) -> None:
    job = req.prefetch
    plain_cancel = job.cancel

    def cancel() -> None:
        plain_cancel()
        release.set()  # the page in progress completes, the rest is not read

    job.cancel = cancel


# --- the pre-set label set, and the reasons cache mode can emit ---

def test_reasons_are_preset_at_zero_in_the_engines_order(make_cache) -> None:
    cache = make_cache(**cfg())
    reasons = [values[0] for values in series(cache, UNFULFILLED)]
    assert reasons == list(PRESET_REASONS)
    assert PRESET_REASONS.index("deadline") == PRESET_REASONS.index("storage_transfer") + 1
    assert set(unfulfilled(cache).values()) == {0}
    assert deferred(cache) == {"host_capacity": 0, "device_capacity": 0}
    assert "shrunk" not in unfulfilled(cache) and "unservable_prefix" not in unfulfilled(cache)


@pytest.mark.parametrize("reason", ["device_covered", "anchor_lost", "aux_window_trim", "device_overlap",
                                    "shrunk", "unservable_prefix"])
def test_buffer_mode_and_dead_reasons_cannot_be_emitted(make_cache, reason) -> None:
    cache = make_cache(**cfg())
    assert reason not in CACHE_MODE_REASONS
    with pytest.raises(ValueError, match="cache-mode"):
        cache.metrics.unfulfilled(reason)
    with pytest.raises(ValueError, match="cache-mode"):
        cache.metrics.deferred("device_capacity")


# --- below_threshold: the hit drain (unified_radix_cache.py:3189-3197) ---

def test_below_threshold(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=4 * PS))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens, indices=[0, 1])  # 2 pages = 8 tokens < 16
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is None and req.storage_hit_tokens == 2 * PS
    assert cache.metrics.prefetch_hit_tokens.value == 2 * PS, "hits are counted before the threshold"
    assert delta(before, unfulfilled(cache)) == {"below_threshold": 2 * PS}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    cache.finish(req)
    settled(req)
    assert delta(before, unfulfilled(cache)) == {"below_threshold": 2 * PS}
    assert cache.metrics.prefetched_tokens.value == 0


def test_a_span_shorter_than_the_threshold_issues_no_query(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=4 * PS))
    tokens = toks(3, 100)  # 12 tokens beyond the (empty) prefix: no lookup (2147-2155)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.storage_hit_tokens == 0 and cache.metrics.prefetch_hit_tokens.value == 0
    assert delta(before, unfulfilled(cache)) == {}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    settled(req)


def test_hits_at_the_threshold_are_prefetched(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_threshold=2 * PS))
    tokens = toks(3, 100)
    seed_l3(cache.storage, tokens, indices=[0, 1])
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is not None
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(req) == 2 * PS
    settled(req)


# --- host_capacity: the hit's host allocation (_try_alloc_storage_hit, 3107-3148) ---

def test_host_capacity_on_partial_host_allocation(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=2))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    req = cache.begin(tokens)
    assert req.storage_hit_tokens == 4 * PS
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 2 * PS}, "what did not fit (3141-3143)"
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 2 * PS}
    assert delta(before_deferred, deferred(cache)) == {}, "a partial allocation defers nothing"
    assert fulfilled(req) == 2 * PS
    assert cache.metrics.prefetched_tokens.value == 2 * PS
    settled(req)
    cache.finish(req)


@pytest.mark.parametrize("free_pages", [0, 1])
def test_a_total_host_capacity_failure_is_unfulfilled_and_deferred(make_cache, free_pages) -> None:
    cache = make_cache(**cfg(host_pages=4 + free_pages))
    first, second = toks(4, 100), toks(4, 500)
    seed_l3(cache.storage, first)
    seed_l3(cache.storage, second)
    r1 = cache.begin(first)  # its in-flight prefetch holds four host pages, outside the tree
    before, before_deferred = unfulfilled(cache), deferred(cache)
    r2 = cache.begin(second)  # free_pages < the 2-page threshold: nothing is fetched
    assert r2.prefetch is None and r2.storage_hit_tokens == 4 * PS
    # The whole hit is host_capacity, and the attempt is also counted as deferred, for the hit's size
    # (3114-3126: max(alloc_len, hit_tokens)).
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 4 * PS}
    assert delta(before_deferred, deferred(cache)) == {"host_capacity": 4 * PS}
    assert cache.host_pool.free_pages == free_pages, "the anchor lock was released, nothing allocated"
    assert cache.admit(r2) is AdmitStatus.ADMITTED  # computes everything
    assert delta(before, unfulfilled(cache)) == {"host_capacity": 4 * PS}
    settled(r2)
    cache.finish(r2)
    assert cache.admit(r1) is AdmitStatus.ADMITTED
    assert fulfilled(r1) == 4 * PS
    settled(r1)


# --- storage_transfer and deadline: the unread tail of a prefetch (_handle_prefetch_result, 2451-2457) ---

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
    assert fulfilled(req) == 2 * PS
    assert cache.host_pool.used_pages == 2, "the unread page went back to the pool"
    settled(req)


def test_deadline_when_the_timeout_policy_ends_the_read(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_policy="timeout", prefetch_timeout=0.05, prefetch_timeout_per_ki_token=0.0))
    tokens = toks(4, 100)
    hashes = seed_l3(cache.storage, tokens)
    entered, release = gate_reads(cache, hashes[1])
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    release_on_cancel(req, release)
    assert entered.wait(10), "the worker reached page 1"
    assert cache.admit(req) is AdmitStatus.ADMITTED  # waits its budget, then terminates the read
    # Pages 0-1 landed (1 was in progress), pages 2-3 were cut by the stop policy: deadline, not
    # storage_transfer (check_prefetch_progress, 2401-2419 -> 2451-2457).
    assert delta(before, unfulfilled(cache)) == {"deadline": 2 * PS}
    assert cache.metrics.prefetched_tokens.value == 2 * PS
    assert fulfilled(req) == 2 * PS
    settled(req)


def test_best_effort_termination_is_storage_transfer_not_deadline(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_policy="best_effort"))
    tokens = toks(4, 100)
    hashes = seed_l3(cache.storage, tokens)
    entered, release = gate_reads(cache, hashes[1])
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    release_on_cancel(req, release)
    assert entered.wait(10)
    assert cache.admit(req) is AdmitStatus.ADMITTED  # best_effort terminates at once, with no deadline
    assert delta(before, unfulfilled(cache)) == {"storage_transfer": 2 * PS}
    assert fulfilled(req) == 2 * PS
    settled(req)


def test_timeout_policy_with_ample_time_has_no_deadline(make_cache) -> None:
    cache = make_cache(**cfg(prefetch_policy="timeout", prefetch_timeout=30.0))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(req) == 4 * PS
    settled(req)


# --- device_capacity and cache_admission_shortfall: admission (schedule_policy.py:985-997) ---

def test_device_capacity_when_the_host_span_is_not_loaded_back(make_cache) -> None:
    # The engine's load-back threshold (10 tokens): two 4-token pages are recomputed, not loaded.
    cache = make_cache(**cfg(load_back_threshold=10))
    tokens = toks(2, 100, extra=1)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    cache.poll(wait=True)
    assert len(req.l3_nodes) == 2 and cache.metrics.prefetched_tokens.value == 2 * PS
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert req.cached_tokens == 0 and cache.metrics.load_back_tokens.value == 0
    assert (req.host_hit_tokens, req.host_loaded_tokens) == (2 * PS, 0)
    assert delta(before, unfulfilled(cache)) == {"device_capacity": 2 * PS}
    assert fulfilled(req) == 0
    settled(req)
    cache.finish(req)


def test_no_room_gives_no_reason_until_admitted(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=4))
    holder = cache.begin(toks(4, 900))
    assert cache.admit(holder) is AdmitStatus.ADMITTED  # every device page is held by a running request
    tokens = toks(2, 100)
    seed_l3(cache.storage, tokens)
    before, before_deferred = unfulfilled(cache), deferred(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.NO_ROOM
    assert delta(before, unfulfilled(cache)) == {} and delta(before_deferred, deferred(cache)) == {}
    assert req.storage_open == 2 * PS, "its accounting stays open while it waits"
    cache.finish(holder)
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(req) == 2 * PS
    settled(req)


def test_cache_admission_shortfall_when_the_loaded_span_is_evicted_from_host(make_cache) -> None:
    cache = make_cache(**cfg(host_pages=4, write_policy="write_through"))
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    cache.poll(wait=True)  # inserted: four host-only pages in the tree
    assert req.prefetch is None and len(req.l3_nodes) == 4
    assert cache.host_pool.used_pages == 4
    other = cache.begin(toks(2, 900))
    assert cache.admit(other) is AdmitStatus.ADMITTED
    cache.finish(other)  # its write-through backup evicts the two deepest loaded pages
    assert cache.metrics.host_evicted_tokens.value == 2 * PS
    assert delta(before, unfulfilled(cache)) == {}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert req.host_loaded_tokens == req.host_hit_tokens == 2 * PS, "the load-back itself was whole"
    assert delta(before, unfulfilled(cache)) == {"cache_admission_shortfall": 2 * PS}
    assert fulfilled(req) == 2 * PS
    settled(req)


# --- dropped: a refill under an un-backed-up node (unified_tree_core.py:2466-2474 -> 2483-2485) ---

@pytest.mark.parametrize("policy", ["write_through_selective", "write_through"])
def test_dropped_when_the_prefetch_would_hang_below_a_node_without_host_copy(make_cache, policy) -> None:
    host_pages = 16 if policy == "write_through_selective" else 6
    cache = make_cache(l3=f"l3-{policy}", **cfg(write_policy=policy, host_pages=host_pages))
    tokens = toks(6, 100)
    if policy == "write_through":
        # Fill the host with held prefetch pages, so that the first request's backup finds no room.
        held = toks(6, 700)
        seed_l3(cache.storage, held)
        holder = cache.begin(held)
        assert cache.host_pool.free_pages == 0
    first = cache.begin(tokens[:2 * PS])
    assert cache.admit(first) is AdmitStatus.ADMITTED
    cache.finish(first)  # pages 0-1 on the device with no host copy (hit once / no host room)
    assert all(not n.on_host for n in first.path + [cache.tree.match(first.pages)[-1]])
    if policy == "write_through":
        cache.abort(holder)
    seed_l3(cache.storage, tokens, indices=range(2, 6))
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.anchor is not None and req.anchor.on_device and not req.anchor.on_host
    cache.poll(wait=True)
    assert delta(before, unfulfilled(cache)) == {"dropped": 4 * PS}
    assert cache.metrics.prefetched_tokens.value >= 4 * PS, "the I/O itself happened"
    assert cache.host_pool.used_pages == 0, "the loaded pages were released"
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {"dropped": 4 * PS}
    settled(req)


def test_write_back_inserts_below_a_device_only_node(make_cache) -> None:
    cache = make_cache(**cfg(write_policy="write_back"))
    tokens = toks(6, 100)
    first = cache.begin(tokens[:2 * PS])
    assert cache.admit(first) is AdmitStatus.ADMITTED
    cache.finish(first)
    seed_l3(cache.storage, tokens, indices=range(2, 6))
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert not req.anchor.on_host
    cache.poll(wait=True)
    assert delta(before, unfulfilled(cache)) == {}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert fulfilled(req) == 4 * PS
    settled(req)


# --- aborts and retractions discard their accounting (2788; schedule_policy.py:963-972) ---

def test_abort_with_a_prefetch_in_flight_is_not_dropped(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert req.prefetch is not None
    cache.abort(req)
    assert delta(before, unfulfilled(cache)) == {}, "an aborted request's hits get no reason"
    assert req.storage_discarded == 4 * PS
    assert cache.host_pool.used_pages == 0, "the prefetch's host pages were released"
    assert req.state == "aborted" and not cache._inflight
    cache.abort(req)  # idempotent
    assert delta(before, unfulfilled(cache)) == {}
    settled(req)


def test_abort_of_a_waiting_request_after_its_prefetch_landed_is_not_dropped(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=4))
    holder = cache.begin(toks(4, 900))
    assert cache.admit(holder) is AdmitStatus.ADMITTED
    tokens = toks(3, 100)
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.NO_ROOM  # the prefetch is in the tree, the request waits
    cache.abort(req)
    assert delta(before, unfulfilled(cache)) == {}
    assert req.storage_discarded == 3 * PS
    settled(req)
    cache.finish(holder)


def test_abort_after_admission_counts_nothing_more(make_cache) -> None:
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
    assert fulfilled(req) == 4 * PS
    settled(req)


def test_retraction_discards_the_next_attempts_accounting(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=8, host_pages=4, write_policy="write_through"))
    tokens = toks(4, 100, extra=1)
    seed_l3(cache.storage, tokens, indices=[0, 1])
    req = cache.begin(tokens)
    assert cache.admit(req) is AdmitStatus.ADMITTED  # pages 0-1 from L3, pages 2-3 computed
    assert fulfilled(req) == 2 * PS
    seed_l3(cache.storage, tokens, indices=[2, 3])
    cache.retract(req)  # its computed pages go; it starts over: a new L3 attempt for pages 2-3
    assert req.state == "begun" and req.retracted
    assert req.storage_hit_tokens == 4 * PS and req.storage_open == 2 * PS, "the new attempt's hits are counted"
    cache.poll(wait=True)
    other = cache.begin(toks(2, 900))
    assert cache.admit(other) is AdmitStatus.ADMITTED
    cache.finish(other)  # its write-through backup evicts the re-fetched pages from the host
    before = unfulfilled(cache)
    prefill_before = {m: c.value for m, c in cache.metrics.prefill_tokens.items()}
    assert cache.admit(req) is AdmitStatus.ADMITTED
    # A request that was not retracted would have cache_admission_shortfall here.
    assert delta(before, unfulfilled(cache)) == {}
    assert req.storage_discarded == 2 * PS
    assert {m: c.value for m, c in cache.metrics.prefill_tokens.items()} == prefill_before, \
        "a retracted request's re-admission counts no prefill tokens"
    cache.finish(req)
    settled(req)


def test_only_a_running_request_can_be_retracted(make_cache) -> None:
    cache = make_cache(**cfg())
    req = cache.begin(toks(2, 100))
    with pytest.raises(ValueError):
        cache.retract(req)


# --- covered: the tree already holds a prefetched page (2486-2512: resolved with no reason) ---

def test_pages_computed_during_the_prefetch_are_covered_with_no_reason(make_cache) -> None:
    cache = make_cache(**cfg())
    tokens = toks(4, 100)
    computing = cache.begin(tokens[:2 * PS])  # no L3 hits yet: it computes the first two pages
    assert cache.admit(computing) is AdmitStatus.ADMITTED
    seed_l3(cache.storage, tokens)
    before = unfulfilled(cache)
    req = cache.begin(tokens)  # the tree has nothing yet: prefetch all four pages
    assert req.storage_hit_tokens == 4 * PS and req.prefetch is not None
    cache.finish(computing)  # pages 0-1 land on the device while the I/O is in flight
    cache.poll(wait=True)
    assert delta(before, unfulfilled(cache)) == {}, "device_covered is a buffer-mode reason"
    assert req.storage_covered == 2 * PS and req.loaded_tokens == 2 * PS and req.loaded_start == 2 * PS
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert delta(before, unfulfilled(cache)) == {}
    assert fulfilled(req) == 2 * PS
    assert cache.metrics.load_back_tokens.value == 2 * PS
    settled(req)


def test_the_anchor_is_pinned_while_the_prefetch_runs(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=4))
    tokens = toks(6, 100)
    first = cache.begin(tokens[:2 * PS])
    assert cache.admit(first) is AdmitStatus.ADMITTED
    cache.finish(first)
    seed_l3(cache.storage, tokens, indices=range(2, 6))
    req = cache.begin(tokens)
    anchor = req.anchor
    assert anchor is not None and anchor.lock == 1
    other = cache.begin(toks(4, 900))  # needs the whole device: the pinned anchor cannot go
    assert cache.admit(other) is AdmitStatus.NO_ROOM
    assert anchor.on_device
    cache.poll(wait=True)
    assert anchor.lock == 0 and req.anchor is None
    assert unfulfilled(cache)["anchor_lost"] == 0, "anchor_lost is a buffer-mode reason"
    cache.abort(other)
    cache.abort(req)


# --- the final per-tier count (prefill_effective_tokens_total, schedule_policy.py:975-983) ---

def test_prefill_tokens_by_tier(make_cache) -> None:
    cache = make_cache(**cfg(device_pages=4, host_pages=16, write_policy="write_through"))
    a = toks(2, 100)
    run = lambda tokens: (cache.admit(r := cache.begin(tokens)), cache.finish(r), r)[2]  # noqa: E731
    modes = lambda: {m: c.value for m, c in cache.metrics.prefill_tokens.items()}  # noqa: E731
    assert modes() == {"input": 0, "device_hit": 0, "host_hit": 0, "storage_hit": 0}
    run(a)  # computed: 8 input tokens, on device and host
    run(toks(4, 900))  # evicts a from the device; it keeps its host copy
    c = a + toks(2, 300, extra=3)  # a's two pages, two more pages in L3, three loose tokens
    seed_l3(cache.storage, c, indices=[2, 3])
    before = modes()
    req = run(c)
    got = {m: modes()[m] - before[m] for m in before}
    assert got == {"input": 3, "device_hit": 0, "host_hit": 2 * PS, "storage_hit": 2 * PS}
    assert req.cached_tokens == 4 * PS
    before = modes()
    run(c)  # everything on the device now
    assert {m: modes()[m] - before[m] for m in before} == {"input": 3, "device_hit": 4 * PS, "host_hit": 0,
                                                           "storage_hit": 0}


def test_a_rank_that_logs_no_scheduler_statistics_has_no_prefill_series(make_cache) -> None:
    cache = make_cache(scheduler=False, **cfg())
    req = cache.begin(toks(2, 100))
    assert cache.admit(req) is AdmitStatus.ADMITTED
    assert not any(name == "prefill_effective_tokens_total" for name, _ in all_children(cache))


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


def test_without_storage_there_is_no_storage_series_at_all(make_cache) -> None:
    cache = make_cache(l3=None, **cfg(device_pages=4, host_pages=8, write_policy="write_through"))
    req = cache.begin(toks(4, 100))
    assert cache.admit(req) is AdmitStatus.ADMITTED
    cache.finish(req)
    families = {name for name, _ in all_children(cache)}
    assert not families & {UNFULFILLED, "storage_prefetch_deferred_tokens_total", "prefetched_tokens_total"}
