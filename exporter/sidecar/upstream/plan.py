"""What one upstream read gives whatever its values (its plan), and the checks of its values: pure, no state, no log.

A read is applied in two steps. Its plan depends on everything but the sample values (which
families are the catalog's, which series belong to which rank, which are passed through or
flagged): the ranks' protocol samples, as recipes over the read's samples by number (process
after process, family after family, sample after sample). Applying the plan to the values makes
the snapshots (feed.py). A text upstream whose read has the last read's shape (text.TextLayout)
keeps its plan, so such a read costs the values alone, not prometheus_client's parser; a read of
a new shape costs a little more than a parse (the layout is made).
Measured payoff: BENCHMARKS.md, The proxy rows.

The words: a *read* is one fetch of an upstream (scrape.py); its *exposition* is the families it
gave, per process (files.Exposition); a *plan* is what the exposition gives whatever its values; a
*planned read* is a plan with the values to apply it to; a series' *values* are its raw values in
one read (`SeriesValues`).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import compress, islice
from operator import le
from typing import Any

from prometheus_client.exposition import generate_latest as text_exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_metric_name
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition
from prometheus_client.samples import Sample as PromSample
from prometheus_client.samples import Timestamp

from exporter.catalog import Catalog, FamilySpec, MetricType
from exporter.config import RanksConfig, UpstreamConfig
from exporter.errors import LabelError, quoted
from exporter.labels import MAX_RANK_AXIS, RANK_AXES, RANK_KEYS, linear_rank_axes, rank_axis, split_rank_labels
from exporter.protocol.messages import RankId
from exporter.sidecar.core.keys import static_key
from exporter.sidecar.core.ranks import RankIdentity, rank_identity
from exporter.sidecar.upstream.files import MERGED, Exposition
from exporter.sidecar.upstream.text import Number
from exporter.sidecar.upstream.world import NO_WORLD, Judgement, judge

MULTIPROCESS_HELP = "Multiprocess metric"  # what a multiprocess /metrics says for every family: not worth keeping
MonotoneKey = tuple[str, tuple[tuple[str, str], ...], str]  # (family, own labels, bucket bound, "count", "sum" or "")
Stamp = float | Timestamp | None  # a sample's timestamp, as prometheus_client's parsers give it
_INF = float("inf")

# The families one upstream passes through are outside max_series_total: they are kept parsed
# and their text once per format, so these caps bound them (measured: BENCHMARKS.md, The proxy
# under hostile upstreams). A family past them is left out whole (a part of a family would
# read as series that vanished). 16,384 is half of a 256-rank engine's whole answer (33,000 lines).
MAX_PASS_THROUGH_SAMPLES = 16_384
MAX_PASS_THROUGH_BYTES = 2 << 20  # of exposition text, estimated from the samples' names and labels
# The names a family's samples and TYPE lines take in the text format and OpenMetrics: a family
# passed through that writes any of them for a family the sidecar makes is refused.
EXPOSITION_SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created", "_info", "_gsum", "_gcount")
_TEXT_TYPE_SUFFIX = {"counter": "_total", "info": "_info"}  # prometheus_client's text format names these families so


@dataclass(slots=True, eq=False)
class SeriesPlan:
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

# A series and its raw values in one read: a counter's or gauge's value; a histogram's count, finite buckets, then sum.
SeriesValues = tuple[SeriesPlan, list[float]]


@dataclass(slots=True, eq=False)
class RankPlan:
    """One rank of a read: who it is, which process wrote it, its series, and the HELP texts they have."""

    identity: RankIdentity
    rank_id: RankId
    static: dict[str, str]
    pid: str | None
    series: list[SeriesPlan]
    helps: dict[str, str]


@dataclass(eq=False)
class ReadPlan:
    """What one read gives whatever its values: each rank's series, the families passed through, what was flagged."""

    ranks: list[RankPlan] = field(default_factory=list)
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
class PlannedRead:
    """One read, ready to apply: its plan and values (and, when the parser made its families, that it did)."""

    plan: ReadPlan
    values: list[Number]
    timestamps: Sequence[Stamp]
    parsed: bool  # by prometheus_client's parser (the families passed through are its own)


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


