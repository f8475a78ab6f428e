"""The Grafana dashboard: current schema, $datasource everywhere, only metrics that exist, and the one rule.

The rule (README, "Which series to read"): one pod, its sidecar's rollups; a fleet, or a TP group
spanning pods, the `cluster:` recording rules. Fleet rows therefore read no sidecar rollup and no
per-rank series; pod rows select every series by the single-valued `$instance`. Every check runs
on the committed dashboard (namespace `sglang_`) and on the one generated for `sglang:`; both hold
the rows of every packaged profile (the lmcache profile's under `lmcache_`). Every metric name a
PromQL target names must be one the sidecar exports (derived from the packaged profiles' catalogs
and the real collector of a sidecar serving them all) or a recording rule generated for it.
`dashboard_expressions()` gives the expressions with Grafana's variables replaced, for tests
that run them through a real Prometheus.
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

from config.generator import DEFAULT_NAMESPACE, outputs

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "config" / "grafana" / "hicache-exporter.json"
NAMESPACES = [DEFAULT_NAMESPACE, "sglang:"]
# The packaged profiles besides the default one, each under its own namespace whatever the default's.
OTHER_PROFILES = {"lmcache": "lmcache_"}

DATASOURCE_UID = "${datasource}"
ALLOWED_PANEL_TYPES = {"timeseries", "stat", "table", "row"}
# Values that make a dashboard expression a plain PromQL query.
VARIABLE_VALUES = {
    "__rate_interval": "5m",
    "__interval": "1m",
    "__range": "1h",
    "instance": "127.0.0.1:9400",
    "dp_rank": ".*",
    "server": ".*",
    "lmcache_server": ".*",
}
RECORD_LEVELS = ("cluster:", "dp_group:")
PREFILL_ROW = "Where prefill tokens come from"
# Series Prometheus itself writes for every target.
PROMETHEUS_SERIES = {"up"}

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
def dashboard(ns: str = DEFAULT_NAMESPACE) -> dict[str, Any]:
    if ns == DEFAULT_NAMESPACE:
        return json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return json.loads(outputs(ns)["grafana/hicache-exporter.json"])


def all_panels(ns: str = DEFAULT_NAMESPACE, panels: list[dict[str, Any]] | None = None) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in (collapsed) rows."""
    for panel in dashboard(ns)["panels"] if panels is None else panels:
        yield panel
        yield from all_panels(ns, panel.get("panels") or [])


def sections(ns: str = DEFAULT_NAMESPACE) -> Iterator[tuple[str, dict[str, Any]]]:
    """(the title of the row a panel sits under, the panel) for every non-row panel, in layout order."""
    row = ""
    for panel in dashboard(ns)["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            for nested in panel.get("panels") or []:
                yield row, nested
        else:
            yield row, panel


def raw_expressions(ns: str = DEFAULT_NAMESPACE) -> list[tuple[str, str]]:
    """(panel title / refId, expr) for every PromQL target, variables left in."""
    out = []
    for panel in all_panels(ns):
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


def dashboard_expressions(ns: str = DEFAULT_NAMESPACE) -> list[str]:
    """Every PromQL expression of the dashboard, with its variables substituted
    (`$__rate_interval` -> 5m, `$instance` -> a target, `$dp_rank` -> .*), ready for a real Prometheus."""
    return [substitute(expr) for _, expr in raw_expressions(ns)]


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
        if word in PROMQL_KEYWORDS:
            continue  # `and (...)`, `bool`, `offset`: operators, neither metric nor function
        if call:
            functions.add(word)
        else:
            metrics.add(word)
    return metrics, functions


def test_name_extraction() -> None:
    metrics, functions = referenced_names(
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{instance=~"$instance", x="y{z}"}[$__rate_interval])))'
        ' / on (job) group_left (pod) b:c:rate5m offset 5m > bool 1e3 and max without (tp_rank) (c)'
        ' + sglang:d_total'
    )
    assert metrics == {"a_bucket", "b:c:rate5m", "c", "sglang:d_total"}
    assert functions == {"histogram_quantile", "sum", "rate", "max"}
    metrics, functions = referenced_names('rate(a[5m]) and on (job) (changes(b[5m]) == 0)')
    assert metrics == {"a", "b"} and functions == {"rate", "changes"}


