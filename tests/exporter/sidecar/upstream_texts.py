"""Hypothesis strategies of upstream expositions: sequences of reads of an engine's /metrics, as text.

An exposition is a list of families (catalog families under the engine's `sglang:` names, and
families outside the catalog), written out by hand in the 0.0.4 text format or OpenMetrics
(with the engine's quirk: HELP and TYPE keep `:` where sample names have `_`), so that what
prometheus_client's own writer never produces is covered too: timestamps, comments, escaped
label values, NaN and infinities, exponents and integer spellings, missing and extra labels,
duplicate series. A sequence of reads starts from one exposition and changes it read by read:
values move on (or go down: an engine restart), spellings change, series appear and disappear,
HELP and TYPE lines change. The strategies stay small (a few ranks, a few families) so that a
run of a few hundred sequences takes seconds.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from hypothesis import strategies as st

# (family as the engine names it, type, own labels, bucket bounds): catalog families of each kind.
CATALOG = (
    ("sglang:load_back_bytes", "counter", (), ()),  # per_shard counter
    ("sglang:load_back_tokens", "counter", ("pool",), ()),  # replicated counter
    ("sglang:prefetched_tokens", "counter", (), ()),  # a storage counter (attn_cp_* labels)
    ("sglang:load_back_duration_seconds", "histogram", (), (0.001, 0.01, 0.1)),  # per_shard histogram
    ("sglang:prefetch_pgs", "histogram", (), (1.0, 5.0, 10.0)),  # replicated histogram
    ("sglang:hicache_host_used_tokens", "gauge", (), ()),  # replicated gauge
)
FOREIGN = (  # passed through
    ("sglang:num_requests", "counter", ("model_name",), ()),
    ("sglang:gen_throughput", "gauge", (), ()),
    ("process_open_fds", "untyped", (), ()),
    ("sglang:e2e_latency_seconds", "histogram", (), (0.5, 1.0)),
)
ODD_LABEL_VALUES = ("UnifiedRadixCache", 'a"quoted"', "back\\slash", "new\nline", "sp ace", "", "ünï")


@dataclass
class Series:
    """One series: its labels and value (a histogram's: cumulative bucket counts, sum), and how it is written."""

    labels: dict[str, str]
    value: float = 0.0
    buckets: list[float] = field(default_factory=list)  # cumulative, one per bound, then +Inf
    total: float = 0.0
    spelling: int = 0  # how values are written (see `spell`)
    timestamp: int | None = None  # ms (0.0.4 only)
    duplicate: bool = False  # its line (its first line, for a histogram) is written twice


@dataclass
class Family:
    name: str
    type: str
    own: tuple[str, ...]
    bounds: tuple[float, ...]
    help: str | None = "Some help."
    series: list[Series] = field(default_factory=list)
    comment: bool = False  # a comment line before its samples


@dataclass
class Exposition:
    families: list[Family]

    def text(self, openmetrics: bool, quirk: bool = True) -> str:
        """The exposition in one format (OpenMetrics with the engine's `:` quirk, or without it)."""
        out: list[str] = []
        for family in self.families:
            out += _family_lines(family, openmetrics, quirk)
        if openmetrics:
            out.append("# EOF")
        return "\n".join(out) + "\n"


def spell(value: float, spelling: int, integral: bool = False) -> str:
    """A value in one of the spellings engines use: Go's float, an integer, an exponent, a signed one."""
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    if spelling == 1 and value == int(value):
        return str(int(value))
    if spelling == 2 and not integral:
        return f"{value:e}"
    if spelling == 3 and value == int(value):
        return f"+{int(value)}" if value >= 0 else str(int(value))
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str], extra: str = "") -> str:
    parts = [f'{k}="{_escape(v)}"' for k, v in labels.items()]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _family_lines(family: Family, openmetrics: bool, quirk: bool) -> list[str]:
    sample_base = family.name.replace(":", "_") if openmetrics and quirk else family.name
    meta = family.name
    kind = family.type
    if openmetrics:
        kind = "unknown" if kind == "untyped" else kind
    elif kind == "counter":
        meta += "_total"  # prometheus_client's 0.0.4 writer names a counter's HELP and TYPE with _total
    lines: list[str] = []
    if family.help is not None:
        help_text = family.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines.append(f"# HELP {meta} {help_text}")
    lines.append(f"# TYPE {meta} {kind}")
    if family.comment and not openmetrics:  # OpenMetrics has no free comments
        lines.append("# a comment that is neither HELP nor TYPE")
    for series in family.series:
        stamp = f" {series.timestamp}" if series.timestamp is not None and not openmetrics else ""
        if family.type == "histogram":
            written = []
            for bound, count in zip((*family.bounds, float("inf")), series.buckets):
                le = "+Inf" if bound == float("inf") else repr(bound)
                written.append(f'{sample_base}_bucket{_labels(series.labels, f"le={chr(34)}{le}{chr(34)}")} '
                               f"{spell(count, series.spelling, integral=True)}{stamp}")
            written.append(f"{sample_base}_count{_labels(series.labels)} "
                           f"{spell(series.buckets[-1], series.spelling, integral=True)}{stamp}")
            written.append(f"{sample_base}_sum{_labels(series.labels)} {spell(series.total, series.spelling)}{stamp}")
        else:
            name = sample_base + "_total" if family.type == "counter" else sample_base
            written = [f"{name}{_labels(series.labels)} {spell(series.value, series.spelling)}{stamp}"]
        if series.duplicate:
            written.insert(1, written[0])
        lines += written
    return lines


