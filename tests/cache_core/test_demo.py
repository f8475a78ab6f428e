"""The main job end to end: `hicache-exporter demo --tp 2 --pp 2 --dp 2` with a request budget."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections import defaultdict

import pytest

from cache_core.geometry import ModelGeometry
from exporter.catalog import MetricType, Semantics, default_catalog
from tests.helpers import Scrape, free_port, http_get, wait_until

REQUESTS = 120


def test_demo_replicas_agree_and_rollups_follow_the_rules() -> None:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "demo", "--tp", "2", "--pp", "2", "--dp", "2",
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
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert proc.returncode == 0, "".join(lines)
    catalog = default_catalog()
    name = lambda family: "sglang_" + family  # noqa: E731

    # Replicas of a dp group count the same tokens, series by series.
    for spec in catalog:
        if spec.type is not MetricType.COUNTER or spec.semantics is not Semantics.REPLICATED:
            continue
        by_group: dict[tuple, set[float]] = defaultdict(set)
        for sample in scrape.find(name(spec.name)):
            key = (sample.labels["dp_rank"], *(sample.labels.get(label) for label in spec.labels))
            by_group[key].add(sample.value)
        assert by_group, spec.name
        for key, values in by_group.items():
            assert len(values) == 1, f"{spec.name} {key}: replicas disagree {values}"
    assert scrape.total(name("load_back_tokens_total")) > 0, "the workload exercises load-back"
    assert scrape.total(name("prefetched_tokens_total")) > 0, "the workload exercises L3 prefetch"

    # Bytes follow each rank's shard: tokens x bytes per token of its (heads / tp) x (layers of its pp stage).
    geometry = ModelGeometry(layers=5)
    for sample in scrape.find(name("load_back_bytes_total")):
        tp, pp = int(sample.labels["tp_rank"]), int(sample.labels["pp_rank"])
        tokens = scrape.value(name("load_back_tokens_total"), pool="kv", tp_rank=str(tp), pp_rank=str(pp),
                              dp_rank=sample.labels["dp_rank"])
        assert sample.value == tokens * geometry.shard(tp, 2, pp, 2).bytes_per_token
    assert geometry.shard(0, 2, 0, 2).bytes_per_token != geometry.shard(0, 2, 1, 2).bytes_per_token

    # Rollups, every family: per_shard ones are the sum over the 8 ranks, replicated ones one
    # replica per dp group summed, exactly (the ranks finished at different instants and left).
    rank_keys = ("tp_rank", "pp_rank", "dp_rank")
    for spec in catalog:
        if spec.type is MetricType.GAUGE:
            continue  # gauges roll up over live ranks only, and the ranks have left
        suffixes = ("_total",) if spec.type is MetricType.COUNTER else ("_bucket", "_sum", "_count")
        stem = name(spec.base_name if spec.type is MetricType.COUNTER else spec.name)
        rollup_stem = name("rollup_" + (spec.base_name if spec.type is MetricType.COUNTER else spec.name))
        for suffix in suffixes:
            expected: dict[tuple, float] = defaultdict(float)
            for sample in scrape.find(stem + suffix):
                if spec.semantics is Semantics.REPLICATED and (sample.labels["tp_rank"], sample.labels["pp_rank"]) != ("0", "0"):
                    continue  # the replicas agree (checked above for counters): take one per dp group
                rest = tuple(sorted((k, v) for k, v in sample.labels.items() if k not in rank_keys))
                expected[rest] += sample.value
            got = {tuple(sorted(s.labels.items())): s.value for s in scrape.find(rollup_stem + suffix)}
            assert set(got) == set(expected), (spec.name, suffix)
            for labels, value in expected.items():
                assert got[labels] == pytest.approx(value, rel=1e-12, abs=0) if suffix == "_sum" else got[labels] == value, \
                    (stem + suffix, labels, got[labels], value)
    assert scrape.value(name("rollup_load_back_tokens_total"), pool="kv") > 0
    # The ranks said who they are, exactly as the upstream label rule says (DP attention on: dp=2).
    ranks = {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"]) for s in scrape.find(name("load_back_bytes_total"))}
    assert ranks == {(str(t), str(p), str(d)) for t in range(2) for p in range(2) for d in range(2)}
    assert {s.labels["cache_type"] for s in scrape.find(name("load_back_bytes_total"))} == {"HiRadixCache"}
