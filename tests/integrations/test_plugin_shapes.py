"""The vLLM general plugin against LMCache of other shapes (issue 30, DESIGN section 15: the engine never pays).

vLLM loads every `vllm.general_plugins` entry point in every process it starts and calls each function with
no guard (vllm/plugins/__init__.py: `load_plugins_by_group` catches only a failing `load()`,
`load_general_plugins` then runs `func()` bare), so whatever `register()` raises stops the engine. Each case
runs in its own interpreter, as vLLM would, with an `lmcache` of one shape on its path: the released 0.5.6
(pushes), or a fake package of another shape, whose engine must go on with its own metrics as if this
package were absent, after exactly one warning line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SidecarThread, sidecar_config, wait_until

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT = 120

# What vLLM does with the group (vllm/plugins/__init__.py), then what the engine does next: the case's code.
VLLM = """\
import json, sys
from importlib.metadata import entry_points

import exporter
assert exporter.__file__.startswith(sys.argv[1]), exporter.__file__  # this checkout, not another install

plugins = {}
for plugin in entry_points(group="vllm.general_plugins"):
    try:
        plugins[plugin.name] = plugin.load()
    except Exception as err:  # as vLLM: a plugin that cannot load is logged, and the engine goes on
        print(f"Failed to load plugin {plugin.name}: {err}", file=sys.stderr)
assert "hicache_exporter_lmcache" in plugins, sorted(plugins)
for func in plugins.values():
    func()  # no guard, as vLLM
plugins["hicache_exporter_lmcache"]()  # a second call in one process changes nothing and says nothing more
"""

# The engine of a fake shape: its logger builds its metrics and counts, with the classes it had before.
FAKE_ENGINE = """\
import prometheus_client
from prometheus_client import REGISTRY
import lmcache.observability as observability

logger = observability.PrometheusLogger.GetOrCreate({"model_name": "m", "worker_id": "0"})
logger.hits.inc(7)
print(json.dumps({
    "counted": REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", {"model_name": "m", "worker_id": "0"}),
    "classes": {name: getattr(observability.PrometheusLogger, name, None).__name__
                for name in ("_counter_cls", "_gauge_cls", "_histogram_cls")
                if getattr(observability.PrometheusLogger, name, None) is not None},
}))
"""

# lmcache/observability.py of each fake shape; `{build}` makes its counter.
LOGGER = """\
import prometheus_client

