"""The proxy source: an engine's own prometheus_client metrics, read back as ranks of the sidecar's state.

An upstream is an engine's `/metrics` URL (text or OpenMetrics, parsed with prometheus_client's
parsers) or its `PROMETHEUS_MULTIPROC_DIR` (read with prometheus_client's multiprocess reader,
each process's files apart). Each series of a catalog family belongs to the rank its rank axes
name (static labels: the rest); the feed turns each rank's series into the core's typed hello
(`Join`) and snapshots (`Push`), no wire messages, and hands them to the same `SidecarState` doors
that pushed ranks go through, so rollups, restarts, staleness and expiry follow one set of rules:

* a rank is hello'd once, with an epoch the feed makes; every read is a snapshot with a rising seq;
* resets are per series, as Prometheus' `increase()` has them: a counter, or a histogram (one
  unit: its count or any bucket), read lower than the last read restarted that series alone. The
  feed keeps each series' last raw values and an offset, and hands the state offset + raw, so the
  state never sees a value go down and the positions go on as `increase()` would; the other
  series of the rank, and the rank's epoch, are untouched. When every counter and histogram of a
  rank that had counted anything went down at once (an engine restart), the rank starts a new
  epoch as well, so that its per-rank series start again from the engine's values (core/rollups.py
  states the rules); the positions are the same either way. A gauge may go down at any time;
* a histogram's sum that falls while its counts do not (a negative observation, which
  prometheus_client takes) holds: later observations add on, a negative increment never enters a
  position. A value no rule allows (NaN, an infinity, a negative counter, a fractional, negative
  or non-cumulative bucket count, a +Inf bucket that is not the count, a non-finite sum) is
  refused for that one series and read, counted and logged once; it never becomes the series'
  last value, so the next good read continues from the one before;
* repeated resets: a series that goes down more than FLAP_RESETS (2) times within
  FLAP_WINDOW_SECONDS (300) is not restarting but flapping: two writers taking turns (two engines
  behind one Service URL) or a broken engine. From its third drop in the window it counts only
  above its highest value so far (a drop adds nothing; the furthest writer's rises count), it is
  logged once and counted in `hicache_exporter_upstream_series_flapping{upstream}`; after a whole
  window without a drop it is a series again, rising from its highest value. Every drop is counted
  in `hicache_exporter_upstream_series_resets_total{upstream}`;
* a histogram whose bucket bounds change starts a new epoch for its rank (the state keeps one layout
  per series within an epoch): the epoch's values are the series' continuous values less those at
  its start, so no other series is counted again. A new layout is one more restart of that series:
  it counts as a drop in the flapping rule (its drop history goes on), and a flapping series keeps
  its layout: a read with another is refused (counted, logged), so two engines with different
  buckets behind one URL add at most FLAP_RESETS whole values per window;
* a series listed twice in one read (the same family and labels, or a histogram's bucket, _count or
  _sum again, or a sample of a family passed through) keeps its first listing; the others are left
  out and counted (`duplicate_series`). A rank is planned with at most ranks.max_series_per_rank
  series (the rest counted: `series_limit`), the feed makes at most that many continuous per
  identity (a new one past it is refused, as the state would; a series unlisted for
  FORGET_SERIES_SECONDS may give its place), and a rank of many series is fed in snapshots of
  APPLY_SLICE_SERIES series, the event loop running between them;
* a problem is logged once, again after LOG_AGAIN_SECONDS, and a read logs at most
  MAX_LOG_LINES_PER_READ lines and one line for the rest; the counters count every one;
* in a multiprocess directory the epoch is the process (pid): a new pid for a known rank is an
  exact restart, and the older process's files are never summed into the newer one's; a drop
  within one process's files is a per-series reset, as above;
* a rank axis is a decimal rank number in one spelling (exporter.labels.rank_axis: no sign,
  spaces, underscores, leading zeros or non-ASCII digits, at most 65535): a series with any other
  is refused (counted, logged once) and makes no rank;
* an upstream that cannot be read sends no snapshots, so its ranks turn stale, then expire, on
  the registry's clock exactly as silent pushed ranks do; rollups keep their contribution;
* with `world:` configured, every rank says hello with that world, completed by the engine's
  storage labels (upstream/world.py), so a position no rank reports for is missing, as for pushed
  ranks. Each read judges it anew: a read whose labels or ranks contradict it withdraws it from
  every rank of the upstream (nothing is expected; `world_problems` says why, logged once per
  change), and the first read that agrees gives it back. A changed judgement reaches the ranks
  in place, not by a new hello, so it is no reconnect or restart. The durable state keeps each
  rank's world, and a restored feed judges it anew at its first read.

A text upstream is read by prometheus_client's parser, and a read with the last read's shape
(every line the same but for its values: text.py) by its values alone, which gives
what the parser would. A histogram whose bucket counts or bounds are no numbers is refused, not
the read; one without a +Inf bucket takes it from its `_count` (with neither it is refused, but
for a multiprocess one, whose child is being written right now: it is read next time). Families
outside the catalog pass through unchanged. A catalog family none of whose series carry rank
axes (an engine from before per-rank labels: multiprocess mode summed its ranks) and radix series
whose context-parallel peers share labels are flagged and left out: no rollup is made of them. In a
family with ranked series, a series without rank axes (or whose linear rank label is missing or no
rank number) is refused alone, as a bad rank axis is: the others are rolled up.

Where it is done: plan.py makes a read's plan and checks its values (pure), continuity.py makes each
series continuous and keeps the flapping series and the generations, problems.py logs, and this
module runs a read's lifecycle: each rank's hello, epoch and snapshots, what departs, the world.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client.metrics_core import Metric

from exporter.catalog import Catalog
from exporter.config import UpstreamConfig
from exporter.errors import ConfigError, ErrorCode, ProtocolError
from exporter.protocol.messages import Sample, World
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.ranks import Join, RankIdentity, RankState
from exporter.sidecar.core.state import Push, SidecarState
from exporter.sidecar.upstream.continuity import FORGET_SERIES_SECONDS, REPLACED_PIDS_KEPT, Continuity, UpstreamRank
from exporter.sidecar.upstream.files import Exposition, TooLarge
from exporter.sidecar.upstream.merged import HeldProcesses
from exporter.sidecar.upstream.plan import (
    MAX_PASS_THROUGH_SAMPLES,
    FeedResult,
    PlannedRead,
    Planner,
    RankPlan,
    ReadPlan,
    SeriesValues,
    Stamp,
    exposition_text,
    int_or_zero,
    passed_families,
    reserved_forms,
    series_values,
)
from exporter.sidecar.upstream.problems import ReadLog
from exporter.sidecar.upstream.text import Number, TextLayout, parse_exposition
from exporter.sidecar.upstream.world import Judgement, judge

log = logging.getLogger("hicache_exporter.upstream")

# A text layout holds a few strings per sample line: at most this many sample lines per series
# the sidecar may hold (max_series_total), far above an engine's (about 4 at 64 ranks).
LAYOUT_LINES_PER_SERIES = 16
# ... and is kept between reads, at a few times the text's size (its lines, and each series'
# part of them): only for texts up to this size, about twice a 256-rank engine's answer, so that
# the largest answer the caps let through (16 MiB) keeps no layout between reads. Larger texts
# are parsed every time. Measured sizes: BENCHMARKS.md, The proxy under hostile upstreams.
MAX_LAYOUT_TEXT_BYTES = 8 << 20
# A read is refused before prometheus_client parses it when it has more sample lines than this
# many per series the sidecar may hold, plus the samples it may pass through (by default 98,304 +
# 16,384 = 114,688 lines, 3.5 times a 256-rank engine's 33,000). The parser's peak memory grows
# with the sample lines, and a body of millions of short lines blocked the loop for tens of seconds
# before. Measured: BENCHMARKS.md, The proxy under hostile upstreams.
READ_LINES_PER_SERIES = 4
# `apply_async` gives the event loop back after this many series of ranks, so that a read of many
# new ranks never holds the loop long (measured payoff: BENCHMARKS.md, The proxy rows).
APPLY_SLICE_SERIES = 256


class UpstreamFeed:
    """One upstream's reads, turned into hellos and snapshots of the sidecar's state (on its event loop)."""

    def __init__(
        self, config: UpstreamConfig, state: SidecarState, health: UpstreamHealth,
        reserved_names: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.state = state
        self.health = health
        # The families this engine serves: its profile's, or the default profile's.
        self.catalog: Catalog = state.catalog.of_profile(config.profile or state.catalog.default_profile.name)
        self.planner = Planner(config, self.catalog, state.config, reserved_forms(reserved_names))
        self.linear = self.planner.linear  # the profile's linear rank label (LMCache's worker_id), if any
        self.merges_processes = self.planner.merges_processes  # a directory is read merged (plan.Planner says why)
        # A merged directory's processes (merged.py): held on the source's thread, saved with the feed's state.
        self.held = HeldProcesses(lambda name: self.planner.spec_of(name) is not None)
        world = config.world
        problem = self.planner.profile.world_problem(world.dp_size, world.dp_attention) if world is not None else None
        if problem:
            raise ConfigError(f"upstream {config.label}: {problem}")
        self.problems = ReadLog(health.name, state.clock)
        self.continuity = Continuity(health, self.problems, state.config)
        self.source = f"upstream:{health.name}"  # the identities this upstream reports are its own
        # What the engine is, whatever the upstream is named: the durable state keys the source by it
        # (a renamed upstream continues its state), hashed so that a URL's credentials are not kept.
        where = f"url:{config.url}" if config.url is not None else f"dir:{os.path.abspath(config.multiprocess_dir or '')}"
        self.physical = hashlib.sha256(where.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        self.tag = f"up-{self.physical[:8]}"  # epochs are at most 64 characters: the name itself may be longer
        self.pass_through: list[Metric] = []
        self.layout_lines = LAYOUT_LINES_PER_SERIES * state.config.max_series_total
        self._layout: tuple[TextLayout, ReadPlan] | None = None  # the last text read's, while it is one
        self._rendered: dict[bool, str] = {}  # the pass-through text per format, until a family passed through changes
        self.max_read_samples = READ_LINES_PER_SERIES * state.config.max_series_total + MAX_PASS_THROUGH_SAMPLES
        # The world every rank of this upstream says hello with (upstream/world.py), as the last read
        # judged it; until a read lists ranks, the configured one is shown and nothing is expected.
        self.world: World | None = None
        health.world = judge(config.world, (), self.catalog.streams).shown

    @property
    def ranks(self) -> dict[RankIdentity, UpstreamRank]:
        """The rank identities this upstream feeds, as the continuity keeps them."""
        return self.continuity.ranks

    # --- a read, planned (off the event loop: these touch no state) ---

    def plan_text(self, text: str, openmetrics: bool) -> PlannedRead:
        """One read of a text upstream, planned: only its values when it has the last read's shape, else
        prometheus_client's parse of it (raises ValueError where that fails, TooLarge past the read's
        sample bound, before parsing). Touches no state: it runs off the event loop, and `apply` takes
        what it gives."""
        if self._layout is not None:
            layout, plan = self._layout
            if layout.openmetrics == openmetrics:
                known = layout.values_of(text)
                if known is not None:
                    return PlannedRead(plan, known[0], known[1], parsed=False)
        self._layout = None
        # Sample lines (and blank ones): every line but the comments, counted without parsing.
        lines = text.count("\n") + (not text.endswith("\n")) - text.count("\n#") - text.startswith("#")
        if lines > self.max_read_samples:
            raise TooLarge(
                f"the answer has {lines} sample lines, more than the {self.max_read_samples} one read may have "
                f"({READ_LINES_PER_SERIES} per series of ranks.max_series_total, and {MAX_PASS_THROUGH_SAMPLES} passed "
                "through): it is not parsed; "
                "raise ranks.max_series_total (and the pod's memory limit), or have the engine write fewer series")
        families = parse_exposition(text, openmetrics)
        plan = self.planner.plan([(None, 0.0, families)])
        text_layout = TextLayout.of(text, families, openmetrics, self.layout_lines) if len(
            text) <= MAX_LAYOUT_TEXT_BYTES else None
        if text_layout is not None:
            self._layout = (text_layout, plan)
        samples = [s for family in families for s in family.samples]
        return PlannedRead(plan, [s.value for s in samples], [s.timestamp for s in samples], parsed=True)

    def plan_exposition(self, exposition: Exposition) -> PlannedRead:
        """A directory read's exposition, planned, for `apply` or `apply_async` (raises TooLarge past the read's
        sample bound). Touches no state: the scraper runs it off the event loop, as `plan_text`."""
        samples = sum(len(family.samples) for _, _, families in exposition for family in families)
        if samples > self.max_read_samples:
            raise TooLarge(
                f"the directory holds {samples} samples, more than the {self.max_read_samples} one read may have "
                f"({READ_LINES_PER_SERIES} per series of ranks.max_series_total, and {MAX_PASS_THROUGH_SAMPLES} passed "
                "through); raise ranks.max_series_total "
                "(and the pod's memory limit), or have the engine write fewer series")
        values = [s.value for _, _, families in exposition for family in families for s in family.samples]
        return PlannedRead(self.planner.plan(exposition), values, (), parsed=True)

    # --- a read, applied (on the event loop) ---

    def apply(self, read: Exposition | PlannedRead) -> FeedResult:
        """Apply one read of the upstream: each process's catalog series to its ranks, the rest passed through."""
        if isinstance(read, PlannedRead):
            return self.apply_plan(read.plan, read.values, read.timestamps, read.parsed)
        values = [s.value for _, _, families in read for family in families for s in family.samples]
        return self.apply_plan(self.planner.plan(read), values, None, True)

    async def apply_async(self, read: Exposition | PlannedRead) -> FeedResult:
        """`apply`, giving the event loop back after every APPLY_SLICE_SERIES series; the same result
        where nothing else changes the state meanwhile. Give it `plan_text`'s or `plan_exposition`'s
        result (made off the loop): an `Exposition` is planned here, on the loop."""
        if not isinstance(read, PlannedRead):
            read = self.plan_exposition(read)
        result = FeedResult()
        for _ in self._apply_steps(read.plan, read.values, read.timestamps, read.parsed, result):
            await asyncio.sleep(0)
        return result

    def apply_plan(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
    ) -> FeedResult:
        """Apply a read by its plan and its samples' values (and, for families passed through that
        the parser did not make, their timestamps)."""
        result = FeedResult()
        for _ in self._apply_steps(plan, values, timestamps, parsed, result):
            pass
        return result

    def release_expired(self) -> int:
        """Disconnect this upstream's identities that the registry marked expired, so their slots can go
        to other ranks; for reads that fail (a read that succeeds departs what it no longer lists)."""
        self.problems.start_read()
        departed = self._depart(set(), only_expired=True)
        self.continuity.calm_unlisted(self.state.clock())
        self.problems.end_read()
        return departed

    def pass_through_text(self, openmetrics: bool) -> str:
        """The families passed through, as prometheus_client's own exposition writes them (cached per read)."""
        text = self._rendered.get(openmetrics)
        if text is None:
            text = self._rendered[openmetrics] = exposition_text(self.pass_through, openmetrics)
        return text

    def _apply_steps(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
        result: FeedResult,
    ) -> Iterator[None]:
        """Apply a read into `result`, pausing (yielding) after every APPLY_SLICE_SERIES series of ranks."""
        self.problems.start_read()
        self._report(plan, result)
        self._judge(plan.judgement)
        # What this read no longer lists departs first: its slots are free for the identities it lists.
        result.departed = self._depart({rank.identity for rank in plan.ranks})
        done = 0
        for rank in plan.ranks:
            self._reattach(rank)
            reads, refused = series_values(rank, values)
            for series, why in refused:
                result.rejected += 1
                self.problems.refused(series.name, why)
            if reads:
                for _ in self._feed(rank, reads, result):  # a rank of many series, a slice at a time
                    done = 0
                    yield
            done += len(rank.series)
            if done >= APPLY_SLICE_SERIES:
                done = 0
                yield
        self.continuity.calm_unlisted(self.state.clock())
        self._expect()
        passed = passed_families(plan, values, timestamps, parsed)
        if len(passed) != len(self.pass_through) or any(a is not b for a, b in zip(passed, self.pass_through)):
            self._rendered = {}  # a family passed through changed: its text is made again when asked
        self.pass_through = passed
        result.pass_through = self.pass_through
        result.ranks = sum(1 for r in self.ranks.values() if r.rank is not None and r.rank.connection is r.token)
        self.problems.end_read()

    def _report(self, plan: ReadPlan, result: FeedResult) -> None:
        """Take what the plan found (families flagged, names that clash, cuts, series refused) into `result`,
        the health and the log."""
        result.samples = plan.samples
        result.unranked, result.cp_colliding = set(plan.unranked), set(plan.cp_colliding)
        result.clashes, result.duplicates, result.cut = set(plan.clashes), set(plan.duplicates), dict(plan.cut)
        problem = self.problems.problem
        for name in sorted(plan.clashes):
            problem("clash", name, logging.ERROR,
                    "upstream %s: family %s writes a name that a family the sidecar makes writes; it is "
                    "not passed through", self.health.name, name)
        if plan.duplicates:
            self.health.error("duplicate_name")
            for name in sorted(plan.duplicates):
                problem("duplicate", name, logging.ERROR,
                        "upstream %s: family %s writes a name that another family of the upstream passed "
                        "through writes (Prometheus would refuse the exposition); it is not passed through",
                        self.health.name, name)
        for kind, message in plan.cut.items():
            self.health.error(kind)
            problem("cut", kind, logging.WARNING, "upstream %s: %s", self.health.name, message)
        for message in plan.refused:
            result.rejected += 1
            problem("refused", message, logging.WARNING, "upstream %s: %s", self.health.name, message)
        self._flag(result)

    # --- the rank lifecycle ---

    def _reattach(self, plan: RankPlan) -> None:
        """Reconnect an identity an earlier read stopped listing, in the epoch it had (its seq goes on)."""
        identity = plan.identity
        entry = self.ranks.get(identity)
        if entry is None:
            self.continuity.listed_again(identity)
            return
        rank = entry.rank
        if rank is None or rank.connection is entry.token:
            return
        if self.state.rank(identity) is not rank or rank.connected:  # forgotten, or held by another
            entry.rank = None  # `_feed` says hello anew
            return
        join = Join(rank=plan.rank_id, labels=plan.static, epoch=entry.epoch, pid=int_or_zero(entry.pid or "0"),
                    world=self.world)
        try:
            self.state.join(entry.token, join, self.source)
        except ProtocolError:
            entry.rank = None  # `_feed` says hello anew, and counts and logs what is wrong with it

    def _depart(self, listed: set[RankIdentity], only_expired: bool = False) -> int:
        """Disconnect the identities not in `listed` (only expired ones, with `only_expired`), as a
        departed pushed rank: the registry's stale and expire clock runs for them and may forget them.
        Entries the registry no longer holds are dropped, so the feed keeps at most what it holds."""
        departed = 0
        for identity, entry in list(self.ranks.items()):
            if identity in listed:
                continue
            rank = entry.rank
            if rank is not None and rank.connection is entry.token and (rank.expired or not only_expired):
                self.state.disconnect(entry.token, rank)
                departed += 1
            if rank is None or self.state.rank(identity) is not rank:
                self.continuity.drop(identity)
        return departed

    def _feed(self, plan: RankPlan, reads: list[SeriesValues], result: FeedResult) -> Iterator[None]:
        """Feed one rank's series values to the state, in snapshots of at most APPLY_SLICE_SERIES series (a
        snapshot updates only the series it names), pausing (yielding) between them."""
        entry = self.continuity.entry(plan.identity)
        now = self.state.clock()
        entry.room = None  # which series may be forgotten for new ones is found anew each read
        taken = self._epoch(plan, entry, reads, now, result)
        if taken is None:
            return
        reads = taken
        limited = 0
        for start in range(0, len(reads), APPLY_SLICE_SERIES):
            if start:
                yield
            samples: list[Sample] = []
            for series, raw in reads[start:start + APPLY_SLICE_SERIES]:
                if not series.keys:  # a gauge: as read
                    samples.append(Sample(series.family, series.labels, value=raw[0]))
                    continue
                went = self.continuity.continued(entry, series, raw, now, result)
                if went is None:
                    limited += 1
                    continue
                if not series.histogram:
                    samples.append(Sample(series.family, series.labels, value=went[0]))
                    continue
                count, *finite, total = went
                wire: list[tuple[float | str, int]] = [*zip(series.bounds, map(int, finite)), ("+Inf", int(count))]
                samples.append(Sample(series.family, series.labels, buckets=wire, sum=total, count=int(count)))
            self._push(plan, entry, samples, result)
        if limited:
            result.rejected += limited
            self.problems.problem(
                "sample", f"{ErrorCode.SERIES_LIMIT.value}:{plan.identity}", logging.WARNING,
                "upstream %s: sample refused (%s): rank %s already has %d series made continuous "
                "(max_series_per_rank), none unlisted for %d s; %d new series are left out",
                self.health.name, ErrorCode.SERIES_LIMIT.value, plan.rank_id, len(entry.series),
                FORGET_SERIES_SECONDS, limited)

    def _epoch(
        self, plan: RankPlan, entry: UpstreamRank, reads: list[SeriesValues], now: float, result: FeedResult,
    ) -> list[SeriesValues] | None:
        """The rank's epoch for this read: a new process, a new bucket layout or an engine restart ends the
        last one, and a rank with none says hello. The series values it may take; None where there is nothing
        to feed (an older process's files, or a hello the state refused)."""
        pid = plan.pid
        if entry.rank is not None and pid is not None and pid != entry.pid:
            if pid in entry.replaced_pids:
                return None  # an older process's files: that epoch was replaced
            entry.replaced_pids[str(entry.pid)] = None
            if len(entry.replaced_pids) > REPLACED_PIDS_KEPT:
                del entry.replaced_pids[next(iter(entry.replaced_pids))]
            self._restart(entry, result)
            self.continuity.forget(entry, list(entry.series))  # a new process: its values count from zero, its own
        reads, relaid = self.continuity.relayouts(entry, reads, now, result)
        if entry.rank is not None:
            if relaid:
                self._restart(entry, result)  # the state keeps one bucket layout per series within an epoch
            elif pid is None and self.continuity.engine_restarted(entry, reads, now):
                self._restart(entry, result)  # the per-rank series start again from the engine's values
        if entry.rank is None and not self._hello(plan, entry):
            return None
        return reads

    def _hello(self, plan: RankPlan, entry: UpstreamRank) -> bool:
        """Say hello for the rank in a new epoch; whether the state took it (counted and logged where it refused it)."""
        pid = plan.pid
        name = str(entry.generation) if pid is None else f"pid{pid}"
        if pid is not None and pid == entry.pid and entry.generation:
            name += f"-{entry.generation}"  # a process's second epoch (a new layout): an epoch never comes back
        entry.pid = pid
        entry.epoch = f"{self.tag}-{name}"[:64]
        join = Join(rank=plan.rank_id, labels=plan.static, epoch=entry.epoch, pid=int_or_zero(pid or "0"),
                    world=self.world)
        try:
            entry.rank = self.state.join(entry.token, join, self.source).rank
        except ProtocolError as err:
            self.health.error(err.code.value)
            self.problems.problem("hello", str(plan.identity), logging.ERROR, "upstream %s: rank refused: %s",
                                  self.health.name, err.message)
            return False
        entry.seq = 0
        return True

    def _push(self, plan: RankPlan, entry: UpstreamRank, samples: list[Sample], result: FeedResult) -> None:
        """One snapshot of the rank's samples to the state; what it refuses counted and logged (its first)."""
        assert entry.rank is not None
        entry.seq += 1
        applied = self.state.push(entry.rank, Push(seq=entry.seq, samples=samples, help=plan.helps))
        result.rejected += len(applied.rejections)
        for code, message in applied.rejections[:1]:
            # Keyed by rank and code, not the message: a message quoting a value that moves every
            # read would be a new problem every read.
            self.problems.problem("sample", f"{code.value}:{plan.identity}", logging.WARNING,
                                  "upstream %s: sample refused (%s): %s", self.health.name, code.value, message)

    def _restart(self, entry: UpstreamRank, result: FeedResult) -> None:
        """End the rank's epoch: a new one begins at the next hello, its series continuing from where they are."""
        assert entry.rank is not None
        self.state.disconnect(entry.token, entry.rank)
        self.continuity.new_epoch(entry)
        result.resets += 1

    # --- what the read says of the upstream ---

    def _flag(self, result: FeedResult) -> None:
        """Log the families newly flagged (unranked, context-parallel peers colliding) and keep them on the health."""
        for name in sorted(result.unranked - self.health.unranked):
            if self.linear is not None:  # the profile's own rule, not SGLang's rank labels
                self.problems.problem(
                    "unranked", name, logging.WARNING,
                    "upstream %s: family %s has no series with a %s label, so it names no rank; it "
                    "is not rolled up", self.health.name, name, self.linear)
                continue
            self.problems.problem(
                "unranked", name, logging.WARNING,
                "upstream %s: family %s carries no rank labels (tp_rank, pp_rank, dp_rank): the engine "
                "predates per-rank labels and prometheus_client's multiprocess mode summed its ranks, "
                "so its values are a sum of replicas, not a count; it is not rolled up. Upgrade the "
                "engine (SGLang 0.5.23 or later) or push with exporter.integrations.sglang",
                self.health.name, name)
        for name in sorted(result.cp_colliding - self.health.cp_colliding):
            self.problems.problem(
                "cp", name, logging.WARNING,
                "upstream %s: family %s has no attn_cp_rank while the engine runs context parallelism "
                "(attn_cp_size > 1 on its storage series): its CP peers share one label set and "
                "multiprocess mode summed them; it is not rolled up. Push with "
                "exporter.integrations.sglang, which adds attn_cp_rank", self.health.name, name)
        self.health.unranked |= result.unranked
        self.health.cp_colliding |= result.cp_colliding

    def _judge(self, judgement: Judgement) -> None:
        """Take a read's judgement of the configured world: its ranks are expected in it, or (where the
        read contradicts it) in none; a line is logged when the problems change."""
        problems = list(judgement.problems)
        if problems != self.health.world_problems:
            if problems:
                log.warning("upstream %s: the configured world is not trusted, so none of its ranks is counted "
                            "missing: %s", self.health.name, "; ".join(problems))
            else:
                log.info("upstream %s: the engine's labels agree with the configured world again: its ranks "
                         "are expected in it", self.health.name)
            self.health.world_problems = problems
        self.health.world = judgement.shown
        self.world = judgement.world

    def _expect(self) -> None:
        """Give every identity this upstream holds the world of the last read, listed this read or not: a
        judgement that changed reaches the ranks that said hello before it, without a hello (which would
        read as a reconnect)."""
        for identity, entry in self.ranks.items():
            rank: RankState | None = entry.rank
            if rank is not None and rank.world != self.world and self.state.rank(identity) is rank:
                self.state.expect(rank, self.world)
