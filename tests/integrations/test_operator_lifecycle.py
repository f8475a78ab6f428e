"""One real sidecar on one state file through what operators do between its restarts.

An LMCache engine of four workers (one process each, writing prometheus_client multiprocess files by its own
writer) is read through the directory door, then pushed, then read again. Between restarts of the sidecar
(SIGTERM, a real `serve` each time, the same state file) the upstream is renamed, given a world, has its
world changed, has a process's files removed while the sidecar is down, restarts in a wiped directory with
pids reused, moves to push and back. After every step each rollup equals the truth this test keeps
independently: per-shard bytes summed over every worker and process, replicated hit tokens counted once per
engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from exporter.catalog import load_profile
from exporter.client import RankClient
from tests.exporter.sidecar.upstream.test_profiles import write_process
from tests.helpers import wait_until
from tests.integrations.support import ServeProcess

WORKERS = 4
HITS, BYTES = "lmcache_rollup_num_hit_tokens_total", "lmcache_rollup_num_remote_read_bytes_total"
STATIC = {"model_name": "m", "role": "worker", "served_model_name": "s"}
WAIT = 30.0


@dataclass
class Engine:
    """The engine's workers as processes (pid -> worker_id and values) and the truth of what they counted."""

    directory: Path
    processes: dict[str, tuple[int, float, float]] = field(default_factory=dict)  # pid -> (worker, hits, bytes)
    hits: float = 0.0  # replicated: every worker counts the engine's tokens; the truth counts them once
    bytes: float = 0.0  # per shard: every worker's own, summed

    def start(self, pids: list[str]) -> None:
        """A fresh engine: worker w runs as pids[w], every counter at zero."""
        for worker, pid in enumerate(pids):
            self.processes[pid] = (worker, 0.0, 0.0)
            self._write(pid)

    def step(self, tokens: float) -> None:
        """Every live worker counts `tokens` hit tokens and moves (worker + 1) * tokens bytes."""
        for pid, (worker, hits, moved) in self.processes.items():
            self.processes[pid] = (worker, hits + tokens, moved + (worker + 1) * tokens)
            self._write(pid)
        self.hits += tokens
        self.bytes += sum((worker + 1) * tokens for worker, _, _ in self.processes.values())

    def _write(self, pid: str) -> None:
        worker, hits, moved = self.processes[pid]
        write_process(self.directory, pid, {str(worker): hits})
        write_process(self.directory, pid, {str(worker): moved}, family="lmcache:num_remote_read_bytes")

    def replace(self, pid: str, new_pid: str) -> None:
        """Worker process `pid` exited (its files gone); `new_pid` takes its worker over from zero."""
        worker, _, _ = self.processes.pop(pid)
        for path in self.directory.glob(f"*_{pid}.db"):
            path.unlink()
        self.processes[new_pid] = (worker, 0.0, 0.0)
        self._write(new_pid)

    def wipe(self) -> None:
        """The engine's container restarted: its multiprocess directory is emptied."""
        self.processes.clear()
        for path in self.directory.iterdir():
            path.unlink()


@dataclass
class Operator:
    """Starts the sidecar on one state file with the configuration of the step."""

    tmp: Path
    engine: Engine
    sidecar: ServeProcess | None = None

    def start(self, upstream: dict[str, Any] | None, **ranks: float) -> ServeProcess:
        if self.sidecar is not None:
            self.sidecar.stop()
        config: dict[str, Any] = {
            "persistence": {"file": str(self.tmp / "state"), "interval": "100ms"},
            "metrics": {"profiles": ["lmcache"]},
            "ranks": ranks,
        }
        if upstream is not None:
            config["upstreams"] = [{"multiprocess_dir": str(self.engine.directory), "profile": "lmcache",
                                    "interval_seconds": 0.1, "timeout_seconds": 0.1, **upstream}]
        self.sidecar = ServeProcess(self.tmp / "sidecar", config)
        return self.sidecar

    def assert_truth(self) -> None:
        """Every rollup reaches the truth, and is still there after two more reads of the upstream."""
        assert self.sidecar is not None
        sidecar = self.sidecar
        truth = {HITS: self.engine.hits, BYTES: self.engine.bytes}

        def rollups() -> dict[str, float]:
            scrape = sidecar.scrape()
            return {name: sum(s.value for s in scrape.find(name, **STATIC)) for name in truth}

        def scrapes() -> int:
            return sum(up["scrapes"] for up in sidecar.get_json("/api/v1/status")["upstreams"])

        seen: list[dict[str, float]] = []
        try:
            wait_until(lambda: seen.append(rollups()) or seen[-1] == truth, WAIT)
        except AssertionError:
            raise AssertionError(f"rollups {seen[-1]}, truth {truth}") from None
        read = scrapes()
        if sidecar.get_json("/api/v1/status")["upstreams"]:
            wait_until(lambda: scrapes() >= read + 2, WAIT)
        assert rollups() == truth


