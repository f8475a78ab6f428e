"""Keys, values and routes of the series the sidecar holds: as pushed, as positions, and rolled up."""

from __future__ import annotations

import operator
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

import msgspec

from exporter.catalog import FamilySpec, MetricType

LabelValues = tuple[str, ...]
StaticKey = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, LabelValues]  # (family name, values of the family's own labels)
GroupKey = tuple[int, StaticKey]  # (dp_rank, static labels): one replica group
RollupKey = tuple[str, StaticKey, LabelValues]
# A histogram's bucket layout as pushed: ascending finite upper bounds, then "+Inf".
Layout = tuple[float | str, ...]


class HistValue(msgspec.Struct, gc=False):
    """One histogram as last pushed: its layout, cumulative bucket counts (the last is +Inf) and sum.

    Never changed once made (a new push stores a new one). A C struct the garbage collector
    does not track (it holds only numbers and one shared layout tuple): one is made per
    histogram per push, and a tracked object would be scanned by every collection.
    """

    bounds: Layout
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(slots=True, eq=False)
class RollupCounter:
    """A counter cell: a rollup series' value, or one replica group's watermark."""

    value: float = 0.0


@dataclass(slots=True, eq=False)
class HistAccumulator:
    """A histogram cell of one layout: cumulative bucket counts and sum (a rollup or a watermark)."""

    bounds: Layout
    counts: list[int]  # ints, like the deltas added to them: int + int is the fast path
    sum: float = 0.0

    @classmethod
    def empty(cls, bounds: Layout) -> HistAccumulator:
        return cls(bounds, [0] * len(bounds), 0.0)

    def add(self, counts: list[int] | tuple[int, ...], total: float) -> None:
        self.counts = list(map(operator.add, self.counts, counts))
        self.sum += total


Value = float | HistValue


# A histogram's buckets cost memory like series do: each is a count in the rank's value, its
# position, its rollup and watermark, and a line on /metrics (a fraction of what a series costs:
# the measured figures are in docs/reliability.md). So a histogram counts as one series plus one
# per BUCKETS_PER_SERIES buckets: the catalog's layouts (6 to 19 buckets) count 1 to 3, and a
# 1,024-bucket layout 129, so the series limits bound what buckets hold too.
BUCKETS_PER_SERIES = 8


def histogram_cost(bounds: Layout) -> int:
    """A histogram series' weight by its buckets alone (`series_cost` weighs its labels too)."""
    return 1 + len(bounds) // BUCKETS_PER_SERIES


# Label values cost memory on every line that writes them: each per-rank line on /metrics carries the
# rank's static labels and rank axes, each rollup line the static labels its group shares, both the
# family's own values, and the renderer keeps each line's text (its prefix, its template, its last
# filled bytes). So a series weighs at least one unit per LABEL_CHARS_PER_UNIT characters its labels
# write over its lines (`series_cost`), each character counted at the width CPython holds the line's
# text at (`label_width`). A series of one unit may write 512 characters of labels on its line (256 on
# each of a gauge's or replicated counter's two): ordinary labels (rank axes, a model path of about 60
# characters, a few short words: up to about 220 characters) keep a counter or gauge at 1, and a budget
# full of series at that edge takes about what the budget allows a series of short labels (5.3 kB a
# unit measured, 5.5 kB budgeted). A replicated counter whose line writes the most the label limits
# allow (8 static values sharing 2,304 characters, two own values of 128: 2,662 characters) weighs 11,
# 42 where a character of it is outside the BMP (docs/reliability.md, "Long label values";
# `python -m bench.label_memory`).
LABEL_CHARS_PER_UNIT = 512


def label_chars(labels: Iterable[tuple[str, str]]) -> int:
    """The characters `labels` write on one line: per label its name, its value as escaped (a backslash,
    newline or double quote takes two), `=`, two quotes and a comma."""
    return sum(len(name) + len(value) + value.count("\\") + value.count("\n") + value.count('"') + 4
               for name, value in labels)


def label_width(labels: Iterable[tuple[str, str]]) -> int:
    """The bytes each character takes in a string holding `labels`: CPython stores a string at the width
    of its widest character (PEP 393), 1 for Latin-1, 2 for the rest of the BMP, 4 beyond it."""
    widest = max((max(name + value) for name, value in labels), default="\x00")
    return 1 if widest < "\u0100" else 2 if widest < "\U00010000" else 4


def label_size(labels: Collection[tuple[str, str]]) -> tuple[int, int]:
    """(`label_chars`, `label_width`) of `labels`: what they write on a line, and the width it is held at."""
    return label_chars(labels), label_width(labels)


def line_chars(chars: int, width: int, own_chars: int, own_width: int) -> int:
    """What the labels of one line weigh: the characters two label sets write on it together
    (`label_chars`: a rank's or its group's, and the family's own), each at the width of the widest
    (`label_width`), as the line's text is held."""
    return (chars + own_chars) * max(width, own_width)


