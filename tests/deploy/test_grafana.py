"""The Grafana dashboard: current schema, $datasource everywhere, and only metrics that exist.

Every metric name a PromQL target names must be one the sidecar exports (derived from the
packaged catalog and the real collector) or a recording rule of
config/prometheus/recording_rules.yml. `dashboard_expressions()` gives the expressions with
Grafana's variables replaced, for tests that run them through a real Prometheus.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "hicache-exporter.json"
RECORDING_RULES = ROOT / "config" / "prometheus" / "recording_rules.yml"

NAMESPACE = "sglang_"
DATASOURCE_UID = "${datasource}"
ALLOWED_PANEL_TYPES = {"timeseries", "stat", "table", "row"}
# Values that make a dashboard expression a plain PromQL query.
VARIABLE_VALUES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "instance": ".*",
    "dp_rank": ".*",
}
# The recording-rule naming contract, for when recording_rules.yml does not exist.
RULE_NAME_PATTERNS = [
    re.compile(r"^cluster:sglang_[a-z0-9_]+:rate5m$"),
    re.compile(r"^dp_group:sglang_[a-z0-9_]+_tokens:rate5m$"),
    re.compile(r"^cluster:sglang_(load_back|hicache_backup|storage_prefetch|storage_backup)"
               r"_active_bandwidth_bytes_per_second:ratio_rate5m$"),
]

PROMQL_FUNCTIONS = {
    # aggregation operators
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
    # functions
    "abs", "absent", "absent_over_time", "ceil", "changes", "clamp", "clamp_max", "clamp_min",
    "day_of_month", "day_of_week", "day_of_year", "days_in_month", "delta", "deriv", "exp", "floor",
    "histogram_avg", "histogram_count", "histogram_fraction", "histogram_quantile", "histogram_stddev",
    "histogram_stdvar", "histogram_sum", "holt_winters", "double_exponential_smoothing", "hour", "idelta",
    "increase", "irate", "label_join", "label_replace", "ln", "log2", "log10", "minute", "month",
    "predict_linear", "rate", "resets", "round", "scalar", "sgn", "sort", "sort_desc", "sort_by_label",
    "sort_by_label_desc", "sqrt", "time", "timestamp", "vector", "year", "avg_over_time", "min_over_time",
    "max_over_time", "sum_over_time", "count_over_time", "quantile_over_time", "stddev_over_time",
    "stdvar_over_time", "last_over_time", "present_over_time", "mad_over_time",
    "acos", "acosh", "asin", "asinh", "atan", "atanh", "cos", "cosh", "sin", "sinh", "tan", "tanh",
    "deg", "rad", "pi",
}
PROMQL_KEYWORDS = {"and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
                   "group_left", "group_right", "inf", "nan", "atan2", "start", "end"}


# --- the dashboard -----------------------------------------------------------------------------

@cache
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(panels: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in dashboard()["panels"] if panels is None else panels:
        yield panel
        yield from all_panels(panel.get("panels") or [])


def raw_expressions() -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every PromQL target, variables left in."""
    out = []
    for panel in all_panels():
        for target in panel.get("targets", []):
            out.append((f"{panel.get('title')} / {target.get('refId')}", target["expr"]))
    return out


def substitute(expr: str) -> str:
    """Replace Grafana variables ($x, ${x}, ${x:fmt}) with plausible values."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in VARIABLE_VALUES:
            raise KeyError(f"no test value for the dashboard variable ${name} in {expr!r}")
        return VARIABLE_VALUES[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def dashboard_expressions() -> list[str]:
    """Every PromQL expression of the dashboard, with its variables substituted
    (`$__rate_interval` -> 5m, `$instance` and `$dp_rank` -> .*), ready for a real Prometheus."""
    return [substitute(expr) for _, expr in raw_expressions()]


# --- metric names --------------------------------------------------------------------------------

def _strip(expr: str) -> str:
    """PromQL with string literals, label matchers, ranges and grouping label lists removed."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    expr = re.sub(r"\{[^{}]*\}", " ", expr)
    expr = re.sub(r"\[[^\[\]]*\]", " ", expr)
    return re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", " ", expr)


def referenced_names(expr: str) -> tuple[set[str], set[str]]:
    """(metric names, function names) an expression uses."""
    assert "__name__" not in expr, f"select metrics by name, not through __name__: {expr}"
    stripped = _strip(expr)
    metrics, functions = set(), set()
    for match in re.finditer(r"(?<![\w:.])([A-Za-z_:][\w:]*)(\s*\()?", stripped):
        word, call = match.group(1), match.group(2)
        if call:
            functions.add(word)
        elif word not in PROMQL_KEYWORDS:
            metrics.add(word)
    return metrics, functions


def test_name_extraction() -> None:
    metrics, functions = referenced_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$instance", x="y{z}"}[$__rate_interval])))'
        ' / on (job) group_left (pod) b:c:rate5m offset 5m > bool 1e3 and max without (tp_rank) (c)'
    )
    assert metrics == {"a_bucket", "b:c:rate5m", "c"}
    assert functions == {"histogram_quantile", "sum", "rate", "max"}


