"""A daemon thread that runs one caller's blocking work, one call at a time."""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class WorkerThread:
    """One caller's blocking work (an upstream's reads, the state file's writes), one call at a time, on its
    own daemon thread.

    Not a ThreadPoolExecutor: the interpreter joins those threads at exit, so one stuck in `open()`
    or a hung read would keep a stopped sidecar from exiting; a daemon thread is left behind.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._jobs: queue.SimpleQueue[tuple[concurrent.futures.Future[object], Callable[[], object]] | None] = (
            queue.SimpleQueue())
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        if self._closed:
            raise RuntimeError(f"{self.name}: the thread takes no more work")
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()
        self._jobs.put((future, fn))  # type: ignore[arg-type]
        return future

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            future, fn = job
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn()
            except BaseException as err:  # handed to whoever awaits the call, whatever it is
                future.set_exception(err)
            else:
                future.set_result(result)

    def shutdown(self) -> None:
        """Stop taking work; a call still running is left to finish (or not) on its own."""
        self._closed = True
        self._jobs.put(None)
