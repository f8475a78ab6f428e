"""exporter.integrations.sglang driving the released SGLang 0.5.23 collectors (tests.upstream_sglang).

Rank processes are real processes (spawned, as SGLang starts its schedulers) pushing over real
Unix sockets into a real sidecar; the collectors are the engine's own code, not a copy.
"""

from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import prometheus_client
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector

from exporter.catalog import default_catalog
from exporter.client import CounterChild, GaugeChild, HistogramChild
from tests.helpers import Scrape, wait_until
from tests.integrations.support import FORK, documentation, run_processes, samples

README = Path(__file__).resolve().parents[2] / "README.md"


def radix_series(ranks: ModuleType, rank: Any) -> dict[str, str]:
    return {key: str(value) for key, value in ranks.radix_labels(rank).items()}


def storage_series(ranks: ModuleType, rank: Any) -> dict[str, str]:
    return {key: str(value) for key, value in ranks.storage_labels(rank).items()}


def observations(ranks: ModuleType, rank: Any, method: str) -> list[float]:
    return [args[0] for _, name, args in ranks.events(rank) if name == method]


def assert_nothing_rejected(scrape: Scrape) -> None:
    rejected = {s.labels["reason"]: s.value for s in scrape.find("hicache_exporter_rejections_total") if s.value}
    assert not rejected, f"the sidecar rejected samples: {rejected}"


def engine_families(namespace: str) -> set[str]:
    """Exposition family names of every catalog family (a counter's family name has no _total)."""
    return {namespace + spec.base_name for spec in default_catalog()}


# --- several rank processes into one sidecar ---


def test_rank_processes_push_per_rank_series_and_the_sidecar_rolls_them_up(ranks, integration, sidecar, push_to):
    push_to(sidecar)
    world = ranks.ranks(tp=2, dp=2)  # DP attention: two groups of two attention-TP ranks
    run_processes(ranks.run_rank, [(integration.stat_loggers(), rank) for rank in world])
    assert integration._clients.clients == {}, "the test process bound nothing: clients start where metrics are made"

    scrape = sidecar.scrape()
    assert_nothing_rejected(scrape)
    for rank in world:  # every rank's own series, exactly what its collectors counted
        radix, storage = radix_series(ranks, rank), storage_series(ranks, rank)
        assert scrape.value("sglang_load_back_tokens_total", pool="kv", **radix) == ranks.total(
            rank, "increment_load_back_num_tokens", "kv")
        assert scrape.value("sglang_load_back_bytes_total", **radix) == ranks.total(rank, "increment_load_back_num_bytes")
        assert scrape.value("sglang_hicache_backup_bytes_total", **radix) == ranks.total(rank, "increment_backup_num_bytes")
        assert scrape.value("sglang_evicted_tokens_total", **radix) == ranks.total(rank, "increment_eviction_num_tokens")
        assert scrape.value("sglang_hicache_dropped_tokens_total", reason="host_pressure", pool="kv", **radix) == ranks.total(
            rank, "increment_dropped_tokens", "host_pressure", "kv")
        durations = observations(ranks, rank, "observe_load_back_duration")
        assert scrape.value("sglang_load_back_duration_seconds_count", **radix) == len(durations)
        assert scrape.value("sglang_load_back_duration_seconds_sum", **radix) == sum(durations)
        assert scrape.value("sglang_storage_prefetch_unfulfilled_tokens_total", reason="deadline", **storage) == ranks.total(
            rank, "log_storage_prefetch_unfulfilled_tokens", "deadline")
        assert scrape.value("sglang_storage_prefetch_unfulfilled_tokens_total", reason="shrunk", **storage) == ranks.total(
            rank, "log_storage_prefetch_unfulfilled_tokens", "shrunk")
        assert scrape.value("sglang_hicache_prefetch_aux_alloc_failed_tokens_total", **storage) == 5
        assert scrape.value("sglang_prefetch_pgs_count", **storage) == len(observations(ranks, rank, "log_storage_metrics"))

    # Tokens: one replica per dp group, summed over the groups (the replicas agree).
    replicas = [rank for rank in world if rank.tp_rank == 0]
    radix_static = {"cache_type": ranks.CACHE_TYPE}
    storage_static = {"storage_backend": ranks.STORAGE_BACKEND, "pp_size": "1", "attn_cp_size": "1"}
    load_back_tokens = sum(ranks.total(rank, "increment_load_back_num_tokens", "kv") for rank in replicas)
    assert scrape.value("sglang_rollup_load_back_tokens_total", pool="kv", **radix_static) == load_back_tokens
    assert load_back_tokens < sum(ranks.total(rank, "increment_load_back_num_tokens", "kv") for rank in world)
    assert scrape.value("sglang_rollup_storage_prefetch_unfulfilled_tokens_total", reason="deadline",
                        **storage_static) == sum(ranks.total(rank, "log_storage_prefetch_unfulfilled_tokens", "deadline")
                                                 for rank in replicas)
    assert scrape.value("sglang_rollup_prefetched_tokens_total", **storage_static) == sum(
        ranks.total(rank, "log_prefetched_tokens") for rank in replicas)
    # Bytes: every rank's shard, summed.
    assert scrape.value("sglang_rollup_load_back_bytes_total", **radix_static) == sum(
        ranks.total(rank, "increment_load_back_num_bytes") for rank in world)
    assert scrape.value("sglang_rollup_hicache_backup_bytes_total", **radix_static) == sum(
        ranks.total(rank, "increment_backup_num_bytes") for rank in world)

    # The engine's own HELP texts travel with the series.
    help_texts = documentation(scrape.text)
    assert help_texts["sglang_load_back_bytes"].startswith("Bytes loaded back from local host DRAM (L2) to GPU")
    assert "deadline means the storage prefetch stop policy ended the read" in help_texts[
        "sglang_storage_prefetch_unfulfilled_tokens"]


