"""The URL source's numbers (issue 19): per-series resets, histograms without +Inf, rank axes.

Expositions are written by hand in the text format, so that what prometheus_client's own writer
never produces (a counter that dips, a +Inf value, a histogram without +Inf) is read too. The
state runs on the harness's fake clock; nothing sleeps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.exposition import generate_latest

from exporter.config import RanksConfig
from exporter.sidecar.upstream.continuity import FLAP_RESETS, FLAP_WINDOW_SECONDS
from exporter.sidecar.upstream.feed import UpstreamFeed
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine, feed, read, rollup

BOUNDS = ("0.01", "0.1")


def rank_labels(tp: str = "0") -> str:
    return f'cache_type="c",tp_rank="{tp}",pp_rank="0",dp_rank="0"'


def counter(family: str, value: str | float, tp: str = "0", extra: str = "") -> str:
    return f"# TYPE sglang:{family} counter\nsglang:{family}{{{rank_labels(tp)}{extra}}} {value}\n"


def histogram(buckets: list[str | int], count: str | int | None, total: str | float | None, tp: str = "0",
              bounds: tuple[str, ...] = (*BOUNDS, "+Inf")) -> str:
    """A load-back duration histogram: one bucket line per (bound, value), then _count and _sum where given."""
    name, labels = "sglang:load_back_duration_seconds", rank_labels(tp)
    lines = [f"# TYPE {name} histogram"]
    lines += [f'{name}_bucket{{{labels},le="{le}"}} {v}' for le, v in zip(bounds, buckets)]
    if count is not None:
        lines.append(f"{name}_count{{{labels}}} {count}")
    if total is not None:
        lines.append(f"{name}_sum{{{labels}}} {total}")
    return "\n".join(lines) + "\n"


def duration(h: Harness) -> tuple[list[int], float] | None:
    """The load-back duration rollup: cumulative counts (finite bounds, then +Inf) and sum."""
    for key, rolled in h.state.ledger.histograms.items():
        if key[0] == "load_back_duration_seconds":
            return list(rolled.counts), rolled.sum
    return None


# --- finding 1: a value that goes down restarts that series alone ---


def test_a_counter_alternating_100_and_50_neither_restarts_its_rank_nor_adds_every_rise() -> None:
    """Before: the bytes rollup was 7,000 after 12 reads (every dip a new epoch, every counter
    counted again); the tokens rollup 650. After: bytes 1,000; tokens counts two restarts, then flaps."""
    h = Harness()
    up = feed(h)
    for n in range(12):
        up.apply(read(counter("load_back_bytes_total", 1000)
                      + counter("load_back_tokens_total", 100 if n % 2 == 0 else 50, extra=',pool="kv"')))
    assert rollup(h, "load_back_bytes_total") == 1000
    # 100, then two dips counted as restarts (+50 each) and their rises (+50 each); the third dip
    # within the window flaps, and the series counts only above its highest value (300) from then.
    assert rollup(h, "load_back_tokens_total", pool="kv") == 300
    (rank,) = h.state.ranks.values()
    assert rank.restarts == 0
    assert up.health.flapping == 1 and up.health.series_resets == 6
    # A whole window without a dip: the series is a series again, and its next dip a restart.
    h.clock.advance(FLAP_WINDOW_SECONDS + 1)
    up.apply(read(counter("load_back_bytes_total", 1000) + counter("load_back_tokens_total", 60, extra=',pool="kv"')))
    assert up.health.flapping == 0 and rollup(h, "load_back_tokens_total", pool="kv") == 300  # 60: below its highest
    up.apply(read(counter("load_back_bytes_total", 1000) + counter("load_back_tokens_total", 70, extra=',pool="kv"')))
    assert rollup(h, "load_back_tokens_total", pool="kv") == 310  # rises count again
    up.apply(read(counter("load_back_bytes_total", 1000) + counter("load_back_tokens_total", 5, extra=',pool="kv"')))
    assert rollup(h, "load_back_tokens_total", pool="kv") == 315 and up.health.series_resets == 7  # a restart again
    assert rollup(h, "load_back_bytes_total") == 1000


def test_one_negative_histogram_observation_leaves_the_other_counters_and_the_sum_does_not_go_down() -> None:
    """Before: the bytes rollup doubled to 2,000 (the sum went down: the rank restarted). After: 1,000."""
    h, engine = Harness(), Engine()
    up = feed(h)
    engine.rank(0, moved=1000, seconds=0.5)
    up.apply(read(engine.text()))
    engine.rank(0, seconds=-0.25)  # prometheus_client takes it: the sum falls while the counts rise
    up.apply(read(engine.text()))
    assert rollup(h, "load_back_bytes_total") == 1000
    assert duration(h) == ([1, 1, 2], 0.5)  # the sum holds: a negative increment never enters a position
    engine.rank(0, seconds=0.125)
    up.apply(read(engine.text()))
    assert duration(h) == ([1, 1, 3], 0.625)  # later observations add on
    (rank,) = h.state.ranks.values()
    assert rank.restarts == 0 and up.health.series_resets == 0


@pytest.mark.parametrize("bad", ["+Inf", "NaN", "-Inf", "-5"])
def test_one_non_finite_or_negative_counter_value_is_refused_for_that_series_alone(bad: str) -> None:
    """Before (+Inf): the bytes rollup went 1,000 -> 2,100 (the next read restarted the rank). After: 1,100."""
    h = Harness()
    up = feed(h)
    tokens = ',pool="kv"'
    up.apply(read(counter("load_back_bytes_total", 1000) + counter("load_back_tokens_total", 10, extra=tokens)))
    result = up.apply(read(counter("load_back_bytes_total", bad) + counter("load_back_tokens_total", 20, extra=tokens)))
    assert result.rejected == 1 and rollup(h, "load_back_tokens_total", pool="kv") == 20
    up.apply(read(counter("load_back_bytes_total", 1100) + counter("load_back_tokens_total", 30, extra=tokens)))
    assert rollup(h, "load_back_bytes_total") == 1100 and rollup(h, "load_back_tokens_total", pool="kv") == 30
    (rank,) = h.state.ranks.values()
    assert rank.restarts == 0 and up.health.series_resets == 0


def test_a_histogram_reset_resets_all_its_parts_and_nothing_else() -> None:
    h = Harness()
    up = feed(h)
    up.apply(read(counter("load_back_bytes_total", 1000) + histogram([2, 3, 4], 4, 1.5)))
    up.apply(read(counter("load_back_bytes_total", 1000) + histogram([0, 1, 1], 1, 0.5)))  # the +Inf bucket fell
    assert duration(h) == ([2, 4, 5], 2.0) and rollup(h, "load_back_bytes_total") == 1000
    up.apply(read(counter("load_back_bytes_total", 1000) + histogram([0, 0, 1], 1, 0.5)))  # one bucket fell alone
    assert duration(h) == ([2, 4, 6], 2.5) and up.health.series_resets == 2


def test_two_engines_behind_one_url_flap_and_count_only_the_furthest() -> None:
    """Two engines take turns answering one Service URL: before, each turn restarted the rank
    (bytes 5,770 after 8 reads); after, two turns count as restarts, then only the highest value rises."""
    h = Harness()
    up = feed(h)
    for n in range(8):
        moved, tokens = (1000 + 100 * n, 100 + 10 * n) if n % 2 == 0 else (500 + 10 * n, 50 + n)
        up.apply(read(counter("load_back_bytes_total", moved) + counter("load_back_tokens_total", tokens,
                                                                        extra=',pool="kv"')))
    # 1000; +510 (a restart), 1200 is +690; +530 (a restart), 1400 is +870; flapping: 1600 +200.
    assert rollup(h, "load_back_bytes_total") == 1000 + 510 + 690 + 530 + 870 + 200
    assert rollup(h, "load_back_tokens_total", pool="kv") == 100 + 51 + 69 + 53 + 87 + 20
    (rank,) = h.state.ranks.values()
    assert up.health.flapping == 2 and rank.restarts == 2  # every series fell at once twice: then they flap


def test_a_layout_change_starts_a_new_epoch_without_counting_the_other_series_again() -> None:
    h = Harness()
    up = feed(h)
    up.apply(read(counter("load_back_bytes_total", 1000) + histogram([1, 2, 2], 2, 1.0)))
    result = up.apply(read(counter("load_back_bytes_total", 1010)
                           + histogram([1, 2, 2], 2, 1.0, bounds=("0.01", "0.5", "+Inf"))))
    (rank,) = h.state.ranks.values()
    assert result.resets == 1 and rank.restarts == 1  # the state keeps one layout per series within an epoch
    assert rollup(h, "load_back_bytes_total") == 1010 and rank.values[("load_back_bytes_total", ())] == 10
    up.apply(read(counter("load_back_bytes_total", 1020) + histogram([1, 2, 3], 3, 1.5, bounds=("0.01", "0.5", "+Inf"))))
    assert rollup(h, "load_back_bytes_total") == 1020 and rank.restarts == 1


def test_bucket_bounds_that_alternate_count_as_drops_and_add_at_most_flap_resets_whole_values() -> None:
    """Two engines with different buckets behind one URL (constant counts [1, 2, 3], sum 0.5): before,
    20 reads rolled up [10, 20, 30] and 5.0 (19 rank restarts, growing every read); after, two
    layout changes restart the rank, the third flaps and the series keeps its layout."""
    h = Harness()
    up = feed(h)
    for n in range(20):
        h.clock.advance(5)
        bounds = ("0.01", "0.1", "+Inf") if n % 2 == 0 else ("0.02", "0.1", "+Inf")
        result = up.apply(read(counter("load_back_bytes_total", 1000) + histogram([1, 2, 3], 3, 0.5, bounds=bounds)))
    (rank,) = h.state.ranks.values()
    assert duration(h) == ([2, 4, 6], 1.0) and rank.restarts == 2
    assert rollup(h, "load_back_bytes_total") == 1000
    # Reads 1, 2 and 3 changed the layout; from then on the series keeps the first one, and each of
    # the 8 odd reads after them (the other layout) is a drop, refused.
    assert up.health.series_resets == 3 + 8 and up.health.flapping == 1
    assert result.rejected == 1  # the last read's other layout: refused while the series flaps
    # Refused layouts are drops too: the series flaps on, and adds nothing more, however long it lasts.
    for n in range(200):
        h.clock.advance(5)
        bounds = ("0.01", "0.1", "+Inf") if n % 2 == 0 else ("0.02", "0.1", "+Inf")
        up.apply(read(counter("load_back_bytes_total", 1000) + histogram([1, 2, 3], 3, 0.5, bounds=bounds)))
    assert duration(h) == ([2, 4, 6], 1.0) and rank.restarts == 2 and up.health.flapping == 1


def test_a_layout_change_keeps_the_series_drop_history() -> None:
    """Two value drops, then a layout change within the window: the third drop, so the series flaps
    and the new layout is refused (before: a fresh series, its history lost, and a rank restart)."""
    h = Harness()
    up = feed(h)
    steady = counter("load_back_bytes_total", 1000)  # not every series falls: no engine restart
    for buckets, count in (([2, 4, 4], 4), ([1, 2, 2], 2), ([2, 4, 4], 4), ([1, 2, 2], 2)):
        up.apply(read(steady + histogram(buckets, count, 1.0)))
    result = up.apply(read(steady + histogram([2, 4, 4], 4, 1.0, bounds=("0.01", "0.5", "+Inf"))))
    (rank,) = h.state.ranks.values()
    assert up.health.series_resets == 3 and up.health.flapping == 1
    assert result.rejected == 1 and result.resets == 0 and rank.restarts == 0


def test_a_series_listed_twice_in_one_read_keeps_its_first_value_and_is_counted() -> None:
    """1,000 and 5 for one series in every read: before, the rollup was 1,005 after one read, 3,000
    after 12 and 5,000 after another window (every read a drop and a rise); after, 1,000."""
    h = Harness()
    up = feed(h)
    labels = rank_labels()
    text = (f"# TYPE sglang:load_back_bytes_total counter\nsglang:load_back_bytes_total{{{labels}}} 1000\n"
            f"sglang:load_back_bytes_total{{{labels}}} 5\n")
    for _ in range(12):
        h.clock.advance(5)
        result = up.apply(up.plan_text(text, False))
    assert rollup(h, "load_back_bytes_total") == 1000
    assert up.health.series_resets == 0 and up.health.flapping == 0 and up.health.errors["duplicate_series"] == 12
    assert result.cut["duplicate_series"] == (
        "1 series are listed more than once in this read (the first: load_back_bytes_total{cache_type='c',"
        "dp_rank='0',pp_rank='0',tp_rank='0'}); the first listing of each is kept, the others left out "
        "(Prometheus would refuse the exposition)")


def test_a_histogram_bucket_listed_twice_keeps_the_first() -> None:
    h = Harness()
    up = feed(h)
    text = histogram([1, 2, 3], 3, 0.5)
    name, labels = "sglang:load_back_duration_seconds", rank_labels()
    result = up.apply(read(text + f'{name}_bucket{{{labels},le="0.1"}} 3\n{name}_count{{{labels}}} 9\n'))
    assert duration(h) == ([1, 2, 3], 0.5) and result.rejected == 0
    assert result.cut["duplicate_series"].startswith("2 series are listed more than once")


def test_a_series_keeps_at_most_flap_resets_plus_one_drop_times() -> None:
    """Before: every drop within the window was kept (600,000 for 50,000 duplicated series in 12 reads)."""
    h = Harness()
    up = feed(h)
    for n in range(40):
        up.apply(read(counter("load_back_bytes_total", 100 if n % 2 == 0 else 50)))
    (entry,) = up.ranks.values()
    (kept,) = entry.series.values()
    assert len(kept.resets) == FLAP_RESETS + 1 and up.health.series_resets == 20 and up.health.flapping == 1


def _flap(up: UpstreamFeed, h: Harness, other: str = "") -> None:
    """Six reads 5 s apart of a bytes counter alternating 100 and 50: the series flaps."""
    for n in range(6):
        h.clock.advance(5)
        up.apply(read(counter("load_back_bytes_total", 100 if n % 2 == 0 else 50) + other))
    assert up.health.flapping == 1


def test_the_flapping_gauge_drops_a_series_whose_identity_was_forgotten() -> None:
    """Before: the gauge stayed 1 an hour after the flapping identity was forgotten."""
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=5, expire_after_seconds=10, max_ranks=1))
    up = feed(h)
    _flap(up, h)
    h.clock.advance(11)
    up.apply(read(counter("load_back_bytes_total", 0, tp="1")))  # tp 0 departs
    h.clock.advance(11)
    up.apply(read(counter("load_back_bytes_total", 0, tp="2")))  # tp 0 expired: forgotten, its slot tp 2's
    assert up.health.flapping == 0 and [identity[0] for identity in up.ranks] == [1, 2]  # 22 s: no window yet


def test_the_flapping_gauge_calms_a_series_not_listed_for_a_whole_window() -> None:
    """Before: the gauge stayed 1 for 6,000 s after the flapping series stopped being listed."""
    h = Harness()
    up = feed(h)
    other = counter("load_back_tokens_total", 1, extra=',pool="kv"')
    _flap(up, h, other)
    h.clock.advance(FLAP_WINDOW_SECONDS - 30)  # within the window since its last drop: it still flaps
    up.apply(read(other))
    assert up.health.flapping == 1
    h.clock.advance(31)
    up.apply(read(other))
    assert up.health.flapping == 0
    # Listed again, it is a series: its rises from its last value (50) count on its highest (300).
    assert rollup(h, "load_back_bytes_total") == 300
    up.apply(read(counter("load_back_bytes_total", 60) + other))
    up.apply(read(counter("load_back_bytes_total", 70) + other))
    assert rollup(h, "load_back_bytes_total") == 320 and up.health.flapping == 0


def test_the_directory_source_restarts_a_rank_per_process_and_a_series_per_drop() -> None:
    h = Harness()
    up = feed(h)

    def process(pid: str, value: int) -> list[tuple[str | None, float, list[Any]]]:
        return [(pid, 0.0, read(counter("load_back_bytes_total", value) + counter("load_back_tokens_total", 4,
                                                                                  extra=',pool="kv"'))[0][2])]

    up.apply(process("101", 100))
    up.apply(process("102", 30))  # a new process for the rank: an exact restart, its values its own
    (rank,) = h.state.ranks.values()
    assert rank.restarts == 1 and rollup(h, "load_back_bytes_total") == 130
    assert rollup(h, "load_back_tokens_total", pool="kv") == 8
    up.apply(process("102", 10))  # a drop within one process's files: that series alone restarts
    assert rank.restarts == 1 and up.health.series_resets == 1
    assert rollup(h, "load_back_bytes_total") == 140 and rollup(h, "load_back_tokens_total", pool="kv") == 8
    up.apply(process("101", 500))  # the older process's files: its epoch was replaced
    assert rollup(h, "load_back_bytes_total") == 140


def test_a_new_process_ends_the_flapping_of_the_old_ones_series() -> None:
    h = Harness()
    up = feed(h)
    for value in (100, 50, 100, 50, 100, 50):
        up.apply([("101", 0.0, read(counter("load_back_bytes_total", value))[0][2])])
    assert up.health.flapping == 1
    up.apply([("102", 0.0, read(counter("load_back_bytes_total", 7))[0][2])])
    assert up.health.flapping == 0 and rollup(h, "load_back_bytes_total") == 300 + 7


def test_the_feeds_self_metrics_are_exposed() -> None:
    from exporter.sidecar.core.health import SidecarHealth
    from tests.exporter.sidecar.expose.reference import ReferenceCollector

    h = Harness()
    up = feed(h)
    for value in (100, 50, 100, 50):
        up.apply(read(counter("load_back_bytes_total", value)))
    stats = SidecarHealth()
    stats.upstreams[up.health.name] = up.health
    samples = {s.name: s.value for m in ReferenceCollector(h.state, stats, "sglang_").collect() for s in m.samples
               if s.labels.get("upstream") == up.health.name}
    assert samples["hicache_exporter_upstream_series_resets_total"] == 2
    assert samples["hicache_exporter_upstream_series_flapping"] == 0
    up.apply(read(counter("load_back_bytes_total", 10)))
    samples = {s.name: s.value for m in ReferenceCollector(h.state, stats, "sglang_").collect() for s in m.samples
               if s.labels.get("upstream") == up.health.name}
    assert samples["hicache_exporter_upstream_series_flapping"] == 1


# --- finding 2: a histogram with no +Inf bucket ---


def test_a_histogram_without_a_plus_inf_bucket_takes_it_from_its_count() -> None:
    """Before: refused on every read, nothing counted (no histogram rollup). After: counted."""
    h = Harness()
    up = feed(h)
    result = up.apply(read(histogram([1, 3], 5, 2.5, bounds=BOUNDS)))
    assert result.rejected == 0 and duration(h) == ([1, 3, 5], 2.5)
    up.apply(read(histogram([2, 4], 7, 3.0, bounds=BOUNDS)))
    assert duration(h) == ([2, 4, 7], 3.0)


def test_a_histogram_with_neither_plus_inf_nor_count_is_refused_and_counted() -> None:
    h = Harness()
    up = feed(h)
    result = up.apply(read(histogram([1, 3], None, 2.5, bounds=BOUNDS) + counter("load_back_bytes_total", 7)))
    assert result.rejected == 1 and duration(h) is None and rollup(h, "load_back_bytes_total") == 7


@pytest.mark.parametrize("buckets, count", [([3, 1, 4], 4), ([1, 2, 4], 5), (["1.5", 2, 2], 2), ([-1, 2, 2], 2)])
def test_histogram_counts_that_are_not_cumulative_whole_numbers_are_refused(buckets: list[str | int], count: int) -> None:
    h = Harness()
    up = feed(h)
    up.apply(read(histogram([1, 2, 2], 2, 1.0)))
    result = up.apply(read(histogram(buckets, count, 1.0)))
    assert result.rejected == 1 and duration(h) == ([1, 2, 2], 1.0)
    up.apply(read(histogram([1, 3, 3], 3, 1.5)))  # the refused read disturbed nothing
    assert duration(h) == ([1, 3, 3], 1.5) and up.health.series_resets == 0


def test_a_multiprocess_histogram_being_created_is_skipped_not_refused() -> None:
    """prometheus_client's multiprocess reader gives `Multiprocess metric` HELP: a child without +Inf is still being written."""
    text = "# HELP sglang:load_back_duration_seconds Multiprocess metric\n" + histogram([0], 0, 0.0, bounds=BOUNDS[:1])
    h = Harness()
    result = feed(h).apply(read(text))
    assert result.rejected == 0 and duration(h) is None


