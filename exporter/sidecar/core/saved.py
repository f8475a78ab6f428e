"""The core's durable state: what the rank registry and the rollup ledger must remember across a restart of
the sidecar, as plain data to encode (`dump`) and, decoded into the typed records here, to take back (`restore`).

Saved is only what continuity needs (README, "Durable rollups"): per identity its epoch, lifecycle, last
cumulative values (counters and histograms), positions and bucket positions; per replica group the
watermarks; the rollup cells with their start times; layout-conflict counts; the identities each source
forgot. Nothing that is rebuilt (routes, caches, window history, gauges) is. No I/O here: the file is
the durable layer's (exporter/sidecar/durable).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Annotated, Any

import msgspec

from exporter.catalog import Catalog, MetricType
from exporter.labels import MAX_RANK_AXIS
from exporter.protocol.messages import World
from exporter.sidecar.core.history import WindowHistory
from exporter.sidecar.core.keys import (
    HistAccumulator,
    HistValue,
    RollupCounter,
    SeriesKey,
    label_size,
    line_chars,
    make_rollup_key,
    scalar_lines,
    series_cost,
)
from exporter.sidecar.core.ranks import WINDOW_HISTORY_ENTRIES, RankIdentity, RankState, rank_identity
from exporter.sidecar.core.state import SidecarState

log = logging.getLogger("hicache_exporter.durable")

# The file is input: a value outside these is refused at load (`invalid`), whatever its checksum says.
# Saved values are sums of increases over every epoch and rank (one pushed value is at most 2**63, a count
# 2**53): 2**80 (1.2e24) is far above what a counter reaches (1 TB/s for 38,000 years) and refuses 1e300.
MAX_SAVED_VALUE = 2.0**80
MAX_SAVED_TIME = 2.0**35  # a wall-clock time (unix seconds) after the year 3000 is not one this sidecar wrote

Pairs = tuple[tuple[str, str], ...]
Index = Annotated[int, msgspec.Meta(ge=0)]  # a place in SavedCore.statics or .label_sets


class SavedValue(msgspec.Struct, array_like=True, frozen=True):
    """One counter's or histogram's last cumulative value in its rank's epoch."""

    family: str
    labels: Index
    value: float | HistValue


class SavedPosition(msgspec.Struct, array_like=True, frozen=True):
    """One series' position: its values made continuous across the rank's epochs."""

    family: str
    labels: Index
    position: float


class SavedBuckets(msgspec.Struct, array_like=True, frozen=True):
    """A replicated histogram's position by bucket, with its layout and sum."""

    family: str
    labels: Index
    bounds: tuple[float | str, ...]
    counts: list[int]
    sum: float


class SavedRank(msgspec.Struct, array_like=True, frozen=True):
    """One rank identity across its epochs."""

    source: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    attn_cp_rank: int | None
    static: Index
    epoch: str
    pid: int
    seq: int
    expired: bool
    resumed: bool
    restarts: int
    reconnects: int
    snapshots: int
    epoch_conflicts: int
    last_push_wall: float | None
    replaced_epochs: tuple[str, ...]
    values: list[SavedValue]
    positions: list[SavedPosition]
    buckets: list[SavedBuckets]
    world: World | None = None  # the server's world it said hello with: what it expects survives a restart


class SavedCell(msgspec.Struct, array_like=True, frozen=True):
    """One rollup series: its value (a counter's, or a histogram's buckets and sum) and start time."""

    family: str
    shared: Index
    labels: Index
    created: float
    value: float | HistValue


class SavedMark(msgspec.Struct, array_like=True, frozen=True):
    """One replica group's watermark of one replicated series."""

    dp_rank: int
    shared: Index
    family: str
    labels: Index
    value: float | HistValue


class SavedForgotten(msgspec.Struct, array_like=True, frozen=True):
    """An identity a source's registry forgot (to make room), with the epoch it had."""

    source: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    attn_cp_rank: int
    static: Index
    epoch: str


class SavedFamily(msgspec.Struct, array_like=True, frozen=True):
    """What a family was when saved: a family whose type, semantics or labels changed starts over."""

    type: str
    per_shard: bool
    labels: tuple[str, ...]


