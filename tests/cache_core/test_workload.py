"""The synthetic workload, replica determinism through run_batch, and accounting over a whole run."""

from __future__ import annotations

from collections import Counter, defaultdict

import pytest

from cache_core.geometry import ModelGeometry
from cache_core.hicache import HiCache
from cache_core.instrumentation import CACHE_MODE_REASONS, UNFULFILLED
from cache_core.rank import run_batch
from cache_core.workload import Workload, WorkloadConfig
from exporter.catalog import MetricType, Semantics, default_catalog
from exporter.client import CounterChild, GaugeChild, HistogramChild
from tests.cache_core.support import PRESET_REASONS, PS, all_children, hist_count, unfulfilled

WORKLOAD = WorkloadConfig(seed=3, system_prompts=4, system_prompt_tokens=(24, 64), turn_tokens=(4, 16),
                          reply_tokens=(4, 12), max_turns=4, active_sessions=6, vocab=1000)
MODEL = ModelGeometry(layers=5, kv_heads=2, head_dim=8, page_size=PS)
STAGE0, STAGE1 = MODEL.shard(0, 1, 0, 2), MODEL.shard(0, 1, 1, 2)  # 3 layers, 2 layers
POOLS = dict(device_pages=24, host_pages=32, prefetch_threshold=2 * PS)
BATCHES, BATCH = 15, 4


def drive(cache: HiCache, workload: Workload, batches: int = BATCHES) -> None:
    for _ in range(batches):
        run_batch(cache, [workload.next_request() for _ in range(BATCH)])


def children(cache: HiCache) -> dict:
    return all_children(cache)


# --- the workload itself ---

def test_workload_is_deterministic_per_seed_and_dp_rank() -> None:
    a, b = Workload(WORKLOAD, 1), Workload(WORKLOAD, 1)
    stream_a = [a.next_request() for _ in range(40)]
    assert stream_a == [b.next_request() for _ in range(40)]
    other_dp = Workload(WORKLOAD, 0)
    assert [other_dp.next_request() for _ in range(40)] != stream_a
    other_seed = Workload(WorkloadConfig(**{**WORKLOAD.__dict__, "seed": 4}), 1)
    assert [other_seed.next_request() for _ in range(40)] != stream_a
    # Every dp group draws from the same system prompts (they depend on the seed only).
    assert Workload(WORKLOAD, 0).prompts == Workload(WORKLOAD, 5).prompts


def test_workload_shares_prefixes() -> None:
    w = Workload(WORKLOAD, 0)
    stream = [w.next_request() for _ in range(40)]
    assert all(any(r[:len(p)] == p for p in w.prompts) for r in stream), "every request starts with a system prompt"
    extended = sum(1 for i, r in enumerate(stream) for q in stream[:i] if len(q) < len(r) and r[:len(q)] == q)
    assert extended > 0, "later turns extend earlier requests of their session"
    assert all(0 <= t < WORKLOAD.vocab for r in stream for t in r)


# --- replicas agree on tokens; bytes follow the shard ---

def test_replicas_on_different_pp_stages_count_the_same_tokens(make_cache) -> None:
    big = make_cache(shard=STAGE0, l3="pp0", **POOLS)
    small = make_cache(shard=STAGE1, l3="pp1", **POOLS)
    drive(big, Workload(WORKLOAD, 1))
    drive(small, Workload(WORKLOAD, 1))
    assert STAGE0.bytes_per_token != STAGE1.bytes_per_token
    m = big.metrics
    assert m.load_back_tokens.value > 0 and m.prefetched_tokens.value > 0 and m.evicted_tokens.value > 0
    assert m.backuped_tokens.value > 0 and m.backup_tokens.value > 0, "the run exercises every tier"
    catalog = default_catalog()
    a, b = children(big), children(small)
    assert a.keys() == b.keys()
    checked_bytes = 0
    for key, child_a in a.items():
        spec, child_b = catalog.get(key[0]), b[key]
        if spec.type is MetricType.HISTOGRAM:
            if not key[0].endswith("bandwidth"):  # a 0-second op has no bandwidth sample
                assert hist_count(child_a) == hist_count(child_b), key  # same operations on both
            if spec.semantics is Semantics.REPLICATED:
                assert child_a.cumulative() == child_b.cumulative(), key
        elif spec.semantics is Semantics.REPLICATED:
            assert child_a.value == child_b.value, key
        else:  # per-shard counters are bytes: they scale with the shard
            assert child_a.value * STAGE1.bytes_per_token == child_b.value * STAGE0.bytes_per_token, key
            checked_bytes += child_a.value > 0
    assert checked_bytes == 4  # load-back, L1->L2 backup, L3 prefetch and L3 backup all moved bytes
    pairs = [(big, STAGE0), (small, STAGE1)]
    for cache, shard in pairs:
        mm = cache.metrics
        assert mm.load_back_bytes.value == mm.load_back_tokens.value * shard.bytes_per_token
        assert mm.backup_bytes.value == mm.backup_tokens.value * shard.bytes_per_token
        assert mm.storage_prefetch_bytes.value == mm.prefetched_tokens.value * shard.bytes_per_token
        assert mm.storage_backup_bytes.value == mm.backuped_tokens.value * shard.bytes_per_token


