"""Process-wide settings for a serving sidecar."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
import os
import resource
from collections.abc import Iterator
from contextlib import contextmanager

GC_YOUNG_THRESHOLD = 20_000


def tune_gc() -> None:
    """Freeze startup objects (modules, catalog, config) out of every collection and collect the
    young generation every 20,000 net container allocations instead of 700: bursts of pushes
    and scrapes then pay for far fewer collections. Nearly everything the sidecar frees goes by
    reference counting; cycles are still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


MALLOC_KEEP_BYTES = 64 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt() parameters (malloc.h)


def tune_malloc() -> bool:
    """Have glibc serve blocks under 64 MiB from its heap and keep up to 128 MiB of freed heap
    instead of giving each large block back to the kernel: a /metrics body and its copies were
    fresh mmaps on every scrape, each page a fault to fill (measured: BENCHMARKS.md, section
    "Fast paths", "glibc keeps freed heap"). Whether it applied (False off glibc, or with
    $HICACHE_EXPORTER_MALLOC_DEFAULT set)."""
    if os.environ.get("HICACHE_EXPORTER_MALLOC_DEFAULT"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * MALLOC_KEEP_BYTES))


@contextmanager
def serving_gc() -> Iterator[None]:
    """The serving settings of tune_gc() for one block, then the previous ones: for measuring
    the sidecar's parts in another process (the benchmarks) as `serve` runs them."""
    threshold = gc.get_threshold()
    tune_gc()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


def raise_fd_limit() -> tuple[int, int]:
    """Raise the soft limit on open files to the hard one: every rank connection, HTTP client
    and socket is a descriptor, and a soft limit of 1,024 stalled ingest and scrapes at about
    that many idle connections. Returns the (soft, hard) limits now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as err:
            logging.getLogger("hicache_exporter").warning("cannot raise the open-file limit from %d: %s", soft, err)
    return soft, hard
