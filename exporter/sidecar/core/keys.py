"""Keys, values and routes of the series the sidecar holds: as pushed, as positions, and rolled up."""

from __future__ import annotations

import operator
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
    """A histogram series' weight in the series budget and max_series_per_rank."""
    return 1 + len(bounds) // BUCKETS_PER_SERIES


@dataclass(slots=True)
class SeriesBudget:
    """The series the sidecar holds, against max_series_total, weighted by `histogram_cost`: the
    ranks' own, and the rollups', which outlive the ranks and epochs that made them (so epoch
    churn cannot grow memory past it)."""

    limit: int
    per_rank: int = 0
    rollup: int = 0

    def has_room(self, pending_rollups: int = 0, cost: int = 1) -> bool:
        """Room for one more rank series of weight `cost` and the rollup series it may make, on
        top of `pending_rollups` that accepted series may still make (the ledger makes them later)."""
        return self.per_rank + self.rollup + pending_rollups + 2 * cost <= self.limit


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

    @classmethod
    def of(cls, spec: FamilySpec) -> FamilyPlan:
        return cls(
            name=spec.name, kind=spec.type, histogram=spec.type is MetricType.HISTOGRAM,
            gauge=spec.type is MetricType.GAUGE, per_shard=spec.per_shard,
            labels=spec.labels, default_layout=(*(spec.buckets or ()), "+Inf"),
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
    counter: RollupCounter | None = field(default=None, compare=False)
    histogram: HistAccumulator | None = field(default=None, compare=False)


# One series that moved: (route, increase, None) for a counter; (route, increase of the sum,
# increases of the cumulative bucket counts) for a histogram. Gauges need no update: their
# rollups are read from the ranks' current values.
Update = tuple[SeriesRoute, float, list[int] | tuple[int, ...] | None]
