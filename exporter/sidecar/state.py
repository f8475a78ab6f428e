"""Per-rank state and rollups: applies hellos, snapshots and disconnects; pure and clock-driven.

Rollup counters are sums of per-rank deltas, so they never decrease while the sidecar runs:
* per_shard families add every rank's delta;
* replicated families add only the delta of each replica group's leader (the eligible rank
  with the lowest (pp_rank, tp_rank)). The group's rollup follows one rank at a time: when
  leadership passes to another rank (at once, or after a gap with no leader), the snapshot in
  which the new leader first leads is its baseline (per series: a series it omits there gets its
  baseline from its next value) and it contributes from its next delta on.
  Nothing is copied in, nothing is counted twice; only a group's very first leader, and a leader
  that comes back with no other rank having led in between, count their deltas from zero.
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, TypeVar

from exporter.catalog import Catalog, MetricType, Semantics
from exporter.config import RanksConfig
from exporter.errors import ErrorCode, ProtocolError, SampleRejected
from exporter.labels import label_name_problem
from msgspec import UNSET

from exporter.protocol.messages import Hello, Sample, Snapshot
from exporter.sidecar.plans import FamilyPlan, SeriesRoute
from exporter.sidecar.ranks import RankIdentity, RankState
from exporter.sidecar.series import (
    GroupKey,
    HistAccumulator,
    HistValue,
    RollupCounter,
    RollupKey,
    SeriesKey,
    static_key,
)
from exporter.sidecar.window import WindowHistory

Clock = Callable[[], float]
KeyT = TypeVar("KeyT", bound=Hashable)
HISTORY_POINTS = 60  # entries kept per rank per window: bounds memory whatever the push rate


@dataclass
class HelloResult:
    """How a hello relates to what the sidecar knew of that identity."""

    rank: RankState
    restart: bool = False
    reconnect: bool = False


@dataclass
class SnapshotResult:
    """Outcome of one snapshot: samples applied and samples rejected."""

    applied: int = 0
    ignored: bool = False  # an old seq: the whole snapshot was skipped
    rejections: list[SampleRejected] = field(default_factory=list)


@dataclass(eq=False)
class ReplicaGroup:
    """The ranks sharing a dp_rank and static labels, and which of them leads."""

    members: list[RankState] = field(default_factory=list)
    leader: RankState | None = None
    counting: RankState | None = None  # the rank whose deltas the replicated rollups last followed

    def elect(self) -> RankState | None:
        eligible = [r for r in self.members if r.eligible]
        self.leader = min(eligible, key=lambda r: r.order) if eligible else None
        return self.leader


class RollupStore:
    """Accumulated rollup counters and histograms, keyed by family, static labels and labels.

    One mutable cell per rollup series, which the routes feeding it hold: applying a delta then
    costs no hashing of the nested key tuple.
    """

    def __init__(self) -> None:
        self.counter_cells: dict[RollupKey, RollupCounter] = {}
        self.histograms: dict[RollupKey, HistAccumulator] = {}

    @property
    def counters(self) -> dict[RollupKey, float]:
        """Every rollup counter's value, as a new dict."""
        return {key: cell.value for key, cell in self.counter_cells.items()}

    def counter(self, key: RollupKey) -> RollupCounter:
        """The cell of rollup counter `key`, created at zero when new."""
        cell = self.counter_cells.get(key)
        if cell is None:
            cell = self.counter_cells[key] = RollupCounter()
        return cell

    def histogram(self, key: RollupKey, n_buckets: int) -> HistAccumulator:
        """The accumulator of rollup histogram `key`, created empty when new."""
        acc = self.histograms.get(key)
        if acc is None:
            acc = self.histograms[key] = HistAccumulator.empty(n_buckets)
        return acc


