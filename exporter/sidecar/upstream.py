"""The proxy source: an engine's own prometheus_client metrics, read back as ranks of the sidecar's state.

An upstream is an engine's `/metrics` URL (text or OpenMetrics, parsed with prometheus_client's
parsers) or its `PROMETHEUS_MULTIPROC_DIR` (read with prometheus_client's multiprocess reader,
each process's files apart). Each series of a catalog family belongs to the rank its rank axes
name (static labels: the rest); the feed turns each rank's series into the protocol's hello and
snapshots and hands them to the same `SidecarState` that pushed ranks go through, so rollups,
restarts, staleness and expiry follow one set of rules:

* a rank is hello'd once, with an epoch the feed makes; every read is a snapshot with a rising seq;
* resets are per series, as Prometheus' `increase()` has them: a counter, or a histogram (one
  unit: its count or any bucket), read lower than the last read restarted that series alone. The
  feed keeps each series' last raw values and an offset, and hands the state offset + raw, so the
  state never sees a value go down and the positions go on as `increase()` would; the other
  series of the rank, and the rank's epoch, are untouched. When every counter and histogram of a
  rank that had counted anything went down at once (an engine restart), the rank starts a new
  epoch as well, so that its per-rank series start again from the engine's values (DESIGN
  section 6); the positions are the same either way. A gauge may go down at any time;
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
  its start, so no other series is counted again;
* in a multiprocess directory the epoch is the process (pid): a new pid for a known rank is an
  exact restart, and the older process's files are never summed into the newer one's; a drop
  within one process's files is a per-series reset, as above;
* a rank axis is a decimal rank number in one spelling (exporter.labels.rank_axis: no sign,
  spaces, underscores, leading zeros or non-ASCII digits, at most 65535): a series with any other
  is refused (counted, logged once) and makes no rank;
* an upstream that cannot be read sends no snapshots, so its ranks turn stale, then expire, on
  the registry's clock exactly as silent pushed ranks do; rollups keep their contribution.

A text upstream is read by prometheus_client's parser, and a read with the last read's shape
(every line the same but for its values: upstream_text.py) by its values alone, which gives
what the parser would. A histogram whose bucket counts or bounds are no numbers is refused, not
the read; one without a +Inf bucket takes it from its `_count` (with neither it is refused, but
for a multiprocess one, whose child is being written right now: it is read next time). Families
outside the catalog pass through unchanged. A catalog family whose series carry no rank
axes (an engine from before per-rank labels: multiprocess mode summed its ranks) and radix series
whose context-parallel peers share labels are flagged and left out: no rollup is made of them.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import math
import re
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, islice
from operator import add, ge, le, sub
from typing import Any

from prometheus_client.exposition import generate_latest as text_exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.samples import Sample as PromSample
from prometheus_client.samples import Timestamp

from exporter.catalog import Catalog, FamilySpec, MetricType
from exporter.config import UpstreamConfig
from exporter.errors import ProtocolError
from exporter.labels import MAX_RANK_AXIS, RANK_AXES, RANK_KEYS, rank_axis
from exporter.protocol.messages import PROTOCOL_VERSION, Hello, RankId, Sample, Snapshot
from exporter.sidecar.families import exported_name
from exporter.sidecar.registry import RankIdentity, RankState
from exporter.sidecar.series import static_key
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import UpstreamHealth
from exporter.sidecar.upstream_files import MERGED, Reading
from exporter.sidecar.upstream_text import Number, TextLayout

log = logging.getLogger("hicache_exporter.upstream")
MULTIPROCESS_HELP = "Multiprocess metric"  # what a multiprocess /metrics says for every family: not worth keeping
# The engine's OpenMetrics quirk (prometheus_client 0.26 without `escaping=allow-utf-8`): sample
# names have `:` escaped to `_` while HELP, TYPE and UNIT lines keep it, which its own parser
# refuses. The metadata lines get the samples' spelling before parsing.
_OM_METADATA = re.compile(r"(?m)^(# (?:HELP|TYPE|UNIT) )(\S+)")


# --- reading a text upstream: prometheus_client's parsers ---


def parse_exposition(text: str, openmetrics: bool) -> list[Metric]:
    """Families of one exposition, by prometheus_client's text or OpenMetrics parser (ValueError where it fails)."""
    try:
        if openmetrics:
            return list(parse_openmetrics(_OM_METADATA.sub(lambda m: m.group(1) + m.group(2).replace(":", "_"), text)))
        return list(parse_text(text))
    except (OverflowError, LookupError, TypeError) as err:  # what the parsers raise on some malformed lines
        raise ValueError(f"{type(err).__name__}: {err}") from None