def test_cp_peers_count_the_same_tokens_and_split_the_bytes(make_cache) -> None:
    cp0 = make_cache(shard=MODEL.shard(0, 1, 0, 1, 0, 2), l3="cp0", **POOLS)
    cp1 = make_cache(shard=MODEL.shard(0, 1, 0, 1, 1, 2), l3="cp1", **POOLS)
    whole = make_cache(shard=MODEL.shard(0, 1, 0, 1), l3="whole", **POOLS)
    for cache in (cp0, cp1, whole):
        drive(cache, Workload(WORKLOAD, 4))
    catalog = default_catalog()
    a, b, c = children(cp0), children(cp1), children(whole)
    assert a.keys() == b.keys() == c.keys()
    for key, child in a.items():
        spec = catalog.get(key[0])
        if spec.type is MetricType.HISTOGRAM:
            if spec.semantics is Semantics.REPLICATED:
                assert child.cumulative() == b[key].cumulative() == c[key].cumulative(), key
        elif spec.semantics is Semantics.REPLICATED:
            assert child.value == b[key].value == c[key].value, key  # the same logical tokens on every cp rank
        else:
            assert child.value == b[key].value and child.value + b[key].value == c[key].value, key  # each a half
    assert cp0.metrics.load_back_bytes.value > 0


def test_other_dp_groups_count_other_tokens(make_cache) -> None:
    dp0 = make_cache(shard=STAGE0, l3="dp0", **POOLS)
    dp1 = make_cache(shard=STAGE0, l3="dp1", **POOLS)
    drive(dp0, Workload(WORKLOAD, 0))
    drive(dp1, Workload(WORKLOAD, 1))
    tokens = lambda c: (c.metrics.evicted_tokens.value, c.metrics.backup_tokens.value, c.metrics.load_back_tokens.value)  # noqa: E731
    assert tokens(dp0) != tokens(dp1)


def test_replica_with_the_same_shard_matches_exactly(make_cache) -> None:
    one = make_cache(shard=STAGE1, l3="r1", **POOLS)
    two = make_cache(shard=STAGE1, l3="r2", **POOLS)
    drive(one, Workload(WORKLOAD, 2))
    drive(two, Workload(WORKLOAD, 2))
    a, b = children(one), children(two)
    for key, child in a.items():
        if isinstance(child, (CounterChild, GaugeChild)):
            assert child.value == b[key].value, key
        else:
            assert isinstance(child, HistogramChild) and hist_count(child) == hist_count(b[key]), key


# --- accounting over a whole run ---

class RecordingCache(HiCache):
    """Records every request and the reason tokens given to each."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.requests: list = []
        self.reasons: dict[int, Counter] = defaultdict(Counter)

    def begin(self, tokens):
        req = super().begin(tokens)
        self.requests.append(req)
        return req

    def _account(self, req, reason, tokens):
        self.reasons[id(req)][reason] += tokens
        super()._account(req, reason, tokens)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize(("device_pages", "host_pages"), [(24, 32), (32, 24), (40, 48)])
def test_storage_hits_are_fulfilled_or_given_exactly_one_reason(make_cache, policy, device_pages, host_pages) -> None:
    cache = make_cache(cls=RecordingCache, shard=STAGE0, device_pages=device_pages, host_pages=host_pages,
                       prefetch_threshold=2 * PS, write_policy=policy)
    assert isinstance(cache, RecordingCache)
    before = unfulfilled(cache)
    drive(cache, Workload(WORKLOAD, 0), batches=12)
    m = cache.metrics
    fulfilled_total = covered_total = discarded_total = 0
    per_reason: Counter = Counter()
    for req in cache.requests:
        assert req.state in ("finished", "aborted")
        reasons = cache.reasons[id(req)]
        assert req.storage_open is None
        assert req.storage_accounted == req.storage_hit_tokens, "every storage hit token is resolved once"
        assert (req.storage_fulfilled + sum(reasons.values()) + req.storage_covered + req.storage_discarded
                == req.storage_hit_tokens), "fulfilled + reasons + covered + discarded == hits"
        assert req.storage_fulfilled % PS == 0
        fulfilled_total += req.storage_fulfilled
        covered_total += req.storage_covered
        discarded_total += req.storage_discarded
        per_reason.update(reasons)
    after = unfulfilled(cache)
    assert {r: after[r] - before.get(r, 0) for r in after} == {r: per_reason.get(r, 0) for r in after}
    assert set(per_reason) <= set(CACHE_MODE_REASONS), "only cache-mode reasons move"
    hits = m.prefetch_hit_tokens.value
    assert hits > 0
    assert fulfilled_total + sum(per_reason.values()) + covered_total + discarded_total == hits
    assert fulfilled_total <= m.prefetched_tokens.value <= hits, "tokens never exceed hits"
    assert m.storage_prefetch_bytes.value == m.prefetched_tokens.value * STAGE0.bytes_per_token
    assert after["aux_window_trim"] == 0 and after["device_overlap"] == 0
    assert [k for k in after if k in PRESET_REASONS] == list(PRESET_REASONS)
    # The host gauge tells the truth at the end of a run.
    assert m.host_used.value == cache.host_pool.used_pages * PS
    assert m.host_total.value == host_pages * PS


def test_only_cache_mode_reasons_ever_move(make_cache) -> None:
    cache = make_cache(shard=STAGE0, device_pages=16, host_pages=16, prefetch_threshold=PS)
    drive(cache, Workload(WORKLOAD, 3), batches=20)
    values = unfulfilled(cache)
    assert sum(values.values()) > 0, "other reasons did move"
    assert {r for r, v in values.items() if v} <= set(CACHE_MODE_REASONS)
    for reason in ("device_covered", "anchor_lost", "aux_window_trim", "device_overlap"):
        assert values[reason] == 0, reason  # pre-set, and no cache-mode path moves them
    keys = [values for (name, values) in all_children(cache) if name == UNFULFILLED]
    assert ("aux_window_trim",) in keys and ("device_overlap",) in keys
    assert ("shrunk",) not in keys