@cache
def exported_names() -> frozenset[str]:
    """Every sample name the sidecar can expose, derived from the catalog as DESIGN section 6 says."""
    from exporter.catalog import MetricType, Semantics, default_catalog

    names: set[str] = set()

    def add(name: str, kind: MetricType) -> None:
        if kind is MetricType.HISTOGRAM:
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)

    catalog = default_catalog()
    for spec in catalog:
        add(NAMESPACE + spec.name, spec.type)
        add(NAMESPACE + "rollup_" + spec.name, spec.type)
        if spec.type is MetricType.COUNTER and spec.semantics is Semantics.REPLICATED:
            names.add(NAMESPACE + spec.base_name + "_replica_spread_ratio")
    for bytes_spec, _ in catalog.bandwidth_pairs():
        names.add(NAMESPACE + bytes_spec.bandwidth_name)
        names.add(NAMESPACE + "rollup_" + bytes_spec.bandwidth_name)
    return frozenset(names | collector_names(prefix="hicache_exporter_"))


@cache
def collector_names(prefix: str = "") -> frozenset[str]:
    """Sample names the real collector (exporter/sidecar/exposition.py) declares, on an empty sidecar."""
    from exporter.catalog import default_catalog
    from exporter.config import SidecarConfig
    from exporter.sidecar.exposition import SidecarCollector
    from exporter.sidecar.state import SidecarState
    from exporter.sidecar.stats import SidecarStats

    config = SidecarConfig()
    state = SidecarState(default_catalog(), config.ranks, config.rollup.window_seconds)
    names: set[str] = set()
    for metric in SidecarCollector(state, SidecarStats(), NAMESPACE).collect():
        if not metric.name.startswith(prefix):
            continue
        if metric.type == "counter":
            names.add(metric.name + "_total")
        elif metric.type == "histogram":
            names.update(metric.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(metric.name)
    return frozenset(names)


def test_catalog_derivation_matches_the_collector() -> None:
    """The allowed set above is exactly what the collector declares (guards this test itself)."""
    assert exported_names() == collector_names()
    assert "hicache_exporter_rank_up" in exported_names()
    assert "hicache_exporter_rejections_total" in exported_names()
    assert "hicache_exporter_scrape_duration_seconds_bucket" in exported_names()


def recording_rule_names() -> set[str] | None:
    if not RECORDING_RULES.is_file():
        return None
    data = yaml.safe_load(RECORDING_RULES.read_text(encoding="utf-8"))
    return {r["record"] for g in data["groups"] for r in g["rules"] if "record" in r}


def unknown_names(names: set[str]) -> set[str]:
    rules = recording_rule_names()
    unknown = set()
    for name in names:
        if name in exported_names():
            continue
        if rules is not None and name in rules:
            continue
        if rules is None and any(p.match(name) for p in RULE_NAME_PATTERNS):
            continue
        unknown.add(name)
    return unknown


# --- tests ---------------------------------------------------------------------------------------

def test_valid_json_with_current_schema() -> None:
    board = dashboard()
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 39
    assert board["uid"] == "hicache-exporter" and len(board["uid"]) <= 40
    assert board["title"]
    ids = [p["id"] for p in all_panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_panel_types_and_layout() -> None:
    for panel in all_panels():
        assert panel["type"] in ALLOWED_PANEL_TYPES, f"{panel.get('title')}: type {panel['type']!r}"
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if panel["type"] == "row":
            assert not panel.get("targets"), "rows hold no queries"
    graphs = [p for p in all_panels() if p["type"] == "timeseries"]
    assert len(graphs) >= 10
    # No two panels overlap on the grid (top-level, expanded rows).
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard()["panels"]:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


def test_every_panel_uses_the_datasource_variable() -> None:
    for panel in all_panels():
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": DATASOURCE_UID}, panel["title"]
        assert panel["targets"], f"{panel['title']}: no queries"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            if "datasource" in target:
                assert target["datasource"]["uid"] == DATASOURCE_UID, panel["title"]
            assert target["expr"].strip()


def test_templating_variables() -> None:
    variables = {v["name"]: v for v in dashboard()["templating"]["list"]}
    assert {"datasource", "instance", "dp_rank"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    for name in ("instance", "dp_rank"):
        var = variables[name]
        assert var["type"] == "query"
        assert var["datasource"]["uid"] == DATASOURCE_UID
        assert var["includeAll"] and var["multi"] and var["allValue"] == ".*"
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match and match.group(2) == name, query
        metrics, _ = referenced_names(match.group(1))
        assert metrics and not unknown_names(metrics), query


def test_every_metric_name_exists() -> None:
    problems = []
    for where, expr in raw_expressions():
        metrics, functions = referenced_names(expr)
        assert metrics, f"{where}: no metric in {expr}"
        bad_functions = functions - PROMQL_FUNCTIONS
        if bad_functions:
            problems.append(f"{where}: unknown functions {sorted(bad_functions)}")
        missing = unknown_names(metrics)
        if missing:
            problems.append(f"{where}: {sorted(missing)} are neither exported nor recording rules")
    assert not problems, "\n".join(problems)


def test_metric_check_catches_a_typo() -> None:
    assert unknown_names({"sglang_load_back_token_total"}) == {"sglang_load_back_token_total"}
    assert unknown_names({"cluster:sglang_load_back_tokens:rate1m"})
    assert not unknown_names({"sglang_rollup_load_back_duration_seconds_bucket"})


def test_selectors_use_the_variables() -> None:
    """Exporter series are filtered by $instance; per-rank series also by $dp_rank."""
    rank_labelled = {n for n in exported_names() if n.startswith(NAMESPACE) and "rollup_" not in n}
    rank_labelled |= {"hicache_exporter_rank_up", "hicache_exporter_rank_leader",
                      "hicache_exporter_rank_restarts_total", "hicache_exporter_rank_last_push_timestamp_seconds"}
    for where, expr in raw_expressions():
        for match in re.finditer(r"(?<![\w:])([A-Za-z_][\w:]*)\s*(\{[^}]*\})?", expr):
            name, matchers = match.group(1), match.group(2) or ""
            if name not in exported_names():
                continue
            assert 'instance=~"$instance"' in matchers, f"{where}: {name} without instance=~\"$instance\""
            if name in rank_labelled:
                assert 'dp_rank=~"$dp_rank"' in matchers, f"{where}: {name} without dp_rank=~\"$dp_rank\""


def test_required_views_are_present() -> None:
    exprs = " ".join(e for _, e in raw_expressions())
    for needed in (
        "sglang_load_back_tokens_total", "sglang_rollup_load_back_tokens_total", "cluster:sglang_load_back_tokens:rate5m",
        "sglang_load_back_bytes_total", "sglang_rollup_load_back_bytes_total",
        "sglang_storage_prefetch_unfulfilled_tokens_total", "sglang_storage_prefetch_deferred_tokens_total",
        "hicache_exporter_rank_up", "hicache_exporter_rejections_total", "hicache_exporter_scrape_duration_seconds",
        "hicache_exporter_connections",
    ):
        assert needed in exprs, needed
    for tier in ("load_back", "hicache_backup", "storage_prefetch", "storage_backup"):
        assert f"sglang_{tier}_active_bandwidth_bytes_per_second" in exprs
        assert f"sglang_rollup_{tier}_active_bandwidth_bytes_per_second" in exprs
        assert f"cluster:sglang_{tier}_active_bandwidth_bytes_per_second:ratio_rate5m" in exprs
    assert "_replica_spread_ratio" in exprs
    by_reason = [p for p in all_panels() if p["type"] == "timeseries"
                 and any("by (reason)" in t["expr"] and "prefetch_" in t["expr"] for t in p["targets"])]
    assert len(by_reason) >= 2
    for panel in by_reason:
        assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal", panel["title"]


def summed_over_replicas(expr: str, names: set[str]) -> set[str]:
    """Replicated per-rank counters that `expr` sums straight across tp/pp replicas."""
    found = set()
    pattern = r"\bsum\s*(?:(by|without)\s*\(([^)]*)\))?\s*\(\s*(?:rate|irate|increase)\s*\(\s*([\w:]+)"
    for match in re.finditer(pattern, expr):
        modifier, labels, name = match.group(1), match.group(2) or "", match.group(3)
        if name not in names:
            continue
        listed = {label.strip() for label in labels.split(",")}
        keeps_ranks = (modifier == "by" and {"tp_rank", "pp_rank"} <= listed) or \
                      (modifier == "without" and not listed & {"tp_rank", "pp_rank"})
        if not keeps_ranks:
            found.add(name)
    return found


def test_replicated_tokens_are_never_summed_over_replicas() -> None:
    """A per-rank token series is drawn per rank, or reduced to one replica per dp group before a sum."""
    from exporter.catalog import MetricType, Semantics, default_catalog

    replicated = {NAMESPACE + s.name for s in default_catalog()
                  if s.semantics is Semantics.REPLICATED and s.type is MetricType.COUNTER}
    assert summed_over_replicas("sum(rate(sglang_load_back_tokens_total[5m]))", replicated)
    assert summed_over_replicas("sum without (tp_rank) (rate(sglang_load_back_tokens_total[5m]))", replicated)
    assert not summed_over_replicas("sum without (pool) (rate(sglang_load_back_tokens_total[5m]))", replicated)
    assert not summed_over_replicas("sum(rate(sglang_load_back_bytes_total[5m]))", replicated)
    for where, expr in raw_expressions():
        wrong = summed_over_replicas(expr, replicated)
        assert not wrong, f"{where}: sums {sorted(wrong)} over replicas; take one replica per dp group first"


def test_dashboard_expressions_are_plain_promql() -> None:
    exprs = dashboard_expressions()
    assert len(exprs) == len(raw_expressions()) > 0
    for expr in exprs:
        assert "$" not in expr, expr
        assert "[5m]" in expr or "[" not in expr
    with pytest.raises(KeyError):
        substitute("rate(x[$unknown])")
