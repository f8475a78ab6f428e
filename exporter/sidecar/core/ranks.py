"""The rank registry: identities, epochs, connections, staleness, expiry and their limits."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import TypeVar

from exporter.catalog import Catalog
from exporter.config import RanksConfig
from exporter.errors import ErrorCode, ProtocolError
from exporter.labels import static_label_problem
from exporter.protocol.messages import Hello, RankId, World
from exporter.sidecar.core.history import Positions, WindowHistory
from exporter.sidecar.core.keys import (
    GroupKey,
    Layout,
    SampleIdent,
    SeriesBudget,
    SeriesKey,
    SeriesRoute,
    StaticKey,
    Value,
    label_size,
    static_key,
)

log = logging.getLogger("hicache_exporter.ranks")
Clock = Callable[[], float]
RankIdentity = tuple[int, int, int, int, StaticKey]  # (tp_rank, pp_rank, dp_rank, attn_cp_rank, static labels)
REPLACED_EPOCHS_KEPT = 64


def rank_identity(tp_rank: int, pp_rank: int, dp_rank: int, attn_cp_rank: int | None, static: StaticKey) -> RankIdentity:
    """The one constructor of a rank identity: a rank without a context-parallel axis (None) is cp rank 0."""
    return (tp_rank, pp_rank, dp_rank, attn_cp_rank or 0, static)


PUSH_SOURCE = "push"  # the source of identities that ranks push over the socket; an upstream's is "upstream:<name>"
# The source of identities taken back from the durable state whose upstream is no longer configured: the
# first source that reports one continues it (a move from the proxy to push, or to another upstream).
RELEASED_SOURCE = "released"
# Position-history entries kept per rank per window (5 s apart at 60 s): bounds memory whatever the
# push rate. Not the status page's history of points (expose/status.py HISTORY_POINTS).
WINDOW_HISTORY_ENTRIES = 12
# How far a reconnect's first seq may pass the last one its epoch pushed: SEQ_JUMP_PER_SECOND for
# every second since that push, plus SEQ_JUMP_SLACK. Generous enough for a client that uses a
# nanosecond clock as its seq (about 2**30 a second); a forged 2**64-1 after a seq of 50 would
# need 544 years of silence. Past it the snapshot is refused (`seq_jump`).
SEQ_JUMP_PER_SECOND = 1 << 30
SEQ_JUMP_SLACK = 1 << 30


class RankStatus(str, Enum):
    """What the sidecar currently believes about a rank."""

    LIVE = "live"  # connected and pushing
    STALE = "stale"  # connected but silent for stale_after
    DEPARTED = "departed"  # disconnected; series stay until expiry
    EXPIRED = "expired"  # silent for expire_after: per-rank series are gone, rollups keep it


@dataclass(frozen=True, slots=True)
class Join:
    """A source's hello, typed: the rank identity it reports (rank keys and static labels) and its
    process start (epoch). The socket's listener makes one of each wire hello, the upstream feed one
    per rank it reads; the registry checks identities (static labels, ownership, limits) once, for both."""

    rank: RankId
    labels: dict[str, str]
    epoch: str
    pid: int
    world: World | None = None

    @classmethod
    def of(cls, hello: Hello) -> Join:
        """A wire hello (its shape already checked by the protocol's decoder) as the registry's record."""
        return cls(rank=hello.rank, labels=hello.labels, epoch=hello.epoch, pid=hello.pid, world=hello.world)


@dataclass(frozen=True, slots=True)
class Silence:
    """When a silent rank turns stale and expires: its status is derived from the clock when read,
    so reading never changes state and no housekeeping has to mark it."""

    clock: Clock
    stale_after: float  # ranks.stale_after_seconds
    expire_after: float  # ranks.expire_after_seconds


@dataclass(eq=False)
class RankState:
    """One rank identity across its epochs and connections: liveness, values as pushed, positions."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    static: StaticKey
    epoch: str
    pid: int
    history: WindowHistory
    silence: Silence
    attn_cp_rank: int | None = None  # None: the rank has no context-parallel axis (0 in its identity)
    source: str = PUSH_SOURCE  # who reports this identity: pushed ranks, or one upstream
    world: World | None = None
    connection: object | None = None  # token of the open connection holding this identity
    seq: int = -1  # the last seq this epoch pushed, on any connection
    connection_seq: int = -1  # the last seq of the open connection: seq is only compared within one
    # Said hello again with its known epoch and not pushed since: its first snapshot is checked
    # against the epoch's last seq (`seq_jump`) and values (`epoch_conflict`).
    rejoined: bool = False
    # Reconnects of this identity's epochs that changed writer (`epoch_conflict`): one whose values
    # went below what the epoch pushed, or that continued the epoch's other writer.
    epoch_conflicts: int = 0
    # The epoch's other writer, from before its last conflict: a writer that reconnects at or
    # above these values continues from them, so two writers taking turns each add only their own.
    other_writer: Writer | None = None
    cost: int = 0  # what `values` holds in series budget units (keys.series_cost)
    pushed: bool = False  # has pushed since it last connected: its gauges are current
    # The epoch of an identity its source had when the registry forgot it (to make room, or when
    # another source took the identity over): its per_shard rollups already hold what it pushed
    # before, so its first values this epoch are baselines.
    resumed: bool = False
    # Taken back from the durable state and not pushed since: its per-rank series wait for its next
    # push (they would read lower than what was shown before a crash; absent is not a reset).
    restored: bool = False
    restarts: int = 0
    reconnects: int = 0
    last_activity: float = 0.0  # monotonic time of the last hello or snapshot
    last_push_wall: float | None = None
    last_push: float | None = None  # monotonic time of the last snapshot accepted this epoch
    snapshots: int = 0
    version: int = 0  # bumped whenever `values` changes: exposition caches key on it
    values: dict[SeriesKey, Value] = field(default_factory=dict)  # this epoch's values, as pushed
    gauge_keys: dict[SeriesKey, None] = field(default_factory=dict)  # which of `values` are gauges, in push order
    # Counters and histogram sums made continuous across this identity's epochs: never decrease.
    positions: Positions = field(default_factory=dict)
    # Replicated histograms' positions by bucket, with their layout and sum (their watermarks need them).
    bucket_positions: dict[SeriesKey, tuple[Layout, list[int], float]] = field(default_factory=dict)
    layout_conflicts: set[SeriesKey] = field(default_factory=set)  # this epoch's, each logged once
    # The reader's caches: validated series by how samples name them, and the last snapshot's
    # (family, labels, route) by place, so most samples match with two equality tests.
    routes: dict[SampleIdent, SeriesRoute] = field(default_factory=dict)
    by_place: list[tuple[str, dict[str, str], SeriesRoute]] = field(default_factory=list)
    replaced_epochs: deque[str] = field(default_factory=lambda: deque(maxlen=REPLACED_EPOCHS_KEPT))
    shared: StaticKey = ()  # the static labels its replica group and rollups carry (derived ones left out)
    derived: frozenset[str] = frozenset()  # its profile's derived labels (Catalog.derived_labels)
    # What its labels write on each of its lines (keys.label_chars, keys.label_width): rank axes and
    # static labels, and the shared ones alone (its rollups'). Counted once; its series are weighed by
    # them (keys.series_cost).
    label_chars: int = 0
    label_width: int = 1
    shared_chars: int = 0
    shared_width: int = 1

    def __post_init__(self) -> None:
        self.shared = tuple(item for item in self.static if item[0] not in self.derived)
        self.shared_chars, self.shared_width = label_size(self.shared)
        self.count_label_chars()

    def count_label_chars(self) -> None:
        """Count `label_chars` again (its rank axes changed: a restart may add or drop attn_cp_rank)."""
        self.label_chars, self.label_width = label_size(self.label_dict().items())

    @property
    def identity(self) -> RankIdentity:
        return rank_identity(self.tp_rank, self.pp_rank, self.dp_rank, self.attn_cp_rank, self.static)

    @property
    def replica_group(self) -> GroupKey:
        return (self.dp_rank, self.shared)

    @property
    def stale(self) -> bool:
        """Silent for stale_after since its last hello or snapshot."""
        silence = self.silence
        return silence.clock() - self.last_activity >= silence.stale_after

    @property
    def expired(self) -> bool:
        """Silent for expire_after: its per-rank series are gone, its rollup contribution stays."""
        silence = self.silence
        return silence.clock() - self.last_activity >= silence.expire_after

    @property
    def connected(self) -> bool:
        return self.connection is not None

    @property
    def live(self) -> bool:
        return self.connected and not self.stale

    @property
    def current(self) -> bool:
        """Live and pushed since it connected: its gauges and window increases are up to date."""
        return self.live and self.pushed

    @property
    def status(self) -> RankStatus:
        silence = self.silence
        silent = silence.clock() - self.last_activity
        if silent >= silence.expire_after:
            return RankStatus.EXPIRED
        if self.connection is None:
            return RankStatus.DEPARTED
        return RankStatus.STALE if silent >= silence.stale_after else RankStatus.LIVE

    def label_dict(self) -> dict[str, str]:
        """Rank keys and static labels, as exposed on every per-rank series."""
        labels = {"tp_rank": str(self.tp_rank), "pp_rank": str(self.pp_rank), "dp_rank": str(self.dp_rank)}
        if self.attn_cp_rank is not None:
            labels["attn_cp_rank"] = str(self.attn_cp_rank)
        labels.update(self.static)
        return labels

    def describe(self) -> str:
        static = ",".join(f"{k}={v}" for k, v in self.static)
        cp = f" cp={self.attn_cp_rank}" if self.attn_cp_rank is not None else ""
        return f"tp={self.tp_rank} pp={self.pp_rank} dp={self.dp_rank}{cp}" + (f" {static}" if static else "")


@dataclass(eq=False)
class Writer:
    """One writer's values of an epoch, set aside while another writer pushes with that epoch."""

    values: dict[SeriesKey, Value]
    gauge_keys: dict[SeriesKey, None]
    cost: int  # in series budget units: the budget keeps counting them while they are set aside


def source_words(source: str) -> str:
    """Who reports an identity, for messages: "pushed ranks", "upstream <name>", or none (released)."""
    if source == RELEASED_SOURCE:
        return "no source (its upstream is no longer configured)"
    return "pushed ranks" if source == PUSH_SOURCE else source.replace(":", " ", 1)


CarriedT = TypeVar("CarriedT")


OLDER_POSITIONS_KEPT = 16  # at least this many series of older epochs carry on, or as many as the ended epoch reported


def _carried(positions: dict[SeriesKey, CarriedT], reported: dict[SeriesKey, Value]) -> dict[SeriesKey, CarriedT]:
    """The positions a new epoch carries on: every series the ended epoch reported, then series of
    older epochs, at most max(OLDER_POSITIONS_KEPT, series reported) of them. A replica that skipped
    a series for one epoch (a lazily made reason) keeps its place in that series' watermark, and
    epochs that each make new series leave at most about twice an epoch's series."""
    kept = {key: value for key, value in positions.items() if key in reported}
    room = max(OLDER_POSITIONS_KEPT, len(reported))
    for key, value in positions.items():
        if room <= 0:
            break
        if key not in kept:
            kept[key] = value
            room -= 1
    return kept


def replica_order(rank: RankState) -> tuple[int, int, int]:
    """How ranks sort inside a replica group: the lowest (pp_rank, attn_cp_rank, tp_rank) speaks for its gauges."""
    return (rank.pp_rank, rank.attn_cp_rank or 0, rank.tp_rank)


def exposition_order(rank: RankState) -> tuple[StaticKey, int, int, int, int]:
    """How ranks sort wherever they are listed: by static labels, then dp, pp, cp and tp rank."""
    return (rank.static, rank.dp_rank, rank.pp_rank, rank.attn_cp_rank or 0, rank.tp_rank)


@dataclass
class HelloResult:
    """How a hello relates to what the sidecar knew of that identity."""

    rank: RankState
    restart: bool = False
    reconnect: bool = False


class RankRegistry:
    """Every rank identity the sidecar knows, and the rules by which they come, restart and go."""

    def __init__(
        self, catalog: Catalog, config: RanksConfig, window_seconds: float,
        clock: Clock = time.monotonic, wall_clock: Clock = time.time,
    ) -> None:
        self.catalog = catalog
        self.config = config
        self.window = window_seconds
        self.clock = clock
        self.wall_clock = wall_clock
        self.ranks: dict[RankIdentity, RankState] = {}
        # By source, identity -> the epoch it had when forgotten, oldest first. Each source keeps
        # at most max_ranks of its own, so no source's churn can flush another's memory.
        self.forgotten: dict[str, dict[RankIdentity, str]] = {}
        self.budget = SeriesBudget(config.max_series_total)
        self.family_labels = frozenset(label for family in catalog for label in family.labels)  # not static labels
        self.derived = catalog.derived_labels
        self.silence = Silence(clock, config.stale_after_seconds, config.expire_after_seconds)

    def join(self, connection: object, msg: Join, source: str = PUSH_SOURCE) -> HelloResult:
        """Bind `connection` to the rank identity in `msg`, reported by `source`; raise ProtocolError to refuse it."""
        self._check_static_labels(msg.labels)
        static = static_key(msg.labels)
        identity = rank_identity(msg.rank.tp_rank, msg.rank.pp_rank, msg.rank.dp_rank, msg.rank.attn_cp_rank, static)
        rank = self.ranks.get(identity)
        if rank is not None and rank.source != source and not rank.connected and (
                rank.source == RELEASED_SOURCE or (rank.restored and rank.expired)):
            self._adopt(rank, msg, source)
        elif rank is not None and rank.source != source:
            self._check_owner(rank, source)  # raises while the owner holds it
            # Its owner went silent past expire_after: the identity is free. The owner is forgotten
            # as making room forgets (its rollup contribution stays, its epoch goes into its own
            # source's memory), so when it comes back its values are baselines again.
            self._forget(identity, rank)
            rank = None
        result: HelloResult
        if rank is None:
            self._make_room_for_a_rank()
            rank = RankState(
                tp_rank=msg.rank.tp_rank, pp_rank=msg.rank.pp_rank, dp_rank=msg.rank.dp_rank,
                static=static, epoch=msg.epoch, pid=msg.pid, attn_cp_rank=msg.rank.attn_cp_rank, source=source,
                history=WindowHistory(self.window, self.window / WINDOW_HISTORY_ENTRIES), silence=self.silence,
                resumed=self._remembered(identity, source) == msg.epoch, derived=self.derived,
            )
            self.ranks[identity] = rank
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
            self._restart(rank, msg.epoch)  # its series are gone: none was weighed by the labels it had
            rank.attn_cp_rank = msg.rank.attn_cp_rank
            rank.count_label_chars()
            result = HelloResult(rank, restart=True)
        else:
            rank.reconnects += 1
            rank.rejoined = True
            result = HelloResult(rank, reconnect=True)
        rank.pid = msg.pid
        rank.connection_seq = -1
        rank.world = msg.world
        rank.connection = connection
        rank.pushed = False
        rank.last_activity = self.clock()  # live again: not stale, not expired
        return result

    def _adopt(self, rank: RankState, msg: Join, source: str) -> None:
        """`source` continues an identity whose source is gone, in place, so that no history is counted twice.

        Gone: released (its upstream is no longer configured), or taken back from the durable state and
        not reported again within expire_after (a move between doors). A pushed hello's epoch, and any
        hello after pushed ranks, is a process start whose values count from zero: the usual restart
        (positions carry on). After another upstream, the values are the engine's own, which may have
        gone on since the state was saved: the hello is a reconnect of the identity's epoch under the new
        source's name, and its first snapshot continues the saved values (only the increase counts) or,
        below them, starts the epoch over in place (an engine restart; `epoch_conflict`)."""
        log.info("rank %s, last reported by %s, is continued by %s", rank.describe(), source_words(rank.source),
                 source_words(source))
        previous, rank.source = rank.source, source
        # The epochs the old source replaced are its own: the new source names its epochs afresh (an upstream
        # that starts without saved state reuses its first names), and the old source, should it come
        # back, is refused as another source (identity_owned) before any epoch is compared.
        rank.replaced_epochs.clear()
        if PUSH_SOURCE not in (source, previous) and msg.epoch != rank.epoch:
            rank.replaced_epochs.append(rank.epoch)
            rank.epoch = msg.epoch
            rank.last_push = None  # no seq to continue: the new source's seq starts where it likes

    def _check_owner(self, rank: RankState, source: str) -> None:
        """Refuse a hello from `source` for an identity another source holds, unless it expired.

        Pushed ranks and each upstream own the identities they report: an upstream listing a
        pushed rank's labels must not take that rank over while it restarts (the real rank
        would then be a duplicate), nor a pushed rank an upstream's."""
        if rank.expired and not rank.connected:
            return
        raise ProtocolError(
            ErrorCode.IDENTITY_OWNED,
            f"rank {rank.describe()} is reported by {source_words(rank.source)}, not {source_words(source)}: "
            "one identity has one source; give one of them a distinguishing static label (the identity "
            f"frees {self.config.expire_after_seconds:g} s after its source stops reporting it)",
        )

    def _forget(self, identity: RankIdentity, rank: RankState) -> None:
        """Drop an identity's per-rank memory; its rollup contribution stays."""
        del self.ranks[identity]
        self.budget.per_rank -= rank.cost
        self._drop_other_writer(rank)
        self.remember_forgotten(rank.source, identity, rank.epoch)

    def remember_forgotten(self, source: str, identity: RankIdentity, epoch: str) -> None:
        """Remember that `source`'s `identity` was forgotten in `epoch`: back with that epoch, its values are baselines."""
        memory = self.forgotten.setdefault(source, {})
        memory.pop(identity, None)  # re-inserted last: the memory forgets oldest first
        memory[identity] = epoch
        if len(memory) > self.config.max_ranks:  # a bounded memory of whom this source had forgotten
            del memory[next(iter(memory))]

    def _remembered(self, identity: RankIdentity, source: str) -> str | None:
        """The epoch `identity` had when `source`'s rank of it was forgotten (taken out of memory), or None."""
        memory = self.forgotten.get(source)
        if memory is None:
            return None
        epoch = memory.pop(identity, None)
        if not memory:
            del self.forgotten[source]
        return epoch

    def _restart(self, rank: RankState, epoch: str) -> None:
        """A new process start: its values count from zero again, its positions carry on."""
        rank.replaced_epochs.append(rank.epoch)
        rank.epoch = epoch
        self._drop_other_writer(rank)  # it wrote the replaced epoch
        self._start_over(rank)
        rank.rejoined = False
        rank.restarts += 1

    def epoch_conflict(self, rank: RankState) -> None:
        """A reconnect's values went below both writers' of its epoch: a new writer. The epoch
        starts over in place, as a restart does (positions carry on from the last values, so no
        rollup falls), and the values of the connection that pushes now are the rank's from here.
        The writer it displaces is set aside (`other_writer`, in place of an earlier one)."""
        rank.epoch_conflicts += 1
        self._drop_other_writer(rank)
        rank.other_writer = Writer(rank.values, rank.gauge_keys, rank.cost)  # its cost stays in the budget
        rank.cost = 0
        rank.values = {}
        rank.gauge_keys = {}
        self._start_over(rank, carry_from=rank.other_writer.values)

    def resume_other_writer(self, rank: RankState) -> None:
        """A reconnect's values are at or above those of its epoch's other writer: that writer is
        back, and continues from its own values (only its increase counts); the writer it
        displaces is set aside in its place."""
        other = rank.other_writer
        assert other is not None
        rank.epoch_conflicts += 1
        rank.other_writer = Writer(rank.values, rank.gauge_keys, rank.cost)
        rank.values, rank.gauge_keys, rank.cost = other.values, other.gauge_keys, other.cost
        rank.layout_conflicts.clear()
        rank.resumed = False
        rank.version += 1

    def _drop_other_writer(self, rank: RankState) -> None:
        """Free the values of the epoch's set-aside writer (its epoch ended, or a new writer replaces it)."""
        if rank.other_writer is not None:
            self.budget.per_rank -= rank.other_writer.cost
            rank.other_writer = None

    def _start_over(self, rank: RankState, carry_from: dict[SeriesKey, Value] | None = None) -> None:
        """Values count from zero again; positions carry on (for the series in `carry_from`, the
        ended values by default, then older series' while there is room)."""
        ended = rank.values if carry_from is None else carry_from
        if ended:
            rank.positions = _carried(rank.positions, ended)
            rank.bucket_positions = _carried(rank.bucket_positions, ended)
        self.budget.per_rank -= rank.cost
        rank.cost = 0
        rank.values.clear()
        rank.gauge_keys.clear()
        rank.layout_conflicts.clear()
        rank.resumed = False
        rank.version += 1
        rank.seq = -1
        rank.last_push = None

    def _make_room_for_a_rank(self) -> None:
        """Forget expired identities when the registry is full; refuse the hello if none is expired."""
        if len(self.ranks) < self.config.max_ranks:
            return
        for identity, rank in list(self.ranks.items()):
            if rank.expired and not rank.connected:
                self._forget(identity, rank)  # its rollup contribution stays; only the per-rank memory goes
        if len(self.ranks) >= self.config.max_ranks:
            raise ProtocolError(
                ErrorCode.TOO_MANY_RANKS,
                f"the sidecar already tracks max_ranks={self.config.max_ranks} rank identities",
            )

    def _check_static_labels(self, labels: dict[str, str]) -> None:
        limits = self.config
        if len(labels) > limits.max_static_labels:
            raise ProtocolError(
                ErrorCode.INVALID_HELLO,
                f"{len(labels)} static labels; at most {limits.max_static_labels} are allowed",
            )
        for name, value in labels.items():
            problem = static_label_problem(name, value, family_labels=self.family_labels,
                                           max_value_length=limits.max_label_value_length)
            if problem:
                raise ProtocolError(ErrorCode.INVALID_HELLO, f"static label: {problem}")
        total = sum(map(len, labels.values()))
        if total > limits.max_static_label_chars:
            raise ProtocolError(
                ErrorCode.INVALID_HELLO,
                f"static labels: their values have {total} characters together; at most "
                f"{limits.max_static_label_chars} are allowed (ranks.max_static_label_chars): every per-rank line "
                "on /metrics carries them",
            )

    def disconnect(self, connection: object, rank: RankState) -> None:
        """The connection holding `rank` closed (bye, EOF or error)."""
        if rank.connection is connection:
            rank.connection = None
            rank.pushed = False

    def refusal(self, rank: RankState, seq: int) -> tuple[ErrorCode, str] | None:
        """Why a snapshot with `seq` is ignored, or None to apply it.

        seq is compared within one connection only: a seq another connection of the epoch sent
        (an impostor's 2**64-1) cannot hold back the rank's own. A reconnect's first snapshot
        may not jump absurdly past the epoch's last seq (SEQ_JUMP_PER_SECOND)."""
        if seq <= rank.connection_seq:
            return ErrorCode.OLD_SEQ, f"seq {seq} is not above this connection's last ({rank.connection_seq})"
        if rank.rejoined and rank.last_push is not None:
            allowed = rank.seq + SEQ_JUMP_SLACK + int(max(0.0, self.clock() - rank.last_push) * SEQ_JUMP_PER_SECOND)
            if seq > allowed:
                return ErrorCode.SEQ_JUMP, (
                    f"rank {rank.describe()} reconnected with epoch {rank.epoch!r} and seq {seq}, but that epoch "
                    f"last pushed seq {rank.seq}: no client pushes that many snapshots in between; refused as a "
                    "forged or corrupted seq (seq rises by one per push)"
                )
        return None

    def accept_snapshot(self, rank: RankState, seq: int) -> None:
        """Note the arrival of a snapshot `refusal` let through."""
        rank.seq = seq
        rank.connection_seq = seq
        rank.rejoined = False
        rank.restored = False
        rank.pushed = True
        rank.last_activity = self.clock()  # live again: not stale, not expired
        rank.last_push_wall = self.wall_clock()
        rank.last_push = rank.last_activity
        rank.snapshots += 1

    def exposed_ranks(self) -> list[RankState]:
        """Ranks whose per-rank series are on /metrics (all but expired ones, and restored ones until they
        push), in exposition order."""
        return sorted((r for r in self.ranks.values() if not r.expired and not r.restored), key=exposition_order)

    def groups(self) -> dict[GroupKey, list[RankState]]:
        """Known ranks by replica group, each group in replica order."""
        groups: dict[GroupKey, list[RankState]] = {}
        for rank in sorted(self.ranks.values(), key=replica_order):
            groups.setdefault(rank.replica_group, []).append(rank)
        return groups
