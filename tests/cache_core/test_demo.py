"""The main job end to end: `hicache-exporter demo` with a request budget, once with attention tp, pp
and dp (`--tp` as the alias of `--attn-tp`), once with context parallelism and DP attention."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from cache_core.geometry import ModelGeometry
from cache_core.instrumentation import NOT_EMITTED
from exporter.catalog import Collector, MetricType, Semantics, default_catalog
from tests.config.test_prometheus_rules import run_promtool
from tests.helpers import Scrape, free_port, http_get, wait_until

REQUESTS = 120
RANK_AXES = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")
DERIVED_LABELS = ("moe_ep_rank",)  # derived from the global tp rank: no group of its own
# The engine's label names per collector (besides a family's own labels).
COLLECTOR_LABELS = {
    Collector.RADIX: {"cache_type", "tp_rank", "pp_rank", "dp_rank"},
    Collector.STORAGE: {"storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size"},
    Collector.SCHEDULER: {"model_name", "engine_type", "tp_rank", "pp_rank", "moe_ep_rank", "dp_rank"},
}


def run_demo(*layout: str, while_up: Callable[[str], None] | None = None) -> Scrape:
    """The demo's /metrics once its ranks finished; `while_up` is called with its URL before it stops."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "demo", *layout,
                             "--host", "127.0.0.1", "--port", str(port), "--requests", str(REQUESTS), "--interval", "0.2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        wait_until(lambda: any("ranks finished" in line for line in lines), timeout=240, interval=0.5)
        assert not any("ranks failed" in line for line in lines), lines
        assert any(line.startswith("[") and "requests dp0:" in line for line in lines), "progress is shown"
        scrape = Scrape(http_get(f"http://127.0.0.1:{port}/metrics")[1].decode())
        if while_up is not None:
            while_up(f"http://127.0.0.1:{port}")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0, "".join(lines)
    return scrape


def name(family: str) -> str:
    return "sglang_" + family


def group_key(labels: dict[str, str]) -> tuple:
    """A replica group: dp_rank and every label that is not a rank axis or derived from one."""
    return (labels["dp_rank"], *sorted((k, v) for k, v in labels.items() if k not in RANK_AXES and k not in DERIVED_LABELS))


def check_rollups(scrape: Scrape) -> None:
    """Replicas of a dp group agree series by series, and every rollup follows the family's
    semantics exactly: per_shard ones sum every rank, replicated ones one replica per dp group."""
    for spec in default_catalog():
        if spec.type is MetricType.GAUGE:
            continue  # gauges roll up over live ranks only, and the ranks have left
        suffixes = ("_total",) if spec.type is MetricType.COUNTER else ("_bucket", "_sum", "_count")
        stem = name(spec.base_name if spec.type is MetricType.COUNTER else spec.name)
        rollup_stem = name("rollup_" + (spec.base_name if spec.type is MetricType.COUNTER else spec.name))
        for suffix in suffixes:
            expected: dict[tuple, float] = defaultdict(float)
            if spec.semantics is Semantics.REPLICATED:
                by_group: dict[tuple, set[float]] = defaultdict(set)
                for sample in scrape.find(stem + suffix):
                    by_group[group_key(sample.labels)].add(sample.value)
                for key, values in by_group.items():
                    assert len(values) == 1, f"{stem + suffix} {key}: replicas disagree {values}"
                    rest = tuple(kv for kv in key[1:])
                    expected[rest] += values.pop()  # one replica per dp group, the groups summed
            else:
                for sample in scrape.find(stem + suffix):
                    expected[tuple(sorted((k, v) for k, v in sample.labels.items()
                                          if k not in RANK_AXES and k not in DERIVED_LABELS))] += sample.value
            got = {tuple(sorted(s.labels.items())): s.value for s in scrape.find(rollup_stem + suffix)}
            assert set(got) == set(expected), (spec.name, suffix)
            for labels, value in expected.items():
                assert got[labels] == pytest.approx(value, rel=1e-12, abs=0) if suffix == "_sum" else got[labels] == value, \
                    (stem + suffix, labels, got[labels], value)


