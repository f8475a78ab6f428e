"""The sidecar's state as one facade over its data flow: registry → reader → ledger → window.

Everything here runs on the event loop and does no I/O; time comes from injected clocks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from exporter.catalog import Catalog
from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.protocol.messages import Hello, Snapshot
from exporter.sidecar.ledger import RollupLedger
from exporter.sidecar.reader import Rejection, SampleReader, below
from exporter.sidecar.registry import PUSH_SOURCE, Clock, HelloResult, RankIdentity, RankRegistry, RankState
from exporter.sidecar.window import Window


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
        self.registry = RankRegistry(catalog, self.config, window_seconds, clock, wall_clock)
        self.reader = SampleReader(catalog, self.config, self.registry)
        self.ledger = RollupLedger(catalog, self.registry.budget)
        self.window = Window(catalog)
        self.help: dict[str, str] = {}  # HELP texts ranks gave for catalog families, the latest per family

    @property
    def ranks(self) -> dict[RankIdentity, RankState]:
        return self.registry.ranks

    def hello(self, connection: object, msg: Hello, source: str = PUSH_SOURCE) -> HelloResult:
        """Bind `connection` to the rank identity in `msg`, reported by `source`; raise ProtocolError to refuse it."""
        return self.registry.hello(connection, msg, source)

    def disconnect(self, connection: object, rank: RankState) -> None:
        """The connection holding `rank` closed (bye, EOF or error)."""
        self.registry.disconnect(connection, rank)

    def snapshot(self, rank: RankState, msg: Snapshot) -> SnapshotResult:
        """Apply a snapshot from `rank`'s open connection."""
        refused = self.registry.refusal(rank, msg.seq)
        if refused is not None:
            return SnapshotResult(ignored=True, refused=refused)
        conflict = self._writer_of(rank, msg) if rank.rejoined else None
        self.registry.accept_snapshot(rank, msg.seq)
        if msg.help:
            self.help.update((family, text) for family, text in msg.help.items() if family in self.catalog)
        updates, rejections = self.reader.read(rank, msg.samples)
        self.ledger.apply(rank, updates)
        rank.history.record(rank.last_activity, rank.positions)
        return SnapshotResult(applied=len(msg.samples) - len(rejections), rejections=rejections, conflict=conflict)

    def _writer_of(self, rank: RankState, msg: Snapshot) -> Rejection | None:
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

    def tick(self) -> None:
        """Mark silent ranks stale, then expired."""
        self.registry.tick()

    def exposed_ranks(self) -> list[RankState]:
        """Ranks whose per-rank series are on /metrics (all but expired), in exposition order."""
        return self.registry.exposed_ranks()
