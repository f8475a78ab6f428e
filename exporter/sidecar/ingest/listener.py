"""The ingest listener: accepts rank connections on the Unix socket and speaks protocol v1 with each."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path

from exporter import __version__
from exporter.config import IngestConfig
from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.framing import FrameDecoder, encode_message
from exporter.protocol.messages import Bye, ErrorMessage, Hello, Snapshot, Welcome, message_type, parse_client_message
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.ranks import Join, RankState
from exporter.sidecar.core.state import Push, SidecarState
from exporter.sidecar.ingest.socket_file import (
    SocketIdentity,
    peer_uid,
    prepare_socket_path,
    remove_socket_file,
    socket_identity,
    socket_startup_error,
)

log = logging.getLogger("hicache_exporter.ingest")
READ_CHUNK = 1 << 16
# Error replies are skipped while this much is still unsent: a peer that never reads cannot grow our buffer.
MAX_PENDING_REPLY_BYTES = 1 << 16
# After an error reply, input still arriving is read and dropped for this long (at most this much).
LINGER_SECONDS = 0.5
# A hello is a few hundred bytes: nobody may buffer a large frame before saying who it is.
MAX_HELLO_BYTES = 64 << 10
LINGER_BYTES = 4 << 20


class _Closing(Exception):
    """Internal: the connection ends here (after an error reply or a bye)."""


class IngestServer:
    """Accepts rank connections on the Unix socket and feeds their frames to the state."""

    def __init__(self, config: IngestConfig, state: SidecarState, stats: SidecarHealth) -> None:
        self.config = config
        self.state = state
        self.stats = stats
        self._server: asyncio.AbstractServer | None = None
        self.buffered = 0  # bytes of partial frames held across every connection
        self._socket_file: SocketIdentity | None = None
        self._connections: dict[asyncio.Task[None], _Connection] = {}

    @property
    def path(self) -> Path:
        return self.config.socket_path

    async def start(self) -> None:
        prepare_socket_path(self.path, self.config.dir_mode)
        try:
            self._server = await asyncio.start_unix_server(self._serve, path=str(self.path), limit=READ_CHUNK)
        except OSError as err:
            raise socket_startup_error(self.path, err) from err
        self._socket_file = socket_identity(self.path)
        os.chmod(self.path, self.config.socket_mode)
        self.stats.ingest_listening = True
        log.info("ingest listening on %s", self.path)

    async def running(self, _app: object) -> AsyncIterator[None]:
        """The listener as a cleanup context of the app: listening while the app serves."""
        await self.start()
        yield
        await self.stop()

    async def stop(self, grace: float = 2.0) -> None:
        """Stop accepting, let frames already arriving finish (up to `grace` s), remove the socket.

        A connection between frames is closed at once: every frame it sent is applied, and the
        next sidecar gets the rest from the rank's next cumulative snapshot.
        """
        self.stats.ingest_listening = False
        if self._server is not None:
            self._server.close()
        deadline = time.monotonic() + grace
        while any(conn.mid_frame for conn in self._connections.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for connection in self._connections.values():
            connection.writer.close()  # its pending read returns EOF and the handler ends normally
        tasks = list(self._connections)
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=1.0)
            for task in stuck:
                task.cancel()
            await asyncio.gather(*stuck, return_exceptions=True)
        remove_socket_file(self.path, self._socket_file)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.stats.connections_accepted += 1
        self.stats.connections_open += 1
        connection = _Connection(self, reader, writer)
        self._connections[task] = connection
        try:
            await connection.run()
        except asyncio.CancelledError:
            pass
        except Exception:  # a bug must cost one connection, never the sidecar
            log.exception("connection handler failed")
        finally:
            connection.release()
            self.buffered -= connection.held
            connection.held = 0
            self.stats.connections_open -= 1
            self._connections.pop(task, None)
            writer.close()
            try:
                await asyncio.wait_for(writer.wait_closed(), 1.0)
            except (OSError, asyncio.TimeoutError, asyncio.CancelledError):
                pass


class _Connection:
    """One rank connection: hello first, then snapshots until bye or EOF."""

    def __init__(self, server: IngestServer, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.state = server.state
        self.stats = server.stats
        self.config = server.config
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder(min(MAX_HELLO_BYTES, self.config.max_frame_bytes))
        self.held = 0  # bytes of partial frames this connection has counted in server.buffered
        self.rank: RankState | None = None
        self.pending: list[bytes] = []

    async def run(self) -> None:
        try:
            self._admit()
            hello_deadline = time.monotonic() + self.config.hello_timeout_seconds
            first = await self._next_frame(hello_deadline, ErrorCode.HELLO_TIMEOUT)
            if first is None:
                return
            self._handle_hello(first)
            while True:
                frame = await self._next_frame(time.monotonic() + self.config.idle_timeout_seconds, ErrorCode.IDLE_TIMEOUT)
                if frame is None:
                    return
                self._handle_frame(frame)
        except ProtocolError as err:
            self.stats.reject(err.code)
            log.info("closing connection (%s): %s", err.code.value, err.message)
            self.decoder = FrameDecoder(0)  # the connection is done: its half frame goes now, not after lingering
            self.pending.clear()
            self._count_buffered()
            await self._reply_and_close(ErrorMessage(code=err.code.value, message=err.message))
        except _Closing:
            pass

    @property
    def mid_frame(self) -> bool:
        """Part of a frame has arrived and the rest is still expected."""
        return self.decoder.in_frame

    def _admit(self) -> None:
        if self.stats.connections_open > self.config.max_connections:
            raise ProtocolError(
                ErrorCode.TOO_MANY_CONNECTIONS,
                f"the sidecar already holds max_connections={self.config.max_connections} connections",
            )
        allowed = self.config.allowed_uids
        if allowed is not None:
            uid = peer_uid(self.writer.get_extra_info("socket"))
            if uid not in allowed:
                raise ProtocolError(ErrorCode.PEER_REFUSED, f"peer uid {uid} is not in ingest.allowed_uids")

    async def _next_frame(self, deadline: float, timeout_code: ErrorCode) -> bytes | None:
        """The next frame's payload, None on EOF; raise ProtocolError on a bad frame or timeout."""
        while not self.pending:
            try:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise asyncio.TimeoutError
                chunk = await asyncio.wait_for(self.reader.read(READ_CHUNK), remaining)
            except asyncio.TimeoutError:
                raise ProtocolError(timeout_code, f"no complete frame within the deadline ({timeout_code.value})") from None
            except (ConnectionError, OSError):
                chunk = b""
            if not chunk:
                if self.mid_frame:  # the peer died or hung up half-way through a frame
                    self.stats.reject(ErrorCode.MALFORMED_FRAME)
                    log.info("connection ended in the middle of a frame (%d bytes buffered)", self.decoder.buffered)
                return None
            frames = self.decoder.feed(chunk)
            self._count_buffered()
            self.stats.frames_received += len(frames)
            self.pending.extend(frames)
        return self.pending.pop(0)

    def _count_buffered(self) -> None:
        """Keep the server's total of partial-frame bytes; past ingest.max_buffered_bytes, the
        connection adding to it is closed (so many peers' half frames cannot add up past the pod's memory)."""
        server = self.server
        held = self.decoder.buffered
        server.buffered += held - self.held
        self.held = held
        if held and server.buffered > self.config.max_buffered_bytes:
            raise ProtocolError(
                ErrorCode.FRAME_TOO_LARGE,
                f"the sidecar already buffers {server.buffered} bytes of partial frames "
                f"(ingest.max_buffered_bytes={self.config.max_buffered_bytes}); send again later",
            )

    def _handle_hello(self, payload: bytes) -> None:
        message = parse_client_message(payload)
        if not isinstance(message, Hello):
            raise ProtocolError(ErrorCode.HELLO_REQUIRED, f"the first frame must be a hello, got {message_type(message)!r}")
        result = self.state.join(self, Join.of(message))  # typed once, here at the edge
        self.rank = result.rank
        self.decoder.max_frame_bytes = self.config.max_frame_bytes  # snapshots may now be large
        self._send(Welcome(server=f"hicache-exporter/{__version__}", restart=result.restart, reconnect=result.reconnect))

    def _handle_frame(self, payload: bytes) -> None:
        started = time.perf_counter()
        message = parse_client_message(payload)
        if isinstance(message, Bye):
            raise _Closing()
        if isinstance(message, Hello):
            raise ProtocolError(ErrorCode.MALFORMED_FRAME, "hello may only be the first frame of a connection")
        assert isinstance(message, Snapshot) and self.rank is not None
        self.stats.snapshots_received += 1
        result = self.state.push(self.rank, Push.of(message))  # typed once, here at the edge
        if result.refused is not None:
            code, text = result.refused
            self.stats.reject(code)
            self._send(ErrorMessage(code=code.value, message=text + "; the snapshot was ignored"))
            return
        if result.conflict is not None:
            code, text = result.conflict
            self.stats.reject(code)
            self._send(ErrorMessage(code=code.value, message=text))
        self.stats.snapshots_applied += 1
        self.stats.samples_applied += result.applied
        self.stats.ingest_duration.observe(time.perf_counter() - started)
        if result.rejections:
            for code, _ in result.rejections:
                self.stats.reject(code)
            first_code, first_message = result.rejections[0]
            more = len(result.rejections) - 1
            suffix = f" (and {more} more samples dropped)" if more else ""
            self._send(ErrorMessage(code=first_code.value, message=first_message + suffix))

    def _send(self, message: Welcome | ErrorMessage) -> None:
        transport = self.writer.transport
        if transport.is_closing() or transport.get_write_buffer_size() > MAX_PENDING_REPLY_BYTES:
            return
        self.writer.write(encode_message(message))

    async def _reply_and_close(self, message: ErrorMessage) -> None:
        """Send the error, then linger briefly: closing with unread input would reset the reply away."""
        self.release()  # the identity is free at once, whatever the lingering
        self._send(message)
        try:
            await asyncio.wait_for(self.writer.drain(), 1.0)
            if self.writer.can_write_eof():
                self.writer.write_eof()
            deadline = time.monotonic() + LINGER_SECONDS
            discarded = 0
            while discarded < LINGER_BYTES and (remaining := deadline - time.monotonic()) > 0:
                chunk = await asyncio.wait_for(self.reader.read(READ_CHUNK), remaining)
                if not chunk:
                    break
                discarded += len(chunk)
        except (OSError, asyncio.TimeoutError):
            pass

    def release(self) -> None:
        if self.rank is not None:
            self.state.disconnect(self, self.rank)
            self.rank = None
