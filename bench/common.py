"""Shared helpers for the benchmarks: a full-catalog rank, a sidecar process, a raw pusher.

Everything here talks to the sidecar only through its public interfaces: the `serve` command
line, the Unix-socket wire protocol (exporter/protocol: 4-byte big-endian length + one JSON
object, built from the protocol's own message structs) and HTTP. With bench/report.py (result
rows and the table) this is the bottom of the bench import graph: it imports no other bench module.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import math
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from exporter.catalog import Catalog, FamilySpec, MetricType, default_catalog
from exporter.client.metrics import MetricSet
from exporter.protocol.framing import HEADER, encode_frame, encode_message, encode_payload
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    ErrorMessage,
    Hello,
    RankId,
    Snapshot,
    Welcome,
    parse_server_message,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "sglang_"  # the sidecar's default namespace
STATIC_LABELS = {"cache_type": "HiRadixCache"}
# Label values for labelled families that have no catalog preset: what cache_core really emits.
DEFAULT_LABEL_VALUES = {
    "pool": ("kv",),
    "reason": ("host_pressure", "write_through_unbacked_eviction"),
}


def child_env(**overrides: str) -> dict[str, str]:
    """The environment for a benchmark subprocess: the repository importable, no multiprocess dir."""
    env = dict(os.environ)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    env.pop("prometheus_multiproc_dir", None)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(overrides)
    return env


def chosen_cases(parser: argparse.ArgumentParser, only: str | None, cases: Sequence[str]) -> tuple[str, ...]:
    """The cases `--only` names (comma-separated; all of `cases` without it); an unknown one is the parser's error."""
    chosen = tuple(c.strip() for c in only.split(",")) if only else tuple(cases)
    unknown = set(chosen) - set(cases)
    if unknown:
        parser.error(f"unknown case(s): {', '.join(sorted(unknown))}")
    return chosen


def free_port() -> int:
    """A loopback TCP port that was free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


# --- measurements ---

def percentile(values: Iterable[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of `values`; with n < 100 samples p99 is the maximum."""
    ordered = sorted(values)
    if not ordered:
        raise ValueError("no samples")
    index = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[index]


def progress_printer(enabled: bool, tag: str):
    """A function printing `[tag] message` on stderr when enabled."""
    started = time.monotonic()

    def say(message: str) -> None:
        if enabled:
            print(f"  [{tag} {time.monotonic() - started:6.1f}s] {message}", file=sys.stderr, flush=True)
    return say


# --- a rank holding the full catalog ---

def label_sets(spec: FamilySpec) -> list[dict[str, str]]:
    """Every label set a rank holds for `spec`: the catalog presets, else the values cache_core emits."""
    if not spec.labels:
        return [{}]
    choices = [spec.preset.get(name) or DEFAULT_LABEL_VALUES.get(name, ("x",)) for name in spec.labels]
    return [dict(zip(spec.labels, combo)) for combo in itertools.product(*choices)]


