"""Prometheus rules in config/prometheus/: promtool accepts them and their unit tests pass, the
recording rules follow the `level:metric:operations` naming contract, refer only to catalog
families, and cover every family the catalog says needs a cluster rollup.

The rules are generated per metric namespace (config/generate.py): the committed files are the
default namespace's, and every check here also runs on the set generated for `sglang:`. Both sets
cover every packaged profile (sglang under the namespace given, lmcache under `lmcache_`). The
expected rule set is derived from the profiles' catalogs independently of the generator, so a
family without its rule fails here. A generated promtool test then checks every family's rollup
semantics, not only the representative families of the hand-written tests."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from config.generator import DEFAULT_NAMESPACE, outputs
from exporter.catalog import Catalog, FamilySpec, MetricType, Semantics, default_catalog, load_profile, load_profiles
from tests.helpers import RawClient, SidecarThread, counter, hello, sidecar_config, snapshot, wait_until

REPO = Path(__file__).resolve().parents[2]
RULES_DIR = REPO / "config" / "prometheus"
RECORDING = RULES_DIR / "recording_rules.yml"
ALERTING = RULES_DIR / "alerting_rules.yml"
TEST_FILES = [RULES_DIR / "tests" / "recording_rules_test.yml", RULES_DIR / "tests" / "alerting_rules_test.yml",
              RULES_DIR / "tests" / "sidecar_restart_test.yml",  # increase() of a rollup across a sidecar restart
              RULES_DIR / "tests" / "lmcache_rules_test.yml",  # the lmcache profile's groups
              RULES_DIR / "tests" / "prefill_tiers_test.yml"]  # tier shares, cost per hit token, HiCacheTierNotPaying

NAMESPACES = [DEFAULT_NAMESPACE, "sglang:"]
SELF_PREFIX = "hicache_exporter_"
# The profiles besides the default one that the generator covers, with their own namespaces, and the
# hit ratios each promises: (gauge, hits counter, asked counter), written here from LMCache 0.5.6
# (observability.py:683-701), not read from the generator.
LMCACHE_NS = "lmcache_"
OTHER_NAMESPACES = {"lmcache": LMCACHE_NS}
HIT_RATIOS = {"lmcache": [("retrieve_hit_rate", "num_hit_tokens_total", "num_requested_tokens_total"),
                          ("lookup_hit_rate", "num_lookup_hits_total", "num_lookup_tokens_total")]}
# Where a profile's prefill tokens come from (issue 32), written here from SGLang 0.5.23
# (metrics_collector.py:1040-1053: input computed, <tier>_hit by tier): its per-tier counter, the label, and
# each mode's tier (None: computed). A tier returns its own hits and those of the tiers below it, staged
# through it (schedule_batch.py:231-265): the cost of each tier, (record part, what it divides).
PREFILL = {"sglang": ("prefill_effective_tokens_total", "mode",
                      {"input": None, "device_hit": "device", "host_hit": "host", "storage_hit": "storage"})}
TIER_RETURNS = {"host": ("host_hit", "storage_hit"), "storage": ("storage_hit",)}
# (tier, cost): the numerator, a bytes counter ("bytes") or a duration histogram's _sum ("seconds").
TIER_COSTS = [("host", "bytes", "bytes"), ("host", "seconds", "seconds"), ("host", "backup_bytes", "bytes"),
              ("storage", "bytes", "bytes"), ("storage", "seconds", "seconds"), ("storage", "backup_bytes", "bytes")]
# A profile that counts the prompt apart, written here from LMCache 0.5.6 under vLLM: its prompt's counter and each
# tier's (vLLM's own GPU prefix hits, vllm_v1_adapter.py:799-806; LMCache's retrieve hits, cache_engine.py:966-970,
# its CPU and remote backends together: `offload`); every prefill token is the prompt as counted or the hits,
# whichever is more, and what the hits leave of it was computed.
PROMPT_APART = {"lmcache": ("num_prompt_tokens_total", {"device": "num_vllm_hit_tokens_total",
                                                        "offload": "num_hit_tokens_total"})}
# Its one cost: the seconds of the transfer that reads the offload tier back (retrieve, L2→L1; LMCache counts no
# bytes of it), a histogram no bytes counter pairs, whose `_sum` gets a cluster rate of its own for it.
READ_SECONDS = {"lmcache": [("offload", "time_to_retrieve")]}


def profiles_in_use() -> list[tuple[Catalog, str | None]]:
    """(a profile's catalog, its namespace; None for the default profile's, which is the namespace given)."""
    return [(default_catalog(), None), *((load_profile(name), ns) for name, ns in OTHER_NAMESPACES.items())]


def namespaces(ns: str) -> list[str]:
    """Every namespace the rule set generated for `ns` uses."""
    return [ns, *OTHER_NAMESPACES.values()]


def record_name_re(ns: str) -> re.Pattern[str]:
    """`level:<ns>metric:operations` for any namespace in use; the namespace may itself hold a colon (`sglang:`)."""
    either = "|".join(re.escape(n) for n in namespaces(ns))
    return re.compile(rf"^(cluster|dp_group):({either})[a-z0-9_]+:(rate5m|ratio_rate5m)$")


@pytest.fixture(scope="module")
def rule_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """(recording, alerting) for each namespace: the committed files, and the `sglang:` set generated."""
    files = {DEFAULT_NAMESPACE: (RECORDING, ALERTING)}
    for ns in NAMESPACES[1:]:
        directory = tmp_path_factory.mktemp("rules")
        paths = []
        for name in ("recording_rules.yml", "alerting_rules.yml"):
            path = directory / name
            path.write_text(outputs(ns)[f"prometheus/{name}"], encoding="utf-8")
            paths.append(path)
        files[ns] = (paths[0], paths[1])
    return files


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


def recorded_names(path: Path = RECORDING) -> list[str]:
    return [rule["record"] for rule in load_rules(path) if "record" in rule]


# ---- what the catalog says must exist ----------------------------------------------------


def counters(catalog: Catalog, semantics: Semantics) -> list[FamilySpec]:
    return [f for f in catalog if f.type is MetricType.COUNTER and f.semantics is semantics]


def expected_records(catalog: Catalog, ns: str = DEFAULT_NAMESPACE, profile: str | None = None) -> set[str]:
    """Every recording rule name the contract promises (header of config/prometheus/recording_rules.yml),
    for one profile's catalog under `ns`; `profile` names a profile whose hit ratios are promised too."""
    names: set[str] = set()
    for fam in counters(catalog, Semantics.PER_SHARD) + counters(catalog, Semantics.PER_ENGINE):
        names.add(f"cluster:{ns}{fam.base_name}:rate5m")
    for fam in counters(catalog, Semantics.REPLICATED):
        names.add(f"dp_group:{ns}{fam.base_name}:rate5m")
        names.add(f"cluster:{ns}{fam.base_name}:rate5m")
    for bytes_fam, hist in catalog.bandwidth_pairs():
        names.add(f"cluster:{ns}{hist.name}_sum:rate5m")
        names.add(f"cluster:{ns}{bytes_fam.bandwidth_name}:ratio_rate5m")
    for gauge, _, _ in HIT_RATIOS.get(profile or "", []):
        names.add(f"cluster:{ns}{gauge}:ratio_rate5m")
    shares = {f"cluster:{ns}prefill_hit_ratio:ratio_rate5m", f"dp_group:{ns}prefill_hit_ratio:ratio_rate5m",
              f"cluster:{ns}prefill_computed_ratio:ratio_rate5m"}
    if profile in PREFILL and PREFILL[profile][0] in {f.name for f in catalog}:
        names |= shares
        names |= {f"cluster:{ns}{tier}_{cost}_per_hit_token:ratio_rate5m" for tier, cost, _ in TIER_COSTS}
    if profile in PROMPT_APART and {PROMPT_APART[profile][0], *PROMPT_APART[profile][1].values()} <= {f.name for f in catalog}:
        names |= shares
        for tier, hist in READ_SECONDS[profile]:
            names |= {f"cluster:{ns}{hist}_sum:rate5m", f"cluster:{ns}{tier}_seconds_per_hit_token:ratio_rate5m"}
    return names


