"""Page copies between pools with torch: CUDA streams, pinned staging and event timing on a GPU.

On a GPU each copy runs on a dedicated stream; host pages live in pinned memory so copies are
`non_blocking` DMA, and durations come from CUDA events recorded on that stream. On CPU the very
same code runs on CPU tensors and is timed with perf_counter.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from cache_core.pools import PagePool

# More runs than this and a gather/scatter through one staging tensor beats per-run copies.
MAX_RUN_COPIES = 64


@dataclass(frozen=True)
class TransferResult:
    """What one batched copy moved: pages, real bytes and the copy span in seconds."""

    pages: int
    bytes: int
    seconds: float


def page_runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce page pairs into (src_start, dst_start, length) runs contiguous on both sides."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class PageMover:
    """Copies pages between two pools (any pair of devices) and reports bytes and time."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if self.cuda else None

    def copy(self, src: PagePool, src_pages: list[int], dst: PagePool, dst_pages: list[int]) -> TransferResult:
        """Copy src_pages of `src` into dst_pages of `dst`; returns once the data has landed."""
        if len(src_pages) != len(dst_pages):
            raise ValueError("source and destination page lists differ in length")
        if src.shard.page_shape != dst.shard.page_shape or src.data.dtype != dst.data.dtype:
            raise ValueError("pools hold pages of different shapes or dtypes")
        if not src_pages:
            return TransferResult(0, 0, 0.0)
        moved = len(src_pages) * src.shard.page_bytes
        if self.cuda:
            return TransferResult(len(src_pages), moved, self._copy_cuda(src, src_pages, dst, dst_pages))
        started = time.perf_counter()
        self._copy_pages(src, src_pages, dst, dst_pages, non_blocking=False)
        return TransferResult(len(src_pages), moved, time.perf_counter() - started)

    def _copy_cuda(self, src: PagePool, src_pages: list[int], dst: PagePool, dst_pages: list[int]) -> float:
        assert self.stream is not None
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        # The copy stream must see every write the compute stream made to these pages.
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            start.record(self.stream)
            self._copy_pages(src, src_pages, dst, dst_pages, non_blocking=True)
            end.record(self.stream)
        end.synchronize()
        return start.elapsed_time(end) / 1000.0

    @staticmethod
    def _copy_pages(src: PagePool, src_pages: list[int], dst: PagePool, dst_pages: list[int], non_blocking: bool) -> None:
        runs = page_runs(src_pages, dst_pages)
        if len(runs) <= MAX_RUN_COPIES:
            for s, d, n in runs:
                dst.data[d:d + n].copy_(src.data[s:s + n], non_blocking=non_blocking)
            return
        # Fragmented: gather on the source device, one bulk copy, scatter on the destination.
        src_index = torch.tensor(src_pages, dtype=torch.long, device=src.device)
        gathered = src.data.index_select(0, src_index)
        if gathered.device != dst.device:
            pin = gathered.device.type == "cuda" and dst.device.type == "cpu"
            staged = torch.empty(gathered.shape, dtype=gathered.dtype, device=dst.device, pin_memory=pin)
            staged.copy_(gathered, non_blocking=non_blocking)
            if non_blocking and pin:
                torch.cuda.current_stream(src.device).synchronize()  # staged is read by the CPU next
            gathered = staged
        dst_index = torch.tensor(dst_pages, dtype=torch.long, device=dst.device)
        dst.data.index_copy_(0, dst_index, gathered)
