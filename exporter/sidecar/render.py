"""Fast text exposition (Prometheus 0.0.4 and OpenMetrics 1.0) of the sidecar's state.

The per-rank catalog series are most of a scrape: each rank's lines are rendered once after it
pushes and reused until it pushes again, so a scrape only formats what changed. Rollups, derived
gauges and self-metrics are few, and are formatted from the collector's Metric objects with a
lean formatter. The output parses to exactly the samples prometheus_client's own exposition of
`SidecarCollector` gives (tests/exporter/sidecar/test_render.py holds the two side by side).
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from exporter.catalog import FamilySpec, MetricType
from exporter.sidecar.exposition import SidecarCollector, exported_name
from exporter.sidecar.ranks import RankState
from exporter.sidecar.series import HistValue, SeriesKey

SUFFIX = {MetricType.COUNTER: "_total", MetricType.GAUGE: "", MetricType.HISTOGRAM: ""}


def escape_label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def label_text(labels: dict[str, str]) -> str:
    """`name="value",...` with values escaped (names are valid by construction)."""
    return ",".join(f'{name}="{escape_label_value(value)}"' for name, value in labels.items())


def header(name: str, kind: str, help_text: str, openmetrics: bool) -> str:
    """HELP and TYPE lines; counters are named with `_total` in 0.0.4 and without it in OpenMetrics."""
    help_text = help_text.replace("\\", "\\\\").replace("\n", "\\n")
    if openmetrics:
        help_text = help_text.replace('"', '\\"')
    elif kind == "counter":
        name += "_total"
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def format_metric(metric: Metric, openmetrics: bool) -> str:
    """One collector Metric, header and samples."""
    lines = [header(metric.name, metric.type, metric.documentation, openmetrics)]
    for sample in metric.samples:
        labels = label_text(sample.labels)
        value = floatToGoString(sample.value)
        lines.append(f"{sample.name}{{{labels}}} {value}\n" if labels else f"{sample.name} {value}\n")
    return "".join(lines)


class _RankLines:
    """One rank's rendered lines per family, valid while its values have not changed, and the
    per-series line prefixes (name and labels), valid for as long as the rank exists."""

    __slots__ = ("version", "families", "prefixes")

    def __init__(self) -> None:
        self.version: tuple[int, int, str] | None = None
        self.families: dict[str, str] = {}
        self.prefixes: dict[SeriesKey, tuple[str, ...]] = {}


class TextRenderer:
    """Renders /metrics bodies, caching per-rank lines between that rank's snapshots."""

    def __init__(self, collector: SidecarCollector) -> None:
        self.collector = collector
        self.state = collector.state
        self.namespace = collector.namespace
        self.specs = {spec.name: spec for spec in self.state.catalog}
        self.exported = {spec.name: exported_name(spec, self.namespace) for spec in self.state.catalog}
        self.bounds = {
            spec.name: [floatToGoString(b) for b in spec.buckets] + ["+Inf"]
            for spec in self.state.catalog if spec.buckets
        }
        self._ranks: dict[object, _RankLines] = {}
        self._family_labels: dict[tuple[str, tuple[str, ...]], str] = {}

    def render(self, openmetrics: bool = False) -> bytes:
        state = self.state
        state.tick()
        ranks = state.exposed_ranks()
        live = {rank.identity for rank in ranks}
        for identity in [i for i in self._ranks if i not in live]:
            del self._ranks[identity]  # expired or forgotten: drop its cached lines
        per_rank = [self._rank_lines(rank) for rank in ranks]
        parts: list[str] = []
        for spec in state.catalog:
            parts.append(header(self.exported[spec.name], spec.type.value, spec.help, openmetrics))
            parts.extend(lines.families.get(spec.name, "") for lines in per_rank)
        rank_labels = {id(r): r.label_dict() for r in ranks}
        parts.extend(format_metric(metric, openmetrics) for metric in self.collector.derived(ranks, rank_labels))
        if openmetrics:
            parts.append("# EOF\n")
        return "".join(parts).encode()

    def _rank_lines(self, rank: RankState) -> _RankLines:
        cached = self._ranks.get(rank.identity)
        if cached is None:
            cached = self._ranks[rank.identity] = _RankLines()
        version = (id(rank), rank.version, rank.epoch)
        if cached.version == version:
            return cached
        prefixes = cached.prefixes
        families: dict[str, list[str]] = {}
        for key, value in rank.values.items():
            parts = prefixes.get(key)
            if parts is None:
                parts = prefixes[key] = self._prefixes(rank, key)
            out = families.get(key[0])
            if out is None:
                out = families[key[0]] = []
            # Values are finite (the protocol refuses NaN/Inf), so repr() is an exact, parseable and
            # much cheaper rendering than floatToGoString; `le` bounds keep Go's canonical spelling.
            if isinstance(value, HistValue):
                counts = value.counts
                out.extend([prefix + repr(count) for prefix, count in zip(parts, counts)])
                out.append(parts[-2] + repr(counts[-1]))
                out.append(parts[-1] + repr(value.sum))
            else:
                out.append(parts[0] + repr(value))
        cached.version = version
        cached.families = {family: "\n".join(chunk) + "\n" for family, chunk in families.items()}
        return cached

    def _prefixes(self, rank: RankState, key: SeriesKey) -> tuple[str, ...]:
        """`name{labels} ` for each line of one series (every bucket, count and sum of a histogram)."""
        family, values = key
        spec = self.specs[family]
        labels = self._labels_of(spec, values) + label_text(rank.label_dict())
        name = self.exported[family]
        if spec.type is not MetricType.HISTOGRAM:
            return (f"{name}{SUFFIX[spec.type]}{{{labels}}} ",)
        buckets = tuple(f'{name}_bucket{{{labels},le="{bound}"}} ' for bound in self.bounds[family])
        return (*buckets, f"{name}_count{{{labels}}} ", f"{name}_sum{{{labels}}} ")

    def _labels_of(self, spec: FamilySpec, values: tuple[str, ...]) -> str:
        """The family's own labels as text, with the separator before the rank labels."""
        key = (spec.name, values)
        text = self._family_labels.get(key)
        if text is None:
            text = "".join(f'{name}="{escape_label_value(value)}",' for name, value in zip(spec.labels, values))
            if len(self._family_labels) < 100_000:
                self._family_labels[key] = text
        return text
