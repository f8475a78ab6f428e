"""The sample reader: turns a snapshot's samples into validated series updates, or rejections.

It owns what applying a sample must check (family, labels, shape, value, layout, limits) and
the caches that make a known series cheap to check; it records each rank's values as pushed
and hands the ledger one update per series that moved.
"""

from __future__ import annotations

import operator
from collections.abc import Hashable, Iterable
from typing import TypeVar

from msgspec import UNSET

from exporter.catalog import Catalog, bucket_layout_problem
from exporter.config import RanksConfig
from exporter.errors import ErrorCode, SampleRejected
from exporter.labels import own_labels_problem
from exporter.protocol.messages import Sample
from exporter.sidecar.core.keys import (
    BUCKETS_PER_SERIES,
    LABEL_CHARS_PER_UNIT,
    FamilyPlan,
    HistValue,
    Layout,
    SeriesKey,
    SeriesRoute,
    Update,
    Value,
    histogram_cost,
    label_size,
    line_chars,
    make_rollup_key,
    series_cost,
)
from exporter.sidecar.core.ranks import RankRegistry, RankState

KeyT = TypeVar("KeyT", bound=Hashable)
MAX_LAYOUTS = 4096  # distinct bucket layouts shared between series; more are used unshared
# Bounds on what a value may be, so that every sum the sidecar forms (rollups over max_ranks
# ranks) stays finite and every count converts to a float exactly.
MAX_COUNT = 2**53
MAX_VALUE = 2.0**63
Rejection = tuple[ErrorCode, str]  # kept as plain data: an exception would pin its traceback's frames