class SavedCore(msgspec.Struct, array_like=True, frozen=True):
    """The registry's and ledger's durable state."""

    families: dict[str, SavedFamily]
    ranks: list[SavedRank]
    cells: list[SavedCell]
    marks: list[SavedMark]
    layout_conflicts: dict[str, int]
    forgotten: list[SavedForgotten]
    # Every static label set and every tuple of a family's label values once: the rest refer to them by
    # index, so the file holds each once as memory does (written out in every place they appear, labels
    # at their length limits made a file 1.7 kB per series, and its save 84 MB for a moment).
    statics: list[Pairs]
    label_sets: list[tuple[str, ...]]


@dataclass
class Restored:
    """What `restore` took back, and what it left out (by reason: series it dropped)."""

    identities: int = 0
    cells: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    changed: list[str] = field(default_factory=list)  # families whose type, semantics or labels changed
    unknown: list[str] = field(default_factory=list)  # families the catalog no longer has

    def drop(self, reason: str, count: int = 1) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + count


def _family(spec_type: MetricType, per_shard: bool, labels: tuple[str, ...]) -> tuple[str, bool, tuple[str, ...]]:
    return (spec_type.value, per_shard, labels)


def dump(state: SidecarState) -> tuple[Any, ...]:
    """The core's durable state as plain tuples, shaped as `SavedCore` (msgspec encodes them as it).

    Runs on the event loop between pushes, so the view is consistent; it copies only numbers and
    references to immutable values (HistValue, tuples), so encoding it later sees this instant."""
    registry, ledger = state.registry, state.ledger
    families = {f.name: _family(f.type, f.per_shard, f.labels) for f in state.catalog}
    statics: dict[Pairs, int] = {}
    label_sets: dict[tuple[str, ...], int] = {}
    static_at, labels_at = statics.setdefault, label_sets.setdefault
    ranks = []
    for rank in registry.ranks.values():
        values = rank.values
        gauges = rank.gauge_keys
        ranks.append((
            rank.source, rank.tp_rank, rank.pp_rank, rank.dp_rank, rank.attn_cp_rank, static_at(rank.static, len(statics)),
            rank.epoch, rank.pid, rank.seq, rank.expired, rank.resumed, rank.restarts, rank.reconnects,
            rank.snapshots, rank.epoch_conflicts, rank.last_push_wall, tuple(rank.replaced_epochs),
            [(key[0], labels_at(key[1], len(label_sets)), value) for key, value in values.items() if key not in gauges],
            [(key[0], labels_at(key[1], len(label_sets)), position) for key, position in rank.positions.items()],
            [(key[0], labels_at(key[1], len(label_sets)), bounds, list(counts), total)
             for key, (bounds, counts, total) in rank.bucket_positions.items()],
            rank.world,
        ))
    created = ledger.created
    cells: list[tuple[Any, ...]] = [
        (key[0], static_at(key[1], len(statics)), labels_at(key[2], len(label_sets)), created.get(key, 0.0), cell.value)
        for key, cell in ledger.counter_cells.items()]
    cells += [(key[0], static_at(key[1], len(statics)), labels_at(key[2], len(label_sets)), created.get(key, 0.0),
               HistValue(acc.bounds, tuple(acc.counts), acc.sum))
              for key, acc in ledger.histograms.items()]
    marks = []
    for (dp_rank, shared), group in ledger.watermarks.items():
        shared_at = static_at(shared, len(statics))
        for key, mark in group.items():
            value = (HistValue(mark.bounds, tuple(mark.counts), mark.sum) if isinstance(mark, HistAccumulator)
                     else mark.value)
            marks.append((dp_rank, shared_at, key[0], labels_at(key[1], len(label_sets)), value))
    forgotten = [(source, *identity[:4], static_at(identity[4], len(statics)), epoch)
                 for source, memory in registry.forgotten.items() for identity, epoch in memory.items()]
    return (families, ranks, cells, marks, dict(ledger.layout_conflicts), forgotten, list(statics), list(label_sets))


