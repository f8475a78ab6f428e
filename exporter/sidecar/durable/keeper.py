"""The state keeper: loads the durable state at start, saves it at an interval and once more at stop.

The state is dumped and encoded on the event loop (a consistent instant: nothing runs between two
statements there) and written in a thread of its own, so a slow disk never holds the loop. A file
that cannot be used, and a directory that cannot be written, never stop the sidecar: each is logged,
counted (hicache_exporter_persistence_*), and serving goes on. Another sidecar on the same file does:
one process writes a file (file.take_lock).

One rule for what /metrics shows: each save's rollups, once that save is over: written, failed, or past
its deadline (`write_deadline`). Rollups never freeze whatever the disk does; what is not durable is
counted (write_failures_total{reason}) and alerted on (HiCacheExporterStateNotSaved).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import math
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec

from exporter.config import PersistenceConfig, RanksConfig
from exporter.errors import StateFileError
from exporter.sidecar.core import saved as core_saved
from exporter.sidecar.core.health import PersistenceHealth
from exporter.sidecar.core.state import Rollups, SidecarState
from exporter.sidecar.durable.file import (
    count_items,
    frame,
    lock_path,
    read_file,
    release_lock,
    remove_temporaries,
    set_aside,
    take_lock,
    unframe,
    write_atomic,
    write_failure_reason,
)
from exporter.sidecar.upstream import saved as feed_saved
from exporter.sidecar.upstream.continuity import SAVED_NAME_CHARS
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.worker import WorkerThread

log = logging.getLogger("hicache_exporter.durable")
# A file may hold this many bytes per unit of the series budget (ranks.max_series_total), once for the
# ranks and rollups and once per upstream, plus a fixed part: above what a series takes (a 1,024-bucket
# histogram's bounds, written with its rank value, position, watermark and cell: 290 B per unit), so that a
# whole file always loads, and low enough that the worst file the limits allow loads within the pod's memory
# limit (docs/reliability.md, "Durable state"; `python -m bench.state_load`). Label values come on top, as
# long as the limits let them be (`max_file_bytes`): each label set is written once (SavedCore.label_sets,
# .statics); an upstream's series carry their own labels (and a flapping one its cut name), its ranks their
# static labels once each.
MAX_BYTES_PER_SERIES = 384
LABEL_NAME_BYTES = 64  # allowed per label for its name and encoding, beside its value
MAX_BYTES_FIXED = 1 << 20
# What a decode builds is one object per MessagePack value: a file may hold this many per unit of the series
# budget (a 1,024-bucket histogram: 64 in its four places; labels at their limits: 10), per rank identity
# (its identity, static labels, a forgotten one's), and a fixed part, counted before anything is decoded
# (file.count_items): 5.6 million tiny label tuples in a 16.8 MB file took the load to 406 MB.
MAX_ITEMS_PER_SERIES = 80
MAX_ITEMS_PER_RANK = 128
MAX_ITEMS_FIXED = 1 << 16
LOG_EVERY_SECONDS = 60.0  # a directory that cannot be written is logged at most this often
# A write that has not finished this long after it started is a failure (`timeout`): its rollups are shown,
# and while it stays stuck in its thread no other write starts; each save meanwhile is a failure (`hung`).
WRITE_DEADLINE_MIN_SECONDS = 10.0
WRITE_DEADLINE_MAX_SECONDS = 60.0
# The stop waits at most this long for the disk in all: for a write in flight, then for the save at stop.
STOP_WRITE_SECONDS = 5.0


def write_deadline(interval: float) -> float:
    """How long a write may take: the interval (a write per interval keeps up), within 10 s and 60 s."""
    return min(max(interval, WRITE_DEADLINE_MIN_SECONDS), WRITE_DEADLINE_MAX_SECONDS)


@dataclass
class _Write:
    """One write in its thread: what it holds, and when it is overdue."""

    future: asyncio.Future[float]
    changes: int  # state.changes it holds
    encoded: float  # seconds its encoding took
    size: int
    shown: Rollups  # its rollups, shown once it is over
    order: int  # the save it was: rollups of an older save are never shown over a newer one's
    deadline: float  # time.monotonic() past which it is overdue
    deadline_seconds: float  # how long it was given
    over: bool = False  # counted as a failure (timeout) and its rollups shown while it still runs


class SavedFile(msgspec.Struct, array_like=True, frozen=True):
    """The whole file's payload: when and under which namespace it was written, the core's and the upstreams' state."""

    saved_at: float
    namespace: str
    core: core_saved.SavedCore
    upstreams: dict[str, feed_saved.SavedFeed]
    # Each upstream source -> what it read (UpstreamFeed.physical): its state follows that, not its name.
    sources: dict[str, str] = {}