def test_released_collectors_in_multiprocess_mode_and_through_the_sidecar_give_the_same_samples(
    ranks, integration, engine_sidecar, push_to, monkeypatch, tmp_path
):
    world = ranks.ranks(tp=2, dp=2)
    # An operator's bucket override: both sides must show the engine's layout, not the catalog's.
    monkeypatch.setenv("SGLANG_BUCKET_LOAD_BACK_DURATION", "0.002,0.01,0.05,0.25")

    # The engine without the hook: its released collectors in prometheus_client's multiprocess
    # mode, one process per rank, read back the way the engine's /metrics reads them.
    directory = tmp_path / "multiproc"
    directory.mkdir()
    with monkeypatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        given_help = run_processes(ranks.run_released_rank, [(rank,) for rank in world], receive=True)
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    engine = samples(generate_latest(registry).decode())

    # The same events through stat_loggers() into a sidecar that keeps the engine's names.
    push_to(engine_sidecar)
    run_processes(ranks.run_rank, [(integration.stat_loggers(), rank) for rank in world])
    scrape = engine_sidecar.scrape()
    assert_nothing_rejected(scrape)
    pushed = samples(scrape.text, engine_families("sglang:"))

    assert pushed == engine
    # What the comparison covered: every rank, both collectors, the override's bounds, every reason.
    assert {dict(labels)["tp_rank"] + dict(labels)["dp_rank"] for _, labels, _ in engine} == {"00", "10", "01", "11"}
    bounds = {dict(labels).get("le") for name, labels, _ in engine if name == "sglang:load_back_duration_seconds_bucket"}
    assert bounds == {"0.002", "0.01", "0.05", "0.25", "+Inf"}
    reasons = {dict(labels)["reason"] for name, labels, _ in engine
               if name == "sglang:storage_prefetch_unfulfilled_tokens_total"}
    assert {"deadline", "shrunk", "storage_transfer", "below_threshold", "dropped"} <= reasons
    assert len(engine) > 400

    # And the sidecar's HELP is the engine's own wording (its multiprocess /metrics says "Multiprocess metric").
    exposed = documentation(scrape.text)
    for texts in given_help:
        for name, text in texts.items():
            assert exposed[name] == text, name


# --- the README's example ---


