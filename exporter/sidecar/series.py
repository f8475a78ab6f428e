"""Keys and values of series held in memory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

LabelValues = tuple[str, ...]
StaticKey = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, LabelValues]  # (family name, values of the family's own labels)
GroupKey = tuple[int, StaticKey]  # (dp_rank, static labels): one replica group
RollupKey = tuple[str, StaticKey, LabelValues]


@dataclass(frozen=True, slots=True)
class HistValue:
    """One histogram as last pushed: cumulative bucket counts (the last is +Inf) and sum."""

    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(slots=True)
class HistAccumulator:
    """A rollup histogram built from deltas: cumulative bucket counts and sum."""

    counts: list[float]
    sum: float = 0.0

    @classmethod
    def empty(cls, n_buckets: int) -> "HistAccumulator":
        return cls([0.0] * n_buckets, 0.0)

    def add(self, counts: list[float] | tuple[float, ...], total: float) -> None:
        self.counts = [mine + theirs for mine, theirs in zip(self.counts, counts)]
        self.sum += total


Value = Union[float, HistValue]


def static_key(labels: dict[str, str]) -> StaticKey:
    """A hashable, order-independent form of static labels."""
    return tuple(sorted(labels.items()))
