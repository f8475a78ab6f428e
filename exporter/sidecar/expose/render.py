"""Fast text exposition (Prometheus 0.0.4 and OpenMetrics 1.0) of the sidecar's state.

The per-rank catalog series are most of a scrape: each rank's lines are rendered once after it
pushes and reused until it pushes again, so a scrape only formats what changed. Rollups, bandwidth
and spread gauges and the per-rank self-metrics are written as text straight from the state's
reads, each series' label text kept between scrapes; the other self-metrics and extra collectors
(few) are the collector's Metric objects, through a lean formatter. The output parses to exactly
the samples prometheus_client's own exposition of the reference collector gives
(tests/exporter/sidecar/expose/reference.py; test_render.py holds the two side by side).
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from functools import partial
from math import isfinite

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from exporter.catalog import FamilySpec, MetricType
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import HistAccumulator, HistValue, LabelValues, SeriesKey, StaticKey
from exporter.sidecar.core.ranks import RankState, RankStatus
from exporter.sidecar.expose.collector import (
    PER_RANK_SELF,
    SidecarCollector,
    by_family,
    le_values,
    rollup_cells,
    series_labels,
    window_increases,
)
from exporter.sidecar.expose.families import SELF, SELF_FAMILIES, Family, value_sample_name

SERIES_TEXTS_LIMIT = 100_000  # label texts of rollup, spread and per-rank bandwidth series kept between scrapes


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
    else:
        name = value_sample_name(name, kind)
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n"


def spell_value(value: float) -> str:
    """repr() for finite values (exact and cheap), Go's spelling for NaN and infinities."""
    return repr(value) if isfinite(value) else floatToGoString(value)


class LabelTexts:
    """`name="value",...` by label set, remembered: escaping costs more than the rest of a line."""

    def __init__(self, limit: int = 20_000) -> None:
        self.limit = limit  # label sets of departed ranks drop out when it is reached
        self._texts: dict[tuple[tuple[str, str], ...], str] = {}

    def __call__(self, labels: dict[str, str]) -> str:
        key = tuple(labels.items())
        text = self._texts.get(key)
        if text is None:
            if len(self._texts) >= self.limit:
                self._texts.clear()
            text = self._texts[key] = label_text(labels)
        return text


def format_metric(metric: Metric, openmetrics: bool, label_texts: Callable[[dict[str, str]], str] = label_text) -> str:
    """One collector Metric, header and samples; its `_created` samples only in OpenMetrics (the
    0.0.4 text format has no place for them)."""
    lines = [header(metric.name, metric.type, metric.documentation, openmetrics)]
    created = "" if openmetrics else metric.name + "_created"
    for sample in metric.samples:
        if sample.name == created:
            continue
        labels = label_texts(sample.labels) if sample.labels else ""
        value = spell_value(sample.value)
        lines.append(f"{sample.name}{{{labels}}} {value}\n" if labels else f"{sample.name} {value}\n")
    return "".join(lines)


def _group_labels(dp_rank: int, static: StaticKey) -> dict[str, str]:
    """A replica group's labels, as its spread series carry them."""
    return {"dp_rank": str(dp_rank), **dict(static)}


def _line(sample: str, labels: str, value: str) -> str:
    """One sample line, as format_metric writes it: no braces without labels."""
    return f"{sample}{{{labels}}} {value}\n" if labels else f"{sample} {value}\n"


def _series_lines(out: list[str], family: Family, labels: str, value: float | HistValue | HistAccumulator,
                  created: float | None) -> None:
    """The lines of one series as the collector's `add_value` makes its samples and format_metric
    writes them: a counter's `_total` or a gauge, or a histogram's buckets, count and sum; then its
    `_created` if given (OpenMetrics only: the caller gives none for the 0.0.4 format)."""
    name = family.name
    if isinstance(value, (HistValue, HistAccumulator)):
        counts = value.counts
        prefix = f"{name}_bucket{{{labels},le=\"" if labels else f"{name}_bucket{{le=\""
        out += [f'{prefix}{bound}"}} {spell_value(float(count))}\n' for bound, count in zip(le_values(value.bounds), counts)]
        out.append(_line(name + "_count", labels, spell_value(float(counts[-1]))))
        out.append(_line(name + "_sum", labels, spell_value(float(value.sum))))
    else:
        out.append(_line(family.sample_name, labels, spell_value(float(value))))
    if created is not None:
        out.append(_line(name + "_created", labels, spell_value(created)))


