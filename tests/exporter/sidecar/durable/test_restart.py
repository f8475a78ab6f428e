"""Issue 21's "Must show", end to end: a real sidecar process (`python -m exporter.cli serve
--persistence.file`) is killed with SIGKILL and started again on its state file, with real sources
feeding it: ranks pushing over the Unix socket, an engine's /metrics over HTTP, and a
prometheus_client multiprocess directory written by real processes.

With a state file, /metrics shows the rollups as of the last save (every 200 ms here): a wait for
rollups after the sources moved polls until a save has them. The new sidecar's first scrape comes,
for certain, before any source is back (the sources reach it only once it has answered): its
rollups are the file's, exactly. At every scrape, before the kill and from the new sidecar's first
until every rank is back, no rollup is absent and none is below any earlier scrape's. Once the
sources are read again, every rollup equals the truth computed here from what the sources counted,
the ended epochs included. The pushing ranks count on through the kill, while the sidecar is down
and after it is back: a rank that reconnects with its epoch is continued exactly, whatever it moved
meanwhile; one whose epoch ended while the sidecar was down counts as far as the file holds it (what
it moved after the last save is lost, the bound docs/reliability.md states). What the killed sidecar
applied after its last save it never showed (the last test).
"""

from __future__ import annotations

import http.server
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest

from tests.exporter.sidecar.durable.restart_support import (
    WAIT,
    Load,
    PushedRank,
    SidecarProcess,
    Watch,
    close_all,
    keep_saved,
    per_rank,
    ranks_by_state,
    reroute,
    rollups,
    saved,
    saved_as_scraped,
    truth,
    wait_saved,
    wait_saved_values,
)
from tests.helpers import free_port, wait_until
from tests.integrations.support import run_processes

TOKENS = "sglang_load_back_tokens_total"
BYTES = "sglang_load_back_bytes_total"


def start_sidecar(socket_dir: Path, tmp_path: Path, cleanup: list[Any], *extra: str) -> SidecarProcess:
    sidecar = SidecarProcess(free_port(), str(socket_dir / "metrics.sock"), tmp_path / "state.bin",
                             tmp_path / "sidecar.log", *extra).start()
    cleanup.append(sidecar.stop)
    sidecar.wait_ready()
    return sidecar


# --- pushed ranks ---------------------------------------------------------------------------------

# (tp, dp) -> (tokens per step, bytes per step, seconds per observation): replicas of one dp group
# count different tokens (skewed), and each shard moves its own bytes.
FIRST = {(0, 0): (7, 4096, 0.25), (1, 0): (5, 2048, 0.0625),
         (0, 1): (3, 4097, 0.25), (1, 1): (11, 2049, 0.0625),
         (0, 2): (13, 4098, 0.25), (1, 2): (12, 2050, 0.0625)}
# dp group 0 restarted as a whole: the skew turned round (the furthest replica is now another one).
RESTARTED_DP0 = {(0, 0): (2, 1024, 0.0625), (1, 0): (9, 512, 0.25)}
RESTARTED_WHILE_DOWN = {(1, 2): (17, 8192, 0.25)}  # its old epoch ends while the sidecar is down


