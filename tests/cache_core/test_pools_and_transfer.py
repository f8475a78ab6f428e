"""Page pools and real torch page copies (CPU tensors here; the same code drives CUDA)."""

from __future__ import annotations

import pytest
import torch

from cache_core.geometry import ModelGeometry
from cache_core.pools import PagePool, PoolExhausted
from cache_core.transfer import MAX_RUN_COPIES, PageMover, page_runs
from tests.cache_core.support import SHARD


def random_pool(name: str, pages: int, shard=SHARD, seed: int = 0) -> PagePool:
    pool = PagePool(name, shard, pages, "cpu")
    generator = torch.Generator().manual_seed(seed)
    pool.data.copy_(torch.randn(pool.data.shape, generator=generator, dtype=torch.float32).to(pool.data.dtype))
    return pool


# --- pools ---

def test_pool_tensor_matches_geometry() -> None:
    pool = PagePool("p", SHARD, 5, "cpu")
    assert tuple(pool.data.shape) == (5, *SHARD.page_shape)
    assert pool.data.dtype == torch.float16
    assert pool.data[0].numel() * pool.data.element_size() == SHARD.page_bytes


def test_pool_allocates_lowest_ids_first_and_refuses_overdraw() -> None:
    pool = PagePool("p", SHARD, 6, "cpu")
    assert pool.alloc(3) == [0, 1, 2]
    assert (pool.free_pages, pool.used_pages) == (3, 3)
    with pytest.raises(PoolExhausted):
        pool.alloc(4)
    assert pool.free_pages == 3, "a refused allocation takes nothing"
    pool.free([1, 0])
    assert pool.alloc(3) == [0, 1, 3]


def test_pool_refuses_double_free_and_unknown_pages() -> None:
    pool = PagePool("p", SHARD, 4, "cpu")
    pages = pool.alloc(2)
    pool.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free(pages[:1])
    with pytest.raises(ValueError, match="double free"):
        pool.free([pages[1], pages[1]])
    with pytest.raises(ValueError, match="does not exist"):
        pool.free([4])
    with pytest.raises(ValueError):
        PagePool("p", SHARD, 0, "cpu")


# --- page_runs ---

def test_page_runs_coalesce_runs_contiguous_on_both_sides() -> None:
    assert page_runs([], []) == []
    assert page_runs([3], [7]) == [(3, 7, 1)]
    assert page_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    # Contiguous on the source only is not a run; nor on the destination only.
    assert page_runs([0, 1, 2], [5, 7, 8]) == [(0, 5, 1), (1, 7, 2)]
    assert page_runs([0, 2, 3], [4, 5, 6]) == [(0, 4, 1), (2, 5, 2)]
    # Descending pages do not coalesce.
    assert page_runs([3, 2, 1], [3, 2, 1]) == [(3, 3, 1), (2, 2, 1), (1, 1, 1)]
    assert page_runs([0, 1, 5, 6, 7, 2], [8, 9, 0, 1, 2, 3]) == [(0, 8, 2), (5, 0, 3), (2, 3, 1)]


def test_page_runs_preserve_every_pair() -> None:
    src = [4, 5, 6, 1, 2, 9, 10, 11, 12, 0]
    dst = [0, 1, 2, 3, 4, 8, 9, 10, 11, 30]
    expanded = [(s + i, d + i) for s, d, n in page_runs(src, dst) for i in range(n)]
    assert expanded == list(zip(src, dst))


# --- copies ---

def test_copy_reports_pages_times_page_bytes() -> None:
    src, dst = random_pool("device", 8), PagePool("host", SHARD, 8, "cpu")
    result = PageMover("cpu").copy(src, [0, 1, 2, 5, 7], dst, [3, 4, 5, 0, 1])
    assert result.pages == 5
    assert result.bytes == 5 * SHARD.page_bytes
    assert result.seconds >= 0
    empty = PageMover("cpu").copy(src, [], dst, [])
    assert (empty.pages, empty.bytes) == (0, 0)


def test_copy_round_trip_contiguous_is_bit_identical() -> None:
    device = random_pool("device", 8, seed=1)
    host = PagePool("host", SHARD, 8, "cpu")
    original = device.data.clone()
    mover = PageMover("cpu")
    mover.copy(device, [1, 2, 3], host, [4, 5, 6])
    assert torch.equal(host.data[4:7], original[1:4])
    device.data.zero_()
    mover.copy(host, [4, 5, 6], device, [1, 2, 3])
    assert torch.equal(device.data[1:4], original[1:4])
    assert not device.data[0].any() and not device.data[4:].any(), "only the destination pages are written"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_copy_round_trip_fragmented_uses_gather_and_is_bit_identical(dtype: str) -> None:
    shard = ModelGeometry(layers=2, kv_heads=2, head_dim=8, page_size=4, dtype=dtype).shard(0, 1, 0, 1)
    pages = 3 * (MAX_RUN_COPIES + 10)
    device = random_pool("device", pages, shard=shard, seed=2)
    host = PagePool("host", shard, pages, "cpu")
    original = device.data.clone()
    src = list(range(0, pages, 3))[: MAX_RUN_COPIES + 8]  # every third page: no two are adjacent
    dst = list(reversed(range(0, pages, 2)))[: len(src)]  # descending, also never coalescing
    assert len(page_runs(src, dst)) > MAX_RUN_COPIES, "this must exercise the gather/scatter path"
    mover = PageMover("cpu")
    out = mover.copy(device, src, host, dst)
    assert out.bytes == len(src) * shard.page_bytes
    for s, d in zip(src, dst):
        assert torch.equal(host.data[d], original[s])
    untouched = sorted(set(range(pages)) - set(dst))
    assert not host.data[untouched].any()
    device.data.zero_()
    back = mover.copy(host, dst, device, src)
    assert back.pages == len(src)
    assert torch.equal(device.data[src], original[src])
    assert not device.data[sorted(set(range(pages)) - set(src))].any()


def test_copy_just_below_the_run_limit_matches_gather() -> None:
    pages = 2 * MAX_RUN_COPIES + 2
    src = list(range(0, 2 * MAX_RUN_COPIES, 2))  # exactly MAX_RUN_COPIES runs: per-run copies
    assert len(page_runs(src, src)) == MAX_RUN_COPIES
    device = random_pool("device", pages, seed=3)
    host = PagePool("host", SHARD, pages, "cpu")
    PageMover("cpu").copy(device, src, host, src)
    assert torch.equal(host.data[src], device.data[src])


def test_copy_refuses_mismatched_lists_and_shapes() -> None:
    a = PagePool("a", SHARD, 4, "cpu")
    other = ModelGeometry(layers=3, kv_heads=2, head_dim=8, page_size=4).shard(0, 1, 0, 1)
    b = PagePool("b", other, 4, "cpu")
    mover = PageMover("cpu")
    with pytest.raises(ValueError, match="differ in length"):
        mover.copy(a, [0, 1], a, [2])
    with pytest.raises(ValueError, match="shapes"):
        mover.copy(a, [0], b, [0])
