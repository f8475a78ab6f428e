"""The reference exposition: the sidecar's state as prometheus_client Metric objects.

/metrics is served by the fast renderer (exporter/sidecar/expose/render.py), which writes its text
directly. This collector yields the same series as prometheus_client families, so that the library's
own exposition (`generate_latest`, and the OpenMetrics one) can be held against the fast text: the
tests in this folder (test_render.py above all) compare the two, sample for sample and header for
header. It lives in the tests because nothing in the package needs it.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from exporter.sidecar.core.keys import LabelValues
from exporter.sidecar.core.ranks import RankState, RankStatus
from exporter.sidecar.expose.collector import (
    SidecarCollector,
    add_value,
    by_family,
    new_metric,
    rollup_cells,
    series_labels,
    window_increases,
)


class ReferenceCollector(SidecarCollector, Collector):
    """Yields per-rank series, rollups, bandwidth and spread gauges, and the sidecar's self-metrics,
    in /metrics order, as prometheus_client Metric objects."""

    def collect(self) -> Iterator[Metric]:
        ranks = self.state.exposed_ranks()
        rank_labels = {id(r): r.label_dict() for r in ranks}
        yield from self._per_rank(ranks, rank_labels)
        yield from self._rollups()
        known, increases = window_increases(self.state)
        yield from self._bandwidth(known, increases, rank_labels)
        yield from self._spreads(increases)
        yield from self._self_metrics(ranks, rank_labels)
        for collector in self.extra:
            yield from collector.collect()

    def _per_rank(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        if not self.per_rank_series:
            return
        reported = self.state.help
        metrics = {name: new_metric(family, reported.get(name)) for name, family in self.families.per_rank.items()}
        for rank in ranks:
            base = rank_labels[id(rank)]
            for (family, values), value in rank.values.items():
                add_value(metrics[family], series_labels(self.label_names(family), values, base), value)
        yield from metrics.values()

    def _rollups(self) -> Iterator[Metric]:
        """Rollup series; counters and histograms with their start time as `_created`, which the
        OpenMetrics exposition shows and the 0.0.4 one leaves out. Per-rank series have none."""
        cells = rollup_cells(self.state)
        created = self.state.rollup_created()  # gauges have no entry
        for name, family in self.families.rollup.items():
            metric = new_metric(family)
            for key, value in cells.get(name, ()):
                add_value(metric, series_labels(self.label_names(name), key[2], dict(key[1])), value, created.get(key))
            yield metric

    def _bandwidth(
        self, known: list[RankState], increases: dict[int, dict[tuple[str, LabelValues], float]],
        rank_labels: dict[int, dict[str, str]],
    ) -> Iterator[Metric]:
        per_rank, rolled = self.state.bandwidths(known, increases)
        rank_rows: dict[str, list[tuple[RankState, LabelValues, float]]] = {}
        for spec, rank, values, bw in per_rank:
            rank_rows.setdefault(spec.name, []).append((rank, values, bw.value))
        rolled_rows = by_family(rolled.items())
        for name, (per_rank_family, rollup_family) in self.families.bandwidth.items():
            names = self.label_names(name)
            if self.per_rank_series:  # a per-rank series of a catalog family, as the per-rank values are
                metric = new_metric(per_rank_family)
                for rank, values, value in rank_rows.get(name, ()):
                    metric.add_sample(metric.name, series_labels(names, values, rank_labels[id(rank)]), value)
                yield metric
            rollup = new_metric(rollup_family)
            for (_, static, values), bw in rolled_rows.get(name, ()):
                rollup.add_sample(rollup.name, series_labels(names, values, dict(static)), bw.value)
            yield rollup

    def _spreads(self, increases: dict[int, dict[tuple[str, LabelValues], float]]) -> Iterator[Metric]:
        spreads = by_family(self.state.spreads(increases).items())
        for name, family in self.families.spread.items():
            metric = new_metric(family)
            for (_, (dp_rank, static), values), ratio in spreads.get(name, ()):
                labels = series_labels(self.label_names(name), values, {"dp_rank": str(dp_rank), **dict(static)})
                metric.add_sample(metric.name, labels, ratio)
            yield metric

    def _self_metrics(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        """The package's self-metrics, with the per-rank ones (which the renderer writes itself) filled in."""
        metric = self.self_metrics()
        up, last, restarts = metric["rank_up"], metric["rank_last_push_timestamp_seconds"], metric["rank_restarts"]
        for rank in ranks:
            labels = rank_labels[id(rank)]
            add_value(up, labels, 1.0 if rank.status is RankStatus.LIVE else 0.0)
            if rank.last_push_wall is not None:
                add_value(last, labels, rank.last_push_wall)
            add_value(restarts, labels, rank.restarts)
        yield from metric.values()