@cache
def profiles_catalog() -> Any:
    """The catalog of a sidecar serving every packaged profile (`serve --profile lmcache`)."""
    from exporter.catalog import load_profiles

    return load_profiles(None, list(OTHER_PROFILES))


@cache
def exported_names(ns: str = DEFAULT_NAMESPACE) -> frozenset[str]:
    """Every sample name the sidecar can expose with `ns` as its namespace, derived from the profiles' catalogs."""
    from exporter.catalog import MetricType, Semantics

    names: set[str] = set()

    def add(name: str, kind: MetricType) -> None:
        if kind is MetricType.HISTOGRAM:
            names.update(name + suffix for suffix in ("_bucket", "_sum", "_count"))
        else:
            names.add(name)

    catalog = profiles_catalog()
    for spec in catalog:
        own = catalog.namespace_of(spec, ns)
        add(own + spec.name, spec.type)
        add(own + "rollup_" + spec.name, spec.type)
        if spec.type is MetricType.COUNTER and spec.semantics is Semantics.REPLICATED:
            names.add(own + spec.base_name + "_replica_spread_ratio")
    for bytes_spec, _ in catalog.bandwidth_pairs():
        own = catalog.namespace_of(bytes_spec, ns)
        names.add(own + bytes_spec.bandwidth_name)
        names.add(own + "rollup_" + bytes_spec.bandwidth_name)
    return frozenset(names | collector_names(ns, prefix="hicache_exporter_"))


@cache
def collector_names(ns: str = DEFAULT_NAMESPACE, prefix: str = "") -> frozenset[str]:
    """Sample names the real collector (exporter/sidecar/expose/collector.py) declares, on a sidecar with one
    upstream, a state file and every packaged profile."""
    from exporter.config import SidecarConfig
    from exporter.sidecar.core.health import SidecarHealth, UpstreamHealth
    from exporter.sidecar.core.state import SidecarState
    from tests.exporter.sidecar.expose.reference import ReferenceCollector

    config = SidecarConfig()
    state = SidecarState(profiles_catalog(), config.ranks, config.rollup.window_seconds)
    stats = SidecarHealth()
    # An upstream that has been read and has failed once, so its every health family is declared.
    upstream = UpstreamHealth("engine", "http://127.0.0.1:30000/metrics")
    upstream.last_scrape_wall, upstream.last_duration, upstream.errors = 1.0, 0.1, {"connect": 1}
    stats.upstreams["engine"] = upstream
    stats.persistence.enabled = True  # --persistence.file, as every generated pod has: its families are declared
    # A rank that said hello with a world: hicache_exporter_ranks_missing is declared for its server.
    from exporter.protocol.messages import RankId, World
    from exporter.sidecar.core.ranks import Join

    state.join(object(), Join(rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0), labels={"cache_type": "c"}, epoch="e",
                              pid=1, world=World(tp_size=1, pp_size=1, dp_size=1)))
    names: set[str] = set()
    for metric in ReferenceCollector(state, stats, ns).collect():
        if not metric.name.startswith(prefix):
            continue
        if metric.type == "counter":
            names.add(metric.name + "_total")
        elif metric.type == "histogram":
            names.update(metric.name + s for s in ("_bucket", "_sum", "_count"))
        else:
            names.add(metric.name)
    return frozenset(names)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_catalog_derivation_matches_the_collector(ns: str) -> None:
    """The allowed set above is exactly what the collector declares (guards this test itself)."""
    assert exported_names(ns) == collector_names(ns)
    for name in ("hicache_exporter_rank_up", "hicache_exporter_rejections_total",
                 "hicache_exporter_scrape_duration_seconds_bucket", "hicache_exporter_upstream_up",
                 "hicache_exporter_upstream_scrape_errors_total", f"{ns}rollup_load_back_tokens_total"):
        assert name in exported_names(ns)


@cache
def process_names() -> frozenset[str]:
    """The process_* samples the sidecar serves on the same /metrics (prometheus_client's ProcessCollector,
    exporter/sidecar/runner.py): its start time is what the pod rows' restart guard reads."""
    from prometheus_client.process_collector import ProcessCollector

    names = frozenset(sample.name for metric in ProcessCollector(registry=None).collect() for sample in metric.samples)
    assert "process_start_time_seconds" in names, "the process collector reads /proc: run the tests on Linux"
    return names


@cache
def recording_rule_names(ns: str = DEFAULT_NAMESPACE) -> frozenset[str]:
    data = yaml.safe_load(outputs(ns)["prometheus/recording_rules.yml"])
    return frozenset(r["record"] for g in data["groups"] for r in g["rules"] if "record" in r)


