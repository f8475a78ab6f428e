"""Test helpers: a sidecar on a background event loop, a raw protocol client, scrape parsing."""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from exporter.config import SidecarConfig, config_from_data
from exporter.protocol.framing import FrameDecoder, encode_message
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    ErrorMessage,
    Hello,
    RankId,
    Sample,
    ScalarSample,
    Snapshot,
    Welcome,
    parse_server_message,
)
from exporter.sidecar.runner import Sidecar

T = TypeVar("T")
# How long a test waits for the sidecar's own loop to start, answer or stop: a bound on a wait, not a
# timing assertion (a stop closes HTTP with its 5 s grace, then the sources; a loaded machine took
# over 10 s).
LOOP_WAIT_SECONDS = 60.0


def sidecar_config(socket_path: Path, **sections: dict[str, Any]) -> SidecarConfig:
    """A config on an ephemeral HTTP port and the given socket, with section overrides."""
    data: dict[str, Any] = {"http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_path)}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return config_from_data(data, "test")


class SidecarThread:
    """Runs a real Sidecar (Unix socket + aiohttp) on its own event loop thread."""

    def __init__(self, config: SidecarConfig) -> None:
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.sidecar: Sidecar | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> SidecarThread:
        self._thread.start()

        async def boot() -> Sidecar:
            sidecar = Sidecar(self.config)
            await sidecar.start()
            return sidecar

        self.sidecar = asyncio.run_coroutine_threadsafe(boot(), self.loop).result(LOOP_WAIT_SECONDS)
        return self

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the sidecar's loop (state is only touched there)."""

        async def run() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(LOOP_WAIT_SECONDS)

    def stop(self) -> None:
        if self.sidecar is not None:
            asyncio.run_coroutine_threadsafe(self.sidecar.stop(), self.loop).result(LOOP_WAIT_SECONDS)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(LOOP_WAIT_SECONDS)
        self.loop.close()

    @property
    def url(self) -> str:
        assert self.sidecar is not None
        return f"http://127.0.0.1:{self.sidecar.http_port}"

    @property
    def socket_path(self) -> str:
        return str(self.config.ingest.socket_path)

    def metrics_text(self) -> str:
        return http_get(self.url + "/metrics")[1].decode()

    def scrape(self) -> Scrape:
        return Scrape(self.metrics_text())


def http_get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, err.read(), dict(err.headers)


class Scrape:
    """A parsed /metrics body with lookups by sample name and labels."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.samples = [s for family in text_string_to_metric_families(text) for s in family.samples]

    def find(self, name: str, **labels: str) -> list[Any]:
        return [s for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]

    def value(self, name: str, **labels: str) -> float:
        """The one sample matching; fails loudly if there are none or several."""
        found = self.find(name, **labels)
        assert len(found) == 1, f"expected one {name}{labels}, found {[(s.labels, s.value) for s in found]}"
        return float(found[0].value)

    def total(self, name: str, **labels: str) -> float:
        return sum(s.value for s in self.find(name, **labels))


class RawClient:
    """Speaks protocol v1 by hand over a real Unix socket, for the rejection paths."""

    def __init__(self, path: str, timeout: float = 5.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.decoder = FrameDecoder()
        self.pending: list[bytes] = []

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def send(self, message: msgspec.Struct | dict[str, Any]) -> None:
        """One message, a protocol struct or a plain dict (for the malformed ones)."""
        self.send_raw(encode_message(message))

    def recv(self) -> Welcome | ErrorMessage | None:
        """The next reply, or None when the sidecar closed the connection."""
        while not self.pending:
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                return None
            if not chunk:
                return None
            self.pending.extend(self.decoder.feed(chunk))
        return parse_server_message(self.pending.pop(0))

    def closed_by_peer(self) -> bool:
        """True when the sidecar has closed its end (after any pending replies)."""
        try:
            while True:
                chunk = self.sock.recv(65536)
                if not chunk:
                    return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False

    def close(self) -> None:
        self.sock.close()


def hello(tp: int = 0, pp: int = 0, dp: int = 0, epoch: str = "e1", **labels: str) -> dict[str, Any]:
    """A hello as a plain dict, so a test can merge bad fields into it."""
    message = Hello(protocol=PROTOCOL_VERSION, epoch=epoch, pid=1234, rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp),
                    labels=labels)
    return msgspec.to_builtins(message)


def snapshot(seq: int, *samples: Sample) -> Snapshot:
    return Snapshot(seq=seq, time=time.time(), samples=list(samples))


def counter(family: str, value: float, **labels: str) -> Sample:
    return ScalarSample(family, value, labels)


# free_port's ports: below Linux's ephemeral range (32768 and up), where neither bind(0) nor an
# outgoing connection is ever handed one, in a block of its own per pytest-xdist worker (the master,
# or a run without xdist, has the first), so that no other test of the run takes one between the
# probe and the server's own bind.
PORT_BLOCK_BASE, PORT_BLOCK_SIZE, PORT_BLOCKS = 20000, 500, 25  # 20000..32499: -n up to 24
_port_offsets = itertools.count(random.randrange(PORT_BLOCK_SIZE))


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, and that no other test of this run is handed."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    block = int(worker[2:]) + 1 if worker.startswith("gw") and worker[2:].isdigit() else 0
    base = PORT_BLOCK_BASE + (block % PORT_BLOCKS) * PORT_BLOCK_SIZE
    for _ in range(PORT_BLOCK_SIZE):
        port = base + next(_port_offsets) % PORT_BLOCK_SIZE
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue  # bound by something else, or a connection of this port is still closing
            return port
    raise AssertionError(f"no free port in {base}..{base + PORT_BLOCK_SIZE - 1}")


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, interval: float = 0.05) -> None:
    """Poll `predicate` until true; fail with a clear message after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"condition not met within {timeout} s")


