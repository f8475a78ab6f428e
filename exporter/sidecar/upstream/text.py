"""An upstream's exposition text: parsed by prometheus_client's parsers (`parse_exposition`), or, for a
read whose lines are the last read's but for their values, read by its shape alone (`TextLayout`).

prometheus_client's parsers turn a text into families; everything but the sample values comes
from the text with those values cut out (its *shape*): which lines are comments, every sample's
name and labels (parsed from the part of its line before the value), how samples group into
families. So when a read has the last read's shape, the parser would give the last read's
families with the new values, and only the values need reading. `TextLayout` keeps the last
read's lines and checks that; anything else (a new, missing or moved series, a changed comment,
HELP or TYPE line, a line whose shape the check does not vouch for) is left to the parser.

What the check vouches for, line by line (tests/exporter/sidecar/upstream/test_text.py proves
it against the library's parsers):

* a sample line is `name` or `name{...}` with no other `{` or `}` (so the library's label
  parse ends where the series part ends), then one space and the value: in the 0.0.4 text
  format, optionally one space and a timestamp; in OpenMetrics, nothing more (timestamps,
  exemplars and native histograms change how the library groups and checks samples: not
  vouched for). Tokens are ASCII letters, digits, `.`, `+` and `-`, read as the library reads
  them (`sample_number`).
* OpenMetrics refuses some values (a negative or NaN counter, a fractional bucket count,
  buckets out of order, a count that is not the +Inf bucket's): the layout keeps which sample
  must satisfy which rule, and a read whose values break one goes to the parser, whose error it is.
  Families of the types whose values it checks otherwise (info, stateset, gaugehistogram) are
  not vouched for.

The layout holds the last read's lines, one value and timestamp per sample, and per sample line
its series part: a few times the text itself, and only up to `max_lines` sample lines.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

Number = int | float
# The engine's OpenMetrics quirk (prometheus_client 0.26 without `escaping=allow-utf-8`): sample
# names have `:` escaped to `_` while HELP, TYPE and UNIT lines keep it, which its own parser
# refuses. The metadata lines get the samples' spelling before parsing.
_OM_METADATA = re.compile(r"(?m)^(# (?:HELP|TYPE|UNIT) )(\S+)")
_TOKEN = r"[0-9A-Za-z.+-]+"
_SERIES = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{[^{}]*\})?")
_TEXT_VALUE = re.compile(f" ({_TOKEN})(?: ({_TOKEN}))?")
_OPENMETRICS_VALUE = re.compile(f" ({_TOKEN})")
# OpenMetrics checks of a sample's value, by its name's suffix after the family's name.
_NON_NEGATIVE = 1  # counter-like: not NaN, not negative
_COUNT = 2  # a bucket or count: a non-negative integer as well
_COUNTER_LIKE = {"_total": _NON_NEGATIVE, "_sum": _NON_NEGATIVE, "_count": _COUNT, "_bucket": _COUNT}
_UNCHECKED_TYPES = frozenset({"info", "stateset", "gaugehistogram"})  # other value rules: left to the parser


def parse_exposition(text: str, openmetrics: bool) -> list[Metric]:
    """Families of one exposition, by prometheus_client's text or OpenMetrics parser (ValueError where it fails)."""
    try:
        if openmetrics:
            return list(parse_openmetrics(_OM_METADATA.sub(lambda m: m.group(1) + m.group(2).replace(":", "_"), text)))
        return list(parse_text(text))
    except ValueError as err:
        if str(err):
            raise
        # The parsers raise a bare ValueError() on some lines (`# TYPE evil.name counter`): the log
        # line must still say what failed.
        raise ValueError("ValueError: prometheus_client's parser refused a line and gave no reason "
                         "(an invalid metric name or TYPE line?)") from None
    except (OverflowError, LookupError, TypeError) as err:  # what the parsers raise on some malformed lines
        raise ValueError(f"{type(err).__name__}: {err}" if str(err) else f"{type(err).__name__} (no message)") from None


def sample_number(token: str) -> Number:
    """A value token as prometheus_client's parsers read it (`parser._parse_value`): an int when it
    is one, else a float. For tokens of ASCII letters, digits, `.`, `+` and `-` (what the layout
    lets through) int() accepts exactly `[+-]?[0-9]+`; raises ValueError where the library does."""
    if token.isdigit() or (token[0] in "+-" and token[1:].isdigit()):
        return int(token)
    return float(token)


def series_length(line: str) -> int:
    """The length of a sample line's series part (`name` or `name{labels}`), 0 where the layout does not vouch for it."""
    close = line.rfind("}")
    end = close + 1 if close >= 0 else line.find(" ")
    return end if end > 0 and _SERIES.fullmatch(line, 0, end) else 0


def is_sample_line(line: str) -> bool:
    """What both parsers read as a sample: a line that is neither blank nor a comment."""
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


