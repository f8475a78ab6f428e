"""The main job end to end: `hicache-exporter demo --tp 2 --pp 2 --dp 2` with a request budget."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections import defaultdict

from cache_core.geometry import ModelGeometry
from exporter.catalog import MetricType, Semantics, default_catalog
from tests.helpers import Scrape, free_port, http_get, wait_until

REQUESTS = 48


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

    # Rollups: bytes summed over the 8 ranks, tokens over one replica per dp group.
    for family in ("load_back_bytes_total", "hicache_backup_bytes_total", "storage_prefetch_bytes_total"):
        assert scrape.value(name("rollup_" + family)) == scrape.total(name(family))
    for family, labels in (("load_back_tokens_total", {"pool": "kv"}), ("prefetched_tokens_total", {}),
                           ("evicted_tokens_total", {})):
        one_replica = sum(scrape.value(name(family), tp_rank="0", pp_rank="0", dp_rank=str(dp), **labels) for dp in range(2))
        assert scrape.value(name("rollup_" + family), **labels) == one_replica
    # The ranks said who they are, exactly as the upstream label rule says (DP attention on: dp=2).
    ranks = {(s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"]) for s in scrape.find(name("load_back_bytes_total"))}
    assert ranks == {(str(t), str(p), str(d)) for t in range(2) for p in range(2) for d in range(2)}
    assert {s.labels["cache_type"] for s in scrape.find(name("load_back_bytes_total"))} == {"HiRadixCache"}
