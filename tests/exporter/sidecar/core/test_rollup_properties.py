"""Property tests of the rollup ledger (DESIGN section 6) over random operation sequences.

A hypothesis state machine runs two replica groups (dp 0 and 1) of three replicas each
((tp, pp) in (0, 0), (1, 0), (0, 1)) against SidecarState. Each group does logical work that
every live replica counts (a replicated counter and a replicated histogram); each rank also
moves its own bytes (a per_shard counter and histogram). Replicas push at different instants
and name any subset of their series; ranks disconnect, reconnect, restart gracefully (a last
push first) or crash (unpushed counts lost), whole groups crash, and time passes (stale,
expired). The sidecar saves its durable state (core/saved.py's `dump`, encoded as the state
file encodes it) and restarts from the last save: a fresh SidecarState takes the saved bytes
back (`restore`), everything not yet saved forgotten; the connected ranks say hello again with
their epochs, and some of them push their cumulative values at once, the others at their next
push. After every step:

(a) no rollup decreases while one sidecar lives (counters, and every histogram bucket and sum);
    a restart serves exactly the saved rollups before any rank is back; and at a settled point
    (every rank has pushed again each series it ever pushed in its epoch) no rollup is below the
    highest value it ever had, across restarts, less the one loss (below) incurred since;
(b) the per_shard rollup is the sum over every rank ever seen of its position: the sum over
    its epochs of the last value each epoch reported to the sidecar (to the sidecar before a
    restart only as far as its last save);
(c) the replicated rollup is, summed over groups, the furthest position of the group's
    replicas (bucket by bucket for the histogram), and never more than the group's logical
    count;
(d) at a settled point, where each group has a replica that never restarted and pushed after
    the group's last work, the replicated rollup is that replica's per-rank value, summed over
    groups: exactly the logical count;
(e) at a settled point, the per_shard rollups are the truth, the sum over every rank of the
    last value each of its epochs pushed to any sidecar, less the one loss: what an epoch
    pushed after the sidecar's last save, when the rank started a new epoch before pushing it
    to the restarted sidecar (after the save and before the restart, or after the restart
    before it pushed again). The model counts that loss where it happens; without such an
    interleaving it is zero and the rollups are the truth exactly.

The runs are derandomized, so the suite is deterministic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from exporter.catalog import default_catalog
from exporter.config import RanksConfig
from exporter.protocol.messages import Hello, HistogramSample, RankId, ScalarSample, Snapshot
from exporter.sidecar.core import saved as core_saved
from exporter.sidecar.core.keys import RollupKey
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.state import SidecarState

BYTES = "load_back_bytes_total"  # per_shard counter
TOKENS = "load_back_tokens_total"  # replicated counter, pool=kv
DURATION = "load_back_duration_seconds"  # per_shard histogram
PGS = "prefetch_pgs"  # replicated histogram
FAMILIES = (BYTES, DURATION, PGS, TOKENS)

CATALOG = default_catalog()
STATIC = {"cache_type": "UnifiedRadixCache"}
STATIC_KEY = tuple(sorted(STATIC.items()))
STALE_AFTER = 10.0
EXPIRE_AFTER = 30.0
GROUPS = (0, 1)
REPLICAS = ((0, 0), (1, 0), (0, 1))  # (tp, pp)


def _layout(family: str) -> tuple[float | str, ...]:
    buckets = CATALOG.get(family).buckets
    assert buckets is not None
    return (*buckets, "+Inf")


N_DURATION = len(_layout(DURATION))
N_PGS = len(_layout(PGS))
ROLLUP: dict[str, RollupKey] = {
    BYTES: (BYTES, STATIC_KEY, ()), TOKENS: (TOKENS, STATIC_KEY, ("kv",)),
    DURATION: (DURATION, STATIC_KEY, ()), PGS: (PGS, STATIC_KEY, ()),
}
PROPERTY_SETTINGS = settings(
    max_examples=200, stateful_step_count=50, deadline=None, derandomize=True, database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Histo:
    """Per-bucket (not cumulative) observation counts and their sum."""

    counts: list[int]
    sum: float = 0.0

    def copy(self) -> Histo:
        return Histo(list(self.counts), self.sum)

    def minus(self, other: Histo) -> Histo:
        return Histo([a - b for a, b in zip(self.counts, other.counts)], self.sum - other.sum)

    def cumulative(self) -> list[int]:
        return list(itertools.accumulate(self.counts))


def _flat(value: object) -> list[float]:
    """A reported value as the ledger holds it: a counter's value, or a histogram's cumulative buckets, then its sum."""
    if isinstance(value, Histo):
        return [*map(float, value.cumulative()), value.sum]
    return [float(value)]  # type: ignore[arg-type]


def _plus(a: list[float], b: list[float]) -> list[float]:
    return [x + y for x, y in zip(a, b)]


def _minus(a: list[float], b: list[float]) -> list[float]:
    return [x - y for x, y in zip(a, b)]


@dataclass
class Group:
    """A replica group's logical work: what every live replica of it counts."""

    tokens: int = 0
    pgs: Histo = field(default_factory=lambda: Histo([0] * N_PGS))


