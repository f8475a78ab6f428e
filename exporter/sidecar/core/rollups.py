"""The rollup ledger: rank positions, replica-group watermarks and the rollups built from them.

The rules, stated once here (README, "Rollups", says them to users); whether a family is replicated or per_shard is
`FamilySpec`'s to say, and a rollup series' key is `keys.make_rollup_key` (family, the static
labels a replica group shares, the family's own label values):

* Every rank has a **position** per counter and histogram series: its values made continuous
  across its own restarts (a new epoch continues from the last value the previous one
  reported, as `increase()` does across a reset), so a position never decreases. A rank seen
  for the first time starts at its reported cumulative value.
* **per_shard** counters and histograms: the rollup is the sum of the ranks' positions (bucket
  by bucket for histograms, over the ranks that share the rollup series' layout).
* **replicated** counters and histograms: each replica group (same `dp_rank` and static labels)
  contributes its **watermark**, the furthest position any of its replicas has reported
  (`W = max(W, position)` at every value; per bucket and for the sum of histograms); the rollup
  is the sum of the groups' watermarks. Replicas reporting at different instants, in any
  order, departures, hand-overs and restarts neither lose nor double-count: at any settled
  point the rollup is one replica's value per group, summed.
* **gauges**: per_shard gauges sum the current (live, pushed) ranks' values; replicated gauges
  take, per group, the current replica first in replica order (the lowest `(pp_rank,
  attn_cp_rank, tp_rank)`: ranks.replica_order), summed over groups.
* A histogram series whose layout differs from its rollup series' (the layout of the first
  value the rollup saw) is exposed per rank but left out of that rollup, counted in
  `layout_conflicts` and logged once per rank, series and epoch.

Rollups therefore never decrease while the sidecar runs, and a departed or expired rank
keeps its contribution. Both rules are applied incrementally: a position's increase goes
into the rollup at once (per_shard), or as far as it raises its group's watermark (replicated).
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable, Iterable

from exporter.catalog import Catalog, MetricType
from exporter.sidecar.core.keys import (
    GroupKey,
    HistAccumulator,
    Layout,
    RollupCounter,
    RollupKey,
    SeriesBudget,
    SeriesKey,
    SeriesRoute,
    Update,
    make_rollup_key,
    series_cost,
)
from exporter.sidecar.core.ranks import RankState, replica_order

log = logging.getLogger("hicache_exporter.ledger")
Watermarks = dict[SeriesKey, "RollupCounter | HistAccumulator"]


class RollupLedger:
    """Rollup counters and histograms, the watermarks of every replica group, and gauge rollups."""

    def __init__(self, catalog: Catalog, budget: SeriesBudget, wall_clock: Callable[[], float] = time.time) -> None:
        self.budget = budget  # each rollup series created counts against max_series_total, by keys.series_cost
        self.wall_clock = wall_clock
        self.counter_cells: dict[RollupKey, RollupCounter] = {}
        self.histograms: dict[RollupKey, HistAccumulator] = {}
        # When each rollup counter and histogram began (wall clock): OpenMetrics' `_created`, kept in
        # the durable state, so that only a true start over reads as a reset.
        self.created: dict[RollupKey, float] = {}
        self.watermarks: dict[GroupKey, Watermarks] = {}
        self.layout_conflicts: dict[str, int] = {}  # by family: rank series left out of their rollup
        self._gauge_per_shard = {f.name: f.per_shard for f in catalog if f.type is MetricType.GAUGE}

    @property
    def counters(self) -> dict[RollupKey, float]:
        """Every rollup counter's value, as a new dict."""
        return {key: cell.value for key, cell in self.counter_cells.items()}

    def apply(self, rank: RankState, updates: list[Update]) -> None:
        """Move `rank`'s positions by the reader's updates, and the rollups with them."""
        positions = rank.positions
        if rank.resumed:
            updates = self._baselines(rank, updates)
        marks: Watermarks | None = None
        for route, amount, bucket_deltas in updates:
            key = route.key
            position = positions.get(key, 0.0) + amount
            positions[key] = position
            if bucket_deltas is not None:
                if marks is None:
                    marks = self.watermarks.setdefault(rank.replica_group, {})
                self._histogram(rank, route, amount, bucket_deltas, marks)
                continue
            cell = route.counter
            if cell is None:  # the rollup series exists from its first accepted value
                cell = route.counter = self._counter_cell(route)
            if route.plan.per_shard:
                cell.value += amount
                continue
            if marks is None:
                marks = self.watermarks.setdefault(rank.replica_group, {})
            mark = marks.get(key)
            if mark is None:
                mark = marks[key] = RollupCounter()
            if position > mark.value:  # type: ignore[union-attr]
                cell.value += position - mark.value  # type: ignore[union-attr]
                mark.value = position  # type: ignore[union-attr]

    def _counter_cell(self, route: SeriesRoute) -> RollupCounter:
        key = route.rollup_key
        cell = self.counter_cells.get(key)
        if cell is None:
            cell = self.counter_cells[key] = RollupCounter()
            self.created[key] = self.wall_clock()
            self.budget.rollup += series_cost(None, route.rollup_chars)
        return cell

    @staticmethod
    def _baselines(rank: RankState, updates: list[Update]) -> list[Update]:
        """A resumed rank's first value of each per_shard series is a baseline: the rollup already
        holds what its forgotten self pushed, so the value only sets the position. (What it moved
        while forgotten is not known: never counted twice, at worst that gap is missed.)"""
        rest = []
        for update in updates:
            route, amount, _ = update
            if route.plan.per_shard and route.key not in rank.positions:
                rank.positions[route.key] = amount
            else:
                rest.append(update)
        return rest

    def _histogram(
        self, rank: RankState, route: SeriesRoute, dsum: float, deltas: list[int] | tuple[int, ...], marks: Watermarks,
    ) -> None:
        key = route.key
        bounds = rank.values[key].bounds  # type: ignore[union-attr]
        acc = route.histogram
        if acc is None:  # the rollup series exists from its first accepted value, with that layout
            acc = self.histograms.get(route.rollup_key)
            if acc is None:
                acc = self.histograms[route.rollup_key] = HistAccumulator.empty(bounds)
                self.created[route.rollup_key] = self.wall_clock()
                self.budget.rollup += series_cost(bounds, route.rollup_chars)
            route.histogram = acc
        if acc.bounds is not bounds and acc.bounds != bounds:
            self._conflict(rank, key, bounds, acc.bounds)
            return
        if route.plan.per_shard:
            acc.add(deltas, dsum)
            return
        held = rank.bucket_positions.get(key)
        if held is None or held[0] != bounds:  # first seen, or a new layout: the position starts here
            counts, total = list(deltas), dsum
        else:
            counts, total = list(map(operator.add, held[1], deltas)), held[2] + dsum
        rank.bucket_positions[key] = (bounds, counts, total)
        mark = marks.get(key)
        if mark is None:
            mark = marks[key] = HistAccumulator.empty(bounds)
        assert isinstance(mark, HistAccumulator)
        raised = list(map(max, mark.counts, counts))
        if raised != mark.counts:
            acc.counts = list(map(operator.add, acc.counts, map(operator.sub, raised, mark.counts)))
            mark.counts = raised
        if total > mark.sum:
            acc.sum += total - mark.sum
            mark.sum = total

    def _conflict(self, rank: RankState, key: SeriesKey, bounds: Layout, rollup_bounds: Layout) -> None:
        if key in rank.layout_conflicts:
            return
        rank.layout_conflicts.add(key)
        family = key[0]
        self.layout_conflicts[family] = self.layout_conflicts.get(family, 0) + 1
        log.warning(
            "rank %s: histogram %s%s has bucket layout %s, its rollup has %s: exposed per rank, left out of the rollup",
            rank.describe(), family, list(key[1]) or "", _spell(bounds), _spell(rollup_bounds),
        )

    def gauges(self, ranks: Iterable[RankState]) -> dict[RollupKey, float]:
        """Gauge rollups over the current ranks: per_shard sums them, replicated takes one per group."""
        out: dict[RollupKey, float] = {}
        taken: set[tuple[int, RollupKey]] = set()  # (dp_rank, rollup key) a replica already spoke for
        per_shard = self._gauge_per_shard
        for rank in sorted((r for r in ranks if r.current and r.gauge_keys), key=replica_order):
            values = rank.values
            for key in rank.gauge_keys:
                rollup_key = make_rollup_key(key[0], rank.shared, key[1])
                if not per_shard[key[0]]:
                    if (rank.dp_rank, rollup_key) in taken:
                        continue
                    taken.add((rank.dp_rank, rollup_key))
                out[rollup_key] = out.get(rollup_key, 0.0) + values[key]  # type: ignore[operator]
        return out


def _spell(bounds: Layout) -> str:
    return "[" + ", ".join(map(str, bounds)) + "]"
