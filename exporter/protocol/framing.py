"""Framing: a 4-byte big-endian length N, then N bytes of one UTF-8 JSON object."""

from __future__ import annotations

import json
import struct
from typing import Any

import msgspec

from exporter.errors import ErrorCode, ProtocolError

HEADER = struct.Struct(">I")
DEFAULT_MAX_FRAME_BYTES = 1 << 20


def encode_frame(payload: bytes) -> bytes:
    """Prefix an already-encoded JSON payload with its length."""
    if not payload:
        raise ValueError("a frame must carry at least one byte")
    return HEADER.pack(len(payload)) + payload


def encode_payload(message: msgspec.Struct | dict[str, Any]) -> bytes:
    """A message struct or plain dict as compact JSON (NaN and Infinity are refused, not sent as null)."""
    obj = msgspec.to_builtins(message) if isinstance(message, msgspec.Struct) else message
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def encode_message(message: msgspec.Struct | dict[str, Any]) -> bytes:
    """Encode a message struct or plain dict as one frame (see `encode_payload`)."""
    return encode_frame(encode_payload(message))


class FrameDecoder:
    """Incremental decoder: feed it bytes as they arrive, take whole frames out.

    The buffer never holds more than one header plus one frame of at most `max_frame_bytes`,
    so a peer cannot make it grow without bound.
    """

    __slots__ = ("max_frame_bytes", "_buffer", "_need")

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._need: int | None = None  # payload length of the frame being read, once known

    @property
    def buffered(self) -> int:
        """Bytes received that do not yet form a whole frame."""
        return len(self._buffer)

    @property
    def in_frame(self) -> bool:
        """Some of a frame (even just its header) has arrived, and the rest has not."""
        return self._need is not None or bool(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add received bytes; return the payloads of every frame now complete.

        Raises ProtocolError (frame_too_large or malformed_frame) on a bad length prefix;
        the connection cannot be resynchronised after that and must be closed.
        """
        self._buffer += data
        frames: list[bytes] = []
        while True:
            if self._need is None:
                if len(self._buffer) < HEADER.size:
                    return frames
                (length,) = HEADER.unpack_from(self._buffer)
                if length == 0:
                    raise ProtocolError(ErrorCode.MALFORMED_FRAME, "frame length is 0; a frame carries 1 or more bytes")
                if length > self.max_frame_bytes:
                    raise ProtocolError(
                        ErrorCode.FRAME_TOO_LARGE,
                        f"frame of {length} bytes exceeds max_frame_bytes={self.max_frame_bytes}",
                    )
                del self._buffer[: HEADER.size]
                self._need = length
            if len(self._buffer) < self._need:
                return frames
            frames.append(bytes(self._buffer[: self._need]))
            del self._buffer[: self._need]
            self._need = None
