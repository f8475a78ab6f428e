"""Keys and values of series held in memory."""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Union

import msgspec

LabelValues = tuple[str, ...]
StaticKey = tuple[tuple[str, str], ...]
SeriesKey = tuple[str, LabelValues]  # (family name, values of the family's own labels)
GroupKey = tuple[int, StaticKey]  # (dp_rank, static labels): one replica group
RollupKey = tuple[str, StaticKey, LabelValues]


class HistValue(msgspec.Struct, gc=False):
    """One histogram as last pushed: cumulative bucket counts (the last is +Inf) and sum.

    Never changed once made (a new push stores a new one). A C struct the garbage collector
    does not track (it holds only numbers): one is made per histogram per push, and a tracked
    object would be scanned by every collection for as long as it is the rank's latest.
    """

    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return self.counts[-1]


@dataclass(slots=True, eq=False)
class RollupCounter:
    """A rollup counter: the running sum of the deltas counted into it."""

    value: float = 0.0


@dataclass(slots=True, eq=False)
class HistAccumulator:
    """A rollup histogram built from deltas: cumulative bucket counts and sum."""

    counts: list[int]  # ints, like the deltas added to them: int + int is the fast path
    sum: float = 0.0

    @classmethod
    def empty(cls, n_buckets: int) -> "HistAccumulator":
        return cls([0] * n_buckets, 0.0)

    def add(self, counts: list[int] | tuple[int, ...], total: float) -> None:
        self.counts = list(map(operator.add, self.counts, counts))
        self.sum += total


Value = Union[float, HistValue]


def static_key(labels: dict[str, str]) -> StaticKey:
    """A hashable, order-independent form of static labels."""
    return tuple(sorted(labels.items()))
