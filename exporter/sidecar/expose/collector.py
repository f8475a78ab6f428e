"""What the exposition is made of, besides each rank's values: the exposed families, the rollup
cells and window reads grouped for it, and the sidecar's self-metrics as prometheus_client Metric
objects; no I/O.

/metrics is written by the renderer (render.py). The same series as prometheus_client Metric
objects, all of them, are the reference it is held to: tests/exporter/sidecar/expose/reference.py
(tests/exporter/sidecar/expose/test_render.py holds the two side by side).
"""

from __future__ import annotations

import os
import platform
import subprocess
from collections.abc import Iterable, Sequence
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
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.servers import build_servers
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.families import SELF, SELF_FAMILIES, ExposedFamilies, Family, value_sample_name

ENV_REVISION = "HICACHE_EXPORTER_REVISION"
# Self-metrics with a series per rank: `SidecarCollector.self_metrics` leaves them empty, the
# renderer writes them (TextRenderer._rank_self_metrics), the reference collector fills them.
PER_RANK_SELF = ("rank_up", "rank_last_push_timestamp_seconds", "rank_restarts")
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


def series_labels(names: tuple[str, ...], values: LabelValues, base: dict[str, str]) -> dict[str, str]:
    """One series' labels: its family's own (`names` with `values`), then `base` (the rank's, or the rollup's)."""
    if not values:
        return base  # no labels of its own: share the rank's (or rollup's) dict, which nobody changes
    labels = dict(zip(names, values))
    labels.update(base)
    return labels


def by_family(*sources: Iterable[tuple[KeyT, ValueT]]) -> dict[str, list[tuple[KeyT, ValueT]]]:
    """Entries keyed by (family, ...) grouped by family, in one pass: not one scan per family."""
    grouped: dict[str, list[tuple[KeyT, ValueT]]] = {}
    for source in sources:
        for entry in source:
            grouped.setdefault(entry[0][0], []).append(entry)
    return grouped


def rollup_cells(state: SidecarState) -> dict[str, list[tuple[RollupKey, float | HistAccumulator]]]:
    """Every rollup series (counters, histograms, then gauges over the current ranks), grouped by family."""
    return by_family(state.rollup_counters().items(), state.rollup_histograms().items(), state.rollup_gauges().items())


def window_increases(state: SidecarState) -> tuple[list[RankState], dict[int, Increases]]:
    """Every known rank in exposition order, and (by id) the increase of each of its positions over the window."""
    known = state.known_ranks()
    return known, state.window_increases(known)


class SidecarCollector:
    """What /metrics is made of besides the state: the exposed families, the sidecar's revision and
    self-metrics, and other collectors rendered last. The fast renderer (render.py) writes the text;
    tests/exporter/sidecar/expose/reference.py yields the same series as prometheus_client Metric
    objects, the reference the renderer is held to."""

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

    def label_names(self, family: str) -> tuple[str, ...]:
        """The catalog family's own label names."""
        return self._labels[family]

    def exposed_names(self) -> set[str]:
        """Every family name this collector can expose (counters without `_total`)."""
        names = {f.name for f in self.families.per_rank.values()} | {f.name for f in self.families.rollup.values()}
        names |= {f.name for pair in self.families.bandwidth.values() for f in pair}
        names |= {f.name for f in self.families.spread.values()} | set(SELF_FAMILIES)
        names |= {metric.name for collector in self.extra for metric in collector.collect()}  # process_*, say
        return names

    def self_metrics(self) -> dict[str, Metric]:
        """The sidecar's self-metrics to show, by name less `hicache_exporter_`, in exposition order.
        The per-rank ones (PER_RANK_SELF) are left empty: the renderer writes their lines itself."""
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
        return {name: m for name, m in metric.items() if not name.startswith(hidden)}  # startswith(()) is False


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