def restore(state: SidecarState, saved: SavedCore) -> Restored:
    """Take `saved` back into a state that has seen nothing yet: every saved identity known (departed, its
    stale and expiry timers starting now; expired ones stay expired), every rollup served at once.

    Series of families the catalog no longer has, or whose type, semantics or labels changed, are
    dropped (counted, logged by name); so are what the state's limits have no room for."""
    result = Restored()
    catalog = state.catalog
    usable = _usable_families(catalog, saved.families, result)
    registry, ledger, budget = state.registry, state.ledger, state.registry.budget
    statics, label_sets = saved.statics, saved.label_sets  # an index past them: IndexError, a corrupt file

    def key_of(family: str, labels: tuple[str, ...], reason_counted: bool = True) -> SeriesKey | None:
        name = usable.get(family)  # the catalog's own string object: keys share it
        if name is None or len(labels) != len(catalog.get(name).labels):
            if reason_counted:
                result.drop("unknown_family" if family not in catalog else "changed_family")
            return None
        return (name, labels)

    now = state.clock()
    window = registry.window
    config = registry.config
    bad_marks = {(mark.family, mark.shared, mark.labels) for mark in saved.marks if not _valid_value(mark.value)}
    shared_chars: dict[int, tuple[int, int]] = {}  # what each shared label set writes on a line, and its width: counted once
    for item in saved.cells:
        key = key_of(item.family, label_sets[item.labels])
        if key is None:
            continue
        if not _valid_value(item.value) or not _valid_time(item.created) \
                or (item.family, item.shared, item.labels) in bad_marks:  # with no watermark, it would count twice
            result.drop("invalid")
            continue
        spec = catalog.get(key[0])
        rollup_key = make_rollup_key(key[0], statics[item.shared], key[1])
        # Weighed as the ledger weighs the cell it makes: by its layout and its labels (the shared static ones, the family's own).
        shared = shared_chars.get(item.shared)
        if shared is None:
            shared = shared_chars[item.shared] = label_size(statics[item.shared])
        chars = line_chars(*shared, *label_size(tuple(zip(spec.labels, key[1]))))
        if isinstance(item.value, HistValue):
            if spec.type is not MetricType.HISTOGRAM or not _whole(item.value):
                result.drop("changed_family")
                continue
            cost = series_cost(item.value.bounds, chars)
            if not budget.has_room(0, cost):
                result.drop("limit")
                continue
            ledger.histograms[rollup_key] = HistAccumulator(item.value.bounds, list(item.value.counts), item.value.sum)
            budget.rollup += cost
        else:
            if spec.type is not MetricType.COUNTER:
                result.drop("changed_family")
                continue
            cost = series_cost(None, chars)
            if not budget.has_room(0, cost):
                result.drop("limit")
                continue
            ledger.counter_cells[rollup_key] = RollupCounter(item.value)
            budget.rollup += cost
        ledger.created[rollup_key] = item.created
        result.cells += 1
    for mark in saved.marks:
        key = key_of(mark.family, label_sets[mark.labels], reason_counted=False)  # a watermark is no series of its own
        if key is None or (mark.family, mark.shared, mark.labels) in bad_marks:  # its cell counted invalid above
            continue
        group = ledger.watermarks.setdefault((mark.dp_rank, statics[mark.shared]), {})
        if isinstance(mark.value, HistValue):
            if catalog.get(key[0]).type is MetricType.HISTOGRAM and _whole(mark.value):
                group[key] = HistAccumulator(mark.value.bounds, list(mark.value.counts), mark.value.sum)
        elif catalog.get(key[0]).type is MetricType.COUNTER:
            group[key] = RollupCounter(mark.value)
    for family, count in saved.layout_conflicts.items():
        if family in usable and count >= 0:
            ledger.layout_conflicts[family] = count
    left_out: list[tuple[RankIdentity, SavedRank]] = []
    # Expired identities last: when there are more than max_ranks, they are the ones left out, as
    # the registry would forget them first.
    for saved_rank in sorted(saved.ranks, key=lambda r: r.expired):
        identity = rank_identity(saved_rank.tp_rank, saved_rank.pp_rank, saved_rank.dp_rank, saved_rank.attn_cp_rank,
                                 statics[saved_rank.static])
        invalid = not _valid_rank(saved_rank, catalog)
        if invalid or len(registry.ranks) >= config.max_ranks:
            # Left out as the registry forgets a rank: its values are baselines when it comes back, never
            # counted twice (a rank with a value missing would count that value again).
            series = {(v.family, v.labels) for v in saved_rank.values} | {(p.family, p.labels) for p in saved_rank.positions}
            result.drop("invalid" if invalid else "limit", len(series))
            left_out.append((identity, saved_rank))
            continue
        if identity in registry.ranks:
            continue  # listed twice: the first stands
        rank = RankState(
            tp_rank=saved_rank.tp_rank, pp_rank=saved_rank.pp_rank, dp_rank=saved_rank.dp_rank, static=identity[4],
            epoch=saved_rank.epoch, pid=saved_rank.pid, attn_cp_rank=saved_rank.attn_cp_rank, source=saved_rank.source,
            history=WindowHistory(window, window / WINDOW_HISTORY_ENTRIES), silence=registry.silence,
            seq=saved_rank.seq, resumed=saved_rank.resumed, restarts=saved_rank.restarts, reconnects=saved_rank.reconnects,
            snapshots=saved_rank.snapshots, epoch_conflicts=saved_rank.epoch_conflicts, last_push_wall=saved_rank.last_push_wall,
            restored=True, world=saved_rank.world, derived=registry.derived,
        )
        rank.replaced_epochs.extend(saved_rank.replaced_epochs)
        # Timers restart from the load: departed now (expired ones stay expired); a reconnect's seq
        # may jump as far as it could have since the load.
        rank.last_activity = now - config.expire_after_seconds if saved_rank.expired else now
        rank.last_push = now if saved_rank.seq >= 0 else None
        for value in saved_rank.values:
            key = key_of(value.family, label_sets[value.labels])
            if key is None:
                continue
            histogram = isinstance(value.value, HistValue)
            spec_type = catalog.get(key[0]).type
            if histogram != (spec_type is MetricType.HISTOGRAM) or spec_type is MetricType.GAUGE \
                    or (isinstance(value.value, HistValue) and not _whole(value.value)):
                result.drop("changed_family")
                continue
            # Weighed as the reader weighs a pushed series: by its layout and its labels (the rank's, the family's own).
            spec = catalog.get(key[0])
            cost = series_cost(value.value.bounds if isinstance(value.value, HistValue) else None,
                               line_chars(rank.label_chars, rank.label_width, *label_size(tuple(zip(spec.labels, key[1])))),
                               scalar_lines(spec))
            if rank.cost + cost > config.max_series_per_rank or not budget.has_room(0, cost):
                result.drop("limit")
                continue
            rank.values[key] = value.value
            rank.cost += cost
            budget.per_rank += cost
        for position in saved_rank.positions:
            key = key_of(position.family, label_sets[position.labels], reason_counted=False)
            if key is not None and catalog.get(key[0]).type is not MetricType.GAUGE:
                rank.positions[key] = position.position
        for buckets in saved_rank.buckets:
            key = key_of(buckets.family, label_sets[buckets.labels], reason_counted=False)
            if key is not None and catalog.get(key[0]).type is MetricType.HISTOGRAM \
                    and len(buckets.counts) == len(buckets.bounds):
                rank.bucket_positions[key] = (buckets.bounds, list(buckets.counts), buckets.sum)
        # The window's base: the loaded positions, as of one window ago, so that the first window after
        # the load reads what moved since the load (never the whole history as a spike).
        rank.history.record(now - window, rank.positions)
        registry.ranks[identity] = rank
        result.identities += 1
    for entry in saved.forgotten:
        forgotten_identity = rank_identity(entry.tp_rank, entry.pp_rank, entry.dp_rank, entry.attn_cp_rank,
                                           statics[entry.static])
        memory = registry.forgotten.setdefault(entry.source, {})
        if len(memory) < config.max_ranks and forgotten_identity not in registry.ranks:
            memory[forgotten_identity] = entry.epoch
    # An identity left out is forgotten as the registry forgets one to make room: its contribution
    # stays in the rollups, and when it comes back with its epoch its values are baselines (a
    # per_shard series counted twice otherwise: once in the restored rollup, once from zero).
    for identity, saved_rank in left_out:
        registry.remember_forgotten(saved_rank.source, identity, saved_rank.epoch)
    if result.dropped.get("invalid"):
        log.warning("durable state: %d saved series hold values no sidecar writes (NaN, infinite, negative, beyond "
                    "2**80, a time outside 1970-3000, or a histogram that is not cumulative): left out, their ranks "
                    "forgotten (their values are baselines when they come back)", result.dropped["invalid"])
    for family in result.changed:
        log.warning("durable state: family %s changed its type, semantics or labels since the file was written: "
                    "its rollups and positions start over", family)
    if result.unknown:
        log.warning("durable state: %d families are no longer in the catalog, their series dropped: %s",
                    len(result.unknown), ", ".join(result.unknown[:20]))
    return result