class StandInEngine:
    """Stands in for `sglang.Engine`: one spawned scheduler process per TP rank, each building the
    released collectors from the stat-logger classes it was given, as the engine's schedulers do."""

    instances: list[StandInEngine] = []

    def __init__(self, ranks: ModuleType, **server_args: Any) -> None:
        from tests.integrations.support import SPAWN

        assert server_args["enable_metrics"] is True
        self.server_args = server_args
        self.world = ranks.ranks(tp=server_args.get("tp_size", 1), dp=1)
        self.pipes = [SPAWN.Pipe() for _ in self.world]
        self.processes = [
            SPAWN.Process(target=ranks.serve_rank, args=(server_args["stat_loggers"], rank, child))
            for rank, (_, child) in zip(self.world, self.pipes)
        ]
        for process in self.processes:
            process.start()
        StandInEngine.instances.append(self)

    def generate(self, prompt: str, sampling_params: dict[str, Any] | None = None) -> dict[str, Any]:
        for parent, _ in self.pipes:
            parent.send("generate")
        for parent, _ in self.pipes:
            assert parent.poll(60) and parent.recv() == "done"
        return {"text": " Paris."}

    def shutdown(self) -> None:
        for parent, _ in self.pipes:
            parent.send("shutdown")
        for process in self.processes:
            process.join(60)
        assert [p.exitcode for p in self.processes] == [0] * len(self.processes)


def readme_example() -> str:
    section = README.read_text(encoding="utf-8").split("\n## Connecting SGLang\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert blocks, "the README's 'Connecting SGLang' section has no python example"
    return blocks[0]


def test_the_readme_example_runs_as_written(ranks, integration, sidecar, monkeypatch, capsys):
    code = readme_example()
    assert "stat_loggers=stat_loggers()" in code and "enable_metrics=True" in code
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)  # the sidecar's socket in the pod
    monkeypatch.setattr(sys.modules["sglang"], "Engine", lambda **kw: StandInEngine(ranks, **kw), raising=False)
    StandInEngine.instances.clear()

    exec(compile(code, f"{README}:Connecting SGLang", "exec"), {"__name__": "__main__"})

    (engine,) = StandInEngine.instances
    assert engine.server_args["stat_loggers"] == integration.stat_loggers()
    assert capsys.readouterr().out == " Paris.\n"  # the example ran to its end, shutdown included
    scrape = sidecar.scrape()
    assert_nothing_rejected(scrape)
    for rank in engine.world:
        radix = radix_series(ranks, rank)
        assert scrape.value("sglang_load_back_tokens_total", pool="kv", **radix) == ranks.total(
            rank, "increment_load_back_num_tokens", "kv")
    (replica,) = [rank for rank in engine.world if rank.tp_rank == 0]
    assert scrape.value("sglang_rollup_load_back_tokens_total", pool="kv") == ranks.total(
        replica, "increment_load_back_num_tokens", "kv")
    assert scrape.value("sglang_rollup_load_back_bytes_total") == sum(
        ranks.total(rank, "increment_load_back_num_bytes") for rank in engine.world)


# --- the other collector, other parallel layouts, other start methods ---


def test_the_scheduler_collector_pushes_its_hicache_families_and_keeps_the_rest_on_prometheus_client(
    ranks, integration, sidecar, push_to
):
    push_to(sidecar)
    labels = {"model_name": "qwen", "engine_type": "unified", "tp_rank": 0, "pp_rank": 0, "moe_ep_rank": 0,
              "priority": "", "dp_rank": 1}
    (engine_metrics,) = run_processes(ranks.run_scheduler, [(integration.stat_loggers(), labels)], receive=True)

    # Families outside the catalog stay on the engine's own /metrics; the catalog's are not there.
    kept = {name for name, _, _ in samples(engine_metrics)}
    assert {"sglang:num_running_reqs", "sglang:token_usage", "sglang:gen_throughput"} <= kept
    assert "sglang:realtime_tokens" in documentation(engine_metrics)  # a counter family, named without _total
    assert not {name for name in kept if "hicache_host" in name or "prefill_effective" in name}

    scrape = sidecar.scrape()
    assert_nothing_rejected(scrape)
    # priority="" (the total under priority scheduling) is no label to Prometheus, so none is pushed.
    rank = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "1", "model_name": "qwen", "engine_type": "unified",
            "moe_ep_rank": "0"}
    assert scrape.value("sglang_hicache_host_used_tokens", **rank) == 512
    assert "priority" not in scrape.find("sglang_hicache_host_used_tokens")[0].labels
    assert scrape.value("sglang_hicache_host_total_tokens", **rank) == 4096
    assert scrape.value("sglang_hicache_host_mamba_used_states", **rank) == 3
    assert scrape.value("sglang_hicache_host_mamba_total_states", **rank) == 8
    for mode, tokens in {"input": 100, "device_hit": 40, "host_hit": 25, "storage_hit": 10}.items():
        assert scrape.value("sglang_prefill_effective_tokens_total", mode=mode, **rank) == tokens
    assert documentation(scrape.text)["sglang_hicache_host_used_tokens"] == (
        "Number of tokens currently used in the host KV cache.")


