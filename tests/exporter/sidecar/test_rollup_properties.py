"""Property tests of the rollup contracts (DESIGN section 6) over random operation sequences.

A hypothesis state machine drives SidecarState over a small rank layout (tp, pp, dp in {0, 1})
with hellos, snapshots, resent snapshots, disconnects, restarts, reconnects and clock jumps,
and checks after every step:

(a) every rollup counter, rollup histogram bucket and count never decreases;
(b) while leadership has never changed (no restart, disconnect or staleness, and in each dp
    group the first rank to push has the lowest (pp_rank, tp_rank) of all that pushed),
    the per_shard rollup is the sum of every rank's current values and the replicated rollup
    is the sum over dp groups of the leader's current value;
(c) (SharedReplicaMachine) when the replicas of one group report one logical token count, the
    replicated rollup never exceeds the highest count any replica reported: nothing is
    counted twice, whatever the takeovers, reconnects, staleness and partial snapshots.

The runs are derandomized, so the suite is deterministic.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from exporter.catalog import default_catalog
from exporter.config import RanksConfig
from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.messages import Hello, HistogramSample, RankId, ScalarSample, Snapshot
from exporter.sidecar.ranks import RankState
from exporter.sidecar.series import RollupKey, SeriesKey
from exporter.sidecar.state import SidecarState

BYTES = "load_back_bytes_total"  # per_shard counter
TOKENS = "load_back_tokens_total"  # replicated counter, pool=kv
DURATION = "load_back_duration_seconds"  # per_shard histogram
PGS = "prefetch_pgs"  # replicated histogram

CATALOG = default_catalog()
STATIC = {"cache_type": "UnifiedRadixCache"}
STATIC_KEY = tuple(sorted(STATIC.items()))
STALE_AFTER = 10.0
EXPIRE_AFTER = 30.0
LAYOUT: tuple[tuple[int, int, int], ...] = tuple(
    (tp, pp, dp) for dp in (0, 1) for pp in (0, 1) for tp in (0, 1)
)


def _bounds(family: str) -> tuple[float, ...]:
    buckets = CATALOG.get(family).buckets
    assert buckets is not None
    return buckets


N_DURATION = len(_bounds(DURATION)) + 1
N_PGS = len(_bounds(PGS)) + 1

SERIES: dict[str, SeriesKey] = {
    BYTES: (BYTES, ()),
    TOKENS: (TOKENS, ("kv",)),
    DURATION: (DURATION, ()),
    PGS: (PGS, ()),
}
ROLLUP: dict[str, RollupKey] = {name: (name, STATIC_KEY, key[1]) for name, key in SERIES.items()}

PROPERTY_SETTINGS = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


class FakeClock:
    """A monotonic clock moved by the state machine."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class ModelRank:
    """What one rank process has sent in its current epoch (values are cumulative)."""

    tp: int
    pp: int
    dp: int
    epoch_no: int = 0
    conn: object | None = None
    rank: RankState | None = None
    seq: int = 0
    bytes: int = 0
    tokens: int = 0
    duration: list[int] = field(default_factory=lambda: [0] * N_DURATION)  # per bucket, not cumulative
    duration_sum: float = 0.0
    pgs: list[int] = field(default_factory=lambda: [0] * N_PGS)
    pgs_sum: float = 0.0
    sent: set[SeriesKey] = field(default_factory=set)  # series named in this epoch
    last_snapshot: Snapshot | None = None
    last_activity: float = 0.0
    pushed_ever: bool = False

    @property
    def order(self) -> tuple[int, int]:
        return (self.pp, self.tp)

    @property
    def epoch(self) -> str:
        return f"r{self.tp}{self.pp}{self.dp}-e{self.epoch_no}"

    def reset_epoch(self) -> None:
        self.epoch_no += 1
        self.seq = 0
        self.bytes = self.tokens = 0
        self.duration = [0] * N_DURATION
        self.pgs = [0] * N_PGS
        self.duration_sum = self.pgs_sum = 0.0
        self.sent = set()
        self.last_snapshot = None