# --- the feed: an upstream's families into the sidecar's state ---
#
# A read is applied in two steps. Its plan depends on everything but the sample values (which
# families are the catalog's, which series belong to which rank, which are passed through or
# flagged): the ranks' protocol samples, as recipes over the read's samples by number (process
# after process, family after family, sample after sample). Applying the plan to the values makes
# the snapshots. A text upstream whose read has the last read's shape (upstream_text.TextLayout)
# keeps its plan, so such a read costs the values alone, not prometheus_client's parser.
# measured: 270 ms -> 12.5 ms per read at 64 ranks (8,256 samples; 1.13x -> 0.05x the parser's
# 240 ms), 1,120 ms -> 49 ms at 256 (python -m bench.proxy, every value moved between reads).
# A read of a new shape costs about 10 % more than before (the layout is made: 290 ms at 64).

MonotoneKey = tuple[str, tuple[tuple[str, str], ...], str]  # (family, own labels, bucket bound, "count", "sum" or "")
Stamp = float | Timestamp | None  # a sample's timestamp, as prometheus_client's parsers give it
_INF = float("inf")


@dataclass(slots=True, eq=False)
class _SeriesPlan:
    """How one protocol sample of a rank is made from a read's values (by sample number)."""

    family: str
    labels: dict[str, str]  # the family's own labels: one dict for every read
    keys: tuple[MonotoneKey, ...]  # a counter's or histogram's key (one), whose values are made continuous; () for a gauge
    value: int = -1  # a counter's or gauge's sample
    histogram: bool = False
    bounds: tuple[float, ...] = ()  # finite bucket bounds, ascending (as the wire has them)
    buckets: tuple[int, ...] = ()  # every bucket's sample, by ascending bound (+Inf ones last)
    kept: tuple[bool, ...] | None = None  # which of `buckets` the wire has (not +Inf), where not the first len(bounds)
    count: int = -1  # the `_count` sample; -1: the last bucket's count
    total: int = -1  # the `_sum` sample; -1: none (0.0)
    name: str = ""  # the series as people read it (family and all labels), for log lines


# A series and its raw values: a counter's or gauge's value; a histogram's count, finite buckets, then sum.
_Read = tuple[_SeriesPlan, list[float]]


@dataclass(slots=True, eq=False)
class _RankPlan:
    """One rank of a read: who it is, which process wrote it, its series, and the HELP texts they have."""

    identity: RankIdentity
    rank_id: RankId
    static: dict[str, str]
    pid: str | None
    series: list[_SeriesPlan]
    helps: dict[str, str]


@dataclass(eq=False)
class ReadPlan:
    """What one read gives whatever its values: each rank's series, the families passed through, what was flagged."""

    ranks: list[_RankPlan] = field(default_factory=list)
    pass_through: list[tuple[Metric, int]] = field(default_factory=list)  # (family, number of its first sample)
    samples: int = 0
    unranked: set[str] = field(default_factory=set)
    cp_colliding: set[str] = field(default_factory=set)
    clashes: set[str] = field(default_factory=set)
    refused: list[str] = field(default_factory=list)  # series no value can make readable (a bucket bound that is no number)
    # The families passed through as last applied, and the values they were made from: a later
    # read with this plan makes a family anew only where its values changed.
    passed: list[Metric] = field(default_factory=list)
    passed_values: list[Number] | None = None
    passed_timestamps: Sequence[Stamp] | None = None


@dataclass(eq=False)
class TextReading:
    """One read of a text upstream: its plan and values (and, when the parser read it, its families)."""

    plan: ReadPlan
    values: list[Number]
    timestamps: Sequence[Stamp]
    parsed: bool  # by prometheus_client's parser (the families passed through are its own)


@dataclass(slots=True, eq=False)
class _Continuity:
    """One counter or histogram (one unit) of a rank: its raw values as the engine reports them, made continuous."""

    bounds: tuple[float, ...]  # a histogram's finite bucket bounds (its layout); () for a counter
    last: list[float]  # the last raw values taken: a counter's value; a histogram's count, finite buckets, then sum
    offset: list[float]  # added to the raw values: what the series counted before its resets
    high: list[float]  # the continuous values so far (offset + raw at their highest): they never decrease
    base: list[float] | None = None  # `high` when the rank's current epoch began (None: zeros): it reports high - base
    resets: deque[float] = field(default_factory=deque)  # state-clock times of its recent drops
    flapping: bool = False