def max_file_bytes(limits: RanksConfig, family_labels: int, upstreams: int) -> int:
    """The largest file a sidecar of these limits loads (and writes): `family_labels` is the most labels a
    family of its catalog has.

    Before label values were counted, a sidecar whose ranks used long label values (max_label_value_length
    allows 4096) wrote files its next start refused as too_large, and set aside."""
    static = limits.max_label_value_length + LABEL_NAME_BYTES
    own = limits.max_family_label_value_length + LABEL_NAME_BYTES
    core_series = MAX_BYTES_PER_SERIES + family_labels * own
    statics = min(limits.max_static_labels * static,
                  limits.max_static_label_chars + limits.max_static_labels * LABEL_NAME_BYTES)  # one rank's
    core_rank = 3 * statics  # its static labels, a forgotten one's, its group's
    # A series' own labels, as names and values; its name for log lines only while it flaps (cut: SAVED_NAME_CHARS).
    upstream_series = MAX_BYTES_PER_SERIES + 2 * family_labels * own + SAVED_NAME_CHARS
    upstream_rank = 2 * statics  # its static labels, and a forgotten one's
    return (MAX_BYTES_FIXED + core_series * limits.max_series_total + core_rank * limits.max_ranks
            + (upstream_series * limits.max_series_total + upstream_rank * limits.max_ranks) * upstreams)


def max_file_items(limits: RanksConfig, upstreams: int) -> int:
    """The most MessagePack values a file of a sidecar of these limits holds: what a load decodes at most."""
    per_source = MAX_ITEMS_PER_SERIES * limits.max_series_total + MAX_ITEMS_PER_RANK * limits.max_ranks
    return MAX_ITEMS_FIXED + per_source * (1 + upstreams)


