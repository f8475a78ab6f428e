"""The state keeper (exporter.sidecar.durable.keeper) in a real in-process Sidecar: a real Unix socket, a real
aiohttp server on port 0, real files. Bad files never stop the sidecar; the state saved at stop is served
by the next sidecar on the same file before any rank is back.

Saves are driven by the test (keeper.save on the sidecar's loop, or the save at stop) with an interval of an
hour, so nothing depends on time; where the interval's own saving is under test, a short interval is used
only to wait for a condition (health.persistence.writes), never for a time.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest

from exporter.catalog import default_catalog
from exporter.config import PersistenceConfig, RanksConfig
from exporter.protocol.messages import HistogramSample, Welcome
from exporter.sidecar.core.health import PersistenceHealth
from exporter.sidecar.durable import keeper as keeper_module
from exporter.sidecar.durable.file import FORMAT_VERSION, HEADER, MAGIC, frame, unframe
from exporter.sidecar.durable.keeper import SavedFile, StateKeeper
from tests.exporter.sidecar.core.test_saved import rollups
from tests.exporter.sidecar.harness import Harness, bytes_, tokens
from tests.exporter.sidecar.upstream.test_feed import Engine, read, rollup
from tests.exporter.sidecar.upstream.test_saved import engine_restarted_before_the_save, four_ranks, url_feed
from tests.helpers import RawClient, SidecarThread, counter, hello, http_get, sidecar_config, snapshot, wait_until


def writing(keeper: StateKeeper) -> bool:
    """Whether a write's thread runs now (what the keeper's `_inflight` says; the package has no reader of it)."""
    return keeper._inflight is not None

T = TypeVar("T")
ROLLUPS = ("sglang_rollup_load_back_bytes_total", "sglang_rollup_load_back_tokens_total",
           "sglang_rollup_load_back_duration_seconds_count", "sglang_rollup_load_back_duration_seconds_sum")
# (dp, tp) -> (bytes, kv tokens, duration observations): two dp groups of skewed replicas.
RANKS = {(0, 0): (1000.0, 500.0, 3), (0, 1): (1100.0, 300.0, 2), (1, 0): (2000.0, 700.0, 4), (1, 1): (2100.0, 650.0, 1)}
TRUTH = {
    "sglang_rollup_load_back_bytes_total": 1000.0 + 1100 + 2000 + 2100,
    "sglang_rollup_load_back_tokens_total": 500.0 + 700,  # the furthest replica of each group
    "sglang_rollup_load_back_duration_seconds_count": 3.0 + 2 + 4 + 1,
    "sglang_rollup_load_back_duration_seconds_sum": 0.5 * (3 + 2 + 4 + 1),
}


def duration(observations: int) -> HistogramSample:
    """`observations` load-backs of 0.5 s each, in the catalog's layout."""
    bounds = default_catalog().get("load_back_duration_seconds").buckets or ()
    buckets: list[tuple[float | str, int]] = [(b, observations if b >= 0.5 else 0) for b in bounds]
    return HistogramSample(family="load_back_duration_seconds", labels={}, buckets=[*buckets, ("+Inf", observations)],
                           sum=0.5 * observations, count=observations)


