"""The storage worker thread: reads L3 pages into host pages and writes host pages to L3.

It never touches metrics or the tree: it moves bytes and records what happened in the job;
the scheduler thread reads finished jobs and does all accounting.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from cache_core.pools import PagePool
from cache_core.storage import FileStorage, StorageError

log = logging.getLogger("cache_core.storage")
FAILURE_LOG_SECONDS = 60.0


@dataclass(eq=False)
class StorageJob:
    """A batch of pages to read (prefetch) or write (backup); progress is read under the GIL."""

    kind: str  # "prefetch" or "backup"
    keys: list[bytes]
    host_pages: list[int]
    done_pages: int = 0  # leading pages transferred successfully
    error: str | None = None
    seconds: float = 0.0
    cancelled: bool = False
    deadline_expired: bool = False  # the prefetch stop policy (timeout) ended the read
    finished: threading.Event = field(default_factory=threading.Event)
    owner: object | None = None  # the request or nodes the scheduler attached

    def cancel(self) -> None:
        """Stop after the page in progress; pages already done stay done."""
        self.cancelled = True


def page_bytes(page: torch.Tensor) -> bytes:
    """A host page's bytes, copied through a buffer torch fills itself (no numpy needed)."""
    flat = page.contiguous().view(torch.uint8).reshape(-1)
    buffer = bytearray(flat.numel())
    torch.frombuffer(buffer, dtype=torch.uint8).copy_(flat)
    return bytes(buffer)


class StorageWorker:
    """One background thread serving storage jobs in order."""

    def __init__(self, storage: FileStorage, host: PagePool) -> None:
        self.storage = storage
        self.host = host
        self._queue: queue.Queue[StorageJob | None] = queue.Queue()
        self._failures = 0
        self._failure_logged = 0.0
        self._thread = threading.Thread(target=self._run, name="hicache-storage", daemon=True)
        self._thread.start()

    def submit(self, job: StorageJob) -> StorageJob:
        self._queue.put(job)
        return job

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(30)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                if job.kind == "prefetch":
                    self._read(job)
                else:
                    self._write(job)
            except Exception as err:  # keep serving: a bad job must not kill the worker
                job.error = f"{type(err).__name__}: {err}"
            finally:
                job.seconds = time.perf_counter() - started
                if job.error is not None:
                    self._failed(job)
                job.finished.set()

    def _failed(self, job: StorageJob) -> None:
        """Say so in the log when jobs fail: at once, then once a minute with how many did. A
        storage that fails every job (a full disk, a missing dependency) is otherwise visible only
        as dropped-token counters."""
        self._failures += 1
        now = time.monotonic()
        if self._failures == 1 or now - self._failure_logged >= FAILURE_LOG_SECONDS:
            log.warning("storage %s failed (%d storage jobs failed so far): %s", job.kind, self._failures, job.error)
            self._failure_logged = now

    def _read(self, job: StorageJob) -> None:
        shape = self.host.data.shape[1:]
        dtype = self.host.data.dtype
        for key, page in zip(job.keys, job.host_pages):
            if job.cancelled:
                return
            try:
                data = self.storage.get(key)
            except StorageError as err:
                job.error = str(err)
                return
            tensor = torch.frombuffer(bytearray(data), dtype=dtype).view(shape)
            self.host.data[page].copy_(tensor)
            job.done_pages += 1

    def _write(self, job: StorageJob) -> None:
        for key, page in zip(job.keys, job.host_pages):
            try:
                self.storage.put(key, page_bytes(self.host.data[page]))
            except StorageError as err:
                job.error = str(err)
                return
            job.done_pages += 1