class TextLayout:
    """The last read text of one upstream, line by line, with its samples' values and timestamps.

    measured payoff: BENCHMARKS.md, The proxy rows (`read` against prometheus_client's parser).
    """

    def __init__(self, openmetrics: bool) -> None:
        self.openmetrics = openmetrics
        self.lines: list[str] = []
        self.series: list[str | None] = []  # per line: its series part, or None for a line that must not change
        self.slots: list[int] = []  # per line: the index of its sample among the read's samples (-1: none)
        self.values: list[Number] = []
        self.timestamps: list[float | None] = []
        self.rules: list[int] = []  # per sample: the OpenMetrics value rule it must meet (0: none)
        self.histograms: list[tuple[tuple[int, ...], int]] = []  # OpenMetrics: each group's buckets and its count (-1: none)
        self._value = _OPENMETRICS_VALUE if openmetrics else _TEXT_VALUE

    @classmethod
    def of(cls, text: str, families: Sequence[Metric], openmetrics: bool, max_lines: int) -> TextLayout | None:
        """The layout of `text`, which the library's parser read as `families`; None where it does not vouch for every line."""
        layout = cls(openmetrics)
        samples = [s for family in families for s in family.samples]
        if len(samples) > max_lines:
            return None
        lines = text.split("\n")
        kinds = [is_sample_line(line) for line in lines]
        if sum(kinds) != len(samples):  # the library kept another number of samples (duplicates dropped)
            return None
        for line, sample_line in zip(lines, kinds):
            if not sample_line:
                layout.series.append(None)
                layout.slots.append(-1)
                continue
            slot = len(layout.values)
            length = series_length(line)
            match = layout._value.fullmatch(line, length) if length else None
            if match is None:
                return None
            try:
                value, timestamp = layout._sample_value(match)
            except (ValueError, OverflowError):
                return None
            sample = samples[slot]
            if (sample.exemplar is not None or sample.native_histogram is not None or sample.timestamp != timestamp
                    or type(sample.value) is not type(value) or not _same(sample.value, value)):
                return None  # the library read this line otherwise: not a line the layout vouches for
            layout.series.append(line[:length])
            layout.slots.append(slot)
            layout.values.append(value)
            layout.timestamps.append(timestamp)
        if openmetrics and not layout._openmetrics_rules(families):
            return None
        layout.lines = lines
        return layout

    def values_of(self, text: str) -> tuple[list[Number], list[float | None]] | None:
        """The values and timestamps of `text`'s samples when it has this layout's shape (which
        then becomes `text`); None when it does not, or when OpenMetrics would refuse a value."""
        lines = text.split("\n")
        if len(lines) != len(self.lines):
            return None
        values = self.values.copy()
        timestamps = self.timestamps.copy()
        rules = self.rules
        openmetrics = self.openmetrics
        read_value = self._value.fullmatch
        changed = False
        number = sample_number
        try:
            for line, old, series, slot in zip(lines, self.lines, self.series, self.slots):
                if line == old:
                    continue
                if series is None or not line.startswith(series):
                    return None
                match = read_value(line, len(series))
                if match is None:
                    return None
                changed = True
                if openmetrics:  # a value alone, which may have to meet a rule
                    value = values[slot] = number(match.group(1))
                    if rules[slot] and not _meets(rules[slot], value):
                        return None
                    continue
                token, stamp = match.groups()
                values[slot] = number(token)
                timestamps[slot] = None if stamp is None else number(stamp) / 1000
        except (ValueError, OverflowError):  # a token the library refuses too
            return None
        if changed and self.histograms and not self._histograms_hold(values):
            return None
        self.lines, self.values, self.timestamps = lines, values, timestamps
        return values, timestamps

    def _sample_value(self, match: re.Match[str]) -> tuple[Number, float | None]:
        """A sample's value and timestamp as the library gives them (0.0.4: the timestamp in ms, as seconds)."""
        if self.openmetrics:
            return sample_number(match.group(1)), None
        value, stamp = match.groups()
        return sample_number(value), (sample_number(stamp) / 1000 if stamp is not None else None)

    def _openmetrics_rules(self, families: Sequence[Metric]) -> bool:
        """Which rule each sample's value must meet, and each histogram group's buckets and count,
        as prometheus_client's OpenMetrics parser checks them (its `_check_histogram` groups a
        histogram's samples by their labels without `le`); False for a family it checks otherwise."""
        slot = 0
        for family in families:
            if family.type in _UNCHECKED_TYPES:
                return False
            name = family.name
            group: dict[str, str] | None = None
            buckets: list[int] = []
            count = -1
            for sample in family.samples:
                suffix = sample.name[len(name):]
                rule = _COUNTER_LIKE.get(suffix, 0) if suffix else 0
                if family.type == "summary" and sample.name == name:
                    rule = _NON_NEGATIVE  # a quantile: not negative (NaN, which it allows, goes to the parser)
                self.rules.append(rule)
                if family.type == "histogram" and suffix:
                    labels = sample.labels
                    if suffix == "_bucket":
                        labels = {k: v for k, v in labels.items() if k != "le"}
                    if labels != group:
                        if group is not None:
                            self.histograms.append((tuple(buckets), count))
                        group, buckets, count = labels, [], -1
                    if suffix == "_bucket":
                        buckets.append(slot)
                    elif suffix == "_count":
                        count = slot
                slot += 1
            if group is not None:
                self.histograms.append((tuple(buckets), count))
        return True

    def _histograms_hold(self, values: list[Number]) -> bool:
        """Each group's bucket counts do not go down, and its count is its last bucket's."""
        for buckets, count in self.histograms:
            previous: Number = 0
            for slot in buckets:
                if values[slot] < previous:
                    return False
                previous = values[slot]
            if count >= 0 and values[count] != previous:
                return False
        return True


def _meets(rule: int, value: Number) -> bool:
    if not value >= 0:  # also NaN
        return False
    return rule != _COUNT or type(value) is int or float(value).is_integer()


def _same(a: Number, b: Number) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))