class Running:
    """A SidecarThread with its keeper, and calls onto its loop."""

    def __init__(self, thread: SidecarThread) -> None:
        self.thread = thread

    @property
    def keeper(self) -> StateKeeper:
        assert self.thread.sidecar is not None and self.thread.sidecar.keeper is not None
        return self.thread.sidecar.keeper

    @property
    def health(self) -> PersistenceHealth:
        assert self.thread.sidecar is not None
        return self.thread.sidecar.health.persistence

    def run(self, make: Callable[[], Any]) -> Any:
        """Await the coroutine `make()` builds, on the sidecar's loop."""

        async def call() -> Any:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), self.thread.loop).result(60)

    def save(self, force: bool = False) -> bool:
        return bool(self.run(lambda: self.keeper.save(force)))

    def rollups(self) -> dict[str, float]:
        scrape = self.thread.scrape()
        return {name: scrape.value(name, **({"pool": "kv"} if "tokens" in name else {})) for name in ROLLUPS
                if scrape.find(name)}

    def live(self) -> dict[str, float]:
        """The ledger's rollups now, by exported name: /metrics shows them once a save wrote them."""

        def read() -> tuple[dict[Any, float], dict[Any, tuple[int, float]]]:
            assert self.thread.sidecar is not None
            ledger = self.thread.sidecar.state.ledger
            return ledger.counters, {key: (acc.counts[-1], acc.sum) for key, acc in ledger.histograms.items()}

        counters, histograms = self.thread.call(read)
        out = {f"sglang_rollup_{family}": value for (family, _, labels), value in counters.items()
               if labels in ((), ("kv",))}
        for (family, _, _), (count, total) in histograms.items():
            out[f"sglang_rollup_{family}_count"], out[f"sglang_rollup_{family}_sum"] = float(count), total
        return {name: value for name, value in out.items() if name in ROLLUPS}

    def serves(self) -> None:
        """Ready, and /metrics answers."""
        assert http_get(self.thread.url + "/-/ready")[0] == 200
        status, body, _ = http_get(self.thread.url + "/metrics")
        assert status == 200 and b"hicache_exporter_" in body


@pytest.fixture
def start(socket_dir: Path) -> Iterator[Callable[..., Running]]:
    """Start sidecars on `path` (stopped at the end of the test unless the test stopped them)."""
    started: list[SidecarThread] = []

    def start_one(path: Path, interval: str = "1h", **sections: dict[str, Any]) -> Running:
        config = sidecar_config(socket_dir / f"m{len(started)}.sock",
                                persistence={"file": str(path), "interval": interval}, **sections)
        thread = SidecarThread(config)
        started.append(thread)
        return Running(thread.start())

    yield start_one
    for thread in started:
        if thread.loop.is_running():
            thread.stop()


def push_ranks(running: Running, scale: float = 1.0, epoch: str = "e") -> list[RawClient]:
    """The four ranks push their values (times `scale`) and stay connected; returns once the ledger holds them
    (/metrics shows them after the next save)."""
    clients = []
    for (dp, tp), (moved, kv_tokens, observed) in RANKS.items():
        client = RawClient(running.thread.socket_path)
        client.send(hello(tp=tp, dp=dp, epoch=f"{epoch}-{dp}-{tp}", cache_type="UnifiedRadixCache"))
        assert isinstance(client.recv(), Welcome)
        client.send(snapshot(int(scale * 10), counter("load_back_bytes_total", moved * scale),
                             counter("load_back_tokens_total", kv_tokens * scale, pool="kv"),
                             duration(int(observed * scale))))
        clients.append(client)
    expected = {name: value * scale for name, value in TRUTH.items()}
    wait_until(lambda: running.live() == expected, timeout=30)
    return clients


def close_all(clients: list[RawClient]) -> None:
    for client in clients:
        client.close()


def good_file(start: Callable[..., Running], path: Path) -> bytes:
    """A state file as a sidecar writes it at stop, after the four ranks pushed."""
    first = start(path)
    clients = push_ranks(first)
    first.thread.stop()
    close_all(clients)
    return path.read_bytes()


def set_aside_files(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f"{path.name}.corrupt-*"))


# --- the state across a restart ---


def test_the_save_at_stop_is_served_by_the_next_sidecar_before_any_rank_is_back(
    start: Callable[..., Running], tmp_path: Path,
) -> None:
    path = tmp_path / "state"
    first = start(path)
    clients = push_ranks(first)
    assert not path.exists()  # an hour's interval: nothing written yet
    first.thread.stop()  # the SIGTERM path: Sidecar.stop, the keeper's save last
    close_all(clients)
    saved = msgspec.msgpack.decode(unframe(path.read_bytes()), type=SavedFile)
    assert saved.namespace == "sglang_" and len(saved.core.ranks) == 4
    second = start(path)
    second.serves()
    assert second.rollups() == TRUTH  # exact, before any rank reconnects
    assert second.health.loaded_identities == 4 and second.health.load_failures == {}
    assert second.health.file_bytes == path.stat().st_size
    statuses = second.thread.call(lambda: sorted(r.status.value for r in second.thread.sidecar.state.ranks.values()))  # type: ignore[union-attr]
    assert statuses == ["departed"] * 4
    # The ranks come back (the same epochs, values on): the rollups continue exactly.
    more = push_ranks(second, scale=2.0)
    assert second.rollups() == TRUTH  # shown as of the last save (the load) until the next save
    assert second.save() is True
    assert second.rollups() == {name: 2 * value for name, value in TRUTH.items()}
    close_all(more)


