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

import ast
import hashlib
import os
import subprocess
import sys
import types
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
WHEEL_NAME = f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
WHEEL_SHA256 = "00b3cd5b265ac76c64185fbb6b95424f324ddd9f428d0306b77bc9db9d859937"
WHEEL_ENV = "HICACHE_SGLANG_WHEEL"
CACHE_DIR = Path(__file__).resolve().parent.parent / ".cache" / "sglang"
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


class WheelUnavailable(RuntimeError):
    """The released wheel could not be found or fetched; the message is one line."""


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
    named = os.environ.get(WHEEL_ENV)
    if named:
        path = Path(named)
        if not path.is_file():
            raise WheelUnavailable(f"{WHEEL_ENV}={named} is not a file")
        return _checked(path)
    cached = CACHE_DIR / WHEEL_NAME
    if cached.is_file():
        return _checked(cached)
    return _checked(download(CACHE_DIR))


def download(directory: Path) -> Path:
    """Fetch the wheel alone (no dependencies) with pip into `directory`; return its path."""
    directory.mkdir(parents=True, exist_ok=True)
    # The platform flags name the released file whatever Python runs the tests: only its
    # Python source is used.
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
        "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
        "--platform", "manylinux_2_34_x86_64", f"sglang=={SGLANG_VERSION}", "-d", str(directory),
    ]
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=240)  # within pytest's 300 s
    except (OSError, subprocess.TimeoutExpired) as err:
        raise WheelUnavailable(f"pip download sglang=={SGLANG_VERSION} failed: {err}") from None
    path = directory / WHEEL_NAME
    if result.returncode != 0 or not path.is_file():
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        raise WheelUnavailable(
            f"pip download sglang=={SGLANG_VERSION} failed ({last}); set {WHEEL_ENV} to a copy of {WHEEL_NAME}"
        )
    return path


def _checked(path: Path) -> Path:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise WheelUnavailable(f"{path} has SHA-256 {digest}, not the released {WHEEL_NAME}'s {WHEEL_SHA256}")
    return path


def select_definitions(source: str, names: Iterable[str], filename: str,
                       third_party: Iterable[str] = ()) -> list[ast.stmt]:
    """Standard-library (and named `third_party`) imports and exactly the top-level definitions named, in source order."""
    wanted, allowed = set(names), set(third_party)
    tree = ast.parse(source, filename)
    chosen: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if all(_is_stdlib(module) or module.split(".")[0] in allowed for module in _imported_modules(node)):
                chosen.append(node)
            continue
        defined = _defined_names(node) & wanted
        if defined:
            chosen.append(node)
            found |= defined
    missing = wanted - found
    if missing:
        raise WheelUnavailable(f"{filename} no longer defines {sorted(missing)}")
    return chosen


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""] if node.level == 0 else [""]
    return [alias.name for alias in node.names]


def _is_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {target.id for target in node.targets if isinstance(target, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()


def install() -> types.ModuleType:
    """Register the released collector module under its own name (once per process) and return it."""
    module = sys.modules.get(COLLECTOR_MODULE)
    if module is not None and getattr(module, "__released_from__", None):
        return module
    wheel = wheel_path()
    module = types.ModuleType(COLLECTOR_MODULE, "SGLang's metrics collectors, compiled from the released wheel")
    module.__file__ = f"{wheel}/{DEFINITIONS[-1][0]}"
    module.__released_from__ = str(wheel)  # type: ignore[attr-defined]
    module.__dict__.update(RUNTIME_STUBS)
    for package in ("sglang", "sglang.srt", "sglang.srt.observability"):
        if package not in sys.modules:  # empty namespace packages: nothing else of the engine imports
            parent = types.ModuleType(package)
            parent.__path__ = []
            sys.modules[package] = parent
    sys.modules[COLLECTOR_MODULE] = module  # dataclasses look their module up while the classes are built
    try:
        with zipfile.ZipFile(wheel) as archive:
            for inner, names in DEFINITIONS:
                source = archive.read(inner).decode("utf-8")
                filename = f"{wheel}/{inner}"
                body = ast.Module(body=select_definitions(source, names, filename), type_ignores=[])
                exec(compile(body, filename, "exec", dont_inherit=True), module.__dict__)
    except BaseException:
        del sys.modules[COLLECTOR_MODULE]
        raise
    sys.modules["sglang.srt.observability"].metrics_collector = module  # type: ignore[attr-defined]
    return module


if __name__ == "__main__":  # `python -m tests.upstream_sglang`: fetch the wheel ahead of the tests
    try:
        print(f"sglang {SGLANG_VERSION} collectors from {install().__released_from__}")
    except WheelUnavailable as err:
        sys.exit(f"tests.upstream_sglang: {err}")