class SampleReader:
    """Validates samples against the catalog and each rank's last values; keeps the rank's values."""

    def __init__(self, catalog: Catalog, config: RanksConfig, registry: RankRegistry) -> None:
        self.config = config
        self.registry = registry
        self._plans = {f.name: FamilyPlan.of(f) for f in catalog}
        self._profiles = ", ".join(catalog.profiles)  # named when a family is unknown
        self._interned: dict[Hashable, Hashable] = {}  # series keys, rollup keys and routes: see _intern
        self._new_series = 0
        self._layouts: dict[Layout, Layout] = {plan.default_layout: plan.default_layout
                                               for plan in self._plans.values() if plan.histogram}

    def read(self, rank: RankState, samples: list[Sample]) -> tuple[list[Update], list[Rejection]]:
        """Record `rank`'s new values; return the updates for the ledger and the samples refused."""
        # The hottest code in the sidecar (every sample of every push): locals over attributes,
        # C-level builtins over Python loops, and the unchanged-value exits first.
        updates: list[Update] = []
        rejections: list[Rejection] = []
        self._new_series = 0  # the weight of the rollup series new series may make when the ledger applies them
        by_place = rank.by_place
        values = rank.values
        find_route = self._find_route
        for place, sample in enumerate(samples):
            try:
                if place < len(by_place):
                    family, labels, route = by_place[place]
                    if family != sample.family or labels != sample.labels:  # equality, no hashing: fresh strings
                        route = find_route(rank, sample, place)
                else:
                    route = find_route(rank, sample, place)
                plan = route.plan
                key = route.key
                previous = values.get(key)
                if plan.histogram:
                    self._histogram(rank, route, sample, previous, updates)  # type: ignore[arg-type]
                    continue
                value = sample.value
                if value is UNSET or sample.buckets is not UNSET or sample.sum is not UNSET or sample.count is not UNSET:
                    raise SampleRejected(
                        ErrorCode.TYPE_MISMATCH,
                        f"{plan.name!r} is a {plan.kind.value}: send a value, and no buckets, sum or count",
                    )
                if value == previous:
                    continue  # unchanged since the last snapshot: the common case when idle
                if not -MAX_VALUE <= value <= MAX_VALUE:
                    raise SampleRejected(ErrorCode.INVALID_VALUE, f"{plan.name!r}: {value} is beyond ±2**63")
                if previous is None:
                    chars = line_chars(rank.label_chars, rank.label_width, route.own_chars, route.own_width)
                    cost = series_cost(None, chars, plan.lines)
                    # A gauge makes no rollup cell (its rollup line is in its own weight): room for it twice, as ever.
                    rollup = cost if plan.gauge else series_cost(None, route.rollup_chars)
                    self._check_series_room(rank, cost, chars, rollup, lines=plan.lines)
                if plan.gauge:
                    if previous is None:
                        self.registry.budget.per_rank += cost
                        rank.cost += cost
                    values[key] = value
                    rank.version += 1
                    rank.gauge_keys[key] = None
                    continue
                if value < 0:
                    raise SampleRejected(ErrorCode.INVALID_VALUE, f"counter {plan.name!r} is negative ({value})")
                if previous is None:
                    delta = value
                    self.registry.budget.per_rank += cost
                    rank.cost += cost
                    self._new_series += rollup
                else:
                    if value < previous:  # type: ignore[operator]
                        raise SampleRejected(
                            ErrorCode.COUNTER_DECREASED,
                            f"counter {plan.name!r}{dict(zip(plan.labels, key[1]))} went down from {previous} to {value} "
                            "within one epoch; a restarted process must say hello with a new epoch",
                        )
                    delta = value - previous  # type: ignore[operator]
                values[key] = value
                rank.version += 1
                updates.append((route, delta, None))
            except SampleRejected as err:
                rejections.append((err.code, err.message))
        return updates, rejections

    def _histogram(
        self, rank: RankState, route: SeriesRoute, sample: Sample, previous: HistValue | None, updates: list[Update],
    ) -> None:
        plan, key = route.plan, route.key
        name = plan.name
        buckets = sample.buckets
        total = sample.sum
        if buckets is UNSET or total is UNSET or sample.count is UNSET or sample.value is not UNSET:
            raise SampleRejected(ErrorCode.TYPE_MISMATCH, f"{name!r} is a histogram: send buckets, sum and count, and no value")
        bounds, counts = zip(*buckets)  # two tuples, built in C
        if counts[-1] != sample.count:
            raise SampleRejected(
                ErrorCode.BUCKET_MISMATCH,
                f"{name!r}: the +Inf bucket ({counts[-1]}) must equal count ({sample.count})",
            )
        layout: Layout
        if previous is not None:
            layout = previous.bounds
            if bounds != layout:
                raise SampleRejected(
                    ErrorCode.BUCKET_MISMATCH,
                    f"{name!r}: the bucket layout changed within one epoch; a rank keeps one layout per series",
                )
            if counts == previous.counts:
                if total != previous.sum:
                    raise SampleRejected(ErrorCode.INVALID_VALUE, f"histogram {name!r}: sum changed without new observations")
                return  # nothing new: the common case of an idle histogram
        else:
            layout = self._layout(name, bounds)
        if counts[0] < 0:
            raise SampleRejected(ErrorCode.INVALID_VALUE, f"{name!r}: bucket counts must not be negative")
        if list(counts) != sorted(counts):  # cumulative counts never go down from bucket to bucket
            raise SampleRejected(ErrorCode.BUCKET_MISMATCH, f"{name!r}: bucket counts are not cumulative")
        if counts[-1] > MAX_COUNT or not -MAX_VALUE <= total <= MAX_VALUE:
            raise SampleRejected(ErrorCode.INVALID_VALUE, f"{name!r}: a count beyond 2**53 or a sum beyond ±2**63")
        deltas: tuple[int, ...] | list[int]
        if previous is None:
            chars = line_chars(rank.label_chars, rank.label_width, route.own_chars, route.own_width)
            cost = series_cost(layout, chars)
            rollup = series_cost(layout, route.rollup_chars)
            self._check_series_room(rank, cost, chars, rollup, layout)
            self.registry.budget.per_rank += cost
            rank.cost += cost
            self._new_series += rollup
            deltas, dsum = counts, total
        else:
            deltas = list(map(operator.sub, counts, previous.counts))
            if sorted(deltas)[0] < 0:  # sorted() compares ints on a fast path that min() lacks
                raise SampleRejected(ErrorCode.COUNTER_DECREASED, f"histogram {name!r} bucket counts went down within one epoch")
            dsum = total - previous.sum
            if dsum < 0:
                raise SampleRejected(ErrorCode.COUNTER_DECREASED, f"histogram {name!r}: sum went down within one epoch")
        rank.values[key] = HistValue(layout, counts, total)
        rank.version += 1
        updates.append((route, dsum, deltas))

    def _layout(self, name: str, bounds: tuple[float | str, ...]) -> Layout:
        """A series' first bucket layout, checked, as the object shared by every series with it."""
        shared = self._layouts.get(bounds)
        if shared is not None:
            return shared
        finite = bounds[:-1]
        if bounds[-1] != "+Inf" or any(isinstance(b, str) for b in finite):
            raise SampleRejected(ErrorCode.BUCKET_MISMATCH, f'{name!r}: the last bucket bound, and only the last, must be "+Inf"')
        if bucket_layout_problem(finite) is not None:  # type: ignore[arg-type]
            raise SampleRejected(ErrorCode.BUCKET_MISMATCH, f"{name!r}: bucket bounds must be finite and strictly ascending")
        if len(self._layouts) < MAX_LAYOUTS:
            self._layouts[bounds] = bounds
        return bounds

    def _find_route(self, rank: RankState, sample: Sample, place: int) -> SeriesRoute:
        """The route of a sample not where the rank's last snapshot had it; remembered at `place`."""
        labels = sample.labels
        route = rank.routes.get((sample.family, tuple(labels.items())) if labels else sample.family)
        if route is None:
            route = self._route(rank, sample)
        by_place = rank.by_place
        entry = (sample.family, labels, route)
        if place < len(by_place):
            by_place[place] = entry
        elif place == len(by_place) and place < self.config.max_series_per_rank:
            by_place.append(entry)
        return route

    def _route(self, rank: RankState, sample: Sample) -> SeriesRoute:
        """Validate a sample's family and labels; remember the result when it names its series canonically."""
        family, labels = sample.family, sample.labels
        plan = self._plans.get(family)
        if plan is None:
            raise SampleRejected(ErrorCode.UNKNOWN_FAMILY, f"family {family!r} is not in the catalog of the profiles "
                                 f"served ({self._profiles}); another engine's needs its profile served (--profile)")
        label_values = self._label_values(plan, labels) if labels or plan.labels else ()
        name = plan.name  # the catalog's string object, shared by every rank's keys
        own_chars, own_width = label_size(tuple(zip(plan.labels, label_values)))
        rollup_chars = line_chars(rank.shared_chars, rank.shared_width, own_chars, own_width)
        if (name, label_values) not in rank.values:
            # Before anything is interned or indexed for it, at its least weight (one line; a histogram's
            # layout is checked when its value is read).
            chars = line_chars(rank.label_chars, rank.label_width, own_chars, own_width)
            self._check_series_room(rank, series_cost(None, chars, plan.lines), chars,
                                    series_cost(None, rollup_chars), lines=plan.lines)
        intern = self._intern
        route = intern(SeriesRoute(
            plan, intern((name, label_values)), intern(make_rollup_key(name, rank.shared, label_values)),
            own_chars=own_chars, own_width=own_width, rollup_chars=rollup_chars))
        # Labels in the catalog's order (as the client library sends them) map one-to-one to
        # series, so the index is bounded like the rank's series; other orders are not kept.
        if tuple(labels) == plan.labels and len(rank.routes) < self.config.max_series_per_rank:
            ident = intern((name, tuple(zip(plan.labels, route.key[1])))) if labels else name  # == what samples send
            rank.routes[ident] = route
        return route

    def _intern(self, key: KeyT) -> KeyT:
        """One shared object per distinct key or route: ranks' equal keys then compare by identity
        in every dict and set they meet (rollups, windows, spreads) and take memory once. Bounded:
        past max_series_total distinct ones, new ones are used as they are (correct, just slower)."""
        interned = self._interned
        if len(interned) < self.config.max_series_total:
            return interned.setdefault(key, key)  # type: ignore[return-value]
        return interned.get(key, key)  # type: ignore[return-value]

    def _check_series_room(self, rank: RankState, cost: int, chars: int, rollup: int, layout: Layout | None = None,
                           lines: int = 1) -> None:
        """Refuse a new series of weight `cost` (keys.series_cost of `layout`, a histogram's, `chars` and
        `lines`), whose rollup cell may weigh `rollup`, that a limit has no room for."""
        weight = ""
        if cost > 1 and layout is not None and cost == histogram_cost(layout):
            weight = f" (a histogram of {(cost - 1) * BUCKETS_PER_SERIES}+ buckets counts {cost})"
        elif cost > 1:
            count = lines if layout is None else len(layout) + 2
            where = "its line" if count == 1 else f"each of its {count} lines"
            weight = f" (a series whose labels write {chars} characters on {where} counts {cost}: one per {LABEL_CHARS_PER_UNIT})"
        if rank.cost + cost > self.config.max_series_per_rank:
            raise SampleRejected(
                ErrorCode.SERIES_LIMIT,
                f"rank {rank.describe()} already holds {rank.cost} of max_series_per_rank="
                f"{self.config.max_series_per_rank} series{weight}",
            )
        if not self.registry.budget.has_room(self._new_series, cost, rollup):
            raise SampleRejected(
                ErrorCode.SERIES_LIMIT,
                f"the sidecar already holds max_series_total={self.config.max_series_total} series, rank "
                f"and rollup series together{weight}",
            )

    def first_values(self, rank: RankState, samples: list[Sample]) -> dict[SeriesKey, Value]:
        """The counters and histograms in `samples` by series, as values: what a reconnect's first
        snapshot is compared with, to tell which writer of its epoch sent it. Checks nothing
        else (read does): samples that name no series, and gauges, are left out."""
        firsts: dict[SeriesKey, Value] = {}
        for sample in samples:
            labels = sample.labels
            route = rank.routes.get((sample.family, tuple(labels.items())) if labels else sample.family)
            if route is not None:
                plan, key = route.plan, route.key
            else:
                found = self._plans.get(sample.family)
                if found is None:
                    continue
                plan = found
                try:
                    key = (plan.name, self._label_values(plan, labels) if labels or plan.labels else ())
                except SampleRejected:
                    continue
            if plan.gauge:
                continue
            if plan.histogram:
                if sample.buckets is UNSET or sample.sum is UNSET or not sample.buckets:
                    continue
                bounds, counts = zip(*sample.buckets)
                firsts[key] = HistValue(bounds, counts, sample.sum)
            elif sample.value is not UNSET:
                firsts[key] = sample.value
        return firsts

    def _label_values(self, plan: FamilyPlan, labels: dict[str, str]) -> tuple[str, ...]:
        names = plan.labels
        try:
            if len(labels) != len(names):
                raise KeyError
            values = tuple(map(labels.__getitem__, names))
        except KeyError:  # the same test as labels.own_labels_problem, on the fast path; its message
            raise SampleRejected(ErrorCode.WRONG_LABELS, own_labels_problem(plan.name, names, labels) or "") from None
        limit = self.config.max_family_label_value_length
        if values and max(map(len, values)) > limit:
            raise SampleRejected(ErrorCode.WRONG_LABELS, f"{plan.name!r}: a label value is longer than {limit} characters "
                                 "(ranks.max_family_label_value_length)")
        return values


def below(new: dict[SeriesKey, Value], old: dict[SeriesKey, Value], keys: Iterable[SeriesKey]) -> bool:
    """Whether, in a series of `keys`, `new` is below `old` in some part: a counter's value, or a
    histogram's count, sum or (same layout length) one of its buckets. A series `new` lacks counts
    as zero (its writer has not counted it yet); one `old` lacks is not compared."""
    for key in keys:
        a, b = new.get(key), old.get(key)
        if b is None:
            continue
        if a is None:
            if (b.count > 0 or b.sum > 0) if isinstance(b, HistValue) else b > 0:
                return True
            continue
        if isinstance(a, HistValue) and isinstance(b, HistValue):
            if (a.count < b.count or a.sum < b.sum
                    or (len(a.counts) == len(b.counts) and any(map(operator.lt, a.counts, b.counts)))):
                return True
        elif not isinstance(a, HistValue) and not isinstance(b, HistValue) and a < b:
            return True
    return False