def test_pushed_rollups_survive_a_sigkill_never_absent_never_lower_then_exact(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any]) -> None:
    """Three dp groups of two skewed tp replicas; dp0 restarted as a whole (new epochs) before the kill,
    one rank restarted while the sidecar is down; SIGKILL under push load, a new sidecar on the file."""
    sidecar = start_sidecar(socket_dir, tmp_path, cleanup)
    ranks = {key: PushedRank(sidecar.socket_path, *key).begin(*steps) for key, steps in FIRST.items()}
    cleanup.append(lambda: close_all(ranks.values()))
    load = Load(list(ranks.values())).start()
    cleanup.append(load.stop)
    wait_until(lambda: ranks_by_state(sidecar.scrape() or "").get("live") == 6, WAIT)

    # dp0 restarts as a whole: its replicas' last values pushed and their goodbyes taken (departed)
    # before the new epochs say hello, so the ended epochs' values are all in.
    load.pause()
    for tp in (0, 1):
        ranks[(tp, 0)].current.client.close()
    wait_until(lambda: ranks_by_state(sidecar.scrape() or "").get("departed") == 2, WAIT)
    for key, steps in RESTARTED_DP0.items():
        ranks[key].begin(*steps)
    load.resume()
    wait_until(lambda: ranks_by_state(sidecar.scrape() or "").get("live") == 6, WAIT)

    # Stand still until the sidecar shows (a save after the last push: /metrics shows the rollups of the
    # last save) and its file holds every rank's last values: the rollups are the truth there, and so are the file's.
    load.pause()
    expected = truth(ranks.values())
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == {k: float(r.current.tokens) for k, r in ranks.items()}
               and rollups(sidecar.scrape() or "") == expected, WAIT)
    wait_saved_values(sidecar.state_file, ranks)
    state = saved(sidecar.state_file)
    assert state is not None
    assert saved_as_scraped(state) == expected

    # Counting goes on, and the sidecar is killed under it (every client connected and pushing) once a
    # save of moving values has been shown; every scrape from here on is checked.
    watch = Watch(expected)
    load.resume()
    watch.until(sidecar, lambda text: all(rollups(text)[key] > value for key, value in expected.items() if value))
    sidecar.kill()
    state = saved(sidecar.state_file)  # as the kill left it: the last save
    assert state is not None
    file = saved_as_scraped(state)
    # One rank's process "restarts" while the sidecar is down: its old epoch never says goodbye, so what
    # it moved after the last save is lost (the bound docs/reliability.md states): its old epoch counts
    # as far as the file holds it. The others keep their epochs and count on while the sidecar is down.
    load.pause()
    for key, steps in RESTARTED_WHILE_DOWN.items():
        keep_saved(ranks[key], state)
        ranks[key].begin(*steps)
    load.resume()
    # The new sidecar listens on another socket, which the ranks reach only once it has answered a
    # scrape: that scrape is one, for certain, before any rank is back.
    ranks_socket = sidecar.socket_path
    sidecar.socket_path = str(socket_dir / "after.sock")
    sidecar.start()
    first = watch.until(sidecar, lambda text: True)  # never below any scrape before the kill
    assert ranks_by_state(first) == {"live": 0, "stale": 0, "departed": 6, "expired": 0}
    assert rollups(first) == file  # served at once from the file, exactly
    assert per_rank(first, TOKENS) == {}  # the restored ranks' own series wait for their next push
    reroute(ranks_socket, sidecar.socket_path)
    # Every scrape from then on: never absent, never lower, ...
    watch.until(sidecar, lambda text: ranks_by_state(text).get("live") == 6)
    # ... until every rank is back and has pushed its last values, and a save has them: then every
    # rollup is the truth (the same epochs continued exactly, whatever they moved meanwhile).
    load.pause()
    final = watch.until(sidecar, lambda text: per_rank(text, TOKENS) == {
        k: float(r.current.tokens) for k, r in ranks.items()} and per_rank(text, BYTES) == {
        k: float(r.current.bytes) for k, r in ranks.items()} and rollups(text) == truth(ranks.values()))
    assert rollups(final) != file  # the ranks moved while the sidecar was down and after: it was counted
    assert watch.scrapes >= 3


# --- a URL upstream -------------------------------------------------------------------------------


@dataclass
class Counted:
    """What one rank of one engine process counted."""

    tokens: float = 0.0
    moved: float = 0.0
    seconds: list[float] = field(default_factory=list)  # its observations


