"""Rank processes for the SGLang integration tests: the released collectors driven by one script of events.

Importing this module registers the released collector module (tests.upstream_sglang), so a
process spawned with a function of this module as its target can unpickle the stat-logger
classes it is given: they travel by reference, as they do into the engine's scheduler processes.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import ModuleType, SimpleNamespace
from typing import Any

from tests import upstream_sglang

released = upstream_sglang.install()

CACHE_TYPE = "UnifiedRadixCache"
STORAGE_BACKEND = "file"
Event = tuple[str, str, tuple[Any, ...]]  # (collector: "radix" | "storage", method, arguments)


@dataclass(frozen=True)
class Rank:
    """One scheduler rank's place; with dp_size > 1 the engine runs DP attention (tp_rank is the attention TP rank)."""

    tp_rank: int
    dp_rank: int
    pp_rank: int = 0
    tp_size: int = 2
    dp_size: int = 2
    pp_size: int = 1

    @property
    def shard(self) -> int:
        """1 + this rank's position among all shards: what makes its bytes and seconds its own."""
        return 1 + self.tp_rank + self.tp_size * (self.pp_rank + self.pp_size * self.dp_rank)


def ranks(tp: int = 2, dp: int = 2, pp: int = 1) -> list[Rank]:
    return [Rank(t, d, p, tp, dp, pp) for d in range(dp) for p in range(pp) for t in range(tp)]


def radix_labels(rank: Rank) -> dict[str, Any]:
    """The radix cache's labels, from the released radix_cache_metric_labels."""
    parallel = SimpleNamespace(
        tp_rank=rank.tp_rank + rank.tp_size * rank.dp_rank, attn_tp_rank=rank.tp_rank,
        attn_dp_rank=rank.dp_rank, pp_rank=rank.pp_rank,
    )
    labels: dict[str, Any] = released.radix_cache_metric_labels(CACHE_TYPE, parallel, rank.dp_size > 1)
    return labels


def storage_labels(rank: Rank) -> dict[str, Any]:
    """The storage collector's labels, built as mem_cache/unified_cache/storage_attachment.py builds them."""
    return {
        "storage_backend": STORAGE_BACKEND, "tp_rank": rank.tp_rank, "dp_rank": rank.dp_rank,
        "pp_rank": rank.pp_rank, "pp_size": rank.pp_size, "attn_cp_rank": 0, "attn_cp_size": 1,
    }


def events(rank: Rank) -> list[Event]:
    """What one rank's caches report: tokens depend on its dp group only (its replicas agree),
    bytes and seconds on its own shard; the groups do different amounts of work."""
    group, shard = rank.dp_rank, rank.shard
    out: list[Event] = []
    for step in range(1, 4 + group):
        out += [
            ("radix", "increment_load_back_num_tokens", (64 * step, "kv")),
            ("radix", "increment_load_back_num_bytes", (4096 * shard * step,)),
            ("radix", "observe_load_back_duration", (0.0015 * shard * step,)),
            ("radix", "increment_backup_num_tokens", (32 * step, "kv")),
            ("radix", "increment_backup_num_bytes", (2048 * shard * step,)),
            ("radix", "observe_backup_duration", (0.003 * shard,)),
            ("radix", "increment_eviction_num_tokens", (16 * (group + 1),)),
            ("radix", "observe_eviction_duration", (0.0007 * step,)),
            ("storage", "log_storage_prefetch_hit_tokens", (128 * step,)),
            ("storage", "log_prefetched_tokens", (96 * step,)),
            ("storage", "log_storage_prefetch_unfulfilled_tokens", (32 * step, "deadline")),
            ("storage", "log_storage_prefetch_deferred_tokens", (4, "host_capacity")),
            ("storage", "log_backuped_tokens", (64,)),
            ("storage", "log_storage_metrics", (released.StorageMetrics(
                prefetch_pgs=[2 * step], backup_pgs=[1], prefetch_bandwidth=[0.7 * shard],
                backup_bandwidth=[3.0 * shard]),)),
        ]
    out += [
        ("radix", "increment_dropped_tokens", (8 * (group + 1), "host_pressure", "kv")),
        ("storage", "log_storage_prefetch_unfulfilled_tokens", (16, "storage_transfer")),
        ("storage", "log_storage_prefetch_unfulfilled_tokens", (8 * (group + 1), "shrunk")),  # created lazily
        ("storage", "log_backup_dropped_tokens", (2 * (group + 1),)),
        ("storage", "log_prefetch_aux_alloc_failed_tokens", (5,)),
    ]
    return out


