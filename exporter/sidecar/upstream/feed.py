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
(every line the same but for its values: upstream_text.py) by its values alone, which gives
what the parser would. A histogram whose bucket counts or bounds are no numbers is refused, not
the read; one without a +Inf bucket takes it from its `_count` (with neither it is refused, but
for a multiprocess one, whose child is being written right now: it is read next time). Families
outside the catalog pass through unchanged. A catalog family none of whose series carry rank
axes (an engine from before per-rank labels: multiprocess mode summed its ranks) and radix series
whose context-parallel peers share labels are flagged and left out: no rollup is made of them. In a
family with ranked series, a series without rank axes (or whose linear rank label is missing or no
rank number) is refused alone, as a bad rank axis is: the others are rolled up.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import logging
import math
import os
import re
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, compress, islice
from operator import add, ge, le, sub
from typing import Any

from prometheus_client.exposition import generate_latest as text_exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_metric_name
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text
from prometheus_client.samples import Sample as PromSample
from prometheus_client.samples import Timestamp

from exporter.catalog import Catalog, FamilySpec, MetricType
from exporter.config import UpstreamConfig
from exporter.errors import ConfigError, ErrorCode, LabelError, ProtocolError, quoted
from exporter.labels import MAX_RANK_AXIS, RANK_AXES, RANK_KEYS, linear_rank_axes, rank_axis, split_rank_labels
from exporter.protocol.messages import RankId, Sample, World
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.keys import static_key
from exporter.sidecar.core.ranks import Join, RankIdentity, RankState
from exporter.sidecar.core.state import Push, SidecarState
from exporter.sidecar.upstream.files import MERGED, Reading, TooLarge
from exporter.sidecar.upstream.merged import HeldProcesses
from exporter.sidecar.upstream.text import Number, TextLayout
from exporter.sidecar.upstream.world import NO_WORLD, Judgement, judge

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
    except ValueError as err:
        if str(err):
            raise
        # The parsers raise a bare ValueError() on some lines (`# TYPE evil.name counter`): the log
        # line must still say what failed.
        raise ValueError("ValueError: prometheus_client's parser refused a line and gave no reason "
                         "(an invalid metric name or TYPE line?)") from None
    except (OverflowError, LookupError, TypeError) as err:  # what the parsers raise on some malformed lines
        raise ValueError(f"{type(err).__name__}: {err}" if str(err) else f"{type(err).__name__} (no message)") from None


# --- the feed: an upstream's families into the sidecar's state ---
#
# A read is applied in two steps. Its plan depends on everything but the sample values (which
# families are the catalog's, which series belong to which rank, which are passed through or
# flagged): the ranks' protocol samples, as recipes over the read's samples by number (process
# after process, family after family, sample after sample). Applying the plan to the values makes
# the snapshots. A text upstream whose read has the last read's shape (upstream_text.TextLayout)
# keeps its plan, so such a read costs the values alone, not prometheus_client's parser; a read of
# a new shape costs a little more than a parse (the layout is made).
# measured payoff: BENCHMARKS.md, The proxy rows.

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


# A family passed through: the family, the number of its first sample, and the numbers of the
# samples it keeps where it lists one twice (None: all of them, from the first on).
PassedFamily = tuple[Metric, int, list[int] | None]

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
    pass_through: list[PassedFamily] = field(default_factory=list)
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
    duplicates: set[str] = field(default_factory=set)  # families passed through that another one already names
    cut: dict[str, str] = field(default_factory=dict)  # what a bound left out of this read: error kind -> message
    judgement: Judgement = NO_WORLD  # the configured world, completed by this read's labels and judged by its ranks


@dataclass(eq=False)
class TextReading:
    """One read of a text upstream: its plan and values (and, when the parser read it, its families)."""

    plan: ReadPlan
    values: list[Number]
    timestamps: Sequence[Stamp]
    parsed: bool  # by prometheus_client's parser (the families passed through are its own)


# A series that goes down more than FLAP_RESETS times within FLAP_WINDOW_SECONDS flaps. An engine
# that restarts (a crash, a redeploy) does so a few times at most in minutes, each start taking
# longer than a scrape interval; a series that falls and rises again and again is two writers
# taking turns (two engines behind one Service URL) or a broken engine. Counting every rise would
# add a whole value per read; a flapping series counts only above its highest value, until it
# holds for a whole window.
FLAP_RESETS = 2
FLAP_WINDOW_SECONDS = 300
# A series of a rank that no read has listed for this long may lose its continuity to a new series
# when the rank holds max_series_per_rank of them: an hour is far past any engine restart or
# redeploy, so only series the engine stopped writing are forgotten (one that comes back after
# that counts from its value then, as a new series).
FORGET_SERIES_SECONDS = 3600.0


def _drop_times() -> deque[float]:
    """A series' recent drop times: the flapping rule needs only the last FLAP_RESETS + 1."""
    return deque(maxlen=FLAP_RESETS + 1)


@dataclass(slots=True, eq=False)
class _Continuity:
    """One counter or histogram (one unit) of a rank: its raw values as the engine reports them, made continuous."""

    bounds: tuple[float, ...]  # a histogram's finite bucket bounds (its layout); () for a counter
    last: list[float]  # the last raw values taken: a counter's value; a histogram's count, finite buckets, then sum
    offset: list[float]  # added to the raw values: what the series counted before its resets
    high: list[float]  # the continuous values so far (offset + raw at their highest): they never decrease
    base: list[float] | None = None  # `high` when the rank's current epoch began (None: zeros): it reports high - base
    resets: deque[float] = field(default_factory=_drop_times)  # state-clock times of its recent drops
    flapping: bool = False
    seen: float = 0.0  # state-clock time of the last read that listed it