def all_expected_records(ns: str) -> set[str]:
    """The contract over every profile in use, each under its namespace."""
    return set().union(*(expected_records(catalog, own or ns, catalog.default_profile.name)
                         for catalog, own in profiles_in_use()))


# ---- promtool ------------------------------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_promtool_check_rules(ns: str, rule_files: dict[str, tuple[Path, Path]]) -> None:
    for path in rule_files[ns]:
        result = run_promtool("check", "rules", str(path))
        assert "SUCCESS" in result.stdout


def test_every_promtool_test_file_is_run() -> None:
    assert sorted(TEST_FILES) == sorted((RULES_DIR / "tests").glob("*.yml"))


@pytest.mark.parametrize("path", TEST_FILES, ids=lambda p: p.name)
def test_promtool_unit_tests(path: Path) -> None:
    result = run_promtool("test", "rules", str(path))
    assert "SUCCESS" in result.stdout


# ---- naming, references, coverage ----------------------------------------------------------


@pytest.mark.parametrize("ns", NAMESPACES)
def test_recording_rule_names_follow_level_metric_operations(ns: str, rule_files: dict[str, tuple[Path, Path]]) -> None:
    names = recorded_names(rule_files[ns][0])
    assert names, "no recording rules found"
    assert not record_name_re(ns).match(f"cluster:{ns}load_back_bytes:rate1m"), "the check can fail"
    bad = [n for n in names if not record_name_re(ns).match(n)]
    assert not bad, f"recording rule names not of the form level:metric:operations: {bad}"
    repeated = sorted({n for n in names if names.count(n) > 1})
    assert not repeated, f"recording rules defined twice: {repeated}"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_recording_rules_cover_the_catalog_exactly(ns: str, rule_files: dict[str, tuple[Path, Path]]) -> None:
    expected = all_expected_records(ns)
    actual = set(recorded_names(rule_files[ns][0]))
    missing = sorted(expected - actual)
    extra = sorted(actual - expected)
    assert not missing, f"catalog families without their recording rule: {missing}"
    assert not extra, f"recording rules outside the naming contract (update the contract and this test): {extra}"
    # The contract as the dashboard and the brief state it, pinned so a catalog change that
    # silently dropped one of these shows up here too.
    for x in ("load_back", "hicache_backup", "storage_prefetch", "storage_backup"):
        assert f"cluster:{ns}{x}_active_bandwidth_bytes_per_second:ratio_rate5m" in actual
        assert f"cluster:{ns}{x}_bytes:rate5m" in actual
    for base in ("storage_prefetch_unfulfilled_tokens", "storage_prefetch_deferred_tokens", "hicache_dropped_tokens"):
        assert f"dp_group:{ns}{base}:rate5m" in actual and f"cluster:{ns}{base}:rate5m" in actual
    # The lmcache profile's, under its own namespace whatever the default one's.
    for base in ("num_hit_tokens", "num_requested_tokens", "num_lookup_hits", "num_stored_tokens"):
        assert f"dp_group:lmcache_{base}:rate5m" in actual and f"cluster:lmcache_{base}:rate5m" in actual
    for base in ("num_remote_read_bytes", "num_remote_write_bytes", "local_cpu_evict_count"):
        assert f"cluster:lmcache_{base}:rate5m" in actual and f"dp_group:lmcache_{base}:rate5m" not in actual
    assert {"cluster:lmcache_retrieve_hit_rate:ratio_rate5m", "cluster:lmcache_lookup_hit_rate:ratio_rate5m"} <= actual


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_IDENT = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_NAME_REGEX = re.compile(r"__name__\s*=~\s*\"((?:[^\"\\]|\\.)*)\"")


