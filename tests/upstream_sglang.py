"""The released SGLang engine's own collector code, run from its wheel without installing the engine.

`pip install sglang` pulls a CUDA torch of several GB, and importing
`sglang.srt.observability.metrics_collector` needs torch and a dozen other packages. The
collectors themselves need only prometheus_client. So the tests fetch the released wheel
(without its dependencies), read `metrics_collector.py` out of it, pull exactly the top-level
definitions they need out of that source with `ast`, and compile them, unchanged, into a module
registered as `sglang.srt.observability.metrics_collector`. Code that does
`from sglang.srt.observability.metrics_collector import RadixCacheMetricsCollector` (such as
`exporter.integrations.sglang`) then gets the released classes.

The wheel comes from, in order: the file named by `HICACHE_SGLANG_WHEEL`; the cache
`.cache/sglang/` in the repository (git-ignored); the package index, by
`python -m pip download --no-deps --only-binary=:all: sglang==0.5.23` into that cache. Its
SHA-256 is checked against the released file's. When no wheel can be had, `install()` raises
`WheelUnavailable` with a one-line reason, and the tests fail on it (they never skip).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

from tests.released_wheel import ReleasedWheel, WheelUnavailable, compile_released, installed

__all__ = ["SGLANG_VERSION", "WheelUnavailable", "install", "wheel_path"]

SGLANG_VERSION = "0.5.23"
WHEEL = ReleasedWheel(
    project="sglang", version=SGLANG_VERSION, name=f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl",
    sha256="00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937", env="HICACHE_SGLANG_WHEEL",
    platform="manylinux_2_34_x86_64")
COLLECTOR_MODULE = "sglang.srt.observability.metrics_collector"

# (file in the wheel, top-level names taken from it), compiled in this order into one module: first
# what the scheduler collector imports by name (a default argument uses one while its class is
# built), last the collector module itself.
DEFINITIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sglang/srt/observability/utils.py", ("exponential_buckets", "generate_buckets", "two_sides_exponential_buckets")),
    ("sglang/srt/utils/gauge_histogram.py", ("BucketLabels", "GaugeHistogram")),
    ("sglang/srt/observability/scheduler_stage_metrics.py", (
        "SCHEDULER_STAGE_OTHER", "SCHEDULER_STAGE_RECV_REQUESTS", "SCHEDULER_STAGE_PROCESS_REQUESTS",
        "SCHEDULER_STAGE_GET_NEXT_BATCH", "SCHEDULER_STAGE_PROCESS_QUEUE", "SCHEDULER_STAGE_RUN_BATCH",
        "SCHEDULER_STAGE_PROCESS_BATCH_RESULT", "SCHEDULER_STAGE_SANITY_CHECK_CACHE", "SCHEDULER_STAGE_IDLE",
        "SCHEDULER_STAGE_CATEGORIES",
        "FORWARD_OVERLAP_FULL", "FORWARD_OVERLAP_PARTIAL", "FORWARD_OVERLAP_NONE", "FORWARD_OVERLAP_CATEGORIES",
    )),
    ("sglang/srt/observability/metrics_collector.py", (
        "STAT_LOGGER_ROLE_SCHEDULER", "STAT_LOGGER_ROLE_TOKENIZER", "STAT_LOGGER_ROLE_STORAGE",
        "STAT_LOGGER_ROLE_RADIX_CACHE", "STAT_LOGGER_ROLE_EXPERT_DISPATCH",
        "_StatLoggerDIMixin", "get_histogram_conf_from_env",
        "radix_cache_metric_labels", "RadixCacheMetricsCollector",
        "StorageMetrics", "StorageMetricsCollector",
        "QueueCount", "SchedulerStats", "DPCooperationInfo", "ROUTING_KEY_REQ_COUNT_BUCKET_BOUNDS",
        "SchedulerMetricsCollector",
    )),
)


class _ScheduleStub:
    """Stands in for the engine's published `get_schedule()` bag: the prefill delayer's settings
    at their defaults (the scheduler collector reads them when it builds its histograms)."""

    prefill_delayer_max_delay_passes = 30
    prefill_delayer_forward_passes_buckets = None
    prefill_delayer_wait_seconds_buckets = None


# Runtime-context functions the scheduler collector calls while it is built. They read the
# engine's process-wide configuration, which does not exist outside a running engine.
RUNTIME_STUBS: dict[str, Any] = {
    "get_schedule": _ScheduleStub,
    "exports_expert_balancedness_to_prometheus": lambda: False,
}


def wheel_path() -> Path:
    """The released wheel: from `HICACHE_SGLANG_WHEEL`, the repository cache, or the package index."""
    return WHEEL.path()


def install() -> types.ModuleType:
    """Register the released collector module under its own name (once per process) and return it."""
    return installed(COLLECTOR_MODULE) or compile_released(
        wheel_path(), COLLECTOR_MODULE, "SGLang's metrics collectors, compiled from the released wheel", DEFINITIONS,
        RUNTIME_STUBS)


if __name__ == "__main__":  # `python -m tests.upstream_sglang`: fetch the wheel ahead of the tests
    try:
        print(f"sglang {SGLANG_VERSION} collectors from {install().__released_from__}")
    except WheelUnavailable as err:
        sys.exit(f"tests.upstream_sglang: {err}")