class SidecarState:
    """Everything the sidecar knows; every method runs on the event loop, none does I/O."""

    def __init__(
        self,
        catalog: Catalog,
        ranks_config: RanksConfig | None = None,
        window_seconds: float = 60.0,
        clock: Clock = time.monotonic,
        wall_clock: Clock = time.time,
    ) -> None:
        self.catalog = catalog
        self.config = ranks_config or RanksConfig()
        self.window = window_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        self.ranks: dict[RankIdentity, RankState] = {}
        self.groups: dict[GroupKey, ReplicaGroup] = {}
        self.rollups = RollupStore()
        self.generation = 0  # bumped on every change that affects the exposition
        self.total_series = 0  # per-rank series held, for the max_series_total guard
        # Series whose increase over the window matters: bytes/duration pairs and replicated counters.
        self.windowed: frozenset[str] = frozenset(
            {f.name for pair in catalog.bandwidth_pairs() for f in pair}
            | {f.name for f in catalog if f.type is MetricType.COUNTER and f.semantics is Semantics.REPLICATED}
        )
        self._plans = {f.name: FamilyPlan.of(f, f.name in self.windowed) for f in catalog}
        self._interned: dict[Hashable, Hashable] = {}  # series keys, rollup keys and routes: see _intern

    # --- hello / disconnect ---

    def hello(self, connection: object, msg: Hello) -> HelloResult:
        """Bind `connection` to the rank identity in `msg`; raise ProtocolError to refuse it."""
        self._check_static_labels(msg.labels)
        static = static_key(msg.labels)
        identity = (msg.rank.tp_rank, msg.rank.pp_rank, msg.rank.dp_rank, static)
        now = self.clock()
        rank = self.ranks.get(identity)
        result: HelloResult
        if rank is None:
            self._make_room_for_a_rank()
            rank = RankState(
                tp_rank=msg.rank.tp_rank, pp_rank=msg.rank.pp_rank, dp_rank=msg.rank.dp_rank,
                static=static, epoch=msg.epoch, pid=msg.pid,
                history=WindowHistory(self.window, self.window / HISTORY_POINTS),
            )
            self.ranks[identity] = rank
            self.groups.setdefault(rank.group, ReplicaGroup()).members.append(rank)
            result = HelloResult(rank)
        elif rank.connected:
            raise ProtocolError(
                ErrorCode.DUPLICATE_RANK,
                f"rank {rank.describe()} is already connected (pid {rank.pid}); two processes "
                "must not share one identity: give each replica group a distinguishing static label",
            )
        elif msg.epoch in rank.replaced_epochs:
            raise ProtocolError(
                ErrorCode.STALE_EPOCH,
                f"epoch {msg.epoch!r} of rank {rank.describe()} was replaced by a newer process start",
            )
        elif msg.epoch != rank.epoch:
            rank.replaced_epochs.append(rank.epoch)
            rank.epoch = msg.epoch
            self.total_series -= len(rank.values)
            rank.values.clear()  # the new epoch counts from zero
            rank.version += 1
            rank.gauge_keys.clear()
            rank.baselined = None
            rank.seq = -1
            rank.restarts += 1
            result = HelloResult(rank, restart=True)
        else:
            rank.reconnects += 1
            result = HelloResult(rank, reconnect=True)
        rank.pid = msg.pid
        rank.world = msg.world
        rank.connection = connection
        rank.ready = False
        rank.stale = False
        rank.expired = False
        rank.last_activity = now
        self.generation += 1
        return result

    def _make_room_for_a_rank(self) -> None:
        """Forget expired identities when the registry is full; refuse the hello if none is expired."""
        if len(self.ranks) < self.config.max_ranks:
            return
        for identity, rank in list(self.ranks.items()):
            if rank.expired and not rank.connected:
                # Its rollup contribution stays; only the per-rank memory goes.
                del self.ranks[identity]
                group = self.groups[rank.group]
                group.members.remove(rank)  # group.counting may still name it: the next leader takes over
                self.total_series -= len(rank.values)
        if len(self.ranks) >= self.config.max_ranks:
            raise ProtocolError(
                ErrorCode.TOO_MANY_RANKS,
                f"the sidecar already tracks max_ranks={self.config.max_ranks} rank identities",
            )

    def disconnect(self, connection: object, rank: RankState) -> None:
        """The connection holding `rank` closed (bye, EOF or error)."""
        if rank.connection is not connection:
            return
        rank.connection = None
        rank.ready = False
        self.groups[rank.group].elect()
        self.generation += 1

    def _check_static_labels(self, labels: dict[str, str]) -> None:
        limits = self.config
        if len(labels) > limits.max_static_labels:
            raise ProtocolError(
                ErrorCode.INVALID_HELLO,
                f"{len(labels)} static labels; at most {limits.max_static_labels} are allowed",
            )
        for name, value in labels.items():
            problem = label_name_problem(name)
            if problem is None and self.catalog.static_label_conflicts({name}):
                problem = f"label name {name!r} is a family label in the catalog"
            if problem is None and len(value) > limits.max_label_value_length:
                problem = f"value of label {name!r} is longer than {limits.max_label_value_length} characters"
            if problem:
                raise ProtocolError(ErrorCode.INVALID_HELLO, f"static label: {problem}")

    # --- snapshots ---

    def snapshot(self, rank: RankState, msg: Snapshot) -> SnapshotResult:
        """Apply a snapshot from `rank`'s open connection."""
        now = self.clock()
        if msg.seq <= rank.seq:
            return SnapshotResult(ignored=True)
        rank.seq = msg.seq
        group = self.groups[rank.group]
        already_eligible = rank.eligible
        rank.ready = True
        rank.stale = False
        rank.expired = False
        rank.last_activity = now
        rank.last_push_wall = self.wall_clock()
        rank.snapshots += 1
        # Only a change of eligibility can change the leader; a steady rank's push cannot.
        leads = (group.leader if already_eligible else group.elect()) is rank
        takeover = leads and group.counting is not None and group.counting is not rank
        if takeover:
            # Another rank's deltas were followed until now: each replicated series' next value
            # from this rank is its baseline (this snapshot's, or a later one for series it omits).
            rank.baselined = set()
        if leads:
            group.counting = rank
        result = SnapshotResult()
        apply = self._apply
        samples = msg.samples
        for position, sample in enumerate(samples):
            try:
                apply(rank, sample, leads, position)
            except SampleRejected as rejection:
                result.rejections.append(rejection)
        result.applied = len(samples) - len(result.rejections)
        rank.history.record(now, rank.totals)
        self.generation += 1
        return result

    def _apply(self, rank: RankState, sample: Sample, leads: bool, position: int) -> None:
        # The hottest code in the sidecar (every sample of every push): locals over attributes,
        # C-level builtins over Python loops, and the unchanged-value exits first.
        recent = rank.recent
        if position < len(recent):
            family, labels, route = recent[position]
            if family != sample.family or labels != sample.labels:  # equality, no hashing: fresh strings
                route = self._find_route(rank, sample, position)
        else:
            route = self._find_route(rank, sample, position)
        plan = route.plan
        key = route.key
        values = rank.values
        previous = values.get(key)
        if previous is None:
            self._check_series_room(rank)
        if plan.histogram:
            self._apply_histogram(rank, route, sample, previous, leads)  # type: ignore[arg-type]
            return
        value = sample.value
        if value is UNSET or sample.buckets is not UNSET or sample.sum is not UNSET or sample.count is not UNSET:
            raise SampleRejected(
                ErrorCode.TYPE_MISMATCH, f"{plan.name!r} is a {plan.kind.value}: send a value, and no buckets, sum or count"
            )
        baselined = rank.baselined
        per_shard = plan.per_shard
        if value == previous and (per_shard or baselined is None):
            return  # unchanged since the last snapshot: nothing to add, the common case when idle
        if plan.gauge:
            self._store(rank, key, value)
            rank.gauge_keys.add(key)
            return
        if value < 0:
            raise SampleRejected(ErrorCode.INVALID_VALUE, f"counter {plan.name!r} is negative ({value})")
        if previous is None:
            before = 0.0
            self.total_series += 1
        else:
            before = previous  # type: ignore[assignment]
            if value < before:
                raise SampleRejected(
                    ErrorCode.COUNTER_DECREASED,
                    f"counter {plan.name!r}{dict(zip(plan.labels, key[1]))} went down from {before} to {value} "
                    "within one epoch; a restarted process must say hello with a new epoch",
                )
        delta = value - before
        values[key] = value
        rank.version += 1
        cell = route.counter
        if cell is None:  # the rollup series exists from its first accepted value, counted or not
            cell = route.counter = self.rollups.counter(route.rollup_key)
        if self._counted(rank, plan, key, leads, delta):
            cell.value += delta

    @staticmethod
    def _counted(rank: RankState, plan: FamilyPlan, key: SeriesKey, leads: bool, increase: float) -> bool:
        """Whether a stored increase of `key` goes into its rollup (the rule in this module's
        docstring), keeping the rank's window totals and takeover baselines up to date."""
        if plan.windowed:
            totals = rank.totals
            totals[key] = totals.get(key, 0.0) + increase
        if plan.per_shard:
            return True
        baselined = rank.baselined
        if baselined is None:
            return leads
        # After a takeover a series' first value is its baseline: counted only once seen before.
        counted = leads and key in baselined
        baselined.add(key)
        return counted

    def _find_route(self, rank: RankState, sample: Sample, position: int) -> SeriesRoute:
        """The route of a sample not where the rank's last snapshot had it; remembered at `position`."""
        labels = sample.labels
        route = rank.routes.get((sample.family, tuple(labels.items())) if labels else sample.family)
        if route is None:
            route = self._route(rank, sample)
        recent = rank.recent
        entry = (sample.family, labels, route)
        if position < len(recent):
            recent[position] = entry
        elif position == len(recent) and position < self.config.max_series_per_rank:
            recent.append(entry)
        return route

    def _route(self, rank: RankState, sample: Sample) -> SeriesRoute:
        """Validate a sample's family and labels; remember the result when it names its series canonically."""
        family, labels = sample.family, sample.labels
        plan = self._plans.get(family)
        if plan is None:
            raise SampleRejected(ErrorCode.UNKNOWN_FAMILY, f"family {family!r} is not in the catalog")
        label_values = self._label_values(plan, labels) if labels or plan.labels else ()
        name = plan.name  # the catalog's string object, shared by every rank's keys
        intern = self._intern
        route = intern(SeriesRoute(plan, intern((name, label_values)), intern((name, rank.static, label_values))))
        # Labels in the catalog's order (as the client library sends them) map one-to-one to
        # series, so the index is bounded like the rank's series; other orders are not kept.
        if tuple(labels) == plan.labels and len(rank.routes) < self.config.max_series_per_rank:
            ident = intern((name, tuple(zip(plan.labels, route.key[1])))) if labels else name  # == what samples send
            rank.routes[ident] = route
        return route

    def _intern(self, key: KeyT) -> KeyT:
        """One shared object per distinct key or route: ranks' equal keys then compare by identity
        in every dict and set they meet (rollups, windows, spreads) and take memory once. Bounded:
        past max_series_total distinct ones, new ones are used as they are (correct, just slower)."""
        interned = self._interned
        if len(interned) < self.config.max_series_total:
            return interned.setdefault(key, key)
        return interned.get(key, key)

    def _check_series_room(self, rank: RankState) -> None:
        if len(rank.values) >= self.config.max_series_per_rank:
            raise SampleRejected(
                ErrorCode.SERIES_LIMIT,
                f"rank {rank.describe()} already has {self.config.max_series_per_rank} series (max_series_per_rank)",
            )
        if self.total_series >= self.config.max_series_total:
            raise SampleRejected(
                ErrorCode.SERIES_LIMIT,
                f"the sidecar already holds {self.config.max_series_total} series (max_series_total)",
            )

    def _apply_histogram(self, rank: RankState, route: SeriesRoute, sample: Sample, previous: HistValue | None, leads: bool) -> None:
        plan, key = route.plan, route.key
        name = plan.name
        buckets = sample.buckets
        total = sample.sum
        if buckets is UNSET or total is UNSET or sample.count is UNSET or sample.value is not UNSET:
            raise SampleRejected(ErrorCode.TYPE_MISMATCH, f"{name!r} is a histogram: send buckets, sum and count, and no value")
        if len(buckets) != plan.n_buckets:
            raise SampleRejected(
                ErrorCode.BUCKET_MISMATCH,
                f"{name!r} has {plan.n_buckets} buckets (catalog), the sample has {len(buckets)}",
            )
        bounds, counts = zip(*buckets)  # two tuples, built in C
        if bounds != plan.bounds:
            bad = next((b, w) for b, w in zip(bounds, plan.bounds) if b != w)
            raise SampleRejected(
                ErrorCode.BUCKET_MISMATCH, f"{name!r}: bucket bound {bad[0]!r} where the catalog has {bad[1]!r}"
            )
        baselined = rank.baselined
        per_shard = plan.per_shard
        if previous is not None and counts == previous.counts:
            if total != previous.sum:
                raise SampleRejected(ErrorCode.INVALID_VALUE, f"histogram {name!r}: sum changed without new observations")
            if per_shard or baselined is None:
                return  # nothing new: the common case of an idle histogram
        if counts[0] < 0:
            raise SampleRejected(ErrorCode.INVALID_VALUE, f"{name!r}: bucket counts must not be negative")
        if counts[-1] != sample.count:
            raise SampleRejected(
                ErrorCode.BUCKET_MISMATCH,
                f"{name!r}: the +Inf bucket ({counts[-1]}) must equal count ({sample.count})",
            )
        if list(counts) != sorted(counts):  # cumulative counts never go down from bucket to bucket
            raise SampleRejected(ErrorCode.BUCKET_MISMATCH, f"{name!r}: bucket counts are not cumulative")
        deltas: tuple[int, ...] | list[int]
        if previous is None:
            deltas, dsum = counts, total
            self.total_series += 1
        else:
            deltas = list(map(operator.sub, counts, previous.counts))
            if sorted(deltas)[0] < 0:  # sorted() compares ints on a fast path that min() lacks
                raise SampleRejected(ErrorCode.COUNTER_DECREASED, f"histogram {name!r} bucket counts went down within one epoch")
            dsum = total - previous.sum
        rank.values[key] = HistValue(counts, total)
        rank.version += 1
        acc = route.histogram
        if acc is None:  # the rollup series exists from its first accepted value, counted or not
            acc = route.histogram = self.rollups.histogram(route.rollup_key, plan.n_buckets)
        if self._counted(rank, plan, key, leads, dsum):
            acc.add(deltas, dsum)

    def _label_values(self, plan: FamilyPlan, labels: dict[str, str]) -> tuple[str, ...]:
        names = plan.labels
        try:
            if len(labels) != len(names):
                raise KeyError
            values = tuple(map(labels.__getitem__, names))
        except KeyError:
            raise SampleRejected(
                ErrorCode.WRONG_LABELS, f"{plan.name!r} takes labels {list(names)}, got {sorted(labels)}"
            ) from None
        limit = self.config.max_label_value_length
        if values and max(map(len, values)) > limit:
            raise SampleRejected(ErrorCode.WRONG_LABELS, f"{plan.name!r}: a label value is longer than {limit} characters")
        return values

    def _store(self, rank: RankState, key: SeriesKey, value: float | HistValue) -> None:
        if key not in rank.values:
            self.total_series += 1
        rank.values[key] = value
        rank.version += 1

    # --- time ---

    def tick(self) -> None:
        """Mark silent ranks stale, then expired; re-elect leaders where that changed anything."""
        now = self.clock()
        stale_after = self.config.stale_after_seconds
        expire_after = self.config.expire_after_seconds
        changed_groups: set[GroupKey] = set()
        for rank in self.ranks.values():
            silent = now - rank.last_activity
            if not rank.stale and silent >= stale_after:
                rank.stale = True
                rank.ready = False
                changed_groups.add(rank.group)
            if not rank.expired and silent >= expire_after:
                rank.expired = True
                changed_groups.add(rank.group)
        for key in changed_groups:
            self.groups[key].elect()
        if changed_groups:
            self.generation += 1

    # --- read side ---

    def exposed_ranks(self) -> list[RankState]:
        """Ranks whose per-rank series are on /metrics (all but expired), in a stable order."""
        return sorted((r for r in self.ranks.values() if not r.expired), key=lambda r: (r.static, r.dp_rank, r.pp_rank, r.tp_rank))

    def live_ranks(self) -> list[RankState]:
        return [r for r in self.ranks.values() if r.live]
