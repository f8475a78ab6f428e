"""The state file on disk: framed (magic, format version, checksum, length), written atomically, read bounded.

A write goes to a temporary file of its own (a new name, created exclusively, never through a link) in
the same directory, is flushed and fsynced, renamed over the old file, and the directory is fsynced: a
crash at any instant leaves the old file or the new one, whole. A file that cannot be used is set aside
as `FILE.corrupt-<unix time>` for a person to look at. One process writes a file: it holds an exclusive
lock on `FILE.lock` (which names it) for as long as it runs.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import os
import secrets
import socket
import stat
import struct
import time
import zlib
from pathlib import Path

from exporter.errors import StateFileError, StateFileLocked

MAGIC = b"HCXSTATE"
FORMAT_VERSION = 1
# magic, format version, CRC-32 of the payload, payload length; then the payload (msgspec MessagePack).
HEADER = struct.Struct(">8sIIQ")


def frame(payload: bytes) -> bytes:
    """The file's bytes for `payload`: header, then payload."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, zlib.crc32(payload), len(payload)) + payload


def unframe(data: bytes | memoryview) -> memoryview:
    """The payload of a file's bytes, as a view of them (a copy would hold the file twice while a load decodes);
    StateFileError (reason: truncated, corrupt or version) where they are not one."""
    data = memoryview(data)
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


def read_file(path: Path, max_bytes: int) -> memoryview | None:
    """The file's bytes, read into one buffer (None when there is none); StateFileError (unreadable, too_large)
    where it cannot be read."""
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
        # One buffer of the size the file says it has, and one byte more to see one that grew past the bound:
        # chunks joined at the end held the file twice for a moment.
        data = memoryview(bytearray(min(info.st_size, max_bytes) + 1))
        data[:len(head)] = head
        filled = len(head)
        while filled < len(data):
            read = os.readv(fd, [data[filled:]])
            if not read:
                break
            filled += read
        if filled == len(data) <= max_bytes:  # it grew since fstat (not ours to write so): the rest, bounded
            grown = bytearray(data)
            while len(grown) <= max_bytes and (more := os.read(fd, min(max_bytes + 1 - len(grown), 1 << 20))):
                grown += more
            data, filled = memoryview(grown), len(grown)
    except OSError as err:
        raise StateFileError("unreadable", f"cannot read it: {err.strerror or err}") from None
    finally:
        os.close(fd)
    if filled > max_bytes:
        raise StateFileError("too_large", f"more than the {max_bytes} bytes the series budget allows")
    return data[:filled]


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


_attempts = itertools.count()
# Created only where no file is (O_EXCL: a planted link or FIFO is refused, never followed or opened).
TEMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def temp_prefix(path: Path) -> str:
    """What every temporary file of `path` is named from: `.FILE.tmp-`."""
    return f".{path.name}.tmp-"


def temp_path(path: Path) -> Path:
    """A temporary name no write used before: pid, a counter and a random part (a crash's leftover under a
    reused pid, or a name planted ahead of time, is never this attempt's)."""
    return path.with_name(f"{temp_prefix(path)}{os.getpid()}-{next(_attempts)}-{secrets.token_hex(4)}")


def remove_temporaries(path: Path) -> int:
    """Remove the temporary files earlier writers of `path` left (a crash mid-write), whatever they are (a
    link is removed, never followed); run with the lock held, so that none of them is being written. How
    many were removed."""
    prefix, removed = temp_prefix(path), 0
    try:
        names = [name for name in os.listdir(path.parent) if name.startswith(prefix)]
    except OSError:
        return 0
    for name in names:
        try:
            os.unlink(path.parent / name)  # unlink removes a link itself; a directory is refused
            removed += 1
        except OSError:
            pass
    return removed


def write_atomic(path: Path, data: bytes) -> None:
    """Write `data` as `path`, atomically and durably (OSError where the directory or disk refuses)."""
    tmp = temp_path(path)
    try:
        fd = os.open(tmp, TEMP_FLAGS, 0o600)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except FileExistsError:
        raise  # not ours: left where it is
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


def lock_path(path: Path) -> Path:
    """The lock file beside the state file: `FILE.lock` (the state file itself is replaced at each write)."""
    return path.with_name(f"{path.name}.lock")