def test_a_stop_before_anything_changed_leaves_the_file_as_it_is(
    start: Callable[..., Running], tmp_path: Path,
) -> None:
    """A sidecar that loads the file and stops before any rank pushes (a start that fails on a socket
    another sidecar holds runs the same cleanup) does not write it again."""
    path = tmp_path / "state"
    written = good_file(start, path)
    again = start(path)
    again.serves()
    assert again.health.loaded_identities == 4
    again.thread.stop()
    assert path.read_bytes() == written and again.health.writes == 0


def test_nothing_is_written_when_nothing_changed(start: Callable[..., Running], tmp_path: Path) -> None:
    path = tmp_path / "state"
    running = start(path)
    clients = push_ranks(running)
    assert running.save() is True and running.health.writes == 1
    written = path.stat().st_mtime_ns, path.read_bytes()
    assert running.save() is False and running.health.writes == 1  # state.changes did not move
    assert (path.stat().st_mtime_ns, path.read_bytes()) == written
    clients[0].send(snapshot(11, counter("load_back_bytes_total", 1001.0)))
    wait_until(lambda: running.live()["sglang_rollup_load_back_bytes_total"] == TRUTH[ROLLUPS[0]] + 1)
    assert running.save() is True and running.health.writes == 2
    assert running.health.last_write_wall is not None and running.health.file_bytes == path.stat().st_size
    close_all(clients)


def test_the_interval_saves_what_changed(start: Callable[..., Running], tmp_path: Path) -> None:
    path = tmp_path / "state"
    running = start(path, interval="50ms")
    clients = push_ranks(running)
    wait_until(lambda: running.health.writes >= 1 and path.exists(), timeout=30)
    loaded = msgspec.msgpack.decode(unframe(path.read_bytes()), type=SavedFile)
    assert {(r.dp_rank, r.tp_rank) for r in loaded.core.ranks} == set(RANKS)
    close_all(clients)


# --- bad files: the sidecar serves, the file is kept aside, the failure counted ---


