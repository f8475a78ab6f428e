"""LMCache's released metrics code (`PrometheusLogger` and what feeds it), run from its wheel without installing it.

Importing `lmcache.observability` needs torch, psutil, aiohttp, requests, numpy, cachetools and
py-cpuinfo, and the wheel carries CUDA extensions. Its metrics path needs only prometheus_client. So,
as tests/upstream_sglang.py does for SGLang, the tests fetch the released wheel (without its
dependencies), pull exactly the top-level definitions they need out of its sources with `ast`, and
compile them, unchanged, into one module registered as `lmcache.observability`:

* `lmcache/logging.py`: `init_logger` and its formatter (standard library only), for `logger`;
* `lmcache/utils.py`: `thread_safe` and its lock, which guard the stats monitor;
* `lmcache/v1/metadata.py`: `LMCacheMetadata`, which `PrometheusLogger._metadata_to_labels` reads
  (observability.py:1905-1913; the real module imports it by name too, observability.py:28);
* `lmcache/observability.py`: `logger`, the stats dataclasses, `LMCStatsMonitor` (which counts the
  events), `PrometheusLogger` (which turns a monitor's interval stats into metrics) and
  `reset_observability_metrics`. `LMCacheStatsLogger`, the thread that moves stats from one to the
  other every `log_interval` seconds and sends usage telemetry, is left out: tests make its one
  step, `log_prometheus(monitor.get_stats_and_clear())` (observability.py:1975-1982), themselves.

Stubs (what the metrics path does not touch): only `torch` in the compiled module's namespace, a
stand-in whose `dtype` and `Size` the annotations of `LMCacheMetadata` name (evaluated when the
class and its `get_dtypes`/`get_shapes` are built; those two methods, the only users of torch, are
not on the metrics path).

The wheel comes from, in order: the file named by `HICACHE_LMCACHE_WHEEL`; the cache
`.cache/lmcache/` in the repository (git-ignored); the package index, by
`python -m pip download --no-deps --only-binary=:all: lmcache==0.5.6` into that cache. Its SHA-256
is checked against the released file's (as PyPI lists it). When no wheel can be had, `install()`
raises `WheelUnavailable` with a one-line reason, and the tests fail on it (they never skip).
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

from tests.released_wheel import ReleasedWheel, WheelUnavailable, compile_released, installed

__all__ = ["LMCACHE_VERSION", "WheelUnavailable", "install", "wheel_path"]

LMCACHE_VERSION = "0.5.6"
WHEEL = ReleasedWheel(
    project="lmcache", version=LMCACHE_VERSION,
    name=f"lmcache-{LMCACHE_VERSION}-cp311-cp311-manylinux_2_27_x86_64.manylinux_2_28_x86_64.whl",
    sha256="14530ff72b96056e894c9b8dc70c10d019e7802799bbfde9cec298700b799194",  # 17,659,257 bytes
    env="HICACHE_LMCACHE_WHEEL", platform="manylinux_2_28_x86_64")
OBSERVABILITY_MODULE = "lmcache.observability"

# (file in the wheel, top-level names taken from it), compiled in this order into one module: each
# file's definitions use names the files before it defined.
DEFINITIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("lmcache/logging.py", ("build_format", "CustomFormatter", "get_log_level", "init_logger")),
    ("lmcache/utils.py", ("_shared_observability_lock", "thread_safe")),
    ("lmcache/v1/metadata.py", ("LMCacheMetadata",)),
    ("lmcache/observability.py", (
        "logger", "LMCacheStats", "LookupRequestStats", "RetrieveRequestStats", "StoreRequestStats",
        "P2PTransferRequestStats", "LMCStatsMonitor", "PrometheusLogger", "reset_observability_metrics",
    )),
)
THIRD_PARTY = ("prometheus_client",)  # observability.py imports it at top level (20-21)


class _TorchStub:
    """Stands in for `torch` where `LMCacheMetadata` is built: only its annotations name torch.dtype and torch.Size."""

    dtype = type("dtype", (), {"__module__": "torch (stand-in)"})
    Size = tuple


def wheel_path() -> Path:
    """The released wheel: from `HICACHE_LMCACHE_WHEEL`, the repository cache, or the package index."""
    return WHEEL.path()


def install() -> types.ModuleType:
    """Register the released `lmcache.observability` (the parts above) under its own name, once per process."""
    return installed(OBSERVABILITY_MODULE) or compile_released(
        wheel_path(), OBSERVABILITY_MODULE, "LMCache's metrics path, compiled from the released wheel", DEFINITIONS,
        {"torch": _TorchStub}, THIRD_PARTY)


if __name__ == "__main__":  # `python -m tests.upstream_lmcache`: fetch the wheel ahead of the tests
    try:
        print(f"lmcache {LMCACHE_VERSION} PrometheusLogger from {install().__released_from__}")
    except WheelUnavailable as err:
        sys.exit(f"tests.upstream_lmcache: {err}")
