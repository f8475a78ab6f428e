"""A prometheus_client collector that renders the sidecar's in-memory state; it never does I/O."""

from __future__ import annotations

import platform
from functools import lru_cache
from typing import Iterable, Iterator, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter import __version__
from exporter.catalog import FamilySpec, MetricType, Semantics
from exporter.sidecar.derived import Bandwidth, bandwidths, gauge_rollups, replica_spreads, window_increases
from exporter.sidecar.ranks import RankState, RankStatus
from exporter.sidecar.series import HistAccumulator, HistValue, LabelValues, StaticKey
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import SidecarStats
from exporter.client.metrics import HistogramChild

SELF = "hicache_exporter_"
KeyT = TypeVar("KeyT", bound=tuple)
ValueT = TypeVar("ValueT")
ROLLUP_HELP = {
    Semantics.PER_SHARD: "Sum over all ranks (per-shard quantity). ",
    Semantics.REPLICATED: "One leader rank per dp replica group, summed over groups (logically replicated quantity). ",
}


def _metric_type(spec: FamilySpec) -> str:
    return spec.type.value


def exported_name(spec: FamilySpec, prefix: str) -> str:
    """Metric name as prometheus_client wants it: counters without their `_total` suffix."""
    return prefix + (spec.base_name if spec.type is MetricType.COUNTER else spec.name)


def _add_value(metric: Metric, spec: FamilySpec, labels: dict[str, str], value: float | HistValue | HistAccumulator) -> None:
    name = metric.name
    if spec.type is MetricType.COUNTER:
        metric.add_sample(name + "_total", labels, float(value))  # type: ignore[arg-type]
        return
    if spec.type is MetricType.GAUGE:
        metric.add_sample(name, labels, float(value))  # type: ignore[arg-type]
        return
    assert spec.buckets is not None and isinstance(value, (HistValue, HistAccumulator))
    for bound, count in zip(_bounds(spec.buckets), value.counts):
        metric.add_sample(name + "_bucket", {**labels, "le": bound}, float(count))
    metric.add_sample(name + "_count", labels, float(value.counts[-1]))
    metric.add_sample(name + "_sum", labels, float(value.sum))


@lru_cache(maxsize=256)
def _bounds(buckets: tuple[float, ...]) -> tuple[str, ...]:
    """`le` values in Go's spelling, worked out once per bucket layout."""
    return (*(floatToGoString(b) for b in buckets), "+Inf")


def _labels(spec: FamilySpec, values: LabelValues, base: dict[str, str]) -> dict[str, str]:
    if not values:
        return base  # no labels of its own: share the rank's (or rollup's) dict, which nobody changes
    labels = dict(zip(spec.labels, values))
    labels.update(base)
    return labels


def _by_family(*sources: Iterable[tuple[KeyT, ValueT]]) -> dict[str, list[tuple[KeyT, ValueT]]]:
    """Entries keyed by (family, ...) grouped by family, in one pass: not one scan per family."""
    grouped: dict[str, list[tuple[KeyT, ValueT]]] = {}
    for source in sources:
        for entry in source:
            grouped.setdefault(entry[0][0], []).append(entry)  # type: ignore[index]
    return grouped


