"""The state file on disk: framed (magic, format version, checksum, length), written atomically, read bounded.

A write goes to a temporary file in the same directory, is flushed and fsynced, renamed over the old
file, and the directory is fsynced: a crash at any instant leaves the old file or the new one, whole.
A file that cannot be used is set aside as `FILE.corrupt-<unix time>` for a person to look at.
"""

from __future__ import annotations

import errno
import os
import stat
import struct
import time
import zlib
from pathlib import Path

from exporter.errors import StateFileError

MAGIC = b"HCXSTATE"
FORMAT_VERSION = 1
# magic, format version, CRC-32 of the payload, payload length; then the payload (msgspec MessagePack).
HEADER = struct.Struct(">8sIIQ")


def frame(payload: bytes) -> bytes:
    """The file's bytes for `payload`: header, then payload."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, zlib.crc32(payload), len(payload)) + payload


def unframe(data: bytes) -> bytes:
    """The payload of a file's bytes; StateFileError (reason: truncated, corrupt or version) where they are not one."""
    if len(data) < HEADER.size:
        raise StateFileError("truncated", f"{len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, checksum, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise StateFileError("corrupt", "not a hicache-exporter state file (its first bytes are not the magic)")
    if version != FORMAT_VERSION:
        raise StateFileError("version", f"format version {version}; this sidecar reads version {FORMAT_VERSION}")
    payload = data[HEADER.size:]
    if len(payload) < length:
        raise StateFileError("truncated", f"{len(payload)} payload bytes of the {length} its header announces")
    if len(payload) > length:
        raise StateFileError("corrupt", f"{len(payload) - length} bytes past the {length} its header announces")
    if zlib.crc32(payload) != checksum:
        raise StateFileError("corrupt", "its checksum does not match its contents")
    return payload


def read_file(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes (None when there is none); StateFileError (unreadable, too_large) where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise StateFileError("unreadable", f"cannot open it: {err.strerror or err}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise StateFileError("unreadable", "not a regular file")
        if info.st_size > max_bytes:
            raise StateFileError("too_large", f"{info.st_size} bytes, more than the {max_bytes} the series budget "
                                 "allows (ranks.max_series_total)")
        # The magic first: a file that is not ours (a path given by mistake) is refused before it is read
        # into memory, however large the bound.
        head = os.read(fd, len(MAGIC))
        if len(head) == len(MAGIC) and head != MAGIC:
            raise StateFileError("corrupt", "not a hicache-exporter state file (its first bytes are not the magic)")
        chunks, left = [head], max_bytes + 1 - len(head)
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        data = b"".join(chunks)
    except OSError as err:
        raise StateFileError("unreadable", f"cannot read it: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise StateFileError("too_large", f"more than the {max_bytes} bytes the series budget allows")
    return data


def set_aside(path: Path, now: float | None = None) -> Path:
    """Rename a file that cannot be used to `FILE.corrupt-<unix time>` (`-<n>` after it when a file set aside in
    the same second has that name: never over another one); the new name (OSError where it cannot)."""
    base = f"{path.name}.corrupt-{int(time.time() if now is None else now)}"
    aside = path.with_name(base)
    n = 0
    while os.path.lexists(aside):
        n += 1
        aside = path.with_name(f"{base}-{n}")
    os.replace(path, aside)
    return aside


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` as `path`, atomically and durably (OSError where the directory or disk refuses)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_failure_reason(err: OSError) -> str:
    """The write-failure counter's label for an OSError."""
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if err.errno == errno.EROFS:
        return "read_only"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission"
    if err.errno in (errno.ENOENT, errno.ENOTDIR):
        return "no_directory"
    return "io"