def test_schedulers_of_one_dp_group_under_different_moe_ep_ranks_count_it_once(ranks, integration, sidecar, push_to):
    """With --enable-metrics-for-all-schedulers and expert parallelism, every scheduler of a dp group
    logs the group's prefill tokens under its own moe_ep_rank (derived from its tp rank)."""
    push_to(sidecar)
    base = {"model_name": "qwen", "engine_type": "unified", "pp_rank": 0, "priority": "", "dp_rank": 0}
    loggers = integration.stat_loggers()
    run_processes(ranks.run_scheduler, [(loggers, {**base, "tp_rank": tp, "moe_ep_rank": tp // 2}) for tp in range(4)],
                  receive=True)
    scrape = sidecar.scrape()
    assert_nothing_rejected(scrape)
    assert {s.labels["moe_ep_rank"] for s in scrape.find("sglang_prefill_effective_tokens_total")} == {"0", "1"}
    for mode, tokens in {"input": 100, "device_hit": 40, "host_hit": 25, "storage_hit": 10}.items():
        (rolled,) = scrape.find("sglang_rollup_prefill_effective_tokens_total", mode=mode)
        assert rolled.value == tokens and "moe_ep_rank" not in rolled.labels  # one replica, not one per EP rank


def test_context_parallel_peers_with_identical_radix_labels_are_replicas_of_one_group(ranks, integration, sidecar, push_to):
    push_to(sidecar)
    rank = ranks.Rank(tp_rank=0, dp_rank=0, tp_size=1, dp_size=1)
    run_processes(ranks.run_context_parallel_rank, [(integration.stat_loggers(), rank, cp, 2) for cp in (0, 1)])

    scrape = sidecar.scrape()
    assert_nothing_rejected(scrape)  # no duplicate_rank: the CP rank tells the peers apart
    tokens = ranks.total(rank, "increment_load_back_num_tokens", "kv")
    radix = radix_series(ranks, rank)
    for cp in ("0", "1"):
        assert scrape.value("sglang_load_back_tokens_total", pool="kv", attn_cp_rank=cp, **radix) == tokens
    assert scrape.value("sglang_rollup_load_back_tokens_total", pool="kv") == tokens  # replicas: read once
    assert scrape.value("sglang_rollup_load_back_bytes_total") == 2 * ranks.total(rank, "increment_load_back_num_bytes")


def test_forked_rank_processes_push_their_last_snapshot_on_the_way_out(ranks, integration, sidecar, push_to):
    push_to(sidecar)
    world = ranks.ranks(tp=2, dp=1)
    run_processes(ranks.run_rank, [(integration.stat_loggers(), rank) for rank in world], context=FORK)

    scrape = sidecar.scrape()
    for rank in world:  # a fork child leaves through os._exit: multiprocessing's finalizers push
        assert scrape.value("sglang_load_back_bytes_total", **radix_series(ranks, rank)) == ranks.total(
            rank, "increment_load_back_num_bytes")


# --- the metric classes themselves (in this process) ---


def test_stat_loggers_maps_the_roles_to_picklable_subclasses_of_the_released_collectors(ranks, integration, monkeypatch):
    # stat_loggers() sets the two variables in os.environ: on a copy, so that they do not outlive the test (a
    # sidecar a later test starts would take HICACHE_EXPORTER_SOCKET over its config file's socket).
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items()
                                        if k not in ("HICACHE_EXPORTER_SOCKET", "HICACHE_EXPORTER_PUSH_INTERVAL")})
    loggers = integration.stat_loggers("/tmp/hc-test.sock", interval=0.25)
    assert issubclass(loggers["radix_cache"], ranks.released.RadixCacheMetricsCollector)
    assert issubclass(loggers["storage"], ranks.released.StorageMetricsCollector)
    assert issubclass(loggers["scheduler"], ranks.released.SchedulerMetricsCollector)
    assert set(loggers) == {ranks.released.STAT_LOGGER_ROLE_RADIX_CACHE, ranks.released.STAT_LOGGER_ROLE_STORAGE,
                            ranks.released.STAT_LOGGER_ROLE_SCHEDULER}
    assert pickle.loads(pickle.dumps(loggers)) == loggers  # by reference, as they reach the scheduler processes
    assert os.environ["HICACHE_EXPORTER_SOCKET"] == "/tmp/hc-test.sock"
    assert float(os.environ["HICACHE_EXPORTER_PUSH_INTERVAL"]) == 0.25
    with pytest.raises(ValueError):
        integration.stat_loggers(interval=0)


def test_labels_split_into_rank_axes_family_labels_and_static_labels(engine_sidecar, in_process, monkeypatch):
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", engine_sidecar.socket_path)
    monkeypatch.setenv("HICACHE_EXPORTER_PUSH_INTERVAL", "0.05")
    counter = in_process.SidecarCounter(
        name="sglang:load_back_tokens_total", documentation="Tokens, as the engine says.",
        labelnames=["cache_type", "tp_rank", "pp_rank", "dp_rank", "region", "pool"],
    )
    child = counter.labels(cache_type="HiRadixCache", tp_rank=3, pp_rank=1, dp_rank=0, region="eu", pool="kv")
    assert isinstance(child, CounterChild)
    assert counter.labels("HiRadixCache", 3, 1, 0, "eu", "kv") is child  # positional, as prometheus_client allows
    child.inc(7)
    with pytest.raises(ValueError, match="Incorrect label names"):
        counter.labels(cache_type="HiRadixCache", tp_rank=3)

    def pushed() -> list[Any]:
        return Scrape(engine_sidecar.metrics_text()).find("sglang:load_back_tokens_total")

    wait_until(lambda: bool(pushed()) and pushed()[0].value == 7)
    (sample,) = pushed()
    assert sample.labels == {"cache_type": "HiRadixCache", "tp_rank": "3", "pp_rank": "1", "dp_rank": "0",
                             "region": "eu", "pool": "kv"}
    assert documentation(engine_sidecar.metrics_text())["sglang:load_back_tokens"] == "Tokens, as the engine says."


def test_histograms_push_the_engines_buckets_and_gauges_ignore_multiprocess_mode(sidecar, in_process, monkeypatch):
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)
    rank = ["tp_rank", "pp_rank", "dp_rank"]
    histogram = in_process.SidecarHistogram("sglang:eviction_duration_seconds", "d", rank, buckets=[0.5, 2.0, float("inf")])
    child = histogram.labels(tp_rank=0, pp_rank=0, dp_rank=0)
    assert isinstance(child, HistogramChild) and child.bounds == (0.5, 2.0)
    gauge = in_process.SidecarGauge(name="sglang:hicache_host_used_tokens", documentation="g", labelnames=rank,
                                    multiprocess_mode="mostrecent")
    assert isinstance(gauge.labels(tp_rank=0, pp_rank=0, dp_rank=0), GaugeChild)


