"""Prometheus rules in config/prometheus/ (DESIGN §2, §6): promtool accepts them and their unit
tests pass, the recording rules follow the `level:metric:operations` naming contract, refer
only to catalog families, and cover every family the catalog says needs a cluster rollup.

The expected rule set is derived from the catalog, so adding a family without its rule fails
here. A generated promtool test then checks every family's rollup semantics, not only the
representative families of the hand-written tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalog import Catalog, FamilySpec, MetricType, Semantics, default_catalog
from tests.helpers import RawClient, SidecarThread, counter, hello, snapshot, wait_until

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "config" / "prometheus"
RECORDING = RULES_DIR / "recording_rules.yml"
ALERTING = RULES_DIR / "alerting_rules.yml"
RULE_FILES = [RECORDING, ALERTING]
TEST_FILES = [RULES_DIR / "tests" / "recording_rules_test.yml", RULES_DIR / "tests" / "alerting_rules_test.yml"]

NAMESPACE = "sglang_"
SELF_PREFIX = "hicache_exporter_"
RECORD_NAME_RE = re.compile(r"^[a-z_]+:[a-zA-Z0-9_]+:[a-z0-9_]+$")


def promtool() -> str:
    """The promtool binary; missing promtool is a failure, never a skip (README: `make test` needs it)."""
    path = shutil.which("promtool") or ("/usr/bin/promtool" if Path("/usr/bin/promtool").exists() else None)
    if path is None:
        pytest.fail("promtool not found on PATH: install the Debian package `prometheus` (see README)")
    return path


def run_promtool(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, (
        f"promtool {' '.join(args)} exited {result.returncode}\n"
        f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
    )
    return result


def load_rules(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as handle:
        data = yaml.safe_load(handle)
    return [rule for group in data["groups"] for rule in group["rules"]]


def recorded_names() -> list[str]:
    return [rule["record"] for rule in load_rules(RECORDING) if "record" in rule]


# ---- what the catalog says must exist ----------------------------------------------------


def counters(catalog: Catalog, semantics: Semantics) -> list[FamilySpec]:
    return [f for f in catalog if f.type is MetricType.COUNTER and f.semantics is semantics]


def expected_records(catalog: Catalog) -> set[str]:
    """Every recording rule name the contract promises (header of config/prometheus/recording_rules.yml)."""
    names: set[str] = set()
    for fam in counters(catalog, Semantics.PER_SHARD):
        names.add(f"cluster:{NAMESPACE}{fam.base_name}:rate5m")
    for fam in counters(catalog, Semantics.REPLICATED):
        names.add(f"dp_group:{NAMESPACE}{fam.base_name}:rate5m")
        names.add(f"cluster:{NAMESPACE}{fam.base_name}:rate5m")
    for bytes_fam, hist in catalog.bandwidth_pairs():
        names.add(f"cluster:{NAMESPACE}{hist.name}_sum:rate5m")
        names.add(f"cluster:{NAMESPACE}{bytes_fam.bandwidth_name}:ratio_rate5m")
    return names


# ---- promtool ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", RULE_FILES, ids=lambda p: p.name)
def test_promtool_check_rules(path: Path) -> None:
    result = run_promtool("check", "rules", str(path))
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    result = run_promtool("test", "rules", str(path))
    assert "SUCCESS" in result.stdout


# ---- naming, references, coverage ----------------------------------------------------------


def test_recording_rule_names_follow_level_metric_operations() -> None:
    names = recorded_names()
    assert names, "no recording rules found"
    bad = [n for n in names if not RECORD_NAME_RE.match(n)]
    assert not bad, f"recording rule names not of the form level:metric:operations: {bad}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"recording rules defined twice: {repeated}"


def test_recording_rules_cover_the_catalog_exactly() -> None:
    catalog = default_catalog()
    expected = expected_records(catalog)
    actual = set(recorded_names())
    missing = sorted(expected - actual)
    extra = sorted(actual - expected)
    assert not missing, f"catalog families without their recording rule: {missing}"
    assert not extra, f"recording rules outside the naming contract (update the contract and this test): {extra}"
    # The contract as the dashboard and the brief state it, pinned so a catalog change that
    # silently dropped one of these shows up here too.
    for x in ("load_back", "hicache_backup", "storage_prefetch", "storage_backup"):
        assert f"cluster:sglang_{x}_active_bandwidth_bytes_per_second:ratio_rate5m" in actual
        assert f"cluster:sglang_{x}_bytes:rate5m" in actual
    for base in ("storage_prefetch_unfulfilled_tokens", "storage_prefetch_deferred_tokens", "hicache_dropped_tokens"):
        assert f"dp_group:sglang_{base}:rate5m" in actual and f"cluster:sglang_{base}:rate5m" in actual


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NAME_REGEX = re.compile(r"__name__\s*=~\s*\"((?:[^\"\\]|\\.)*)\"")


def exported_names(catalog: Catalog) -> dict[str, str]:
    """Every series name the sidecar exports per rank, mapped to its catalog family."""
    names: dict[str, str] = {}
    for fam in catalog:
        if fam.type is MetricType.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[NAMESPACE + fam.name + suffix] = fam.name
        else:
            names[NAMESPACE + fam.name] = fam.name
        if fam.type is MetricType.COUNTER and fam.semantics is Semantics.REPLICATED:
            names[NAMESPACE + fam.base_name + "_replica_spread_ratio"] = fam.name
        if fam.duration_histogram:
            names[NAMESPACE + fam.bandwidth_name] = fam.name
    return names


def references(expr: str) -> tuple[set[str], list[str]]:
    """(series names an expression selects by name, regexes it matches __name__ against)."""
    regexes = _NAME_REGEX.findall(expr)
    bare = _STRING.sub('""', expr)
    return set(_IDENT.findall(bare)), regexes


def test_rules_reference_only_catalog_families_and_self_metrics() -> None:
    catalog = default_catalog()
    exported = exported_names(catalog)
    records = set(recorded_names())
    family_names = {f.name for f in catalog}
    problems: list[str] = []
    seen_families: set[str] = set()
    for path in RULE_FILES:
        for rule in load_rules(path):
            what = f"{path.name}: {rule.get('record') or rule.get('alert')}"
            idents, regexes = references(rule["expr"])
            for ident in idents:
                if ":" in ident:
                    if ident not in records:
                        problems.append(f"{what}: refers to {ident}, which no recording rule records")
                elif ident.startswith(NAMESPACE):
                    if ident in exported:
                        seen_families.add(exported[ident])
                    else:
                        problems.append(f"{what}: {ident} is not a series of any catalog family")
                elif ident in family_names:
                    problems.append(f"{what}: {ident} lacks the {NAMESPACE!r} namespace")
            for regex in regexes:
                matched = [n for n in exported if re.fullmatch(regex, n)]
                if not matched:
                    problems.append(f"{what}: __name__=~{regex!r} matches no catalog series")
                seen_families.update(exported[n] for n in matched)
    assert not problems, "\n".join(problems)
    # Every counter with a rollup rule is actually read by one.
    needed = {f.name for f in counters(catalog, Semantics.PER_SHARD) + counters(catalog, Semantics.REPLICATED)}
    needed |= {hist.name for _, hist in catalog.bandwidth_pairs()}
    assert needed <= seen_families, f"families no rule reads: {sorted(needed - seen_families)}"


def test_rules_select_names_and_labels_a_real_sidecar_serves(sidecar: SidecarThread) -> None:
    """The series and label values the rules select are what /metrics really exposes."""
    client = RawClient(sidecar.socket_path)
    try:
        client.send(hello(tp=0, cache_type="HiRadixCache"))
        assert client.recv() is not None
        client.send(snapshot(1, counter("load_back_bytes_total", 4096)))
        wait_until(lambda: bool(sidecar.scrape().find("hicache_exporter_rank_up", tp_rank="0")))
        scrape = sidecar.scrape()
    finally:
        client.close()
    served: set[str] = set()
    for family in text_string_to_metric_families(scrape.text):
        served.add(family.name)
        served.update({"counter": [family.name + "_total"],
                       "histogram": [family.name + s for s in ("_sum", "_count", "_bucket")]}.get(family.type, []))
        served.update(sample.name for sample in family.samples)
    missing = []
    for path in RULE_FILES:
        for rule in load_rules(path):
            idents, regexes = references(rule["expr"])
            for ident in idents:
                if ident.startswith((NAMESPACE, SELF_PREFIX)) and ":" not in ident and ident not in served:
                    missing.append(f"{path.name}: {rule.get('record') or rule.get('alert')}: {ident}")
            for regex in regexes:
                if not any(re.fullmatch(regex, name) for name in served):
                    missing.append(f"{path.name}: {rule.get('alert')}: nothing served matches {regex!r}")
    assert not missing, "rules select series the sidecar does not serve:\n" + "\n".join(missing)
    # Labels the rules aggregate away or filter on are on the served series.
    per_rank = scrape.find("sglang_load_back_bytes_total")
    assert per_rank and {"tp_rank", "pp_rank", "dp_rank", "cache_type"} <= set(per_rank[0].labels)
    assert scrape.find("hicache_exporter_rejections_total", reason="old_seq"), "old_seq is not a rejection reason"
    assert {"tp_rank", "pp_rank", "dp_rank"} <= set(scrape.find("hicache_exporter_rank_up")[0].labels)


def test_replica_spread_alert_selects_exactly_the_spread_gauges() -> None:
    catalog = default_catalog()
    exported = exported_names(catalog)
    rule = next(r for r in load_rules(ALERTING) if r.get("alert") == "HiCacheReplicaSpreadHigh")
    _, regexes = references(rule["expr"])
    assert len(regexes) == 1
    matched = {n for n in exported if re.fullmatch(regexes[0], n)}
    spread = {NAMESPACE + f.base_name + "_replica_spread_ratio" for f in counters(catalog, Semantics.REPLICATED)}
    assert matched == spread


def test_alerts_have_for_severity_and_annotations() -> None:
    alerts = [r for r in load_rules(ALERTING) if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"HiCacheRankDown", "HiCacheReplicaSpreadHigh", "HiCacheExporterRejecting"}
    for alert in alerts:
        assert alert.get("for"), f"{alert['alert']}: no `for:` duration"
        assert alert.get("labels", {}).get("severity") in {"info", "warning", "critical"}, alert["alert"]
        annotations = alert.get("annotations", {})
        assert annotations.get("summary") and annotations.get("description"), alert["alert"]


# ---- every family's semantics, checked by promtool on generated series -----------------------

# One TP group of four ranks spanning two pods (dp 0), and a second dp group of four ranks in a
# third pod (dp 1). Layout: (pod, instance, tp_rank, dp_rank).
LAYOUT = [
    ("srv-a", "10.0.0.1:9400", 0, 0),
    ("srv-a", "10.0.0.1:9400", 1, 0),
    ("srv-b", "10.0.0.2:9400", 2, 0),
    ("srv-b", "10.0.0.2:9400", 3, 0),
    ("srv-c", "10.0.0.3:9400", 0, 1),
    ("srv-c", "10.0.0.3:9400", 1, 1),
    ("srv-c", "10.0.0.3:9400", 2, 1),
    ("srv-c", "10.0.0.3:9400", 3, 1),
]
KEPT = {"job": "hicache", "namespace": "llm", "cache_type": "HiRadixCache"}


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _own_labels(fam: FamilySpec) -> dict[str, str]:
    return {label: (fam.preset.get(label) or ("x",))[0] for label in fam.labels}


def generated_tests(catalog: Catalog) -> dict:
    """Series for every rolled-up family over LAYOUT, with the exact rollups they must give.

    rate(...[5m]) at 10m of a counter rising 60*k per minute is exactly k.
    Replicated: every replica of dp 0 rises at 1/s, of dp 1 at 2/s: dp_group 1 and 2, cluster 3.
    Per-shard: rank i (0..7) rises at (i+1)/s: cluster 36. Paired durations: 15 s per minute on
    every rank (0.25 s/s): cluster 2, active bandwidth 36 / 2 = 18.
    """
    inputs: list[dict] = []
    checks: list[dict] = []

    def sample(record: str, value: float, **extra: str) -> dict:
        return {"labels": _series(record, {**KEPT, **extra}), "value": value}

    def check(record: str, samples: list[dict]) -> None:
        checks.append({"expr": record, "eval_time": "10m", "exp_samples": samples})

    for fam in counters(catalog, Semantics.REPLICATED):
        own = _own_labels(fam)
        for pod, instance, tp, dp in LAYOUT:
            labels = {**KEPT, **own, "pod": pod, "instance": instance, "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
            inputs.append({"series": _series(NAMESPACE + fam.name, labels), "values": f"0+{60 * (dp + 1)}x10"})
        dp_group = f"dp_group:{NAMESPACE}{fam.base_name}:rate5m"
        check(dp_group, [sample(dp_group, 1, **own, dp_rank="0"), sample(dp_group, 2, **own, dp_rank="1")])
        cluster = f"cluster:{NAMESPACE}{fam.base_name}:rate5m"
        check(cluster, [sample(cluster, 3, **own)])

    per_shard = counters(catalog, Semantics.PER_SHARD)
    durations = [hist for _, hist in catalog.bandwidth_pairs()]
    for fam in per_shard:
        own = _own_labels(fam)
        for i, (pod, instance, tp, dp) in enumerate(LAYOUT):
            labels = {**KEPT, **own, "pod": pod, "instance": instance, "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
            inputs.append({"series": _series(NAMESPACE + fam.name, labels), "values": f"0+{60 * (i + 1)}x10"})
        record = f"cluster:{NAMESPACE}{fam.base_name}:rate5m"
        check(record, [sample(record, 36, **own)])
    for hist in durations:
        own = _own_labels(hist)
        for pod, instance, tp, dp in LAYOUT:
            labels = {**KEPT, **own, "pod": pod, "instance": instance, "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
            inputs.append({"series": _series(f"{NAMESPACE}{hist.name}_sum", labels), "values": "0+15x10"})
        record = f"cluster:{NAMESPACE}{hist.name}_sum:rate5m"
        check(record, [sample(record, 2, **own)])
    for bytes_fam, _ in catalog.bandwidth_pairs():
        record = f"cluster:{NAMESPACE}{bytes_fam.bandwidth_name}:ratio_rate5m"
        check(record, [sample(record, 18, **_own_labels(bytes_fam))])

    return {
        "rule_files": [str(RECORDING)],
        "evaluation_interval": "1m",
        "tests": [{"name": "every catalog family, generated", "interval": "1m",
                   "input_series": inputs, "promql_expr_test": checks}],
    }


def test_every_family_rolls_up_by_its_semantics(tmp_path: Path) -> None:
    catalog = default_catalog()
    spec = generated_tests(catalog)
    checked = {c["expr"] for c in spec["tests"][0]["promql_expr_test"]}
    assert checked == expected_records(catalog)
    path = tmp_path / "generated_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    run_promtool("test", "rules", str(path), cwd=tmp_path)