def _usable_families(catalog: Catalog, saved: dict[str, SavedFamily], result: Restored) -> dict[str, str]:
    """The saved families that continue (same type, semantics and labels), by name, as the catalog spells them."""
    usable: dict[str, str] = {}
    for name, family in saved.items():
        spec = catalog.find(name)
        if spec is None:
            result.unknown.append(name)
            continue
        if (family.type, family.per_shard, family.labels) != _family(spec.type, spec.per_shard, spec.labels):
            result.changed.append(name)
            continue
        usable[name] = spec.name
    return usable


def _whole(value: HistValue) -> bool:
    """A saved histogram that can stand: as many counts as bounds, the last bound "+Inf"."""
    return bool(value.bounds) and len(value.counts) == len(value.bounds) and value.bounds[-1] == "+Inf"


def valid_count(value: float) -> bool:
    """A counter's value or position: finite, from 0 to MAX_SAVED_VALUE (NaN fails both comparisons)."""
    return 0.0 <= value <= MAX_SAVED_VALUE


def valid_sum(value: float) -> bool:
    """A histogram's sum (or its position): finite, within ±MAX_SAVED_VALUE."""
    return -MAX_SAVED_VALUE <= value <= MAX_SAVED_VALUE


def _valid_histogram(bounds: tuple[float | str, ...], counts: tuple[int, ...] | list[int], total: float) -> bool:
    """Finite bounds rising to "+Inf", one count each, whole, non-negative and cumulative, within bounds; a finite sum."""
    if not bounds or len(counts) != len(bounds) or bounds[-1] != "+Inf" or not valid_sum(total):
        return False
    last: float = -math.inf
    for bound in bounds[:-1]:
        if isinstance(bound, str) or not last < bound < math.inf:
            return False
        last = bound
    previous = 0
    for count in counts:
        if not previous <= count <= MAX_SAVED_VALUE:
            return False
        previous = count
    return True