def total(rank: Rank, method: str, *extra: Any) -> float:
    """The sum of the first argument of `rank`'s `method` events whose other arguments are `extra`."""
    return sum(args[0] for _, name, args in events(rank) if name == method and tuple(args[1:]) == extra)


def drive(collectors: Mapping[str, Any], rank: Rank) -> None:
    for which, method, args in events(rank):
        getattr(collectors[which], method)(*args)


def collectors_for(loggers: Mapping[str, type] | None, rank: Rank) -> dict[str, Any]:
    """The rank's radix and storage collectors: the stat-logger classes, or the released ones when None."""
    radix_cls = loggers["radix_cache"] if loggers else released.RadixCacheMetricsCollector
    storage_cls = loggers["storage"] if loggers else released.StorageMetricsCollector
    return {"radix": radix_cls(labels=radix_labels(rank)), "storage": storage_cls(labels=storage_labels(rank))}


# --- process targets ---


def run_rank(loggers: Mapping[str, type] | None, rank: Rank) -> None:
    """A rank process: build the collectors, report the events, exit normally (a last push at exit)."""
    drive(collectors_for(loggers, rank), rank)


def run_released_rank(rank: Rank, results: Connection) -> None:
    """The engine as it runs without the hook: the released collectors on prometheus_client (in
    multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set); sends back the HELP texts they gave."""
    from prometheus_client import REGISTRY

    drive(collectors_for(None, rank), rank)
    results.send({metric.name: metric.documentation for metric in REGISTRY.collect() if metric.name.startswith("sglang:")})


def run_context_parallel_rank(loggers: Mapping[str, type], rank: Rank, cp_rank: int, cp_size: int) -> None:
    """A CP peer: the engine's runtime context says which CP rank this process is (a stand-in
    for sglang.srt.runtime_context, which needs the engine installed); its radix labels are its peers'."""
    context = SimpleNamespace(attn_cp_rank=cp_rank, attn_cp_size=cp_size)
    module = ModuleType("sglang.srt.runtime_context")
    module.get_parallel = lambda: context  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    collector = loggers["radix_cache"](labels=radix_labels(rank))
    for _, method, args in events(rank):
        if method in {"increment_load_back_num_tokens", "increment_load_back_num_bytes"}:
            getattr(collector, method)(*args)


def serve_rank(loggers: Mapping[str, type], rank: Rank, commands: Connection) -> None:
    """A rank of the stand-in engine: report one round of events per `generate`, leave on `shutdown`."""
    collectors = collectors_for(loggers, rank)
    while (command := commands.recv()) != "shutdown":
        assert command == "generate", command
        drive(collectors, rank)
        commands.send("done")


def report_scheduler(loggers: Mapping[str, type], labels: dict[str, Any]) -> Any:
    """The released scheduler collector through the stat-logger class, having logged statistics and prefill tokens."""
    collector = loggers["scheduler"](labels=labels, server_args=None, enable_hierarchical_cache=True)
    collector.log_stats(released.SchedulerStats(
        num_running_reqs=released.QueueCount(total=3), hicache_host_used_tokens=512, hicache_host_total_tokens=4096,
        hicache_host_mamba_used_states=3, hicache_host_mamba_total_states=8,
    ))
    collector.increment_effective_prefill_tokens(input_tokens=100, device_hit_tokens=40, host_hit_tokens=25,
                                                 storage_hit_tokens=10)
    return collector