def unknown_names(names: set[str], ns: str = DEFAULT_NAMESPACE) -> set[str]:
    return {name for name in names
            if name not in exported_names(ns) and name not in recording_rule_names(ns) and name not in PROMETHEUS_SERIES
            and name not in process_names()}


def namespaces(ns: str) -> tuple[str, ...]:
    """Every namespace the dashboard generated for `ns` reads: `ns` and the other profiles' own."""
    return (ns, *OTHER_PROFILES.values())


def is_rollup(name: str, ns: str) -> bool:
    return name.startswith(tuple(n + "rollup_" for n in namespaces(ns)))


def is_cache_series(name: str, ns: str) -> bool:
    """A per-rank or rollup series of a catalog family (or derived from one) of any profile, not a recording rule."""
    return name.startswith(namespaces(ns)) and not name.startswith(RECORD_LEVELS)


# --- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("ns", NAMESPACES)
def test_valid_json_with_current_schema(ns: str) -> None:
    board = dashboard(ns)
    assert isinstance(board["schemaVersion"], int) and board["schemaVersion"] >= 39
    assert board["uid"] == ("hicache-exporter" if ns == DEFAULT_NAMESPACE else "hicache-exporter-sglang-colon")
    assert len(board["uid"]) <= 40 and board["title"]
    ids = [p["id"] for p in all_panels(ns)]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_panel_types_and_layout(ns: str) -> None:
    for panel in all_panels(ns):
        assert panel["type"] in ALLOWED_PANEL_TYPES, f"{panel.get('title')}: type {panel['type']!r}"
        pos = panel["gridPos"]
        assert 0 <= pos["x"] and pos["x"] + pos["w"] <= 24 and pos["h"] > 0
        if panel["type"] == "row":
            assert not panel.get("targets"), "rows hold no queries"
    graphs = [p for p in all_panels(ns) if p["type"] == "timeseries"]
    assert len(graphs) >= 10
    # No two panels overlap on the grid (top-level, expanded rows).
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard(ns)["panels"]:
        pos = panel["gridPos"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_panel_uses_the_datasource_variable(ns: str) -> None:
    for panel in all_panels(ns):
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


@pytest.mark.parametrize("ns", NAMESPACES)
def test_templating_variables(ns: str) -> None:
    variables = {v["name"]: v for v in dashboard(ns)["templating"]["list"]}
    assert {"datasource", "instance", "dp_rank"} <= set(variables)
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    # One pod at a time: a multi-valued instance would let a pod panel add up several sidecars.
    assert variables["instance"]["multi"] is False and variables["instance"]["includeAll"] is False
    assert variables["dp_rank"]["includeAll"] and variables["dp_rank"]["multi"] and variables["dp_rank"]["allValue"] == ".*"
    for name in ("instance", "dp_rank"):
        var = variables[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == DATASOURCE_UID
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        assert match and match.group(2) == name, query
        metrics, _ = referenced_names(match.group(1))
        assert metrics and not unknown_names(metrics, ns), query


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_metric_name_exists(ns: str) -> None:
    problems = []
    for where, expr in raw_expressions(ns):
        metrics, functions = referenced_names(expr)
        assert metrics, f"{where}: no metric in {expr}"
        bad_functions = functions - PROMQL_FUNCTIONS
        if bad_functions:
            problems.append(f"{where}: unknown functions {sorted(bad_functions)}")
        missing = unknown_names(metrics, ns)
        if missing:
            problems.append(f"{where}: {sorted(missing)} are neither exported nor recording rules")
        other = next(o for o in NAMESPACES if o != ns)
        if any(m.startswith(other) and not m.startswith(ns) for m in metrics):
            problems.append(f"{where}: names of namespace {other!r}")
    assert not problems, "\n".join(problems)


def test_metric_check_catches_a_typo() -> None:
    assert unknown_names({"sglang_load_back_token_total"}) == {"sglang_load_back_token_total"}
    assert unknown_names({"lmcache_num_hit_token_total"}) and unknown_names({"lmcache:num_hit_tokens_total"})
    assert unknown_names({"cluster:lmcache_retrieve_hit_rate:ratio_rate1m"})
    assert not unknown_names({"lmcache_rollup_num_hit_tokens_total", "cluster:lmcache_retrieve_hit_rate:ratio_rate5m"},
                             "sglang:")
    assert unknown_names({"cluster:sglang_load_back_tokens:rate1m"})
    assert unknown_names({"sglang_rollup_load_back_tokens_total"}, "sglang:")
    assert not unknown_names({"sglang_rollup_load_back_duration_seconds_bucket"})
    assert not unknown_names({"cluster:sglang:load_back_tokens:rate5m"}, "sglang:")


# --- the one rule ------------------------------------------------------------------------------

def fleet_violations(expr: str, ns: str) -> set[str]:
    """What a fleet panel may not read: a sidecar rollup or a per-rank cache series (only recording rules)."""
    metrics, _ = referenced_names(expr)
    return {m for m in metrics if is_cache_series(m, ns)}


def pod_violations(expr: str, ns: str) -> set[str]:
    """Series of a pod panel not pinned to the one pod `instance="$instance"` (recording rules are fleet-wide)."""
    bad = set()
    for match in re.finditer(r"(?<![\w:])([A-Za-z_][\w:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = match.group(1), match.group(2) or ""
        if name.startswith(RECORD_LEVELS):
            bad.add(name)
        elif (name in exported_names(ns) or name in process_names()) and 'instance="$instance"' not in matchers:
            bad.add(name)
    return bad


def test_the_rule_checks_can_fail() -> None:
    ns = DEFAULT_NAMESPACE
    assert fleet_violations("sum(rate(sglang_rollup_load_back_tokens_total[5m]))", ns)
    assert fleet_violations("sum(rate(sglang_load_back_bytes_total[5m]))", ns)
    assert not fleet_violations("sum(cluster:sglang_load_back_tokens:rate5m)", ns)
    assert fleet_violations("sum(rate(lmcache_rollup_num_hit_tokens_total[5m]))", ns)
    assert fleet_violations("sum(lmcache_local_cache_usage)", ns)
    assert not fleet_violations("sum(cluster:lmcache_num_hit_tokens:rate5m)", ns)
    assert pod_violations("lmcache_local_cache_usage", ns)
    assert pod_violations('rate(sglang_rollup_load_back_bytes_total{instance=~"$instance"}[5m])', ns)
    assert pod_violations("sum(cluster:sglang_load_back_bytes:rate5m)", ns)
    assert not pod_violations('rate(sglang_rollup_load_back_bytes_total{instance="$instance"}[5m])', ns)
    assert pod_violations('rate(sglang_rollup_load_back_bytes_total{instance="$instance"}[5m]) '
                          'and on (job, instance) (changes(process_start_time_seconds[5m]) == 0)', ns)


@pytest.mark.parametrize("ns", NAMESPACES)
def test_fleet_rows_read_recording_rules_and_pod_rows_one_pod(ns: str) -> None:
    """The one rule, everywhere: each panel is a fleet panel or a pod panel, and reads accordingly."""
    problems = []
    seen = {"fleet": 0, "pod": 0}
    for row, panel in sections(ns):
        # The prefill row reads recording rules only, as the fleet rows do.
        kind = "fleet" if row.startswith(("Fleet", PREFILL_ROW)) else "pod" if row.startswith("Pod") else None
        assert kind, f"{panel['title']!r} sits under {row!r}, neither a fleet nor a pod row"
        seen[kind] += 1
        for target in panel["targets"]:
            check = fleet_violations if kind == "fleet" else pod_violations
            wrong = check(target["expr"], ns)
            if wrong:
                problems.append(f"{kind} panel {panel['title']!r}: {sorted(wrong)} in {target['expr']}")
    assert not problems, "\n".join(problems)
    assert seen["fleet"] >= 5 and seen["pod"] >= 5
    rows = [p["title"] for p in dashboard(ns)["panels"] if p["type"] == "row"]
    assert rows[0].startswith(PREFILL_ROW), "where prefill tokens come from comes first"
    assert rows[1].startswith("Fleet"), "then the fleet view"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_the_first_row_is_where_prefill_tokens_come_from(ns: str) -> None:
    """Each tier's share over the whole fleet, then over time, stacked, one panel per server, and what a hit
    costs per tier, per server, from the recording rules (issue 32)."""
    board = dashboard(ns)
    assert board["panels"][0]["type"] == "row" and board["panels"][0]["title"].startswith(PREFILL_ROW)
    panels = [panel for row, panel in sections(ns) if row.startswith(PREFILL_ROW)]
    fleet, shares, moved, timed = panels
    # Every server's tokens summed before the division: a busy server weighs as its tokens do.
    assert [t["legendFormat"] for t in fleet["targets"]] == ["fleet {{tier}}", "fleet computed"]
    for target in fleet["targets"]:
        metrics, _ = referenced_names(target["expr"])
        assert metrics == {f"cluster:{ns}prefill_effective_tokens:rate5m"} and "sum(" in target["expr"]
    assert "repeat" not in fleet and fleet["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert [t["expr"] for t in shares["targets"]] == [f'cluster:{ns}prefill_hit_ratio:ratio_rate5m{{server=~"$server"}}',
                                                    f'cluster:{ns}prefill_computed_ratio:ratio_rate5m{{server=~"$server"}}']
    assert [t["legendFormat"] for t in shares["targets"]] == ["{{tier}}", "computed"]
    assert shares["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert shares["fieldConfig"]["defaults"]["unit"] == "percentunit" and shares["fieldConfig"]["defaults"]["max"] == 1
    assert shares["repeat"] == "server", "stacked per server: one panel each"
    server = {v["name"]: v for v in board["templating"]["list"]}["server"]
    assert server["multi"] and server["includeAll"] and server["allValue"] == ".*"
    assert server["query"]["query"] == f"label_values(cluster:{ns}prefill_effective_tokens:rate5m, server)"
    costs = {t["expr"].split("{")[0]: t["legendFormat"] for panel in (moved, timed) for t in panel["targets"]}
    assert set(costs) == {f"cluster:{ns}{tier}_{what}_per_hit_token:ratio_rate5m"
                          for tier in ("host", "storage") for what in ("bytes", "seconds", "backup_bytes")}
    assert all(legend.startswith("{{server}} ") for legend in costs.values()), "per server"
    assert {t["expr"].split("{")[0] for t in timed["targets"]} == {f"cluster:{ns}host_seconds_per_hit_token:ratio_rate5m",
                                                                   f"cluster:{ns}storage_seconds_per_hit_token:ratio_rate5m"}
    assert moved["fieldConfig"]["defaults"]["unit"] == "bytes" and timed["fieldConfig"]["defaults"]["unit"] == "s"


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


@pytest.mark.parametrize("ns", NAMESPACES)
def test_replicated_tokens_are_never_summed_over_replicas(ns: str) -> None:
    """A per-rank token series is drawn per rank, or reduced to one replica per dp group before a sum."""
    from exporter.catalog import MetricType, Semantics

    catalog = profiles_catalog()
    replicated = {catalog.namespace_of(s, ns) + s.name for s in catalog
                  if s.semantics is Semantics.REPLICATED and s.type is MetricType.COUNTER}
    assert summed_over_replicas(f"sum(rate({ns}load_back_tokens_total[5m]))", replicated)
    assert summed_over_replicas("sum(rate(lmcache_num_hit_tokens_total[5m]))", replicated)
    assert not summed_over_replicas("sum(rate(lmcache_num_remote_read_bytes_total[5m]))", replicated)
    assert summed_over_replicas(f"sum without (tp_rank) (rate({ns}load_back_tokens_total[5m]))", replicated)
    assert not summed_over_replicas(f"sum without (pool) (rate({ns}load_back_tokens_total[5m]))", replicated)
    assert not summed_over_replicas(f"sum(rate({ns}load_back_bytes_total[5m]))", replicated)
    for where, expr in raw_expressions(ns):
        wrong = summed_over_replicas(expr, replicated)
        assert not wrong, f"{where}: sums {sorted(wrong)} over replicas; take one replica per dp group first"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_required_views_are_present(ns: str) -> None:
    exprs = " ".join(e for _, e in raw_expressions(ns))
    for needed in (
        f"{ns}load_back_tokens_total", f"{ns}rollup_load_back_tokens_total", f"cluster:{ns}load_back_tokens:rate5m",
        f"{ns}load_back_bytes_total", f"{ns}rollup_load_back_bytes_total", f"cluster:{ns}load_back_bytes:rate5m",
        f"cluster:{ns}storage_prefetch_unfulfilled_tokens:rate5m", f"cluster:{ns}storage_prefetch_deferred_tokens:rate5m",
        f"cluster:{ns}prefill_effective_tokens:rate5m",
        "hicache_exporter_rank_up", "hicache_exporter_rejections_total", "hicache_exporter_scrape_duration_seconds",
        "hicache_exporter_connections", "hicache_exporter_upstream_up",
    ):
        assert needed in exprs, needed
    for tier in ("load_back", "hicache_backup", "storage_prefetch", "storage_backup"):
        assert f"{ns}{tier}_active_bandwidth_bytes_per_second" in exprs
        assert f"{ns}rollup_{tier}_active_bandwidth_bytes_per_second" in exprs
        assert f"cluster:{ns}{tier}_active_bandwidth_bytes_per_second:ratio_rate5m" in exprs
    assert "_replica_spread_ratio" in exprs
    by_reason = [p for p in all_panels(ns) if p["type"] == "timeseries"
                 and any("by (reason)" in t["expr"] and "prefetch_" in t["expr"] for t in p["targets"])]
    assert len(by_reason) >= 2
    for panel in by_reason:
        assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal", panel["title"]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_profile_in_use_has_its_fleet_and_pod_rows(ns: str) -> None:
    """The LMCache rows: hit vs requested tokens once per engine, the hit ratio from counters, remote bytes
    per shard, local CPU usage; the fleet row from the cluster:lmcache_ rules, the pod row from one sidecar."""
    rows = [p["title"] for p in dashboard(ns)["panels"] if p["type"] == "row"]
    lmcache_rows = [r for r in rows if "LMCache" in r]
    assert len(lmcache_rows) == 2 and lmcache_rows[0].startswith("Fleet") and lmcache_rows[1].startswith("Pod")
    exprs = " ".join(e for row, panel in sections(ns) if "LMCache" in row for e in (t["expr"] for t in panel["targets"]))
    for needed in ("cluster:lmcache_num_hit_tokens:rate5m", "cluster:lmcache_num_requested_tokens:rate5m",
                   "cluster:lmcache_retrieve_hit_rate:ratio_rate5m", "cluster:lmcache_num_remote_read_bytes:rate5m",
                   "cluster:lmcache_num_remote_write_bytes:rate5m", "lmcache_rollup_num_hit_tokens_total",
                   "lmcache_num_remote_read_bytes_total", "lmcache_local_cache_usage", "lmcache_rollup_local_cache_usage"):
        assert needed in exprs, needed
    # Where LMCache's prefill tokens come from, one stacked panel per server of its own variable, and what an
    # offload hit costs (seconds only: LMCache counts no bytes of a retrieve or a store).
    shares = next(panel for row, panel in sections(ns) if "LMCache" in row and panel.get("repeat"))
    assert shares["repeat"] == "lmcache_server"
    assert [(t["expr"], t["legendFormat"]) for t in shares["targets"]] == [
        ('cluster:lmcache_prefill_hit_ratio:ratio_rate5m{server=~"$lmcache_server"}', "{{tier}}"),
        ('cluster:lmcache_prefill_computed_ratio:ratio_rate5m{server=~"$lmcache_server"}', "computed")]
    assert shares["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "normal"
    assert 'cluster:lmcache_offload_seconds_per_hit_token:ratio_rate5m{server=~"$lmcache_server"}' in exprs
    variable = {v["name"]: v for v in dashboard(ns)["templating"]["list"]}["lmcache_server"]
    assert variable["query"]["query"] == "label_values(cluster:lmcache_num_prompt_tokens:rate5m, server)"
    own = ("lmcache_", "cluster:lmcache_", "dp_group:lmcache_", "hicache_exporter_", "process_")  # the guard's
    strays = {name for name in referenced_names(exprs)[0] if not name.startswith(own)}
    assert not strays, f"the LMCache rows read only the lmcache profile's names: {sorted(strays)}"
    # No sglang row reads an lmcache name, and no LMCache row a HiCache one.
    for row, panel in sections(ns):
        names = {m for t in panel["targets"] for m in referenced_names(t["expr"])[0]}
        if "LMCache" not in row:
            assert not any("lmcache_" in m for m in names), panel["title"]


def test_dashboard_expressions_are_plain_promql() -> None:
    for ns in NAMESPACES:
        exprs = dashboard_expressions(ns)
        assert len(exprs) == len(raw_expressions(ns)) > 0
        for expr in exprs:
            assert "$" not in expr.replace("$1", ""), expr
    with pytest.raises(KeyError):
        substitute("rate(x[$unknown])")