def int_or_zero(value: str) -> int:
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


# --- the plan ---


@dataclass(eq=False)
class _Walk:
    """What the walk over a read's families gathers, before the ranks' series are kept or cut."""

    per_process: list[dict[RankIdentity, RankPlan]] = field(default_factory=list)
    identities: set[RankIdentity] = field(default_factory=set)
    ranks_cut: int = 0
    cp_size_above_one: bool = False
    lacking_cp: dict[str, bool] = field(default_factory=dict)  # catalog family -> none of its series carries attn_cp_rank
    help_texts: dict[str, str] = field(default_factory=dict)
    duplicated: list[str] = field(default_factory=list)  # series (or a histogram's samples) listed again: the first kept
    # Catalog family -> its series that name no rank: the family is unranked where none of its series
    # names one (an engine before per-rank labels), else only these are refused.
    rankless: dict[str, list[str]] = field(default_factory=dict)
    ranked: set[str] = field(default_factory=set)


class Planner:
    """An upstream's catalog, rank rules and limits, and the plan they make of each of its reads."""

    def __init__(self, config: UpstreamConfig, catalog: Catalog, limits: RanksConfig, reserved_forms: frozenset[str]) -> None:
        self.config = config
        self.catalog = catalog
        self.limits = limits
        self.reserved_forms = reserved_forms  # every name the sidecar's own families write: pass-through must not
        self.profile = catalog.default_profile
        # The upstream's names of catalog families (without the prefix), in both spellings of `:`.
        self.specs: dict[str, FamilySpec] = {spec.exported_name(""): spec for spec in catalog}
        prefix = config.prefix if config.prefix is not None else self.profile.upstream_prefix
        self.prefixes = tuple(dict.fromkeys((prefix, prefix.replace(":", "_"))))
        # A profile whose series name their rank with one replica-local label (LMCache's worker_id)
        # labels no data-parallel replica: the engine's /metrics sums the replicas' equal label sets,
        # and a directory is read the same way (every process's files merged), so that the replicas
        # of one worker are one rank whose values are their sum, never two processes taking turns.
        self.linear = self.profile.linear_rank_label
        self.merges_processes = self.linear is not None
        world = config.world
        self.linear_sizes = (world.tp_size, world.attn_cp_size or 1) if world is not None else (None, 1)

    def spec_of(self, name: str) -> FamilySpec | None:
        """The catalog family an upstream family name is, if any (the upstream's prefix, in either spelling)."""
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return self.specs.get(name[len(prefix):])
        return None

    def place(self, worker: int) -> dict[str, int]:
        """The rank axes of linear rank number `worker` under the configured world (labels.linear_rank_axes): what
        a read gives a series, and where the durable state puts a saved worker (upstream/saved.py relocate)."""
        return linear_rank_axes(worker, *self.linear_sizes)

    def plan(self, exposition: Exposition) -> ReadPlan:
        """What `exposition` gives whatever its values (no state is touched, nothing is logged)."""
        plan = ReadPlan()
        passed = _PassThroughPlan(self.reserved_forms)
        walk = self._walk(exposition, plan, passed)
        self._refuse_rankless(walk, plan)
        if walk.cp_size_above_one:
            plan.cp_colliding = {name for name, lacking in walk.lacking_cp.items() if lacking}
        series_cut = self._keep_series(walk, plan)
        plan.pass_through = passed.families
        plan.clashes, plan.duplicates = passed.clashes, passed.duplicates
        plan.judgement = judge(self.config.world, ((rank.rank_id, rank.identity[4]) for rank in plan.ranks),
                               self.catalog.streams)
        walk.duplicated += passed.duplicated
        self._note_cuts(plan, walk, series_cut, passed)
        return plan

    def _walk(self, exposition: Exposition, plan: ReadPlan, passed: _PassThroughPlan) -> _Walk:
        """Each process's catalog series, by rank (at most max_ranks identities); the rest offered to pass through."""
        walk = _Walk()
        merged = any(pid == MERGED for pid, _, _ in exposition)
        number = 0  # of the family's first sample in the exposition
        for pid, _, families in exposition:
            by_rank: dict[RankIdentity, RankPlan] = {}
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
                    walk.help_texts[spec.name] = family.documentation
                for labels, series in catalog_series(spec, family, first, plan.refused, walk.duplicated):
                    self._rank_series(spec, labels, series, None if pid == MERGED else pid, by_rank, walk, plan)
            walk.per_process.append(by_rank)
        return walk

    def _rank_series(
        self, spec: FamilySpec, labels: dict[str, str], series: SeriesPlan, pid: str | None,
        by_rank: dict[RankIdentity, RankPlan], walk: _Walk, plan: ReadPlan,
    ) -> None:
        """Give one series to the rank its labels name (or note why it has none)."""
        if self.linear is not None:
            linear = self._linear_ranked(labels, series.name, plan.refused)
            if linear is None:
                return
            labels = linear
        if "attn_cp_size" in labels and int_or_zero(labels["attn_cp_size"]) > 1:
            walk.cp_size_above_one = True
        if not all(key in labels for key in RANK_KEYS):
            walk.rankless.setdefault(spec.name, []).append(series.name)
            return
        walk.ranked.add(spec.name)
        if spec.type is not MetricType.GAUGE:
            walk.lacking_cp[spec.name] = walk.lacking_cp.get(spec.name, True) and "attn_cp_rank" not in labels
        rank_id, static = self._rank_of(labels, spec.labels)
        if rank_id is None:  # not met: catalog_series refused each axis that is no rank number
            plan.refused.append(f"{series.name} refused: its rank labels name no rank")
            return
        identity = rank_identity(rank_id.tp_rank, rank_id.pp_rank, rank_id.dp_rank, rank_id.attn_cp_rank,
                                 static_key(static))
        rank = by_rank.get(identity)
        if rank is None:
            if identity not in walk.identities:
                if len(walk.identities) >= self.limits.max_ranks:  # more than the registry may hold are not made
                    walk.ranks_cut += 1
                    return
                walk.identities.add(identity)
            rank = by_rank[identity] = RankPlan(identity, rank_id, static, pid, [], {})
        rank.series.append(series)

    def _refuse_rankless(self, walk: _Walk, plan: ReadPlan) -> None:
        """A family none of whose series names a rank is unranked; in one with ranked series, each rankless one is refused."""
        for name, names in walk.rankless.items():
            if name not in walk.ranked:
                plan.unranked.add(name)
                continue
            without = f"no {self.linear} label" if self.linear is not None else f"no rank labels ({', '.join(RANK_KEYS)})"
            plan.refused += [f"{series} refused: it has {without}, so it names no rank; its family's other series "
                             "are rolled up" for series in names]

    def _keep_series(self, walk: _Walk, plan: ReadPlan) -> int:
        """Each rank's series but the flagged families' and those listed again, at most max_series_per_rank
        (the most the state holds and the feed continues); the ranks that keep any go to the plan. The number cut."""
        left_out = plan.unranked | plan.cp_colliding
        max_series = self.limits.max_series_per_rank
        series_cut = 0
        for by_rank in walk.per_process:
            for rank in by_rank.values():
                listed: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
                kept: list[SeriesPlan] = []
                for s in rank.series:
                    if s.family in left_out:
                        continue
                    key = (s.family, tuple(s.labels.items()))  # own labels, in the family's order
                    if key in listed:
                        # Twice in one read: two values of one series, which would read as a drop and a
                        # rise on every read (each counted again). Prometheus refuses such an exposition.
                        walk.duplicated.append(s.name)
                    elif len(kept) >= max_series:
                        series_cut += 1
                    else:
                        listed.add(key)
                        kept.append(s)
                rank.series = kept
                if rank.series:
                    rank.helps = {s.family: walk.help_texts[s.family] for s in rank.series if s.family in walk.help_texts}
                    plan.ranks.append(rank)
        return series_cut

    def _note_cuts(self, plan: ReadPlan, walk: _Walk, series_cut: int, passed: _PassThroughPlan) -> None:
        """Say what a bound left out of the read, by error kind."""
        duplicated = walk.duplicated
        if duplicated:
            plan.cut["duplicate_series"] = (
                f"{len(duplicated)} series are listed more than once in this read (the first: {duplicated[0]}); "
                "the first listing of each is kept, the others left out (Prometheus would refuse the exposition)")
        if series_cut:
            plan.cut["series_limit"] = (
                f"{series_cut} series of ranks past the first {self.limits.max_series_per_rank} of their rank in this "
                "read are left out (ranks.max_series_per_rank)")
        if walk.ranks_cut:
            plan.cut["too_many_ranks"] = (
                f"{walk.ranks_cut} series of rank identities past the first {self.limits.max_ranks} of this read are "
                "left out (ranks.max_ranks)")
        if passed.over:
            plan.cut["pass_through_too_large"] = (
                f"{len(passed.over)} families ({passed.over_samples} samples; the first: {passed.over[0]}) are not "
                f"passed through: the families passed through are held to {MAX_PASS_THROUGH_SAMPLES} samples and "
                f"{MAX_PASS_THROUGH_BYTES} bytes per upstream; set pass_through: false, or drop them in the engine")

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