class Engine:
    """An engine's /metrics (prometheus_client's text), served over real HTTP; a restart starts its counters over."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.epochs: list[dict[tuple[int, int], Counted]] = []  # what each rank counted, per engine process
        self.down = False  # answers 503 (an engine not serving yet)
        self.restart()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def _handler(self) -> type[http.server.BaseHTTPRequestHandler]:
        engine = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                if engine.down:
                    self.send_error(503)
                    return
                with engine._lock:
                    body = generate_latest(engine.registry)
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        return Handler

    def start(self) -> Engine:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def restart(self) -> None:
        """A new engine process: new counters, from zero."""
        with self._lock:
            self.registry = CollectorRegistry()
            labels = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
            self.tokens = Counter("sglang:load_back_tokens", "tokens", [*labels, "pool"], registry=self.registry)
            self.bytes = Counter("sglang:load_back_bytes", "bytes", labels, registry=self.registry)
            self.duration = Histogram("sglang:load_back_duration_seconds", "seconds", labels,
                                      buckets=(0.1, 0.5, 1.0), registry=self.registry)
            self.epochs.append({})

    def count(self, tp: int, dp: int, tokens: float, moved: float, seconds: list[float]) -> None:
        """The rank (tp, dp) of the engine counts this much more."""
        with self._lock:
            values = {"cache_type": "UnifiedRadixCache", "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
            self.tokens.labels(**values, pool="kv").inc(tokens)
            self.bytes.labels(**values).inc(moved)
            for s in seconds:
                self.duration.labels(**values).observe(s)
            counted = self.epochs[-1].setdefault((tp, dp), Counted())
            counted.tokens += tokens
            counted.moved += moved
            counted.seconds += seconds

    def current(self, series: str) -> dict[tuple[int, int], float]:
        """Each rank's value of one series (tokens or moved) in the engine's current epoch."""
        return {rank: float(getattr(counted, series)) for rank, counted in self.epochs[-1].items()}

    def truth(self) -> dict[str, float]:
        """Tokens: per dp group the furthest replica over the engine's epochs; bytes and observations: every rank, every epoch."""
        counted = [(rank, c) for epoch in self.epochs for rank, c in epoch.items()]
        tokens: dict[tuple[int, int], float] = {}
        for rank, c in counted:
            tokens[rank] = tokens.get(rank, 0.0) + c.tokens
        return {
            "tokens": sum(max(t for (_, dp), t in tokens.items() if dp == g) for g in {dp for _, dp in tokens}),
            "bytes": sum(c.moved for _, c in counted),
            "observations": float(sum(len(c.seconds) for _, c in counted)),
            "seconds": sum(s for _, c in counted for s in c.seconds),
        }


def upstream_rollups(text: str) -> dict[str, float]:
    values = {name: sum(v for (n, _), v in rollups(text).items() if n == f"sglang_rollup_{name}")
              for name in ("load_back_tokens_total", "load_back_bytes_total", "load_back_duration_seconds_count",
                           "load_back_duration_seconds_sum")}
    return {"tokens": values["load_back_tokens_total"], "bytes": values["load_back_bytes_total"],
            "observations": values["load_back_duration_seconds_count"], "seconds": values["load_back_duration_seconds_sum"]}