@dataclass(eq=False)
class _UpstreamRank:
    """One rank identity this upstream feeds: its connection token, epoch and series made continuous."""

    token: object = field(default_factory=object)  # stands for the rank's "connection"
    rank: RankState | None = None
    epoch: str = ""
    pid: str | None = None
    generation: int = 0
    seq: int = 0
    series: dict[MonotoneKey, _Continuity] = field(default_factory=dict)  # at most max_series_per_rank
    replaced_pids: dict[str, None] = field(default_factory=dict)  # oldest first, at most REPLACED_PIDS_KEPT
    room: list[MonotoneKey] | None = None  # this read's series that may be forgotten for new ones, longest unlisted last


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
    duplicates: set[str] = field(default_factory=set)  # families not passed through: an earlier one writes their names
    cut: dict[str, str] = field(default_factory=dict)  # what a bound left out of this read: error kind -> message
    departed: int = 0  # identities this read no longer lists: disconnected, so they turn stale, then expire
    series_resets: int = 0  # counters and histograms that went down (each counted as its own restart)


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
# The families one upstream passes through are outside max_series_total: they are kept parsed
# and their text once per format, so these caps bound them (measured: BENCHMARKS.md, The proxy
# under hostile upstreams). A family past them is left out whole (a part of a family would
# read as series that vanished). 16,384 is half of a 256-rank engine's whole answer (33,000 lines).
MAX_PASS_THROUGH_SAMPLES = 16_384
MAX_PASS_THROUGH_BYTES = 2 << 20  # of exposition text, estimated from the samples' names and labels
# `apply_async` gives the event loop back after this many series of ranks, so that a read of many
# new ranks never holds the loop long (measured payoff: BENCHMARKS.md, The proxy rows).
APPLY_SLICE_SERIES = 256
# The names a family's samples and TYPE lines take in the text format and OpenMetrics: a family
# passed through that writes any of them for a family the sidecar makes is refused.
EXPOSITION_SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created", "_info", "_gsum", "_gcount")
_TEXT_TYPE_SUFFIX = {"counter": "_total", "info": "_info"}  # prometheus_client's text format names these families so


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
        # The families this engine serves: its profile's, or the default profile's.
        self.catalog: Catalog = state.catalog.of_profile(config.profile or state.catalog.default_profile.name)
        self.profile = self.catalog.default_profile
        # The upstream's names of catalog families (without the prefix), in both spellings of `:`.
        self.specs: dict[str, FamilySpec] = {spec.exported_name(""): spec for spec in self.catalog}
        prefix = config.prefix if config.prefix is not None else self.profile.upstream_prefix
        self.prefixes = tuple(dict.fromkeys((prefix, prefix.replace(":", "_"))))
        # A profile whose series name their rank with one replica-local label (LMCache's worker_id)
        # labels no data-parallel replica: the engine's /metrics sums the replicas' equal label sets,
        # and a directory is read the same way (every process's files merged), so that the replicas
        # of one worker are one rank whose values are their sum, never two processes taking turns.
        self.linear = self.profile.linear_rank_label
        self.merges_processes = self.linear is not None
        # A merged directory's processes (merged.py): held on the source's thread, saved with the feed's state.
        self.held = HeldProcesses(lambda name: self.spec_of(name) is not None)
        world = config.world
        problem = self.profile.world_problem(world.dp_size) if world is not None else None
        if problem:
            raise ConfigError(f"upstream {config.label}: {problem}")
        self.linear_sizes = (world.tp_size, world.attn_cp_size or 1) if world is not None else (None, 1)
        self.ranks: dict[RankIdentity, _UpstreamRank] = {}
        self.source = f"upstream:{health.name}"  # the identities this upstream reports are its own
        # What the engine is, whatever the upstream is named: the durable state keys the source by it
        # (a renamed upstream continues its state), hashed so that a URL's credentials are not kept.
        where = f"url:{config.url}" if config.url is not None else f"dir:{os.path.abspath(config.multiprocess_dir or '')}"
        self.physical = hashlib.sha256(where.encode("utf-8", "surrogatepass")).hexdigest()[:32]
        self.tag = f"up-{self.physical[:8]}"  # epochs are at most 64 characters: the name itself may be longer
        self.pass_through: list[Metric] = []
        self.layout_lines = LAYOUT_LINES_PER_SERIES * state.config.max_series_total
        self._layout: tuple[TextLayout, ReadPlan] | None = None  # the last text read's, while it is one
        # (kind, name) -> state-clock time it was last logged, oldest first: a problem is logged again
        # after LOG_AGAIN_SECONDS, and the oldest are forgotten past MAX_LOGGED.
        self._logged: dict[tuple[str, str], float] = {}
        self._lines_this_read = 0  # log lines this read has written (at most MAX_LOG_LINES_PER_READ)
        self._unlogged_this_read = 0  # problems this read did not log past that
        self._rendered: dict[bool, str] = {}  # the pass-through text per format, until a family passed through changes
        # Every name the sidecar's own families write (as prometheus_client escapes them): pass-through must not write one.
        self.reserved_forms = frozenset(escape_metric_name(name) + suffix
                                        for name in self.reserved for suffix in EXPOSITION_SUFFIXES)
        self.max_read_samples = READ_LINES_PER_SERIES * state.config.max_series_total + MAX_PASS_THROUGH_SAMPLES
        # The generation of identities dropped after the registry forgot them (text upstreams'
        # epochs count restarts): one listed again says hello with the epoch it had. Bounded like
        # the registry's memory of forgotten identities.
        self._generations: dict[RankIdentity, int] = {}
        # The series flapping now, and their names (for the line that says they calmed down): the
        # flapping gauge is their number as of the last read.
        self._flapping: dict[_Continuity, str] = {}
        # The world every rank of this upstream says hello with (upstream/world.py), as the last read
        # judged it; until a read lists ranks, the configured one is shown and nothing is expected.
        self.world: World | None = None
        health.world = judge(config.world, (), self.catalog.streams).shown

    def spec_of(self, name: str) -> FamilySpec | None:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return self.specs.get(name[len(prefix):])
        return None

    def read_text(self, text: str, openmetrics: bool) -> TextReading:
        """One read of a text upstream: only its values when it has the last read's shape, else
        prometheus_client's parse of it (raises ValueError where that fails, TooLarge past the read's
        sample bound, before parsing). Touches no state: it
        runs off the event loop, and `apply` takes what it gives."""
        if self._layout is not None:
            layout, plan = self._layout
            if layout.openmetrics == openmetrics:
                known = layout.read(text)
                if known is not None:
                    return TextReading(plan, known[0], known[1], parsed=False)
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
        reading: Reading = [(None, 0.0, families)]
        plan = self.plan(reading)
        text_layout = TextLayout.of(text, families, openmetrics, self.layout_lines) if len(
            text) <= MAX_LAYOUT_TEXT_BYTES else None
        if text_layout is not None:
            self._layout = (text_layout, plan)
        samples = [s for family in families for s in family.samples]
        return TextReading(plan, [s.value for s in samples], [s.timestamp for s in samples], parsed=True)

    def plan_reading(self, reading: Reading) -> TextReading:
        """A directory read's plan and values, for `apply` or `apply_async` (raises TooLarge past the read's
        sample bound). Touches no state: the scraper runs it off the event loop, as `read_text`."""
        samples = sum(len(family.samples) for _, _, families in reading for family in families)
        if samples > self.max_read_samples:
            raise TooLarge(
                f"the directory holds {samples} samples, more than the {self.max_read_samples} one read may have "
                f"({READ_LINES_PER_SERIES} per series of ranks.max_series_total, and {MAX_PASS_THROUGH_SAMPLES} passed "
                "through); raise ranks.max_series_total "
                "(and the pod's memory limit), or have the engine write fewer series")
        values = [s.value for _, _, families in reading for family in families for s in family.samples]
        return TextReading(self.plan(reading), values, (), parsed=True)

    def apply(self, reading: Reading | TextReading) -> FeedResult:
        """Apply one read of the upstream: each process's catalog series to its ranks, the rest passed through."""
        if isinstance(reading, TextReading):
            return self.apply_plan(reading.plan, reading.values, reading.timestamps, reading.parsed)
        values = [s.value for _, _, families in reading for family in families for s in family.samples]
        return self.apply_plan(self.plan(reading), values, None, True)

    async def apply_async(self, reading: Reading | TextReading) -> FeedResult:
        """`apply`, giving the event loop back after every APPLY_SLICE_SERIES series; the same result
        where nothing else changes the state meanwhile. Give it `read_text`'s or `plan_reading`'s
        result (made off the loop): a directory `Reading` is planned here, on the loop."""
        if not isinstance(reading, TextReading):
            reading = self.plan_reading(reading)
        result = FeedResult()
        for _ in self._apply_steps(reading.plan, reading.values, reading.timestamps, reading.parsed, result):
            await asyncio.sleep(0)
        return result

    def release_expired(self) -> int:
        """Disconnect this upstream's identities that the registry marked expired, so their slots can go
        to other ranks; for reads that fail (a read that succeeds departs what it no longer lists)."""
        self._lines_this_read = self._unlogged_this_read = 0
        departed = self._depart(set(), only_expired=True)
        self._calm_unlisted()
        self._log_summary()
        return departed

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
        passed = _PassThroughPlan(self.reserved_forms)
        max_ranks = self.state.config.max_ranks  # more identities than the registry may hold are not made
        identities: set[RankIdentity] = set()
        ranks_cut = 0
        cp_size_above_one = False
        lacking_cp: dict[str, bool] = {}  # catalog family -> whether none of its series carries attn_cp_rank
        help_texts: dict[str, str] = {}
        merged = any(pid == MERGED for pid, _, _ in reading)
        duplicated: list[str] = []  # series (or a histogram's samples) listed again: the first is kept
        # Catalog family -> its series that name no rank: the family is unranked where none of its series
        # names one (an engine before per-rank labels), else only these are refused.
        rankless: dict[str, list[str]] = {}
        ranked: set[str] = set()
        number = 0  # of the family's first sample in the reading
        for pid, _, families in reading:
            by_rank: dict[RankIdentity, _RankPlan] = {}
            # Catalog series come from each process apart, or (merges_processes) from all of them merged.
            ranked_here = pid == MERGED if self.merges_processes and merged else pid != MERGED
            for family in families:
                first, number = number, number + len(family.samples)
                spec = self.spec_of(family.name)
                if not ranked_here or spec is None:
                    if spec is None and self.config.pass_through and (pid == MERGED or not merged):
                        plan.samples += len(family.samples)
                        passed.offer(family, first)
                    continue
                plan.samples += len(family.samples)
                if family.documentation and family.documentation != MULTIPROCESS_HELP:
                    help_texts[spec.name] = family.documentation
                for labels, series in _series(spec, family, first, plan.refused, duplicated):
                    if self.linear is not None:
                        linear = self._linear_ranked(labels, series.name, plan.refused)
                        if linear is None:
                            continue
                        labels = linear
                    if "attn_cp_size" in labels and _int_or_zero(labels["attn_cp_size"]) > 1:
                        cp_size_above_one = True
                    if not all(key in labels for key in RANK_KEYS):
                        rankless.setdefault(spec.name, []).append(series.name)
                        continue
                    ranked.add(spec.name)
                    if spec.type is not MetricType.GAUGE:
                        lacking_cp[spec.name] = lacking_cp.get(spec.name, True) and "attn_cp_rank" not in labels
                    rank_id, static = self._rank_of(labels, spec.labels)
                    if rank_id is None:  # not met: _series refused each axis that is no rank number
                        plan.refused.append(f"{series.name} refused: its rank labels name no rank")
                        continue
                    identity = (rank_id.tp_rank, rank_id.pp_rank, rank_id.dp_rank, rank_id.attn_cp_rank or 0,
                                static_key(static))
                    rank = by_rank.get(identity)
                    if rank is None:
                        if identity not in identities:
                            if len(identities) >= max_ranks:
                                ranks_cut += 1
                                continue
                            identities.add(identity)
                        rank = by_rank[identity] = _RankPlan(identity, rank_id, static,
                                                             None if pid == MERGED else pid, [], {})
                    rank.series.append(series)
            per_process.append((pid, by_rank))
        for name, names in rankless.items():
            if name not in ranked:
                plan.unranked.add(name)
                continue
            without = f"no {self.linear} label" if self.linear is not None else f"no rank labels ({', '.join(RANK_KEYS)})"
            plan.refused += [f"{series} refused: it has {without}, so it names no rank; its family's other series "
                             "are rolled up" for series in names]
        if cp_size_above_one:
            plan.cp_colliding = {name for name, lacking in lacking_cp.items() if lacking}
        left_out = plan.unranked | plan.cp_colliding
        max_series = self.state.config.max_series_per_rank  # the most the state holds (and the feed continues)
        series_cut = 0
        for _, by_rank in per_process:
            for rank in by_rank.values():
                listed: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
                kept: list[_SeriesPlan] = []
                for s in rank.series:
                    if s.family in left_out:
                        continue
                    key = (s.family, tuple(s.labels.items()))  # own labels, in the family's order
                    if key in listed:
                        # Twice in one read: two values of one series, which would read as a drop and a
                        # rise on every read (each counted again). Prometheus refuses such an exposition.
                        duplicated.append(s.name)
                    elif len(kept) >= max_series:
                        series_cut += 1
                    else:
                        listed.add(key)
                        kept.append(s)
                rank.series = kept
                if rank.series:
                    rank.helps = {s.family: help_texts[s.family] for s in rank.series if s.family in help_texts}
                    plan.ranks.append(rank)
        plan.pass_through = passed.families
        plan.clashes, plan.duplicates = passed.clashes, passed.duplicates
        plan.judgement = judge(self.config.world, ((rank.rank_id, rank.identity[4]) for rank in plan.ranks),
                               self.catalog.streams)
        duplicated += passed.duplicated
        if duplicated:
            plan.cut["duplicate_series"] = (
                f"{len(duplicated)} series are listed more than once in this read (the first: {duplicated[0]}); "
                "the first listing of each is kept, the others left out (Prometheus would refuse the exposition)")
        if series_cut:
            plan.cut["series_limit"] = (
                f"{series_cut} series of ranks past the first {max_series} of their rank in this read are left out "
                "(ranks.max_series_per_rank)")
        if ranks_cut:
            plan.cut["too_many_ranks"] = (
                f"{ranks_cut} series of rank identities past the first {max_ranks} of this read are left out "
                "(ranks.max_ranks)")
        if passed.over:
            plan.cut["pass_through_too_large"] = (
                f"{len(passed.over)} families ({passed.over_samples} samples; the first: {passed.over[0]}) are not "
                f"passed through: the families passed through are held to {MAX_PASS_THROUGH_SAMPLES} samples and "
                f"{MAX_PASS_THROUGH_BYTES} bytes per upstream; set pass_through: false, or drop them in the engine")
        return plan

    def apply_plan(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
    ) -> FeedResult:
        """Apply a read by its plan and its samples' values (and, for families passed through that
        the parser did not make, their timestamps)."""
        result = FeedResult()
        for _ in self._apply_steps(plan, values, timestamps, parsed, result):
            pass
        return result

    def _apply_steps(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
        result: FeedResult,
    ) -> Iterator[None]:
        """Apply a read into `result`, pausing (yielding) after every APPLY_SLICE_SERIES series of ranks."""
        self._lines_this_read = self._unlogged_this_read = 0
        result.samples = plan.samples
        result.unranked, result.cp_colliding = set(plan.unranked), set(plan.cp_colliding)
        result.clashes, result.duplicates, result.cut = set(plan.clashes), set(plan.duplicates), dict(plan.cut)
        for name in sorted(plan.clashes):
            self._log_once("clash", name, logging.ERROR,
                           "upstream %s: family %s writes a name that a family the sidecar makes writes; it is "
                           "not passed through", self.health.name, name)
        if plan.duplicates:
            self.health.error("duplicate_name", ", ".join(sorted(plan.duplicates)))
            for name in sorted(plan.duplicates):
                self._log_once("duplicate", name, logging.ERROR,
                               "upstream %s: family %s writes a name that another family of the upstream passed "
                               "through writes (Prometheus would refuse the exposition); it is not passed through",
                               self.health.name, name)
        for kind, message in plan.cut.items():
            self.health.error(kind, message)
            self._log_once("cut", kind, logging.WARNING, "upstream %s: %s", self.health.name, message)
        for message in plan.refused:
            result.rejected += 1
            self._log_once("refused", message, logging.WARNING, "upstream %s: %s", self.health.name, message)
        self._flag(result)
        self._judge(plan.judgement)
        # What this read no longer lists departs first: its slots are free for the identities it lists.
        result.departed = self._depart({rank.identity for rank in plan.ranks})
        done = 0
        for rank in plan.ranks:
            self._reattach(rank)
            reads = self._samples(rank, values, result)
            if reads:
                for _ in self._feed(rank, reads, result):  # a rank of many series, a slice at a time
                    done = 0
                    yield
            done += len(rank.series)
            if done >= APPLY_SLICE_SERIES:
                done = 0
                yield
        self._calm_unlisted()
        self._expect()
        passed = self._passed(plan, values, timestamps, parsed)
        if len(passed) != len(self.pass_through) or any(a is not b for a, b in zip(passed, self.pass_through)):
            self._rendered = {}  # a family passed through changed: its text is made again when asked
        self.pass_through = passed
        result.pass_through = self.pass_through
        result.ranks = sum(1 for r in self.ranks.values() if r.rank is not None and r.rank.connection is r.token)
        self._log_summary()

    def _reattach(self, plan: _RankPlan) -> None:
        """Reconnect an identity an earlier read stopped listing, in the epoch it had (its seq goes on)."""
        identity = plan.identity
        entry = self.ranks.get(identity)
        if entry is None:
            generation = self._generations.pop(identity, 0)
            if generation:  # dropped after the registry forgot it: its epoch is the one it had
                self.ranks[identity] = _UpstreamRank(generation=generation)
            return
        rank = entry.rank
        if rank is None or rank.connection is entry.token:
            return
        if self.state.rank(identity) is not rank or rank.connected:  # forgotten, or held by another
            entry.rank = None  # `_feed` says hello anew
            return
        join = Join(rank=plan.rank_id, labels=plan.static, epoch=entry.epoch, pid=_int_or_zero(entry.pid or "0"),
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
                del self.ranks[identity]
                self._forget(entry, list(entry.series))
                if entry.generation:
                    self._generations[identity] = entry.generation
                    if len(self._generations) > self.state.config.max_ranks:
                        del self._generations[next(iter(self._generations))]
        return departed

    def _samples(
        self, rank: _RankPlan, values: list[Number], result: FeedResult,
    ) -> list[_Read]:
        """A rank's series' raw values from the read's (the ones no rule allows refused and counted)."""
        reads: list[_Read] = []
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
            reads.append((series, [count, *finite, total]))
        return reads

    def _passed(
        self, plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool,
    ) -> list[Metric]:
        """The families passed through: the parser's own, or the plan's made anew where their values changed."""
        if parsed or timestamps is None:
            out = [family for family, _, _ in plan.pass_through]
        else:
            last_values, last_timestamps = plan.passed_values, plan.passed_timestamps
            out = []
            for (family, first, numbers), made in zip(plan.pass_through,
                                                      plan.passed or [f for f, _, _ in plan.pass_through]):
                if numbers is None:
                    end = first + len(family.samples)
                    now_values, now_stamps = values[first:end], timestamps[first:end]
                    last = (None if last_values is None or last_timestamps is None
                            else (last_values[first:end], last_timestamps[first:end]))
                else:  # a family that lists a sample twice: the samples it keeps
                    now_values, now_stamps = [values[n] for n in numbers], [timestamps[n] for n in numbers]
                    last = (None if last_values is None or last_timestamps is None
                            else ([last_values[n] for n in numbers], [last_timestamps[n] for n in numbers]))
                if last is not None and now_values == last[0] and now_stamps == last[1]:
                    out.append(made)
                    continue
                metric = copy.copy(family)
                metric.samples = [PromSample(s.name, s.labels, v, t, s.exemplar, s.native_histogram)
                                  for s, v, t in zip(family.samples, now_values, now_stamps)]
                out.append(metric)
        plan.passed, plan.passed_values, plan.passed_timestamps = out, values, timestamps
        return out

    def _linear_ranked(self, labels: dict[str, str], name: str, refused: list[str]) -> dict[str, str] | None:
        """A series' labels with the rank axes its linear rank label names (labels.linear_rank_axes, by the
        configured world's tp and cp sizes); unchanged where that label is missing; None where it is no rank
        number (why is added to `refused`, as _bad_axes does for a rank axis: only that series is out)."""
        assert self.linear is not None
        value = labels.get(self.linear)
        number = None if value is None else rank_axis(value)
        if number is None:
            if value is not None:
                refused.append(f"{name} refused: {self.linear}={quoted(value)} is not a rank number: a whole number "
                               f"from 0 to {MAX_RANK_AXIS} in ASCII digits, without a sign, spaces, underscores or "
                               "a leading zero")
                return None
            return labels
        return {**labels, **{key: str(value) for key, value in self.place(number).items()}}

    def place(self, worker: int) -> dict[str, int]:
        """The rank axes of linear rank number `worker` under the configured world (labels.linear_rank_axes): what
        a read gives a series, and where the durable state puts a saved worker (upstream/saved.py relocate)."""
        return linear_rank_axes(worker, *self.linear_sizes)

    def _rank_of(self, labels: dict[str, str], own: tuple[str, ...]) -> tuple[RankId | None, dict[str, str]]:
        """The rank axes (None where one is missing or no rank number), and the static labels: the
        one split of labels.split_rank_labels (neither a rank axis nor one of the family's own labels)."""
        try:
            axes, static = split_rank_labels(labels, own)
        except LabelError:  # a rank key missing, or an axis that is no rank number
            return None, {}
        rank_id = RankId(**axes)
        static.update(self.config.labels)
        return rank_id, static

    def _flag(self, result: FeedResult) -> None:
        for name in sorted(result.unranked - self.health.unranked):
            if self.linear is not None:  # the profile's own rule, not SGLang's rank labels
                self._log_once("unranked", name, logging.WARNING,
                               "upstream %s: family %s has no series with a %s label, so it names no rank; it "
                               "is not rolled up", self.health.name, name, self.linear)
                continue
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
            rank = entry.rank
            if rank is not None and rank.world != self.world and self.state.rank(identity) is rank:
                rank.world = self.world

    def _log_once(self, kind: str, name: str, level: int, message: str, *args: object) -> None:
        """Log a problem unless it was logged within LOG_AGAIN_SECONDS or this read has logged its share."""
        key, now = (kind, name), self.state.clock()
        last = self._logged.get(key)
        if last is not None and now - last < LOG_AGAIN_SECONDS:
            return
        if self._lines_this_read >= MAX_LOG_LINES_PER_READ:
            self._unlogged_this_read += 1  # not remembered: a later read logs it
            return
        self._lines_this_read += 1
        self._logged.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._logged[key] = now
        while len(self._logged) > MAX_LOGGED:
            del self._logged[next(iter(self._logged))]
        log.log(level, message, *args)

    def _log_summary(self) -> None:
        """End a read's logging: one line for the problems it did not log, and a fresh share for the next read."""
        if self._unlogged_this_read:
            log.warning("upstream %s: %d more problems this read, not logged; see "
                        "hicache_exporter_upstream_scrape_errors_total", self.health.name, self._unlogged_this_read)
        self._lines_this_read = self._unlogged_this_read = 0

    def _feed(self, plan: _RankPlan, reads: list[_Read], result: FeedResult) -> Iterator[None]:
        """Feed one rank's reads to the state, in snapshots of at most APPLY_SLICE_SERIES series (a
        snapshot updates only the series it names), pausing (yielding) between them."""
        identity, pid = plan.identity, plan.pid
        entry = self.ranks.get(identity)
        if entry is None:
            entry = self.ranks[identity] = _UpstreamRank()
        now = self.state.clock()
        entry.room = None  # which series may be forgotten for new ones is found anew each read
        if entry.rank is not None and pid is not None and pid != entry.pid:
            if pid in entry.replaced_pids:
                return  # an older process's files: that epoch was replaced
            entry.replaced_pids[str(entry.pid)] = None
            if len(entry.replaced_pids) > REPLACED_PIDS_KEPT:
                del entry.replaced_pids[next(iter(entry.replaced_pids))]
            self._restart(entry, result)
            self._forget(entry, list(entry.series))  # a new process: its values count from zero, its own
        reads, relaid = self._relayouts(entry, reads, now, result)
        if entry.rank is not None:
            if relaid:
                self._restart(entry, result)  # the state keeps one bucket layout per series within an epoch
            elif pid is None and self._engine_restarted(entry, reads):
                self._restart(entry, result)  # the per-rank series start again from the engine's values
        if entry.rank is None:
            name = str(entry.generation) if pid is None else f"pid{pid}"
            if pid is not None and pid == entry.pid and entry.generation:
                name += f"-{entry.generation}"  # a process's second epoch (a new layout): an epoch never comes back
            entry.pid = pid
            entry.epoch = f"{self.tag}-{name}"[:64]
            join = Join(rank=plan.rank_id, labels=plan.static, epoch=entry.epoch, pid=_int_or_zero(pid or "0"),
                        world=self.world)
            try:
                entry.rank = self.state.join(entry.token, join, self.source).rank
            except ProtocolError as err:
                self.health.error(err.code.value, err.message)
                self._log_once("hello", str(identity), logging.ERROR, "upstream %s: rank refused: %s",
                               self.health.name, err.message)
                return
            entry.seq = 0
        limited = 0
        for start in range(0, len(reads), APPLY_SLICE_SERIES):
            if start:
                yield
            samples: list[Sample] = []
            for series, raw in reads[start:start + APPLY_SLICE_SERIES]:
                if not series.keys:  # a gauge: as read
                    samples.append(Sample(series.family, series.labels, value=raw[0]))
                    continue
                went = self._continue(entry, series, raw, now, result)
                if went is None:
                    limited += 1
                    continue
                if not series.histogram:
                    samples.append(Sample(series.family, series.labels, value=went[0]))
                    continue
                count, *finite, total = went
                wire: list[tuple[float | str, int]] = [*zip(series.bounds, map(int, finite)), ("+Inf", int(count))]
                samples.append(Sample(series.family, series.labels, buckets=wire, sum=total, count=int(count)))
            entry.seq += 1
            applied = self.state.push(entry.rank, Push(seq=entry.seq, samples=samples, help=plan.helps))
            result.rejected += len(applied.rejections)
            for code, message in applied.rejections[:1]:
                # Keyed by rank and code, not the message: a message quoting a value that moves every
                # read would be a new problem every read.
                self._log_once("sample", f"{code.value}:{identity}", logging.WARNING,
                               "upstream %s: sample refused (%s): %s", self.health.name, code.value, message)
        if limited:
            result.rejected += limited
            self._log_once("sample", f"{ErrorCode.SERIES_LIMIT.value}:{identity}", logging.WARNING,
                           "upstream %s: sample refused (%s): rank %s already has %d series made continuous "
                           "(max_series_per_rank), none unlisted for %d s; %d new series are left out",
                           self.health.name, ErrorCode.SERIES_LIMIT.value, plan.rank_id, len(entry.series),
                           FORGET_SERIES_SECONDS, limited)

    def _relayouts(
        self, entry: _UpstreamRank, reads: list[_Read], now: float, result: FeedResult,
    ) -> tuple[list[_Read], bool]:
        """The reads a rank may take, and whether a histogram among them has new bucket bounds (a new epoch).

        A new layout is one more restart of its series, so it counts as a drop in the flapping rule,
        and the series keeps its drop history across it. A flapping series keeps its layout: a read
        with another is refused (and is a drop), so two engines with different buckets behind one
        URL add at most FLAP_RESETS whole values per window, as drops do."""
        out: list[_Read] = []
        relaid = False
        for read in reads:
            series = read[0]
            kept = entry.series.get(series.keys[0]) if series.histogram else None
            if kept is not None and kept.bounds != series.bounds:
                if not self._reset(kept, series, now, result):
                    kept.seen = now  # listed: a live series, whatever its layout
                    self._refuse(series, f"bucket bounds {list(series.bounds)} while it flaps with bounds "
                                 f"{list(kept.bounds)}: a flapping series keeps its layout", result)
                    continue
                relaid = True
            out.append(read)
        return out, relaid

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
    ) -> list[float] | None:
        """Take a series' raw values and give the values its epoch reports: continuous across its resets, never lower
        (None: a new series past max_series_per_rank, refused).

        A histogram is one unit: a drop of its count or of any bucket resets all its parts, sum too."""
        key = series.keys[0]
        kept = entry.series.get(key)
        if kept is None or kept.bounds != series.bounds:  # a new series (or a new layout, in a new epoch)
            if kept is None and len(entry.series) >= self.state.config.max_series_per_rank \
                    and not self._make_room(entry, now):
                return None  # past the bound, as the state would refuse it: not remembered either
            high = [max(v, 0.0) for v in raw]  # only a sum may be below zero: it starts at zero
            new = _Continuity(series.bounds, raw, [h - v for h, v in zip(high, raw)], high)
            if kept is not None:
                new.resets = kept.resets  # a new layout is one more drop of the same series (`_relayouts`)
            kept = entry.series[key] = new
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
                self._calm(kept, series.name, now)
            if series.histogram:
                if len(high) > 2:  # parts that rose apart (after a flap) must stay cumulative, the count last
                    high[1:-1] = accumulate(high[1:-1], max)
                    high[0] = max(high[0], high[-2])
                if high[0] == counted:
                    high[-1] = summed  # no new observation, no new sum (the state's rule: it refuses one)
        kept.seen = now
        return kept.high if kept.base is None else list(map(sub, kept.high, kept.base))

    def _make_room(self, entry: _UpstreamRank, now: float) -> bool:
        """Forget the series of the rank unlisted longest, if for FORGET_SERIES_SECONDS: whether one was."""
        cutoff = now - FORGET_SERIES_SECONDS
        if entry.room is None:  # once per read and rank, only when full: a scan of at most max_series_per_rank
            old = [(kept.seen, key) for key, kept in entry.series.items() if kept.seen < cutoff]
            old.sort(key=lambda pair: pair[0], reverse=True)
            entry.room = [key for _, key in old]
        while entry.room:
            key = entry.room.pop()
            kept = entry.series.get(key)
            if kept is not None and kept.seen < cutoff:
                self._forget(entry, [key])
                return True
        return False

    def _forget(self, entry: _UpstreamRank, keys: Iterable[MonotoneKey]) -> None:
        """Drop series' continuity (and their part in the flapping gauge)."""
        for key in keys:
            kept = entry.series.pop(key, None)
            if kept is not None:
                self._flapping.pop(kept, None)

    def _calm_unlisted(self) -> None:
        """Calm the flapping series that have not gone down for a whole window, listed or not, and set the gauge."""
        now = self.state.clock()
        for kept, name in list(self._flapping.items()):
            self._calm(kept, name, now)
        self.health.flapping = len(self._flapping)

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
            self._flapping[kept] = series.name
            self.health.flapping = len(self._flapping)
            self._log_once("flapping", series.name, logging.WARNING,
                           "upstream %s: %s went down %d times within %d s: two processes write it (two engines "
                           "behind one URL?) or the engine is broken. Its drops are no longer counted as restarts: "
                           "it counts only above its highest value until it holds for %d s. Give each engine its "
                           "own upstream", self.health.name, series.name, len(resets), FLAP_WINDOW_SECONDS,
                           FLAP_WINDOW_SECONDS)
        return not kept.flapping

    def _calm(self, kept: _Continuity, name: str, now: float) -> None:
        """A flapping series that has not gone down for a whole window is a series again."""
        if kept.resets and kept.resets[-1] > now - FLAP_WINDOW_SECONDS:
            return
        kept.resets.clear()
        kept.flapping = False
        kept.offset = [h - v for h, v in zip(kept.high, kept.last)]  # rises count again from its highest value
        self._flapping.pop(kept, None)
        self._log_once("calm", name, logging.INFO,
                       "upstream %s: %s has not gone down for %d s: its drops count as restarts again",
                       self.health.name, name, FLAP_WINDOW_SECONDS)

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
        # Keyed by the series alone: `why` may quote a value, which would make each read a new problem.
        self._log_once("value", series.name, logging.WARNING,
                       "upstream %s: %s refused this read: %s", self.health.name, series.name, why)


