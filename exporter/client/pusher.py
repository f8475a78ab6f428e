"""The background pusher: sends cumulative snapshots over the Unix socket, reconnecting with backoff.

Nothing here ever raises into the rank: failures are logged, counted in `PushStats`,
and retried after a capped exponential backoff with jitter.
"""

from __future__ import annotations

import logging
import math
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.client.metrics import GaugeChild, SeriesKey
from exporter.errors import ErrorCode, ProtocolError
from exporter.log_throttle import LogThrottle
from exporter.protocol.framing import FrameDecoder, encode_message
from exporter.protocol.messages import Bye, ErrorMessage, Hello, Snapshot, Welcome, parse_server_message

log = logging.getLogger("hicache_exporter.client")

REFUSAL_LOG_SECONDS = 60.0  # a refused rank says so at once, then once a minute while it lasts
# How long a push waits for the function gauges' callbacks: one still running then is stuck (left out, logged
# once, counted), and the pushes go on. An engine's callback reads a value under a lock: microseconds, not this.
CALLBACK_DEADLINE = 1.0


@dataclass
class PushStats:
    """What the pusher has done, for tests and for the rank's own logs."""

    snapshots_sent: int = 0
    connects: int = 0
    failures: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    refused: str | None = None  # why the sidecar refuses this rank's hello now (None once accepted)
    callbacks_stuck: int = 0  # function gauges' callbacks that missed their deadline (FunctionPoller)