@dataclass
class Proc:
    """One rank: its process's counts since its epoch began, and what the sidecar was told."""

    tp: int
    pp: int
    dp: int
    epoch_no: int = 1
    conn: object | None = None
    rank: RankState | None = None
    seq: int = 0
    restarted: bool = False
    # The group's logical counts when this epoch began: the process counts from there.
    tokens_start: int = 0
    pgs_start: Histo = field(default_factory=lambda: Histo([0] * N_PGS))
    bytes: int = 0  # its own shard's bytes this epoch
    duration: Histo = field(default_factory=lambda: Histo([0] * N_DURATION))
    # Last value reported per series in this epoch, and the sum of earlier epochs' last values,
    # as the sidecar holds them (a sidecar restart takes them back to its last save).
    reported: dict[str, object] = field(default_factory=dict)
    earlier: dict[str, list[float]] = field(default_factory=dict)
    # The same as the rank pushed them, to whichever sidecar: the truth no restart of the sidecar forgets.
    pushed: dict[str, object] = field(default_factory=dict)
    truth_earlier: dict[str, list[float]] = field(default_factory=dict)
    # The one loss, per series: what ended epochs pushed that no sidecar kept (truth_earlier - earlier).
    lost: dict[str, list[float]] = field(default_factory=dict)
    pushed_after_work: bool = False

    @property
    def epoch(self) -> str:
        return f"r{self.tp}{self.pp}{self.dp}-e{self.epoch_no}"

    def values(self, group: Group) -> dict[str, object]:
        """What the process would push now for each series (cumulative since its epoch began)."""
        return {
            BYTES: self.bytes, TOKENS: group.tokens - self.tokens_start,
            DURATION: self.duration.copy(), PGS: group.pgs.minus(self.pgs_start),
        }

    def position(self, family: str) -> list[float]:
        """The model's position: earlier epochs' last values plus this epoch's (per cumulative bucket, then sum)."""
        return _position(self.earlier, self.reported, family)

    def truth(self, family: str) -> list[float]:
        """The position had every push reached a sidecar that never forgot it."""
        return _position(self.truth_earlier, self.pushed, family)

    def loss(self, family: str) -> list[float]:
        return list(self.lost.get(family, _zero(family)))

    def settled(self) -> bool:
        """Whether the sidecar holds every value this epoch pushed (none forgotten by a restart of it)."""
        return self.reported == self.pushed

    def new_epoch(self, group: Group) -> None:
        for family in FAMILIES:
            # What this epoch pushed to a sidecar that restarted since, and did not push again, is lost.
            forgotten = _minus(_flat_or_zero(self.pushed, family), _flat_or_zero(self.reported, family))
            self.lost[family] = _plus(self.loss(family), forgotten)
            self.earlier[family] = self.position(family)
            self.truth_earlier[family] = self.truth(family)
        self.reported = {}
        self.pushed = {}
        self.epoch_no += 1
        self.seq = 0
        self.restarted = True
        self.tokens_start, self.pgs_start = group.tokens, group.pgs.copy()
        self.bytes, self.duration = 0, Histo([0] * N_DURATION)
        self.pushed_after_work = False


def _zero(family: str) -> list[float]:
    return [0.0] * {BYTES: 1, TOKENS: 1, DURATION: N_DURATION + 1, PGS: N_PGS + 1}[family]


