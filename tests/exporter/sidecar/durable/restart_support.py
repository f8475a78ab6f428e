"""Helpers for the sidecar-restart tests: a real `hicache-exporter serve` process that can be killed
with SIGKILL and started again on its state file, ranks pushing known amounts from real clients,
the truth of every rollup computed from what they pushed, and a watch that checks each scrape.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from exporter.client import CounterChild, HistogramChild, RankClient
from exporter.errors import StateFileError
from exporter.sidecar.core.keys import HistValue
from exporter.sidecar.durable.file import unframe
from exporter.sidecar.durable.keeper import SavedFile
from tests.helpers import http_get, wait_ready, wait_until

REPO = Path(__file__).resolve().parents[4]
CACHE = "HiRadixCache"
ROLLUP = "sglang_rollup_"
WAIT = 30.0  # every wait's bound: a condition, polled, never a timing assertion
PUSH_INTERVAL = 0.05
BACKOFF = 0.2  # how soon a client retries a sidecar that is down
SAVE_EVERY = "200ms"
HISTOGRAM = "load_back_duration_seconds"
# Rollup key: (sample name, sorted labels); a scrape's rollups as key -> value.
Key = tuple[str, tuple[tuple[str, str], ...]]


class SidecarProcess:
    """`python -m exporter.cli serve` on a fixed port, socket and state file; killed with SIGKILL or stopped."""

    def __init__(self, port: int, socket_path: str, state_file: Path, log: Path, *extra: str) -> None:
        self.port, self.socket_path, self.state_file, self.log, self.extra = port, socket_path, state_file, log, extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SidecarProcess:
        """Start the process (the previous one must be gone) and return at once: callers poll `scrape`."""
        assert self.proc is None or self.proc.poll() is not None
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port),
                 "--socket", self.socket_path, "--persistence.file", str(self.state_file),
                 "--persistence.interval", SAVE_EVERY, *self.extra],
                cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
            )
        return self

    def wait_ready(self) -> None:
        assert self.proc is not None
        wait_ready(self.proc, lambda: self.scrape() is not None)

    def scrape(self) -> str | None:
        """The /metrics text, or None while nothing answers (not started yet, or killed)."""
        try:
            status, body, _ = http_get(self.url + "/metrics")
        except OSError:
            return None
        assert status == 200, f"/metrics answered {status}"
        return body.decode()

    def kill(self) -> None:
        """SIGKILL: no final save, no goodbye to anyone."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(WAIT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(WAIT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(WAIT)


def reroute(clients_path: str, sidecar_path: str) -> None:
    """Point the socket path the clients use (a dead sidecar's socket file) at a running sidecar's socket."""
    os.unlink(clients_path)
    os.symlink(sidecar_path, clients_path)


def rollups(text: str) -> dict[Key, float]:
    """Every rollup counter and histogram sample of an exposition (gauges are not cumulative)."""
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): float(sample.value)
        for family in text_string_to_metric_families(text)
        if family.name.startswith(ROLLUP) and family.type in ("counter", "histogram")
        for sample in family.samples
    }


def per_rank(text: str, name: str) -> dict[tuple[int, int], float]:
    """A per-rank series' values by (tp_rank, dp_rank)."""
    return {
        (int(s.labels["tp_rank"]), int(s.labels["dp_rank"])): float(s.value)
        for family in text_string_to_metric_families(text) for s in family.samples
        if s.name == name and "tp_rank" in s.labels
    }


def ranks_by_state(text: str) -> dict[str, float]:
    return {s.labels["state"]: float(s.value) for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == "hicache_exporter_ranks"}