def run_scheduler(loggers: Mapping[str, type], labels: dict[str, Any], results: Connection) -> None:
    """The released scheduler collector: log statistics and prefill tokens, then send back what
    prometheus_client's own registry holds in this process."""
    from prometheus_client import REGISTRY, generate_latest

    report_scheduler(loggers, labels)
    results.send(generate_latest(REGISTRY).decode())


# --- an engine process's runtime context: the released sglang/srt/runtime_context.py ---


@dataclass(frozen=True)
class Server:
    """A server's configured parallel leaves (ServerArgs' `parallel` namespace, as resolved: DP attention
    is `attn_dp_size`, DP-controller replicas `dp_size`)."""

    tp_size: int
    attn_dp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    attn_cp_size: int = 1


def runtime_context() -> ModuleType:
    """The released sglang.srt.runtime_context, imported from the wheel itself (zipimport) in this process.

    The module needs msgspec and the wheel's arg_groups package, nothing else, until it asks
    sglang.srt.server_args's `ServerArgs` which of its fields are parallel leaves; ServerArgs imports
    most of the engine, so a module whose `ServerArgs` is the wheel's own `parallel` namespace class
    (arg_groups/fields/parallel.py `Parallel`, exactly those leaves) stands in for that module.
    """
    wheel = released.__released_from__
    for package in ("sglang", "sglang.srt"):
        inside = f"{wheel}/{package.replace('.', '/')}"
        if inside not in sys.modules[package].__path__:
            sys.modules[package].__path__.append(inside)
    if "sglang.srt.server_args" not in sys.modules:
        from sglang.srt.arg_groups.fields.parallel import Parallel

        stand_in = ModuleType("sglang.srt.server_args")
        stand_in.ServerArgs = Parallel  # type: ignore[attr-defined]
        sys.modules[stand_in.__name__] = stand_in
    return importlib.import_module("sglang.srt.runtime_context")


def publish_parallel(server: Server, tp_rank: int, pp_rank: int = 0, replica: int | None = None) -> Any:
    """This process's `get_parallel()`, stated as a scheduler process of `server` at (tp_rank, pp_rank) has it.

    The engine's publish (managers/scheduler.py:6327) computes the derived widths and ranks from the
    configured leaves; here the wheel's own functions compute them (runtime_context.py:73-225), and
    `override_permanently`, the context's way to state values without a published ServerArgs,
    sets them. Its own check rejects an inconsistent topology.
    """
    context = runtime_context()
    leaves = {"tp_size": server.tp_size, "pp_size": server.pp_size, "dp_size": server.dp_size,
              "attn_dp_size": server.attn_dp_size, "attn_cp_size": server.attn_cp_size}
    config = SimpleNamespace(**leaves, ep_size=1, moe_dp_size=1, dcp_size=1)
    widths = context.parallel_widths_of(config)
    ranks = context.derive_spawn_ranks(
        world_rank=server.tp_size * pp_rank + tp_rank, tp_size=server.tp_size, ep_join_rank_offset=0,
        attn_cp_size=server.attn_cp_size, attn_tp_size=widths["attn_tp_size"], moe_dp_size=1, moe_ep_size=1)
    attn_tp_rank, attn_dp_rank = context.derive_attention_ranks(
        tp_rank=tp_rank, attn_tp_size=widths["attn_tp_size"], attn_cp_size=server.attn_cp_size)
    parallel = context.get_parallel()
    parallel.override_permanently(
        **leaves, attn_tp_size=widths["attn_tp_size"], num_dp_ranks=context.num_dp_ranks_of(config),
        # attn_dp_enabled_of (runtime_context.py:191) also counts elastic EP scale joiners, not modelled here.
        attn_dp_enabled=server.attn_dp_size > 1,
        tp_rank=ranks["tp_rank"], pp_rank=ranks["pp_rank"], attn_cp_rank=ranks["attn_cp_rank"],
        attn_tp_rank=attn_tp_rank, attn_dp_rank=attn_dp_rank,
        # The launcher numbers a DP-attention scheduler by its attention dp group
        # (managers/data_parallel_controller.py:717-723), a replica's by the replica.
        dp_rank=attn_dp_rank if server.attn_dp_size > 1 else replica,
    )
    return parallel