def scalar_lines(spec: FamilySpec) -> int:
    """The lines on /metrics that one rank series of a counter or gauge family accounts for: its own, and
    one more for a gauge (the rollup line the render sums from the current ranks, which no rollup cell
    holds) or a replicated counter (its replica group's spread line, `_replica_spread_ratio`)."""
    return 2 if spec.type is MetricType.GAUGE or spec.replicated_counter else 1


def series_cost(bounds: Layout | None, chars: int, lines: int = 1) -> int:
    """A series' weight in the series budget and max_series_per_rank: the larger of its buckets' weight
    (`histogram_cost`; a counter or gauge: 1) and one unit per LABEL_CHARS_PER_UNIT characters its labels
    write over its lines. `bounds`: a histogram's layout (a line per bucket, its count and its sum), or
    None for a counter or gauge, which writes `lines` (`scalar_lines` for a rank's series, 1 for a rollup
    cell). `chars`: what its labels weigh on one line (`line_chars`): a rank's series, the rank's labels
    and axes (RankState.label_chars) with the family's own; a rollup cell, the static labels its group
    shares with the family's own."""
    if bounds is None:
        return max(1, -(-lines * chars // LABEL_CHARS_PER_UNIT))
    return max(histogram_cost(bounds), -(-(len(bounds) + 2) * chars // LABEL_CHARS_PER_UNIT))


@dataclass(slots=True)
class SeriesBudget:
    """The series the sidecar holds, against max_series_total, weighted by `series_cost`: the
    ranks' own, and the rollups', which outlive the ranks and epochs that made them (so epoch
    churn cannot grow memory past it)."""

    limit: int
    per_rank: int = 0
    rollup: int = 0

    def has_room(self, pending_rollups: int = 0, cost: int = 1, rollup: int | None = None) -> bool:
        """Room for one more rank series of weight `cost` and the rollup series it may make (of weight
        `rollup`, by default `cost`), on top of `pending_rollups` that accepted series may still make
        (the ledger makes them later)."""
        return self.per_rank + self.rollup + pending_rollups + cost + (cost if rollup is None else rollup) <= self.limit


def make_rollup_key(family: str, shared: StaticKey, label_values: LabelValues) -> RollupKey:
    """The one rollup key of a series: its family, the static labels its replica group shares
    (RankState.shared: derived labels left out) and the values of the family's own labels."""
    return (family, shared, label_values)


def static_key(labels: dict[str, str]) -> StaticKey:
    """A hashable, order-independent form of static labels."""
    return tuple(sorted(labels.items()))


# How a rank's sample is looked up in its route index: the family alone when it has no labels,
# else the family and its label pairs in the order sent.
SampleIdent = str | tuple[str, tuple[tuple[str, str], ...]]


@dataclass(frozen=True, slots=True)
class FamilyPlan:
    """A catalog family, reduced to the flags and shapes that reading a sample checks."""

    name: str
    kind: MetricType
    histogram: bool
    gauge: bool
    per_shard: bool
    labels: tuple[str, ...]
    default_layout: Layout  # the catalog's buckets: what clients send unless told otherwise
    lines: int = 1  # a counter's or gauge's lines on /metrics per rank series (scalar_lines)

    @classmethod
    def of(cls, spec: FamilySpec) -> FamilyPlan:
        return cls(
            name=spec.name, kind=spec.type, histogram=spec.type is MetricType.HISTOGRAM,
            gauge=spec.type is MetricType.GAUGE, per_shard=spec.per_shard,
            labels=spec.labels, default_layout=(*(spec.buckets or ()), "+Inf"), lines=scalar_lines(spec),
        )


@dataclass(slots=True, unsafe_hash=True)
class SeriesRoute:
    """Where one validated (family, labels) of ranks with the same static labels goes: its plan,
    series key, rollup key and, once the ledger has seen a value through it, its rollup cell.

    Ranks push the same series every time, so after the first push a sample costs one lookup
    here instead of a family lookup, label checks and two key tuples; the keys are the same
    objects every time, which dicts compare by identity. Equal and hashed by the keys alone.
    """

    plan: FamilyPlan
    key: SeriesKey
    rollup_key: RollupKey
    # What the family's own labels write on a line (`label_chars`, `label_width`), and what its rollup's
    # weigh (`line_chars`: the static labels the group shares with the family's own): counted once, when
    # the route is made.
    own_chars: int = field(default=0, compare=False)
    own_width: int = field(default=1, compare=False)
    rollup_chars: int = field(default=0, compare=False)
    counter: RollupCounter | None = field(default=None, compare=False)
    histogram: HistAccumulator | None = field(default=None, compare=False)


# One series that moved: (route, increase, None) for a counter; (route, increase of the sum,
# increases of the cumulative bucket counts) for a histogram. Gauges need no update: their
# rollups are read from the ranks' current values.
Update = tuple[SeriesRoute, float, list[int] | tuple[int, ...] | None]
