"""What applying a sample needs, worked out once: per family from the catalog, per series per rank."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

from exporter.catalog import FamilySpec, MetricType, Semantics
from exporter.sidecar.series import HistAccumulator, RollupCounter, RollupKey, SeriesKey

# How a rank's sample is looked up in its route index: the family alone when it has no labels,
# else the family and its label pairs in the order sent.
SampleIdent = Union[str, tuple[str, tuple[tuple[str, str], ...]]]


@dataclass(frozen=True, slots=True)
class FamilyPlan:
    """A catalog family, reduced to the flags and shapes that applying a sample checks."""

    name: str
    kind: MetricType
    histogram: bool
    gauge: bool
    per_shard: bool
    windowed: bool
    labels: tuple[str, ...]
    n_buckets: int
    bounds: tuple[float | str, ...]

    @classmethod
    def of(cls, spec: FamilySpec, windowed: bool) -> "FamilyPlan":
        return cls(
            name=spec.name, kind=spec.type, histogram=spec.type is MetricType.HISTOGRAM,
            gauge=spec.type is MetricType.GAUGE, per_shard=spec.semantics is Semantics.PER_SHARD,
            windowed=windowed, labels=spec.labels, n_buckets=len(spec.buckets or ()) + 1,
            bounds=(*(spec.buckets or ()), "+Inf"),
        )


@dataclass(slots=True, unsafe_hash=True)
class SeriesRoute:
    """Where one validated (family, labels) of one rank goes: its plan, series key, rollup key
    and, from the first value accepted through it, the rollup cell its deltas go into.

    Ranks push the same series every time, so after the first push a sample costs one lookup
    here instead of a family lookup, label checks and two key tuples; the keys are the same
    objects every time, which dicts compare by identity. Equal and hashed by the keys alone.
    """

    plan: FamilyPlan
    key: SeriesKey
    rollup_key: RollupKey
    counter: RollupCounter | None = field(default=None, compare=False)
    histogram: HistAccumulator | None = field(default=None, compare=False)