# A series that goes down more than FLAP_RESETS times within FLAP_WINDOW_SECONDS flaps. An engine
# that restarts (a crash, a redeploy) does so a few times at most in minutes, each start taking
# longer than a scrape interval; a series that falls and rises again and again is two writers
# taking turns (two engines behind one Service URL) or a broken engine. Counting every rise would
# add a whole value per read; a flapping series counts only above its highest value, until it
# holds for a whole window.
FLAP_RESETS = 2
FLAP_WINDOW_SECONDS = 300


@dataclass(eq=False)
class _UpstreamRank:
    """One rank identity this upstream feeds: its connection token, epoch and series made continuous."""

    token: object = field(default_factory=object)  # stands for the rank's "connection"
    rank: RankState | None = None
    epoch: str = ""
    pid: str | None = None
    generation: int = 0
    seq: int = 0
    series: dict[MonotoneKey, _Continuity] = field(default_factory=dict)
    replaced_pids: set[str] = field(default_factory=set)


@dataclass
class FeedResult:
    """What one read gave: samples read, ranks fed, families passed through, problems found."""

    samples: int = 0
    ranks: int = 0
    resets: int = 0
    rejected: int = 0
    pass_through: list[Metric] = field(default_factory=list)
    unranked: set[str] = field(default_factory=set)
    cp_colliding: set[str] = field(default_factory=set)
    clashes: set[str] = field(default_factory=set)
    series_resets: int = 0  # counters and histograms that went down (each counted as its own restart)


# A text layout holds a few strings per sample line: at most this many sample lines per series
# the sidecar may hold (max_series_total), far above an engine's (about 4 at 64 ranks).
LAYOUT_LINES_PER_SERIES = 16