def check_families_and_labels(scrape: Scrape, extra_radix: set[str] = frozenset()) -> None:  # type: ignore[assignment]
    """Every family the engine's cache mode emits is there, with its collector's label names only."""
    for spec in default_catalog():
        sample_name = name(spec.name + ("_count" if spec.type is MetricType.HISTOGRAM else ""))
        found = scrape.find(sample_name)
        if spec.name in NOT_EMITTED:
            assert not found, f"{spec.name} is not emitted in cache mode"
            continue
        assert found, spec.name
        assert spec.collector is not None
        wanted = COLLECTOR_LABELS[spec.collector] | set(spec.labels)
        if spec.collector is Collector.RADIX:
            wanted |= extra_radix
        for sample in found:
            assert set(sample.labels) == wanted, (spec.name, sorted(sample.labels))


def logical_bytes_per_token(shard: Any) -> float:
    return shard.page_bytes / shard.model.page_size


def missing_by_dp(scrape: Scrape) -> dict[str, float]:
    """hicache_exporter_ranks_missing per dp group: a series only where the server's streams agree on one world."""
    return {s.labels["dp_rank"]: s.value for s in scrape.find("hicache_exporter_ranks_missing")}


def prefill_shares_match_the_rollups(url: str) -> None:
    """The status document's prefill shares since start are each tier's share in the sidecar's own rollup
    on /metrics (the status document is encoded once a tick: wait for one made after the last push)."""
    def agree() -> bool:
        scrape = Scrape(http_get(url + "/metrics")[1].decode())
        tokens = {s.labels["mode"]: s.value for s in scrape.find(name("rollup_prefill_effective_tokens_total"))}
        total = sum(tokens.values())
        offload = tokens["host_hit"] + tokens["storage_hit"]
        shares = {**{tier: tokens[f"{tier}_hit"] / total for tier in ("device", "host", "storage")},
                  "offload": offload / total}
        since = json.loads(http_get(url + "/api/v1/status")[1])["prefill"]["since_start"]
        counted = {"computed": tokens["input"], "total": total, "offload": offload,
                   **{tier: tokens[f"{tier}_hit"] for tier in ("device", "host", "storage")}}
        return (since["hit_ratio"] == shares and since["computed_ratio"] == tokens["input"] / total
                and since["tokens"] == counted)  # the counts too: a share alone would not show tokens counted TP times
    wait_until(agree, timeout=10)


RULES = Path(__file__).resolve().parents[2] / "config" / "prometheus"
SERVED_MINUTES = 70  # longer than HiCacheTierNotPaying's `for: 1h`


def tier_alert_on(scrape: Scrape, directory: Path) -> None:
    """HiCacheTierNotPaying stays quiet on the demo's traffic: its ranks' counters, what they counted in the
    whole run counted again every minute for SERVED_MINUTES, through the shipped rules in promtool. Not
    vacuous: each tier's backup writes and returns a share of at least 1 %, so the alert's write side holds
    and its share side decides."""
    series = []
    for sample in scrape.samples:
        if (not sample.name.startswith("sglang_") or sample.name.startswith("sglang_rollup_")
                or not sample.name.endswith(("_total", "_sum", "_count", "_bucket"))):
            continue  # the ranks' own counters and histograms, as Prometheus scrapes them from the sidecar
        labels = {**sample.labels, "job": "hicache", "namespace": "demo", "server": "demo", "pod": "demo-0"}
        selector = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        series.append({"series": f"{sample.name}{{{selector}}}", "values": f"0+{sample.value!r}x{SERVED_MINUTES}"})
    counted = [
        ("prefill hit share, tier host", 'count(cluster:sglang_prefill_hit_ratio:ratio_rate5m{tier="host"} >= 0.01)'),
        ("prefill hit share, tier storage",
         'count(cluster:sglang_prefill_hit_ratio:ratio_rate5m{tier="storage"} >= 0.01)'),
        ("host backup writes", "count(cluster:sglang_hicache_backup_bytes:rate5m > 0)"),
        ("storage backup writes", "count(cluster:sglang_storage_backup_bytes:rate5m > 0)"),
    ]
    test = {"rule_files": [str(RULES / "recording_rules.yml"), str(RULES / "alerting_rules.yml")],
            "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "alert_rule_test": [{"eval_time": f"{SERVED_MINUTES}m", "alertname": "HiCacheTierNotPaying",
                                            "exp_alerts": []}],
                       "promql_expr_test": [{"expr": expr, "eval_time": f"{SERVED_MINUTES}m",
                                             "exp_samples": [{"labels": "{}", "value": 1}]} for _, expr in counted]}]}
    path = directory / "demo_tiers_test.yml"
    path.write_text(yaml.safe_dump(test, sort_keys=False))
    run_promtool("test", "rules", str(path))