@pytest.fixture
def operator(tmp_path: Path) -> Iterator[Operator]:
    directory = tmp_path / "multiproc"
    directory.mkdir()
    op = Operator(tmp_path, Engine(directory))
    yield op
    if op.sidecar is not None:
        op.sidecar.stop()


def push_workers(socket_path: str, tokens: float) -> Engine:
    """The engine restarted with the push hook: each worker's client pushes its counts from zero, then says bye."""
    pushed = Engine(Path("/nonexistent"))
    catalog = load_profile("lmcache")
    for worker in range(WORKERS):
        client = RankClient(socket_path, rank={"tp_rank": worker, "pp_rank": 0, "dp_rank": 0},
                            labels={**STATIC, "worker_id": str(worker)}, interval=0.05, catalog=catalog, preset=False)
        client.counter("num_hit_tokens_total").inc(tokens)
        client.counter("num_remote_read_bytes_total").inc((worker + 1) * tokens)
        client.start()
        client.close()  # its last snapshot, then bye
    pushed.hits, pushed.bytes = tokens, sum((worker + 1) * tokens for worker in range(WORKERS))
    return pushed


def test_the_rollups_stay_exact_through_an_operators_restarts_and_reconfigurations(operator: Operator) -> None:
    engine = operator.engine
    engine.start(["100", "101", "102", "103"])
    engine.step(100)
    operator.start({})
    operator.assert_truth()
    # Renamed.
    operator.start({"name": "engine"})
    engine.step(10)
    operator.assert_truth()
    # Given a world: workers 2 and 3 are now (tp 0-1, pp 1).
    operator.start({"name": "engine", "world": {"tp_size": 2, "pp_size": 2}})
    engine.step(10)
    operator.assert_truth()
    # Its world changed: every worker a tp rank of one stage again.
    operator.start({"name": "engine", "world": {"tp_size": 4}})
    engine.step(10)
    operator.assert_truth()
    # A worker's process exited and its files were removed while the sidecar was down; another took over.
    assert operator.sidecar is not None
    operator.sidecar.stop()
    operator.sidecar = None
    engine.replace("103", "104")
    engine.step(7)
    operator.start({"name": "engine", "world": {"tp_size": 4}})
    operator.assert_truth()
    # The engine's container restarted: a wiped directory, pids 100 and 101 reused by new processes.
    operator.sidecar.stop()
    operator.sidecar = None
    engine.wipe()
    engine.start(["100", "101", "105", "106"])
    engine.step(5)
    operator.start({"name": "engine", "world": {"tp_size": 4}})
    operator.assert_truth()
    # Moved to push: the upstream is gone from the config; the engine restarted with the hook.
    sidecar = operator.start(None)
    pushed = push_workers(sidecar.socket_path, tokens=20)
    engine.wipe()
    engine.hits += pushed.hits
    engine.bytes += pushed.bytes
    operator.assert_truth()
    # And back to the proxy: the pushed ranks do not come back, and the upstream continues them once they expire.
    operator.start({"name": "engine", "world": {"tp_size": 4}}, stale_after_seconds=0.5, expire_after_seconds=1.0)
    engine.start(["200", "201", "202", "203"])
    engine.step(3)
    operator.assert_truth()