class _RankLines:
    """One rank's lines, a bytes block per family, valid while its values have not changed; the
    layout they are filled from, valid while its set of series has not changed; and the
    per-series line prefixes (name and labels), valid while the rank exists."""

    __slots__ = ("version", "blocks", "shape", "layout", "prefixes", "epoch")

    def __init__(self) -> None:
        self.epoch = ""  # the epoch `prefixes` were made in: histogram layouts change only across epochs
        self.version: tuple[int, int, str] | None = None
        self.blocks: dict[str, bytes] = {}  # family -> its lines for this rank, reused until the rank pushes
        self.shape: tuple[int, str, int, int] | None = None
        self.layout = _RankLayout([])
        self.prefixes: dict[SeriesKey, tuple[str, ...]] = {}


def line_template(prefix: str, spelling: str) -> str:
    """`prefix` (name and labels, `%` doubled) then a %-format slot for its value and a newline."""
    return prefix.replace("%", "%%") + spelling + "\n"


class _RankLayout:
    """A rank's lines as one bytes %-template per family: per line its prefix (name and labels),
    a slot for its value and a newline. A render fills each family's template with one C-level
    `template % values`: no string is built per line, and the body joins one piece per rank and
    family. Values are spelled `%r` (repr(), exact and cheap: the protocol refuses NaN and
    infinities), bucket counts `%d` (ints by type, decoded as ints by the protocol: the same text
    as repr(), and cheaper). Measured against the str-per-line layout it replaced: BENCHMARKS.md,
    section "Fast paths", "the /metrics renderer"."""

    __slots__ = ("families",)

    def __init__(self, families: list[tuple[str, list[SeriesKey], bool, bytes]]) -> None:
        self.families = families  # (family, its series, histogram?, template) in the rank's order

    def fill(self, values: Mapping[SeriesKey, object]) -> dict[str, bytes]:
        """Each family's lines with the rank's current values."""
        blocks: dict[str, bytes] = {}
        for family, keys, histogram, template in self.families:
            # Most families hold one series: its values go straight in, with no argument list built
            # (15 % of a fill at 64 full-catalog ranks; BENCHMARKS.md "Fast paths", "Bytes %-templates").
            if histogram:
                if len(keys) == 1:
                    value = values[keys[0]]
                    counts = value.counts  # type: ignore[attr-defined]
                    blocks[family] = template % (*counts, counts[-1], value.sum)  # type: ignore[attr-defined]
                    continue
                args: list[object] = []
                for key in keys:
                    value = values[key]
                    counts = value.counts  # type: ignore[attr-defined]
                    args += counts
                    args.append(counts[-1])
                    args.append(value.sum)  # type: ignore[attr-defined]
                blocks[family] = template % tuple(args)
            elif len(keys) == 1:
                blocks[family] = template % (values[keys[0]],)
            else:
                blocks[family] = template % tuple(map(values.__getitem__, keys))
        return blocks


