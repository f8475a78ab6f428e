"""Start-up failures are one line on stderr and exit 2, naming the thing and the setting (flag,
environment variable or config key) that set it; `--log.level debug` keeps the traceback."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "exporter.cli"]


def serve(*args: str, env: dict[str, str] | None = None, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *CLI, "serve", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **(env or {})})


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hicache-exporter: error: ")
    return lines[0]


@pytest.fixture
def taken_port() -> Iterator[int]:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        yield holder.getsockname()[1]
    finally:
        holder.close()


def test_port_in_use_names_the_port_and_the_flag(socket_dir: Path, taken_port: int) -> None:
    line = one_line(serve("--host", "127.0.0.1", "--port", str(taken_port), "--socket", str(socket_dir / "m.sock")))
    assert f"cannot listen on 127.0.0.1:{taken_port}: the port is already in use" in line
    assert "(http.port, set by --port)" in line
    assert not (socket_dir / "m.sock").exists(), "the ingest socket is never created"
    line = one_line(serve("--web.listen-address", f"127.0.0.1:{taken_port}", "--socket", str(socket_dir / "m.sock")))
    assert "set by --web.listen-address" in line


def test_port_9400_in_use_names_dcgm_exporter_and_the_environment(socket_dir: Path) -> None:
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 9400))
        holder.listen()
    except OSError:
        pass  # something else holds it already: the clash is the same
    try:
        line = one_line(serve("--host", "127.0.0.1", "--socket", str(socket_dir / "m.sock"),
                              env={"HICACHE_EXPORTER_PORT": "9400"}))
    finally:
        holder.close()
    assert "9400: the port is already in use" in line and "dcgm-exporter" in line
    assert "(http.port, set by HICACHE_EXPORTER_PORT in the environment)" in line


def test_port_in_use_set_by_the_config_file(socket_dir: Path, taken_port: int, tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text(f"http:\n  host: 127.0.0.1\n  port: {taken_port}\n")
    line = one_line(serve("--config", str(config), "--socket", str(socket_dir / "m.sock"), env={"HICACHE_EXPORTER_PORT": ""}))
    assert f"(http.port, set in {config})" in line


def test_a_host_that_does_not_resolve(socket_dir: Path) -> None:
    line = one_line(serve("--host", "no-such-host.invalid", "--port", "0", "--socket", str(socket_dir / "m.sock")))
    assert "the host 'no-such-host.invalid' does not resolve" in line and "(http.host, set by --host)" in line


def _without_write_permission() -> tuple[str, ...]:
    """Root writes anywhere: drop the capabilities that let it (setpriv, util-linux)."""
    if os.geteuid() != 0:
        return ()
    setpriv = shutil.which("setpriv")
    assert setpriv, "setpriv (util-linux) is needed to test a read-only directory as root"
    return (setpriv, "--bounding-set", "-dac_override,-dac_read_search,-fowner")


def test_a_read_only_socket_directory(socket_dir: Path) -> None:
    directory = socket_dir / "ro"
    directory.mkdir(mode=0o555)
    directory.chmod(0o555)
    line = one_line(serve("--port", "0", "--host", "127.0.0.1", env={"HICACHE_EXPORTER_SOCKET": str(directory / "m.sock")},
                          prefix=_without_write_permission()))
    assert f"cannot create the ingest socket {directory / 'm.sock'}: its directory {directory} is not writable" in line
    assert "(ingest.socket_path, set by HICACHE_EXPORTER_SOCKET in the environment)" in line


def test_a_missing_socket_directory_that_cannot_be_created(socket_dir: Path) -> None:
    parent = socket_dir / "ro"
    parent.mkdir(mode=0o555)
    parent.chmod(0o555)
    path = parent / "run" / "m.sock"
    line = one_line(serve("--port", "0", "--host", "127.0.0.1", "--socket", str(path), prefix=_without_write_permission()))
    assert f"its directory {path.parent} is missing and {parent} is not writable" in line
    assert "(ingest.socket_path, set by --socket)" in line


def test_a_parent_path_that_is_a_file(socket_dir: Path) -> None:
    blocker = socket_dir / "file"
    blocker.write_text("")
    for path in (blocker / "m.sock", blocker / "deeper" / "m.sock"):
        line = one_line(serve("--port", "0", "--host", "127.0.0.1", "--socket", str(path)))
        assert f"cannot create the ingest socket {path}: {blocker} is a file, not a directory" in line


def test_a_socket_path_over_108_bytes(socket_dir: Path) -> None:
    path = socket_dir / ("x" * 110) / "metrics.sock"
    line = one_line(serve("--port", "0", "--host", "127.0.0.1", "--socket", str(path)))
    assert f"is {len(str(path))} bytes long, over the 107 a Unix socket path may have" in line
    assert "(ingest.socket_path, set by --socket)" in line
    assert not path.parent.exists()


def test_log_level_debug_keeps_the_traceback(socket_dir: Path, taken_port: int) -> None:
    result = serve("--host", "127.0.0.1", "--port", str(taken_port), "--socket", str(socket_dir / "m.sock"),
                   "--log.level", "debug")
    assert result.returncode == 2
    assert "Traceback" in result.stderr and "Address already in use" in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("hicache-exporter: error: cannot listen on")


def test_the_demo_names_its_port_flag(taken_port: int) -> None:
    result = subprocess.run([*CLI, "demo", "--host", "127.0.0.1", "--port", str(taken_port), "--requests", "1"],
                            capture_output=True, text=True, timeout=120)
    line = one_line(result)
    assert "the port is already in use (http.port, set by --port)" in line
