"""Fixed-size page pools held in torch tensors, with a free-list page allocator."""

from __future__ import annotations

import torch

from cache_core.geometry import ShardGeometry


class PoolExhausted(Exception):
    """Raised internally when a pool cannot supply the pages asked for."""


class PagePool:
    """`num_pages` pages of one shard's KV, on one device; page ids are row indices of `data`."""

    def __init__(
        self, name: str, shard: ShardGeometry, num_pages: int, device: torch.device | str, pin_memory: bool = False
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"pool {name!r} needs at least one page")
        self.name = name
        self.shard = shard
        self.num_pages = num_pages
        self.device = torch.device(device)
        self.data = torch.zeros((num_pages, *shard.page_shape), dtype=shard.model.torch_dtype,
                                device=self.device, pin_memory=pin_memory and self.device.type == "cpu")
        # Lowest ids first, so that fresh allocations come out as contiguous runs.
        self._free: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def used_pages(self) -> int:
        return self.num_pages - len(self._free)

    @property
    def page_size(self) -> int:
        return self.shard.model.page_size

    def alloc(self, count: int) -> list[int]:
        """`count` page ids, or PoolExhausted (nothing allocated) when fewer are free."""
        if count > len(self._free):
            raise PoolExhausted(f"pool {self.name!r}: {count} pages asked, {len(self._free)} free")
        pages = [self._free.pop() for _ in range(count)]
        return pages

    def free(self, pages: list[int]) -> None:
        """Return pages to the pool (a double free is a bug and raises)."""
        for page in pages:
            if not 0 <= page < self.num_pages:
                raise ValueError(f"pool {self.name!r}: page {page} does not exist")
        if len(set(pages)) != len(pages) or set(pages) & set(self._free):
            raise ValueError(f"pool {self.name!r}: double free of pages {pages}")
        # Keep the free list sorted descending so pop() hands out the lowest ids (contiguous runs).
        self._free.extend(pages)
        self._free.sort(reverse=True)
