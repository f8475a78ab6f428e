"""How exporter.integrations.lmcache gets into LMCache's processes: the vLLM general plugin the package
declares, `register()` (idempotent, nothing without LMCache), and the 42 `set_function` gauges of the
released logger pushed with their functions' values, read at snapshot time."""

from __future__ import annotations

import re
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from exporter.integrations import lmcache as hook
from tests.helpers import SidecarThread, sidecar_config, wait_until
from tests.integrations.support import SPAWN

REPO = Path(__file__).resolve().parents[2]
SYNC_TIMEOUT = 120
DYNAMIC_GAUGES = 42  # observability.py:1467-1672 (docs/lmcache-0.5.6.md section 2, rows 53-94)


def test_the_declared_vllm_plugin_is_register() -> None:
    # The table as pyproject.toml declares it (tomllib is Python 3.11+; the project supports 3.10).
    text = (REPO / "pyproject.toml").read_text()
    section = re.search(r'^\[project\.entry-points\."vllm\.general_plugins"\]\n((?:[^\[\n].*\n|\n)*)', text, re.M)
    assert section is not None
    lines = [line for line in section.group(1).splitlines() if line.strip() and not line.startswith("#")]
    plugins = dict(re.fullmatch(r'(\w+) = "([^"]+)"', line).groups() for line in lines)  # type: ignore[union-attr]
    assert plugins == {"hicache_exporter_lmcache": "exporter.integrations.lmcache:register"}
    entry = EntryPoint("hicache_exporter_lmcache", plugins["hicache_exporter_lmcache"], "vllm.general_plugins")
    assert entry.load() is hook.register


def test_register_without_lmcache_does_nothing() -> None:
    # A fresh interpreter of this environment, where LMCache is not installed (as in the sidecar's image).
    code = ("import importlib.util, sys; assert importlib.util.find_spec('lmcache') is None; "
            "import exporter.integrations.lmcache as h; h.register(); h.register(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('lmcache', 'vllm', 'torch')))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def patched_process(conn: Any) -> None:
    """register() twice where the released LMCache is importable: the classes once, then unchanged."""
    import prometheus_client

    from tests.upstream_lmcache import install

    lmcache = install()
    logger_cls = lmcache.PrometheusLogger
    before = (logger_cls._counter_cls, logger_cls._gauge_cls, logger_cls._histogram_cls)
    import exporter.integrations.lmcache as h

    h.register()
    once = (logger_cls._counter_cls, logger_cls._gauge_cls, logger_cls._histogram_cls)
    h.register()
    h.install()
    twice = (logger_cls._counter_cls, logger_cls._gauge_cls, logger_cls._histogram_cls)
    conn.send({
        "before": [cls is base for cls, base in zip(before, (prometheus_client.Counter, prometheus_client.Gauge,
                                                             prometheus_client.Histogram))],
        "once": [cls.__name__ for cls in once],
        "same": once == twice,
        "subclasses": [issubclass(new, old) for new, old in zip(once, before)],
    })



def spawn(target: Any, *args: Any) -> tuple[Any, Any]:
    receive, send = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=target, args=(*args, send))
    process.start()
    send.close()
    return process, receive


