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
from exporter.sidecar.reader import Rejection, SampleReader
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
        conflict: Rejection | None = None
        if rank.rejoined and self.reader.falls(rank, msg.samples):
            # Another process pushed with this epoch while the rank was away (epochs are public on
            # /api/v1/status): the values of the writer that pushes now are the rank's from here on,
            # continuing the positions, so per-rank series show them and no rollup falls.
            conflict = (ErrorCode.EPOCH_CONFLICT, (
                f"rank {rank.describe()} reconnected with epoch {rank.epoch!r} and values below what that epoch "
                "pushed before: another process pushed with this epoch. This connection's values count from "
                "here on (the epoch restarts in place); keep other processes off the socket (ingest.allowed_uids)"
            ))
            self.registry.epoch_conflict(rank)
        self.registry.accept_snapshot(rank, msg.seq)
        if msg.help:
            self.help.update((family, text) for family, text in msg.help.items() if family in self.catalog)
        updates, rejections = self.reader.read(rank, msg.samples)
        self.ledger.apply(rank, updates)
        rank.history.record(rank.last_activity, rank.positions)
        return SnapshotResult(applied=len(msg.samples) - len(rejections), rejections=rejections, conflict=conflict)

    def tick(self) -> None:
        """Mark silent ranks stale, then expired."""
        self.registry.tick()

    def exposed_ranks(self) -> list[RankState]:
        """Ranks whose per-rank series are on /metrics (all but expired), in exposition order."""
        return self.registry.exposed_ranks()
