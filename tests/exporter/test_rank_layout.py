"""Eight real rank processes (tp=2, pp=2, dp=2) push to a real `hicache-exporter serve`."""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Scrape, free_port, http_get, wait_ready

LAYOUT = list(itertools.product(range(2), range(2), range(2)))  # (dp, pp, tp)
STATIC = {"cache_type": "UnifiedRadixCache", "model": "demo-7b"}


def tokens_of_group(dp: int) -> tuple[int, int]:
    """Tokens each replica of dp group `dp` counts: first push, then the final value."""
    return 1000 * (dp + 1), 1000 * (dp + 1) + 37 * (dp + 3)


def bytes_of_rank(dp: int, pp: int, tp: int) -> tuple[int, int]:
    """Per-shard bytes differ per rank."""
    index = dp * 4 + pp * 2 + tp
    return 4096 * (index + 1), 4096 * (index + 1) + 512 * (index + 2)


def run_rank(socket_path: str, dp: int, pp: int, tp: int, barrier: Any) -> None:
    """One rank process: bind, increment, push, then move in lock-step with its replicas and close."""
    from exporter.client import RankClient

    client = RankClient(socket_path, rank={"tp_rank": tp, "pp_rank": pp, "dp_rank": dp}, labels=STATIC,
                        interval=0.2, world={"tp_size": 2, "pp_size": 2, "dp_size": 2})
    tokens = client.counter("load_back_tokens_total", pool="kv")
    moved = client.counter("load_back_bytes_total")
    first_tokens, final_tokens = tokens_of_group(dp)
    first_bytes, final_bytes = bytes_of_rank(dp, pp, tp)
    tokens.inc(first_tokens)
    moved.inc(first_bytes)
    client.histogram("load_back_duration_seconds").observe(0.002)
    client.gauge("hicache_host_used_tokens").set(100 * (dp + 1))
    client.start()
    deadline = time.monotonic() + 30
    while client.stats.snapshots_sent == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    barrier.wait(60)  # replicas advance in lock-step, as collectives force in a real TP group
    tokens.inc(final_tokens - first_tokens)
    moved.inc(final_bytes - first_bytes)
    client.close()
    assert client.stats.failures == 0, client.stats


@pytest.fixture
def served(socket_dir: Path) -> Iterator[tuple[str, str]]:
    port = free_port()
    sock = str(socket_dir / "metrics.sock")
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), "--socket", sock],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, lambda: _ready(url))
        yield url, sock
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
        assert not os.path.exists(sock), "SIGTERM must remove the socket"


def _ready(url: str) -> bool:
    try:
        return http_get(url + "/-/ready")[0] == 200
    except OSError:
        return False


def test_eight_ranks_roll_up_by_semantics(served: tuple[str, str]) -> None:
    url, sock = served
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(len(LAYOUT))
    procs = [ctx.Process(target=run_rank, args=(sock, dp, pp, tp, barrier)) for dp, pp, tp in LAYOUT]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(60)
        assert proc.exitcode == 0
    scrape = Scrape(http_get(url + "/metrics")[1].decode())

    for dp, pp, tp in LAYOUT:
        labels = {"tp_rank": str(tp), "pp_rank": str(pp), "dp_rank": str(dp), **STATIC}
        assert scrape.value("sglang_load_back_bytes_total", **labels) == bytes_of_rank(dp, pp, tp)[1]
        assert scrape.value("sglang_load_back_tokens_total", pool="kv", **labels) == tokens_of_group(dp)[1]
        assert scrape.value("sglang_load_back_duration_seconds_count", **labels) == 1

    total_bytes = sum(bytes_of_rank(*rank)[1] for rank in LAYOUT)
    logical_tokens = sum(tokens_of_group(dp)[1] for dp in range(2))
    assert scrape.value("sglang_rollup_load_back_bytes_total", **STATIC) == total_bytes
    rollup_tokens = scrape.value("sglang_rollup_load_back_tokens_total", pool="kv", **STATIC)
    assert rollup_tokens == logical_tokens
    assert rollup_tokens != 8 * logical_tokens / 2 and rollup_tokens != 4 * logical_tokens / 2
    assert scrape.value("sglang_rollup_load_back_duration_seconds_count", **STATIC) == 8
    rollup_labels = {frozenset(s.labels) for s in scrape.find("sglang_rollup_load_back_bytes_total")}
    assert rollup_labels == {frozenset(STATIC)}, "rollups carry no rank labels"
    assert scrape.value("hicache_exporter_ranks", state="departed") == 8