def _flat_or_zero(reported: dict[str, object], family: str) -> list[float]:
    last = reported.get(family)
    return _zero(family) if last is None else _flat(last)


def _position(earlier: dict[str, list[float]], reported: dict[str, object], family: str) -> list[float]:
    return _plus(earlier.get(family, _zero(family)), _flat_or_zero(reported, family))


@dataclass(frozen=True)
class SavedProc:
    """What the sidecar's last save held of one rank, in the model's terms."""

    epoch_no: int
    reported: dict[str, object]
    earlier: dict[str, list[float]]


@dataclass(frozen=True)
class Save:
    """The sidecar's last save: the file's core part, and what the model expects it to bring back."""

    data: bytes
    procs: list[SavedProc]
    rollups: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]]
    created: dict[RollupKey, float]


class LedgerMachine(RuleBasedStateMachine):
    """Random pushes, departures, restarts and time against SidecarState; the ledger's rules checked."""

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = self._new_state()
        self.groups = {dp: Group() for dp in GROUPS}
        self.procs = [Proc(tp, pp, dp) for dp in GROUPS for tp, pp in REPLICAS]
        self.previous: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]] = ({}, {})
        self.last_save: Save | None = None
        # Per rollup, the highest value it ever had plus the loss counted by then: at a settled
        # point the value plus the loss counted by now is at least that (a).
        self.ceiling: dict[RollupKey, list[float]] = {}
        # What /metrics shows with a state file: the rollups of the last save (none before the first),
        # as the keeper shows them (StateKeeper.load, then each write).
        self.state.show_rollups(({}, {}))
        self.shown: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]] = ({}, {})

    def _new_state(self) -> SidecarState:
        """A sidecar process's state: the same catalog, limits and clocks every time."""
        return SidecarState(
            CATALOG, ranks_config=RanksConfig(stale_after_seconds=STALE_AFTER, expire_after_seconds=EXPIRE_AFTER),
            clock=self.clock, wall_clock=lambda: 1_764_400_000.0 + self.clock.now,
        )

    # --- helpers ---

    def _pick(self, data: st.DataObject, candidates: list[Proc]) -> Proc:
        by_id = {(p.tp, p.pp, p.dp): p for p in candidates}
        return by_id[data.draw(st.sampled_from(sorted(by_id)), label="rank (tp, pp, dp)")]

    def _hello(self, p: Proc) -> None:
        p.conn = object()
        msg = Hello(protocol=1, epoch=p.epoch, pid=1000 + p.epoch_no,
                    rank=RankId(tp_rank=p.tp, pp_rank=p.pp, dp_rank=p.dp), labels=dict(STATIC))
        p.rank = self.state.hello(p.conn, msg).rank

    def _push(self, p: Proc, families: tuple[str, ...]) -> None:
        assert p.rank is not None and p.conn is not None
        now = p.values(self.groups[p.dp])
        samples: list[ScalarSample | HistogramSample] = []
        for family in families:
            value = now[family]
            if isinstance(value, Histo):
                counts = value.cumulative()
                samples.append(HistogramSample(family, list(zip(_layout(family), counts)), value.sum, counts[-1]))
            else:
                samples.append(ScalarSample(family, float(value), {"pool": "kv"} if family == TOKENS else {}))  # type: ignore[arg-type]
            p.reported[family] = value
            p.pushed[family] = value
        p.seq += 1
        result = self.state.snapshot(p.rank, Snapshot(seq=p.seq, time=self.clock.now, samples=samples))
        assert not result.ignored and result.rejections == [], result.rejections
        if TOKENS in families:
            p.pushed_after_work = True

    def _disconnect(self, p: Proc) -> None:
        if p.conn is not None:
            assert p.rank is not None
            self.state.disconnect(p.conn, p.rank)
            p.conn = None

    # --- rules ---

    @initialize()
    def start(self) -> None:
        for p in self.procs:
            self._hello(p)

    @rule(dp=st.sampled_from(GROUPS), tokens=st.integers(1, 4096),
          pgs=st.lists(st.integers(0, N_PGS - 1), max_size=3), eighths=st.integers(1, 64))
    def group_work(self, dp: int, tokens: int, pgs: list[int], eighths: int) -> None:
        """A group processes tokens: every replica of it counts them (reported at its next push)."""
        group = self.groups[dp]
        group.tokens += tokens
        for i in pgs:
            group.pgs.counts[i] += 1
        if pgs:
            group.pgs.sum += eighths / 8
        for p in self.procs:
            if p.dp == dp:
                p.pushed_after_work = False

    @rule(data=st.data(), moved=st.integers(1, 1 << 20), obs=st.lists(st.integers(0, N_DURATION - 1), max_size=3),
          eighths=st.integers(1, 64))
    def shard_work(self, data: st.DataObject, moved: int, obs: list[int], eighths: int) -> None:
        """One rank moves bytes of its own shard."""
        p = self._pick(data, self.procs)
        p.bytes += moved
        for i in obs:
            p.duration.counts[i] += 1
        if obs:
            p.duration.sum += eighths / 8

    @precondition(lambda self: any(p.conn is not None for p in self.procs))
    @rule(data=st.data(), families=st.sets(st.sampled_from((BYTES, TOKENS, DURATION, PGS)), min_size=1))
    def push(self, data: st.DataObject, families: set[str]) -> None:
        """A connected rank pushes some of its series, at its own instant."""
        self._push(self._pick(data, [p for p in self.procs if p.conn is not None]), tuple(sorted(families)))

    @precondition(lambda self: any(p.conn is not None for p in self.procs))
    @rule(data=st.data())
    def depart(self, data: st.DataObject) -> None:
        """A connection drops (the process lives on and keeps counting)."""
        self._disconnect(self._pick(data, [p for p in self.procs if p.conn is not None]))

    @precondition(lambda self: any(p.conn is None for p in self.procs))
    @rule(data=st.data())
    def reconnect(self, data: st.DataObject) -> None:
        """A departed rank comes back with the same epoch."""
        self._hello(self._pick(data, [p for p in self.procs if p.conn is None]))

    @rule(data=st.data(), graceful=st.booleans())
    def restart(self, data: st.DataObject, graceful: bool) -> None:
        """A rank's process restarts: gracefully (a last push of everything first) or by crashing."""
        p = self._pick(data, self.procs)
        if graceful and p.conn is not None:
            self._push(p, (BYTES, DURATION, PGS, TOKENS))
        self._disconnect(p)
        p.new_epoch(self.groups[p.dp])
        self._hello(p)

    @rule(dp=st.sampled_from(GROUPS))
    def group_crash(self, dp: int) -> None:
        """Every replica of one group crashes and restarts."""
        for p in self.procs:
            if p.dp == dp:
                self._disconnect(p)
                p.new_epoch(self.groups[dp])
                self._hello(p)

    @rule(seconds=st.sampled_from((1.0, STALE_AFTER, EXPIRE_AFTER)))
    def time_passes(self, seconds: float) -> None:
        """Time passes: silent ranks turn stale, then expire (derived from the clock when read)."""
        self.clock.now += seconds

    @rule()
    def save_state(self) -> None:
        """The sidecar saves its durable state (encoded as the state file's core part)."""
        data = msgspec.msgpack.encode(core_saved.dump(self.state))
        procs = [SavedProc(p.epoch_no, dict(p.reported), {f: list(v) for f, v in p.earlier.items()}) for p in self.procs]
        self.last_save = Save(data, procs, self._rollups(), dict(self.state.ledger.created))
        self.state.show_rollups(self.state.rollup_snapshot())  # on disk now: shown

    @precondition(lambda self: self.last_save is not None)
    @rule(data=st.data())
    def sidecar_restarts(self, data: st.DataObject) -> None:
        """The sidecar restarts from its last save, forgetting what came after it; the connected ranks say
        hello again (same epoch), and some push their cumulative values at once, the others later."""
        save = self.last_save
        assert save is not None
        self.state = self._new_state()
        restored = core_saved.restore(self.state, msgspec.msgpack.decode(save.data, type=core_saved.SavedCore))
        assert restored.dropped == {} and restored.identities == len(self.procs), restored
        # Never absent, never lower than the file: the saved rollups are served before any rank is back.
        assert self._rollups() == save.rollups
        assert self.state.ledger.created == save.created  # their start times too: no reset to Prometheus
        self.state.show_rollups(self.state.rollup_snapshot())  # the loaded rollups, shown at once
        self.previous = save.rollups
        connected = []
        for p, was in zip(self.procs, save.procs):
            if p.epoch_no == was.epoch_no:
                p.reported, p.earlier = dict(was.reported), {f: list(v) for f, v in was.earlier.items()}
            else:
                # It started a new epoch after the save: the restored identity ends at its saved position,
                # and what its ended epochs moved after the save is the one loss.
                saved_position = {f: _position(was.earlier, was.reported, f) for f in FAMILIES}
                for f in FAMILIES:
                    p.lost[f] = _plus(p.loss(f), _minus(p.earlier.get(f, _zero(f)), saved_position[f]))
                p.earlier, p.reported = saved_position, {}
            p.pushed_after_work = False
            if p.conn is not None:
                connected.append(p)
            p.conn, p.rank = None, None
        for p in connected:
            self._hello(p)
        for p in connected:
            if data.draw(st.booleans(), label=f"rank {(p.tp, p.pp, p.dp)} pushes at once"):
                self._push(p, FAMILIES)

    @rule()
    def every_rank_pushes(self) -> None:
        """Every rank is back and pushes all its series: a settled point, after a restart of the sidecar too."""
        for p in self.procs:
            if p.conn is None:
                self._hello(p)
            self._push(p, FAMILIES)

    # --- invariants ---

    def _rollups(self) -> tuple[dict[RollupKey, float], dict[RollupKey, list[float]]]:
        ledger = self.state.ledger
        return dict(ledger.counters), {k: [*v.counts, v.sum] for k, v in ledger.histograms.items()}

    @invariant()
    def rollups_never_decrease(self) -> None:
        """(a)"""
        counters, histograms = self._rollups()
        old_counters, old_histograms = self.previous
        for key, value in old_counters.items():
            assert counters[key] >= value, (key, value, counters[key])
        for key, old in old_histograms.items():
            assert all(new >= was for new, was in zip(histograms[key], old)), (key, old, histograms[key])
        self.previous = (counters, histograms)

    @invariant()
    def shown_rollups_never_decrease(self) -> None:
        """What /metrics shows with a state file never falls, across every restart of the sidecar, with no
        allowance for the one loss (it is what the last save holds, and a restart starts from it)."""
        counters = dict(self.state.rollup_counters())
        histograms = {k: [*v.counts, v.sum] for k, v in self.state.rollup_histograms().items()}
        old_counters, old_histograms = self.shown
        for key, value in old_counters.items():
            assert counters.get(key, -1.0) >= value, (key, value, counters.get(key))
        for key, old in old_histograms.items():
            assert key in histograms and all(new >= was for new, was in zip(histograms[key], old)), (key, old)
        self.shown = (counters, histograms)

    @invariant()
    def settled_rollups_never_below_their_highest(self) -> None:
        """(a), across restarts of the sidecar: at a settled point, at least the highest value less the loss since."""
        counters, histograms = self._rollups()
        now = {**{k: [v] for k, v in counters.items()}, **histograms}
        keys = set(now) | set(self.ceiling)  # a rollup a restart forgot, and no rank pushed since, reads as zero
        with_loss = {key: _plus(now.get(key, _zero(key[0])), self._loss(key[0])) for key in keys}
        if all(p.settled() for p in self.procs):
            for key, ceiling in self.ceiling.items():
                assert all(a >= b for a, b in zip(with_loss[key], ceiling)), (key, ceiling, with_loss[key])
        for key, value in with_loss.items():
            self.ceiling[key] = [max(a, b) for a, b in zip(value, self.ceiling.get(key, value))]

    def _loss(self, family: str) -> list[float]:
        loss = _zero(family)
        for p in self.procs:
            loss = _plus(loss, p.loss(family))
        return loss

    @invariant()
    def per_shard_rollup_is_the_sum_of_positions(self) -> None:
        """(b)"""
        counters, histograms = self._rollups()
        assert counters.get(ROLLUP[BYTES], 0.0) == sum(p.position(BYTES)[0] for p in self.procs)
        if ROLLUP[DURATION] in histograms:
            assert histograms[ROLLUP[DURATION]] == [sum(col) for col in zip(*(p.position(DURATION) for p in self.procs))]

    @invariant()
    def replicated_rollup_is_the_sum_of_watermarks(self) -> None:
        """(c)"""
        counters, histograms = self._rollups()
        furthest = {dp: max(p.position(TOKENS)[0] for p in self.procs if p.dp == dp) for dp in GROUPS}
        assert counters.get(ROLLUP[TOKENS], 0.0) == sum(furthest.values())
        assert counters.get(ROLLUP[TOKENS], 0.0) <= sum(g.tokens for g in self.groups.values())
        if ROLLUP[PGS] in histograms:
            marks = [[max(col) for col in zip(*(p.position(PGS) for p in self.procs if p.dp == dp))] for dp in GROUPS]
            assert histograms[ROLLUP[PGS]] == [sum(col) for col in zip(*marks)]

    @invariant()
    def settled_rollup_is_one_replica_per_group(self) -> None:
        """(d)"""
        witnesses = []
        for dp in GROUPS:
            steady = [p for p in self.procs if p.dp == dp and not p.restarted and p.conn is not None and p.pushed_after_work]
            if not steady:
                return
            witnesses.append(steady[0])
        per_rank = [w.rank.values[(TOKENS, ("kv",))] for w in witnesses if w.rank is not None]
        rollup = self.state.ledger.counters[ROLLUP[TOKENS]]
        assert rollup == sum(per_rank) == sum(g.tokens for g in self.groups.values())

    @invariant()
    def settled_per_shard_rollups_are_the_truth_less_the_one_loss(self) -> None:
        """(e)"""
        if not all(p.settled() for p in self.procs):
            return
        counters, histograms = self._rollups()
        truth = [sum(p.truth(BYTES)[0] for p in self.procs)]
        assert [counters.get(ROLLUP[BYTES], 0.0)] == _minus(truth, self._loss(BYTES))
        if ROLLUP[DURATION] in histograms:
            truth = [sum(col) for col in zip(*(p.truth(DURATION) for p in self.procs))]
            assert histograms[ROLLUP[DURATION]] == _minus(truth, self._loss(DURATION))


