"""Rank layout and the upstream rank-label rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cache_core import parallel as parallel_module
from cache_core.geometry import ModelGeometry
from cache_core.parallel import ParallelState
from cache_core.rank import CACHE_TYPE, MODEL_NAME, STORAGE_BACKEND, RankSpec, build_rank
from exporter.catalog import Collector
from exporter.labels import radix_cache_metric_labels

UPSTREAM = SimpleNamespace(tp_rank=3, pp_rank=1, attn_tp_rank=1, attn_dp_rank=2)


@pytest.mark.parametrize("rule", [radix_cache_metric_labels, parallel_module.radix_cache_metric_labels])
def test_upstream_label_rule_with_dp_attention(rule) -> None:
    labels = rule("HiRadixCache", UPSTREAM, True)
    assert labels == {"cache_type": "HiRadixCache", "tp_rank": 1, "pp_rank": 1, "dp_rank": 2}


@pytest.mark.parametrize("rule", [radix_cache_metric_labels, parallel_module.radix_cache_metric_labels])
def test_upstream_label_rule_without_dp_attention(rule) -> None:
    labels = rule("HiRadixCache", UPSTREAM, False)
    assert labels == {"cache_type": "HiRadixCache", "tp_rank": 3, "pp_rank": 1, "dp_rank": 0}


def test_parallel_state_labels_follow_the_rule() -> None:
    with_dp = ParallelState(tp_rank=3, pp_rank=1, attn_tp_rank=1, attn_dp_rank=2, tp_size=4, pp_size=2, attn_tp_size=2, dp_size=3)
    assert with_dp.dp_attention
    assert with_dp.metric_labels("HiRadixCache") == {"cache_type": "HiRadixCache", "tp_rank": 1, "pp_rank": 1, "dp_rank": 2}
    without = ParallelState(tp_rank=3, pp_rank=1, attn_tp_rank=1, attn_dp_rank=2, tp_size=4, pp_size=2, attn_tp_size=4, dp_size=1)
    assert not without.dp_attention
    assert without.metric_labels("HiRadixCache") == {"cache_type": "HiRadixCache", "tp_rank": 3, "pp_rank": 1, "dp_rank": 0}


def test_extra_labels_are_merged_on_top() -> None:
    state = ParallelState.from_layout(0, 0, 1, 2, 1, 2)
    labels = state.metric_labels("HiRadixCache", {"model": "m", "cache_type": "override"})
    assert labels == {"cache_type": "override", "tp_rank": 0, "pp_rank": 0, "dp_rank": 1, "model": "m"}


def test_from_layout_mapping() -> None:
    state = ParallelState.from_layout(attn_tp_rank=2, pp_rank=1, dp_rank=1, attn_tp_size=4, pp_size=2, dp_size=3)
    assert state == ParallelState(tp_rank=6, pp_rank=1, attn_tp_rank=2, attn_dp_rank=1,
                                  tp_size=12, pp_size=2, attn_tp_size=4, dp_size=3)
    assert state.dp_attention
    assert state.metric_labels("c") == {"cache_type": "c", "tp_rank": 2, "pp_rank": 1, "dp_rank": 1}


def test_from_layout_dp_groups_are_contiguous_tp_ranks() -> None:
    groups = {d: sorted(ParallelState.from_layout(a, 0, d, 2, 1, 3).tp_rank for a in range(2)) for d in range(3)}
    assert groups == {0: [0, 1], 1: [2, 3], 2: [4, 5]}  # tp_rank = attn_dp_rank * attn_tp_size + attn_tp_rank


def test_from_layout_covers_every_tp_rank_once() -> None:
    states = [ParallelState.from_layout(a, p, d, 2, 2, 2) for a in range(2) for p in range(2) for d in range(2)]
    assert sorted((s.tp_rank, s.pp_rank) for s in states) == [(t, p) for t in range(4) for p in range(2)]
    assert {(s.metric_labels("c")["tp_rank"], s.pp_rank, s.metric_labels("c")["dp_rank"]) for s in states} == {
        (a, p, d) for a in range(2) for p in range(2) for d in range(2)}


def test_from_layout_without_dp_attention() -> None:
    state = ParallelState.from_layout(3, 0, 0, 4, 1, 1)
    assert (state.tp_rank, state.tp_size, state.dp_attention) == (3, 4, False)
    assert state.metric_labels("c") == {"cache_type": "c", "tp_rank": 3, "pp_rank": 0, "dp_rank": 0}


@pytest.mark.parametrize("args", [(2, 0, 0, 2, 1, 1), (0, 1, 0, 2, 1, 1), (0, 0, 2, 2, 1, 2), (-1, 0, 0, 2, 1, 1)])
def test_from_layout_refuses_out_of_range(args: tuple) -> None:
    with pytest.raises(ValueError, match="outside"):
        ParallelState.from_layout(*args)


# --- context parallelism ---

def test_from_layout_with_context_parallelism_follows_the_engines_rank_layout() -> None:
    # tp_rank = (attn_dp_rank * attn_cp_size + attn_cp_rank) * attn_tp_size + attn_tp_rank
    state = ParallelState.from_layout(attn_tp_rank=1, pp_rank=0, dp_rank=1, attn_tp_size=2, pp_size=1, dp_size=2,
                                      attn_cp_rank=1, attn_cp_size=2)
    assert (state.tp_rank, state.tp_size) == (7, 8)
    assert (state.attn_cp_rank, state.attn_cp_size) == (1, 2)
    states = [ParallelState.from_layout(a, 0, d, 2, 1, 2, c, 2) for d in range(2) for c in range(2) for a in range(2)]
    assert [s.tp_rank for s in states] == list(range(8))


def test_from_layout_refuses_an_out_of_range_cp_rank() -> None:
    with pytest.raises(ValueError, match="cp rank"):
        ParallelState.from_layout(0, 0, 0, 1, 1, 1, attn_cp_rank=2, attn_cp_size=2)


def test_stats_logging_ranks_are_attention_tp_and_cp_rank_zero() -> None:
    logging = {(a, c): ParallelState.from_layout(a, 0, 0, 2, 1, 1, c, 2).is_stats_logging_rank
               for a in range(2) for c in range(2)}
    assert logging == {(0, 0): True, (0, 1): False, (1, 0): False, (1, 1): False}


def test_the_three_label_sets_with_dp_attention_and_cp() -> None:
    state = ParallelState.from_layout(1, 1, 1, 2, 2, 2, attn_cp_rank=1, attn_cp_size=2)
    # Radix: attention tp rank and dp rank; cp peers would collide, so they say their cp rank.
    assert state.radix_labels("UnifiedRadixCache") == {
        "cache_type": "UnifiedRadixCache", "tp_rank": 1, "pp_rank": 1, "dp_rank": 1, "attn_cp_rank": 1}
    # Storage: no cache_type; attn_cp_rank always; pp_size and attn_cp_size.
    assert state.storage_labels("file") == {
        "storage_backend": "file", "tp_rank": 1, "dp_rank": 1, "pp_rank": 1, "pp_size": 2,
        "attn_cp_rank": 1, "attn_cp_size": 2}
    # Scheduler: the global tp rank.
    assert state.scheduler_labels("m") == {
        "model_name": "m", "engine_type": "unified", "tp_rank": 7, "pp_rank": 1, "moe_ep_rank": 0, "dp_rank": 1}


def test_the_label_sets_without_dp_attention() -> None:
    state = ParallelState.from_layout(1, 0, 0, 2, 1, 1, attn_cp_rank=1, attn_cp_size=2)
    assert state.tp_rank == 3 and not state.dp_attention
    # The global tp rank already tells cp peers apart: the radix labels are the engine's exactly.
    assert state.radix_labels("c") == {"cache_type": "c", "tp_rank": 3, "pp_rank": 0, "dp_rank": 0}
    assert state.storage_labels("file")["tp_rank"] == 3 and state.storage_labels("file")["dp_rank"] == 0
    assert ParallelState.from_layout(0, 0, 0, 2, 1, 1).radix_labels("c") == {
        "cache_type": "c", "tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


# --- a rank process's clients ---

def _spec(tmp_path: Path, **kw) -> RankSpec:
    geometry = ModelGeometry(layers=5, kv_heads=4, head_dim=8, page_size=4)
    base = dict(attn_tp_rank=1, pp_rank=1, dp_rank=1, attn_tp_size=2, pp_size=2, dp_size=2,
                socket_path=str(tmp_path / "none.sock"), storage_root=str(tmp_path / "l3"), geometry=geometry,
                extra_labels=(("model", "tiny"),))
    return RankSpec(**{**base, **kw})


def test_build_rank_labels_and_shard(tmp_path: Path) -> None:
    spec = _spec(tmp_path)
    clients, cache = build_rank(spec)
    try:
        radix, storage = clients.radix, clients.storage
        assert radix.rank == {"tp_rank": 1, "pp_rank": 1, "dp_rank": 1}
        assert radix.labels == {"cache_type": CACHE_TYPE, "model": "tiny"}
        assert CACHE_TYPE == "UnifiedRadixCache"
        # The whole server's world from every collector: tp 4 is the engine's (2 dp groups x 2 attention tp).
        server = {"tp_size": 4, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1}
        assert radix.world == server and storage.world == server
        assert storage.rank == {"tp_rank": 1, "pp_rank": 1, "dp_rank": 1, "attn_cp_rank": 0}
        assert storage.labels == {"storage_backend": STORAGE_BACKEND, "pp_size": "2", "attn_cp_size": "1", "model": "tiny"}
        assert clients.scheduler is None, "attn_tp_rank 1 logs no scheduler statistics"
        # Each client holds only its collector's families.
        assert {f.collector for f in radix.metrics.catalog} == {Collector.RADIX}
        assert {f.collector for f in storage.metrics.catalog} == {Collector.STORAGE}
        # With DP attention the heads are split over the attention tp group (2), not the whole tp (4).
        assert cache.shard == geometry_of(spec).shard(1, 2, 1, 2)
        assert (cache.shard.heads, cache.shard.layers) == (2, 2)
        assert cache.storage is not None and cache.storage.root == tmp_path / "l3" / "tp3-pp1"
        assert cache.storage.page_bytes == cache.shard.page_bytes
    finally:
        cache.close()


def geometry_of(spec: RankSpec) -> ModelGeometry:
    return spec.geometry


def test_build_rank_on_a_logging_cp_rank(tmp_path: Path) -> None:
    spec = _spec(tmp_path, attn_tp_rank=0, attn_cp_rank=0, attn_cp_size=2, pp_rank=0)
    clients, cache = build_rank(spec)
    try:
        scheduler = clients.scheduler
        assert scheduler is not None
        assert scheduler.rank == {"tp_rank": 4, "pp_rank": 0, "dp_rank": 1}  # (1 * 2 + 0) * 2 + 0
        assert scheduler.labels == {"model_name": MODEL_NAME, "engine_type": "unified", "moe_ep_rank": "0",
                                    "model": "tiny"}
        # The scheduler sends the server's world too (the sidecar maps its global tp rank 4 to dp 1, cp 0, tp 0).
        server = {"tp_size": 8, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 2}
        assert scheduler.world == clients.radix.world == clients.storage.world == server
        assert clients.radix.rank == {"tp_rank": 0, "pp_rank": 0, "dp_rank": 1, "attn_cp_rank": 0}
        # Each cp rank holds half the token slots of every page.
        assert cache.shard.page_tokens == 2 and cache.shard.page_bytes == spec.geometry.shard(0, 2, 0, 2).page_bytes // 2
        assert len(clients.all()) == 3
    finally:
        cache.close()


def test_a_family_bound_on_another_collectors_client_is_an_error(tmp_path: Path) -> None:
    from cache_core.instrumentation import CacheMetrics, client_catalog
    from exporter.client import RankClient
    from exporter.errors import UnknownFamilyError

    radix = RankClient(str(tmp_path / "x.sock"), catalog=client_catalog("radix"))
    storage = RankClient(str(tmp_path / "x.sock"), catalog=client_catalog("storage"))
    with pytest.raises(UnknownFamilyError):
        radix.counter("prefetched_tokens_total")  # a storage family on the radix connection
    with pytest.raises(ValueError, match="radix client"):
        CacheMetrics(storage, storage, page_size=4)  # the storage client passed as the radix one
    with pytest.raises(ValueError, match="radix client"):
        CacheMetrics(RankClient(str(tmp_path / "x.sock")), page_size=4)  # the whole catalog on one client
    metrics = CacheMetrics(radix, storage, page_size=4)
    assert metrics.client_for("prefetched_tokens_total") is storage
    assert metrics.client_for("load_back_bytes_total") is radix
    with pytest.raises(ValueError, match="scheduler"):
        metrics.client_for("hicache_host_used_tokens")
