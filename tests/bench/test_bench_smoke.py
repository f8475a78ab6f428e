"""Smoke test of the benchmark harness: every benchmark runs with tiny parameters, its rows are
well-formed and its anchors were really measured. Timings are reported, never asserted: this
machine is shared and noisy (the real run is `make bench`, its figures are in BENCHMARKS.md).
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path
from typing import Any

import pytest

from exporter.catalog import MetricType, default_catalog

from bench import report as bench_report
from bench import run as bench_run
from bench import scrape as bench_scrape
from bench.common import RawRank, Sidecar, label_sets

ROW_KEYS = {"name", "value", "unit", "anchor", "anchor_value", "ratio", "goal", "met"}


@pytest.fixture(scope="module")
def smoke() -> tuple[dict[str, list[dict[str, Any]]], dict[str, str]]:
    results, errors, seconds = bench_run.run_benchmarks("smoke", progress=False)
    print(f"\nbench smoke seconds: {seconds}")
    return results, errors


@pytest.mark.parametrize("name", bench_run.ORDER)
def test_benchmark_rows_are_well_formed(smoke: Any, name: str) -> None:
    results, errors = smoke
    assert name not in errors, errors.get(name)
    rows = results[name]
    assert rows, f"{name} returned no rows"
    for r in rows:
        assert ROW_KEYS <= set(r), f"{name}: row lacks {ROW_KEYS - set(r)}: {r}"
        assert isinstance(r["name"], str) and r["name"] and isinstance(r["unit"], str) and r["unit"]
        assert isinstance(r["anchor"], str) and r["anchor"]
        assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0, r
        # The anchor was measured in this run, not copied from a document.
        assert isinstance(r["anchor_value"], float) and math.isfinite(r["anchor_value"]) and r["anchor_value"] > 0, r
        assert r["ratio"] is not None and math.isfinite(r["ratio"]) and r["ratio"] > 0, r
        if r["goal"] is None:
            assert r["met"] is None, r
        else:
            assert isinstance(r["goal"], str) and isinstance(r["met"], bool), r
        assert r["benchmark"] == name
    assert any(r["goal"] is not None for r in rows), f"{name}: no row carries a goal"
    json.dumps(rows)  # the rows go to JSON as they are


def _catalog_sample_lines() -> int:
    """Sample lines one rank holding the full catalog exposes (a histogram: its buckets, +Inf, sum, count)."""
    return sum((len(spec.buckets or ()) + 3 if spec.type is MetricType.HISTOGRAM else 1) * len(label_sets(spec))
               for spec in default_catalog())


def test_scrape_anchor_holds_the_same_series(smoke: Any) -> None:
    rows = [r for r in smoke[0]["scrape"] if r["percentile"] in ("p50", "p99")]
    assert {r["ranks"] for r in rows} == {2, 4}
    per_rank = _catalog_sample_lines()
    assert per_rank == 164  # 47 series with the catalog of sglang 0.5.23's families
    for r in rows:
        # The full catalog per rank in both: the sidecar adds rollups and its own metrics.
        assert r["anchor_series"] == per_rank * r["ranks"], r
        assert r["series"] > r["anchor_series"], r


def test_scrape_times_gzip_as_prometheus_asks_for_it(smoke: Any) -> None:
    rows = {(r["ranks"], r["percentile"]): r for r in smoke[0]["scrape"]}
    for count in (2, 4):
        for label in ("p50", "p99"):
            zipped, plain = rows[(count, f"{label}-gzip")], rows[(count, label)]
            assert zipped["gzip_level"] == bench_scrape.GZIP_LEVEL, zipped
            assert zipped["anchor"] == f"MultiProcessCollector + gzip level {bench_scrape.GZIP_LEVEL}, {count} processes"
            # Both bodies were gzipped: a fraction of the plain ones, as many samples as those.
            assert 0 < zipped["body_bytes"] < plain["body_bytes"] / 3, (zipped, plain)
            assert 0 < zipped["anchor_body_bytes"] < plain["anchor_body_bytes"] / 3, (zipped, plain)
            assert zipped["samples"] == zipped["anchor_samples"] == plain["samples"]
            assert (zipped["goal"] is not None) == (count == 4), zipped  # the smoke profile's gzip_goal_ranks


def test_the_anchor_gzips_at_the_sidecars_level() -> None:
    """A gzipped /metrics body from a real sidecar is byte for byte what the anchor's gzip makes of its
    content (past the timestamp in the header), so the two gzip the same way."""
    with Sidecar() as sidecar:
        rank = RawRank(sidecar.socket_path, 0)
        try:
            rank.push()
            sidecar.wait_applied(1)
            body = sidecar.get(headers=bench_scrape.GZIP_HEADERS)
        finally:
            rank.close()
    assert body[:2] == b"\x1f\x8b"
    content = gzip.decompress(body)
    assert b"tp_rank=" in content
    again = bench_scrape.gzip_body(content)
    assert again[:4] + again[8:] == body[:4] + body[8:]  # bytes 4..7: the time it was made


def test_table_json_and_plot(smoke: Any, tmp_path: Path) -> None:
    results, _ = smoke
    rows = [r for name in bench_run.ORDER for r in results.get(name, [])]
    lines = bench_report.table_lines(rows)
    assert len(lines) == len(rows) + 2
    assert all(("met" in line) or line.rstrip().endswith("-") for line in lines[2:])
    markdown = bench_report.markdown_table(rows)
    assert markdown.count("\n") == len(rows) + 1
    from bench.scrape import plot  # matplotlib comes with the bench extra, which `make test` installs

    png = plot(results["scrape"], str(tmp_path / "scrape.png"))
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_entry_point_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "latest.json"
    code = bench_run.main(["--profile", "smoke", "--only", "ingest,transfer", "--json", str(out),
                           "--plot", str(tmp_path / "p.png")])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["machine"]["nproc"] >= 1
    assert {r["benchmark"] for r in report["rows"]} == {"ingest", "transfer"}
    printed = capsys.readouterr().out
    assert "anchor (same run)" in printed and "goals met" in printed


@pytest.mark.parametrize(
    "workload, count", [("ingest", 16), ("decode", 16), ("loads", 16), ("render", 1), ("render-unchanged", 1)]
)
def test_instruction_workloads_run(workload: str, count: int) -> None:
    from bench import instructions

    assert instructions.main([workload, str(count), "--ranks", "4"]) == 0


def test_instruction_workload_refuses_a_count_its_setup_cannot_hold(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import instructions

    with pytest.raises(SystemExit) as info:
        instructions.main(["render", "6", "--ranks", "4"])
    assert info.value.code == 2 and "count is at most 5" in capsys.readouterr().err


def test_persistence_saves_a_file_that_a_serve_process_loads() -> None:
    """bench/persistence.py times saves of a real state, sizes its file by the state's series, and starts a
    real `serve` on that file (it fails unless the process lists every rank of the file)."""
    from exporter.sidecar.durable.keeper import MAX_BYTES_PER_SERIES

    from bench import persistence

    state = persistence.build_state(4)
    budget = state.registry.budget
    rows = {r["name"].split(",")[0].split(" on ")[0]: r for r in persistence.run((4,), saves=2, starts=1, goal_ranks=4,
                                                                                 progress=False)}
    assert set(rows) == {"persistence: CPU per save (encode + atomic write)", "persistence: file bytes per series",
                         "persistence: start to ready"}
    size = rows["persistence: file bytes per series"]
    assert size["series"] == budget.per_rank + budget.rollup and size["ranks"] == 4
    assert size["value"] == size["file_bytes"] / size["series"] <= MAX_BYTES_PER_SERIES
    # The same state encodes to as many bytes here (the same seeds; times are 8-byte floats, epochs 16 hex digits).
    assert len(persistence.keeper_for(state, persistence.Path("unused")).encode()) == size["file_bytes"]
    assert all(r["goal"] is not None and isinstance(r["met"], bool) for r in rows.values())


def test_label_memory_fills_the_budget_in_every_case(smoke: Any) -> None:
    """bench/label_memory.py's smoke run (8 ranks, a budget of 24 a rank): the cases of labels as long as a
    series weighing one unit may have fill the budget; the cases of labels at their limits fill it with
    fewer series, the rest refused (`series_limit`)."""
    from bench import label_memory

    rows = {r["name"].rsplit(", ", 1)[1].split()[0]: r for r in smoke[0]["label_memory"]}
    assert set(rows) == set(label_memory.CASES)
    for case, r in rows.items():
        # A series pair of the longest labels weighs 17 (11 and its rollup 6); a histogram's, more than this budget.
        assert r["series_allowed"] == 8 * 24 and r["series_allowed"] - r["series_used"] < (192 if case == "histograms" else 20)
        assert r["series_used"] > 0, (case, r)
        assert r["anchor_value"] == pytest.approx(r["value"] / r["ratio"]), r
        if case != "short":  # measured in the same run: the short case's peak
            assert r["anchor_value"] == rows["short"]["value"], r
    # (A new series asks room for its rollup too, even where its group has it: the last replicas' few are refused.)
    assert [rows[c]["series_refused"] for c in ("short", "edge")] == [0, 0]
    assert [rows[c]["series_refused"] > 0 for c in ("long", "wide", "histograms")] == [True] * 3
    assert rows["long"]["views"]["/metrics"] > rows["short"]["views"]["/metrics"]


@pytest.mark.parametrize("case, lines", [("edge", 1), ("replicas", 2), ("gauges", 2)])
def test_label_memory_edge_labels_weigh_exactly_one_unit(case: str, lines: int) -> None:
    """The edge cases' labels write the most a series of `lines` lines weighing one unit may write."""
    from exporter.config import RanksConfig
    from exporter.sidecar.core.keys import LABEL_CHARS_PER_UNIT, label_chars, label_width, series_cost

    from bench import label_memory

    static, own = label_memory.case_labels(case, 7, RanksConfig())
    sample = label_memory.case_samples(case, own, 1)[0]
    labels = [*label_memory.AXES.items(), *static.items(), *sample.labels.items()]
    chars = label_chars(labels)
    assert label_width(labels) == 1 and chars * lines == LABEL_CHARS_PER_UNIT
    assert (series_cost(None, chars, lines), series_cost(None, chars + 1, lines)) == (1, 2)


def test_label_memory_long_labels_are_at_the_limits() -> None:
    from exporter.config import RanksConfig
    from exporter.sidecar.core.keys import label_width

    from bench import label_memory

    limits = RanksConfig()
    for case, width in (("long", 1), ("wide", 4), ("histograms", 1)):
        static, own = label_memory.case_labels(case, 1023, limits)
        assert len(static) == limits.max_static_labels and own == limits.max_family_label_value_length
        assert sum(map(len, static.values())) == limits.max_static_label_chars
        assert len(set(static.values())) == len(static) and label_width(static.items()) == width
