"""The proxy against a real upstream: the released SGLang 0.5.23 collectors in prometheus_client
multiprocess mode, one spawned process per rank, served over HTTP the way the engine serves its
/metrics (tests/integrations/engine_server.py), or read from their directory.

The sidecar is real (aiohttp, its own event loop) and reads the upstream on a short interval.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from exporter.config import config_from_data
from tests.helpers import Scrape, SidecarThread, free_port, http_get, wait_until
from tests.integrations.support import REPO, run_processes, samples

PASSED = frozenset({"sglang:num_requests_total"})
STEP_EVENTS = 14  # one step of a rank's events: a restarted engine that has done less work so far
RADIX_STATIC = {"cache_type": "UnifiedRadixCache"}
STORAGE_STATIC = {"storage_backend": "file", "pp_size": "1", "attn_cp_size": "1"}


class EngineServer:
    """prometheus_client's HTTP server over a MultiProcessCollector of `directory`, in its own process."""

    def __init__(self, directory: Path, port: int) -> None:
        self.directory, self.port = directory, port
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/metrics"

    def start(self) -> EngineServer:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integrations.engine_server", str(self.directory), str(self.port)],
            cwd=REPO, stdout=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None and self.proc.stdout.readline().strip() == "serving"
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(10)
            self.proc = None


def run_frontend(requests: int) -> None:
    """A process of the engine that writes a family outside the catalog (a tokenizer-side counter)."""
    from prometheus_client import Counter

    Counter("sglang:num_requests_total", "Number of requests processed.", ["model_name"]).labels("demo").inc(requests)


def run_pre_fix_rank(tp_rank: int) -> None:
    """A rank of an engine from before per-rank labels: its radix counters carry no rank axes."""
    from prometheus_client import Counter

    Counter("sglang:load_back_tokens_total", "tokens", ["cache_type", "pool"]).labels("UnifiedRadixCache", "kv").inc(64)
    Counter("sglang:load_back_bytes_total", "bytes", ["cache_type"]).labels("UnifiedRadixCache").inc(4096 * (tp_rank + 1))


def run_engine(ranks: ModuleType, directory: Path, monkeypatch: pytest.MonkeyPatch, world: list[Any],
               count: int | None = None, frontend: int = 0) -> None:
    """The engine's rank processes writing into `directory` (all their events, or the first `count`)."""
    directory.mkdir(parents=True, exist_ok=True)
    with monkeypatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        if count is None:
            run_processes(ranks.run_released_rank, [(rank,) for rank in world], receive=True)
        else:
            run_processes(ranks.run_released_rank_partly, [(rank, count) for rank in world])
        if frontend:
            run_processes(run_frontend, [(frontend,)])


# Reading a directory of many processes' files takes longer than an HTTP answer: on a loaded CI
# machine the first read of the late sidecar ran past a 0.2 s timeout and it had no rollups yet.
DIRECTORY_PACE = {"interval_seconds": 1.0, "timeout_seconds": 1.0}
# The tests read `up` and the ranks' status at arbitrary instants: a loaded machine's slow HTTP
# answer (0.2 s timed out) must not read as an engine that is down, nor a late read as a stale
# rank. Only a refused connection, at once, should; stale_after is four read intervals.
HTTP_PACE = {"interval_seconds": 0.5, "timeout_seconds": 0.5}
STALE_AFTER_SECONDS = 2.0


def proxy(socket_dir: Path, **upstream: Any) -> SidecarThread:
    config = config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "run" / "metrics.sock")},
        "ranks": {"stale_after_seconds": STALE_AFTER_SECONDS, "expire_after_seconds": 120.0},
        "upstreams": [{"name": "engine", **HTTP_PACE, **upstream}],
    }, "test")
    return SidecarThread(config).start()


def radix(ranks: ModuleType, rank: Any) -> dict[str, str]:
    return {key: str(value) for key, value in ranks.radix_labels(rank).items()}


def storage(ranks: ModuleType, rank: Any) -> dict[str, str]:
    return {key: str(value) for key, value in ranks.storage_labels(rank).items()}


def expected(ranks: ModuleType, world: list[Any], counts: dict[Any, list[int | None]]) -> dict[str, float]:
    """Rollups over epochs: bytes summed over every rank and epoch; tokens, per dp group, the furthest
    replica's total over its epochs."""

    def of(rank: Any, method: str, *extra: Any) -> float:
        return sum(ranks.total(rank, method, *extra) if n is None else ranks.partial_total(rank, n, method, *extra)
                   for n in counts[rank])

    groups = {rank.dp_rank for rank in world}
    return {
        "bytes": sum(of(rank, "increment_load_back_num_bytes") for rank in world),
        "tokens": sum(max(of(rank, "increment_load_back_num_tokens", "kv") for rank in world if rank.dp_rank == g)
                      for g in groups),
        "prefetched": sum(max(of(rank, "log_prefetched_tokens") for rank in world if rank.dp_rank == g) for g in groups),
    }