# Fast path: formats only what changed since the last scrape (payoff: BENCHMARKS.md "Fast paths"; proof: expose/test_render.py).
class TextRenderer:
    """Renders /metrics bodies, caching per-rank lines between that rank's snapshots."""

    def __init__(
        self, collector: SidecarCollector, pass_through: list[Callable[[bool], str]] | None = None,
    ) -> None:
        self.collector = collector
        self.pass_through = pass_through or []  # upstream families outside the catalog, as text
        self.state = collector.state
        self.specs = {spec.name: spec for spec in self.state.catalog}
        self.families = collector.families.per_rank
        self._ranks: dict[object, _RankLines] = {}
        self._family_labels: dict[tuple[str, tuple[str, ...]], str] = {}
        self._label_texts = LabelTexts()
        self._headers: dict[tuple[str, str, bool], bytes] = {}
        self._heads: dict[tuple[Family, bool], str] = {}  # the derived families' HELP and TYPE lines
        # Label texts of derived series by their key (rollup, spread, or family, values and rank
        # labels), kept between scrapes: escaping and joining cost more than the rest of a line.
        # A rollup bandwidth key is shaped as its bytes family's rollup key: the same labels, the same text.
        self._series_texts: dict[tuple[object, ...], str] = {}

    def render(self, openmetrics: bool = False) -> bytes:
        """One /metrics body. The garbage collector waits until it is done: a render allocates
        thousands of short-lived strings, enough to set off a full collection over every rank's
        state now and then, which showed in the p99 (BENCHMARKS.md, section "Fast paths", "no
        garbage collection during a render")."""
        if not gc.isenabled():
            return self._render(openmetrics)
        gc.disable()
        try:
            return self._render(openmetrics)
        finally:
            gc.enable()

    def _render(self, openmetrics: bool) -> bytes:
        state = self.state
        ranks = state.exposed_ranks()
        live = {rank.identity for rank in ranks}
        for identity in [i for i in self._ranks if i not in live]:
            del self._ranks[identity]  # expired or forgotten: drop its cached lines
        per_rank = [self._rank_lines(rank).blocks for rank in ranks] if self.collector.per_rank_series else []
        reported = state.help  # the engine's HELP texts, where ranks sent them
        parts: list[bytes] = []
        for spec in state.catalog if self.collector.per_rank_series else ():
            family = self.families[spec.name]
            parts.append(self._header(family.name, family.type, reported.get(spec.name, family.help), openmetrics))
            name = spec.name
            parts += [block for blocks in per_rank if (block := blocks.get(name)) is not None]
        texts = self._label_texts
        rank_texts = {id(r): texts(r.label_dict()) for r in ranks}
        rest: list[str] = []
        self._rollups(rest, openmetrics)
        known, increases = window_increases(state)
        self._bandwidth(rest, known, increases, rank_texts, openmetrics)
        self._spreads(rest, increases, openmetrics)
        self._self_metrics(rest, ranks, rank_texts, openmetrics)
        for collector in self.collector.extra:  # prometheus_client's process collector, say
            rest += [format_metric(metric, openmetrics, texts) for metric in collector.collect()]
        rest.extend(text(openmetrics) for text in self.pass_through)
        if openmetrics:
            rest.append("# EOF\n")
        parts.append("".join(rest).encode())
        return b"".join(parts)

    def _header(self, name: str, kind: str, help_text: str, openmetrics: bool) -> bytes:
        key = (name, help_text, openmetrics)
        text = self._headers.get(key)
        if text is None:
            if len(self._headers) >= 1_000:  # HELP texts come from ranks: bounded, as label texts are
                self._headers.clear()
            text = self._headers[key] = header(name, kind, help_text, openmetrics).encode()
        return text

    # Fast path: the derived series (rollups, bandwidth, spread, per-rank self-metrics) written as text,
    # not built as prometheus_client Metric objects and then formatted (BENCHMARKS.md "Fast paths",
    # "Derived series as text"). Proof: tests/exporter/sidecar/expose/test_render.py against reference.py.
    def _head(self, family: Family, openmetrics: bool) -> str:
        key = (family, openmetrics)
        text = self._heads.get(key)
        if text is None:
            text = self._heads[key] = header(family.name, family.type, family.help, openmetrics)
        return text

    def _series_text(self, key: tuple[object, ...], names: tuple[str, ...], values: LabelValues,
                     base: Callable[[], dict[str, str]]) -> str:
        """The label text of the series `key` names: its family's own labels, then `base()`'s."""
        text = self._series_texts.get(key)
        if text is None:
            if len(self._series_texts) >= SERIES_TEXTS_LIMIT:  # departed ranks' and groups' series drop out
                self._series_texts.clear()
            text = self._series_texts[key] = label_text(series_labels(names, values, base()))
        return text

    def _rollups(self, out: list[str], openmetrics: bool) -> None:
        """Rollup series; counters and histograms with their start time as `_created`, which only the
        OpenMetrics exposition shows. Per-rank series have none: theirs would change with every
        epoch, which is no reset of the series."""
        cells = rollup_cells(self.state)
        created = self.state.rollup_created() if openmetrics else {}  # gauges have no entry
        names = self.collector.label_names
        texts = self._series_text
        for name, family in self.collector.families.rollup.items():
            out.append(self._head(family, openmetrics))
            own = names(name)
            for key, value in cells.get(name, ()):
                labels = texts(key, own, key[2], partial(dict, key[1]))
                _series_lines(out, family, labels, value, created.get(key))

    def _bandwidth(self, out: list[str], known: list[RankState], increases: dict[int, Increases],
                   rank_texts: dict[int, str], openmetrics: bool) -> None:
        per_rank, rolled = self.state.bandwidths(known, increases)
        rank_rows: dict[str, list[tuple[RankState, LabelValues, float]]] = {}
        for spec, rank, values, bw in per_rank:
            rank_rows.setdefault(spec.name, []).append((rank, values, bw.value))
        rolled_rows = by_family(rolled.items())
        texts = self._series_text
        for name, (per_rank_family, rollup_family) in self.collector.families.bandwidth.items():
            own = self.collector.label_names(name)
            if self.collector.per_rank_series:  # a per-rank series of a catalog family, as the per-rank values are
                out.append(self._head(per_rank_family, openmetrics))
                sample = per_rank_family.name
                for rank, values, value in rank_rows.get(name, ()):
                    rank_text = rank_texts[id(rank)]
                    labels = rank_text if not values else texts(
                        (name, values, rank_text), own, values, rank.label_dict)
                    out.append(_line(sample, labels, spell_value(value)))
            out.append(self._head(rollup_family, openmetrics))
            sample = rollup_family.name
            for key, bw in rolled_rows.get(name, ()):
                labels = texts(key, own, key[2], partial(dict, key[1]))
                out.append(_line(sample, labels, spell_value(bw.value)))

    def _spreads(self, out: list[str], increases: dict[int, Increases], openmetrics: bool) -> None:
        spreads = by_family(self.state.spreads(increases).items())
        texts = self._series_text
        for name, family in self.collector.families.spread.items():
            out.append(self._head(family, openmetrics))
            own = self.collector.label_names(name)
            for key, ratio in spreads.get(name, ()):
                _, (dp_rank, static), values = key
                labels = texts(key, own, values, partial(_group_labels, dp_rank, static))
                out.append(_line(family.name, labels, spell_value(ratio)))

    def _self_metrics(self, out: list[str], ranks: list[RankState], rank_texts: dict[int, str],
                      openmetrics: bool) -> None:
        """The collector's self-metrics, its per-rank ones written here (one line per rank each)."""
        texts = self._label_texts
        for name, metric in self.collector.self_metrics().items():
            if name not in PER_RANK_SELF:
                out.append(format_metric(metric, openmetrics, texts))
                continue
            family = SELF_FAMILIES[SELF + name]
            out.append(self._head(family, openmetrics))
            sample = family.sample_name
            for rank in ranks:
                if name == "rank_up":
                    value = "1.0" if rank.status is RankStatus.LIVE else "0.0"
                elif name == "rank_restarts":
                    value = spell_value(float(rank.restarts))
                elif rank.last_push_wall is not None:
                    value = spell_value(float(rank.last_push_wall))
                else:
                    continue  # never pushed: no last push time
                out.append(_line(sample, rank_texts[id(rank)], value))

    def _rank_lines(self, rank: RankState) -> _RankLines:
        cached = self._ranks.get(rank.identity)
        if cached is None:
            cached = self._ranks[rank.identity] = _RankLines()
        version = (id(rank), rank.version, rank.epoch)
        if cached.version == version:
            return cached
        values = rank.values
        if cached.epoch != rank.epoch:
            cached.prefixes.clear()
            cached.epoch = rank.epoch
        # Within an epoch series are only ever added, so the count names the set of series (an
        # epoch conflict starts the epoch over in place: its count is part of the epoch here).
        shape = (id(rank), rank.epoch, rank.epoch_conflicts, len(values))
        if cached.shape != shape:
            cached.layout = self._layout(rank, cached.prefixes)
            cached.shape = shape
        cached.blocks = cached.layout.fill(values)
        cached.version = version
        return cached

    def _layout(self, rank: RankState, prefixes: dict[SeriesKey, tuple[str, ...]]) -> _RankLayout:
        """Group the rank's series by family and make each family's template."""
        keys_by_family: dict[str, list[SeriesKey]] = {}
        for key in rank.values:
            keys_by_family.setdefault(key[0], []).append(key)
        families = []
        for family, keys in keys_by_family.items():
            histogram = self.specs[family].type is MetricType.HISTOGRAM
            lines: list[str] = []
            for key in keys:
                parts = prefixes.get(key)
                if parts is None:
                    parts = prefixes[key] = self._prefixes(rank, key)
                if histogram:  # every bucket and the count are ints, the sum a float
                    lines += [line_template(prefix, "%d") for prefix in parts[:-1]]
                    lines.append(line_template(parts[-1], "%r"))
                else:
                    lines += [line_template(prefix, "%r") for prefix in parts]
            families.append((family, keys, histogram, "".join(lines).encode()))
        return _RankLayout(families)

    def _prefixes(self, rank: RankState, key: SeriesKey) -> tuple[str, ...]:
        """`name{labels} ` for each line of one series (every bucket, count and sum of a histogram)."""
        family, values = key
        spec = self.specs[family]
        labels = self._labels_of(spec, values) + label_text(rank.label_dict())
        exposed = self.families[family]
        value = rank.values[key]
        if not isinstance(value, HistValue):
            return (f"{exposed.sample_name}{{{labels}}} ",)
        name = exposed.name
        buckets = tuple(f'{name}_bucket{{{labels},le="{bound}"}} ' for bound in le_values(value.bounds))
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