# --- finding 3: rank axes ---


@pytest.mark.parametrize("axis", ["-1", "1" + "0" * 3999, "\u0663", " 3", "+2", "1_0", "03", "3 ", "65536", ""])
def test_a_series_whose_rank_axis_is_no_rank_number_is_refused_and_makes_no_rank(axis: str) -> None:
    """Before: "-1", "65536" and the 4,000-digit rank became ranks, " 3", "03", "+2", "1_0" and "\u0663" ranks 3, 3, 2,
    10 and 3 (merged with any series there), and "" flagged the whole family as unranked."""
    h = Harness()
    up = feed(h)
    text = (counter("load_back_bytes_total", 100, tp="0") + f'sglang:load_back_bytes_total{{{rank_labels(axis)}}} 5\n'
            + counter("load_back_tokens_total", 7, tp="2", extra=',pool="kv"'))
    result = up.apply(read(text))
    assert result.rejected == 1 and not result.unranked  # the family is rolled up: only that series is out
    assert sorted(r.tp_rank for r in h.state.ranks.values()) == [0, 2]
    assert rollup(h, "load_back_bytes_total") == 100


def test_the_largest_rank_number_is_a_rank() -> None:
    h = Harness()
    feed(h).apply(read(counter("load_back_bytes_total", 1, tp="65535")))
    assert [r.tp_rank for r in h.state.ranks.values()] == [65535]


