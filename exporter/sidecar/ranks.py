"""One rank as the sidecar knows it: identity, epoch, liveness and the values it last pushed."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from exporter.protocol.messages import World
from exporter.sidecar.plans import SampleIdent, SeriesRoute
from exporter.sidecar.series import GroupKey, SeriesKey, StaticKey, Value
from exporter.sidecar.window import Totals, WindowHistory

RankIdentity = tuple[int, int, int, StaticKey]  # (tp_rank, pp_rank, dp_rank, static labels)
REPLACED_EPOCHS_KEPT = 64


class RankStatus(str, Enum):
    """What the sidecar currently believes about a rank."""

    LIVE = "live"  # connected and pushing
    STALE = "stale"  # connected but silent for stale_after
    DEPARTED = "departed"  # disconnected; series stay until expiry
    EXPIRED = "expired"  # silent for expire_after: per-rank series are gone, rollups keep it


@dataclass(eq=False)
class RankState:
    """Mutable state of one rank identity across its epochs and connections."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    static: StaticKey
    epoch: str
    pid: int
    history: WindowHistory
    world: World | None = None
    connection: object | None = None  # token of the open connection holding this identity
    seq: int = -1
    ready: bool = False  # pushed since it last became live: only then may it lead its group
    stale: bool = False
    expired: bool = False
    restarts: int = 0
    reconnects: int = 0
    last_activity: float = 0.0  # monotonic time of the last hello or snapshot
    last_push_wall: float | None = None
    snapshots: int = 0
    version: int = 0  # bumped whenever `values` changes: exposition caches key on it
    values: dict[SeriesKey, Value] = field(default_factory=dict)
    gauge_keys: set[SeriesKey] = field(default_factory=set)  # which of `values` are gauges
    routes: dict[SampleIdent, SeriesRoute] = field(default_factory=dict)  # validated series, by how samples name them
    # The last snapshot's (family, labels, route) by position: ranks send the same samples in the
    # same order, so most samples are matched by two equality tests, without hashing their strings.
    recent: list[tuple[str, dict[str, str], SeriesRoute]] = field(default_factory=list)
    totals: Totals = field(default_factory=dict)  # windowed series: sums of deltas across epochs
    # After taking over leadership: the replicated series whose baseline has been seen since.
    # Each series' first value after a takeover is a baseline, never a delta (None: no takeover).
    baselined: set[SeriesKey] | None = None
    replaced_epochs: deque[str] = field(default_factory=lambda: deque(maxlen=REPLACED_EPOCHS_KEPT))

    @property
    def identity(self) -> RankIdentity:
        return (self.tp_rank, self.pp_rank, self.dp_rank, self.static)

    @property
    def group(self) -> GroupKey:
        return (self.dp_rank, self.static)

    @property
    def order(self) -> tuple[int, int]:
        """Leader order inside a replica group: the lowest (pp_rank, tp_rank) leads."""
        return (self.pp_rank, self.tp_rank)

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def live(self) -> bool:
        return self.connected and not self.stale

    @property
    def eligible(self) -> bool:
        """May lead its replica group: live, and its values are fresh since it became live."""
        return self.live and self.ready

    @property
    def status(self) -> RankStatus:
        if self.expired:
            return RankStatus.EXPIRED
        if not self.connected:
            return RankStatus.DEPARTED
        return RankStatus.STALE if self.stale else RankStatus.LIVE

    def label_dict(self) -> dict[str, str]:
        """Rank keys and static labels, as exposed on every per-rank series."""
        labels = {"tp_rank": str(self.tp_rank), "pp_rank": str(self.pp_rank), "dp_rank": str(self.dp_rank)}
        labels.update(self.static)
        return labels

    def describe(self) -> str:
        static = ",".join(f"{k}={v}" for k, v in self.static)
        return f"tp={self.tp_rank} pp={self.pp_rank} dp={self.dp_rank}" + (f" {static}" if static else "")