def exported_names(catalog: Catalog, ns: str = DEFAULT_NAMESPACE) -> dict[str, str]:
    """Every series name the sidecar exports per rank, mapped to its catalog family (`ns`: the default
    profile's namespace; another profile's families take their own)."""
    names: dict[str, str] = {}
    for fam in catalog:
        ns = catalog.namespace_of(fam, ns)
        if fam.type is MetricType.HISTOGRAM:
            for suffix in ("_bucket", "_sum", "_count"):
                names[ns + fam.name + suffix] = fam.name
        else:
            names[ns + fam.name] = fam.name
        if fam.type is MetricType.COUNTER and fam.semantics is Semantics.REPLICATED:
            names[ns + fam.base_name + "_replica_spread_ratio"] = fam.name
        if fam.duration_histogram:
            names[ns + fam.bandwidth_name] = fam.name
    return names


def references(expr: str) -> tuple[set[str], list[str]]:
    """(series names an expression selects by name, regexes it matches __name__ against)."""
    regexes = _NAME_REGEX.findall(expr)
    bare = _STRING.sub('""', expr)
    return set(_IDENT.findall(bare)), regexes


RECORD_LEVELS = ("cluster:", "dp_group:")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_rules_reference_only_catalog_families_and_self_metrics(ns: str, rule_files: dict[str, tuple[Path, Path]]) -> None:
    catalog = load_profiles(None, list(OTHER_NAMESPACES))
    exported = exported_names(catalog, ns)
    records = set(recorded_names(rule_files[ns][0]))
    family_names = {f.name for f in catalog}
    problems: list[str] = []
    seen_families: set[str] = set()
    for path in rule_files[ns]:
        for rule in load_rules(path):
            what = f"{path.name}: {rule.get('record') or rule.get('alert')}"
            idents, regexes = references(rule["expr"])
            for ident in idents:
                if ident.startswith(RECORD_LEVELS):
                    if ident not in records:
                        problems.append(f"{what}: refers to {ident}, which no recording rule records")
                elif ident.startswith(tuple(namespaces(ns))):
                    if ident in exported:
                        seen_families.add(exported[ident])
                    else:
                        problems.append(f"{what}: {ident} is not a series of any catalog family")
                elif ident in family_names or any(ident.startswith(other) for other in NAMESPACES):
                    problems.append(f"{what}: {ident} lacks the {ns!r} namespace")
            for regex in regexes:
                matched = [n for n in exported if re.fullmatch(regex, n)]
                if not matched:
                    problems.append(f"{what}: __name__=~{regex!r} matches no catalog series")
                seen_families.update(exported[n] for n in matched)
    assert not problems, "\n".join(problems)
    # Every counter with a rollup rule is actually read by one.
    needed = {f.name for semantics in Semantics for f in counters(catalog, semantics)}
    needed |= {hist.name for _, hist in catalog.bandwidth_pairs()}
    assert needed <= seen_families, f"families no rule reads: {sorted(needed - seen_families)}"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_rules_select_names_and_labels_a_real_sidecar_serves(ns: str, socket_dir: Path,
                                                             rule_files: dict[str, tuple[Path, Path]]) -> None:
    """The series and label values the rules select are what /metrics really exposes, in each namespace
    (a sidecar with a state file, as every generated pod runs it: its persistence families are served)."""
    sidecar = SidecarThread(sidecar_config(socket_dir / "metrics.sock", metrics={"namespace": ns, "profiles": ["lmcache"]},
                                           persistence={"file": str(socket_dir / "state")})).start()
    try:
        client = RawClient(sidecar.socket_path)
        # An LMCache worker as the push door sends it: its stream marked by `role`, worker_id derived.
        worker = RawClient(sidecar.socket_path)
        try:
            worker.send(hello(tp=1, role="worker", model_name="llama", served_model_name="llama", worker_id="1"))
            assert worker.recv() is not None
            worker.send(snapshot(1, counter("num_hit_tokens_total", 256)))
            # A world of two tp ranks, tp 1 never connecting: ranks_missing (HiCacheRankMissing) is served.
            client.send({**hello(tp=0, cache_type="HiRadixCache", model_name="llama"),
                         "world": {"tp_size": 2, "pp_size": 1, "dp_size": 1}})
            assert client.recv() is not None
            client.send(snapshot(1, counter("load_back_bytes_total", 4096)))
            wait_until(lambda: bool(sidecar.scrape().find("hicache_exporter_rank_up", tp_rank="0"))
                       and bool(sidecar.scrape().find(f"{LMCACHE_NS}num_hit_tokens_total")))
            scrape = sidecar.scrape()
        finally:
            client.close()
            worker.close()
    finally:
        sidecar.stop()
    served: set[str] = set()
    for family in text_string_to_metric_families(scrape.text):
        served.add(family.name)
        served.update({"counter": [family.name + "_total"],
                       "histogram": [family.name + s for s in ("_sum", "_count", "_bucket")]}.get(family.type, []))
        served.update(sample.name for sample in family.samples)
    missing = []
    for path in rule_files[ns]:
        for rule in load_rules(path):
            idents, regexes = references(rule["expr"])
            for ident in idents:
                if ident.startswith((*namespaces(ns), SELF_PREFIX)) and not ident.startswith(RECORD_LEVELS) \
                        and ident not in served:
                    missing.append(f"{path.name}: {rule.get('record') or rule.get('alert')}: {ident}")
            for regex in regexes:
                if not any(re.fullmatch(regex, name) for name in served):
                    missing.append(f"{path.name}: {rule.get('alert')}: nothing served matches {regex!r}")
    assert not missing, "rules select series the sidecar does not serve:\n" + "\n".join(missing)
    # Labels the rules aggregate away or filter on are on the served series.
    per_rank = scrape.find(f"{ns}load_back_bytes_total")
    assert per_rank and {"tp_rank", "pp_rank", "dp_rank", "cache_type"} <= set(per_rank[0].labels)
    # The lmcache rules drop the rank axes and worker_id, and keep role, model_name and served_model_name.
    (worker_series,) = scrape.find(f"{LMCACHE_NS}num_hit_tokens_total")
    assert worker_series.labels == {"tp_rank": "1", "pp_rank": "0", "dp_rank": "0", "worker_id": "1", "role": "worker",
                                    "model_name": "llama", "served_model_name": "llama"}
    assert scrape.find("hicache_exporter_rejections_total", reason="old_seq"), "old_seq is not a rejection reason"
    assert {"tp_rank", "pp_rank", "dp_rank"} <= set(scrape.find("hicache_exporter_rank_up")[0].labels)
    # One series per expected dp group, by the server's labels (the collector's cache_type left out).
    assert [(s.labels, s.value) for s in scrape.find("hicache_exporter_ranks_missing")] == [
        ({"model_name": "llama", "dp_rank": "0"}, 1.0)]