# --- properties of the URL source: any sequence of reads ---

COUNTERS = (("0", "load_back_bytes_total"), ("1", "load_back_bytes_total"))
BAD = ("NaN", "+Inf", "-Inf", "-3")


@dataclass
class Model:
    """What the reads should give under per-series increase() semantics (for well-formed reads)."""

    last: dict[str, list[float]] = field(default_factory=dict)  # series -> last raw values taken
    total: dict[str, list[float]] = field(default_factory=dict)  # series -> increase so far

    def take(self, key: str, raw: list[float], parts: int) -> None:
        """`parts`: how many leading values are counts (a drop of any is a reset); a histogram's sum follows."""
        last = self.last.get(key)
        if last is None:
            self.total[key] = [max(v, 0.0) for v in raw]
        elif any(v < w for v, w in zip(raw[:parts], last[:parts])):
            self.total[key] = [t + max(v, 0.0) for t, v in zip(self.total[key], raw)]
        else:
            self.total[key] = [t + max(v - w, 0.0) for t, v, w in zip(self.total[key], raw, last)]
        self.last[key] = raw


@st.composite
def read_sequences(draw: st.DrawFn, well_formed: bool) -> list[tuple[float, dict[str, object]]]:
    """Reads: (seconds the clock moves first, series -> value written, or absent)."""
    reads: list[tuple[float, dict[str, object]]] = []
    current: dict[str, list[float]] = {}  # series -> the engine's values now (a histogram: 3 bucket counts, sum)
    for _ in range(draw(st.integers(1, 10))):
        advance = float(FLAP_WINDOW_SECONDS + 1) if well_formed else draw(st.sampled_from([0.0, 1.0, 301.0]))
        written: dict[str, object] = {}
        for key in [tp for tp, _ in COUNTERS] + ["h"]:
            op = draw(st.sampled_from(["rise", "rise", "restart", "absent"] + ([] if well_formed else ["bad"])))
            if op == "absent":
                continue
            if key != "h":
                was = current.get(key, [0.0])[0]
                if op == "bad":
                    written[key] = draw(st.sampled_from(BAD))
                    continue
                value = was + draw(st.integers(0, 50)) if op == "rise" else float(draw(st.integers(0, 50)))
                current[key] = [value]
                written[key] = value
                continue
            was = current.get("h", [0.0, 0.0, 0.0, 0.0])
            if op == "bad":
                written[key] = draw(st.sampled_from([([1, 0, 2], 2, 0.5), ([0, 0, "NaN"], 0, 0.0),
                                                     ([0, 1, 1], 1, "NaN"), ([0, 0, 0], 0, "+Inf")]))
                continue
            start = was if op == "rise" else [0.0, 0.0, 0.0, 0.0]
            steps = [draw(st.integers(0, 3)) for _ in range(3)]
            counts = [start[0] + steps[0], start[1] + steps[0] + steps[1], start[2] + sum(steps)]
            # Observations of half-seconds: a sum moves only with the count (negative ones where not well formed).
            observed = draw(st.integers(0 if well_formed else -2, 4)) * 0.5 if sum(steps) else 0.0
            current["h"] = [*counts, start[3] + observed]
            written[key] = ([int(c) for c in counts], int(counts[2]), current["h"][3])
        reads.append((advance, written))
    return reads