class UpstreamFeed:
    """One upstream's reads, turned into hellos and snapshots of the sidecar's state (on its event loop)."""

    def __init__(
        self, config: UpstreamConfig, state: SidecarState, health: UpstreamHealth,
        reserved_names: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.state = state
        self.health = health
        self.reserved = frozenset(reserved_names)  # family names the sidecar makes: pass-through must not reuse them
        self.catalog: Catalog = state.catalog
        # The upstream's names of catalog families (without the prefix), in both spellings of `:`.
        self.specs: dict[str, FamilySpec] = {exported_name(spec, ""): spec for spec in self.catalog}
        self.prefixes = tuple(dict.fromkeys((config.prefix, config.prefix.replace(":", "_"))))
        self.ranks: dict[RankIdentity, _UpstreamRank] = {}
        digest = hashlib.sha256(config.label.encode()).hexdigest()[:8]
        self.source = f"upstream:{health.name}"  # the identities this upstream reports are its own
        self.tag = f"up-{digest}"  # epochs are at most 64 characters: the name itself may be longer
        self.pass_through: list[Metric] = []
        self.layout_lines = LAYOUT_LINES_PER_SERIES * state.config.max_series_total
        self._layout: tuple[TextLayout, ReadPlan] | None = None  # the last text read's, while it is one
        self._logged: set[tuple[str, str]] = set()
        self._rendered: dict[bool, str] = {}  # the pass-through text per format, until a family passed through changes

    def spec_of(self, name: str) -> FamilySpec | None:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return self.specs.get(name[len(prefix):])
        return None

    def read_text(self, text: str, openmetrics: bool) -> TextReading:
        """One read of a text upstream: only its values when it has the last read's shape, else
        prometheus_client's parse of it (raises ValueError where that fails). Touches no state: it
        runs off the event loop, and `apply` takes what it gives."""
        if self._layout is not None:
            layout, plan = self._layout
            if layout.openmetrics == openmetrics:
                known = layout.read(text)
                if known is not None:
                    return TextReading(plan, known[0], known[1], parsed=False)
        self._layout = None
        families = parse_exposition(text, openmetrics)
        reading: Reading = [(None, 0.0, families)]
        plan = self.plan(reading)
        text_layout = TextLayout.of(text, families, openmetrics, self.layout_lines)
        if text_layout is not None:
            self._layout = (text_layout, plan)
        samples = [s for family in families for s in family.samples]
        return TextReading(plan, [s.value for s in samples], [s.timestamp for s in samples], parsed=True)

    def apply(self, reading: Reading | TextReading, wall: float | None = None) -> FeedResult:
        """Apply one read of the upstream: each process's catalog series to its ranks, the rest passed through."""
        if isinstance(reading, TextReading):
            return self.apply_plan(reading.plan, reading.values, reading.timestamps, reading.parsed, wall)
        values = [s.value for _, _, families in reading for family in families for s in family.samples]
        return self.apply_plan(self.plan(reading), values, None, True, wall)

    def pass_through_text(self, openmetrics: bool) -> str:
        """The families passed through, as prometheus_client's own exposition writes them (cached per read)."""
        text = self._rendered.get(openmetrics)
        if text is None:
            registry = _Families(self.pass_through)
            if openmetrics:
                text = openmetrics_exposition(registry).decode()
                text = text.removesuffix("# EOF\n")
            else:
                text = text_exposition(registry).decode()
            self._rendered[openmetrics] = text
        return text

    def plan(self, reading: Reading) -> ReadPlan:
        """What `reading` gives whatever its values (no state is touched, nothing is logged)."""
        plan = ReadPlan()
        per_process: list[tuple[str | None, dict[RankIdentity, _RankPlan]]] = []
        passed: dict[str, tuple[Metric, int]] = {}
        cp_size_above_one = False
        lacking_cp: dict[str, bool] = {}  # catalog family -> whether none of its series carries attn_cp_rank
        help_texts: dict[str, str] = {}
        merged = any(pid == MERGED for pid, _, _ in reading)
        number = 0  # of the family's first sample in the reading
        for pid, _, families in reading:
            by_rank: dict[RankIdentity, _RankPlan] = {}
            for family in families:
                first, number = number, number + len(family.samples)
                spec = self.spec_of(family.name)
                if pid == MERGED or spec is None:
                    if spec is None and self.config.pass_through and (pid == MERGED or not merged):
                        plan.samples += len(family.samples)
                        if family.name in self.reserved:
                            plan.clashes.add(family.name)
                        else:
                            passed.setdefault(family.name, (family, first))
                    continue
                plan.samples += len(family.samples)
                if family.documentation and family.documentation != MULTIPROCESS_HELP:
                    help_texts[spec.name] = family.documentation
                for labels, series in _series(spec, family, first, plan.refused):
                    if "attn_cp_size" in labels and _int(labels["attn_cp_size"]) > 1:
                        cp_size_above_one = True
                    if not all(key in labels for key in RANK_KEYS):
                        plan.unranked.add(spec.name)
                        continue
                    if spec.type is not MetricType.GAUGE:
                        lacking_cp[spec.name] = lacking_cp.get(spec.name, True) and "attn_cp_rank" not in labels
                    rank_id, static = self._rank_of(labels, spec.labels)
                    if rank_id is None:
                        plan.unranked.add(spec.name)
                        continue
                    identity = (rank_id.tp_rank, rank_id.pp_rank, rank_id.dp_rank, rank_id.attn_cp_rank or 0,
                                static_key(static))
                    rank = by_rank.get(identity)
                    if rank is None:
                        rank = by_rank[identity] = _RankPlan(identity, rank_id, static, pid, [], {})
                    rank.series.append(series)
            per_process.append((pid, by_rank))
        if cp_size_above_one:
            plan.cp_colliding = {name for name, lacking in lacking_cp.items() if lacking}
        left_out = plan.unranked | plan.cp_colliding
        for _, by_rank in per_process:
            for rank in by_rank.values():
                rank.series = [s for s in rank.series if s.family not in left_out]
                if rank.series:
                    rank.helps = {s.family: help_texts[s.family] for s in rank.series if s.family in help_texts}
                    plan.ranks.append(rank)
        plan.pass_through = list(passed.values())
        return plan

    def apply_plan(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
        wall: float | None = None,
    ) -> FeedResult:
        """Apply a read by its plan and its samples' values (and, for families passed through that
        the parser did not make, their timestamps)."""
        wall = time.time() if wall is None else wall
        result = FeedResult(samples=plan.samples, unranked=set(plan.unranked), cp_colliding=set(plan.cp_colliding),
                            clashes=set(plan.clashes))
        for name in sorted(plan.clashes):
            self._log_once("clash", name, logging.ERROR,
                           "upstream %s: family %s is also a family the sidecar makes; it is not passed through",
                           self.health.name, name)
        for message in plan.refused:
            result.rejected += 1
            self._log_once("refused", message, logging.WARNING, "upstream %s: %s", self.health.name, message)
        self._flag(result)
        for rank in plan.ranks:
            samples, monotone = self._samples(rank, values, result)
            if samples:
                self._feed(rank, samples, monotone, wall, result)
        passed = self._passed(plan, values, timestamps, parsed)
        if len(passed) != len(self.pass_through) or any(a is not b for a, b in zip(passed, self.pass_through)):
            self._rendered = {}  # a family passed through changed: its text is made again when asked
        self.pass_through = passed
        result.pass_through = self.pass_through
        result.ranks = sum(1 for r in self.ranks.values() if r.rank is not None)
        return result

    def _samples(
        self, rank: _RankPlan, values: list[Number], result: FeedResult,
    ) -> tuple[list[_Read], bool]:
        """A rank's series' raw values from the read's (the ones no rule allows refused and counted), and
        whether a histogram's bucket bounds differ from what that series had (a new epoch)."""
        reads: list[_Read] = []
        known = self.ranks.get(rank.identity)
        kept_series = known.series if known is not None else {}
        relaid = False
        at = values.__getitem__
        for series in rank.series:
            if not series.histogram:
                value = _as_float(at(series.value))
                if series.keys and not 0.0 <= value < _INF:  # NaN, an infinity, or below zero
                    self._refuse(series, f"counter value {value!r} is not a finite number of zero or more", result)
                    continue
                reads.append((series, [value]))
                continue
            raw = [at(n) for n in series.buckets]
            if series.count >= 0:
                raw.append(at(series.count))
            try:
                counts = list(map(int, raw))
            except (ValueError, OverflowError):  # NaN or an infinity
                counts = []
            if counts != raw or min(counts, default=0) < 0:  # != : a fraction, or no number at all
                self._refuse(series, "a bucket count or count that is not a whole number of zero or more", result)
                continue
            count = counts.pop() if series.count >= 0 else counts[-1]
            total = _as_float(at(series.total)) if series.total >= 0 else 0.0
            if series.kept is None:
                finite, infinite = counts[:len(series.bounds)], counts[len(series.bounds):]
            else:
                finite = list(compress(counts, series.kept))
                infinite = [c for c, k in zip(counts, series.kept) if not k]
            if not all(map(le, finite, islice(finite, 1, None))) or (finite and finite[-1] > count) \
                    or infinite.count(count) != len(infinite):
                self._refuse(series, "buckets that are not cumulative (each bucket at most the next, +Inf equal "
                             "to the count)", result)
                continue
            if not math.isfinite(total):
                self._refuse(series, f"sum {total!r} is not a finite number", result)
                continue
            kept = kept_series.get(series.keys[0])
            relaid = relaid or (kept is not None and kept.bounds != series.bounds)
            reads.append((series, [count, *finite, total]))
        return reads, relaid

    def _passed(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
    ) -> list[Metric]:
        """The families passed through: the parser's own, or the plan's made anew where their values changed."""
        if parsed or timestamps is None:
            out = [family for family, _ in plan.pass_through]
        else:
            last_values, last_timestamps = plan.passed_values, plan.passed_timestamps
            out = []
            for (family, first), made in zip(plan.pass_through, plan.passed or [f for f, _ in plan.pass_through]):
                end = first + len(family.samples)
                if (last_values is not None and last_timestamps is not None and values[first:end] == last_values[first:end]
                        and timestamps[first:end] == last_timestamps[first:end]):
                    out.append(made)
                    continue
                metric = copy.copy(family)
                metric.samples = [PromSample(s.name, s.labels, v, t, s.exemplar, s.native_histogram)
                                  for s, v, t in zip(family.samples, values[first:end], timestamps[first:end])]
                out.append(metric)
        plan.passed, plan.passed_values, plan.passed_timestamps = out, values, timestamps
        return out

    def _rank_of(self, labels: dict[str, str], own: tuple[str, ...]) -> tuple[RankId | None, dict[str, str]]:
        """The rank axes (None where one is no rank number: see labels.rank_axis), and the static labels:
        neither a rank axis nor one of the family's own labels."""
        axes: dict[str, int] = {}
        for key in RANK_AXES:
            if key in labels:
                number = rank_axis(labels[key])
                if number is None:
                    return None, {}
                axes[key] = number
        try:
            rank_id = RankId(**axes)
        except TypeError:  # a rank key missing
            return None, {}
        static = {k: v for k, v in labels.items() if k not in RANK_AXES and k not in own}
        static.update(self.config.labels)
        return rank_id, static

    def _flag(self, result: FeedResult) -> None:
        for name in sorted(result.unranked - self.health.unranked):
            self._log_once("unranked", name, logging.WARNING,
                           "upstream %s: family %s carries no rank labels (tp_rank, pp_rank, dp_rank): the engine "
                           "predates per-rank labels and prometheus_client's multiprocess mode summed its ranks, "
                           "so its values are a sum of replicas, not a count; it is not rolled up. Upgrade the "
                           "engine (SGLang 0.5.23 or later) or push with exporter.integrations.sglang",
                           self.health.name, name)
        for name in sorted(result.cp_colliding - self.health.cp_colliding):
            self._log_once("cp", name, logging.WARNING,
                           "upstream %s: family %s has no attn_cp_rank while the engine runs context parallelism "
                           "(attn_cp_size > 1 on its storage series): its CP peers share one label set and "
                           "multiprocess mode summed them; it is not rolled up. Push with "
                           "exporter.integrations.sglang, which adds attn_cp_rank", self.health.name, name)
        self.health.unranked |= result.unranked
        self.health.cp_colliding |= result.cp_colliding

    def _log_once(self, kind: str, name: str, level: int, message: str, *args: object) -> None:
        if (kind, name) not in self._logged and len(self._logged) < MAX_LOGGED:
            self._logged.add((kind, name))
            log.log(level, message, *args)

    def _feed(
        self, plan: _RankPlan, reads: list[_Read], relaid: bool, wall: float, result: FeedResult,
    ) -> None:
        identity, pid = plan.identity, plan.pid
        entry = self.ranks.get(identity)
        if entry is None:
            entry = self.ranks[identity] = _UpstreamRank()
        if entry.rank is not None:
            if pid is not None and pid != entry.pid:
                if pid in entry.replaced_pids:
                    return  # an older process's files: that epoch was replaced
                entry.replaced_pids.add(str(entry.pid))
                self._restart(entry, result)
                self.health.flapping -= sum(kept.flapping for kept in entry.series.values())
                entry.series.clear()  # a new process: its values count from zero, its own
            elif relaid:
                self._restart(entry, result)  # the state keeps one bucket layout per series within an epoch
            elif pid is None and self._engine_restarted(entry, reads):
                self._restart(entry, result)  # the per-rank series start again from the engine's values
        if entry.rank is None:
            name = str(entry.generation) if pid is None else f"pid{pid}"
            if pid is not None and pid == entry.pid and entry.generation:
                name += f"-{entry.generation}"  # a process's second epoch (a new layout): an epoch never comes back
            entry.pid = pid
            entry.epoch = f"{self.tag}-{name}"[:64]
            hello = Hello(protocol=PROTOCOL_VERSION, epoch=entry.epoch, pid=_int(pid or "0"), rank=plan.rank_id,
                          labels=plan.static)
            try:
                entry.rank = self.state.hello(entry.token, hello, self.source).rank
            except ProtocolError as err:
                self.health.error(err.code.value, err.message)
                self._log_once("hello", str(identity), logging.ERROR, "upstream %s: rank refused: %s",
                               self.health.name, err.message)
                return
            entry.seq = 0
        samples: list[Sample] = []
        now = self.state.clock()
        for series, raw in reads:
            if not series.keys:  # a gauge: as read
                samples.append(Sample(series.family, series.labels, value=raw[0]))
                continue
            went = self._continue(entry, series, raw, now, result)
            if not series.histogram:
                samples.append(Sample(series.family, series.labels, value=went[0]))
                continue
            count, *finite, total = went
            wire: list[tuple[float | str, int]] = [*zip(series.bounds, map(int, finite)), ("+Inf", int(count))]
            samples.append(Sample(series.family, series.labels, buckets=wire, sum=total, count=int(count)))
        entry.seq += 1
        applied = self.state.snapshot(entry.rank, Snapshot(seq=entry.seq, time=wall, samples=samples, help=plan.helps))
        result.rejected += len(applied.rejections)
        for code, message in applied.rejections[:1]:
            self._log_once("sample", f"{code.value}:{message}", logging.WARNING,
                           "upstream %s: sample refused (%s): %s", self.health.name, code.value, message)

    def _engine_restarted(self, entry: _UpstreamRank, reads: list[_Read]) -> bool:
        """Whether every counter and histogram of the rank that had counted anything went down at once
        (and none of them flaps): the engine restarted, and its rank can start a new epoch that counts
        no series twice."""
        now = self.state.clock()
        dropped = False
        for series, raw in reads:
            kept = entry.series.get(series.keys[0]) if series.keys else None
            if kept is None or kept.bounds != series.bounds or kept.last[0] <= 0:
                continue  # a gauge, a new series, or one that has counted nothing: it tells nothing
            parts = len(raw) - 1 if series.histogram else 1
            if all(map(ge, raw[:parts], kept.last[:parts])):
                return False  # this one went on: the engine did not restart
            if kept.flapping or sum(t > now - FLAP_WINDOW_SECONDS for t in kept.resets) >= FLAP_RESETS:
                return False  # a drop that will not count as a restart
            dropped = True
        return dropped

    def _continue(
        self, entry: _UpstreamRank, series: _SeriesPlan, raw: list[float], now: float, result: FeedResult,
    ) -> list[float]:
        """Take a series' raw values and give the values its epoch reports: continuous across its resets, never lower.

        A histogram is one unit: a drop of its count or of any bucket resets all its parts, sum too."""
        key = series.keys[0]
        kept = entry.series.get(key)
        if kept is None or kept.bounds != series.bounds:  # a new series (or a new layout, in a new epoch)
            if kept is not None and kept.flapping:
                self.health.flapping -= 1  # the old layout's series is gone
            high = [max(v, 0.0) for v in raw]  # only a sum may be below zero: it starts at zero
            kept = entry.series[key] = _Continuity(series.bounds, raw, [h - v for h, v in zip(high, raw)], high)
        elif not series.histogram and not kept.flapping and raw[0] >= kept.last[0]:  # a counter that rose or held
            went = kept.offset[0] + raw[0]
            if went > kept.high[0]:
                kept.high[0] = went
            kept.last = raw
        else:
            last, offset, high = kept.last, kept.offset, kept.high
            counted, summed = high[0], high[-1]
            if kept.flapping or not all(map(ge, raw, last)):
                parts = len(raw) - 1 if series.histogram else 1  # the sum is no count: a negative observation lowers it
                if not all(map(ge, raw[:parts], last[:parts])):
                    if self._reset(kept, series, now, result):  # counts again from zero, on top of what it had counted
                        offset[:] = high
                elif series.histogram and raw[-1] < last[-1]:
                    offset[-1] += last[-1] - raw[-1]  # a negative observation: the sum holds, later ones add
            high = kept.high = list(map(max, high, map(add, offset, raw)))
            kept.last = raw
            if kept.flapping:
                self._calm(kept, series, now)
            if series.histogram:
                if len(high) > 2:  # parts that rose apart (after a flap) must stay cumulative, the count last
                    high[1:-1] = accumulate(high[1:-1], max)
                    high[0] = max(high[0], high[-2])
                if high[0] == counted:
                    high[-1] = summed  # no new observation, no new sum (the state's rule: it refuses one)
        return kept.high if kept.base is None else list(map(sub, kept.high, kept.base))

    def _reset(self, kept: _Continuity, series: _SeriesPlan, now: float, result: FeedResult) -> bool:
        """Note one drop of a series; whether it counts as a restart (False: the series flaps)."""
        resets = kept.resets
        while resets and resets[0] <= now - FLAP_WINDOW_SECONDS:
            resets.popleft()
        resets.append(now)
        result.series_resets += 1
        self.health.series_resets += 1
        if not kept.flapping and len(resets) > FLAP_RESETS:
            kept.flapping = True
            self.health.flapping += 1
            log.warning("upstream %s: %s went down %d times within %d s: two processes write it (two engines "
                        "behind one URL?) or the engine is broken. Its drops are no longer counted as restarts: "
                        "it counts only above its highest value until it holds for %d s. Give each engine its "
                        "own upstream", self.health.name, series.name, len(resets), FLAP_WINDOW_SECONDS,
                        FLAP_WINDOW_SECONDS)
        return not kept.flapping

    def _calm(self, kept: _Continuity, series: _SeriesPlan, now: float) -> None:
        """A flapping series that has not gone down for a whole window is a series again."""
        if kept.resets and kept.resets[-1] > now - FLAP_WINDOW_SECONDS:
            return
        kept.resets.clear()
        kept.flapping = False
        kept.offset = [h - v for h, v in zip(kept.high, kept.last)]  # rises count again from its highest value
        self.health.flapping -= 1
        log.info("upstream %s: %s has not gone down for %d s: its drops count as restarts again",
                 self.health.name, series.name, FLAP_WINDOW_SECONDS)

    def _restart(self, entry: _UpstreamRank, result: FeedResult) -> None:
        """End the rank's epoch: a new one begins at the next hello, its series continuing from where they are."""
        assert entry.rank is not None
        self.state.disconnect(entry.token, entry.rank)
        entry.rank = None
        entry.token = object()
        entry.generation += 1
        for kept in entry.series.values():
            kept.base = list(kept.high)  # the new epoch counts from zero; the state carries the positions on
        result.resets += 1

    def _refuse(self, series: _SeriesPlan, why: str, result: FeedResult) -> None:
        """Count one series' value that no rule allows (it stays out of the state and of the series' last values)."""
        result.rejected += 1
        self._log_once("value", f"{series.name}:{why}", logging.WARNING,
                       "upstream %s: %s refused this read: %s", self.health.name, series.name, why)


MAX_LOGGED = 10_000  # distinct problems logged once each; past it, new ones are not logged (memory)


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def _as_float(value: Number) -> float:
    """float(value), with an int too large for a float as the infinity it stands for (refused as a value later)."""
    try:
        return float(value)
    except OverflowError:
        return _INF if value > 0 else -_INF


def _series(
    spec: FamilySpec, family: Metric, first: int, refused: list[str],
) -> Iterable[tuple[dict[str, str], _SeriesPlan]]:
    """(all labels, how its protocol sample is made) per series of a catalog family whose first sample is number `first`.

    A series whose rank axis is no rank number (labels.rank_axis) is refused: no rank is made of it."""
    own = spec.labels
    if spec.type is MetricType.HISTOGRAM:
        grouped: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for number, s in enumerate(family.samples, first):
            if s.name.endswith("_bucket"):
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = grouped.setdefault(tuple(sorted(labels.items())), {"buckets": []})
                entry["buckets"].append((s.labels.get("le", "+Inf"), number))
            elif s.name.endswith("_sum") or s.name.endswith("_count"):
                entry = grouped.setdefault(tuple(sorted(s.labels.items())), {"buckets": []})
                entry[s.name.rsplit("_", 1)[1]] = number
        for key, parts in grouped.items():
            labels = dict(key)
            name = _series_name(spec, labels)
            if not any(le == "+Inf" for le, _ in parts["buckets"]):
                if family.documentation == MULTIPROCESS_HELP:
                    # A process creating the child right now: prometheus_client writes its buckets
                    # in ascending order, +Inf last, so the layout is not whole yet. Next read.
                    continue
                if "count" not in parts:
                    refused.append(f"{name} refused: a histogram with neither a +Inf bucket nor a _count")
                    continue
                # Text without a +Inf bucket: its count is the _count (what +Inf would say).
            if _bad_axes(labels, name, refused):
                continue
            try:
                buckets = sorted(((float(le), number) for le, number in parts["buckets"]), key=lambda b: b[0])
            except ValueError:
                refused.append(f"sample refused: histogram {spec.name} has a bucket bound that is not a number")
                continue
            kept = tuple(b != _INF for b, _ in buckets)  # as the wire has them: +Inf is the count's
            bounds = tuple(b for b, _ in buckets if b != _INF)
            wire_labels = {k: labels[k] for k in own if k in labels}
            yield labels, _SeriesPlan(
                spec.name, wire_labels, ((spec.name, tuple(wire_labels.items()), ""),), histogram=True, bounds=bounds,
                buckets=tuple(n for _, n in buckets), kept=None if kept[:len(bounds)] == (True,) * len(bounds) else kept,
                count=parts.get("count", -1), total=parts.get("sum", -1), name=name)
        return
    wanted = family.name + "_total" if spec.type is MetricType.COUNTER else family.name
    for number, s in enumerate(family.samples, first):
        if s.name == wanted:
            name = _series_name(spec, s.labels)
            if _bad_axes(s.labels, name, refused):
                continue
            wire_labels = {k: s.labels[k] for k in own if k in s.labels}
            # A gauge may go down at any time: only counters (and histograms) are made continuous.
            keys = ((spec.name, tuple(wire_labels.items()), ""),) if spec.type is MetricType.COUNTER else ()
            yield s.labels, _SeriesPlan(spec.name, wire_labels, keys, value=number, name=name)


def _series_name(spec: FamilySpec, labels: dict[str, str]) -> str:
    """A series as a log line names it: its family and labels, as the exposition writes them."""
    return spec.name + "{" + ",".join(f"{k}={_short(v)}" for k, v in sorted(labels.items())) + "}"


def _short(value: str) -> str:
    """A label value for a log line: a value thousands of characters long is cut (quoted, as repr() quotes)."""
    return repr(value) if len(value) <= 40 else repr(value[:40]) + f"... ({len(value)} characters)"


def _bad_axes(labels: dict[str, str], name: str, refused: list[str]) -> bool:
    """Whether a rank axis of the series is no rank number (then why is added to `refused`)."""
    bad = [key for key in RANK_AXES if key in labels and rank_axis(labels[key]) is None]
    if bad:
        refused.append(f"{name} refused: rank label {bad[0]}={_short(labels[bad[0]])} is not a rank number: a whole "
                       f"number from 0 to {MAX_RANK_AXIS} in ASCII digits, without a sign, spaces, underscores "
                       "or a leading zero")
    return bool(bad)


class _Families:
    """Parsed families as a collector, for prometheus_client's exposition functions."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