@pytest.mark.parametrize("ns", NAMESPACES)
def test_replica_spread_alert_selects_exactly_the_spread_gauges(ns: str, rule_files: dict[str, tuple[Path, Path]]) -> None:
    catalog = default_catalog()
    exported = {**exported_names(catalog, ns), **{n: "" for other in NAMESPACES if other != ns
                                                  for n in exported_names(catalog, other)}}
    rule = next(r for r in load_rules(rule_files[ns][1]) if r.get("alert") == "HiCacheReplicaSpreadHigh")
    _, regexes = references(rule["expr"])
    assert len(regexes) == 1
    matched = {n for n in exported if re.fullmatch(regexes[0], n)}
    spread = {ns + f.base_name + "_replica_spread_ratio" for f in counters(catalog, Semantics.REPLICATED)}
    assert matched == spread, "the spread gauges of this namespace, and no other's"
    lmcache = exported_names(load_profile("lmcache"), LMCACHE_NS)
    assert not {n for n in lmcache if re.fullmatch(regexes[0], n)}, "the alert covers the default profile only"


def test_alerts_have_for_severity_and_annotations() -> None:
    alerts = [r for r in load_rules(ALERTING) if "alert" in r]
    assert {a["alert"] for a in alerts} >= {"HiCacheRankDown", "HiCacheRankMissing", "HiCacheReplicaSpreadHigh",
                                          "HiCacheExporterRejecting"}
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


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def _own_labels(fam: FamilySpec) -> dict[str, str]:
    return {label: (fam.preset.get(label) or ("x",))[0] for label in fam.labels}