def cumulative(per_bucket: list[int]) -> list[int]:
    return list(itertools.accumulate(per_bucket))


def histogram_sample(family: str, per_bucket: list[int], total: float) -> HistogramSample:
    counts = cumulative(per_bucket)
    pairs: list[tuple[float | str, int]] = list(zip((*_bounds(family), "+Inf"), counts))
    return HistogramSample(family=family, labels={}, buckets=pairs, sum=total, count=counts[-1])


def observations(n_buckets: int) -> st.SearchStrategy[list[int]]:
    """Bucket indices of new observations (possibly none)."""
    return st.lists(st.integers(0, n_buckets - 1), max_size=4)


class RollupMachine(RuleBasedStateMachine):
    """Drives SidecarState with random protocol traffic and checks the rollup contracts."""

    LAYOUT: tuple[tuple[int, int, int], ...] = LAYOUT  # (tp, pp, dp) of every rank
    ALLOW_DISRUPTION = True  # disconnect, restart, reconnect and long clock jumps
    ALLOW_RESTART = True
    ALLOW_NOISE = True  # resent snapshots and refused duplicate hellos
    CLOCK_STEPS: tuple[float, ...] = (1.0, 4.0, STALE_AFTER, EXPIRE_AFTER)

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.state = SidecarState(
            CATALOG,
            ranks_config=RanksConfig(stale_after_seconds=STALE_AFTER, expire_after_seconds=EXPIRE_AFTER),
            clock=self.clock,
            wall_clock=lambda: 1_764_400_000.0 + self.clock.now,
        )
        self.model = [ModelRank(tp, pp, dp) for tp, pp, dp in self.LAYOUT]
        self.first_pusher_order: dict[int, tuple[int, int]] = {}
        self.leadership_changed = False  # once True, (b) is no longer expected to hold
        self.previous: tuple[dict[RollupKey, float], dict[RollupKey, list[float]]] = ({}, {})
        self.b_checks = 0  # diagnostic: how many steps checked (b)

    # --- helpers ---

    def _connected(self) -> list[ModelRank]:
        return [m for m in self.model if m.conn is not None]

    def _disconnected(self) -> list[ModelRank]:
        return [m for m in self.model if m.conn is None]

    def _seen(self) -> list[ModelRank]:
        return [m for m in self.model if m.rank is not None]

    def _pick(self, data: st.DataObject, candidates: list[ModelRank]) -> ModelRank:
        """Draw one of `candidates`, shown in falsifying examples as its (tp, pp, dp)."""
        by_position = {(m.tp, m.pp, m.dp): m for m in candidates}
        return by_position[data.draw(st.sampled_from(sorted(by_position)), label="rank (tp, pp, dp)")]

    def _hello(self, m: ModelRank) -> object:
        conn = object()
        msg = Hello(
            protocol=1,
            epoch=m.epoch,
            pid=1000 + m.epoch_no,
            rank=RankId(tp_rank=m.tp, pp_rank=m.pp, dp_rank=m.dp),
            labels=dict(STATIC),
        )
        result = self.state.hello(conn, msg)
        m.conn = conn
        m.rank = result.rank
        m.last_activity = self.clock.now
        return result

    def tokens_value(self, m: ModelRank, increment: int) -> int:
        """The replicated counter's new cumulative value for `m` (independent per rank here)."""
        return m.tokens + increment

    # --- rules ---

    @initialize()
    def first_hello(self) -> None:
        m = self.model[0]
        m.epoch_no = 1
        result = self._hello(m)
        assert not result.restart and not result.reconnect

    @precondition(lambda self: any(m.conn is None and m.rank is None for m in self.model))
    @rule(data=st.data())
    def connect(self, data: st.DataObject) -> None:
        """A rank the sidecar has never seen says hello."""
        m = self._pick(data, [m for m in self._disconnected() if m.rank is None])
        m.epoch_no = 1
        result = self._hello(m)
        assert not result.restart and not result.reconnect

    @precondition(lambda self: any(m.conn is not None for m in self.model))
    @rule(
        data=st.data(),
        include=st.tuples(st.booleans(), st.booleans(), st.booleans(), st.booleans()),
        bytes_inc=st.integers(0, 1 << 20),
        tokens_inc=st.integers(0, 4096),
        duration_obs=observations(N_DURATION),
        pgs_obs=observations(N_PGS),
        sum_eighths=st.integers(0, 64),
    )
    def push(
        self,
        data: st.DataObject,
        include: tuple[bool, bool, bool, bool],
        bytes_inc: int,
        tokens_inc: int,
        duration_obs: list[int],
        pgs_obs: list[int],
        sum_eighths: int,
    ) -> None:
        """A connected rank pushes a snapshot naming some of its series."""
        m = self._pick(data, self._connected())
        samples: list[ScalarSample | HistogramSample] = []
        if include[0]:
            m.bytes += bytes_inc
            samples.append(ScalarSample(family=BYTES, labels={}, value=float(m.bytes)))
            m.sent.add(SERIES[BYTES])
        if include[1]:
            m.tokens = self.tokens_value(m, tokens_inc)
            samples.append(ScalarSample(family=TOKENS, labels={"pool": "kv"}, value=float(m.tokens)))
            m.sent.add(SERIES[TOKENS])
        if include[2]:
            for i in duration_obs:
                m.duration[i] += 1
            if duration_obs:  # a sum only moves with observations (the sidecar checks that)
                m.duration_sum += sum_eighths / 8
            samples.append(histogram_sample(DURATION, m.duration, m.duration_sum))
            m.sent.add(SERIES[DURATION])
        if include[3]:
            for i in pgs_obs:
                m.pgs[i] += 1
            if pgs_obs:
                m.pgs_sum += sum_eighths / 8
            samples.append(histogram_sample(PGS, m.pgs, m.pgs_sum))
            m.sent.add(SERIES[PGS])
        m.seq += 1
        msg = Snapshot(seq=m.seq, time=self.clock.now, samples=samples)
        assert m.rank is not None
        result = self.state.snapshot(m.rank, msg)
        assert not result.ignored
        assert result.rejections == []
        assert result.applied == len(samples)
        m.last_snapshot = msg
        m.last_activity = self.clock.now
        if not m.pushed_ever:
            m.pushed_ever = True
            first = self.first_pusher_order.setdefault(m.dp, m.order)
            if m.order < first:
                self.leadership_changed = True  # a lower-order rank takes over the group

    @precondition(
        lambda self: self.ALLOW_NOISE and any(m.conn is not None and m.last_snapshot is not None for m in self.model)
    )
    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """A repeated snapshot (same seq) is ignored and changes nothing."""
        m = self._pick(data, [m for m in self._connected() if m.last_snapshot is not None])
        assert m.rank is not None and m.last_snapshot is not None
        before = self._rollups()
        result = self.state.snapshot(m.rank, m.last_snapshot)
        assert result.ignored and result.applied == 0
        assert self._rollups() == before

    @precondition(lambda self: self.ALLOW_NOISE and any(m.conn is not None for m in self.model))
    @rule(data=st.data())
    def duplicate(self, data: st.DataObject) -> None:
        """A second hello for a connected identity is refused, whatever its epoch."""
        m = self._pick(data, self._connected())
        epoch = data.draw(st.sampled_from([m.epoch, m.epoch + "-other"]), label="epoch")
        msg = Hello(
            protocol=1, epoch=epoch, pid=1, rank=RankId(tp_rank=m.tp, pp_rank=m.pp, dp_rank=m.dp), labels=dict(STATIC)
        )
        with pytest.raises(ProtocolError) as err:
            self.state.hello(object(), msg)
        assert err.value.code is ErrorCode.DUPLICATE_RANK
        assert m.rank is not None and m.rank.connection is m.conn and m.rank.epoch == m.epoch

    @precondition(lambda self: self.ALLOW_DISRUPTION and any(m.conn is not None for m in self.model))
    @rule(data=st.data())
    def disconnect(self, data: st.DataObject) -> None:
        m = self._pick(data, self._connected())
        assert m.rank is not None
        self.state.disconnect(m.conn, m.rank)
        m.conn = None
        self.leadership_changed = True

    @precondition(lambda self: self.ALLOW_DISRUPTION and any(m.conn is None and m.rank is not None for m in self.model))
    @rule(data=st.data())
    def reconnect(self, data: st.DataObject) -> None:
        """A departed rank comes back with the same epoch: it continues its deltas."""
        m = self._pick(data, [m for m in self._disconnected() if m.rank is not None])
        result = self._hello(m)
        assert result.reconnect and not result.restart
        self.leadership_changed = True

    @precondition(lambda self: self.ALLOW_DISRUPTION and self.ALLOW_RESTART and any(m.rank is not None for m in self.model))
    @rule(data=st.data())
    def restart(self, data: st.DataObject) -> None:
        """The process behind a rank restarts: disconnect, then hello with a new epoch from zero."""
        m = self._pick(data, self._seen())
        assert m.rank is not None
        if m.conn is not None:
            self.state.disconnect(m.conn, m.rank)
            m.conn = None
        old_epoch = m.epoch
        m.reset_epoch()
        result = self._hello(m)
        assert result.restart and not result.reconnect
        self.leadership_changed = True
        # The replaced epoch never comes back.
        self.state.disconnect(m.conn, m.rank)
        with pytest.raises(ProtocolError) as err:
            self.state.hello(
                object(),
                Hello(
                    protocol=1, epoch=old_epoch, pid=1, rank=RankId(tp_rank=m.tp, pp_rank=m.pp, dp_rank=m.dp),
                    labels=dict(STATIC),
                ),
            )
        assert err.value.code is ErrorCode.STALE_EPOCH
        result = self._hello(m)
        assert result.reconnect

    @rule(data=st.data())
    def advance(self, data: st.DataObject) -> None:
        """Time passes; tick() marks silent ranks stale, then expired."""
        steps = self.CLOCK_STEPS if self.ALLOW_DISRUPTION else self.CLOCK_STEPS[:1]
        self.clock.now += data.draw(st.sampled_from(steps), label="seconds")
        self.state.tick()
        if any(self.clock.now - m.last_activity >= STALE_AFTER for m in self._seen()):
            self.leadership_changed = True
        for m in self._seen():
            assert m.rank is not None
            silent = self.clock.now - m.last_activity
            assert m.rank.stale == (silent >= STALE_AFTER)
            assert m.rank.expired == (silent >= EXPIRE_AFTER)
            assert (m.rank in self.state.exposed_ranks()) == (silent < EXPIRE_AFTER)

    # --- invariants ---

    def _rollups(self) -> tuple[dict[RollupKey, float], dict[RollupKey, list[float]]]:
        rollups = self.state.rollups
        return dict(rollups.counters), {k: list(v.counts) for k, v in rollups.histograms.items()}

    @invariant()
    def rollups_never_decrease(self) -> None:
        """(a) Rollup counters, histogram buckets and counts only go up."""
        counters, histograms = self._rollups()
        old_counters, old_histograms = self.previous
        for key, value in old_counters.items():
            assert key in counters and counters[key] >= value, (key, value, counters.get(key))
        for key, counts in old_histograms.items():
            assert key in histograms
            assert all(new >= old for new, old in zip(histograms[key], counts)), (key, counts, histograms[key])
        self.previous = (counters, histograms)

    @invariant()
    def per_rank_values_are_as_pushed(self) -> None:
        """Each rank holds exactly the series named in its current epoch, at their last values."""
        for m in self._seen():
            assert m.rank is not None
            assert set(m.rank.values) == m.sent
            if SERIES[BYTES] in m.sent:
                assert m.rank.values[SERIES[BYTES]] == m.bytes
            if SERIES[TOKENS] in m.sent:
                assert m.rank.values[SERIES[TOKENS]] == m.tokens
            if SERIES[DURATION] in m.sent:
                assert list(m.rank.values[SERIES[DURATION]].counts) == cumulative(m.duration)

    @invariant()
    def stable_leadership_sums(self) -> None:
        """(b) Without leadership changes: per_shard = sum of ranks; replicated = sum of group leaders."""
        if self.leadership_changed:
            return
        self.b_checks += 1
        counters = self.state.rollups.counters
        histograms = self.state.rollups.histograms
        assert counters.get(ROLLUP[BYTES], 0.0) == sum(m.bytes for m in self.model)
        leaders: dict[int, ModelRank] = {}
        for m in self.model:
            if m.pushed_ever and (m.dp not in leaders or m.order < leaders[m.dp].order):
                leaders[m.dp] = m
        for m in leaders.values():
            assert m.rank is not None and self.state.groups[m.rank.group].leader is m.rank
        assert counters.get(ROLLUP[TOKENS], 0.0) == sum(m.tokens for m in leaders.values())
        want_duration = [sum(col) for col in zip(*(cumulative(m.duration) for m in self.model))]
        got = histograms.get(ROLLUP[DURATION])
        assert (list(got.counts) if got else [0.0] * N_DURATION) == want_duration
        if got:
            assert got.sum == pytest.approx(sum(m.duration_sum for m in self.model))
        want_pgs = [sum(col) for col in zip(*([0] * N_PGS, *(cumulative(m.pgs) for m in leaders.values())))]
        got = histograms.get(ROLLUP[PGS])
        assert (list(got.counts) if got else [0.0] * N_PGS) == want_pgs
        if got:
            assert got.sum == pytest.approx(sum(m.pgs_sum for m in leaders.values()))


