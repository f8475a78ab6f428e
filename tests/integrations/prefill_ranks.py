"""Scheduler processes that count known prefill tokens by tier through the released SchedulerMetricsCollector.

Importing this module registers the released collector module (through tests.integrations.ranks), so a
process spawned with a function of this module as its target can unpickle the stat-logger classes it is
given, as the engine's scheduler processes do.

The server runs DP attention: tp_size 4 over 2 dp groups, 2 attention tp ranks each. With
--enable-metrics-for-all-schedulers every scheduler builds the collector (metrics_collector.py:1361-1404),
and each counts its dp group's prefill batches: the group's attention tp ranks are replicas that agree.
The count is the engine's own call, `increment_effective_prefill_tokens`
(scheduler_components/metrics_reporter.py:~835, metrics_collector.py:1580-1596), which increments
`sglang:prefill_effective_tokens_total{mode}` for `input`, `device_hit`, `host_hit` and `storage_hit`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tests.integrations.ranks import CACHE_TYPE, Rank, Server, drive, publish_parallel, released, storage_labels

SERVER = Server(tp_size=4, attn_dp_size=2)
WORLD = "tp=4,dp=2,pp=1,cp=1,dp-attention"  # the same server, as `--upstream-world` states it
MODES = ("input", "device_hit", "host_hit", "storage_hit")
Batch = tuple[int, int, int, int]  # tokens by mode, in MODES' order

# Each dp group's prefill batches, as the scheduler reports them: the groups serve different traffic.
BATCHES: dict[int, tuple[Batch, ...]] = {
    0: ((300, 500, 128, 0), (120, 256, 64, 32), (0, 640, 0, 0)),
    1: ((700, 64, 0, 96), (212, 0, 192, 0)),
}


def group_tokens(dp_rank: int) -> dict[str, int]:
    """What one replica of dp group `dp_rank` counted, by mode."""
    return {mode: sum(batch[n] for batch in BATCHES[dp_rank]) for n, mode in enumerate(MODES)}


def scheduler_labels(parallel: Any) -> dict[str, Any]:
    """The scheduler collector's labels, as SchedulerMetricsCollector.init_new builds them (1382-1392)."""
    labels: dict[str, Any] = {"model_name": "qwen", "engine_type": "unified", "tp_rank": parallel.tp_rank,
                              "pp_rank": parallel.pp_rank, "moe_ep_rank": 0}  # no expert parallelism
    if parallel.dp_rank is not None:
        labels["dp_rank"] = parallel.dp_rank
    return labels


def cache_rank(tp_rank: int) -> Rank:
    """The attention rank of the engine's tp rank `tp_rank`: whose radix and storage events it reports
    (tests.integrations.ranks.events: tokens by dp group, bytes and seconds by shard)."""
    attn_tp = SERVER.tp_size // SERVER.attn_dp_size
    return Rank(tp_rank=tp_rank % attn_tp, dp_rank=tp_rank // attn_tp, tp_size=attn_tp, dp_size=SERVER.attn_dp_size)


def count_prefill(loggers: Mapping[str, type] | None, tp_rank: int) -> None:
    """A scheduler process at the engine's tp rank `tp_rank`: its runtime context published; its radix and
    storage collectors (the stat-logger classes, or the released ones when None) labelled as the engine labels
    them and their events reported (what the tiers moved: the costs); its scheduler collector built and its dp
    group's batches counted."""
    parallel = publish_parallel(SERVER, tp_rank)
    rank = cache_rank(tp_rank)
    assert (rank.tp_rank, rank.dp_rank) == (parallel.attn_tp_rank, parallel.attn_dp_rank)

    def role(name: str, default: type) -> Any:
        return default if loggers is None else loggers[name]

    drive({
        # The engine's call (mem_cache/base_prefix_cache.py:408), on the published context.
        "radix": role(released.STAT_LOGGER_ROLE_RADIX_CACHE, released.RadixCacheMetricsCollector)(
            labels=released.radix_cache_metric_labels(CACHE_TYPE, parallel, parallel.attn_dp_enabled)),
        "storage": role(released.STAT_LOGGER_ROLE_STORAGE, released.StorageMetricsCollector)(
            labels=storage_labels(rank)),
    }, rank)
    cls = role(released.STAT_LOGGER_ROLE_SCHEDULER, released.SchedulerMetricsCollector)
    collector = cls(labels=scheduler_labels(parallel), server_args=None, enable_hierarchical_cache=True)
    for batch in BATCHES[parallel.attn_dp_rank]:
        collector.increment_effective_prefill_tokens(
            input_tokens=batch[0], device_hit_tokens=batch[1], host_hit_tokens=batch[2], storage_hit_tokens=batch[3])