# Processes of one rank whose files are known to be replaced by a newer process's, as the registry
# keeps replaced epochs: enough for files that linger, bounded whatever pids a directory shows.
REPLACED_PIDS_KEPT = 64
# Distinct problems remembered as logged (about 200 bytes each); past it the oldest are forgotten,
# so a read full of new problems cannot mute later ones.
MAX_LOGGED = 10_000
# A problem still there is logged again after an hour: often enough to be seen in a day's logs,
# rarely enough not to flood them at one read every few seconds.
LOG_AGAIN_SECONDS = 3600.0
# One read logs at most this many lines (then one summary line): a read of thousands of bad
# series writes a screenful, not thousands of lines; the counters stay exact.
MAX_LOG_LINES_PER_READ = 20


def _int_or_zero(value: str) -> int:
    """A label's or pid's decimal value, 0 where it is no integer: an attn_cp_size that is none reads
    as no context parallelism, a pid that is none as pid 0 (unknown)."""
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
    spec: FamilySpec, family: Metric, first: int, refused: list[str], duplicated: list[str],
) -> Iterable[tuple[dict[str, str], _SeriesPlan]]:
    """(all labels, how its protocol sample is made) per series of a catalog family whose first sample is number `first`.

    A series whose rank axis is no rank number (labels.rank_axis) is refused: no rank is made of it. A
    histogram's bucket, `_count` or `_sum` listed again is left out (its first kept) and named in `duplicated`."""
    own = spec.labels
    if spec.type is MetricType.HISTOGRAM:
        grouped: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for number, s in enumerate(family.samples, first):
            if s.name.endswith("_bucket"):
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = grouped.setdefault(tuple(sorted(labels.items())), {"buckets": [], "les": set()})
                le = s.labels.get("le", "+Inf")
                if le in entry["les"]:
                    duplicated.append(_series_name(spec, labels) + f" bucket le={quoted(le)}")
                    continue
                entry["les"].add(le)
                entry["buckets"].append((le, number))
            elif s.name.endswith("_sum") or s.name.endswith("_count"):
                entry = grouped.setdefault(tuple(sorted(s.labels.items())), {"buckets": [], "les": set()})
                part = s.name.rsplit("_", 1)[1]
                if part in entry:
                    duplicated.append(_series_name(spec, s.labels) + f" _{part}")
                    continue
                entry[part] = number
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
                buckets = []
            if not buckets or any(math.isnan(bound) for bound, _ in buckets):  # NaN != NaN: no layout could hold it
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
    return spec.name + "{" + ",".join(f"{k}={quoted(v)}" for k, v in sorted(labels.items())) + "}"