def catalog_series(
    spec: FamilySpec, family: Metric, first: int, refused: list[str], duplicated: list[str],
) -> Iterable[tuple[dict[str, str], SeriesPlan]]:
    """(all labels, how its protocol sample is made) per series of a catalog family whose first sample is number `first`.

    A series whose rank axis is no rank number (labels.rank_axis) is refused: no rank is made of it. A
    histogram's bucket, `_count` or `_sum` listed again is left out (its first kept) and named in `duplicated`."""
    if spec.type is MetricType.HISTOGRAM:
        yield from _histogram_series(spec, family, first, refused, duplicated)
        return
    own = spec.labels
    wanted = family.name + "_total" if spec.type is MetricType.COUNTER else family.name
    for number, s in enumerate(family.samples, first):
        if s.name == wanted:
            name = _series_name(spec, s.labels)
            if _bad_axes(s.labels, name, refused):
                continue
            wire_labels = {k: s.labels[k] for k in own if k in s.labels}
            # A gauge may go down at any time: only counters (and histograms) are made continuous.
            keys = ((spec.name, tuple(wire_labels.items()), ""),) if spec.type is MetricType.COUNTER else ()
            yield s.labels, SeriesPlan(spec.name, wire_labels, keys, value=number, name=name)


def _histogram_series(
    spec: FamilySpec, family: Metric, first: int, refused: list[str], duplicated: list[str],
) -> Iterable[tuple[dict[str, str], SeriesPlan]]:
    """`catalog_series` of a histogram family: its samples grouped by labels into buckets, _count and _sum."""
    grouped: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for number, s in enumerate(family.samples, first):
        if s.name.endswith("_bucket"):
            labels = {k: v for k, v in s.labels.items() if k != "le"}
            entry = grouped.setdefault(tuple(sorted(labels.items())), {"buckets": [], "les": set()})
            le_ = s.labels.get("le", "+Inf")
            if le_ in entry["les"]:
                duplicated.append(_series_name(spec, labels) + f" bucket le={quoted(le_)}")
                continue
            entry["les"].add(le_)
            entry["buckets"].append((le_, number))
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
        if not any(bound == "+Inf" for bound, _ in parts["buckets"]):
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
            buckets = sorted(((float(bound), number) for bound, number in parts["buckets"]), key=lambda b: b[0])
        except ValueError:
            buckets = []
        if not buckets or any(math.isnan(bound) for bound, _ in buckets):  # NaN != NaN: no layout could hold it
            refused.append(f"sample refused: histogram {spec.name} has a bucket bound that is not a number")
            continue
        kept = tuple(b != _INF for b, _ in buckets)  # as the wire has them: +Inf is the count's
        bounds = tuple(b for b, _ in buckets if b != _INF)
        wire_labels = {k: labels[k] for k in spec.labels if k in labels}
        yield labels, SeriesPlan(
            spec.name, wire_labels, ((spec.name, tuple(wire_labels.items()), ""),), histogram=True, bounds=bounds,
            buckets=tuple(n for _, n in buckets), kept=None if kept[:len(bounds)] == (True,) * len(bounds) else kept,
            count=parts.get("count", -1), total=parts.get("sum", -1), name=name)


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