def exposition(written: dict[str, object]) -> str:
    text = "".join(counter("load_back_bytes_total", v, tp=k) for k, v in written.items() if k != "h")  # type: ignore[arg-type]
    if "h" in written:
        buckets, count, total = written["h"]  # type: ignore[misc]
        text += histogram(buckets, count, total)
    return text


def _rollups(h: Harness) -> tuple[float, list[int], float]:
    rolled = duration(h) or ([0, 0, 0], 0.0)
    return rollup(h, "load_back_bytes_total"), rolled[0], rolled[1]


def _run(sequence: list[tuple[float, dict[str, object]]]) -> tuple[Harness, UpstreamFeed]:
    h = Harness()
    up = feed(h)
    before = _rollups(h)
    for advance, written in sequence:
        h.clock.advance(advance)
        up.apply(read(exposition(written)))
        after = _rollups(h)
        assert after[0] >= before[0] and after[2] >= before[2], (before, after)
        assert all(a >= b for a, b in zip(after[1], before[1])), (before, after)
        before = after
    return h, up


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=read_sequences(well_formed=False))
def test_any_reads_leave_every_rollup_never_decreasing(sequence: list[tuple[float, dict[str, object]]]) -> None:
    """Resets, dips, flapping, non-finite and negative values, series that come and go: no rollup ever goes down."""
    _run(sequence)


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=read_sequences(well_formed=True))
def test_well_formed_reads_give_each_series_its_increase(sequence: list[tuple[float, dict[str, object]]]) -> None:
    """Finite, non-negative values, resets apart: each rollup is the sum of its series' increase() (first value included)."""
    model = Model()
    for _, written in sequence:
        for key, value in written.items():
            if key == "h":
                buckets, count, total = value  # type: ignore[misc]
                model.take(key, [float(count), *map(float, buckets[:2]), float(total)], 3)
            else:
                model.take(key, [float(value)], 1)  # type: ignore[arg-type]
    h, up = _run(sequence)
    bytes_total, counts, total = _rollups(h)
    assert bytes_total == sum(model.total[k][0] for k in model.total if k != "h")
    if "h" in model.total:
        count, first, second, summed = model.total["h"]
        assert counts == [first, second, count] and total == summed
    else:
        assert (counts, total) == ([0, 0, 0], 0.0)
    assert up.health.flapping == 0


def test_flap_constants_are_what_the_docs_say() -> None:
    assert (FLAP_RESETS, FLAP_WINDOW_SECONDS) == (2, 300)  # the self-metric's HELP and the module docstring name them


def test_prometheus_client_takes_a_negative_observation() -> None:
    """The premise of the negative-observation test: the library lets the sum go down."""
    registry = CollectorRegistry()
    hist = Histogram("x_seconds", "x", registry=registry)
    hist.observe(1.0)
    hist.observe(-0.5)
    assert "x_seconds_sum 0.5" in generate_latest(registry).decode()