def _valid_value(value: float | HistValue) -> bool:
    """A saved counter or histogram value that a sidecar could have written."""
    if isinstance(value, HistValue):
        return _valid_histogram(value.bounds, value.counts, value.sum)
    return valid_count(value)


def _valid_time(value: float | None) -> bool:
    return value is None or 0.0 <= value <= MAX_SAVED_TIME


def _valid_rank(rank: SavedRank, catalog: Catalog) -> bool:
    """Every number of a saved rank is one a sidecar could have written (its families aside: those are checked
    against the catalog where they are taken back)."""
    axes = (rank.tp_rank, rank.pp_rank, rank.dp_rank, rank.attn_cp_rank or 0)
    if not all(0 <= axis <= MAX_RANK_AXIS for axis in axes) or not _valid_time(rank.last_push_wall) \
            or min(rank.restarts, rank.reconnects, rank.snapshots, rank.epoch_conflicts, rank.pid, rank.seq + 1) < 0:
        return False
    if not all(_valid_value(value.value) for value in rank.values):
        return False
    for position in rank.positions:
        spec = catalog.find(position.family)
        counter = spec is None or spec.type is not MetricType.HISTOGRAM  # a histogram's position is its sum's
        if not (valid_count(position.position) if counter else valid_sum(position.position)):
            return False
    return all(_valid_histogram(b.bounds, b.counts, b.sum) for b in rank.buckets)
