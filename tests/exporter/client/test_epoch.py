"""RankClient.new_epoch and GaugeChild.set_function against a real sidecar: a rank that clears its metrics
while it runs is a restart to the sidecar, and a gauge read from a function is read when a snapshot is made."""

from __future__ import annotations

import json
import logging
import threading

import pytest

from exporter.catalog import default_catalog
from exporter.client import RankClient
from exporter.client.metrics import GaugeChild, MetricSet
from exporter.client.pusher import FunctionPoller, PushStats
from tests.helpers import SidecarThread, http_get, wait_until

RANK = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


def _rank(sidecar: SidecarThread) -> dict:
    ranks = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]
    assert len(ranks) == 1, ranks
    return ranks[0]


def _settled(sidecar: SidecarThread, name: str, value: float, **labels: str) -> bool:
    found = sidecar.scrape().find(name, **labels)
    return len(found) == 1 and found[0].value == value


def test_new_epoch_restarts_the_rank_and_the_sidecar_continues_its_positions(sidecar: SidecarThread) -> None:
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, preset=False).start()
    try:
        tokens = client.counter("evicted_tokens_total")
        host = client.gauge("hicache_host_used_tokens")
        tokens.inc(100)
        host.set(7)
        wait_until(lambda: _settled(sidecar, "sglang_rollup_evicted_tokens_total", 100))
        tokens.inc(5)  # not pushed yet when the epoch ends: the old epoch's last snapshot carries it
        first = client.epoch
        assert client.new_epoch() == client.epoch != first
        assert tokens.value == 0 and host.value == 7  # counters start again, gauges keep their value
        assert not client.metrics.counted()
        wait_until(lambda: _rank(sidecar)["epoch"] == client.epoch)
        assert _rank(sidecar)["restarts"] == 1
        tokens.inc(20)
        # The per-rank series starts again from the new epoch; the rollup goes on from 105.
        wait_until(lambda: _settled(sidecar, "sglang_rollup_evicted_tokens_total", 125))
        wait_until(lambda: _settled(sidecar, "sglang_evicted_tokens_total", 20, tp_rank="0"))
        assert sidecar.scrape().value("sglang_hicache_host_used_tokens", tp_rank="0") == 7
        assert client.stats.refused is None and client.stats.errors_by_code == {}
    finally:
        client.close()


def test_new_epoch_without_a_sidecar_only_starts_again(socket_dir) -> None:
    client = RankClient(str(socket_dir / "none.sock"), rank=RANK, interval=0.05, preset=False)
    tokens = client.counter("evicted_tokens_total")
    tokens.inc(3)
    first = client.epoch
    client.new_epoch()
    assert client.epoch != first and tokens.value == 0
    client.close()


def test_restart_zeroes_histograms_and_counted_sees_them() -> None:
    metrics = MetricSet(default_catalog())
    histogram = metrics.child("load_back_duration_seconds", {})
    assert not metrics.counted()
    histogram.observe(0.5)  # type: ignore[union-attr]
    assert metrics.counted()
    metrics.restart()
    assert not metrics.counted()
    assert histogram.cumulative() == ([0] * (len(histogram.bounds) + 1), 0.0)  # type: ignore[union-attr]


def test_a_function_gauge_is_read_at_snapshot_time(sidecar: SidecarThread) -> None:
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, preset=False).start()
    try:
        reading = [3.0]
        gauge = client.gauge("hicache_host_used_tokens")
        gauge.set(1)
        gauge.set_function(lambda: reading[0])
        wait_until(lambda: _settled(sidecar, "sglang_hicache_host_used_tokens", 3, tp_rank="0"))
        reading[0] = 11.0  # nobody calls set(): the next snapshot reads it
        wait_until(lambda: _settled(sidecar, "sglang_hicache_host_used_tokens", 11, tp_rank="0"))
        gauge.set_function(None)
        wait_until(lambda: _settled(sidecar, "sglang_hicache_host_used_tokens", 1, tp_rank="0"))
    finally:
        client.close()


def test_a_failing_function_leaves_its_gauge_out_of_the_snapshot() -> None:
    metrics = MetricSet(default_catalog())
    gauge = metrics.child("hicache_host_used_tokens", {})
    assert isinstance(gauge, GaugeChild)

    def broken() -> float:
        raise RuntimeError("the engine's callback failed")

    gauge.set_function(broken)
    metrics.poll()
    assert [s.family for s in metrics.wire_samples()] == []
    gauge.set_function(lambda: 2)
    assert [s.family for s in metrics.wire_samples()] == []  # not read until polled
    metrics.poll()
    assert [(s.family, s.value) for s in metrics.wire_samples()] == [("hicache_host_used_tokens", 2.0)]