# Each profile's own labels on every series, kept by the rules; and its derived labels, functions of the
# rank (generated from tp_rank here), which the rules drop with the rank axes.
PROFILE_KEPT = {"sglang": {"cache_type": "HiRadixCache"},
                "lmcache": {"role": "worker", "model_name": "llama", "served_model_name": "llama"}}
PROFILE_DERIVED = {"sglang": (), "lmcache": ("worker_id",)}


def generated_tests(catalog: Catalog, ns: str = DEFAULT_NAMESPACE, recording: Path = RECORDING,
                    profile: str = "sglang") -> dict:
    """Series for every rolled-up family of one profile's catalog over LAYOUT, with the exact rollups they must give.

    rate(...[5m]) at 10m of a counter rising 60*k per minute is exactly k.
    Replicated: the i-th replicated family has m = 1 + i % 3; every replica of dp 0 rises at m/s, of
    dp 1 at 2m/s: dp_group m and 2m, cluster 3m; a hit ratio is its two families' m over m.
    Per-shard and per-engine: rank i (0..7) rises at (i+1)/s: cluster 36. Paired durations: 15 s per
    minute on every rank (0.25 s/s): cluster 2, active bandwidth 36 / 2 = 18.
    """
    inputs: list[dict] = []
    checks: list[dict] = []
    kept = {"job": "hicache", "namespace": "llm", **PROFILE_KEPT[profile]}

    def rank_labels(fam: FamilySpec, pod: str, instance: str, tp: int, dp: int) -> dict[str, str]:
        derived = {label: str(tp) for label in PROFILE_DERIVED[profile]}
        return {**kept, **_own_labels(fam), **derived, "pod": pod, "instance": instance, "tp_rank": str(tp),
                "pp_rank": "0", "dp_rank": str(dp)}

    def sample(record: str, value: float, **extra: str) -> dict:
        return {"labels": _series(record, {**kept, **extra}), "value": value}

    def check(record: str, samples: list[dict]) -> None:
        checks.append({"expr": record, "eval_time": "10m", "exp_samples": samples})

    pace: dict[str, int] = {}
    prefill_family, mode_label, modes = PREFILL.get(profile, ("", "", {}))
    mode_pace: dict[str, int] = {}
    for i, fam in enumerate(counters(catalog, Semantics.REPLICATED)):
        pace[fam.name] = m = 1 + i % 3
        # The prefill counter counts every mode, each at its own pace (the computed one at m).
        owns = [_own_labels(fam)]
        if fam.name == prefill_family:
            mode_pace = {mode: (m if tier is None else 1 + j) for j, (mode, tier) in enumerate(modes.items())}
            owns = [{**_own_labels(fam), mode_label: mode} for mode in modes]
        dp_group = f"dp_group:{ns}{fam.base_name}:rate5m"
        cluster = f"cluster:{ns}{fam.base_name}:rate5m"
        groups, clusters = [], []
        for own in owns:
            k = mode_pace.get(own.get(mode_label, ""), m) if fam.name == prefill_family else m
            for pod, instance, tp, dp in LAYOUT:
                inputs.append({"series": _series(ns + fam.name, {**rank_labels(fam, pod, instance, tp, dp), **own}),
                               "values": f"0+{60 * k * (dp + 1)}x10"})
            groups += [sample(dp_group, k, **own, dp_rank="0"), sample(dp_group, 2 * k, **own, dp_rank="1")]
            clusters.append(sample(cluster, 3 * k, **own))
        check(dp_group, groups)
        check(cluster, clusters)
    for gauge, hits, asked in HIT_RATIOS.get(profile, []):
        record = f"cluster:{ns}{gauge}:ratio_rate5m"
        check(record, [sample(record, pace[hits] / pace[asked])])

    summed = counters(catalog, Semantics.PER_SHARD) + counters(catalog, Semantics.PER_ENGINE)
    durations = [hist for _, hist in catalog.bandwidth_pairs()]
    for fam in summed:
        own = _own_labels(fam)
        for i, (pod, instance, tp, dp) in enumerate(LAYOUT):
            inputs.append({"series": _series(ns + fam.name, rank_labels(fam, pod, instance, tp, dp)),
                           "values": f"0+{60 * (i + 1)}x10"})
        record = f"cluster:{ns}{fam.base_name}:rate5m"
        check(record, [sample(record, 36, **own)])
    for hist in durations:
        own = _own_labels(hist)
        for pod, instance, tp, dp in LAYOUT:
            inputs.append({"series": _series(f"{ns}{hist.name}_sum", rank_labels(hist, pod, instance, tp, dp)),
                           "values": "0+15x10"})
        record = f"cluster:{ns}{hist.name}_sum:rate5m"
        check(record, [sample(record, 2, **own)])
    for bytes_fam, _ in catalog.bandwidth_pairs():
        record = f"cluster:{ns}{bytes_fam.bandwidth_name}:ratio_rate5m"
        check(record, [sample(record, 18, **_own_labels(bytes_fam))])

    if mode_pace:
        # Shares of every mode's cluster rate (3 x its pace); costs: a summed family's cluster rate (36) or
        # a duration's (2) over the cluster rate of the modes the tier returns.
        total = 3 * sum(mode_pace.values())
        server = {k: v for k, v in kept.items() if k in ("job", "namespace")}
        record = f"cluster:{ns}prefill_hit_ratio:ratio_rate5m"
        check(record, [{"labels": _series(record, {**kept, "tier": tier}), "value": 3 * mode_pace[mode] / total}
                       for mode, tier in modes.items() if tier is not None])
        # Per dp group: dp 0 counts each mode at its pace, dp 1 at twice it.
        record = f"dp_group:{ns}prefill_hit_ratio:ratio_rate5m"
        check(record, [{"labels": _series(record, {**kept, "tier": tier, "dp_rank": str(dp)}),
                        "value": (dp + 1) * mode_pace[mode] / ((dp + 1) * sum(mode_pace.values()))}
                       for dp in (0, 1) for mode, tier in modes.items() if tier is not None])
        record = f"cluster:{ns}prefill_computed_ratio:ratio_rate5m"
        computed = next(mode for mode, tier in modes.items() if tier is None)
        check(record, [sample(record, 3 * mode_pace[computed] / total)])
        for tier, cost, kind in TIER_COSTS:
            record = f"cluster:{ns}{tier}_{cost}_per_hit_token:ratio_rate5m"
            returned = 3 * sum(mode_pace[mode] for mode in TIER_RETURNS[tier])
            check(record, [{"labels": _series(record, server), "value": (36 if kind == "bytes" else 2) / returned}])

    if profile in PROMPT_APART:
        # Each tier's cluster rate (3 x its family's pace) over every prefill token's (the prompt's or the hits',
        # whichever is more), both summed to the server's labels (role goes); computed is what the hits leave of
        # it; the read-back's seconds (15 s a minute on each of 8 ranks: 2 s/s) over the offload hits.
        prompt, hits = PROMPT_APART[profile]
        server = {k: v for k, v in kept.items() if k != "role"}

        def whole(n: int) -> float:
            return max(n * pace[prompt], sum(n * pace[fam] for fam in hits.values()))

        record = f"cluster:{ns}prefill_hit_ratio:ratio_rate5m"
        check(record, [{"labels": _series(record, {**server, "tier": tier}), "value": 3 * pace[fam] / whole(3)}
                       for tier, fam in hits.items()])
        record = f"dp_group:{ns}prefill_hit_ratio:ratio_rate5m"
        check(record, [{"labels": _series(record, {**server, "tier": tier, "dp_rank": str(dp)}),
                        "value": (dp + 1) * pace[fam] / whole(dp + 1)}
                       for dp in (0, 1) for tier, fam in hits.items()])
        record = f"cluster:{ns}prefill_computed_ratio:ratio_rate5m"
        check(record, [{"labels": _series(record, server),
                        "value": 1 - sum(3 * pace[fam] for fam in hits.values()) / whole(3)}])
        for tier, hist in READ_SECONDS[profile]:
            fam = catalog.get(hist)
            for pod, instance, tp, dp in LAYOUT:
                inputs.append({"series": _series(f"{ns}{hist}_sum", rank_labels(fam, pod, instance, tp, dp)),
                               "values": "0+15x10"})
            record = f"cluster:{ns}{hist}_sum:rate5m"
            check(record, [sample(record, 2, **_own_labels(fam))])
            record = f"cluster:{ns}{tier}_seconds_per_hit_token:ratio_rate5m"
            check(record, [{"labels": _series(record, server), "value": 2 / (3 * pace[hits[tier]])}])

    return {
        "rule_files": [str(recording)],
        "evaluation_interval": "1m",
        "tests": [{"name": f"every {profile} family, generated", "interval": "1m",
                   "input_series": inputs, "promql_expr_test": checks}],
    }


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_family_rolls_up_by_its_semantics(ns: str, tmp_path: Path, rule_files: dict[str, tuple[Path, Path]]) -> None:
    tests, checked = [], set()
    for catalog, own in profiles_in_use():
        profile = catalog.default_profile.name
        spec = generated_tests(catalog, own or ns, rule_files[ns][0], profile)
        tests += spec["tests"]
        checked |= {c["expr"] for c in spec["tests"][0]["promql_expr_test"]}
    assert checked == all_expected_records(ns)
    assert len(tests) == 2, "the sglang and the lmcache profile"
    path = tmp_path / "generated_test.yml"
    path.write_text(yaml.safe_dump({**spec, "tests": tests}, sort_keys=False), encoding="utf-8")
    run_promtool("test", "rules", str(path), cwd=tmp_path)