TestLedgerProperties = LedgerMachine.TestCase
TestLedgerProperties.settings = PROPERTY_SETTINGS


# --- two writers taking turns on one epoch (review 19, finding 6) ---

TURNS = st.lists(
    st.tuples(st.sampled_from((0, 1)), st.lists(st.integers(0, 1_000), min_size=1, max_size=3)),
    min_size=1, max_size=20,
)


@PROPERTY_SETTINGS
@given(family=st.sampled_from((BYTES, TOKENS)), turns=TURNS)
def test_two_writers_taking_turns_on_one_epoch_add_no_more_than_their_own_increases(
    family: str, turns: list[tuple[int, list[int]]],
) -> None:
    """A rank (writer 0) and an impostor (writer 1) reconnect with one epoch in turns, each pushing
    its own rising count from zero. However they interleave, the rollup never falls, holds at
    least the furthest count either reached, and never more than the two counts together: each
    writer adds only its own increases, never the other's count over again."""
    clock = FakeClock()
    state = SidecarState(CATALOG, clock=clock, wall_clock=lambda: 1_764_400_000.0 + clock.now)
    key = (TOKENS, ("kv",)) if family == TOKENS else (BYTES, ())
    rollup_key = (family, STATIC_KEY, key[1])
    counts = [0, 0]
    seq = itertools.count(1)
    conn: object | None = None
    rank: RankState | None = None
    last_rollup = 0.0
    for writer, increases in [(0, [0]), *turns]:  # the rank says hello first
        if conn is not None and rank is not None:
            state.disconnect(conn, rank)
        conn = object()
        msg = Hello(protocol=1, epoch="E", pid=1 + writer, rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels=STATIC)
        rank = state.hello(conn, msg).rank
        for increase in increases:
            counts[writer] += increase
            sample = ScalarSample(family, float(counts[writer]), dict(zip(("pool",), key[1])))
            result = state.snapshot(rank, Snapshot(seq=next(seq), time=clock.now, samples=[sample]))
            assert not result.ignored and result.rejections == []
            assert rank.values[key] == counts[writer]  # per-rank series show the writer that pushes now
            rollup = state.ledger.counters[rollup_key]
            assert last_rollup <= rollup  # never falls
            assert max(counts) <= rollup <= sum(counts), (counts, rollup)
            last_rollup = rollup
            clock.now += 1.0
