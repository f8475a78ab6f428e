"""The storage worker thread: reads L3 pages into host pages and writes host pages to L3.

It never touches metrics or the tree: it moves bytes and records what happened in the job;
the scheduler thread reads finished jobs and does all accounting.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from cache_core.pools import PagePool
from cache_core.storage import FileStorage, StorageError


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


class StorageWorker:
    """One background thread serving storage jobs in order."""

    def __init__(self, storage: FileStorage, host: PagePool) -> None:
        self.storage = storage
        self.host = host
        self._queue: queue.Queue[StorageJob | None] = queue.Queue()
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
                job.finished.set()

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
                self.storage.put(key, self.host.data[page].contiguous().view(torch.uint8).numpy().tobytes())
            except StorageError as err:
                job.error = str(err)
                return
            job.done_pages += 1