def take_lock(path: Path) -> int | None:
    """Lock `path` for this process: the descriptor of `FILE.lock`, held until `release_lock`; StateFileLocked
    naming the holder where another process holds it; None where no lock file can be opened (a read-only or
    missing directory: nothing can be written there either) and OSError reasons are logged by the caller."""
    lock = lock_path(path)
    fd = None
    for flags in (os.O_RDWR | os.O_CREAT, os.O_RDONLY):  # read-only: a lock file left in a read-only directory
        try:
            fd = os.open(lock, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
            break
        except OSError:
            continue
    if fd is None:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{lock} is not a regular file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StateFileLocked(
                f"state file {path} is in use by another sidecar ({_holder(fd)}, holding {lock}): two sidecars on "
                "one file would overwrite each other's rollups; give each sidecar its own file") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
        except OSError:
            pass  # a read-only lock file: the lock holds, the message will only name no one
    except BaseException:
        os.close(fd)
        raise
    return fd


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it (at most a line of it)."""
    try:
        text = os.pread(fd, 256, 0).decode("utf-8", "replace").splitlines()
    except OSError:
        text = []
    holder = "".join(ch for ch in (text[0] if text else "") if ch.isprintable())
    return holder or "a process that did not say which"


def release_lock(fd: int) -> None:
    """Let the lock go (the file stays: removing it would let a third process lock a new file beside a holder
    of the old one)."""
    os.close(fd)


# MessagePack, as far as counting needs: per first byte, the bytes a scalar takes after it, or how to read a
# length (of a string or binary: bytes to skip; of an array or map: items that follow).
_SCALAR = {**{b: 0 for b in range(0x00, 0x80)}, **{b: 0 for b in range(0xE0, 0x100)}, 0xC0: 0, 0xC2: 0, 0xC3: 0,
           0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
           0xD4: 2, 0xD5: 3, 0xD6: 5, 0xD7: 9, 0xD8: 17}
_LENGTH = {0xC4: (">B", 0), 0xC5: (">H", 0), 0xC6: (">I", 0), 0xD9: (">B", 0), 0xDA: (">H", 0), 0xDB: (">I", 0),
           0xC7: (">B", 1), 0xC8: (">H", 1), 0xC9: (">I", 1)}  # (length format, type bytes of an ext)
_ITEMS = {0xDC: (">H", 1), 0xDD: (">I", 1), 0xDE: (">H", 2), 0xDF: (">I", 2)}  # (count format, items per entry)


def count_items(payload: bytes | memoryview, limit: int) -> int:
    """How many MessagePack values `payload` holds (every array and map entry, nested), counted without building
    any: StateFileError (over_limits) as soon as the arrays and maps read so far announce more than `limit`
    (a decode builds one object per value: this bounds what it builds), (corrupt) where it is not MessagePack
    (its checksum matched: what it holds was written so)."""
    size, pos, pending, items = len(payload), 0, 1, 0
    unpack = struct.unpack_from
    try:
        while pending:
            pending -= 1
            items += 1
            first = payload[pos]
            pos += 1
            skip = _SCALAR.get(first)
            if skip is not None:
                pos += skip
            elif 0xA0 <= first <= 0xBF:
                pos += first & 0x1F
            elif 0x90 <= first <= 0x9F:
                pending += first & 0x0F
            elif 0x80 <= first <= 0x8F:
                pending += 2 * (first & 0x0F)
            elif first in _LENGTH:
                form, extra = _LENGTH[first]
                pos += struct.calcsize(form) + extra + unpack(form, payload, pos)[0]
            elif first in _ITEMS:
                form, per = _ITEMS[first]
                pending += per * unpack(form, payload, pos)[0]
                pos += struct.calcsize(form)
            else:
                raise StateFileError("corrupt", f"byte {first:#x} at {pos - 1} is not MessagePack")
            if items + pending > limit:
                raise StateFileError("over_limits", f"it announces more than the {limit} values the configured limits "
                                     "allow a file to hold (ranks.max_series_total, ranks.max_ranks)")
    except (IndexError, struct.error):
        raise StateFileError("corrupt", "its contents end inside a value") from None
    if pos != size:
        raise StateFileError("corrupt", f"{size - pos} bytes past its contents" if pos < size else
                             "its contents end inside a value")
    return items