def test_a_repeated_bucket_bound_keeps_the_family_prometheus_clients_and_starts_no_client(sidecar, in_process,
                                                                                         monkeypatch, caplog):
    """prometheus_client takes a repeated bound, the sidecar's one layout rule (catalog.bucket_layout_problem)
    does not. Before, each label set started a push client, then fell back when its child was refused: the
    sidecar held a rank identity with no series. Now the family is decided once, at construction."""
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)
    histogram = in_process.SidecarHistogram("sglang:eviction_duration_seconds", "d", ["tp_rank", "pp_rank", "dp_rank"],
                                            buckets=[0.5, 0.5, 2.0])
    try:
        assert isinstance(histogram, prometheus_client.Histogram)
        histogram.labels(tp_rank=0, pp_rank=0, dp_rank=0).observe(1.0)
        assert "sglang:eviction_duration_seconds: buckets must be strictly ascending" in caplog.text
        assert in_process._clients.clients == {}
    finally:
        if isinstance(histogram, prometheus_client.Histogram):
            prometheus_client.REGISTRY.unregister(histogram)
        in_process._warned.discard("sglang:eviction_duration_seconds")


def test_the_hook_splits_labels_by_the_proxys_rule(engine_sidecar, in_process, monkeypatch, caplog):
    """exporter.labels.split_rank_labels: an empty value is no static label, and a rank axis has one spelling
    ("03" is no rank number; before, the hook's int() pushed it as rank 3 while the proxy refused it)."""
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", engine_sidecar.socket_path)
    counter = in_process.SidecarCounter(name="sglang:evicted_tokens_total", documentation="e",
                                        labelnames=["tp_rank", "pp_rank", "dp_rank", "priority"])
    made: list[Any] = []
    try:
        assert isinstance(counter.labels(tp_rank=0, pp_rank=0, dp_rank=0, priority=""), CounterChild)
        assert [static for (_, static) in in_process._clients.clients] == [()]
        odd = counter.labels(tp_rank="03", pp_rank=0, dp_rank=0, priority="")
        assert not isinstance(odd, CounterChild)
        assert "tp_rank='03' must be a whole number" in caplog.text
        made.append(counter._fallback)
    finally:
        for metric in made:
            prometheus_client.REGISTRY.unregister(metric)
        in_process._warned.discard("sglang:evicted_tokens_total")


