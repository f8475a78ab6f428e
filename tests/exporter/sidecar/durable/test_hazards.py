"""The state file never lies (issue 30): two writers, a hung volume, planted links and FIFOs.

Each test fails on the code before the fix (docs/reliability.md, "The state file's threat model", has the
before and after of each). Real files, FIFOs and processes; waits are bounded polls, never timings.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from exporter.sidecar.durable import file as state_file
from exporter.sidecar.durable import keeper as keeper_module
from tests.exporter.sidecar.durable.restart_support import REPO, SidecarProcess
from tests.exporter.sidecar.durable.test_keeper import (  # noqa: F401  (start: the fixture)
    RANKS,
    TRUTH,
    Running,
    close_all,
    duration,
    push_ranks,
    start,
)
from tests.helpers import RawClient, counter, free_port, snapshot, wait_until

BOUND = 5.0  # how long a call may take before the test calls it stuck (every call here takes milliseconds)


def within(running: Running, make: Callable[[], Any], bound: float = BOUND) -> Any:
    """Await `make()` on the sidecar's loop; fails (TimeoutError) if it has not returned within `bound`."""

    async def call() -> Any:
        return await make()

    return asyncio.run_coroutine_threadsafe(call(), running.thread.loop).result(bound)


def push_on(running: Running, clients: list[RawClient], scale: float) -> None:
    """The same ranks push on to `scale` times their first values; returns once the ledger holds them."""
    for client, (moved, kv_tokens, observed) in zip(clients, RANKS.values(), strict=True):
        client.send(snapshot(int(scale * 10), counter("load_back_bytes_total", moved * scale),
                             counter("load_back_tokens_total", kv_tokens * scale, pool="kv"),
                             duration(int(observed * scale))))
    wait_until(lambda: running.live() == {name: value * scale for name, value in TRUTH.items()}, timeout=30)


# --- finding 8: one writer per file ---


def test_a_second_sidecar_on_the_same_file_refuses_to_start_naming_the_holder(
    socket_dir: Path, tmp_path: Path,
) -> None:
    """Before: the second sidecar started on the first one's file (and the one that wrote last won: 1,000,000
    read 6 after a restart). After: it exits at once with one line naming the file and the holder's pid and host."""
    path = tmp_path / "state"
    first = SidecarProcess(free_port(), str(socket_dir / "a.sock"), path, tmp_path / "a.log").start()
    try:
        first.wait_ready()
        assert first.proc is not None
        second = subprocess.run(
            [sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(free_port()),
             "--socket", str(socket_dir / "b.sock"), "--persistence.file", str(path)],
            cwd=REPO, capture_output=True, timeout=30)
        lines = second.stderr.decode().strip().splitlines()
        assert second.returncode == 2, lines
        assert lines == [
            f"hicache-exporter: error: state file {path} is in use by another sidecar (pid {first.proc.pid} on host "
            f"{socket.gethostname()}, holding {path}.lock): two sidecars on one file would overwrite each other's "
            "rollups; give each sidecar its own file"]
    finally:
        first.stop()
    assert first.proc.returncode == 0
    fd = state_file.take_lock(path)  # the holder let its lock go at its stop: the next one may start
    assert fd is not None
    os.close(fd)


def test_a_lock_held_in_this_process_is_refused_too_and_let_go_at_close(tmp_path: Path) -> None:
    path = tmp_path / "state"
    held = state_file.take_lock(path)
    assert held is not None
    with pytest.raises(Exception, match=f"pid {os.getpid()} on host"):
        state_file.take_lock(path)
    os.close(held)
    again = state_file.take_lock(path)
    assert again is not None and state_file.lock_path(path).read_text() == f"pid {os.getpid()} on host {socket.gethostname()}\n"
    os.close(again)


# --- finding 10: a hung write ---