def wait_ready(process: subprocess.Popen[Any], ready: Callable[[], bool], timeout: float = LOOP_WAIT_SECONDS) -> None:
    """Wait until a server `process` just started answers `ready`: as long as a loaded machine
    takes to import and bind (10 s was too short), and no longer once it has exited (a port taken
    meanwhile), which fails at once with its exit status."""

    def answered() -> bool:
        if process.poll() is not None:
            raise AssertionError(f"the process exited with status {process.returncode} before it was ready")
        return ready()

    wait_until(answered, timeout)


def self_signed_cert(directory: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key, `cert.pem` and `key.pem` in `directory`, made by openssl."""
    openssl = shutil.which("openssl")
    assert openssl, "openssl is needed to make a test certificate"
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run([openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
                    "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def steady_rank(socket_path: str, rank: dict[str, int], labels: dict[str, str], interval: float, max_backoff: float,
                unfulfilled: int = 0) -> None:
    """A rank process loading pages back at a steady rate (and, with `unfulfilled`, missing that many
    prefetch tokens for host capacity per step) until it is stopped or killed from outside."""
    from exporter.client import RankClient

    client = RankClient(socket_path, rank=rank, labels=labels, interval=interval, max_backoff=max_backoff)
    tokens = client.counter("load_back_tokens_total", pool="kv")
    moved = client.counter("load_back_bytes_total")
    took = client.histogram("load_back_duration_seconds")
    missed = client.counter("storage_prefetch_unfulfilled_tokens_total", reason="host_capacity") if unfulfilled else None
    client.start()
    while True:
        tokens.inc(64)
        moved.inc(64 * 4096)
        took.observe(0.002)
        if missed is not None:
            missed.inc(unfulfilled)
        time.sleep(0.05)


# What the sidecar's side loads (YAML and pydantic for its config and catalog, aiohttp for its server) and
# its modules: an engine process that imports the client or an integration must load none of them.
HEAVY_MODULES = ("yaml", "pydantic", "pydantic_core", "aiohttp")
SIDECAR_MODULES = ("exporter.catalog", "exporter.config", "exporter.sidecar", "exporter.cli")
REPO = Path(__file__).resolve().parents[1]


def loaded_after(code: str, roots: tuple[str, ...] = HEAVY_MODULES) -> list[str]:
    """The `roots` packages and sidecar modules a fresh interpreter of this environment holds after running `code`."""
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r} "
             f"or '.'.join(m.split('.')[:2]) in {SIDECAR_MODULES!r})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout))