class StateKeeper:
    """Loads and saves one sidecar's durable state (its registry, ledger and upstream feeds) in one file."""

    def __init__(
        self, config: PersistenceConfig, state: SidecarState, feeds: Mapping[str, UpstreamFeed],
        health: PersistenceHealth, namespace: str,
    ) -> None:
        assert config.file is not None
        self.path: Path = config.file
        self.interval = config.interval_seconds
        self.state = state
        self.feeds = dict(feeds)
        self.health = health
        self.namespace = namespace
        self.max_bytes = max_file_bytes(state.config, max((len(f.labels) for f in state.catalog), default=0),
                                        len(self.feeds))
        self.max_items = max_file_items(state.config, len(self.feeds))
        self.write_deadline = write_deadline(self.interval)
        self._saved_changes: int | None = None  # state.changes as of the last write
        self._inflight: _Write | None = None  # the write whose thread runs now
        self._saves = 0  # saves that showed rollups, in order
        self._shown_order = 0  # the save whose rollups are shown
        self._lock: int | None = None  # the lock file's descriptor while this keeper runs
        self._failure_logged = -LOG_EVERY_SECONDS
        # Writes run here, one at a time: a disk stuck in fsync holds up neither the loop nor an exit.
        self._thread = WorkerThread("hicache-state-write")
        health.enabled = True

    # --- load ---

    def load(self) -> None:
        """Take the file's state back into the (empty) state and feeds; a file that cannot be used is set aside.
        The rollups shown from here on are the loaded ones (none on a fresh start), then each save's."""
        self._load()
        self.state.show_rollups(self.state.rollup_snapshot())
        # The file holds this state (or there is none to hold yet): a stop before anything changes, such
        # as a start that fails on a socket another sidecar holds, leaves the file as it is.
        self._saved_changes = self.state.changes

    def _load(self) -> None:
        started = time.perf_counter()
        try:
            data = read_file(self.path, self.max_bytes)
            if data is None:
                log.info("state file %s does not exist yet: starting fresh; it is written every %g s",
                         self.path, self.interval)
                return
            payload = unframe(data)
            count_items(payload, self.max_items)  # before anything is built: a decode's memory is bounded
            try:
                saved = msgspec.msgpack.decode(payload, type=SavedFile)
            except (msgspec.DecodeError, msgspec.ValidationError) as err:
                raise StateFileError("corrupt", f"its contents do not decode: {err}") from None
            del payload
        except StateFileError as err:
            self._set_aside(err)
            return
        if saved.namespace != self.namespace:
            log.warning("state file %s was written under metrics.namespace %r, this sidecar uses %r: its rollups are "
                        "other series to Prometheus, so they start over", self.path, saved.namespace, self.namespace)
            self.health.count(self.health.dropped, "namespace", len(saved.core.cells))
            return
        scratch = self.state.fresh()  # taken whole or not at all: a failure leaves the state empty
        try:
            core, upstreams, relocation = feed_saved.relocate(saved.core, saved.upstreams, saved.sources,
                                                              self.feeds.values())
            restored = core_saved.restore(scratch, core)
        except Exception as err:  # a file that decodes but holds what no state can (a bug, or a hand-edited file)
            self._set_aside(StateFileError("corrupt", f"its contents cannot be taken back: {type(err).__name__}: {err}"))
            return
        self.state.adopt(scratch)
        identities = restored.identities
        relocation.log(self.path)
        for name, feed in self.feeds.items():
            feed_state = upstreams.get(name)
            if feed_state is not None:
                try:
                    feed_saved.restore(feed, feed_state)
                except Exception as err:
                    # All or nothing: the registry took back this upstream's identities in the epochs the feed
                    # named them; a feed that forgot them would say hello with an epoch they replaced, and
                    # be refused (stale_epoch) for as long as the sidecar runs.
                    self._start_fresh()
                    self._set_aside(StateFileError(
                        "corrupt", f"upstream {name}'s state cannot be taken back: {type(err).__name__}: {err}"))
                    return
        for count in relocation.collided.values():
            self.health.count(self.health.dropped, "world_changed", count)
        for reason, count in restored.dropped.items():
            self.health.count(self.health.dropped, reason, count)
        health = self.health
        health.loaded_identities = identities
        health.file_bytes = len(data)
        health.load_duration = time.perf_counter() - started
        age = max(0.0, self.state.wall_time() - saved.saved_at) if math.isfinite(saved.saved_at) else math.nan
        log.info("state file %s: took back %d rank identities and %d rollup series, written %.1f s ago, in %.0f ms",
                 self.path, identities, restored.cells, age, health.load_duration * 1000)

    def _start_fresh(self) -> None:
        """Forget what a load took back: an empty state, feeds that have read nothing."""
        self.state.adopt(self.state.fresh())
        for feed in self.feeds.values():
            feed_saved.forget(feed)

    def _set_aside(self, err: StateFileError) -> None:
        self.health.count(self.health.load_failures, err.reason)
        try:
            aside = f"kept aside as {set_aside(self.path)}"
        except OSError as move:
            aside = f"and cannot be kept aside ({move.strerror or move})"
        log.error("state file %s cannot be used (%s: %s); %s; starting fresh", self.path, err.reason, err.message, aside)

    # --- save ---

    def encode(self) -> bytes:
        """The file's bytes for the state as it is now (on the event loop: a consistent instant)."""
        payload = msgspec.msgpack.encode((
            self.state.wall_time(), self.namespace, core_saved.dump(self.state),
            {name: feed_saved.dump(feed) for name, feed in self.feeds.items()},
            {feed.source: feed.physical for feed in self.feeds.values()},
        ))
        return frame(payload)

    async def save(self, force: bool = False, deadline: float | None = None) -> bool:
        """Write the state if it changed since the last write (or `force`); whether a write succeeded within
        `deadline` seconds (`write_deadline` by default). A write still running within its deadline makes
        this one skip (the next tick writes what is newer); one past it makes this one a failure (`hung`).

        The write is accounted for when its thread ends, not when this call returns: a cancel (the stop
        cancels the interval's save) or a deadline leaves the thread writing, and no other write starts
        beside it until it ended: at most one thread is ever stuck in the disk."""
        changes = self.state.changes
        if not force and changes == self._saved_changes:
            return False
        inflight = self._inflight
        if inflight is not None:
            if time.monotonic() < inflight.deadline:
                return False
            self._overdue(inflight)
            self._write_failed(OSError(errno.ETIMEDOUT, "the write before is still stuck in the disk past its deadline, "
                                                        "so no write starts beside it"), "hung")
            self._show(self._next_order(), self.state.rollup_snapshot())  # not durable, but never frozen
            return False
        started = time.perf_counter()
        data = self.encode()
        shown = self.state.rollup_snapshot()  # the same instant as the bytes: shown once the write is over
        encoded = time.perf_counter() - started
        order = self._next_order()
        if len(data) > self.max_bytes:  # the next start would refuse it and set it aside: keep the last one
            self._write_failed(OSError(errno.EFBIG, f"{len(data)} bytes, more than the {self.max_bytes} a load "
                                                    "reads (ranks.max_series_total and the label limits)"), "too_large")
            self._show(order, shown)  # not durable now, but never frozen: serving goes on
            return False
        limit = self.write_deadline if deadline is None else deadline
        future = asyncio.wrap_future(self._thread.submit(lambda: _timed_write(self.path, data)))
        write = self._inflight = _Write(future, changes, encoded, len(data), shown, order, time.monotonic() + limit, limit)
        future.add_done_callback(lambda _: self._written(write))
        await asyncio.wait({future}, timeout=limit)  # a cancel of this call leaves the write running
        if not future.done():
            self._overdue(write)
            return False
        return not future.cancelled() and future.exception() is None

    def _next_order(self) -> int:
        self._saves += 1
        return self._saves

    def _show(self, order: int, rollups: Rollups) -> None:
        """Show a save's rollups, unless a later save's are shown already (a late write's never go back)."""
        if order > self._shown_order:
            self._shown_order = order
            self.state.show_rollups(rollups)

    def _overdue(self, write: _Write) -> None:
        """A write past its deadline: a failure (`timeout`), and its rollups shown; its thread runs on."""
        if write.over:
            return
        write.over = True
        self._write_failed(OSError(errno.ETIMEDOUT, f"the write did not finish within {write.deadline_seconds:g} s "
                                                    "(a stalled volume?); no other write starts until it does"),
                           "timeout")
        self._show(write.order, write.shown)

    def _written(self, write: _Write) -> None:
        """A write's thread ended: count it, as a write or a failure (unless its deadline counted it already),
        and show the rollups it saved (after a failure too: the rollups are then not durable, counted and
        logged, but never frozen)."""
        if self._inflight is write:
            self._inflight = None
        self._show(write.order, write.shown)
        done = write.future
        err = None if done.cancelled() else done.exception()
        if err is not None or done.cancelled():
            if write.over:  # counted as a timeout already
                return
            if isinstance(err, OSError):
                self._write_failed(err)
            else:
                log.error("state file %s: saving failed (%s)", self.path, err or "cancelled")
            return
        health = self.health
        health.writes += 1
        health.last_write_wall = self.state.wall_time()
        health.last_write_duration = write.encoded + done.result()
        health.file_bytes = write.size
        self._saved_changes = write.changes

    def _write_failed(self, err: OSError, reason: str | None = None) -> None:
        reason = reason or write_failure_reason(err)
        self.health.count(self.health.write_failures, reason)
        now = time.monotonic()
        if now - self._failure_logged >= LOG_EVERY_SECONDS:
            self._failure_logged = now
            log.error("state file %s cannot be written (%s: %s); serving goes on, the rollups are not durable until "
                      "it can (logged at most once a minute; hicache_exporter_persistence_write_failures_total counts)",
                      self.path, reason, err.strerror or err)

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.save()
            except Exception:  # never let one bad save end the saving
                log.exception("state file %s: saving failed", self.path)

    def running(self, _app: object) -> AsyncIterator[None]:
        """The keeper as a cleanup context of the app: load before the sources start, save after they stop."""
        return self._running()

    async def _running(self) -> AsyncIterator[None]:
        self._take_lock()
        try:
            self.load()
            task = asyncio.create_task(self._every_interval(), name="hicache-state-saver")
            try:
                yield
            finally:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                await self._save_at_stop()
                self._thread.shutdown()
        finally:
            if self._lock is not None and self._inflight is None:  # a write still stuck keeps it until the exit
                release_lock(self._lock)
                self._lock = None

    def _take_lock(self) -> None:
        """Lock the file for this process before it is read (StateFileLocked: another one holds it), and
        remove the temporary files a crashed writer left."""
        try:
            self._lock = take_lock(self.path)
        except OSError as err:
            log.error("state file %s: cannot lock %s (%s); going on without the lock: make sure no other sidecar "
                      "uses this file", self.path, lock_path(self.path), err.strerror or err)
            return
        if self._lock is None:
            log.error("state file %s: cannot create or open its lock file %s; going on without the lock: make sure "
                      "no other sidecar uses this file", self.path, lock_path(self.path))
            return
        removed = remove_temporaries(self.path)
        if removed:
            log.info("state file %s: removed %d temporary files an earlier writer left", self.path, removed)

    async def _save_at_stop(self) -> None:
        """Wait for a write in flight within its deadline, then save what is newer; STOP_WRITE_SECONDS in all."""
        stop_by = time.monotonic() + STOP_WRITE_SECONDS
        inflight = self._inflight
        if inflight is not None:  # a write the cancel caught mid-flight finishes in its thread
            wait = min(inflight.deadline, stop_by) - time.monotonic()
            if wait > 0:
                await asyncio.wait({inflight.future}, timeout=wait)
            if self._inflight is not None:  # a disk stuck in it: stopping waits no longer
                self._overdue(inflight)
                self.health.count(self.health.write_failures, "hung")
                log.error("state file %s: a write is still stuck in the disk; the save at stop is skipped (the file "
                          "keeps the last write that finished)", self.path)
                return
        left = stop_by - time.monotonic()
        try:
            await self.save(deadline=max(0.0, min(self.write_deadline, left)))
        except Exception as err:
            log.error("state file %s: the save at stop did not finish (%s)", self.path, err or type(err).__name__)
        if self._inflight is not None:
            log.error("state file %s: the save at stop did not finish within %.3g s; the file keeps the last write "
                      "that finished", self.path, max(0.0, left))


def _timed_write(path: Path, data: bytes) -> float:
    started = time.perf_counter()
    write_atomic(path, data)
    return time.perf_counter() - started