def proxy_config(tmp_path: Path, **upstream: Any) -> str:
    """A config file naming the upstream (its state is kept by name) with a quick read pace."""
    path = tmp_path / "sidecar.yaml"
    path.write_text(yaml.safe_dump({"upstreams": [{"name": "engine", "interval_seconds": 0.25, "timeout_seconds": 0.25,
                                                   **upstream}]}), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("while_down", ["counts on", "restarts again"])
def test_a_url_upstream_that_restarted_before_the_kill_is_continued_exactly(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any], while_down: str) -> None:
    """The issue's numbers: the tokens rollup read 8,000 before the engine restarted; after the engine's
    restart and a SIGKILL of the sidecar, a sidecar without the file read 1,500 (the counters since the
    engine's restart). With it, the rollups continue from where they were, and then exactly, whether
    the engine counted on while the sidecar was down (at least the saved values: it continues) or
    restarted once more (lower than the saved values: a new epoch on top of them)."""
    engine = Engine().start()
    cleanup.append(engine.stop)
    # dp0: tp0 is the furthest replica (3,000); dp1: tp1 (5,000): 8,000 tokens.
    for (tp, dp), tokens in {(0, 0): 3000, (1, 0): 2600, (0, 1): 4200, (1, 1): 5000}.items():
        engine.count(tp, dp, tokens, moved=tokens * 64 + tp, seconds=[0.25] * (tp + 2))
    sidecar = start_sidecar(socket_dir, tmp_path, cleanup, "--config", proxy_config(tmp_path, url=engine.url))
    # The rank series are read live; the rollups are shown as of the last save (every 200 ms): polled.
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == engine.current("tokens")
               and upstream_rollups(sidecar.scrape() or "") == engine.truth(), WAIT)
    assert engine.truth()["tokens"] == 8000

    # The engine restarts (every counter falls), with the skew turned round; the sidecar reads it as a
    # new epoch of each rank.
    engine.restart()
    for (tp, dp), tokens in {(0, 0): 600, (1, 0): 900, (0, 1): 500, (1, 1): 600}.items():
        engine.count(tp, dp, tokens, moved=tokens * 32 + tp, seconds=[0.0625])
    assert sum(max(t for (tp, dp), t in engine.current("tokens").items() if dp == g) for g in (0, 1)) == 1500
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == engine.current("tokens")
               and upstream_rollups(sidecar.scrape() or "") == engine.truth(), WAIT)
    before_text = sidecar.scrape() or ""
    assert upstream_rollups(before_text) == engine.truth()
    wait_saved(sidecar.state_file, {rank: {"load_back_tokens_total": t} for rank, t in engine.current("tokens").items()})
    before = rollups(before_text)

    sidecar.kill()
    if while_down == "restarts again":
        engine.restart()
    for (tp, dp), tokens in {(0, 0): 100, (1, 0): 300, (0, 1): 50, (1, 1): 20}.items():
        engine.count(tp, dp, tokens, moved=tokens * 8, seconds=[0.5])
    # The engine answers only once the new sidecar has answered a scrape: one, for certain, before any rank is back.
    engine.down = True
    watch = Watch(before)
    sidecar.start()
    assert rollups(watch.until(sidecar, lambda text: True)) == before  # served at once from the file, exactly
    engine.down = False
    final = watch.until(sidecar, lambda text: per_rank(text, TOKENS) == engine.current("tokens")
                        and per_rank(text, BYTES) == engine.current("moved") and upstream_rollups(text) == engine.truth())
    assert upstream_rollups(final)["tokens"] == 3800 + 5620  # the furthest replicas across every epoch of the engine


# --- a multiprocess directory ---------------------------------------------------------------------


def engine_process(tp: int, dp: int, tokens: float, moved: float, observations: int, pipe: Any) -> None:
    """One rank process of an engine in prometheus_client multiprocess mode (PROMETHEUS_MULTIPROC_DIR set by
    the parent): counts, leaves its files, sends back its pid and exits."""
    from prometheus_client import Counter as MpCounter
    from prometheus_client import Histogram as MpHistogram

    labels = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
    values = {"cache_type": "UnifiedRadixCache", "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
    MpCounter("sglang:load_back_tokens", "tokens", [*labels, "pool"]).labels(**values, pool="kv").inc(tokens)
    MpCounter("sglang:load_back_bytes", "bytes", labels).labels(**values).inc(moved)
    duration = MpHistogram("sglang:load_back_duration_seconds", "seconds", labels, buckets=(0.1, 0.5, 1.0))
    for _ in range(observations):
        duration.labels(**values).observe(0.25)
    pipe.send(os.getpid())
    pipe.close()


def run_engine_processes(directory: Path, monkeypatch: pytest.MonkeyPatch,
                         ranks: dict[tuple[int, int], tuple[float, float, int]]) -> dict[tuple[int, int], int]:
    """Each rank's process, run to its end; their pids by (tp, dp)."""
    with monkeypatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        pids = run_processes(engine_process, [(*rank, *values) for rank, values in ranks.items()], receive=True)
    return dict(zip(ranks, pids))


@pytest.mark.parametrize("old_files", ["removed", "kept"])
def test_a_multiprocess_rank_with_a_new_pid_while_the_sidecar_was_down_is_counted_on_top(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any], monkeypatch: pytest.MonkeyPatch, old_files: str) -> None:
    """A rank process replaced (a new pid, lower values) while the sidecar was down: its rollup contribution is
    the old process's plus the new one's, exactly. The old process's files removed, or left behind as
    prometheus_client leaves a dead process's counter files (never summed into the new process's)."""
    directory = tmp_path / "multiproc"
    directory.mkdir()
    first = {(0, 0): (3000.0, 300_000.0, 3), (1, 0): (2600.0, 260_000.0, 2),
             (0, 1): (4200.0, 420_000.0, 4), (1, 1): (5000.0, 500_000.0, 5)}
    pids = run_engine_processes(directory, monkeypatch, first)
    sidecar = start_sidecar(socket_dir, tmp_path, cleanup, "--config", proxy_config(tmp_path, multiprocess_dir=str(directory)))
    counted = {"tokens": 3000 + 5000, "bytes": 1_480_000, "observations": 14, "seconds": 14 * 0.25}
    # The rank series are read live; the rollups are shown as of the last save (every 200 ms): polled.
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == {r: v[0] for r, v in first.items()}
               and upstream_rollups(sidecar.scrape() or "") == counted, WAIT)
    before_text = sidecar.scrape() or ""
    assert upstream_rollups(before_text) == counted
    wait_saved(sidecar.state_file, {rank: {"load_back_tokens_total": v[0]} for rank, v in first.items()})
    before = rollups(before_text)

    sidecar.kill()
    # (1, 1), dp1's furthest replica, is a new process now, counting from zero: less than its predecessor.
    if old_files == "removed":
        for path in directory.glob(f"*_{pids[(1, 1)]}.db"):
            path.unlink()
    again = {(1, 1): (700.0, 70_000.0, 1)}
    new_pid = run_engine_processes(directory, monkeypatch, again)[(1, 1)]
    assert new_pid != pids[(1, 1)]
    # The directory is away until the new sidecar has answered a scrape: one, for certain, before any rank is read.
    away = directory.rename(tmp_path / "away")
    watch = Watch(before)
    sidecar.start()
    assert rollups(watch.until(sidecar, lambda text: True)) == before  # served at once from the file, exactly
    away.rename(directory)
    after = {"tokens": 3000 + 5000 + 700, "bytes": 1_480_000 + 70_000, "observations": 15, "seconds": 15 * 0.25}
    final = watch.until(sidecar, lambda text: per_rank(text, TOKENS).get((1, 1)) == 700.0
                        and upstream_rollups(text) == after)
    assert per_rank(final, TOKENS) == {(0, 0): 3000.0, (1, 0): 2600.0, (0, 1): 4200.0, (1, 1): 700.0}


