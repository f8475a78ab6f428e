"""Page-transfer benchmark: HiCache load-back (host→device) and backup (device→host) throughput,
as a ratio to a plain contiguous torch copy of the same bytes measured in the same run.

    python -m bench.transfer [--pages 64] [--repeats 20] [--device cpu|cuda] [--json FILE]

On a GPU the device pool is in CUDA memory, the host pool pinned, copies run on a dedicated
stream and are timed with CUDA events (the anchor too); on CPU both pools are CPU tensors.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

from cache_core.geometry import ModelGeometry
from cache_core.pools import PagePool
from cache_core.transfer import PageMover

GOAL_RATIO_CPU = 0.7


def _timed(fn: Callable[[], float], repeats: int) -> float:
    """Median seconds of `repeats` runs after one warm-up; `fn` returns its own duration."""
    fn()
    return statistics.median(fn() for _ in range(repeats))


def _anchor(src: torch.Tensor, dst: torch.Tensor, cuda: bool) -> Callable[[], float]:
    """A plain contiguous copy of the same number of bytes, timed the same way as the mover."""
    def run() -> float:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            return start.elapsed_time(end) / 1000.0
        started = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - started
    return run


def run(pages: int, repeats: int, device: str, progress: bool = True) -> list[dict[str, Any]]:
    torch.manual_seed(0)
    shard = ModelGeometry(layers=8, kv_heads=8, head_dim=128, dtype="float16", page_size=16).shard(0, 1, 0, 1)
    cuda = device == "cuda"
    pool_pages = pages * 4
    dev = PagePool("device", shard, pool_pages, device)
    host = PagePool("host", shard, pool_pages, "cpu", pin_memory=cuda)
    dev.data.normal_()
    host.data.normal_()
    mover = PageMover(device)
    moved = pages * shard.page_bytes
    rng = random.Random(0)
    layouts = {
        "contiguous": (list(range(pages)), list(range(pages, 2 * pages))),
        "fragmented": (rng.sample(range(pool_pages), pages), rng.sample(range(pool_pages), pages)),
    }
    rows = []
    for layout, (src_pages, dst_pages) in layouts.items():
        for op, src_pool, dst_pool in (("load_back", host, dev), ("backup", dev, host)):
            if progress:
                print(f"  measuring {op} ({layout}) ...", file=sys.stderr, flush=True)
            anchor_src = src_pool.data[:pages]
            anchor_dst = dst_pool.data[pages:2 * pages] if src_pool is not dst_pool else dst_pool.data[:pages]
            anchor_s = _timed(_anchor(anchor_src, anchor_dst, cuda), repeats)
            mover_s = _timed(lambda src_pool=src_pool, src_pages=src_pages, dst_pool=dst_pool, dst_pages=dst_pages:
                             mover.copy(src_pool, src_pages, dst_pool, dst_pages).seconds, repeats)
            ok = torch.equal(dst_pool.data[dst_pages[0]].cpu(), src_pool.data[src_pages[0]].cpu())
            rows.append({
                "op": op, "layout": layout, "device": device, "pages": pages, "bytes": moved,
                "anchor_gb_s": moved / anchor_s / 1e9, "hicache_gb_s": moved / mover_s / 1e9,
                "ratio": anchor_s / mover_s, "goal": GOAL_RATIO_CPU if not cuda else None, "bit_identical": ok,
            })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'op':<10} {'layout':<11} {'device':<6} {'MiB':>7} {'anchor GB/s':>12} {'hicache GB/s':>13} {'ratio':>6}  goal")
    for r in rows:
        goal = r["goal"]
        verdict = "-" if goal is None else (f">= {goal}: {'met' if r['ratio'] >= goal else 'NOT met'}")
        print(f"{r['op']:<10} {r['layout']:<11} {r['device']:<6} {r['bytes'] / 2**20:>7.1f} "
              f"{r['anchor_gb_s']:>12.2f} {r['hicache_gb_s']:>13.2f} {r['ratio']:>6.2f}  {verdict}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64, help="pages per copy (default 64 = 32 MiB)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default 1, as each rank process runs; more threads "
                             "make small per-page copies slower on a shared 2-core machine)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = run(args.pages, args.repeats, args.device)
    print_table(rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)
    return 0 if all(r["bit_identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