def _bad_axes(labels: dict[str, str], name: str, refused: list[str]) -> bool:
    """Whether a rank axis of the series is no rank number (then why is added to `refused`)."""
    bad = [key for key in RANK_AXES if key in labels and rank_axis(labels[key]) is None]
    if bad:
        refused.append(f"{name} refused: rank label {bad[0]}={quoted(labels[bad[0]])} is not a rank number: a whole "
                       f"number from 0 to {MAX_RANK_AXIS} in ASCII digits, without a sign, spaces, underscores "
                       "or a leading zero")
    return bool(bad)


def exposition_names(family: Metric) -> set[str]:
    """Every name prometheus_client's text and OpenMetrics expositions write for `family`: its TYPE
    lines' and its samples', with invalid characters as `_` (as its default escaping writes them)."""
    names = {family.name, family.name + _TEXT_TYPE_SUFFIX.get(family.type, "")}
    names.update({s.name for s in family.samples})
    return {escape_metric_name(name) for name in names}


class _PassThroughPlan:
    """The families one read passes through: no name the sidecar's or another's, within the caps."""

    def __init__(self, reserved: frozenset[str]) -> None:
        self.reserved = reserved
        self.families: list[PassedFamily] = []
        self.taken: set[str] = set()  # names the families passed through write
        self.clashes: set[str] = set()
        self.duplicates: set[str] = set()
        self.duplicated: list[str] = []  # samples a family passed through lists again (left out)
        self.over: list[str] = []  # families past the caps
        self.over_samples = 0
        self.samples = 0
        self.bytes = 0

    def offer(self, family: Metric, first: int) -> None:
        """Pass `family` through, unless a name it writes is taken or it does not fit the caps."""
        if not family.samples:
            # Nothing to pass, and prometheus_client writes its TYPE line anyway: `# TYPE x counter`
            # with `x_total` samples parses to an empty `x` and an untyped `x_total`, both TYPE x_total.
            return
        names = exposition_names(family)
        if not names.isdisjoint(self.reserved):
            if not (family.name.endswith("_created") and family.name[:-len("_created")] in self.clashes):
                self.clashes.add(family.name)  # (a refused counter's `_created` family goes with it, unnamed)
            return
        if not names.isdisjoint(self.taken):
            self.duplicates.add(family.name)
            return
        numbers = None
        written: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
        for i, s in enumerate(family.samples):
            key = (s.name, tuple(sorted(s.labels.items())))
            if key in written:  # the same sample twice: Prometheus refuses the exposition; the first is kept
                self.duplicated.append(s.name + "{" + ",".join(f"{k}={quoted(v)}" for k, v in key[1]) + "}")
                numbers = numbers or list(range(first, first + i))
                continue
            written.add(key)
            if numbers is not None:
                numbers.append(first + i)
        if numbers is not None:
            family = copy.copy(family)
            family.samples = [family.samples[n - first] for n in numbers]
        count = len(family.samples)
        size = 0
        if self.samples + count <= MAX_PASS_THROUGH_SAMPLES:
            size = sum(len(s.name) + 24 + sum(len(k) + len(v) + 4 for k, v in s.labels.items())
                       for s in family.samples)
        if self.samples + count > MAX_PASS_THROUGH_SAMPLES or self.bytes + size > MAX_PASS_THROUGH_BYTES:
            self.over.append(family.name)
            self.over_samples += count
            return
        self.samples += count
        self.bytes += size
        self.taken |= names
        self.families.append((family, first, numbers))


class _Families:
    """Parsed families as a collector, for prometheus_client's exposition functions."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families