def _truncated(good: bytes) -> bytes:
    return good[:len(good) // 2]


def _header_only(good: bytes) -> bytes:
    return good[:HEADER.size - 3]


def _flipped(good: bytes) -> bytes:
    data = bytearray(good)
    data[len(data) // 2] ^= 0x40
    return bytes(data)


def _other_version(good: bytes) -> bytes:
    payload = unframe(good)
    return HEADER.pack(MAGIC, FORMAT_VERSION + 1, 0, len(payload)) + payload


def _undecodable(good: bytes) -> bytes:
    return frame(b"\x93\x01\x02")  # a whole frame whose payload is no SavedFile


@pytest.mark.parametrize("damage, reason", [
    (_truncated, "truncated"), (_header_only, "truncated"), (_flipped, "corrupt"), (_other_version, "version"),
    (_undecodable, "corrupt"),
])
def test_a_bad_file_is_kept_aside_counted_and_the_sidecar_starts_fresh(
    start: Callable[..., Running], tmp_path: Path, caplog: pytest.LogCaptureFixture,
    damage: Callable[[bytes], bytes], reason: str,
) -> None:
    path = tmp_path / "state"
    bad = damage(good_file(start, path))
    path.write_bytes(bad)
    with caplog.at_level(logging.ERROR, "hicache_exporter.durable"):
        running = start(path)
    running.serves()
    assert running.health.load_failures == {reason: 1} and running.health.loaded_identities == 0
    (aside,) = set_aside_files(path)
    assert aside.read_bytes() == bad and not path.exists()
    assert running.rollups() == {}  # fresh
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache_exporter.durable"]
    assert len(lines) == 1 and str(path) in lines[0] and f"({reason}: " in lines[0] and str(aside) in lines[0]
    # Serving goes on, and the next save writes a good file in its place.
    clients = push_ranks(running)
    assert running.save() is True and running.health.write_failures == {}
    assert msgspec.msgpack.decode(unframe(path.read_bytes()), type=SavedFile).core.ranks
    close_all(clients)


def test_a_directory_in_place_of_the_file_is_unreadable_kept_aside_and_replaced(
    start: Callable[..., Running], tmp_path: Path,
) -> None:
    path = tmp_path / "state"
    path.mkdir()
    (path / "inside").write_text("kept")
    running = start(path)
    running.serves()
    assert running.health.load_failures == {"unreadable": 1}
    (aside,) = set_aside_files(path)
    assert (aside / "inside").read_text() == "kept"
    clients = push_ranks(running)
    assert running.save() is True and path.is_file()
    close_all(clients)


def test_a_file_that_cannot_be_read_is_unreadable(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tests run as root (modes do not refuse): the open's OSError is injected, for this path only."""
    path = tmp_path / "state"
    good = good_file(start, path)
    real_open = os.open

    def refusing_open(at: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if Path(at) == path and not flags & (os.O_WRONLY | os.O_RDWR):
            raise PermissionError(errno.EACCES, "Permission denied", str(at))
        return real_open(at, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing_open)
    running = start(path)
    running.serves()
    assert running.health.load_failures == {"unreadable": 1} and running.rollups() == {}
    (aside,) = set_aside_files(path)
    assert aside.read_bytes() == good


def test_a_file_larger_than_the_budget_allows_is_too_large(start: Callable[..., Running], tmp_path: Path) -> None:
    path = tmp_path / "state"
    tight = {"max_series_total": 64}
    limit = keeper_module.max_file_bytes(RanksConfig(**tight), max(len(f.labels) for f in default_catalog()), 0)
    path.write_bytes(b"\x00" * (limit + 1))
    running = start(path, ranks=tight)
    assert running.keeper.max_bytes == limit
    running.serves()
    assert running.health.load_failures == {"too_large": 1}
    assert len(set_aside_files(path)) == 1


def test_a_changed_namespace_starts_over_and_keeps_no_file_aside(start: Callable[..., Running], tmp_path: Path) -> None:
    path = tmp_path / "state"
    good = good_file(start, path)
    cells = len(msgspec.msgpack.decode(unframe(good), type=SavedFile).core.cells)
    running = start(path, metrics={"namespace": "other_"})
    running.serves()
    assert running.health.load_failures == {} and running.health.dropped == {"namespace": cells}
    assert running.thread.scrape().find("other_rollup_load_back_bytes_total") == []  # started over
    assert set_aside_files(path) == [] and path.read_bytes() == good  # overwritten by the next save only


def test_a_changed_catalog_drops_the_unknown_and_restarts_the_changed_families(
    start: Callable[..., Running], tmp_path: Path,
) -> None:
    """The file is edited as a catalog change would leave it: bytes saved under a family the catalog no longer
    has, tokens saved as per_shard (the catalog says replicated)."""
    path = tmp_path / "state"
    saved = msgspec.msgpack.decode(unframe(good_file(start, path)), type=SavedFile)
    core = saved.core

    def renamed(family: str) -> str:
        return "retired_bytes_total" if family == "load_back_bytes_total" else family

    families = {renamed(name): f for name, f in core.families.items()}
    families["load_back_tokens_total"] = msgspec.structs.replace(families["load_back_tokens_total"], per_shard=True)
    core = msgspec.structs.replace(
        core, families=families,
        cells=[msgspec.structs.replace(c, family=renamed(c.family)) for c in core.cells],
        ranks=[msgspec.structs.replace(r, values=[msgspec.structs.replace(v, family=renamed(v.family)) for v in r.values])
               for r in core.ranks],
    )
    path.write_bytes(frame(msgspec.msgpack.encode(msgspec.structs.replace(saved, core=core))))
    running = start(path)
    running.serves()
    # bytes: one rollup series and four ranks' series; tokens: one rollup series and four ranks' series.
    assert running.health.dropped == {"unknown_family": 1 + 4, "changed_family": 1 + 4}
    assert running.health.load_failures == {} and set_aside_files(path) == []
    served = running.rollups()
    assert "sglang_rollup_load_back_bytes_total" not in served and "sglang_rollup_load_back_tokens_total" not in served
    assert served["sglang_rollup_load_back_duration_seconds_count"] == TRUTH[ROLLUPS[2]]  # the unchanged family continues


# --- writes that fail ---


def test_a_disk_that_fails_writes_is_counted_logged_once_and_serving_goes_on(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    path = tmp_path / "state"
    running = start(path)
    clients = push_ranks(running)
    full = threading.Event()
    full.set()
    real_write = keeper_module.write_atomic

    def write(at: Path, data: bytes) -> None:
        if full.is_set():
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(at, data)

    monkeypatch.setattr(keeper_module, "write_atomic", write)
    with caplog.at_level(logging.ERROR, "hicache_exporter.durable"):
        assert running.save(force=True) is False
        assert running.save(force=True) is False
    assert running.health.write_failures == {"no_space": 2} and running.health.writes == 0
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache_exporter.durable"]
    assert len(lines) == 1 and "no_space" in lines[0] and "serving goes on" in lines[0]  # once a minute at most
    running.serves()
    assert running.rollups() == TRUTH
    full.clear()
    assert running.save() is True and running.health.writes == 1  # the change not yet written is written now
    assert msgspec.msgpack.decode(unframe(path.read_bytes()), type=SavedFile).core.ranks
    close_all(clients)


def _tmpfs(directory: Path, size: str) -> bool:
    """Mount a tmpfs of `size` on `directory`; False where this machine does not let the test."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
                              capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def test_a_full_tmpfs_fails_the_write_and_the_next_write_succeeds_once_there_is_room(
    start: Callable[..., Running], tmp_path: Path,
) -> None:
    disk = tmp_path / "disk"
    disk.mkdir()
    if not _tmpfs(disk, "64k"):
        pytest.skip("cannot mount a tmpfs here (not root, or no CAP_SYS_ADMIN)")
    try:
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        try:  # fill the disk to its last byte
            with pytest.raises(OSError) as full:
                while True:
                    os.write(fd, b"\x00" * 512)
            assert full.value.errno == errno.ENOSPC
        finally:
            os.close(fd)
        path = disk / "state"
        running = start(path)
        clients = push_ranks(running)
        assert running.save() is False
        assert running.health.write_failures == {"no_space": 1}
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "state.lock"]  # no temporary file left behind
        running.serves()
        filler.unlink()
        assert running.save() is True and unframe(path.read_bytes())
        close_all(clients)
        running.thread.stop()
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True, timeout=30)


def test_a_save_cancelled_mid_write_keeps_the_next_save_waiting_for_it(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: a cancel (the stop cancels the interval's save) reset `_writing` while the thread still wrote,
    so the save at stop wrote the same temporary file at the same time."""
    path = tmp_path / "state"
    running = start(path)
    clients = push_ranks(running)
    entered, release = threading.Event(), threading.Event()
    writers: list[int] = []
    real_write = keeper_module.write_atomic

    def slow_write(at: Path, data: bytes) -> None:
        writers.append(threading.get_ident())
        entered.set()
        assert release.wait(60)
        real_write(at, data)

    monkeypatch.setattr(keeper_module, "write_atomic", slow_write)

    async def cancel_mid_write() -> bool:
        task = asyncio.create_task(running.keeper.save(force=True))
        while not entered.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return writing(running.keeper)

    assert running.run(cancel_mid_write) is True  # the write goes on in its thread
    assert running.save(force=True) is False  # a second write does not start beside it
    release.set()
    wait_until(lambda: not writing(running.keeper), timeout=30)
    assert len(writers) == 1 and path.exists()
    assert running.save(force=True) is True
    close_all(clients)


def test_a_sidecar_without_a_file_keeps_no_state(socket_dir: Path) -> None:
    thread = SidecarThread(sidecar_config(socket_dir / "m.sock")).start()
    try:
        assert thread.sidecar is not None and thread.sidecar.keeper is None
        assert thread.sidecar.health.persistence.enabled is False
    finally:
        thread.stop()



def test_a_write_stuck_in_the_disk_does_not_hold_the_stop(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
) -> None:
    """A write stuck in its thread holds the stop for STOP_WRITE_SECONDS at most, and no second write starts
    beside it (the stop's wait for the write in flight had no bound, once that write was waited for at all)."""
    path = tmp_path / "state"
    entered, release = threading.Event(), threading.Event()

    def stuck_write(at: Path, data: bytes) -> None:
        entered.set()
        release.wait(120)

    monkeypatch.setattr(keeper_module, "write_atomic", stuck_write)
    monkeypatch.setattr(keeper_module, "STOP_WRITE_SECONDS", 0.2)  # how long the stop waits for the disk
    running = start(path, interval="50ms")
    clients = push_ranks(running)  # something to save: the interval's first save gets stuck
    try:
        assert entered.wait(60)
        with caplog.at_level(logging.ERROR, "hicache_exporter.durable"):
            running.thread.stop()  # returns, with the write still stuck
        assert "a write is still stuck in the disk; the save at stop is skipped" in caplog.text
        assert not path.exists()
    finally:
        release.set()
        close_all(clients)


# --- the keeper over a state and an upstream feed (fake clocks, no server) ---


def feed_keeper(h: Any, up: Any, path: Path) -> StateKeeper:
    return StateKeeper(PersistenceConfig(file=path, interval="1h"), h.state, {up.health.name: up}, PersistenceHealth(),
                       "sglang_")


def test_an_upstream_feeds_state_goes_through_the_file(tmp_path: Path) -> None:
    path = tmp_path / "state"
    h, up, engine = engine_restarted_before_the_save()
    assert asyncio.run(feed_keeper(h, up, path).save()) is True
    again = Harness()
    new_up = url_feed(again)
    keeper = feed_keeper(again, new_up, path)
    keeper.load()
    assert keeper.health.loaded_identities == 4 and keeper.health.load_failures == {}
    assert rollups(again) == rollups(h)
    assert {i: e.epoch for i, e in new_up.ranks.items()} == {i: e.epoch for i, e in up.ranks.items()}
    four_ranks(engine, scale=0.125)
    for feed in (up, new_up):
        assert feed.apply(read(engine.text())).resets == 0
    assert rollups(again) == rollups(h)


def test_an_upstream_state_that_cannot_be_taken_back_sets_the_whole_file_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before: the feed alone started afresh while the registry kept its ranks in the epochs the feed had named
    them; the fresh feed's hellos (epoch generation 0, one those ranks had replaced) were refused as stale_epoch
    for as long as the sidecar ran, and the upstream's ranks never came back."""
    path = tmp_path / "state"
    h, up, _ = engine_restarted_before_the_save()
    assert asyncio.run(feed_keeper(h, up, path).save()) is True
    good = path.read_bytes()

    def cannot(*_: object) -> int:
        raise ValueError("a feed state no feed can hold")

    monkeypatch.setattr(keeper_module.feed_saved, "restore", cannot)
    again = Harness()
    new_up = url_feed(again)
    keeper = feed_keeper(again, new_up, path)
    keeper.load()
    assert keeper.health.load_failures == {"corrupt": 1} and keeper.health.loaded_identities == 0
    assert (again.state.ranks, again.state.ledger.counters, new_up.ranks) == ({}, {}, {})
    (aside,) = set_aside_files(path)
    assert aside.read_bytes() == good
    engine = Engine()  # the upstream's ranks come back, fresh
    four_ranks(engine)
    result = new_up.apply(read(engine.text()))
    assert new_up.health.errors == {} and result.ranks == 4
    assert rollup(again, "load_back_bytes_total") == 1000 + 1001 + 2000 + 2001


def long_labelled_state(h: Any) -> None:
    """Two replicas of one group, eight static labels and thirty pools, every value 4096 characters long."""
    static = {f"s{i}": chr(ord("a") + i) * 4096 for i in range(8)}
    for tp in (0, 1):
        _, rank = h.hello(tp=tp, labels=static)
        h.push(rank, *[tokens(float(i + tp), pool=f"{i:02d}" + "p" * 4094) for i in range(30)])


def test_a_file_of_long_label_values_loads_back(tmp_path: Path) -> None:
    """Label values at 4,096 characters: the file loads back, and holds each label set once. (Once, the
    file wrote labels in every place they appear, 2.8 MB for these 90 series, and the bound counted
    1,024 bytes a series whatever its labels: the next start refused it as too_large.) The series weigh
    their labels (keys.series_cost): 145 units each and 73 a rollup, 10,890 together, which the limits hold
    (with the room each new series asks for its rollup)."""
    limits = RanksConfig(max_label_value_length=4096, max_family_label_value_length=4096, max_static_label_chars=32768,
                         max_series_total=16_384, max_series_per_rank=8192)
    path = tmp_path / "state"
    h = Harness(ranks_config=limits)
    long_labelled_state(h)
    up_none: dict[str, Any] = {}
    first = StateKeeper(PersistenceConfig(file=path), h.state, up_none, PersistenceHealth(), "sglang_")
    assert asyncio.run(first.save()) is True
    assert path.stat().st_size < 300_000  # each label set once: 164 kB
    again = Harness(ranks_config=limits)
    second = StateKeeper(PersistenceConfig(file=path), again.state, up_none, PersistenceHealth(), "sglang_")
    second.load()
    assert second.health.load_failures == {} and second.health.loaded_identities == 2
    assert rollups(again) == rollups(h) and len(rollups(again)[0]) == 30
    assert (h.state.registry.budget.per_rank, h.state.registry.budget.rollup) == (2 * 30 * 145, 30 * 73)
    assert again.state.registry.budget == h.state.registry.budget  # the load weighs them as the pushes did


def test_a_state_larger_than_a_load_reads_is_not_written_and_the_last_file_stays(tmp_path: Path) -> None:
    path = tmp_path / "state"
    h = Harness()
    _, rank = h.hello()
    h.push(rank, bytes_(5.0))
    keeper = StateKeeper(PersistenceConfig(file=path), h.state, {}, PersistenceHealth(), "sglang_")
    assert asyncio.run(keeper.save()) is True
    written = path.read_bytes()
    h.push(rank, bytes_(6.0))
    keeper.max_bytes = len(written) - 1  # as if the state had grown past what a load reads
    assert asyncio.run(keeper.save()) is False
    assert keeper.health.write_failures == {"too_large": 1} and keeper.health.writes == 1
    assert path.read_bytes() == written


def test_a_sidecar_started_with_a_changed_catalog_drops_and_restarts_those_families(
    start: Callable[..., Running], tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    """The file written under the packaged catalog, loaded under one without load_back_bytes_total and with
    load_back_tokens_total per_shard (it was replicated)."""
    import yaml

    from exporter.defaults import default_path

    path = tmp_path / "state"
    good_file(start, path)
    catalog = yaml.safe_load(default_path("catalog.yaml").read_text())
    families = [f for f in catalog["families"] if f["name"] != "load_back_bytes_total"]
    for family in families:
        if family["name"] == "load_back_tokens_total":
            family["semantics"] = "per_shard"
    catalog["families"] = families
    changed = tmp_path / "catalog.yaml"
    changed.write_text(yaml.safe_dump(catalog))
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        running = start(path, metrics={"catalog": str(changed)})
    running.serves()
    assert running.health.dropped == {"unknown_family": 1 + 4, "changed_family": 1 + 4}
    assert running.health.load_failures == {} and running.health.loaded_identities == 4
    served = running.rollups()
    assert served == {"sglang_rollup_load_back_duration_seconds_count": TRUTH[ROLLUPS[2]],
                      "sglang_rollup_load_back_duration_seconds_sum": TRUTH[ROLLUPS[3]]}
    lines = [r.getMessage() for r in caplog.records if r.name == "hicache_exporter.durable"]
    assert any("family load_back_tokens_total changed its type, semantics or labels" in line for line in lines)
    assert any("no longer in the catalog" in line and "load_back_bytes_total" in line for line in lines)
