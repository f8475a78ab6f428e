"""The background pusher: sends cumulative snapshots over the Unix socket, reconnecting with backoff.

Nothing here ever raises into the rank: failures are logged, counted in `PushStats`,
and retried after a capped exponential backoff with jitter.
"""

from __future__ import annotations

import logging
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.framing import FrameDecoder, encode_message
from exporter.protocol.messages import Bye, ErrorMessage, Hello, Snapshot, Welcome, parse_server_message

log = logging.getLogger("hicache_exporter.client")

REFUSAL_LOG_SECONDS = 60.0  # a refused rank says so at once, then once a minute while it lasts


@dataclass
class PushStats:
    """What the pusher has done, for tests and for the rank's own logs."""

    snapshots_sent: int = 0
    connects: int = 0
    failures: int = 0
    errors_by_code: dict[str, int] = field(default_factory=dict)
    last_error: str | None = None
    refused: str | None = None  # why the sidecar refuses this rank's hello now (None once accepted)


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
        prepare: Callable[[], None] | None = None,
    ) -> None:
        self.socket_path = socket_path
        self._hello = hello
        self._snapshot = snapshot
        # Run by the thread before each push, outside the I/O lock: what may block (an engine's callbacks).
        self._prepare = prepare
        self.interval = interval
        self.max_backoff = max_backoff
        self.io_timeout = io_timeout
        self.stats = PushStats()
        self._sock: socket.socket | None = None
        self._decoder = FrameDecoder()
        self._seq = 0
        self._refusal_logged = 0.0
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
            if self._prepare is not None:
                try:
                    self._prepare()
                except Exception as err:  # nothing it does may stop the pushes
                    log.warning("preparing a snapshot failed: %s", err)
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
        now = time.monotonic()
        if self.stats.refused is None or now - self._refusal_logged >= REFUSAL_LOG_SECONDS:
            log.error(
                "sidecar at %s refuses this rank's hello (%s: %s): nothing this process counts reaches /metrics; "
                "retrying every %.0f s", self.socket_path, reply.code, reply.message, self.max_backoff,
            )
            self._refusal_logged = now
        self.stats.refused = f"{reply.code}: {reply.message}"