def saved(path: Path) -> SavedFile | None:
    """The state file decoded, or None while there is none yet (it is replaced atomically: never half written)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return msgspec.msgpack.decode(unframe(data), type=SavedFile)
    except StateFileError as err:
        raise AssertionError(f"the state file cannot be read back: {err.reason}: {err.message}") from None


def saved_rank_values(state: SavedFile) -> dict[tuple[int, int, str], dict[str, float]]:
    """Each saved rank's last cumulative values by family (a histogram's by its count), keyed by (tp, dp, epoch)."""
    out: dict[tuple[int, int, str], dict[str, float]] = {}
    for rank in state.core.ranks:
        values = out.setdefault((rank.tp_rank, rank.dp_rank, rank.epoch), {})
        for value in rank.values:
            values[value.family] = float(value.value.counts[-1] if isinstance(value.value, HistValue) else value.value)
    return out


def saved_rollups(state: SavedFile) -> dict[str, float | tuple[tuple[int, ...], float]]:
    """The saved rollup cells by family: a counter's value, a histogram's (bucket counts, sum)."""
    out: dict[str, float | tuple[tuple[int, ...], float]] = {}
    for cell in state.core.cells:
        out[cell.family] = (tuple(cell.value.counts), cell.value.sum) if isinstance(cell.value, HistValue) \
            else float(cell.value)
    return out


def saved_as_scraped(state: SavedFile) -> dict[Key, float]:
    """The file's rollups of the pushed ranks' families as a scrape shows them (`rollups`)."""
    cells = saved_rollups(state)
    cache = (("cache_type", CACHE),)
    histogram = cells[HISTOGRAM]
    tokens, moved = cells["load_back_tokens_total"], cells["load_back_bytes_total"]
    assert isinstance(histogram, tuple) and isinstance(tokens, float) and isinstance(moved, float)
    counts, total = histogram
    name = f"{ROLLUP}{HISTOGRAM}"
    out: dict[Key, float] = {
        (f"{ROLLUP}load_back_tokens_total", (*cache, ("pool", "kv"))): tokens,
        (f"{ROLLUP}load_back_bytes_total", cache): moved,
        (f"{name}_count", cache): float(counts[-1]),  # the buckets are cumulative: +Inf's is the count
        (f"{name}_sum", cache): total,
    }
    for bound, count in zip(HISTOGRAM_BOUNDS, counts, strict=True):
        le = "+Inf" if bound == float("inf") else repr(bound)
        out[(f"{name}_bucket", (("cache_type", CACHE), ("le", le)))] = float(count)
    return out


def wait_saved(path: Path, ranks: dict[tuple[int, int], dict[str, float]]) -> None:
    """Until the state file holds these last values for each (tp, dp) (of the one epoch it keeps per rank)."""

    def holds() -> bool:
        state = saved(path)
        if state is None:
            return False
        values = saved_rank_values(state)
        return all(any((tp, dp) == key[:2] and all(got.get(f) == v for f, v in want.items())
                       for key, got in values.items()) for (tp, dp), want in ranks.items())

    wait_until(holds, WAIT)


def wait_saved_values(path: Path, ranks: dict[tuple[int, int], PushedRank]) -> None:
    """Until the state file holds every pushed rank's last values."""
    wait_saved(path, {k: {"load_back_tokens_total": r.current.tokens, "load_back_bytes_total": r.current.bytes,
                          HISTOGRAM: r.current.steps} for k, r in ranks.items()})


class Watch:
    """Checks every scrape of a restarted sidecar: each rollup present, never below its value before the
    kill, never below its value at the previous scrape."""

    def __init__(self, before: dict[Key, float]) -> None:
        assert before, "no rollups before the kill"
        self.floor = dict(before)
        self.scrapes = 0

    def check(self, text: str) -> dict[Key, float]:
        now = rollups(text)
        self.scrapes += 1
        missing = sorted(set(self.floor) - set(now))
        assert not missing, f"scrape {self.scrapes}: rollups absent: {missing}"
        lower = {key: (now[key], floor) for key, floor in self.floor.items() if now[key] < floor}
        assert not lower, f"scrape {self.scrapes}: rollups lower than before (now, floor): {lower}"
        self.floor.update(now)
        return now

    def until(self, sidecar: SidecarProcess, done: Callable[[str], bool]) -> str:
        """Scrape (checking each) until `done(text)`; the last text."""
        last: list[str] = []

        def settled() -> bool:
            text = sidecar.scrape()
            if text is None:
                return False
            self.check(text)
            last[:] = [text]
            return done(text)

        wait_until(settled, WAIT, interval=0.02)
        return last[0]


@dataclass
class Epoch:
    """One epoch of a pushing rank: its client and how many steps it has taken (each step moves its series by known amounts)."""

    client: RankClient
    children: tuple[CounterChild, CounterChild, HistogramChild]
    tokens_step: int
    bytes_step: int
    seconds: float  # one observation of this value per step (a power of two: sums stay exact)
    steps: int = 0
    # An epoch that ended while the sidecar was down counts as far as the sidecar's file holds it: its
    # tokens, bytes, observations and their sum there (what it moved after the last save is lost).
    kept: tuple[float, float, int, float] | None = None

    @property
    def tokens(self) -> float:
        return self.steps * self.tokens_step if self.kept is None else self.kept[0]

    @property
    def bytes(self) -> float:
        return self.steps * self.bytes_step if self.kept is None else self.kept[1]

    @property
    def observations(self) -> int:
        return self.steps if self.kept is None else self.kept[2]

    @property
    def seconds_sum(self) -> float:
        return self.steps * self.seconds if self.kept is None else self.kept[3]


