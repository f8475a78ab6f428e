"""A prometheus_client collector over the sidecar's state: the reference exposition; no I/O.

/metrics is served by the faster renderer (render.py), whose output parses to exactly the
samples this collector yields (tests/exporter/sidecar/expose/test_render.py holds the two side by side).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable, Iterator, Sequence
from functools import lru_cache
from typing import TypeVar

from prometheus_client.metrics import Histogram
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from exporter import __version__
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import HistAccumulator, HistValue, LabelValues, Layout, RollupKey
from exporter.sidecar.core.ranks import RankState, RankStatus
from exporter.sidecar.core.servers import build_servers
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.families import SELF, SELF_FAMILIES, ExposedFamilies, Family, value_sample_name

ENV_REVISION = "HICACHE_EXPORTER_REVISION"
KeyT = TypeVar("KeyT", bound=tuple)
ValueT = TypeVar("ValueT")
_METRIC_CLASS = {"counter": CounterMetricFamily, "gauge": GaugeMetricFamily, "histogram": HistogramMetricFamily}


def new_metric(family: Family, help_text: str | None = None) -> Metric:
    """An empty prometheus_client metric family for `family` (with another HELP text, if given)."""
    return _METRIC_CLASS[family.type](family.name, help_text or family.help)


@lru_cache(maxsize=1)
def build_revision() -> str:
    """The commit the sidecar runs: $HICACHE_EXPORTER_REVISION (set by an image build), else the git
    checkout the package lives in, else "unknown"."""
    revision = os.environ.get(ENV_REVISION, "").strip()
    if revision:
        return revision
    try:
        result = subprocess.run(["git", "rev-parse", "HEAD"], cwd=os.path.dirname(os.path.abspath(__file__)),
                                capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    out = result.stdout.strip()
    return out if result.returncode == 0 and out else "unknown"


@lru_cache(maxsize=256)
def le_values(bounds: Layout) -> tuple[str, ...]:
    """`le` values of a bucket layout in Go's spelling, worked out once per layout."""
    return tuple(b if isinstance(b, str) else floatToGoString(b) for b in bounds)


def add_value(
    metric: Metric, labels: dict[str, str], value: float | HistValue | HistAccumulator, created: float | None = None,
) -> None:
    """The samples of one series: a counter's `_total`, a gauge, or a histogram's buckets, count and sum;
    then its `_created` if given (last of the series, where OpenMetrics wants it)."""
    name = metric.name
    if isinstance(value, (HistValue, HistAccumulator)):
        for bound, count in zip(le_values(value.bounds), value.counts):
            metric.add_sample(name + "_bucket", {**labels, "le": bound}, float(count))
        metric.add_sample(name + "_count", labels, float(value.counts[-1]))
        metric.add_sample(name + "_sum", labels, float(value.sum))
    else:
        metric.add_sample(value_sample_name(name, metric.type), labels, float(value))
    if created is not None:
        metric.add_sample(name + "_created", labels, created)


def _labels(names: tuple[str, ...], values: LabelValues, base: dict[str, str]) -> dict[str, str]:
    if not values:
        return base  # no labels of its own: share the rank's (or rollup's) dict, which nobody changes
    labels = dict(zip(names, values))
    labels.update(base)
    return labels


def _by_family(*sources: Iterable[tuple[KeyT, ValueT]]) -> dict[str, list[tuple[KeyT, ValueT]]]:
    """Entries keyed by (family, ...) grouped by family, in one pass: not one scan per family."""
    grouped: dict[str, list[tuple[KeyT, ValueT]]] = {}
    for source in sources:
        for entry in source:
            grouped.setdefault(entry[0][0], []).append(entry)
    return grouped


def rollup_cells(state: SidecarState) -> dict[str, list[tuple[RollupKey, float | HistAccumulator]]]:
    """Every rollup series (counters, histograms, then gauges over the current ranks), grouped by family."""
    return _by_family(state.rollup_counters().items(), state.rollup_histograms().items(), state.rollup_gauges().items())


def window_increases(state: SidecarState) -> tuple[list[RankState], dict[int, Increases]]:
    """Every known rank in exposition order, and (by id) the increase of each of its positions over the window."""
    known = state.known_ranks()
    return known, state.window_increases(known)