# --- a rank's values, checked ---


def series_values(rank: RankPlan, values: list[Number]) -> tuple[list[SeriesValues], list[tuple[SeriesPlan, str]]]:
    """A rank's series' raw values from the read's, and the series whose values no rule allows (with why)."""
    out: list[SeriesValues] = []
    refused: list[tuple[SeriesPlan, str]] = []
    at = values.__getitem__
    for series in rank.series:
        if not series.histogram:
            value = _as_float(at(series.value))
            if series.keys and not 0.0 <= value < _INF:  # NaN, an infinity, or below zero
                refused.append((series, f"counter value {value!r} is not a finite number of zero or more"))
                continue
            out.append((series, [value]))
            continue
        raw = [at(n) for n in series.buckets]
        if series.count >= 0:
            raw.append(at(series.count))
        try:
            counts = list(map(int, raw))
        except (ValueError, OverflowError):  # NaN or an infinity
            counts = []
        if counts != raw or min(counts, default=0) < 0:  # != : a fraction, or no number at all
            refused.append((series, "a bucket count or count that is not a whole number of zero or more"))
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
            refused.append((series, "buckets that are not cumulative (each bucket at most the next, +Inf equal "
                                    "to the count)"))
            continue
        if not math.isfinite(total):
            refused.append((series, f"sum {total!r} is not a finite number"))
            continue
        out.append((series, [count, *finite, total]))
    return out, refused


