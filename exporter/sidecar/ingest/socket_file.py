"""The ingest socket's file and its peers: directory and modes, leftovers, peer credentials."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import stat
import struct
from pathlib import Path

from exporter.errors import SocketInUseError, StartupError

MAX_SOCKET_PATH_BYTES = 107  # sun_path is 108 bytes on Linux, the last one the terminating NUL
SETTING = "ingest.socket_path"


def check_socket_path(path: Path) -> None:
    """A path a Unix socket can have at all: short enough for sun_path."""
    size = len(os.fsencode(path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise StartupError(f"the ingest socket path {path} is {size} bytes long, over the {MAX_SOCKET_PATH_BYTES} "
                           "a Unix socket path may have: choose a shorter one", SETTING)


def _file_in_the_way(path: Path) -> Path | None:
    """The first ancestor of `path` that exists and is not a directory."""
    for parent in reversed(path.parents):
        if parent.exists() and not parent.is_dir():
            return parent
    return None


def socket_startup_error(path: Path, err: OSError) -> StartupError:
    """One line naming the socket and what is wrong with its directory."""
    blocker = _file_in_the_way(path)
    if blocker is not None:
        why = f"{blocker} is a file, not a directory"
    elif err.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
        where = next((p for p in path.parents if p.exists()), path.parent)
        kind = "is on a read-only file system" if err.errno == errno.EROFS else "is not writable by this process"
        what = "its directory" if where == path.parent else f"its directory {path.parent} is missing and"
        why = f"{what} {where} {kind} ({err.strerror})"
    elif err.errno == errno.ENOENT:
        why = f"its directory {path.parent} does not exist and cannot be created ({err.strerror})"
    else:
        why = err.strerror or str(err)
    return StartupError(f"cannot create the ingest socket {path}: {why}", SETTING)


def prepare_socket_path(path: Path, dir_mode: int) -> None:
    """Create the socket's directory; replace a dead sidecar's socket file, refuse a live one."""
    check_socket_path(path)
    if _file_in_the_way(path) is not None:
        raise socket_startup_error(path, NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR)))
    directory = path.parent
    if not directory.exists():
        try:
            directory.mkdir(parents=True, mode=dir_mode)
            os.chmod(directory, dir_mode)  # mkdir's mode is filtered by the umask
        except OSError as err:
            raise socket_startup_error(path, err) from err
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise SocketInUseError(f"{path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # nobody listens: a dead sidecar's leftover
        return
    except OSError as err:  # EAGAIN: a live listener whose backlog is full; EACCES, timeouts: unknown
        raise SocketInUseError(
            f"cannot tell whether another sidecar listens on {path} ({err.strerror or err}); "
            "refusing to replace it: stop the other sidecar or give this one another --socket"
        ) from None
    finally:
        probe.close()
    raise SocketInUseError(
        f"another sidecar is already listening on {path}; stop it or give this one another --socket"
    )


SocketIdentity = tuple[int, int]  # (st_dev, st_ino) of the socket file a listener created


def socket_identity(path: Path) -> SocketIdentity:
    """Which file `path` is now: taken right after binding, so that only its creator removes it."""
    info = os.lstat(path)
    return (info.st_dev, info.st_ino)


def remove_socket_file(path: Path, identity: SocketIdentity | None) -> None:
    """Remove the socket file this process created; one that another sidecar has since put at
    the same path (the file is not ours any more) stays."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if identity is not None and (info.st_dev, info.st_ino) == identity:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    if sock is None or not hasattr(socket, "SO_PEERCRED"):
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return uid