def test_a_blocking_function_holds_up_neither_close_nor_a_new_epoch(sidecar: SidecarThread) -> None:
    """The pusher reads functions on a thread of its own (FunctionPoller): an engine's callback that never
    returns holds up neither exit nor a reset."""
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, preset=False).start()
    release = threading.Event()
    client.counter("evicted_tokens_total").inc(5)
    wait_until(lambda: _settled(sidecar, "sglang_rollup_evicted_tokens_total", 5))
    client.gauge("hicache_host_used_tokens").set_function(lambda: float(release.wait()))  # blocks until released
    try:
        done = threading.Event()

        def reset_then_close() -> None:
            client.new_epoch()
            client.close()
            done.set()

        threading.Thread(target=reset_then_close, daemon=True).start()
        assert done.wait(30), "new_epoch() or close() waited on the blocked callback"
    finally:
        release.set()
        client.close()


def test_a_blocking_callback_costs_only_its_own_gauge(sidecar: SidecarThread, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 30: LMCache's callbacks take locks; one that blocked once stopped every push of its rank, silently."""
    release = threading.Event()
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, preset=False)
    client.gauge("hicache_host_used_tokens").set_function(lambda: float(release.wait()))  # bound first: read first
    client.gauge("hicache_host_total_tokens").set_function(lambda: 64.0)
    evicted = client.counter("evicted_tokens_total")
    evicted.inc(5)
    try:
        with caplog.at_level(logging.WARNING, logger="hicache_exporter.client"):
            client.start()
            wait_until(lambda: _settled(sidecar, "sglang_rollup_evicted_tokens_total", 5))
            evicted.inc(7)  # counted while the callback still blocks: pushed all the same
            wait_until(lambda: _settled(sidecar, "sglang_rollup_evicted_tokens_total", 12))
            wait_until(lambda: _settled(sidecar, "sglang_hicache_host_total_tokens", 64, tp_rank="0"))  # read after it
            assert sidecar.scrape().find("sglang_hicache_host_used_tokens") == []  # left out, not a stale value
            assert client.stats.callbacks_stuck == 1
            closed = threading.Event()
            threading.Thread(target=lambda: (client.close(), closed.set()), daemon=True).start()
            assert closed.wait(30), "close() waited on the blocked callback"
        stuck = [r.getMessage() for r in caplog.records if "has not returned" in r.getMessage()]
        assert len(stuck) == 1 and "hicache_host_used_tokens" in stuck[0], stuck
        wait_until(lambda: _rank(sidecar)["status"] == "departed")  # its last snapshot and bye went out
    finally:
        release.set()
        client.close()


def test_a_callback_that_returns_at_last_has_its_gauge_pushed_again(sidecar: SidecarThread) -> None:
    release = threading.Event()
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, preset=False)
    client.gauge("hicache_host_used_tokens").set_function(lambda: 3.0 if release.wait() else 0.0)
    client.counter("evicted_tokens_total").inc(5)
    client.start()
    try:
        wait_until(lambda: client.stats.callbacks_stuck == 1 and _settled(sidecar, "sglang_rollup_evicted_tokens_total", 5))
        release.set()
        wait_until(lambda: _settled(sidecar, "sglang_hicache_host_used_tokens", 3, tp_rank="0"))
        assert client.stats.callbacks_stuck == 1
    finally:
        release.set()
        client.close()


def test_callbacks_stuck_for_good_cost_one_thread_each_however_often_the_gauges_are_read() -> None:
    metrics = MetricSet(default_catalog())
    stats = PushStats()
    poller = FunctionPoller(metrics.functions, 0.05, stats)
    release = threading.Event()
    for family in ("hicache_host_used_tokens", "hicache_host_total_tokens"):
        gauge = metrics.child(family, {})
        assert isinstance(gauge, GaugeChild)
        gauge.set_function(lambda: float(release.wait()))
    fine = metrics.child("hicache_host_mamba_used_states", {})
    assert isinstance(fine, GaugeChild)
    fine.set_function(lambda: 2.0)
    before = {thread for thread in threading.enumerate() if thread.name == "hicache-gauge-reader"}

    def readers() -> set[threading.Thread]:
        return {thread for thread in threading.enumerate() if thread.name == "hicache-gauge-reader"} - before

    try:
        for _ in range(200):  # each read waits at most the deadline
            poller.poll()
            if stats.callbacks_stuck == 2:
                break
        for _ in range(20):
            poller.poll()
        assert stats.callbacks_stuck == 2
        assert len(readers()) == 3  # one per stuck callback, one reading the rest
        assert [s.family for s in metrics.wire_samples()] == ["hicache_host_mamba_used_states"]
    finally:
        release.set()
        poller.close()
    wait_until(lambda: not readers())  # released, the stuck threads end; closed, so does the last
