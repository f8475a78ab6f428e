"""Model and shard geometry: heads over tp, layers over pp, bytes per token."""

from __future__ import annotations

import pytest
import torch

from cache_core.geometry import ModelGeometry, ShardGeometry


def test_heads_split_over_tp() -> None:
    model = ModelGeometry(layers=4, kv_heads=8, head_dim=16)
    assert [model.shard(r, 4, 0, 1).heads for r in range(4)] == [2, 2, 2, 2]
    assert model.shard(0, 1, 0, 1).heads == 8
    assert model.shard(7, 8, 0, 1).heads == 1


def test_mla_keeps_one_latent_on_every_tp_rank() -> None:
    model = ModelGeometry(layers=4, kv_heads=8, head_dim=16, mla=True)
    for tp_size in (1, 2, 3, 8, 16):  # not split: even a tp size that does not divide the heads is fine
        shard = model.shard(tp_size - 1, tp_size, 0, 1)
        assert shard.heads == 1
        assert shard.kv_planes == 1
        assert shard.page_shape == (4, 1, model.page_size, 1, 16)


@pytest.mark.parametrize(("layers", "pp_size", "expected"), [
    (6, 2, [3, 3]),
    (5, 2, [3, 2]),
    (5, 3, [2, 2, 1]),
    (7, 4, [2, 2, 2, 1]),
    (10, 4, [3, 3, 2, 2]),
    (3, 3, [1, 1, 1]),
])
def test_layers_split_over_pp_with_remainder_to_earlier_stages(layers: int, pp_size: int, expected: list[int]) -> None:
    model = ModelGeometry(layers=layers, kv_heads=2)
    got = [model.shard(0, 1, pp, pp_size).layers for pp in range(pp_size)]
    assert got == expected
    assert sum(got) == layers


@pytest.mark.parametrize(("dtype", "itemsize"), [("float16", 2), ("bfloat16", 2), ("float32", 4), ("float8_e4m3fn", 1)])
def test_bytes_per_token_formula(dtype: str, itemsize: int) -> None:
    model = ModelGeometry(layers=5, kv_heads=8, head_dim=64, dtype=dtype, page_size=16)
    shard = model.shard(1, 4, 0, 2)  # 2 heads, 3 layers
    assert (shard.layers, shard.heads) == (3, 2)
    assert shard.bytes_per_token == 3 * 2 * 2 * 64 * itemsize  # layers * K/V * heads * head_dim * itemsize
    assert shard.page_bytes == shard.bytes_per_token * 16
    # The formula agrees with a real tensor of one page.
    page = torch.empty(shard.page_shape, dtype=model.torch_dtype)
    assert page.numel() * page.element_size() == shard.page_bytes
    assert shard.page_shape == (3, 2, 16, 2, 64)


def test_mla_bytes_per_token() -> None:
    model = ModelGeometry(layers=4, kv_heads=8, head_dim=32, dtype="bfloat16", mla=True)
    shard = model.shard(3, 4, 1, 2)
    assert shard.bytes_per_token == 2 * 1 * 1 * 32 * 2  # one latent plane, one "head"


def test_small_geometry_numbers() -> None:
    shard = ModelGeometry(layers=2, kv_heads=2, head_dim=8, page_size=4).shard(0, 1, 0, 1)
    assert shard.bytes_per_token == 2 * 2 * 2 * 8 * 2 == 128
    assert shard.page_bytes == 512
    assert isinstance(shard, ShardGeometry)


def test_pp_stages_differ_in_bytes() -> None:
    model = ModelGeometry(layers=5, kv_heads=4, head_dim=8)
    first, second = model.shard(0, 2, 0, 2), model.shard(0, 2, 1, 2)
    assert (first.layers, second.layers) == (3, 2)
    assert first.bytes_per_token * 2 == second.bytes_per_token * 3


def test_uneven_heads_are_refused() -> None:
    with pytest.raises(ValueError, match="split evenly"):
        ModelGeometry(kv_heads=6).shard(0, 4, 0, 1)


@pytest.mark.parametrize(("tp_rank", "tp_size", "pp_rank", "pp_size"), [
    (2, 2, 0, 1), (-1, 2, 0, 1), (0, 2, 1, 1), (0, 2, -1, 2), (0, 0, 0, 1), (0, 1, 0, 0),
])
def test_bad_ranks_are_refused(tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ModelGeometry(kv_heads=8).shard(tp_rank, tp_size, pp_rank, pp_size)


def test_more_pp_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        ModelGeometry(layers=3).shard(0, 1, 3, 4)


@pytest.mark.parametrize("kwargs", [{"layers": 0}, {"kv_heads": 0}, {"head_dim": -1}, {"page_size": 0}, {"dtype": "int8"}])
def test_bad_model_is_refused(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        ModelGeometry(**kwargs)


def test_cp_ranks_hold_a_slice_of_every_page() -> None:
    model = ModelGeometry(layers=4, kv_heads=8, head_dim=16, page_size=16)
    whole = model.shard(1, 2, 0, 1)
    halves = [model.shard(1, 2, 0, 1, cp, 2) for cp in range(2)]
    for half in halves:
        assert (half.heads, half.layers, half.page_tokens) == (whole.heads, whole.layers, 8)
        assert half.bytes_per_token == whole.bytes_per_token, "a token slot costs the same"
        assert half.page_bytes * 2 == whole.page_bytes, "the cp ranks' pages sum to the whole page"
        page = torch.empty(half.page_shape, dtype=model.torch_dtype)
        assert page.numel() * page.element_size() == half.page_bytes
    assert whole.page_tokens == 16 and whole.cp_size == 1


@pytest.mark.parametrize(("cp_rank", "cp_size"), [(2, 2), (-1, 2)])
def test_bad_cp_ranks_are_refused(cp_rank: int, cp_size: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        ModelGeometry(layers=2, kv_heads=2).shard(0, 1, 0, 1, cp_rank, cp_size)


def test_a_page_that_does_not_split_over_cp_is_refused() -> None:
    with pytest.raises(ValueError, match="cp_size"):
        ModelGeometry(layers=2, kv_heads=2, page_size=6).shard(0, 1, 0, 1, 0, 4)
