"""Process-wide settings for a serving sidecar."""

from __future__ import annotations

import gc
import logging
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