class PrometheusLogger:
{attributes}

    def __init__(self, labels):
        self.hits = {build}("lmcache:num_hit_tokens", "hit tokens", labelnames=sorted(labels)).labels(**labels)

    @classmethod
    def GetOrCreate(cls, labels):
{get_or_create}
"""

DI_CLASSES = ("    _counter_cls = prometheus_client.Counter\n    _gauge_cls = prometheus_client.Gauge\n"
              "    _histogram_cls = prometheus_client.Histogram")
SINGLETON = "        if cls._instance is None:\n            cls._instance = cls(labels)\n        return cls._instance"
BY_LABELS = ("        key = tuple(sorted(labels.items()))\n        if key not in cls._instances:\n"
             "            cls._instances[key] = cls(labels)\n        return cls._instances[key]")

SHAPES: dict[str, dict[str, str]] = {
    # An older logger: one instance per process (`_instance`), no `_instances` to find a series' logger in.
    "older_singleton": {"lmcache/__init__.py": "", "lmcache/observability.py": LOGGER.format(
        attributes=f"    _instance = None\n{DI_CLASSES}", build="self._counter_cls", get_or_create=SINGLETON)},
    # A refactored logger that builds prometheus_client's classes directly: nothing to set them through.
    "no_metric_classes": {"lmcache/__init__.py": "", "lmcache/observability.py": LOGGER.format(
        attributes="    _instances = {}", build="prometheus_client.Counter", get_or_create=BY_LABELS)},
    # A module that moved the logger elsewhere.
    "no_prometheus_logger": {"lmcache/__init__.py": "", "lmcache/observability.py": "PrometheusLoggerV2 = None\n"},
    # Installed, but its CUDA extension cannot load on this host: the import itself fails with OSError.
    "import_oserror": {"lmcache/__init__.py": 'raise OSError("libcudart.so.12: cannot open shared object file: '
                                              'No such file or directory")\n'},
}


def run_engine(tmp: Path, engine: str, env: dict[str, str], packages: Path | None = None,
               prelude: str = "") -> subprocess.CompletedProcess[str]:
    """One engine process: `prelude`, vLLM's plugin loading, then `engine`; this checkout (and `packages`)
    first on its path."""
    script = tmp / "engine.py"
    script.write_text(prelude + VLLM + engine)
    path = [str(REPO)] + ([str(packages)] if packages else [])
    environment = {key: value for key, value in os.environ.items()
                   if not key.startswith(("HICACHE_EXPORTER_", "PROMETHEUS_MULTIPROC_DIR", "VLLM_"))}
    environment.update(env, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, str(script), str(REPO)], cwd=tmp, env=environment, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_another_shape_of_lmcache_leaves_the_engine_as_if_this_package_were_absent(shape: str, tmp_path: Path) -> None:
    packages = tmp_path / "site"
    for name, text in SHAPES[shape].items():
        (packages / name).parent.mkdir(parents=True, exist_ok=True)
        (packages / name).write_text(text)
    engine = FAKE_ENGINE if shape in ("older_singleton", "no_metric_classes") else 'print(json.dumps({"went_on": True}))\n'
    done = run_engine(tmp_path, engine, {"HICACHE_EXPORTER_SOCKET": str(tmp_path / "nobody.sock")}, packages)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "LMCache" in lines[0] and "not pushed" in lines[0], done.stderr  # one line, once
    if shape == "older_singleton":  # the engine's own classes untouched, its counter counted
        assert report == {"counted": 7.0, "classes": {"_counter_cls": "Counter", "_gauge_cls": "Gauge",
                                                       "_histogram_cls": "Histogram"}}
    elif shape == "no_metric_classes":  # nothing was added to the logger
        assert report == {"counted": 7.0, "classes": {}}
    else:
        assert report == {"went_on": True}
    if shape == "import_oserror":
        assert "OSError: libcudart.so.12" in lines[0]  # says why


# The released lmcache.observability cannot be imported here (torch, CUDA): it is compiled from the wheel and
# registered under its own name first, as if the engine had imported it before the plugins load.
RELEASED_PRELUDE = """\
import os
import prometheus_client  # before LMCache sets PROMETHEUS_MULTIPROC_DIR: values stay in-process
from tests.upstream_lmcache import install

os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(os.getcwd(), "mp")  # not /tmp's
lmcache = install()
"""

RELEASED_ENGINE = """\
metadata = lmcache.LMCacheMetadata(
    model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0, kv_dtype=None,
    kv_shape=(1, 2, 256, 8, 128), role="worker", served_model_name="s", engine_id="e0")
logger = lmcache.PrometheusLogger.GetOrCreate(metadata)
monitor = lmcache.LMCStatsMonitor.GetOrCreate()
monitor.on_retrieve_finished(monitor.on_retrieve_request(128), 100)
logger.log_prometheus(monitor.get_stats_and_clear())
print(json.dumps({"counter_class": type(logger.counter_num_hit_tokens).__name__}))
"""


def test_the_released_lmcache_under_vllms_plugin_loading_pushes_its_counters(
        released_wheel: Path, socket_dir: Path, tmp_path: Path) -> None:
    sidecar = SidecarThread(sidecar_config(socket_dir / "m.sock", metrics={"profiles": ["lmcache"]})).start()
    try:
        done = run_engine(tmp_path, RELEASED_ENGINE, {
            "HICACHE_EXPORTER_SOCKET": sidecar.socket_path, "HICACHE_EXPORTER_PUSH_INTERVAL": "0.05",
            "HICACHE_LMCACHE_WHEEL": str(released_wheel)},
            prelude=RELEASED_PRELUDE)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout.splitlines()[-1]) == {"counter_class": "PushingCounter"}
        assert "not pushed" not in done.stderr, done.stderr
        # The process has exited: its last snapshot went out at exit, whatever the interval had pushed.
        wait_until(lambda: hit_tokens(sidecar) == [100.0], 60)
    finally:
        sidecar.stop()


def hit_tokens(sidecar: SidecarThread) -> list[Any]:
    """The worker's hit tokens as the sidecar shows them (one series, or none yet)."""
    return [s.value for s in sidecar.scrape().find("lmcache_num_hit_tokens_total", tp_rank="0", worker_id="0")]
