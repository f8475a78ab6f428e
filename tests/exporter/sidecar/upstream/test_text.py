"""The text layout (exporter.sidecar.upstream.text) against prometheus_client's own parsers.

Whenever the layout reads a text by its values alone, the library's parser must give the same:
the families of the text the layout was made from (names, HELP, types, every sample's name and
labels) with exactly the values and timestamps the layout read, and no error. Where the layout
declines, the feed parses with the library, so declining is always right; the tests also check
that it does not decline what an engine writes.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.sidecar.upstream.text import TextLayout, parse_exposition, sample_number
from tests.exporter.sidecar.upstream_texts import read_sequences

PROPERTY = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
LINES = 10_000


def _shape(families: list[Metric]) -> list[Any]:
    """Everything the parser gives but the values and timestamps."""
    return [(f.name, f.documentation, f.type, f.unit,
             [(s.name, s.labels, s.exemplar, s.native_histogram) for s in f.samples]) for f in families]


def _same(a: object, b: object) -> bool:
    """Equal and of one type (an int is not a float here), NaN equal to NaN."""
    if type(a) is not type(b):
        return False
    return a == b or (isinstance(a, float) and math.isnan(a) and isinstance(b, float) and math.isnan(b))


def _parse(text: str, openmetrics: bool) -> list[Metric] | None:
    try:
        return parse_exposition(text, openmetrics)
    except ValueError:
        return None


def _check_read(layout: TextLayout, made_from: list[Metric], text: str, openmetrics: bool) -> bool:
    """Read `text` with the layout; where it reads it, the library must agree. True when it read it."""
    read = layout.values_of(text)
    if read is None:
        return False
    families = _parse(text, openmetrics)
    assert families is not None, "the layout read a text the library's parser refuses"
    assert _shape(families) == _shape(made_from), "the layout read a text whose shape differs"
    samples = [s for f in families for s in f.samples]
    values, timestamps = read
    assert len(values) == len(samples)
    for sample, value, timestamp in zip(samples, values, timestamps):
        assert _same(sample.value, value), (sample, value)
        assert sample.timestamp == timestamp or _same(sample.timestamp, timestamp), (sample, timestamp)
    return True


# --- one line: the value (and timestamp) read from it, as the library reads it ---

_TOKENS = st.one_of(
    st.integers(-10**25, 10**25).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.floats(-1e6, 1e6).map(lambda v: f"{v:e}"),
    st.sampled_from(["NaN", "nan", "+Inf", "-Inf", "Inf", "inf", "Infinity", "-infinity", "+5", "-0", "007", "1e3",
                     "1E+03", ".5", "5.", "1_000", "0x10", "1e", "e1", "--1", "+-1", "abc", "1.2.3", "١٢", "²",
                     "1" + "0" * 400, "-" + "9" * 400, "1e400"]),
    st.text("0123456789.eE+-naifINAF_x", min_size=1, max_size=8),
)
_SERIES = st.sampled_from([
    "x", "x_total", "sglang:x", "x{}", 'x{a="b"}', 'x{a="b",c="d"}', 'x{a="sp ace"}', 'x{a="q\\"t"}',
    'x{a="b\\\\"}', 'x{a="n\\nl"}', 'x{a="br}ce"}', 'x{a="{"}', 'x{ a="b" }', 'x{a="b",}', "x {}", '{__name__="x"}',
    'x{a="b"} # {t="1"} 1', "1x", "x{a=b}", 'x{a="ü"}',
])
_SEPARATORS = st.sampled_from([" ", " ", " ", "  ", "\t", " \t"])


_NUMBERS = st.one_of(st.integers(-10**6, 10**6).map(str), st.floats(allow_nan=False).map(repr))


@settings(PROPERTY, max_examples=1500)
@given(series=_SERIES, first=_NUMBERS, then=_TOKENS, stamp=st.one_of(st.none(), _NUMBERS),
       later=st.one_of(st.none(), _TOKENS), gap=_SEPARATORS, openmetrics=st.booleans(), typed=st.booleans())
def test_a_lines_value_is_read_as_the_librarys_parser_reads_it(
    series: str, first: str, then: str, stamp: str | None, later: str | None, gap: str, openmetrics: bool,
    typed: bool,
) -> None:
    """A line read once by the parser, then with another value (and timestamp, or none)."""
    head = "# TYPE x gauge\n" if typed else ""
    tail = "# EOF\n" if openmetrics else ""
    before = f"{head}{series}{gap}{first}{'' if stamp is None else gap + stamp}\n{tail}"
    after = f"{head}{series}{gap}{then}{'' if later is None else gap + later}\n{tail}"
    families = _parse(before, openmetrics)
    if families is None:
        return
    layout = TextLayout.of(before, families, openmetrics, LINES)
    if layout is not None:
        _check_read(layout, families, after, openmetrics)


@given(st.one_of(_TOKENS, st.text(max_size=6)))
@settings(max_examples=500, deadline=None, derandomize=True, database=None)
def test_sample_number_reads_a_token_as_the_librarys_parser_does(token: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families as parse_text

    try:
        (family,) = parse_text(f"x {token}\n")
        expected: object = family.samples[0].value
    except (ValueError, OverflowError, IndexError):
        expected = ValueError
    if not (token and token.isascii() and all(c.isalnum() or c in ".+-" for c in token)):
        return  # tokens the layout never lets through
    try:
        got: object = sample_number(token)
    except ValueError:
        got = ValueError
    assert got is expected if expected is ValueError else _same(got, expected), (token, got, expected)


# --- sequences of reads: the layout of the last parsed text, read by read ---


@PROPERTY
@given(sequence=read_sequences(), openmetrics=st.booleans(), quirk=st.booleans())
def test_over_a_sequence_of_reads_the_layout_reads_only_what_the_parser_would_give(
    sequence: list[Any], openmetrics: bool, quirk: bool,
) -> None:
    layout: TextLayout | None = None
    made_from: list[Metric] = []
    for exposition in sequence:
        text = exposition.text(openmetrics, quirk)
        if layout is not None and _check_read(layout, made_from, text, openmetrics):
            continue
        families = _parse(text, openmetrics)
        layout = None if families is None else TextLayout.of(text, families, openmetrics, LINES)
        made_from = families or []


# --- what an engine writes: vouched for ---


def _engine() -> tuple[CollectorRegistry, Counter, Histogram, Gauge]:
    registry = CollectorRegistry()
    labels = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
    tokens = Counter("sglang:load_back_tokens_total", "tokens", [*labels, "pool"], registry=registry)
    duration = Histogram("sglang:load_back_duration_seconds", "seconds", labels, buckets=(0.01, 0.1), registry=registry)
    used = Gauge("sglang:hicache_host_used_tokens", "used", ["tp_rank", "pp_rank", "dp_rank"], registry=registry)
    return registry, tokens, duration, used


@pytest.mark.parametrize("openmetrics", [False, True])
def test_prometheus_clients_own_text_is_read_by_its_values_while_its_series_stay(openmetrics: bool) -> None:
    registry, tokens, duration, used = _engine()
    write = (lambda: openmetrics_latest(registry).decode()) if openmetrics else (lambda: generate_latest(registry).decode())
    for tp in range(4):
        tokens.labels('Unified"Radix\\Cache', str(tp), "0", "0", "kv").inc(tp)
        duration.labels("UnifiedRadixCache", str(tp), "0", "0").observe(0.05)
        used.labels(str(tp), "0", "0").set(10)
    text = write()
    families = parse_exposition(text, openmetrics)
    layout = TextLayout.of(text, families, openmetrics, LINES)
    assert layout is not None
    for step in range(3):
        tokens.labels('Unified"Radix\\Cache', "1", "0", "0", "kv").inc(5)
        duration.labels("UnifiedRadixCache", "2", "0", "0").observe(0.005 * step)
        used.labels("3", "0", "0").set(-1.5 * step)  # a gauge goes down: fine
        assert _check_read(layout, families, write(), openmetrics)
    tokens.labels("UnifiedRadixCache", "9", "0", "0", "kv").inc()  # a new series: the parser's again
    assert layout.values_of(write()) is None


def test_openmetrics_values_the_parser_refuses_are_left_to_it() -> None:
    registry, tokens, duration, _ = _engine()
    tokens.labels("c", "0", "0", "0", "kv").inc(3)
    duration.labels("c", "0", "0", "0").observe(0.05)
    text = openmetrics_latest(registry).decode()
    families = parse_exposition(text, True)
    layout = TextLayout.of(text, families, True, LINES)
    assert layout is not None
    lines = text.split("\n")
    targets = [i for i, line in enumerate(lines) if line.startswith(("sglang_load_back_tokens_total{",
                                                                     "sglang_load_back_duration_seconds_"))]
    refused = 0
    for i in targets:
        for bad in ("-1.0", "NaN", "2.5", "0.0", "7.0", "+Inf"):
            odd = lines.copy()
            odd[i] = lines[i].rsplit(" ", 1)[0] + " " + bad
            odd_text = "\n".join(odd)
            if _parse(odd_text, True) is None:
                refused += 1
                assert layout.values_of(odd_text) is None, odd[i]
            else:
                assert _check_read(layout, families, odd_text, True), odd[i]
                assert _check_read(layout, families, text, True)  # and back
    group = [i for i, line in enumerate(lines) if line.startswith(("sglang_load_back_duration_seconds_bucket",
                                                                   "sglang_load_back_duration_seconds_count"))]
    for bad in ("0.5", "-1.0"):  # buckets and count agree, but are no counts
        odd = lines.copy()
        for i in group:
            odd[i] = lines[i].rsplit(" ", 1)[0] + " " + bad
        assert _parse("\n".join(odd), True) is None and layout.values_of("\n".join(odd)) is None, bad
        refused += 1
    assert refused > 10  # negative, NaN and fractional counts, buckets out of order, a count off its +Inf bucket


def test_a_layout_is_only_made_up_to_its_bound() -> None:
    registry, tokens, _, _ = _engine()
    for tp in range(5):
        tokens.labels("c", str(tp), "0", "0", "kv").inc()
    text = generate_latest(registry).decode()
    families = parse_exposition(text, False)
    samples = sum(len(f.samples) for f in families)
    assert TextLayout.of(text, families, False, samples) is not None
    assert TextLayout.of(text, families, False, samples - 1) is None