# --- the families passed through ---


def exposition_names(family: Metric) -> set[str]:
    """Every name prometheus_client's text and OpenMetrics expositions write for `family`: its TYPE
    lines' and its samples', with invalid characters as `_` (as its default escaping writes them)."""
    names = {family.name, family.name + _TEXT_TYPE_SUFFIX.get(family.type, "")}
    names.update({s.name for s in family.samples})
    return {escape_metric_name(name) for name in names}


def reserved_forms(names: Iterable[str]) -> frozenset[str]:
    """Every name the sidecar's own families write (as prometheus_client escapes them): pass-through must not write one."""
    return frozenset(escape_metric_name(name) + suffix for name in names for suffix in EXPOSITION_SUFFIXES)


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


def passed_families(plan: ReadPlan, values: list[Number], timestamps: Sequence[Stamp] | None, parsed: bool) -> list[Metric]:
    """The families passed through: the parser's own, or the plan's made anew where their values changed (the plan
    remembers what it made, for the next read)."""
    if parsed or timestamps is None:
        out = [family for family, _, _ in plan.pass_through]
    else:
        last_values, last_timestamps = plan.passed_values, plan.passed_timestamps
        out = []
        for (family, first, numbers), made in zip(plan.pass_through, plan.passed or [f for f, _, _ in plan.pass_through]):
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


class _Families:
    """Parsed families as a collector, for prometheus_client's exposition functions."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


def exposition_text(families: list[Metric], openmetrics: bool) -> str:
    """`families` as prometheus_client's own exposition writes them (OpenMetrics without its `# EOF`)."""
    if openmetrics:
        return openmetrics_exposition(_Families(families)).decode().removesuffix("# EOF\n")
    return text_exposition(_Families(families)).decode()
