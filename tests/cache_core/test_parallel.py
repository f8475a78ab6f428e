"""Rank layout and the upstream rank-label rule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from cache_core import parallel as parallel_module
from cache_core.geometry import ModelGeometry
from cache_core.parallel import ParallelState
from cache_core.rank import CACHE_TYPE, RankSpec, build_rank
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


def test_build_rank_labels_and_shard(tmp_path: Path) -> None:
    geometry = ModelGeometry(layers=5, kv_heads=4, head_dim=8, page_size=4)
    spec = RankSpec(attn_tp_rank=1, pp_rank=1, dp_rank=1, tp_size=2, pp_size=2, dp_size=2,
                    socket_path=str(tmp_path / "none.sock"), storage_root=str(tmp_path / "l3"), geometry=geometry,
                    extra_labels=(("model", "tiny"),))
    client, cache = build_rank(spec)
    try:
        assert client.rank == {"tp_rank": 1, "pp_rank": 1, "dp_rank": 1}
        assert client.labels == {"cache_type": CACHE_TYPE, "model": "tiny"}
        assert client.world == {"tp_size": 4, "pp_size": 2, "dp_size": 2}
        # With DP attention the heads are split over the attention tp group (2), not the whole tp (4).
        assert cache.shard == geometry.shard(1, 2, 1, 2)
        assert (cache.shard.heads, cache.shard.layers) == (2, 2)
        assert cache.storage is not None and cache.storage.root == tmp_path / "l3" / "tp3-pp1"
        assert cache.storage.page_bytes == cache.shard.page_bytes
    finally:
        cache.close()