def test_a_hung_write_is_a_counted_failure_rollups_stay_live_and_the_stop_does_not_wait(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: the save never returned (rollups frozen at the last write, write_failures_total 0 so
    HiCacheExporterStateNotSaved could never fire) and the stop waited 10 s. After: past its deadline the write
    is a `timeout`, every save while it stays stuck a `hung`, the rollups shown are each save's, and the stop
    gives up on it at once."""
    path = tmp_path / "state"
    entered, release = threading.Event(), threading.Event()
    writes: list[Path] = []

    def hung_write(at: Path, data: bytes) -> None:  # a stalled network volume: the write never returns
        writes.append(at)
        entered.set()
        release.wait(120)

    running = start(path)
    try:
        clients = push_ranks(running)
        monkeypatch.setattr(keeper_module, "write_atomic", hung_write)
        running.keeper.write_deadline = 0.05
        with caplog.at_level(logging.ERROR, "hicache_exporter.durable"):
            assert within(running, lambda: running.keeper.save()) is False
            assert entered.is_set()
            assert running.health.write_failures == {"timeout": 1}
            assert running.rollups() == TRUTH  # shown, though not durable
            push_on(running, clients, 3.0)
            assert within(running, lambda: running.keeper.save()) is False
            assert running.health.write_failures == {"timeout": 1, "hung": 1}
            assert running.rollups() == {name: 3 * value for name, value in TRUTH.items()}  # live, never frozen
            stopper = threading.Thread(target=running.thread.stop)
            stopper.start()
            stopper.join(BOUND)
            assert not stopper.is_alive(), "the stop waited for a hung write"
        assert running.health.write_failures == {"timeout": 1, "hung": 2}  # the save at stop could not be made
        assert len(writes) == 1  # one thread stuck in the disk, never a second beside it
        assert "timeout: the write did not finish within 0.05 s" in caplog.text
        assert "a write is still stuck in the disk; the save at stop is skipped" in caplog.text
        assert not path.exists()
        close_all(clients)
    finally:
        release.set()


def test_a_write_that_ends_after_its_deadline_counts_as_written_and_never_shows_older_rollups(
    start: Callable[..., Running], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
) -> None:
    path = tmp_path / "state"
    entered, release = threading.Event(), threading.Event()

    def slow_write(at: Path, data: bytes) -> None:
        entered.set()
        assert release.wait(60)
        state_file.write_atomic(at, data)

    running = start(path)
    clients = push_ranks(running)
    monkeypatch.setattr(keeper_module, "write_atomic", slow_write)
    running.keeper.write_deadline = 0.05
    assert within(running, lambda: running.keeper.save()) is False
    push_on(running, clients, 3.0)
    assert within(running, lambda: running.keeper.save()) is False  # hung: its rollups shown
    release.set()
    wait_until(lambda: running.health.writes == 1, timeout=30)
    assert running.health.write_failures == {"timeout": 1, "hung": 1}
    assert running.rollups() == {name: 3 * value for name, value in TRUTH.items()}  # not the late write's
    # The disk is back: what changed is written. Its deadline is the keeper's own again, not the 50 ms that
    # made the first writes late (a real write on a busy machine may take longer than that).
    running.keeper.write_deadline = keeper_module.write_deadline(running.keeper.interval)
    assert within(running, lambda: running.keeper.save()) is True
    close_all(clients)


# --- findings 10 and 13: what is planted at the temporary file's name ---


def old_temporary(path: Path) -> Path:
    """The one temporary name every write of this process used before: `.FILE.tmp-<pid>`."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


def test_a_symlink_planted_at_the_temporary_name_is_never_followed(tmp_path: Path) -> None:
    """Before: the write followed the link and overwrote its target (then renamed the link over the file).
    After: the victim is untouched, the file is written whole, the link is left where it was."""
    path, victim = tmp_path / "state", tmp_path / "victim"
    victim.write_bytes(b"precious")
    old_temporary(path).symlink_to(victim)
    state_file.write_atomic(path, b"state")
    assert victim.read_bytes() == b"precious"
    assert not path.is_symlink() and path.read_bytes() == b"state"
    assert old_temporary(path).is_symlink()


def test_a_fifo_planted_at_the_temporary_name_does_not_hang_the_write(tmp_path: Path) -> None:
    """Before: opening the FIFO to write blocked until a reader came, forever. After: the write goes on."""
    path = tmp_path / "state"
    os.mkfifo(old_temporary(path))
    done = threading.Event()

    def write() -> None:
        state_file.write_atomic(path, b"state")
        done.set()

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    writer.join(BOUND)
    if writer.is_alive():  # free the thread the old code left blocked
        with open(os.open(old_temporary(path), os.O_RDONLY | os.O_NONBLOCK), "rb"):
            writer.join(BOUND)
    assert done.is_set() and path.read_bytes() == b"state"


def test_each_write_has_a_temporary_name_of_its_own_and_the_lock_holder_removes_leftovers(tmp_path: Path) -> None:
    path = tmp_path / "state"
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: Any, dst: Any) -> None:
        seen.append(Path(src).name)
        real_replace(src, dst)

    os.replace = spy  # type: ignore[assignment]
    try:
        state_file.write_atomic(path, b"one")
        state_file.write_atomic(path, b"two")
    finally:
        os.replace = real_replace
    assert len(set(seen)) == 2 and all(name.startswith(f".state.tmp-{os.getpid()}-") for name in seen)
    leftover, link, other = path.with_name(".state.tmp-1-0-dead"), path.with_name(".state.tmp-9"), tmp_path / "keep"
    leftover.write_bytes(b"half")
    other.write_bytes(b"x")
    link.symlink_to(other)
    assert state_file.remove_temporaries(path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep", "state"] and other.read_bytes() == b"x"


# --- finding 12: loading is bounded by the limits ---


def test_a_file_of_millions_of_tiny_label_tuples_is_set_aside_before_it_is_decoded(tmp_path: Path) -> None:
    """Before: a valid 16.8 MB file of 5.6 million one-letter label tuples loaded, the process peaking at 406 MB
    (over the pod's 320 Mi) before anything was set aside. After: refused by what it announces (`over_limits`),
    set aside, the sidecar starts empty; the loading process peaks where it does with no file, plus the file
    read in (measured in a child process: VmHWM)."""
    from bench.state_load import TINY_TUPLES, label_sets_file, load_in_child

    path = tmp_path / "state"
    path.write_bytes(label_sets_file(TINY_TUPLES, b"\x91\xa1a"))
    size = path.stat().st_size
    assert size == 16_800_057
    idle, loaded = load_in_child(None), load_in_child(path)
    assert loaded["load_failures"] == {"over_limits": 1} and loaded["identities"] == 0 and loaded["series"] == 0
    assert not path.exists() and len(list(tmp_path.glob("state.corrupt-*"))) == 1
    assert loaded["peak_bytes"] - idle["peak_bytes"] < 3 * size  # the file read, its payload: nothing decoded