@dataclass
class PushedRank:
    """One rank identity pushing over the real socket, across its epochs (a new client is a new epoch)."""

    socket_path: str
    tp: int
    dp: int
    epochs: list[Epoch] = field(default_factory=list)

    @property
    def current(self) -> Epoch:
        return self.epochs[-1]

    def begin(self, tokens_step: int, bytes_step: int, seconds: float) -> PushedRank:
        """Start a new epoch: a new client (a new epoch id), pushing from zero."""
        client = RankClient(self.socket_path, rank={"tp_rank": self.tp, "pp_rank": 0, "dp_rank": self.dp},
                            labels={"cache_type": CACHE}, interval=PUSH_INTERVAL, max_backoff=BACKOFF, preset=False)
        children = (client.counter("load_back_tokens_total", pool="kv"), client.counter("load_back_bytes_total"),
                    client.histogram(HISTOGRAM))
        epoch = Epoch(client, children, tokens_step, bytes_step, seconds)
        self.epochs.append(epoch)
        client.start()
        return self

    def step(self) -> None:
        epoch = self.current
        tokens, moved, took = epoch.children
        tokens.inc(epoch.tokens_step)
        moved.inc(epoch.bytes_step)
        took.observe(epoch.seconds)
        epoch.steps += 1

    def position(self, attr: str) -> float:
        """The series made continuous across epochs: the sum of every epoch's last value."""
        return float(sum(getattr(epoch, attr) for epoch in self.epochs))


def truth(ranks: Iterable[PushedRank]) -> dict[Key, float]:
    """Every rollup as it must read: per_shard (bytes, the histogram) the sum over ranks and epochs;
    replicated (tokens) per dp group the furthest replica, across its epochs, summed over groups."""
    ranks = list(ranks)
    groups = sorted({r.dp for r in ranks})
    cache = (("cache_type", CACHE),)
    out: dict[Key, float] = {
        ("sglang_rollup_load_back_tokens_total", (("cache_type", CACHE), ("pool", "kv"))):
            sum(max(r.position("tokens") for r in ranks if r.dp == g) for g in groups),
        ("sglang_rollup_load_back_bytes_total", cache): sum(r.position("bytes") for r in ranks),
    }
    epochs = [e for r in ranks for e in r.epochs]
    name = f"{ROLLUP}{HISTOGRAM}"
    out[(f"{name}_count", cache)] = float(sum(e.observations for e in epochs))
    out[(f"{name}_sum", cache)] = float(sum(e.seconds_sum for e in epochs))
    for bound in HISTOGRAM_BOUNDS:
        le = "+Inf" if bound == float("inf") else repr(bound)
        out[(f"{name}_bucket", (("cache_type", CACHE), ("le", le)))] = float(
            sum(e.observations for e in epochs if e.seconds <= bound))
    return out


def _bounds() -> tuple[float, ...]:
    from exporter.catalog import default_catalog

    bounds = default_catalog().get(HISTOGRAM).buckets
    assert bounds is not None
    return (*bounds, float("inf"))


HISTOGRAM_BOUNDS = _bounds()


class Load:
    """A thread stepping every rank of `ranks` while running; `pause()` returns once no step is under way."""

    def __init__(self, ranks: Sequence[PushedRank]) -> None:
        self.ranks = ranks
        self._running = threading.Event()
        self._stop = threading.Event()
        self._pass = threading.Lock()  # held for one pass over the ranks
        self._thread = threading.Thread(target=self._run, name="load", daemon=True)

    def start(self) -> Load:
        self._running.set()
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._running.wait(0.05):
                with self._pass:
                    if self._running.is_set():
                        for rank in self.ranks:
                            rank.step()
            self._stop.wait(0.01)  # the load's pace, not a wait for anything

    def pause(self) -> None:
        self._running.clear()
        with self._pass:
            pass

    def resume(self) -> None:
        self._running.set()

    def stop(self) -> None:
        self._stop.set()
        self._running.set()
        self._thread.join(WAIT)


def keep_saved(rank: PushedRank, state: SavedFile) -> None:
    """The rank's current epoch ends while the sidecar is down: it counts as far as the file holds it (its
    client is closed; the file's values are read per series, a push may have caught a step half made)."""
    rank.current.client.close()
    epoch = rank.current.client.epoch
    (saved_rank,) = [r for r in state.core.ranks if (r.tp_rank, r.dp_rank, r.epoch) == (rank.tp, rank.dp, epoch)]
    values = {value.family: value.value for value in saved_rank.values}
    tokens, moved, took = values["load_back_tokens_total"], values["load_back_bytes_total"], values[HISTOGRAM]
    assert isinstance(tokens, float) and isinstance(moved, float) and isinstance(took, HistValue)
    rank.current.kept = (tokens, moved, took.counts[-1], took.sum)


def close_all(ranks: Iterable[PushedRank]) -> None:
    for rank in ranks:
        for epoch in rank.epochs:
            epoch.client.close()