def rollups(scrape: Scrape) -> dict[str, float]:
    return {
        "bytes": scrape.value("sglang_rollup_load_back_bytes_total", **RADIX_STATIC),
        "tokens": scrape.value("sglang_rollup_load_back_tokens_total", pool="kv", **RADIX_STATIC),
        "prefetched": scrape.value("sglang_rollup_prefetched_tokens_total", **STORAGE_STATIC),
    }


def assert_ranks_as_counted(ranks: ModuleType, scrape: Scrape, world: list[Any], count: int | None = None) -> None:
    for rank in world:
        def total(method: str, *extra: Any, rank: Any = rank) -> float:
            return ranks.total(rank, method, *extra) if count is None else ranks.partial_total(rank, count, method, *extra)
        assert scrape.value("sglang_load_back_tokens_total", pool="kv", **radix(ranks, rank)) == total(
            "increment_load_back_num_tokens", "kv")
        assert scrape.value("sglang_load_back_bytes_total", **radix(ranks, rank)) == total("increment_load_back_num_bytes")
        assert scrape.value("sglang_prefetched_tokens_total", **storage(ranks, rank)) == total("log_prefetched_tokens")
        assert scrape.value("sglang_load_back_duration_seconds_count", **radix(ranks, rank)) == len(
            [e for e in (ranks.events(rank) if count is None else ranks.first_events(rank, count))
             if e[1] == "observe_load_back_duration"])


def counted(ranks: ModuleType, sidecar: SidecarThread, world: list[Any], count: int | None = None) -> bool:
    """Whether every rank of `world` shows what it counted (a read may land while a process still writes)."""
    try:
        assert_ranks_as_counted(ranks, sidecar.scrape(), world, count)
    except AssertionError:
        return False
    return True


def upstream_up(sidecar: SidecarThread) -> float:
    return sidecar.scrape().value("hicache_exporter_upstream_up", upstream="engine")


def statuses(sidecar: SidecarThread) -> set[str]:
    import json

    return {row["status"] for row in json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]}