class SidecarCollector(Collector):
    """Yields per-rank series, rollups, bandwidth and spread gauges, and the sidecar's self-metrics."""

    def __init__(
        self, state: SidecarState, health: SidecarHealth, namespace: str, per_rank_series: bool = True,
        extra: Sequence[Collector] = (),
    ) -> None:
        self.state = state
        self.health = health
        self.per_rank_series = per_rank_series
        self.extra = tuple(extra)  # other collectors rendered last, such as prometheus_client's process collector
        self.revision = build_revision()
        self.families = ExposedFamilies(state.catalog, namespace)
        self._labels = {spec.name: spec.labels for spec in state.catalog}

    def collect(self) -> Iterator[Metric]:
        ranks = self.state.exposed_ranks()
        rank_labels = {id(r): r.label_dict() for r in ranks}
        yield from self._per_rank(ranks, rank_labels)
        yield from self.derived(ranks, rank_labels)

    def derived(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        """Everything but the per-rank catalog series: rollups, bandwidth, spread, self-metrics."""
        state = self.state
        yield from self._rollups()
        known, increases = window_increases(state)
        yield from self._bandwidth(known, increases, rank_labels)
        yield from self._spreads(increases)
        yield from self._self_metrics(ranks, rank_labels)
        for collector in self.extra:
            yield from collector.collect()

    def exposed_names(self) -> set[str]:
        """Every family name this collector can expose (counters without `_total`)."""
        names = {f.name for f in self.families.per_rank.values()} | {f.name for f in self.families.rollup.values()}
        names |= {f.name for pair in self.families.bandwidth.values() for f in pair}
        names |= {f.name for f in self.families.spread.values()} | set(SELF_FAMILIES)
        names |= {metric.name for collector in self.extra for metric in collector.collect()}  # process_*, say
        return names

    def _per_rank(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        if not self.per_rank_series:
            return
        reported = self.state.help
        metrics = {name: new_metric(family, reported.get(name)) for name, family in self.families.per_rank.items()}
        for rank in ranks:
            base = rank_labels[id(rank)]
            for (family, values), value in rank.values.items():
                add_value(metrics[family], _labels(self._labels[family], values, base), value)
        yield from metrics.values()

    def _rollups(self) -> Iterator[Metric]:
        """Rollup series; counters and histograms with their start time as `_created`, which the
        OpenMetrics exposition shows and the 0.0.4 one leaves out (render.format_metric). Per-rank
        series have none: theirs would change with every epoch, which is no reset of the series."""
        by_family = rollup_cells(self.state)
        created = self.state.rollup_created()  # gauges have no entry
        for name, family in self.families.rollup.items():
            metric = new_metric(family)
            for key, value in by_family.get(name, ()):
                add_value(metric, _labels(self._labels[name], key[2], dict(key[1])), value, created.get(key))
            yield metric

    def _bandwidth(
        self, known: list[RankState], increases: dict[int, dict[tuple[str, LabelValues], float]],
        rank_labels: dict[int, dict[str, str]],
    ) -> Iterator[Metric]:
        per_rank, rolled = self.state.bandwidths(known, increases)
        rank_rows: dict[str, list[tuple[RankState, LabelValues, float]]] = {}
        for spec, rank, values, bw in per_rank:
            rank_rows.setdefault(spec.name, []).append((rank, values, bw.value))
        rolled_rows = _by_family(rolled.items())
        for name, (per_rank_family, rollup_family) in self.families.bandwidth.items():
            names = self._labels[name]
            if self.per_rank_series:  # a per-rank series of a catalog family, as the per-rank values are
                metric = new_metric(per_rank_family)
                for rank, values, value in rank_rows.get(name, ()):
                    metric.add_sample(metric.name, _labels(names, values, rank_labels[id(rank)]), value)
                yield metric
            rollup = new_metric(rollup_family)
            for (_, static, values), bw in rolled_rows.get(name, ()):
                rollup.add_sample(rollup.name, _labels(names, values, dict(static)), bw.value)
            yield rollup

    def _spreads(self, increases: dict[int, dict[tuple[str, LabelValues], float]]) -> Iterator[Metric]:
        state = self.state
        by_family = _by_family(state.spreads(increases).items())
        for name, family in self.families.spread.items():
            metric = new_metric(family)
            for (_, (dp_rank, static), values), ratio in by_family.get(name, ()):
                labels = _labels(self._labels[name], values, {"dp_rank": str(dp_rank), **dict(static)})
                metric.add_sample(metric.name, labels, ratio)
            yield metric

    def _self_metrics(self, ranks: list[RankState], rank_labels: dict[int, dict[str, str]]) -> Iterator[Metric]:
        health, state = self.health, self.state
        metric = {name[len(SELF):]: new_metric(family) for name, family in SELF_FAMILIES.items()}
        info = metric["build_info"]
        info.add_sample(info.name, {"version": __version__, "revision": self.revision,
                                  "python_version": platform.python_version()}, 1.0)
        for status, count in state.ranks_by_status().items():
            add_value(metric["ranks"], {"state": status.value}, count)
        known = state.known_ranks()
        if any(rank.world is not None for rank in known):  # no world, nothing expected: the scrape skips the work
            config = state.config
            for server in build_servers(known, state.catalog.streams, config.max_ranks, config.node_rank, config.nodes):
                for dp, missing in sorted(server.missing_by_dp.items()):
                    add_value(metric["ranks_missing"], {**dict(server.labels), "dp_rank": str(dp)}, missing)
        up, last, restarts = metric["rank_up"], metric["rank_last_push_timestamp_seconds"], metric["rank_restarts"]
        for rank in ranks:
            labels = rank_labels[id(rank)]
            add_value(up, labels, 1.0 if rank.status is RankStatus.LIVE else 0.0)
            if rank.last_push_wall is not None:
                add_value(last, labels, rank.last_push_wall)
            add_value(restarts, labels, rank.restarts)
        for name, value in (
            ("connections", health.connections_open), ("connections_accepted", health.connections_accepted),
            ("frames_received", health.frames_received), ("snapshots_received", health.snapshots_received),
            ("snapshots_applied", health.snapshots_applied), ("samples_applied", health.samples_applied),
        ):
            metric[name].add_metric([], float(value))  # type: ignore[attr-defined]
        for reason, count in sorted(health.rejections.items()):
            add_value(metric["rejections"], {"reason": reason}, count)
        for family, count in state.layout_conflicts().items():
            add_value(metric["rollup_layout_conflicts"], {"family": family}, count)
        for upstream in health.upstreams.values():
            labels = {"upstream": upstream.name}
            add_value(metric["upstream_series_resets"], labels, upstream.series_resets)
            add_value(metric["upstream_series_flapping"], labels, upstream.flapping)
            add_value(metric["upstream_up"], labels, 1.0 if upstream.up else 0.0)
            if upstream.last_scrape_wall is not None:
                add_value(metric["upstream_last_scrape_timestamp_seconds"], labels, upstream.last_scrape_wall)
            if upstream.last_duration is not None:
                add_value(metric["upstream_scrape_duration_seconds"], labels, upstream.last_duration)
            add_value(metric["upstream_samples"], labels, upstream.samples)
            for kind, count in sorted(upstream.errors.items()):
                add_value(metric["upstream_scrape_errors"], {**labels, "kind": kind}, count)
            for family in sorted(upstream.unranked):
                add_value(metric["upstream_unranked_families"], {**labels, "family": family}, 1.0)
            for family in sorted(upstream.cp_colliding):
                add_value(metric["upstream_cp_colliding_families"], {**labels, "family": family}, 1.0)
        saving = health.persistence
        if saving.enabled:
            for table, name in ((saving.load_failures, "persistence_load_failures"),
                                (saving.write_failures, "persistence_write_failures"),
                                (saving.dropped, "persistence_dropped_series")):
                for reason, count in sorted(table.items()):
                    add_value(metric[name], {"reason": reason}, count)
            add_value(metric["persistence_writes"], {}, saving.writes)
            add_value(metric["persistence_loaded_identities"], {}, saving.loaded_identities)
            readings: tuple[tuple[str, float | None], ...] = (
                ("persistence_last_write_timestamp_seconds", saving.last_write_wall),
                ("persistence_write_duration_seconds", saving.last_write_duration),
                ("persistence_file_bytes", saving.file_bytes),
                ("persistence_load_duration_seconds", saving.load_duration))
            for name, reading in readings:
                if reading is not None:  # not written, or nothing loaded, yet
                    add_value(metric[name], {}, reading)
        _durations(metric["scrape_duration_seconds"], health.scrape_duration)
        _durations(metric["ingest_duration_seconds"], health.ingest_duration)
        # A sidecar without upstreams, or without a state file, shows no empty families of either.
        hidden: tuple[str, ...] = () if health.upstreams else ("upstream_",)
        hidden += () if saving.enabled else ("persistence_",)
        hidden += () if metric["ranks_missing"].samples else ("ranks_missing",)  # no server with an expected world
        yield from (m for name, m in metric.items() if not name.startswith(hidden))  # startswith(()) is False


def _durations(metric: Metric, histogram: Histogram) -> None:
    """prometheus_client's histogram under the family's name: its buckets and sum, not its `_created`
    (no sidecar family has one)."""
    buckets, total = [], 0.0
    (collected,) = histogram.collect()
    for sample in collected.samples:
        if sample.name.endswith("_bucket"):
            buckets.append((sample.labels["le"], sample.value))
        elif sample.name.endswith("_sum"):
            total = sample.value
    metric.add_metric([], buckets, total)  # type: ignore[attr-defined]