# --- strategies ---

_counts = st.integers(0, 50)


@st.composite
def _rank_labels(draw: st.DrawFn, family: str, own: tuple[str, ...]) -> dict[str, str]:
    """Rank axes (now and then one missing or not a number), static labels, the family's own labels."""
    labels: dict[str, str] = {}
    storage = family == "sglang:prefetched_tokens"
    if storage:
        labels["storage_backend"] = "file"
    if family == "sglang:hicache_host_used_tokens":
        labels["model_name"] = "m"
    else:
        labels["cache_type"] = draw(st.sampled_from(ODD_LABEL_VALUES[:4])) if not storage else "x"
        if not labels["cache_type"]:
            del labels["cache_type"]
    for axis in ("tp_rank", "pp_rank", "dp_rank"):
        choice = draw(st.integers(0, 80))
        if choice == 0:
            continue  # a family without rank axes (an engine before per-rank labels)
        labels[axis] = "x" if choice == 1 else str(choice % 3 if axis != "pp_rank" else choice % 2)
    if storage:
        labels.update(pp_size="1", attn_cp_rank=str(draw(st.integers(0, 1))), attn_cp_size=draw(st.sampled_from(("1", "2"))))
    if draw(st.integers(0, 9)) == 0:
        labels["extra"] = draw(st.sampled_from(ODD_LABEL_VALUES))
    for name in own:
        labels[name] = draw(st.sampled_from(("kv", "mamba", 'we"ird')))
    return labels


def _fill(draw: st.DrawFn, family: Family, series: Series) -> None:
    """Values for a new series: counters and histograms from zero up, gauges anywhere."""
    if family.type == "histogram":
        counts = sorted(draw(st.lists(_counts, min_size=len(family.bounds) + 1, max_size=len(family.bounds) + 1)))
        series.buckets = [float(c) for c in counts]
        series.total = draw(st.floats(0, 100, allow_nan=False).map(lambda v: round(v, 3)))
    elif family.type == "counter":
        series.value = float(draw(_counts))
    else:
        series.value = draw(st.sampled_from((0.0, 1.5, -3.0, 1e6, 12.0)))
    series.spelling = draw(st.integers(0, 3))


@st.composite
def expositions(draw: st.DrawFn) -> Exposition:
    """One exposition: a few catalog families and families outside the catalog, a few series each."""
    chosen = draw(st.lists(st.sampled_from(CATALOG + FOREIGN), min_size=1, max_size=6, unique=True))
    families = []
    for name, kind, own, bounds in chosen:
        family = Family(name, kind, own, bounds, help=draw(st.sampled_from(("Some help.", None, "Multiprocess metric",
                                                                               'back\\slash "q"\nnew'))))
        for _ in range(draw(st.integers(0, 4))):
            family.series.append(_new_series(draw, family))
        families.append(family)
    return Exposition(families)