class SidecarCollector(Collector):
    """Yields per-rank series, rollups, derived gauges and the sidecar's self-metrics."""

    def __init__(self, state: SidecarState, stats: SidecarStats, namespace: str) -> None:
        self.state = state
        self.stats = stats
        self.namespace = namespace

    def collect(self) -> Iterator[Metric]:
        self.state.tick()
        ranks = self.state.exposed_ranks()
        rank_labels = {id(r): r.label_dict() for r in ranks}
        yield from self._per_rank(ranks, rank_labels)
        yield from self.derived(ranks, rank_labels)

    def derived(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        """Everything but the per-rank catalog series: rollups, bandwidth, spread, self-metrics."""
        state = self.state
        yield from self._rollups()
        increases = window_increases(state, state.clock())
        yield from self._bandwidth(increases, rank_labels)
        yield from self._spreads(increases)
        yield from self._self_metrics(ranks, rank_labels)

    def _per_rank(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        metrics = {
            spec.name: (spec, Metric(exported_name(spec, self.namespace), spec.help, _metric_type(spec)))
            for spec in self.state.catalog
        }
        for rank in ranks:
            base = rank_labels[id(rank)]
            for (family, values), value in rank.values.items():
                spec, metric = metrics[family]
                _add_value(metric, spec, _labels(spec, values, base), value)
        for _, metric in metrics.values():
            yield metric

    def _rollups(self) -> Iterator[Metric]:
        state = self.state
        prefix = self.namespace + "rollup_"
        by_family = _by_family(state.rollups.counters.items(), state.rollups.histograms.items(), gauge_rollups(state).items())
        for spec in state.catalog:
            metric = Metric(exported_name(spec, prefix), ROLLUP_HELP[spec.semantics] + spec.help, _metric_type(spec))
            for (_, static, values), value in by_family.get(spec.name, ()):
                _add_value(metric, spec, _labels(spec, values, dict(static)), value)
            yield metric

    def _bandwidth(self, increases: dict, rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        per_rank, rolled = bandwidths(self.state, increases)
        rank_rows: dict[str, list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]]] = {}
        for entry in per_rank:
            rank_rows.setdefault(entry[0].name, []).append(entry)
        rolled_rows = _by_family(rolled.items())
        for bytes_spec, _ in self.state.catalog.bandwidth_pairs():
            help_text = (
                f"Active bandwidth of {bytes_spec.name}: byte increase over the window divided by the "
                "increase of its duration histogram's sum (idle time excluded); absent without transfers."
            )
            metric = Metric(self.namespace + bytes_spec.bandwidth_name, help_text, "gauge")
            for spec, rank, values, bw in rank_rows.get(bytes_spec.name, ()):
                metric.add_sample(metric.name, _labels(spec, values, rank_labels[id(rank)]), bw.value)
            yield metric
            rollup = Metric(self.namespace + "rollup_" + bytes_spec.bandwidth_name, "Rolled up: " + help_text, "gauge")
            for (_, static, values), bw in rolled_rows.get(bytes_spec.name, ()):
                rollup.add_sample(rollup.name, _labels(bytes_spec, values, dict(static)), bw.value)
            yield rollup

    def _spreads(self, increases: dict) -> Iterator[Metric]:
        by_family = _by_family(replica_spreads(self.state, increases).items())
        for spec in self.state.catalog:
            if spec.type is not MetricType.COUNTER or spec.semantics is not Semantics.REPLICATED:
                continue
            metric = Metric(
                self.namespace + spec.base_name + "_replica_spread_ratio",
                f"How far live replicas' increases of {spec.name} over the window disagree: (max - min) / max.",
                "gauge",
            )
            for (_, (dp_rank, static), values), ratio in by_family.get(spec.name, ()):
                metric.add_sample(metric.name, _labels(spec, values, {"dp_rank": str(dp_rank), **dict(static)}), ratio)
            yield metric

    def _self_metrics(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        stats, state = self.stats, self.state

        def gauge(name: str, help_text: str, value: float | None = None) -> Metric:
            metric = Metric(SELF + name, help_text, "gauge")
            if value is not None:
                metric.add_sample(metric.name, {}, float(value))
            return metric

        def counter(name: str, help_text: str, value: float | None = None) -> Metric:
            metric = Metric(SELF + name, help_text, "counter")
            if value is not None:
                metric.add_sample(metric.name + "_total", {}, float(value))
            return metric

        info = gauge("build_info", "Version of the running sidecar (value is always 1).")
        info.add_sample(info.name, {"version": __version__, "python_version": platform.python_version()}, 1.0)
        yield info
        by_status = {status: 0 for status in RankStatus}
        for rank in state.ranks.values():
            by_status[rank.status] += 1
        known = gauge("ranks", "Rank identities the sidecar knows, by status.")
        for status, count in by_status.items():
            known.add_sample(known.name, {"state": status.value}, float(count))
        yield known
        up = gauge("rank_up", "1 while the rank is connected and pushing, else 0.")
        leader = gauge("rank_leader", "1 for the rank that replicated rollups of its dp replica group follow.")
        last = gauge("rank_last_push_timestamp_seconds", "Wall-clock time of the rank's last snapshot.")
        restarts = counter("rank_restarts", "Process restarts (new epochs) seen for the rank.")
        for rank in ranks:
            labels = rank_labels[id(rank)]
            up.add_sample(up.name, labels, 1.0 if rank.status is RankStatus.LIVE else 0.0)
            leader.add_sample(leader.name, labels, 1.0 if state.groups[rank.group].leader is rank else 0.0)
            if rank.last_push_wall is not None:
                last.add_sample(last.name, labels, rank.last_push_wall)
            restarts.add_sample(restarts.name + "_total", labels, float(rank.restarts))
        yield from (up, leader, last, restarts)
        yield gauge("connections", "Open rank connections.", stats.connections_open)
        yield counter("connections_accepted", "Rank connections accepted.", stats.connections_accepted)
        yield counter("frames_received", "Frames received from ranks.", stats.frames_received)
        yield counter("snapshots_received", "Snapshot frames received from ranks.", stats.snapshots_received)
        yield counter("snapshots_applied", "Snapshots applied to rank state.", stats.snapshots_applied)
        yield counter("samples_applied", "Samples applied to rank state.", stats.samples_applied)
        rejections = counter("rejections", "Frames, hellos, snapshots and samples refused, by reason.")
        for reason, count in sorted(stats.rejections.items()):
            rejections.add_sample(rejections.name + "_total", {"reason": reason}, float(count))
        yield rejections
        yield _histogram(SELF + "scrape_duration_seconds", "Time to render /metrics.", stats.scrape_duration)
        yield _histogram(SELF + "ingest_duration_seconds", "Time to apply one snapshot.", stats.ingest_duration)


def _histogram(name: str, help_text: str, child: HistogramChild) -> Metric:
    metric = Metric(name, help_text, "histogram")
    counts, total = child.cumulative()
    bounds = [floatToGoString(b) for b in child.bounds] + ["+Inf"]
    for bound, count in zip(bounds, counts):
        metric.add_sample(name + "_bucket", {"le": bound}, float(count))
    metric.add_sample(name + "_count", {}, float(counts[-1]))
    metric.add_sample(name + "_sum", {}, total)
    return metric