def test_families_the_sidecar_cannot_take_stay_prometheus_clients(sidecar, in_process, monkeypatch, caplog):
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)
    made: list[Any] = []
    try:
        # Not in the catalog: the engine's own /metrics serves it.
        made.append(in_process.SidecarGauge(name="sglang:num_running_reqs", documentation="r", labelnames=["tp_rank"],
                                            multiprocess_mode="mostrecent"))
        assert isinstance(made[-1], prometheus_client.Gauge)
        # In the catalog, but without rank labels to tell the ranks apart.
        made.append(in_process.SidecarCounter(name="sglang:evicted_tokens_total", documentation="e", labelnames=["x"]))
        assert isinstance(made[-1], prometheus_client.Counter)
        # In the catalog as a counter, asked for as a gauge.
        made.append(in_process.SidecarGauge(name="sglang:backuped_tokens_total", documentation="b",
                                            labelnames=["tp_rank", "pp_rank", "dp_rank"]))
        assert isinstance(made[-1], prometheus_client.Gauge)
        # A rank identity that is not one (dp_rank None): this label set only stays prometheus_client's.
        counter = in_process.SidecarCounter(name="sglang:prefetched_tokens_total", documentation="p",
                                            labelnames=["tp_rank", "pp_rank", "dp_rank"])
        assert isinstance(counter.labels(tp_rank=0, pp_rank=0, dp_rank=0), CounterChild)
        odd = counter.labels(tp_rank=0, pp_rank=0, dp_rank=None)
        assert not isinstance(odd, CounterChild)
        odd.inc(2)
        assert "sglang:prefetched_tokens_total" in caplog.text and "is not pushed" in caplog.text
        assert counter._fallback is not None
        made.append(counter._fallback)
    finally:
        for metric in made:
            prometheus_client.REGISTRY.unregister(metric)


def test_the_sidecar_imports_neither_the_engine_nor_its_integration():
    probe = ("import sys, exporter.cli, exporter.sidecar.runner; "
             "print(sorted(m for m in sys.modules if m.split('.')[0] in {'sglang', 'torch'} "
             "or m.startswith('exporter.integrations')))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert result.stdout.strip() == "[]"