class StableRollupMachine(RollupMachine):
    """Only hellos, snapshots, resends, refused duplicates and short clock steps: (b) is checked often."""

    ALLOW_DISRUPTION = False


class SharedReplicaMachine(RollupMachine):
    """Replicas of a dp group report one logical token count, each as of its own last push.

    No restarts (a restarted process counts from zero, so it no longer reports the shared
    count); disconnects, reconnects, staleness and partial snapshots stay.
    """

    # One replica group: another group's undercount (lost baselines) cannot mask an overcount.
    LAYOUT = ((0, 0, 0), (1, 0, 0), (0, 1, 0))
    ALLOW_RESTART = False
    ALLOW_NOISE = False  # covered by the other machines; fewer rules reach takeovers sooner

    def __init__(self) -> None:
        super().__init__()
        self.logical: dict[int, int] = {dp: 0 for _, _, dp in self.LAYOUT}

    @rule(amount=st.integers(1, 4096))
    def work(self, amount: int) -> None:
        """The group processes tokens; each replica reports them at its next push."""
        self.logical[0] += amount

    def tokens_value(self, m: ModelRank, increment: int) -> int:
        return self.logical[m.dp]

    @invariant()
    def nothing_counted_twice(self) -> None:
        """(c) The replicated rollup is at most the highest logical count any replica reported."""
        reported = max(m.tokens for m in self.model)
        assert self.state.rollups.counters.get(ROLLUP[TOKENS], 0.0) <= reported


TestRollupProperties = RollupMachine.TestCase
TestRollupProperties.settings = PROPERTY_SETTINGS
TestStableRollupProperties = StableRollupMachine.TestCase
TestStableRollupProperties.settings = PROPERTY_SETTINGS
TestSharedReplicaProperties = SharedReplicaMachine.TestCase
# Without the shrink phase: a failure comes back in seconds rather than a minute; the minimal
# forms are unit tests in test_state.py (test_takeover_baseline_covers_series_*).
TestSharedReplicaProperties.settings = settings(
    PROPERTY_SETTINGS, phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target]
)
