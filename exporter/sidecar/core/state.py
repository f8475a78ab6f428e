"""The sidecar's state as one facade over its data flow: the rank registry (ranks.py) → the sample reader
(samples.py) → the rollup ledger (rollups.py) → the series window (history.py, window.py).

Everything here runs on the event loop and does no I/O; time comes from injected clocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from exporter.catalog import Catalog, FamilySpec
from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.protocol.messages import Hello, Sample, Snapshot, World
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import (
    GroupKey,
    HistAccumulator,
    LabelValues,
    RollupCounter,
    RollupKey,
    SeriesBudget,
    SeriesKey,
)
from exporter.sidecar.core.ranks import (
    PUSH_SOURCE,
    Clock,
    HelloResult,
    Join,
    RankIdentity,
    RankRegistry,
    RankState,
    RankStatus,
    exposition_order,
)
from exporter.sidecar.core.rollups import RollupLedger
from exporter.sidecar.core.samples import Rejection, SampleReader, below
from exporter.sidecar.core.window import Bandwidth, SeriesWindow

Rollups = tuple[dict[RollupKey, float], dict[RollupKey, HistAccumulator]]  # rollup counters and histograms


@dataclass(slots=True)
class Push:
    """A source's snapshot, typed: its seq, its samples and any HELP texts. The listener makes one
    of each wire snapshot, the upstream feed one per slice of a rank's read; the reader checks the
    samples (once, for both). Not frozen: one is made per push, and a frozen init costs twice."""

    seq: int
    samples: list[Sample]
    help: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, snapshot: Snapshot) -> Push:
        """A wire snapshot (its shape already checked by the protocol's decoder) as the state's record."""
        return cls(seq=snapshot.seq, samples=snapshot.samples, help=snapshot.help)


@dataclass
class SnapshotResult:
    """Outcome of one snapshot: samples applied and samples rejected."""

    applied: int = 0
    ignored: bool = False  # refused as a whole (an old seq, a seq jump): nothing applied
    rejections: list[Rejection] = field(default_factory=list)
    refused: Rejection | None = None  # why it was ignored
    conflict: Rejection | None = None  # applied, after its epoch started over (`epoch_conflict`)


class SidecarState:
    """Hellos, snapshots and disconnects in; ranks, rollups and window readings out."""

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
        self.clock = clock
        self._made = (window_seconds, wall_clock)
        self.registry = RankRegistry(catalog, self.config, window_seconds, clock, wall_clock)
        self.reader = SampleReader(catalog, self.config, self.registry)
        self.ledger = RollupLedger(catalog, self.registry.budget, wall_clock)
        self.window = SeriesWindow(catalog)
        self.help: dict[str, str] = {}  # HELP texts ranks gave for catalog families, the latest per family
        # Bumped by every hello and disconnect, and every snapshot that moved a value: the durable
        # state is saved only when it moved.
        self.changes = 0
        # With a durable state, the rollup counters and histograms shown are those of the last save
        # (the keeper shows each save's once written): a sidecar killed at any instant then never
        # comes back lower than a value it showed. None: no durable state, the live values are shown.
        self._shown: Rollups | None = None

    def fresh(self) -> SidecarState:
        """An empty state of the same catalog, limits and clocks (the durable state loads into one)."""
        window_seconds, wall_clock = self._made
        return SidecarState(self.catalog, self.config, window_seconds, self.clock, wall_clock)

    def adopt(self, other: SidecarState) -> None:
        """Take `other`'s ranks, rollups and window whole, in place of this state's (which has seen nothing yet)."""
        self.registry, self.reader, self.ledger, self.window = other.registry, other.reader, other.ledger, other.window
        self.changes += 1

    @property
    def ranks(self) -> dict[RankIdentity, RankState]:
        return self.registry.ranks

    def join(self, connection: object, msg: Join, source: str = PUSH_SOURCE) -> HelloResult:
        """Bind `connection` to the rank identity in `msg`, reported by `source`; raise ProtocolError to refuse it.

        The sources' one door for hellos: the listener and the upstream feed each hand a typed `Join`."""
        self.changes += 1
        return self.registry.join(connection, msg, source)

    def hello(self, connection: object, msg: Hello) -> HelloResult:
        """A pushed rank's wire hello, for callers that speak the protocol directly (tests, benches): `join`."""
        return self.join(connection, Join.of(msg))

    def disconnect(self, connection: object, rank: RankState) -> None:
        """The connection holding `rank` closed (bye, EOF or error)."""
        self.changes += 1
        self.registry.disconnect(connection, rank)

    def expect(self, rank: RankState, world: World | None) -> None:
        """Expect `rank` in `world` from now on: a source's judgement of its world changed (no hello, so no reconnect)."""
        rank.world = world

    def snapshot(self, rank: RankState, msg: Snapshot) -> SnapshotResult:
        """A pushed rank's wire snapshot, for callers that speak the protocol directly (tests, benches): `push`."""
        return self.push(rank, Push.of(msg))

    def push(self, rank: RankState, msg: Push) -> SnapshotResult:
        """Apply a snapshot from `rank`'s open connection: the sources' one door for snapshots."""
        refused = self.registry.refusal(rank, msg.seq)
        if refused is not None:
            return SnapshotResult(ignored=True, refused=refused)
        version = rank.version
        conflict = self._writer_of(rank, msg) if rank.rejoined else None
        self.registry.accept_snapshot(rank, msg.seq)
        if msg.help:
            self.help.update((family, text) for family, text in msg.help.items() if family in self.catalog)
        updates, rejections = self.reader.read(rank, msg.samples)
        self.ledger.apply(rank, updates)
        rank.history.record(rank.last_activity, rank.positions)
        if rank.version != version:  # values moved: the durable state has something new to save
            self.changes += 1
        return SnapshotResult(applied=len(msg.samples) - len(rejections), rejections=rejections, conflict=conflict)

    def _writer_of(self, rank: RankState, msg: Push) -> Rejection | None:
        """Which writer of its epoch a reconnect's first snapshot continues; an `epoch_conflict`
        answer when that is not the writer that pushed last.

        Another process may push with a rank's epoch while the rank is away (epochs are public on
        /api/v1/status). The epoch keeps the values of two writers: the one that pushed last and
        the one before its last conflict. A snapshot at or above the last writer's values
        continues them; one at or above the other writer's continues those instead (when it is
        below the last writer's, or the other writer's are above them: the nearer of the two);
        one below both is a new writer, and the epoch starts over in place. Positions continue
        in every case, so per-rank series show the writer that pushes now, no rollup falls, and
        two writers taking turns each add only their own increases."""
        other = rank.other_writer
        if not rank.values and other is None:
            return None
        firsts = self.reader.first_values(rank, msg.samples)
        fell = below(firsts, rank.values, firsts)
        if other is not None and not below(firsts, other.values, firsts) and (
                fell or (below(rank.values, other.values, firsts) and not below(other.values, rank.values, firsts))):
            self.registry.resume_other_writer(rank)
            return ErrorCode.EPOCH_CONFLICT, (
                f"rank {rank.describe()} reconnected with epoch {rank.epoch!r} and values that continue those "
                "another writer of that epoch pushed before the last epoch_conflict: two processes push with "
                "this epoch. This connection continues its own values (only their increase counts); keep "
                "other processes off the socket (ingest.allowed_uids)"
            )
        if not fell:
            return None
        self.registry.epoch_conflict(rank)
        return ErrorCode.EPOCH_CONFLICT, (
            f"rank {rank.describe()} reconnected with epoch {rank.epoch!r} and values below what that epoch "
            "pushed before: another process pushed with this epoch. This connection's values count from "
            "here on (the epoch restarts in place); keep other processes off the socket (ingest.allowed_uids)"
        )

    def exposed_ranks(self) -> list[RankState]:
        """Ranks whose per-rank series are on /metrics (all but expired), in exposition order."""
        return self.registry.exposed_ranks()

    # Reads: the views ask these, and none of them changes state.

    def known_ranks(self) -> list[RankState]:
        """Every rank identity the sidecar knows (expired ones too), in exposition order."""
        return sorted(self.registry.ranks.values(), key=exposition_order)

    def rank(self, identity: RankIdentity) -> RankState | None:
        """The rank known under `identity`, if any."""
        return self.registry.ranks.get(identity)

    def rank_count(self) -> int:
        """How many rank identities the sidecar knows."""
        return len(self.registry.ranks)

    def ranks_by_status(self) -> dict[RankStatus, int]:
        """How many known ranks are in each status, every status present."""
        by_status = dict.fromkeys(RankStatus, 0)
        for rank in self.registry.ranks.values():
            by_status[rank.status] += 1
        return by_status

    def replica_groups(self) -> dict[GroupKey, list[RankState]]:
        """Known ranks by replica group, each group in replica order."""
        return self.registry.groups()

    def rollup_counters(self) -> dict[RollupKey, float]:
        """Every rollup counter's value, as shown (`show_rollups`)."""
        return self.ledger.counters if self._shown is None else self._shown[0]

    def rollup_histograms(self) -> dict[RollupKey, HistAccumulator]:
        """Every rollup histogram, as shown (`show_rollups`)."""
        return self.ledger.histograms if self._shown is None else self._shown[1]

    def live_rollups(self) -> Rollups:
        """Every rollup as counted now, whatever is shown (`show_rollups`): read in place, not copied, so that
        one view's figures (a server, its dp groups' watermarks, the window) agree with each other."""
        return self.ledger.counters, self.ledger.histograms

    def rollup_snapshot(self) -> Rollups:
        """A copy of the rollup counters and histograms as they are now."""
        return self.ledger.counters, {key: HistAccumulator(acc.bounds, list(acc.counts), acc.sum)
                                      for key, acc in self.ledger.histograms.items()}

    def show_rollups(self, rollups: Rollups) -> None:
        """Show `rollups` (a `rollup_snapshot` the durable state has saved) in place of the live values."""
        self._shown = rollups

    def group_watermarks(self, group: GroupKey) -> dict[SeriesKey, RollupCounter | HistAccumulator]:
        """One replica group's watermarks: how far its furthest replica got in each replicated series, its part
        of the rollups (live values; read them, never change them)."""
        return self.ledger.watermarks.get(group, {})

    def rollup_created(self) -> dict[RollupKey, float]:
        """When each rollup counter and histogram began (wall clock; OpenMetrics' `_created`)."""
        return self.ledger.created

    def rollup_gauges(self) -> dict[RollupKey, float]:
        """Every rollup gauge, over the ranks as they are now."""
        return self.ledger.gauges(self.registry.ranks.values())

    def layout_conflicts(self) -> dict[str, int]:
        """By family, rank histogram series left out of their rollup for their bucket layout, sorted by family."""
        return dict(sorted(self.ledger.layout_conflicts.items()))

    def window_increases(self, ranks: list[RankState]) -> dict[int, Increases]:
        """Per rank of `ranks` (by id), the increase of each of its positions over the window ending now."""
        return self.window.increases(ranks, self.clock())

    def bandwidths(self, ranks: list[RankState], increases: dict[int, Increases]
                   ) -> tuple[list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]], dict[RollupKey, Bandwidth]]:
        """Per-rank (unexpired ranks) and rolled-up active bandwidth over the window."""
        return self.window.bandwidths(ranks, increases)

    def spreads(self, increases: dict[int, Increases]) -> dict[tuple[str, GroupKey, LabelValues], float]:
        """(max - min) / max of current replicas' window increases, per replicated counter and replica group."""
        return self.window.spreads(self.registry.groups(), increases)

    def series_budget(self) -> SeriesBudget:
        """The series budget: what per-rank and rollup series use of max_series_total (read it, never change it)."""
        return self.registry.budget

    @property
    def window_seconds(self) -> float:
        """How far back the window reads (bandwidth, spread)."""
        return self.registry.window

    def wall_time(self) -> float:
        """Wall-clock time now, from the injected clock."""
        return self.registry.wall_clock()