class Pusher:
    """Owns the socket and the background thread; `hello()` and `snapshot(seq)` build the messages it sends."""

    def __init__(
        self,
        socket_path: str,
        hello: Callable[[], Hello],
        snapshot: Callable[[int], Snapshot],
        interval: float = 1.0,
        max_backoff: float = 5.0,
        io_timeout: float = 2.0,
        functions: Callable[[], list[tuple[SeriesKey, GaugeChild]]] | None = None,
        callback_deadline: float = CALLBACK_DEADLINE,
    ) -> None:
        """`functions` lists the gauges read from callbacks, which a FunctionPoller reads before each push."""
        self.socket_path = socket_path
        self._hello = hello
        self._snapshot = snapshot
        self.interval = interval
        self.max_backoff = max_backoff
        self.io_timeout = io_timeout
        self.stats = PushStats()
        self._poller = FunctionPoller(functions, callback_deadline, self.stats) if functions is not None else None
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._seq = 0
        self._refusals = LogThrottle(REFUSAL_LOG_SECONDS)
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._io_lock = threading.Lock()  # the thread and close() never write at once
        self._thread: threading.Thread | None = None
        self._closed = False

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hicache-pusher", daemon=True)
        self._thread.start()

    def push_now(self) -> None:
        """Ask the background thread to push without waiting for the interval."""
        self._wake.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread, then send a last snapshot and `bye` (best effort, bounded in time)."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._poller is not None:
            self._poller.close()
        with self._io_lock:
            if self.stats.refused is None:  # a refused rank would only be refused once more
                try:
                    self._ensure_connected()
                    self._send_snapshot()
                    self._send(Bye())
                except (OSError, ProtocolError) as err:
                    self._failed(err)
            self._disconnect()

    def restart(self, begin: Callable[[], None]) -> None:
        """End the connection's epoch and call `begin` (which starts the next), so that the next push says hello again.

        The epoch ends as a process that exits ends it: its last snapshot and `bye`, then the sidecar
        closing the connection, which frees the identity before the new hello (else it would be a
        duplicate). Best effort and bounded in time, as `close()`; without a connection only `begin` runs."""
        with self._io_lock:
            if self._sock is not None and self.stats.refused is None:
                try:
                    self._send_snapshot()
                    self._send(Bye())
                    self._await_close()
                except (OSError, ProtocolError) as err:
                    self._failed(err)
            self._disconnect()
            begin()
        self._wake.set()

    # --- the thread ---

    def _run(self) -> None:
        backoff = min(0.05, self.max_backoff)
        while not self._stop.is_set():
            if self._poller is not None:
                try:
                    self._poller.poll()
                except Exception as err:  # nothing it does may stop the pushes
                    log.warning("reading the function gauges failed: %s", err)
            with self._io_lock:
                if self._stop.is_set():
                    return
                try:
                    self._ensure_connected()
                    self._send_snapshot()
                    self._drain_replies()
                    backoff = min(0.05, self.max_backoff)
                    delay = self.interval
                except (OSError, ProtocolError) as err:
                    self._failed(err)
                    self._disconnect()
                    # A refused hello (stale epoch, a duplicate, a refused uid) only clears when
                    # something outside changes: keep asking, at the slowest pace.
                    delay = (self.max_backoff if self.stats.refused else backoff) * random.uniform(0.5, 1.0)
                    backoff = min(backoff * 2, self.max_backoff)
            self._wake.wait(delay)
            self._wake.clear()

    def _failed(self, err: Exception) -> None:
        self.stats.failures += 1
        self.stats.last_error = str(err)
        if self.stats.failures == 1 or self.stats.failures % 100 == 0:
            log.warning("push to %s failed (%d so far): %s", self.socket_path, self.stats.failures, err)

    # --- socket I/O (called with _io_lock held) ---

    def _ensure_connected(self) -> None:
        if self._sock is not None:
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.io_timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self._decoder = FrameDecoder()
        self._send(self._hello())
        reply = self._read_reply()
        if isinstance(reply, ErrorMessage):
            self._record_error(reply)
            self._refused(reply)
            raise ProtocolError(ErrorCode(reply.code) if reply.code in ErrorCode._value2member_map_
                                else ErrorCode.MALFORMED_FRAME, f"sidecar refused hello: {reply.code}: {reply.message}")
        self.stats.connects += 1
        if self.stats.refused is not None:
            log.warning("sidecar at %s accepts this rank again", self.socket_path)
            self.stats.refused = None

    def _disconnect(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None

    def _await_close(self) -> None:
        """Read until the sidecar closes the connection (it does after `bye`, once the identity is free)."""
        assert self._sock is not None
        deadline = time.monotonic() + self.io_timeout
        while (remaining := deadline - time.monotonic()) > 0:
            self._sock.settimeout(remaining)
            if not self._sock.recv(65536):
                return
        raise TimeoutError("the sidecar did not close the connection after bye")

    def _send(self, message: Hello | Snapshot | Bye) -> None:
        assert self._sock is not None
        self._sock.sendall(encode_message(message))

    def _send_snapshot(self) -> None:
        self._seq += 1
        self._send(self._snapshot(self._seq))
        self.stats.snapshots_sent += 1

    def _read_reply(self) -> Welcome | ErrorMessage:
        assert self._sock is not None
        while True:
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("sidecar closed the connection before answering hello")
            frames = self._decoder.feed(chunk)
            if frames:
                return parse_server_message(frames[0])

    def _drain_replies(self) -> None:
        """Read error frames the sidecar sent about earlier snapshots, without waiting."""
        assert self._sock is not None
        self._sock.setblocking(False)
        try:
            while True:
                try:
                    chunk = self._sock.recv(65536)
                except (BlockingIOError, InterruptedError):
                    return
                if not chunk:
                    raise ConnectionResetError("sidecar closed the connection")
                for frame in self._decoder.feed(chunk):
                    reply = parse_server_message(frame)
                    if isinstance(reply, ErrorMessage):
                        self._record_error(reply)
        finally:
            if self._sock is not None:
                self._sock.settimeout(self.io_timeout)

    def _record_error(self, reply: ErrorMessage) -> None:
        count = self.stats.errors_by_code.get(reply.code, 0) + 1
        self.stats.errors_by_code[reply.code] = count
        self.stats.last_error = f"{reply.code}: {reply.message}"
        if count == 1:
            log.warning("sidecar rejected data: %s", self.stats.last_error)

    def _refused(self, reply: ErrorMessage) -> None:
        """Say loudly, and again every minute, that this rank's numbers are not reaching the sidecar."""
        if self.stats.refused is None:  # a new refusal after an accepted hello says so at once
            self._refusals = LogThrottle(REFUSAL_LOG_SECONDS)
        if self._refusals.due("hello"):
            log.error(
                "sidecar at %s refuses this rank's hello (%s: %s): nothing this process counts reaches /metrics; "
                "retrying every %.0f s", self.socket_path, reply.code, reply.message, self.max_backoff,
            )
        self.stats.refused = f"{reply.code}: {reply.message}"


class _Reader:
    """One thread of a FunctionPoller; `calling` is the gauge whose callback it is in now, and since when."""

    __slots__ = ("thread", "calling", "retired")

    def __init__(self) -> None:
        self.thread: threading.Thread | None = None
        self.calling: tuple[SeriesKey, GaugeChild, float] | None = None
        self.retired = False  # left to a callback past its deadline: it ends when that call returns


class FunctionPoller:
    """Reads the function gauges (`set_function`) on a thread of its own, with a deadline, off the counters' path.

    Before each push the pusher asks for a round of reads and waits for it at most `deadline` seconds. A
    callback still running then (an engine's callback blocked on a lock) is stuck: its gauge is left out of
    the snapshots, as one whose callback raised; it is logged once and counted (`PushStats.callbacks_stuck`);
    and its thread is left to it: a new thread reads the other gauges, and skips the stuck one until its call
    returns (then the old thread ends). So a callback stuck for good costs one thread and its own gauge, and
    the rank's counters are pushed on time; no thread is started while no callback is stuck."""

    def __init__(self, functions: Callable[[], list[tuple[SeriesKey, GaugeChild]]], deadline: float,
                 stats: PushStats) -> None:
        self._functions = functions
        self.deadline = deadline
        self._stats = stats
        self._cond = threading.Condition()
        self._asked = 0  # rounds of reads asked for
        self._done = 0  # the last round asked for that a reader has finished
        self._reader: _Reader | None = None  # the thread that reads the rounds now (started on the first)
        self._stuck: set[SeriesKey] = set()  # gauges whose callback has not returned: skipped
        self._reported: set[SeriesKey] = set()  # stuck gauges logged already: once each
        self._closed = False

    def poll(self) -> None:
        """Read every function gauge, waiting at most the deadline; a callback past it is given up on."""
        if not self._functions():
            return  # no callbacks: no thread
        with self._cond:
            if self._closed:
                return
            if self._reader is None:
                self._reader = self._start_reader()
            self._asked += 1
            asked = self._asked
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._done >= asked or self._closed, self.deadline):
                self._give_up_stuck()

    def close(self) -> None:
        """Stop reading; a thread in a callback that does not return is a daemon, and is not waited for."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            reader = self._reader
        if reader is not None and reader.thread is not None:
            reader.thread.join(self.deadline)  # bounded: a callback that blocks would hold it forever

    def _start_reader(self) -> _Reader:
        reader = _Reader()
        reader.thread = threading.Thread(target=self._read, args=(reader,), name="hicache-gauge-reader", daemon=True)
        reader.thread.start()
        return reader

    def _give_up_stuck(self) -> None:
        """With the lock held: leave the callback the reader has been in past the deadline to its thread, and read
        the other gauges on a new one. A round that is only slow (no call past the deadline) is waited for later."""
        reader = self._reader
        calling = reader.calling if reader is not None else None
        if reader is None or calling is None or time.monotonic() - calling[2] < self.deadline:
            return
        key, gauge, _ = calling
        reader.retired = True
        self._stuck.add(key)
        gauge.read = math.nan  # left out: its last value would look current
        self._stats.callbacks_stuck += 1
        if key not in self._reported:
            self._reported.add(key)
            family, values = key
            log.warning("the callback of gauge %s%s has not returned within %.1f s: the gauge is left out of the "
                        "snapshots until it returns; the rank's other series are pushed", family,
                        list(values) if values else "", self.deadline)
        self._reader = self._start_reader()  # serves the round asked for, without the stuck gauge

    def _read(self, reader: _Reader) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: reader.retired or self._closed or self._asked > self._done)
                if reader.retired or self._closed:
                    return
                asked, skip = self._asked, set(self._stuck)
            for key, gauge in self._functions():
                if key in skip:
                    continue
                reader.calling = (key, gauge, time.monotonic())
                gauge.poll()
                with self._cond:
                    reader.calling = None
                    if reader.retired:  # given up on during this call: another reader has taken over
                        self._stuck.discard(key)
                        return
            with self._cond:
                self._done = max(self._done, asked)
                self._cond.notify_all()