# --- what a SIGKILL loses was never shown --------------------------------------------------------


def test_what_a_scrape_saw_between_the_last_save_and_a_sigkill_is_never_lower_after_it(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any]) -> None:
    """A scrape after the last save and before the kill: the new sidecar serves the file's rollups, and
    they are what that scrape showed, since /metrics shows the rollups of the last save.

    Made certain with a save interval of an hour: the file holds what a SIGTERM saved; the rank then
    counts on, the sidecar applies it (the rank's own series shows it) and a scrape sees the rollups
    still at the file's values; the rank ends (a process done, or one that restarts while the sidecar
    is down: what it moved after the file is lost, as the issue says) and the sidecar is killed. Before
    the rollups were shown as of the last save, that scrape saw the rank's new values in the rollups,
    and the restarted sidecar's lower ones read as a counter reset (Prometheus's increase() counted
    the whole rollup again)."""
    sidecar = start_sidecar(socket_dir, tmp_path, cleanup, "--persistence.interval", "1h")
    rank = PushedRank(sidecar.socket_path, 0, 0).begin(7, 4096, 0.25)
    cleanup.append(lambda: close_all([rank]))
    for _ in range(10):
        rank.step()
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == {(0, 0): 70.0}, WAIT)
    sidecar.stop()  # SIGTERM: the save at stop
    wait_saved_values(sidecar.state_file, {(0, 0): rank})
    file = saved(sidecar.state_file)
    assert file is not None
    in_file = saved_as_scraped(file)
    assert in_file == truth([rank])
    sidecar.start()
    sidecar.wait_ready()
    for _ in range(5):
        rank.step()
    wait_until(lambda: per_rank(sidecar.scrape() or "", TOKENS) == {(0, 0): 105.0}, WAIT)
    seen = sidecar.scrape() or ""
    assert per_rank(seen, TOKENS) == {(0, 0): 105.0}  # applied, ...
    assert rollups(seen) == in_file  # ... and not shown: the last save's rollups
    rank.current.client.close()
    sidecar.kill()
    watch = Watch(rollups(seen))
    sidecar.start()
    assert rollups(watch.until(sidecar, lambda text: True)) == rollups(seen)