def promtool_check(text: str, passed_through: frozenset[str] = frozenset()) -> None:
    """`promtool check metrics` finds nothing, except that families passed through unchanged keep the
    engine's `sglang:` names (a colon is legal in a metric name; the linter only advises against it)."""
    binary = shutil.which("promtool")
    assert binary, "promtool is required (Debian package `prometheus`)"
    result = subprocess.run([binary, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    findings = (result.stdout + result.stderr).strip().splitlines()
    allowed = {f"{name} metric names should not contain ':'" for name in passed_through}
    assert set(findings) <= allowed, findings
    assert result.returncode == (3 if findings else 0), result


def test_the_proxy_of_an_engine_url_rolls_up_its_ranks_through_a_restart_and_an_outage(
    ranks, tmp_path, socket_dir, monkeypatch, running
):
    world = ranks.ranks(tp=2, dp=2)
    port = free_port()
    run_engine(ranks, tmp_path / "engine-1", monkeypatch, world, frontend=3)
    engine = EngineServer(tmp_path / "engine-1", port).start()
    running.append(engine)
    engine_text = http_get(engine.url)[1].decode()
    sidecar = proxy(socket_dir, url=engine.url)
    running.append(sidecar)

    scrape = sidecar.scrape()
    assert scrape.value("hicache_exporter_upstream_up", upstream="engine") == 1
    assert scrape.value("hicache_exporter_upstream_samples", upstream="engine") == len(samples(engine_text))
    assert_ranks_as_counted(ranks, scrape, world)
    before = expected(ranks, world, {rank: [None] for rank in world})
    assert rollups(scrape) == before
    assert before["tokens"] < sum(ranks.total(rank, "increment_load_back_num_tokens", "kv") for rank in world)
    # A family outside the catalog passes through unchanged; nothing is flagged for a 0.5.23 engine.
    assert samples(scrape.text, {"sglang:num_requests"}) == samples(engine_text, {"sglang:num_requests"}) != []
    assert not scrape.find("hicache_exporter_upstream_unranked_families")
    promtool_check(scrape.text, PASSED)

    # The engine goes down: the upstream is down and its ranks turn stale; the rollups hold.
    engine.stop()
    wait_until(lambda: upstream_up(sidecar) == 0, timeout=10)
    wait_until(lambda: statuses(sidecar) == {"stale"}, timeout=10)
    scrape = sidecar.scrape()
    assert {s.value for s in scrape.find("hicache_exporter_rank_up")} == {0.0}
    assert scrape.value("hicache_exporter_upstream_scrape_errors_total", upstream="engine", kind="connect") >= 1
    assert rollups(scrape) == before

    # It restarts: a new directory, its counters from zero, less work done so far.
    run_engine(ranks, tmp_path / "engine-2", monkeypatch, world, count=STEP_EVENTS)
    running.append(EngineServer(tmp_path / "engine-2", port).start())
    after = expected(ranks, world, {rank: [None, STEP_EVENTS] for rank in world})
    wait_until(lambda: rollups(sidecar.scrape()) == after, timeout=10)
    wait_until(lambda: counted(ranks, sidecar, world, STEP_EVENTS), timeout=10)
    scrape = sidecar.scrape()
    assert scrape.value("hicache_exporter_upstream_up", upstream="engine") == 1
    assert statuses(sidecar) == {"live"}
    assert_ranks_as_counted(ranks, scrape, world, STEP_EVENTS)  # per-rank series start again from the new values
    assert {s.value for s in scrape.find("hicache_exporter_rank_restarts_total")} == {1.0}
    promtool_check(scrape.text, PASSED)


def test_the_proxy_of_a_multiprocess_directory_reads_each_process_apart(ranks, tmp_path, socket_dir, monkeypatch, running):
    world = ranks.ranks(tp=2, dp=2)
    directory = tmp_path / "multiproc"
    run_engine(ranks, directory, monkeypatch, world)
    with monkeypatch.context() as env:  # two processes writing one family outside the catalog
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        run_processes(run_frontend, [(2,), (3,)])
    sidecar = proxy(socket_dir, multiprocess_dir=str(directory), **DIRECTORY_PACE)
    running.append(sidecar)
    wait_until(lambda: sidecar.scrape().find("sglang_rollup_load_back_bytes_total"), timeout=10)
    scrape = sidecar.scrape()
    assert scrape.value("hicache_exporter_upstream_up", upstream="engine") == 1
    # Passed through as the engine's /metrics shows it: one series, both processes summed.
    assert scrape.value("sglang:num_requests_total", model_name="demo") == 5
    assert_ranks_as_counted(ranks, scrape, world)
    assert rollups(scrape) == expected(ranks, world, {rank: [None] for rank in world})

    # One rank's process restarts: a new pid for the same rank writes its own files beside the dead one's.
    restarted = world[2]  # tp 0 of dp group 1
    run_engine(ranks, directory, monkeypatch, [restarted], count=STEP_EVENTS)
    counts: dict[Any, list[int | None]] = {rank: [None] for rank in world}
    counts[restarted] = [None, STEP_EVENTS]
    wait_until(lambda: rollups(sidecar.scrape()) == expected(ranks, world, counts), timeout=10)
    wait_until(lambda: counted(ranks, sidecar, [restarted], STEP_EVENTS), timeout=10)
    scrape = sidecar.scrape()
    assert_ranks_as_counted(ranks, scrape, [restarted], STEP_EVENTS)  # the dead process is not summed in
    assert_ranks_as_counted(ranks, scrape, [r for r in world if r != restarted])
    assert scrape.value("hicache_exporter_rank_restarts_total", **radix(ranks, restarted)) == 1
    # What the engine's own /metrics shows for that rank: both processes summed.
    engine = CollectorRegistry()
    MultiProcessCollector(engine, path=str(directory))
    summed = {name: value for name, labels, value in samples(generate_latest(engine).decode())
              if name == "sglang:load_back_bytes_total" and dict(labels) == radix(ranks, restarted)}
    assert summed == {"sglang:load_back_bytes_total": ranks.total(restarted, "increment_load_back_num_bytes")
                      + ranks.partial_total(restarted, STEP_EVENTS, "increment_load_back_num_bytes")}

    # A sidecar that starts after the restart reads the older process first: the same rollups.
    late = proxy(socket_dir / "late", multiprocess_dir=str(directory), **DIRECTORY_PACE)
    running.append(late)
    wait_until(lambda: late.scrape().find("sglang_rollup_load_back_bytes_total"), timeout=10)
    assert rollups(late.scrape()) == expected(ranks, world, counts)
    promtool_check(scrape.text, PASSED)


def test_an_engine_without_rank_labels_is_flagged_not_rolled_up(ranks, tmp_path, socket_dir, monkeypatch, running, caplog):
    directory = tmp_path / "multiproc"
    directory.mkdir()
    with monkeypatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        run_processes(run_pre_fix_rank, [(0,), (1,)])
    port = free_port()
    running.append(EngineServer(directory, port).start())
    with caplog.at_level("WARNING", logger="hicache_exporter.upstream"):
        sidecar = proxy(socket_dir, url=f"http://127.0.0.1:{port}/metrics")
    running.append(sidecar)
    scrape = sidecar.scrape()
    flagged = {s.labels["family"] for s in scrape.find("hicache_exporter_upstream_unranked_families", upstream="engine")}
    assert flagged == {"load_back_tokens_total", "load_back_bytes_total"}
    assert not scrape.find("sglang_rollup_load_back_bytes_total") and not scrape.find("sglang_load_back_bytes_total")
    assert "predates per-rank labels" in caplog.text and "summed its ranks" in caplog.text
