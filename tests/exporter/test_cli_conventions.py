"""The conventions of Prometheus exporters: --version, --web.listen-address, --web.config.file
(exporter-toolkit format), --log.level and --log.format, the process collector, build_info's revision."""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import bcrypt
import pytest

from exporter import __version__
from exporter.sidecar.expose.collector import build_revision
from tests.helpers import LOOP_WAIT_SECONDS, Scrape, free_port, http_get, self_signed_cert, wait_until

CLI = [sys.executable, "-m", "exporter.cli"]


def _ready(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        with urllib.request.urlopen(url + "/-/ready", timeout=2, context=context) as resp:
            return resp.status == 200
    except OSError:
        return False


class Serve:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def stop(self) -> tuple[str, str]:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        out, err = self.proc.communicate(timeout=20)
        return out, err


@pytest.fixture
def serving() -> Iterator[list[Serve]]:
    started: list[Serve] = []
    yield started
    for serve in started:
        if serve.proc.poll() is None:
            serve.proc.kill()
            serve.proc.communicate(timeout=10)


def test_version_flag() -> None:
    result = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0 and result.stdout.strip() == f"hicache-exporter {__version__}"


def test_help_documents_the_exporter_flags() -> None:
    result = subprocess.run([*CLI, "serve", "--help"], capture_output=True, text=True, timeout=30)
    for flag in ("--web.listen-address", "--web.config.file", "--log.level", "--log.format", "--port", "--log-level"):
        assert flag in result.stdout


def test_web_listen_address_and_the_process_and_build_info_metrics(socket_dir: Path, serving: list[Serve]) -> None:
    port = free_port()
    serving.append(serve := Serve("--web.listen-address", f"127.0.0.1:{port}", "--socket", str(socket_dir / "m.sock")))
    url = f"http://127.0.0.1:{port}"
    wait_until(lambda: _ready(url), timeout=LOOP_WAIT_SECONDS)
    scrape = Scrape(http_get(url + "/metrics")[1].decode())
    assert scrape.value("process_resident_memory_bytes") > 1_000_000
    assert scrape.value("process_open_fds") > 0 and scrape.find("process_cpu_seconds_total")
    # The dashboard's pod rows leave out rollup rates across a restart by this start time.
    assert time.time() - 120 < scrape.value("process_start_time_seconds") <= time.time()
    (info,) = scrape.find("hicache_exporter_build_info")
    assert info.labels["revision"] == build_revision() and info.labels["version"] == __version__
    assert len(info.labels["revision"]) == 40, "the tests run from a git checkout"
    serve.stop()
    assert serve.proc.returncode == 0


def test_web_listen_address_takes_ipv6_in_brackets(socket_dir: Path, serving: list[Serve]) -> None:
    probe = socket.socket(socket.AF_INET6)
    try:
        probe.bind(("::1", 0))
    except OSError:
        pytest.fail("this machine has no IPv6 loopback to test [::1]:PORT on")
    port = probe.getsockname()[1]
    probe.close()
    serving.append(serve := Serve("--web.listen-address", f"[::1]:{port}", "--socket", str(socket_dir / "m.sock")))
    wait_until(lambda: _ready(f"http://[::1]:{port}"), timeout=LOOP_WAIT_SECONDS)
    serve.stop()


@pytest.mark.parametrize("address, said", [
    ("::1:9400", "an IPv6 address goes in brackets: [::1]:9400"),
    ("127.0.0.1", "expected HOST:PORT, [IPV6]:PORT or :PORT"),
    ("127.0.0.1:http", "the port must be 0 to 65535"),
])
def test_a_bad_listen_address_is_one_line(address: str, said: str) -> None:
    result = subprocess.run([*CLI, "serve", "--web.listen-address", address], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and said in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_listen_address_and_port_flags_together_are_refused() -> None:
    result = subprocess.run([*CLI, "serve", "--web.listen-address", ":9400", "--port", "9401"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "either --web.listen-address or --host/--port" in result.stderr


def test_web_config_file_with_tls_and_basic_auth(tmp_path: Path, socket_dir: Path, serving: list[Serve]) -> None:
    self_signed_cert(tmp_path)
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    web = tmp_path / "web.yml"  # exporter-toolkit's format; file names relative to the file itself
    web.write_text(f"tls_server_config:\n  cert_file: cert.pem\n  key_file: key.pem\n"
                   f"basic_auth_users:\n  prom: '{hashed}'\n")
    port = free_port()
    serving.append(serve := Serve("--web.listen-address", f"127.0.0.1:{port}", "--web.config.file", str(web),
                                  "--socket", str(socket_dir / "m.sock")))
    context = ssl.create_default_context(cafile=str(tmp_path / "cert.pem"))
    url = f"https://127.0.0.1:{port}"
    wait_until(lambda: _ready(url, context), timeout=LOOP_WAIT_SECONDS)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(url + "/metrics", timeout=5, context=context)
    assert refused.value.code == 401
    request = urllib.request.Request(url + "/metrics", headers={
        "Authorization": "Basic " + base64.b64encode(b"prom:s3cret").decode()})
    with urllib.request.urlopen(request, timeout=5, context=context) as resp:
        assert resp.status == 200 and b"hicache_exporter_build_info" in resp.read()
    with pytest.raises(OSError):  # plain HTTP is not served
        urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=5)
    serve.stop()


def test_web_config_file_problems_are_one_line(tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("tls_server_config:\n  cert_file: /no/cert.pem\n  key_file: /no/key.pem\nbasic_auth_user: {}\n")
    result = subprocess.run([*CLI, "serve", "--web.config.file", str(web)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unknown key(s) basic_auth_user" in result.stderr
    web.write_text("tls_server_config:\n  cert_file: /no/cert.pem\n  key_file: /no/key.pem\n")
    result = subprocess.run([*CLI, "serve", "--web.config.file", str(web), "--port", "0"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "/no/cert.pem" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("fmt", ["json", "logfmt"])
def test_log_format(fmt: str, socket_dir: Path, serving: list[Serve]) -> None:
    port = free_port()
    serving.append(serve := Serve("--web.listen-address", f"127.0.0.1:{port}", "--socket", str(socket_dir / "m.sock"),
                                  "--log.format", fmt, "--log.level", "info"))
    wait_until(lambda: _ready(f"http://127.0.0.1:{port}"), timeout=LOOP_WAIT_SECONDS)
    _, err = serve.stop()
    lines = err.strip().splitlines()
    assert any("serving /metrics" in line for line in lines), err
    for line in lines:
        if fmt == "json":
            record = json.loads(line)
            assert set(record) >= {"ts", "level", "logger", "msg"} and record["level"] in ("info", "debug", "warning")
        else:
            assert line.startswith("ts=") and " level=" in line and " msg=" in line, line


def test_the_env_revision_wins() -> None:
    code = "from exporter.sidecar.expose.collector import build_revision; print(build_revision())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30,
                         env={**os.environ, "HICACHE_EXPORTER_REVISION": "abc123"}).stdout.strip()
    assert out == "abc123"


def test_the_image_takes_its_revision_as_a_build_argument() -> None:
    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    assert "ARG REVISION=unknown" in dockerfile and 'ENV HICACHE_EXPORTER_REVISION="${REVISION}"' in dockerfile