def _new_series(draw: st.DrawFn, family: Family) -> Series:
    if family.name.startswith("sglang:") and any(family.name == c[0] for c in CATALOG):
        labels = draw(_rank_labels(family.name, family.own))
    else:
        labels = {name: draw(st.sampled_from(ODD_LABEL_VALUES)) for name in family.own}
    series = Series(labels)
    _fill(draw, family, series)
    return series


STEPS = ("advance", "advance", "advance", "same", "reset", "spell", "add", "remove", "help", "type", "odd",
         "timestamp", "comment", "duplicate", "order", "relabel", "swap")


def _step(draw: st.DrawFn, model: Exposition) -> str:
    """Change the exposition as an engine's next read may differ; returns what was done."""
    step = draw(st.sampled_from(STEPS))
    every = [(f, s) for f in model.families for s in f.series]
    if step == "advance":
        for family, series in every:
            if draw(st.booleans()):
                if family.type == "histogram":
                    extra = draw(_counts)
                    at = draw(st.integers(0, len(series.buckets) - 1))
                    series.buckets = [c + (extra if i >= at else 0) for i, c in enumerate(series.buckets)]
                    series.total += draw(st.integers(0, 5))
                elif family.type == "counter" or draw(st.booleans()):
                    series.value += draw(_counts)
                else:
                    series.value -= draw(_counts)  # a gauge may go down
    elif step == "reset" and every:
        for family, series in every:
            if draw(st.booleans()):
                if family.type == "histogram":
                    series.buckets = [0.0] * len(series.buckets)
                    series.total = 0.0
                else:
                    series.value = 0.0
    elif step == "spell" and every:
        family, series = draw(st.sampled_from(every))
        series.spelling = draw(st.integers(0, 3))
    elif step == "add":
        family = draw(st.sampled_from(model.families))
        family.series.append(_new_series(draw, family))
    elif step == "remove" and every:
        family, series = draw(st.sampled_from(every))
        family.series.remove(series)
    elif step == "help":
        family = draw(st.sampled_from(model.families))
        family.help = draw(st.sampled_from(("Other help.", None, "Some help.")))
    elif step == "type":
        family = draw(st.sampled_from(model.families))
        if family.type in ("counter", "gauge", "untyped"):
            family.type = draw(st.sampled_from(("counter", "gauge", "untyped")))
    elif step == "odd" and every:
        family, series = draw(st.sampled_from(every))
        odd = draw(st.sampled_from((float("nan"), float("inf"), -1.0, 1e300, 0.5)))
        if family.type == "histogram":
            series.buckets[draw(st.integers(0, len(series.buckets) - 1))] = odd
        else:
            series.value = odd
    elif step == "timestamp" and every:
        family, series = draw(st.sampled_from(every))
        series.timestamp = draw(st.sampled_from((None, 1_700_000_000_000, 1_700_000_001_500)))
    elif step == "comment":
        family = draw(st.sampled_from(model.families))
        family.comment = not family.comment
    elif step == "duplicate" and every:
        family, series = draw(st.sampled_from(every))
        series.duplicate = not series.duplicate
    elif step == "order" and len(model.families) > 1:
        model.families.append(model.families.pop(0))
    elif step == "relabel" and every:  # one label value changes in place: as many lines as before
        family, series = draw(st.sampled_from(every))
        if series.labels:
            name = draw(st.sampled_from(sorted(series.labels)))
            series.labels[name] = draw(st.sampled_from(("0", "1", "kv", "other", 'o"dd')))
    elif step == "swap":  # two series of one family trade places
        family = draw(st.sampled_from(model.families))
        if len(family.series) > 1:
            family.series[0], family.series[-1] = family.series[-1], family.series[0]
    return step


@st.composite
def read_sequences(draw: st.DrawFn, reads: int = 6) -> list[Exposition]:
    """An exposition and how it reads on `reads` consecutive reads (each a copy, changed by one step or none)."""
    model = draw(expositions())
    sequence = [copy.deepcopy(model)]
    for _ in range(reads - 1):
        _step(draw, model)
        sequence.append(copy.deepcopy(model))
    return sequence
