"""In-memory metric children for the rank's hot path: one add per increment, no lock, no I/O.

Each child is written by one thread (the rank's scheduler thread) and read by the pusher;
reading a float or copying a list is atomic under the GIL, so snapshots are consistent
enough: a histogram's `count` is derived from its buckets at snapshot time. Snapshots are
made of the protocol's own `Sample` structs (exporter/protocol/messages.py).
"""

from __future__ import annotations

import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from exporter.errors import LabelError
from exporter.labels import own_labels_problem
from exporter.protocol.messages import BucketBound, HistogramSample, Sample, ScalarSample
from exporter.rank_catalog import MetricType, RankCatalog, RankFamily, bucket_layout_problem

_INF = math.inf  # a module global is one lookup cheaper than math.inf on the hot path
LabelValues = tuple[str, ...]
SeriesKey = tuple[str, LabelValues]

__all__ = ["CounterChild", "GaugeChild", "HistogramChild", "LabelError", "MetricSet", "SeriesKey"]


class CounterChild:
    """A cumulative counter bound to one label set."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: float = 0

    def inc(self, amount: float = 1) -> None:
        """Add `amount` (finite and not negative)."""
        if 0 <= amount < _INF:  # one chained comparison also refuses NaN
            self.value += amount
        else:
            raise ValueError(f"a counter only adds finite non-negative amounts, got {amount}")

    def sample(self, family: str, labels: dict[str, str] | None = None) -> Sample:
        """This child as a protocol sample of `family`: its cumulative value."""
        return ScalarSample(family, self.value, labels)


class GaugeChild:
    """A current value bound to one label set, or read from a callable before each snapshot (`set_function`)."""

    __slots__ = ("value", "function", "read")

    def __init__(self) -> None:
        self.value: float = 0
        self.function: Callable[[], float] | None = None
        self.read: float = math.nan  # the function's value when last polled (NaN: not yet, or it failed)

    def set(self, value: float) -> None:
        self.value = value

    def set_function(self, function: Callable[[], float] | None) -> None:
        """Read the gauge from `function` before every snapshot (as prometheus_client's `Gauge.set_function`,
        whose value nobody `set()`s); None goes back to the set value."""
        self.function = function
        self.read = math.nan

    def poll(self) -> None:
        """Read the function now (the pusher's FunctionPoller does, on a thread of its own, with a deadline)."""
        function = self.function
        if function is None:
            return
        try:
            self.read = float(function())
        except Exception:  # an engine's callback must never break the push of the rank's other series
            self.read = math.nan

    def current(self) -> float:
        """The value a snapshot carries: the function's as last polled when there is one (NaN: not pushed)."""
        return self.value if self.function is None else self.read

    def inc(self, amount: float = 1) -> None:
        self.value += amount

    def dec(self, amount: float = 1) -> None:
        self.value -= amount

    def sample(self, family: str, labels: dict[str, str] | None = None) -> Sample:
        """This child as a protocol sample of `family`: its current value."""
        return ScalarSample(family, self.current(), labels)


class HistogramChild:
    """A histogram with fixed upper bounds; per-bucket counts, made cumulative when sampled."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last slot is +Inf
        self.sum: float = 0.0

    def observe(self, value: float) -> None:
        """Record one observation (inclusive upper bounds, as in Prometheus); NaN/Inf are ignored."""
        if -_INF < value < _INF:  # a NaN/Inf observation must not poison the cumulative sum for good
            self.counts[bisect_left(self.bounds, value)] += 1
            self.sum += value

    def cumulative(self) -> tuple[list[int], float]:
        """(cumulative counts per bucket including +Inf, sum), read consistently enough."""
        counts = list(self.counts)  # one atomic copy under the GIL
        running = 0
        cumulative = []
        for count in counts:
            running += count
            cumulative.append(running)
        return cumulative, self.sum

    def sample(self, family: str, labels: dict[str, str] | None = None) -> Sample:
        """This child as a protocol sample of `family`: cumulative buckets ending in "+Inf", sum and count."""
        cumulative, total = self.cumulative()
        buckets: list[tuple[BucketBound, int]] = [*zip(self.bounds, cumulative), ("+Inf", cumulative[-1])]
        return HistogramSample(family, buckets, total, cumulative[-1], labels)


Child = CounterChild | GaugeChild | HistogramChild


class MetricSet:
    """The rank's metric children, keyed by catalog family and label values."""

    def __init__(self, catalog: RankCatalog) -> None:
        self.catalog = catalog
        self._children: dict[SeriesKey, Child] = {}
        self._lock = threading.Lock()  # taken when binding and snapshotting, never on increments

    def preset(self) -> None:
        """Create every unlabelled family and every catalog preset at 0."""
        for spec in self.catalog:
            for labels in spec.preset_label_sets():
                self.child(spec.name, labels)

    def child(
        self, family: str, labels: dict[str, Any], expect: MetricType | None = None, bounds: Sequence[float] | None = None
    ) -> Child:
        """The child for `family` with `labels`, created at 0 on first use; a histogram's `bounds` replace the catalog's."""
        spec = self.catalog.get(family)
        if expect is not None and spec.type is not expect:
            raise LabelError(f"{family!r} is a {spec.type.value}, not a {expect.value}")
        layout = None if bounds is None else self._layout(spec, bounds)
        values = self._label_values(spec, labels)
        key = (spec.name, values)
        child = self._children.get(key)
        if child is None:
            with self._lock:
                child = self._children.get(key)
                if child is None:
                    child = self._new_child(spec, layout)
                    self._children[key] = child
        if layout is not None and isinstance(child, HistogramChild) and child.bounds != layout:
            raise LabelError(f"{family!r}{dict(zip(spec.labels, values))} already has the buckets {list(child.bounds)}")
        return child

    @staticmethod
    def _layout(spec: RankFamily, bounds: Sequence[float]) -> tuple[float, ...]:
        if spec.type is not MetricType.HISTOGRAM:
            raise LabelError(f"{spec.name!r} is a {spec.type.value}: only a histogram has buckets")
        layout = tuple(float(b) for b in bounds)
        if not layout or bucket_layout_problem(layout) is not None:
            raise LabelError(f"{spec.name!r}: buckets must be finite and strictly ascending (+Inf implied), got {list(bounds)}")
        return layout

    @staticmethod
    def _label_values(spec: RankFamily, labels: dict[str, Any]) -> LabelValues:
        problem = own_labels_problem(spec.name, spec.labels, labels)
        if problem:
            raise LabelError(problem)
        return tuple(str(labels[name]) for name in spec.labels)

    @staticmethod
    def _new_child(spec: RankFamily, bounds: tuple[float, ...] | None = None) -> Child:
        if spec.type is MetricType.COUNTER:
            return CounterChild()
        if spec.type is MetricType.GAUGE:
            return GaugeChild()
        assert spec.buckets is not None
        return HistogramChild(bounds or spec.buckets)

    def items(self) -> list[tuple[SeriesKey, Child]]:
        with self._lock:
            return list(self._children.items())

    def __iter__(self) -> Iterator[SeriesKey]:
        return iter(key for key, _ in self.items())

    def wire_samples(self) -> list[Sample]:
        """Every child as a protocol sample: cumulative counters and histograms, current gauges."""
        out = []
        for (family, values), child in self.items():
            labels = dict(zip(self.catalog.get(family).labels, values))
            if isinstance(child, HistogramChild):
                out.append(child.sample(family, labels))
                continue
            value = child.current() if isinstance(child, GaugeChild) else child.value
            if math.isfinite(value):  # JSON cannot carry NaN/Inf, and the sidecar would refuse it anyway
                out.append(ScalarSample(family, value, labels))
        return out

    def functions(self) -> list[tuple[SeriesKey, GaugeChild]]:
        """The gauges read from a function (`set_function`), which the pusher's FunctionPoller reads."""
        return [(key, child) for key, child in self.items() if isinstance(child, GaugeChild) and child.function is not None]

    def poll(self) -> None:
        """Read every function gauge's function now, in this thread (GaugeChild.poll)."""
        for _, child in self.functions():
            child.poll()

    def counted(self) -> bool:
        """Whether any counter or histogram has counted something since it was created or restarted."""
        for _, child in self.items():
            if isinstance(child, CounterChild) and child.value:
                return True
            if isinstance(child, HistogramChild) and (any(child.counts) or child.sum):
                return True
        return False

    def restart(self) -> None:
        """Counters and histograms back to 0, as in a process that starts again; gauges keep their values
        (a gauge is a current value, not a position: a new epoch reports it as it is)."""
        with self._lock:
            for child in self._children.values():
                if isinstance(child, CounterChild):
                    child.value = 0
                elif isinstance(child, HistogramChild):
                    child.counts = [0] * len(child.counts)
                    child.sum = 0.0

    def samples(self) -> list[dict[str, Any]]:
        """The same samples as plain JSON-ready objects, as they go on the wire (empty labels left out)."""
        return msgspec.to_builtins(self.wire_samples())