def rank_id(index: int) -> dict[str, int]:
    """Rank keys of the index-th rank of a tp=8, pp=4, dp=N layout."""
    return {"tp_rank": index % 8, "pp_rank": (index // 8) % 4, "dp_rank": index // 32}


def full_metric_set(catalog: Catalog | None = None, seed: int = 0) -> MetricSet:
    """A client MetricSet in which every family and every label set has a non-zero value."""
    metrics = MetricSet(catalog or default_catalog())
    metrics.preset()
    return fill_metric_set(metrics, random.Random(seed))


def fill_metric_set(metrics: MetricSet, rng: random.Random) -> MetricSet:
    """Create every family's label sets in `metrics` (a RankClient's `.metrics` too) and move each one."""
    for spec in metrics.catalog:
        for labels in label_sets(spec):
            advance(spec, metrics.child(spec.name, labels), rng)
    return metrics


def advance(spec: FamilySpec, child: Any, rng: random.Random) -> None:
    """Move one child forward as a busy rank would between two pushes."""
    if spec.type is MetricType.COUNTER:
        child.inc(rng.randint(1, 4096))
    elif spec.type is MetricType.GAUGE:
        child.set(rng.randint(0, 1 << 20))
    else:
        top = spec.buckets[-1] if spec.buckets else 1.0
        for _ in range(3):
            child.observe(rng.uniform(0, top * 1.2))


def advance_all(metrics: MetricSet, rng: random.Random) -> None:
    for (family, _values), child in metrics.items():
        advance(metrics.catalog.get(family), child, rng)


def snapshot_payload(metrics: MetricSet, seq: int) -> bytes:
    """The JSON body the client library's pusher sends for this MetricSet."""
    return encode_payload(Snapshot(seq=seq, time=time.time(), samples=metrics.wire_samples()))


def hello_payload(rank: dict[str, int], labels: dict[str, str] | None = None) -> bytes:
    """The JSON body of a hello from `rank`, with a fresh epoch."""
    return encode_payload(Hello(protocol=PROTOCOL_VERSION, epoch=os.urandom(8).hex(), pid=os.getpid(), rank=RankId(**rank),
                                labels=dict(labels if labels is not None else STATIC_LABELS)))


# --- the sidecar as a black box ---

class Sidecar:
    """`python -m exporter.cli serve` on 127.0.0.1, a free port and a private socket."""

    def __init__(self, config_yaml: str | None = None) -> None:
        # Unix socket paths are limited to ~108 bytes: stay short whatever TMPDIR says.
        self.workdir = Path(tempfile.mkdtemp(prefix="hcb-", dir="/tmp" if os.path.isdir("/tmp") else None))
        self.socket_path = str(self.workdir / "metrics.sock")
        self.port = free_port()
        extra: list[str] = []
        if config_yaml is not None:
            config = self.workdir / "sidecar.yaml"
            config.write_text(config_yaml)
            extra = ["--config", str(config)]
        env = child_env()
        for key in ("HICACHE_EXPORTER_CONFIG", "HICACHE_EXPORTER_PORT", "HICACHE_EXPORTER_SOCKET"):
            env.pop(key, None)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter.cli", "serve", *extra, "--host", "127.0.0.1", "--port", str(self.port),
             "--socket", self.socket_path, "--log-level", "warning"], env=env, cwd=REPO_ROOT)
        self._conn: http.client.HTTPConnection | None = None
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=2) as response:
                    response.read()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the sidecar exited with {self.proc.returncode}") from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the sidecar did not become ready") from None
                time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def get(self, path: str = "/metrics", headers: dict[str, str] | None = None) -> bytes:
        """GET over one kept-alive HTTP connection (reconnects once if the server closed it); the body
        as sent (a gzipped one stays gzipped)."""
        for attempt in (0, 1):
            if self._conn is None:
                self._conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
            try:
                self._conn.request("GET", path, headers=headers or {})
                response = self._conn.getresponse()
                body = response.read()
                if response.status != 200:
                    raise RuntimeError(f"GET {path}: HTTP {response.status}")
                return body
            except (OSError, http.client.HTTPException):
                self._conn.close()
                self._conn = None
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def metric(self, name: str) -> float:
        """The value of an unlabelled sample on /metrics."""
        for line in self.get().decode().splitlines():
            if line.startswith(name + " "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def applied(self) -> int:
        """Snapshots applied so far, summed over ranks from the JSON route (which renders no /metrics,
        so it leaves any exposition cache as it was)."""
        ranks = json.loads(self.get("/api/v1/ranks"))["ranks"]
        return sum(int(r["snapshots"]) for r in ranks)

    def wait_applied(self, total: int, timeout: float = 60.0) -> None:
        """Wait until the sidecar has applied at least `total` snapshots."""
        deadline = time.monotonic() + timeout
        while self.applied() < total:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the sidecar did not apply {total} snapshots in {timeout:.0f} s")
            time.sleep(0.005)

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> Sidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    """Exactly `n` bytes from a blocking socket."""
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionResetError("the sidecar closed the connection")
        data += chunk
    return data


def read_reply(sock: socket.socket) -> Welcome | ErrorMessage:
    """The sidecar's answer to a hello: one framed server message."""
    (length,) = HEADER.unpack(recv_exact(sock, HEADER.size))
    return parse_server_message(recv_exact(sock, length))


class RawRank:
    """One rank connection speaking the wire protocol directly: hello, then full snapshots."""

    def __init__(self, socket_path: str, index: int, seed: int | None = None) -> None:
        self.index = index
        self.rank = rank_id(index)
        self.rng = random.Random(index if seed is None else seed)
        self.metrics = full_metric_set(seed=index if seed is None else seed)
        self.seq = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(socket_path)
        self.sock.sendall(encode_frame(hello_payload(self.rank)))
        reply = self._read_reply()
        if not isinstance(reply, Welcome):
            raise RuntimeError(f"rank {index}: the sidecar refused hello: {reply}")
        self.sock.setblocking(False)

    def _read_reply(self) -> Welcome | ErrorMessage:
        return read_reply(self.sock)

    def push(self, advance_values: bool = True) -> int:
        """Send one full cumulative snapshot; returns its size in bytes."""
        if advance_values and self.seq:
            advance_all(self.metrics, self.rng)
        self.seq += 1
        data = encode_frame(snapshot_payload(self.metrics, self.seq))
        self.sock.setblocking(True)
        try:
            self.sock.sendall(data)
        finally:
            self.sock.setblocking(False)
        self.drain()
        return len(data)

    def drain(self) -> None:
        """Read (and fail on) any error frame the sidecar sent back; never blocks."""
        try:
            data = self.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        if not data:
            raise ConnectionResetError(f"rank {self.index}: the sidecar closed the connection")
        raise RuntimeError(f"rank {self.index}: the sidecar answered a snapshot: {data[:300]!r}")

    def close(self) -> None:
        try:
            self.sock.setblocking(True)
            self.sock.sendall(encode_message(Bye()))
        except OSError:
            pass
        self.sock.close()


def series_count(text: str) -> int:
    """Sample lines (not comments) in a Prometheus text exposition."""
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))