def test_register_patches_the_released_logger_classes_once(released_wheel: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_LMCACHE_WHEEL", str(released_wheel))
    process, receive = spawn(patched_process)
    assert receive.poll(SYNC_TIMEOUT)
    report = receive.recv()
    process.join(SYNC_TIMEOUT)
    assert process.exitcode == 0
    assert report == {"before": [True, True, True], "once": ["PushingCounter", "PushingGauge", "PushingHistogram"],
                      "same": True, "subclasses": [True, True, True]}


def gauges_process(socket_path: str, reading: Any, done: Any, conn: Any) -> None:
    """A worker whose logger's 42 dynamic gauges are all fed by functions, as LMCache's components feed them."""
    import os

    import prometheus_client  # noqa: F401  (before LMCache sets PROMETHEUS_MULTIPROC_DIR)

    from tests.upstream_lmcache import install

    lmcache = install()
    import exporter.integrations.lmcache as h

    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.path.join(os.path.dirname(socket_path), "mp")
    h.install(socket_path, interval=0.05)
    metadata = lmcache.LMCacheMetadata(
        model_name="m", world_size=2, local_world_size=2, worker_id=1, local_worker_id=1, kv_dtype=None,
        kv_shape=(1, 2, 256, 4, 128), role="worker", served_model_name="", engine_id="e1f0_dp3")
    logger = lmcache.PrometheusLogger.GetOrCreate(metadata)
    names = sorted(logger._dynamic_gauge_collectors)  # the 42 `set_function` gauges (observability.py:1488-1492)
    for number, name in enumerate(names):
        if name == "lmcache_is_healthy":
            getattr(logger, name).set_function(lambda: reading.value)
        else:
            getattr(logger, name).set_function(lambda number=number: number + 1)
    conn.send(names)
    done.wait(SYNC_TIMEOUT)


def test_the_42_set_function_gauges_push_their_functions_values(released_wheel: Path, socket_dir: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HICACHE_LMCACHE_WHEEL", str(released_wheel))
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    sidecar = SidecarThread(sidecar_config(socket_dir / "m.sock", metrics={"profiles": ["lmcache"]})).start()
    reading, done = SPAWN.Value("d", 1.0), SPAWN.Event()
    process, receive = spawn(gauges_process, sidecar.socket_path, reading, done)
    try:
        assert receive.poll(SYNC_TIMEOUT)
        names = receive.recv()
        assert len(names) == DYNAMIC_GAUGES
        # worker 1 of world 2 (tp 2, pp 1), replica 3 from the engine id; no served_model_name label (empty).
        rank = {"tp_rank": "1", "pp_rank": "0", "dp_rank": "3", "worker_id": "1", "model_name": "m", "role": "worker"}
        expected = {f"lmcache_{name}": float(number + 1) for number, name in enumerate(names)}
        expected["lmcache_lmcache_is_healthy"] = 1.0

        def pushed() -> dict[str, float]:
            """The rank's series of the expected families that carry exactly the rank's labels, by name."""
            scrape = sidecar.scrape()
            values = {}
            for name in expected:
                found = scrape.find(name, **rank)
                if len(found) == 1 and set(found[0].labels) == set(rank):
                    values[name] = found[0].value
            return values

        wait_until(lambda: pushed() == expected, 60)
        reading.value = 0.0  # unhealthy: nobody calls set(), the next snapshot reads the function
        expected["lmcache_lmcache_is_healthy"] = 0.0
        wait_until(lambda: pushed() == expected, 60)
    finally:
        done.set()
        process.join(SYNC_TIMEOUT)
        sidecar.stop()
    assert process.exitcode == 0


def multiprocess_process(socket_path: str, counted: Any, go_on: Any, finish: Any, conn: Any) -> None:
    """A worker in LMCache's multiprocess mode (PROMETHEUS_MULTIPROC_DIR set before it started): 100 hit
    tokens, `reset_counters()`, 20 more."""
    from prometheus_client import REGISTRY

    from tests.upstream_lmcache import install

    lmcache = install()
    import exporter.integrations.lmcache as h

    h.install(socket_path, interval=0.05)
    metadata = lmcache.LMCacheMetadata(
        model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0, kv_dtype=None,
        kv_shape=(1, 2, 256, 8, 128), role="worker", served_model_name="s", engine_id="0a1b")
    logger = lmcache.PrometheusLogger.GetOrCreate(metadata)
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    own = {"model_name": "m", "worker_id": "0", "role": "worker", "served_model_name": "s"}
    monitor.on_retrieve_finished(monitor.on_retrieve_request(128), 100)
    logger.log_prometheus(monitor.get_stats_and_clear())
    counted.set()
    go_on.wait(SYNC_TIMEOUT)
    logger.reset_counters()
    after_reset = REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", own)
    monitor.on_retrieve_finished(monitor.on_retrieve_request(32), 20)
    logger.log_prometheus(monitor.get_stats_and_clear())
    conn.send([after_reset, REGISTRY.get_sample_value("lmcache:num_hit_tokens_total", own)])
    finish.wait(SYNC_TIMEOUT)  # its client keeps pushing until the parent has read the sidecar


def test_a_reset_in_multiprocess_mode_is_a_new_epoch_of_zeros_though_the_engine_keeps_its_value(
        released_wheel: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # prometheus_client cannot clear in multiprocess mode: the engine's counter reads its file back
    # (docs/lmcache-0.5.6.md section 5). The push door counts what happens, so its epoch starts at 0.
    monkeypatch.setenv("HICACHE_LMCACHE_WHEEL", str(released_wheel))
    directory = socket_dir / "mp"
    directory.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
    sidecar = SidecarThread(sidecar_config(socket_dir / "m.sock", metrics={"profiles": ["lmcache"]})).start()
    counted, go_on, finish = SPAWN.Event(), SPAWN.Event(), SPAWN.Event()
    process, receive = spawn(multiprocess_process, sidecar.socket_path, counted, go_on, finish)
    rank = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0", "worker_id": "0"}

    def shows(rank_value: float, rollup: float) -> bool:
        scrape = sidecar.scrape()
        series, rollups = scrape.find("lmcache_num_hit_tokens_total", **rank), scrape.find("lmcache_rollup_num_hit_tokens_total")
        return [s.value for s in series] == [rank_value] and [s.value for s in rollups] == [rollup]

    try:
        assert counted.wait(SYNC_TIMEOUT)
        wait_until(lambda: shows(100, 100), 60)
        go_on.set()
        assert receive.poll(SYNC_TIMEOUT)
        engine = receive.recv()
        wait_until(lambda: shows(20, 120), 60)
        assert any(directory.iterdir())  # the engine's values are in its files: multiprocess mode indeed
    finally:
        go_on.set()
        finish.set()
        process.join(SYNC_TIMEOUT)
        sidecar.stop()
    assert engine == [100.0, 120.0]  # the engine's own counter did not drop
    assert process.exitcode == 0


@pytest.mark.parametrize("engine_id, dp_rank", [
    ("3f2a_dp1", 1), ("3f2a_dp0", 0), ("3f2a_dp65535", 65535), ("3f2a", 0), (None, 0),
    # One spelling per number, as labels.rank_axis: no leading zero, no non-ASCII digit, nothing past 65535.
    ("3f2a_dp01", 0), ("3f2a_dp\u0661", 0), ("3f2a_dp-1", 0), ("3f2a_dp", 0), ("3f2a_dp65536", 0),
])
def test_the_dp_rank_is_the_engine_ids_dp_suffix_in_one_spelling(engine_id: object, dp_rank: int) -> None:
    assert hook._dp_rank(engine_id) == dp_rank


def test_a_loggers_rank_identity_is_made_once_whatever_vllms_config_context_says_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's current config exists only while it sets the model up: a gauge bound then reads tp 2 x pp 2, a
    counter first written while serving would read the metadata's world alone. One worker must stay one rank."""
    labels = {"model_name": "m", "worker_id": "3", "role": "worker", "served_model_name": "s"}
    metadata = SimpleNamespace(world_size=4, engine_id="e_dp1")
    logger = SimpleNamespace(PrometheusLogger=SimpleNamespace(
        _instances={tuple(sorted(labels.items())): SimpleNamespace(metadata=metadata)}))
    parallel = SimpleNamespace(tensor_parallel_size=2, pipeline_parallel_size=2, prefill_context_parallel_size=1)
    in_context = SimpleNamespace(get_current_vllm_config=lambda: SimpleNamespace(parallel_config=parallel))
    monkeypatch.setitem(sys.modules, hook.OBSERVABILITY, logger)
    monkeypatch.setitem(sys.modules, "vllm.config", in_context)
    monkeypatch.setattr(hook, "_identities", {})
    first = hook.rank_identity(labels)
    assert first == ({"tp_rank": 1, "pp_rank": 1, "dp_rank": 1}, {"model_name": "m", "role": "worker",
                                                                   "served_model_name": "s", "worker_id": "3"})
    monkeypatch.delitem(sys.modules, "vllm.config")  # outside the context: the metadata alone says tp 4
    assert hook.rank_identity(labels) == first


# --- the engine never pays (issue 30): what the hook does inside the engine raises nothing into it ---

LABELS = {"model_name": "m", "role": "worker", "served_model_name": "s", "worker_id": "0"}


def fake_observability(monkeypatch: pytest.MonkeyPatch, metadata: Any) -> None:
    """An `lmcache.observability` whose PrometheusLogger files one logger, of `metadata`, under LABELS."""
    loggers = {tuple(sorted(LABELS.items())): SimpleNamespace(metadata=metadata)}
    monkeypatch.setitem(sys.modules, hook.OBSERVABILITY, SimpleNamespace(PrometheusLogger=SimpleNamespace(_instances=loggers)))
    monkeypatch.setattr(hook, "_identities", {})


def hit_tokens_counter() -> Any:
    """LMCache's hit-token counter as install() has it built (outside any registry), labelled as a worker's."""
    return hook.PushingCounter("lmcache:num_hit_tokens", "hit tokens", labelnames=sorted(LABELS), registry=None)


def test_a_logger_without_instances_has_no_metadata(monkeypatch: pytest.MonkeyPatch) -> None:
    older = SimpleNamespace(PrometheusLogger=SimpleNamespace(_instance=SimpleNamespace(metadata="m")))
    monkeypatch.setitem(sys.modules, hook.OBSERVABILITY, older)
    assert hook._metadata(LABELS) is None


def test_metadata_of_another_shape_leaves_the_series_unpushed_not_the_engine_broken(
        monkeypatch: pytest.MonkeyPatch, socket_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", str(socket_dir / "nobody.sock"))
    fake_observability(monkeypatch, SimpleNamespace(engine_id="e"))  # no world_size
    counter = hit_tokens_counter()
    with caplog.at_level("WARNING", logger=hook.log.name):
        counter.labels(**LABELS).inc(3)
        counter.labels(**LABELS).inc(4)
    assert counter.labels(**LABELS)._value.get() == 7  # the engine's own metric counted both
    said = [r.getMessage() for r in caplog.records if r.name == hook.log.name]
    assert len(said) == 1 and "is not pushed" in said[0] and "world_size" in said[0]


def test_a_write_the_push_side_refuses_stops_that_series_and_never_reaches_the_engine(
        monkeypatch: pytest.MonkeyPatch, socket_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    # prometheus_client's Counter takes NaN (it refuses only amounts below 0); the push client refuses it.
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", str(socket_dir / "nobody.sock"))
    fake_observability(monkeypatch, SimpleNamespace(world_size=1, engine_id="e"))
    counter = hit_tokens_counter()
    child = counter.labels(**LABELS)
    try:
        with caplog.at_level("WARNING", logger=hook.log.name):
            child.inc(5)
            push = child._push
            child.inc(float("nan"))
            child.inc(1)
        assert push.value == 5  # the refused write and what followed stayed out of the push series
        assert child._push is None and child._push_generation == -1
        assert [r.getMessage() for r in caplog.records if r.name == hook.log.name] == [
            "lmcache:num_hit_tokens('m', 'worker', 's', '0') is no longer pushed: its push side refused a write "
            "(ValueError: a counter only adds finite non-negative amounts, got nan)"]
    finally:
        hook.close()


def test_install_leaves_a_logger_of_another_shape_alone_with_one_warning(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    older = type("PrometheusLogger", (), {"_instance": None, "_counter_cls": None})
    monkeypatch.setitem(sys.modules, hook.OBSERVABILITY, SimpleNamespace(PrometheusLogger=older))
    monkeypatch.setattr(hook, "_warned", set())
    with caplog.at_level("WARNING", logger=hook.log.name):
        hook.install()
        hook.install()
        hook.register()
    assert older._counter_cls is None and not hasattr(older, "_gauge_cls")
    assert [r.getMessage() for r in caplog.records if r.name == hook.log.name] == [
        "hicache-exporter: LMCache's PrometheusLogger._counter_cls is missing, not prometheus_client's; LMCache's "
        "metrics are not pushed (hicache-exporter supports the PrometheusLogger of LMCache 0.5.6)"]