def test_demo_replicas_agree_and_rollups_follow_the_rules(tmp_path: Path) -> None:
    scrape = run_demo("--tp", "2", "--pp", "2", "--dp", "2", while_up=prefill_shares_match_the_rollups)
    tier_alert_on(scrape, tmp_path)
    assert all(scrape.value(name("rollup_prefill_effective_tokens_total"), mode=mode) > 0
               for mode in ("input", "device_hit", "host_hit", "storage_hit")), "the workload hits every tier"
    # Every collector sent the one server world, and every rank of it reported (the scheduler's
    # streams under their global tp rank included): none missing in either dp group.
    assert missing_by_dp(scrape) == {"0": 0, "1": 0}
    assert scrape.total(name("load_back_tokens_total")) > 0, "the workload exercises load-back"
    assert scrape.total(name("prefetched_tokens_total")) > 0, "the workload exercises L3 prefetch"
    check_families_and_labels(scrape)
    check_rollups(scrape)

    # Bytes follow each rank's shard: tokens x bytes per token of its (heads / tp) x (layers of its pp stage).
    geometry = ModelGeometry(layers=5)
    for sample in scrape.find(name("load_back_bytes_total")):
        tp, pp = int(sample.labels["tp_rank"]), int(sample.labels["pp_rank"])
        tokens = scrape.value(name("load_back_tokens_total"), pool="kv", tp_rank=str(tp), pp_rank=str(pp),
                              dp_rank=sample.labels["dp_rank"])
        assert sample.value == tokens * geometry.shard(tp, 2, pp, 2).bytes_per_token
    assert geometry.shard(0, 2, 0, 2).bytes_per_token != geometry.shard(0, 2, 1, 2).bytes_per_token
    assert scrape.value(name("rollup_load_back_tokens_total"), pool="kv") > 0

    # The ranks said who they are, exactly as the engine's label rules say (DP attention on: dp=2).
    ranks = {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"]) for s in scrape.find(name("load_back_bytes_total"))}
    assert ranks == {(str(t), str(p), str(d)) for t in range(2) for p in range(2) for d in range(2)}
    assert {s.labels["cache_type"] for s in scrape.find(name("load_back_bytes_total"))} == {"UnifiedRadixCache"}
    storage = {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"], s.labels["attn_cp_rank"])
               for s in scrape.find(name("prefetched_tokens_total"))}
    assert storage == {(str(t), str(p), str(d), "0") for t in range(2) for p in range(2) for d in range(2)}
    # Scheduler series: only the ranks with attention tp rank 0, under their global tp rank.
    scheduler = {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"])
                 for s in scrape.find(name("prefill_effective_tokens_total"), mode="input")}
    assert scheduler == {(str(2 * d), str(p), str(d)) for p in range(2) for d in range(2)}
    assert scrape.value(name("rollup_prefill_effective_tokens_total"), mode="input") > 0


def test_demo_with_context_parallelism_counts_tokens_once() -> None:
    scrape = run_demo("--attn-tp", "2", "--cp", "2", "--dp", "2")
    assert missing_by_dp(scrape) == {"0": 0, "1": 0}  # 2 dp groups x 2 cp ranks x 2 attention tp ranks, all there
    # With DP attention the radix labels of cp peers would collide: they carry attn_cp_rank.
    check_families_and_labels(scrape, extra_radix={"attn_cp_rank"})
    check_rollups(scrape)
    # Every cp peer counts the same tokens, and the rollup counts them once per dp group.
    for family in ("load_back_tokens_total", "prefetched_tokens_total", "storage_prefetch_hit_tokens_total"):
        per_group: dict[str, set[float]] = defaultdict(set)
        samples = scrape.find(name(family))
        assert len(samples) == 8, family
        for sample in samples:
            per_group[sample.labels["dp_rank"]].add(sample.value)
        assert all(len(v) == 1 for v in per_group.values()), (family, per_group)
        once = sum(v.pop() for v in per_group.values())
        assert once > 0
        assert scrape.total(name("rollup_" + family)) == once, family
    # Bytes: each cp rank moves its slice of every page (half), so they sum to the whole once.
    geometry = ModelGeometry(layers=5)
    half = logical_bytes_per_token(geometry.shard(0, 2, 0, 1, 0, 2))
    assert half * 2 == logical_bytes_per_token(geometry.shard(0, 2, 0, 1))
    for sample in scrape.find(name("load_back_bytes_total")):
        tokens = scrape.value(name("load_back_tokens_total"), **{k: sample.labels[k] for k in
                                                                 ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")})
        assert sample.value == tokens * half
    assert scrape.value(name("rollup_load_back_bytes_total")) == scrape.total(name("load_back_bytes_total"))
    # Scheduler statistics: attention tp rank 0 and cp rank 0 of each dp group only.
    scheduler = {s.labels["tp_rank"] for s in scrape.find(name("hicache_host_used_tokens"))}
    assert scheduler == {"0", "4"}  # tp_rank = (dp * cp + 0) * attn_tp + 0


def _group_members(group: int) -> list[tuple[int, str]]:
    """(pid, state) of every process in process group `group`, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while listed
        if int(fields[2]) == group:
            members.append((int(stat.parent.name), fields[0]))
    return members


def _l3_bytes_stopped(group: int, l3: Path) -> int:
    """Bytes of stored pages (a page being written is a `.tmp-` file until it is renamed), listed
    while the demo's processes are stopped: a listing is not atomic, and a page evicted and
    replaced while it runs would be counted with its replacement. SIGSTOP is delivered
    asynchronously, so the listing waits until every process of the group shows it stopped (or dead)."""
    os.killpg(group, signal.SIGSTOP)
    try:
        wait_until(lambda: all(state in "TtZX" for _, state in _group_members(group)), timeout=10, interval=0.005)
        return sum(f.stat().st_size for f in l3.glob("*/??/*") if not f.name.startswith(".tmp-"))
    finally:
        os.killpg(group, signal.SIGCONT)


def test_demo_l3_stays_under_its_capacity_and_ctrl_c_leaves_nothing(socket_dir: Path) -> None:
    """The L3 store evicts past its capacity, and the demo's directory goes with the demo."""
    # A short TMPDIR, not tmp_path: the demo's socket is made in it, and a socket's path has at most
    # 107 bytes (under pytest-xdist, tmp_path/tmp/hicache-demo-XXXXXXXX/metrics.sock was 110).
    tmp = socket_dir / "tmp"
    tmp.mkdir()
    capacity = 2 * 2**20
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "demo", "--tp", "2", "--host", "127.0.0.1",
                             "--port", str(free_port()), "--interval", "0.2", "--l3-capacity-mb", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TMPDIR": str(tmp)}, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")), daemon=True)  # type: ignore[union-attr]
    reader.start()
    try:
        def started() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"the demo exited with status {proc.returncode}:\n{''.join(lines)}")
            return any(" L3 in " in line for line in lines)

        wait_until(started, timeout=120, interval=0.2)
        l3 = Path(next(line for line in lines if " L3 in " in line).split(" L3 in ")[1].split(" (")[0])
        assert l3.parent.parent == tmp and "at most 2 MiB" in "".join(lines)
        peak, full_for = 0, 0
        deadline = time.monotonic() + 90
        while full_for < 15 and time.monotonic() < deadline:  # 3 s with the store at its capacity
            size = _l3_bytes_stopped(proc.pid, l3)
            peak = max(peak, size)
            full_for = full_for + 1 if size > capacity * 0.9 else 0
            time.sleep(0.2)
        assert full_for >= 15, f"the store never filled: peak {peak} bytes"
        assert peak <= capacity, peak
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    reader.join(5)
    assert proc.returncode == 0, "".join(lines)
    assert "Traceback" not in "".join(lines), "".join(lines)
    assert list(tmp.iterdir()) == [], "the demo left files behind"