def serve_engine_rank(loggers: Mapping[str, type], server: Server, tp_rank: int, commands: Connection) -> None:
    """A scheduler process of `server` at the engine's tp rank `tp_rank`: its runtime context published, its
    radix and storage collectors labelled from it as the engine labels them and one round of events
    reported; an attention-TP leader also runs the scheduler collector (metrics_collector.py:1361-1391).
    Sends "ready", then leaves on "shutdown"."""
    parallel = publish_parallel(server, tp_rank)
    rank = Rank(tp_rank=parallel.attn_tp_rank, dp_rank=parallel.attn_dp_rank, pp_rank=parallel.pp_rank,
                tp_size=parallel.attn_tp_size, dp_size=parallel.num_dp_ranks, pp_size=parallel.pp_size)
    collectors = {
        # The engine's call (mem_cache/base_prefix_cache.py:408), on the published context.
        "radix": loggers["radix_cache"](labels=released.radix_cache_metric_labels(
            CACHE_TYPE, parallel, parallel.attn_dp_enabled)),
        "storage": loggers["storage"](labels=storage_labels(rank)),
    }
    drive(collectors, rank)
    if parallel.attn_tp_rank == 0 and parallel.attn_cp_rank == 0:
        labels = {"model_name": "qwen", "engine_type": "unified", "tp_rank": parallel.tp_rank,
                  "pp_rank": parallel.pp_rank, "moe_ep_rank": 0}
        if parallel.dp_rank is not None:
            labels["dp_rank"] = parallel.dp_rank
        collectors["scheduler"] = report_scheduler(loggers, labels)
    commands.send("ready")
    command = commands.recv()
    assert command == "shutdown", command


def first_events(rank: Rank, count: int) -> list[Event]:
    """The first `count` events of `rank`: a restarted engine that has done less work so far."""
    return events(rank)[:count]


def partial_total(rank: Rank, count: int, method: str, *extra: Any) -> float:
    """`total` over the first `count` events only."""
    return sum(args[0] for _, name, args in first_events(rank, count) if name == method and tuple(args[1:]) == extra)


def run_released_rank_partly(rank: Rank, count: int) -> None:
    """The released collectors (in multiprocess mode when PROMETHEUS_MULTIPROC_DIR is set), the first `count` events."""
    collectors = collectors_for(None, rank)
    for which, method, args in first_events(rank, count):
        getattr(collectors[which], method)(*args)



def report_worlds(servers: list[Server], results: Connection) -> None:
    """What the hook reads as the server's world in a scheduler process: before any layout is published,
    then as a rank of each of `servers` in turn (World's keys, or None where it would send none)."""
    from exporter.integrations.sglang import _server_world

    parallel = runtime_context().get_parallel()
    worlds = [_server_world()]
    for server in servers:
        publish_parallel(server, tp_rank=0)
        worlds.append(_server_world())
        parallel.clear_stamp()
    results.send(worlds)


def report_replicas(results: Connection) -> None:
    """The dp_rank the hook gives a replica's radix and storage streams (whose labels say 0): the
    DP-controller replica under replicas, none under DP attention (its labels carry the dp group)."""
    from exporter.integrations.sglang import _replica_dp_rank

    parallel = runtime_context().get_parallel()
    found = []
    for server, replica in ((Server(tp_size=2, dp_size=3), 2), (Server(tp_size=4, attn_dp_size=2), None)):
        publish_parallel(server, tp_rank=3 if server.attn_dp_size > 1 else 1, replica=replica)
        found.append(_replica_dp_rank())
        parallel.clear_stamp()
    results.send(found)
