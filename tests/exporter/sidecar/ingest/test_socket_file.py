"""The ingest socket's file: a live listener is never replaced, and only its creator removes it."""

from __future__ import annotations

import errno
import socket
from pathlib import Path

import pytest

from exporter.errors import SocketInUseError
from exporter.sidecar.ingest.socket_file import prepare_socket_path
from tests.helpers import RawClient, SidecarThread, hello, sidecar_config


def test_a_leftover_socket_with_nobody_listening_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "m.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays, nobody listens
    prepare_socket_path(path, 0o750)
    assert not path.exists()


def test_a_live_listener_whose_backlog_is_full_is_not_mistaken_for_a_dead_one(tmp_path: Path) -> None:
    """EAGAIN from a full backlog once read as "stale": the live sidecar's socket was unlinked."""
    path = tmp_path / "m.sock"
    busy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    busy.bind(str(path))
    busy.listen(0)  # never accepts
    waiting = []
    try:
        for _ in range(64):  # fill the backlog until a connect would block
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.setblocking(False)
            try:
                peer.connect(str(path))
            except BlockingIOError:
                peer.close()
                break
            waiting.append(peer)
        else:
            pytest.fail("the backlog never filled")
        with pytest.raises(SocketInUseError, match="cannot tell whether another sidecar listens"):
            prepare_socket_path(path, 0o750)
        assert path.exists()
    finally:
        for peer in waiting:
            peer.close()
        busy.close()


def test_a_sidecar_leaves_a_socket_file_it_did_not_create(tmp_path: Path) -> None:
    """A stops after B has put its own socket at the same path: B's file and listener stay."""
    path = tmp_path / "m.sock"
    first = SidecarThread(sidecar_config(path)).start()
    path.unlink()  # e.g. removed by hand, or by a sidecar of the past
    second = SidecarThread(sidecar_config(path)).start()
    try:
        first.stop()
        assert path.exists()
        client = RawClient(str(path))
        client.send(hello(tp=0))
        assert client.recv() is not None  # B still answers on it
        client.close()
    finally:
        second.stop()
    assert not path.exists()  # B removes what it created


def test_probe_errors_other_than_refused_are_not_guessed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "m.sock"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.close()

    def no_access(self: socket.socket, address: object) -> None:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(socket.socket, "connect", no_access)
    with pytest.raises(SocketInUseError, match="Permission denied"):
        prepare_socket_path(path, 0o750)
    assert path.exists()
