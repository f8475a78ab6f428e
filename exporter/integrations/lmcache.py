"""LMCache's metrics hook: the released `PrometheusLogger` pushes its series to the sidecar as well.

    import exporter.integrations.lmcache as hook
    hook.install()  # before LMCache's first PrometheusLogger.GetOrCreate in this process

Under vLLM nothing needs to be written: the package declares the vLLM general plugin
`hicache_exporter_lmcache` (entry point group `vllm.general_plugins`, pointing at `register`), which
vLLM loads in every process it starts (API server, engine cores, workers) before any KV connector
exists (docs/lmcache-0.5.6.md section 6). When `VLLM_PLUGINS` is set, it must name
`hicache_exporter_lmcache` too. Without the plugin machinery, the smallest alternative is one line in
a `sitecustomize.py` (or a `.pth` file) on the engine's path:

    import exporter.integrations.lmcache as h; h.register()

LMCache has no setting for its logger's metric classes: `PrometheusLogger` builds every metric from its
class attributes `_counter_cls`, `_gauge_cls` and `_histogram_cls` (lmcache/observability.py:857-859).
`install()` sets them to subclasses of prometheus_client's Counter, Gauge and Histogram, so the engine's
own metrics keep working as before (its registry, its multiprocess files, its `clear()`), and every
family of the `lmcache` profile (exporter/defaults/lmcache.yaml: LMCache's names without `lmcache:`,
counters with `_total`) is also counted in a `RankClient`, which pushes over the sidecar's socket
(`HICACHE_EXPORTER_SOCKET`, default /run/hicache/metrics.sock) every `HICACHE_EXPORTER_PUSH_INTERVAL`
seconds (default 1), one client per rank identity per process.

A rank identity comes from LMCache's four labels (model_name, worker_id, role, served_model_name,
observability.py:1905-1913) and the logger's metadata:

* tp_rank, pp_rank (and attn_cp_rank) from `worker_id` by `exporter.labels.linear_rank_axes`, with the
  tp size vLLM's parallel config gives when this process has one whose sizes multiply to the metadata's
  `world_size`, else the metadata's `world_size` (pp 1);
* dp_rank: the DP replica, which LMCache does not label: the `_dp<N>` suffix vLLM appends to each DP
  engine's `engine_id` (vllm/v1/engine/core.py:1374-1382), read from the metadata; 0 without one;
* static labels model_name, role, served_model_name (left out when empty: Prometheus drops an empty
  label) and worker_id (the profile's derived label: kept per rank, left out of rollups).

The hello carries no world: LMCache's metadata has no tp or pp size, and vLLM resets the DP size of a
dense model's engine to 1 (vllm/config/parallel.py:1130-1139), so no process knows it for sure.

Values are counted as they happen (a metric's `inc`, `set`, `observe`), except the 42 gauges LMCache
feeds through `set_function`: their function is read before each push, on the client's own thread and
with a deadline (exporter.client.pusher.FunctionPoller: a callback that blocks costs only its gauge).
`clear()` (LMCache's `reset_counters()`/`reset_histograms()`, observability.py:1879-1903) clears the engine's metric as
LMCache intends and starts a new epoch of the rank's client (`RankClient.new_epoch`): the sidecar then
continues the rank's positions, and no rollup falls.

This module imports LMCache only when `install()` or `register()` runs; the sidecar never imports it.

It is a guest in the engine (DESIGN section 15): `register()` never raises, and a LMCache of another shape
than 0.5.6's, recognised by feature (`unsupported_shape`: the three metric-class attributes still
prometheus_client's, loggers filed in an `_instances` mapping), or one that cannot be imported at all, gets
one warning line, and the engine runs as if this package were absent. Once installed, a write the push
side refuses (or a series whose rank cannot be made out) is the engine's alone: its prometheus_client
metric has it first, and the series is not pushed, with one warning.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import math
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar

import prometheus_client

from exporter.client import CounterChild, GaugeChild, HistogramChild, RankClient
from exporter.integrations.push_clients import ProcessPushClients, push_interval, set_push_environment
from exporter.labels import linear_rank_axes, rank_axis
from exporter.rank_catalog import BuiltFamily, MetricType, bucket_layout_problem, built_catalog, packaged_engine_family

__all__ = ["install", "register", "close", "PushingCounter", "PushingGauge", "PushingHistogram"]

PROFILE = "lmcache"
ENGINE_PREFIX = "lmcache:"
OBSERVABILITY = "lmcache.observability"
STATIC_LABELS = ("model_name", "role", "served_model_name", "worker_id")
INACTIVE = "inactive"  # the _warn_once key of the line that says why this process pushes nothing
# vllm/v1/engine/core.py:1374-1382: f"{engine_id}_dp{dp_rank}"; the number in one spelling, as labels.rank_axis.
DP_SUFFIX = re.compile(r"_dp(0|[1-9][0-9]{0,5})\Z", re.ASCII)

log = logging.getLogger("hicache_exporter.integrations.lmcache")

Child = CounterChild | GaugeChild | HistogramChild


def install(socket_path: str | os.PathLike[str] | None = None, *, interval: float | None = None) -> None:
    """Make LMCache's `PrometheusLogger` build pushing metrics in this process (idempotent).

    Call it before the process's first `PrometheusLogger.GetOrCreate`: a logger made before keeps
    prometheus_client's classes. `socket_path` and `interval`, when given, are set in this process's
    environment (`HICACHE_EXPORTER_SOCKET`, `HICACHE_EXPORTER_PUSH_INTERVAL`), which processes it
    starts inherit. Raises what importing `lmcache.observability` raises (ImportError where LMCache is
    missing); a `PrometheusLogger` of another shape than the one this is built for is left alone, with
    one warning line (`unsupported_shape` says why)."""
    set_push_environment(socket_path, interval)
    logger_cls: Any = getattr(importlib.import_module(OBSERVABILITY), "PrometheusLogger", None)
    problem = unsupported_shape(logger_cls)
    if problem is not None:
        _say_inactive(f"LMCache's {problem}; LMCache's metrics are not pushed (hicache-exporter supports the "
                      "PrometheusLogger of LMCache 0.5.6)")
        return
    if logger_cls._counter_cls is PushingCounter and logger_cls._gauge_cls is PushingGauge \
            and logger_cls._histogram_cls is PushingHistogram:
        return
    if logger_cls._instances:
        log.warning("LMCache already made %d PrometheusLogger(s) in this process; their metrics are not pushed",
                    len(logger_cls._instances))
    # lmcache/observability.py:857-859: the classes every _create_counter/_create_histogram and
    # _gauge_cls(...) call builds from (935-1672).
    logger_cls._counter_cls = PushingCounter
    logger_cls._gauge_cls = PushingGauge
    logger_cls._histogram_cls = PushingHistogram


def unsupported_shape(logger_cls: object) -> str | None:
    """Why LMCache's `PrometheusLogger` is not the shape install() patches, or None when it is."""
    # By feature rather than version: the class attributes install() replaces (each still prometheus_client's,
    # or already its own: another subclass would be someone else's to keep), and the mapping of loggers by
    # their sorted labels that a series' rank identity is read from (_metadata).
    if not isinstance(logger_cls, type):
        return f"{OBSERVABILITY} has no PrometheusLogger class"
    for name, base, ours in (("_counter_cls", prometheus_client.Counter, PushingCounter),
                             ("_gauge_cls", prometheus_client.Gauge, PushingGauge),
                             ("_histogram_cls", prometheus_client.Histogram, PushingHistogram)):
        value = getattr(logger_cls, name, None)
        if value is not base and value is not ours:
            return f"PrometheusLogger.{name} is {'missing' if value is None else repr(value)}, not prometheus_client's"
    if not isinstance(getattr(logger_cls, "_instances", None), Mapping):
        return "PrometheusLogger has no _instances mapping of its loggers"
    return None


def _say_inactive(message: str) -> None:
    """One warning line per process (whatever the error's text): the engine then runs as if this package were absent."""
    _warn_once(INACTIVE, "hicache-exporter: " + " ".join(message.split()))


def register() -> None:
    """vLLM's general plugin (entry point `hicache_exporter_lmcache`): `install()` where LMCache is installed.

    vLLM calls it once in each process it starts (vllm/plugins/__init__.py:77-90) with no guard, so
    it never raises: where LMCache cannot be found it does nothing; where LMCache cannot be imported
    (a missing dependency, a CUDA library that will not load) or has another shape, it says so in one
    warning line and leaves the engine as it was."""
    try:
        if OBSERVABILITY not in sys.modules:
            try:
                if importlib.util.find_spec("lmcache") is None:
                    return
            except (ImportError, ValueError):
                return
        install()
    except Exception as err:  # whatever it is, the engine must start: it reports its own import errors
        _say_inactive(f"{OBSERVABILITY} could not be set up ({type(err).__name__}: {err}); LMCache's metrics "
                      "are not pushed")


# --- this process's push clients ---


def _make_client(rank: dict[str, int], static: dict[str, str]) -> RankClient:
    return RankClient(rank=rank, labels=static, interval=push_interval(), preset=False, catalog=built_catalog(PROFILE))


_clients = ProcessPushClients(_make_client)


def close() -> None:
    """Push this process's last snapshots and say bye now (what happens at interpreter exit).

    Series written later start new clients, with new epochs (a restart, as far as the sidecar knows)."""
    _clients.close()


# --- rank identity ---


def _metadata(labels: dict[str, str]) -> Any:
    """The `LMCacheMetadata` of the logger (or label view) that labels its series `labels`, or None."""
    # lmcache/observability.py:1847-1868: GetOrCreate keeps every logger and label view in
    # PrometheusLogger._instances under _metadata_to_key(metadata) (1914-1917), the sorted label
    # strings; a label view keeps its own `.metadata` (1919-1929). A logger is filed there only once
    # it is made, so a metric finds it from its first write on, not while the logger is being built.
    module = sys.modules.get(OBSERVABILITY)
    instances = getattr(getattr(module, "PrometheusLogger", None), "_instances", None) or {}
    logger = instances.get(tuple(sorted(labels.items())))
    return getattr(logger, "metadata", None)


def _dp_rank(engine_id: object) -> int:
    """The DP replica vLLM names in an engine id (`<id>_dp<N>`), 0 for an engine id without one."""
    match = DP_SUFFIX.search(engine_id) if isinstance(engine_id, str) else None
    number = rank_axis(match.group(1)) if match else None
    return number if number is not None else 0


def _tp_cp_sizes(world_size: int) -> tuple[int | None, int]:
    """(tp size, context-parallel size) of this engine: vLLM's parallel config when this process has one that
    accounts for `world_size`, else every worker a tp rank of one stage (LMCache's metadata has no tp size)."""
    config_module = sys.modules.get("vllm.config")  # only where vLLM runs: never imported here
    if config_module is not None:
        try:
            # The current config exists only within vLLM's set_current_vllm_config (model set-up); outside
            # it newer vLLM raises and older builds a default one, whose sizes do not match below.
            current = getattr(config_module, "get_current_vllm_config_or_none", None) \
                or config_module.get_current_vllm_config
            parallel = current().parallel_config
            tp = int(parallel.tensor_parallel_size)
            pp = int(parallel.pipeline_parallel_size)
            cp = int(getattr(parallel, "prefill_context_parallel_size", 1) or 1)
            if tp * pp * cp == world_size:  # vllm/config/parallel.py:899-903
                return tp, cp
        except Exception:  # no current config, or one of another shape: the metadata decides
            pass
    return (world_size if world_size >= 1 else None), 1


# Each logger's label set -> its rank identity, made once: a metric first written inside vLLM's config
# context and one first written while serving would otherwise read different tp sizes, and one worker
# would push as two ranks. As many entries as LMCache makes loggers and label views (a few per process).
_identities: dict[tuple[tuple[str, str], ...], tuple[dict[str, int], dict[str, str]]] = {}


def rank_identity(labels: dict[str, str]) -> tuple[dict[str, int], dict[str, str]] | None:
    """(rank axes, static labels) of a series LMCache labels `labels`; None while its logger is not filed yet."""
    key = tuple(sorted(labels.items()))
    known = _identities.get(key)
    if known is not None:
        return dict(known[0]), dict(known[1])
    metadata = _metadata(labels)
    if metadata is None:
        return None
    tp_size, cp_size = _tp_cp_sizes(int(metadata.world_size))
    rank = linear_rank_axes(int(labels["worker_id"]), tp_size, cp_size)
    rank["dp_rank"] = _dp_rank(getattr(metadata, "engine_id", None))
    static = {name: labels[name] for name in STATIC_LABELS if labels.get(name)}
    _identities.setdefault(key, (rank, static))
    return dict(rank), dict(static)


# --- routing a family ---

_warned: set[str] = set()


def profile_family(name: str, kind: MetricType) -> BuiltFamily | None:
    """The profile's family that LMCache's metric `name` of type `kind` is, or None."""
    spec = packaged_engine_family(PROFILE, name, ENGINE_PREFIX, kind)
    if spec is None or spec.type is not kind:
        return None
    return spec


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning(message)


class _Pushing:
    """A prometheus_client metric whose labelled children also count in the rank's push client."""

    _kind: ClassVar[MetricType]
    _original_name: str
    _documentation: str
    _labelnames: tuple[str, ...]
    _labelvalues: tuple[str, ...]
    _metrics: dict[Any, Any]
    _lock: threading.Lock
    _push: Any = None  # the push child (on a labelled child), bound on its first write
    _push_client: RankClient | None = None
    _push_generation: int | None = None  # the _clients.generation it was bound in; -1: never pushed

    def _push_child(self) -> Any:
        """This series' push child, bound on first use; None while unbound (its logger is not filed yet) or never pushed."""
        if self._push_generation == _clients.generation or self._push_generation == -1:
            return self._push
        spec = profile_family(self._original_name, self._kind)
        if spec is None or not self._labelvalues:
            self._push_generation = -1
            return None
        labels = dict(zip(self._labelnames, self._labelvalues))
        try:
            identity = rank_identity(labels)
            if identity is None:
                _warn_once(self._original_name, f"{self._original_name}{labels}: no PrometheusLogger with these "
                                                "labels yet; this write is not pushed")
                return None
            client = _clients.client(*identity)
            if self._documentation:
                client.describe(spec.name, self._documentation)
            child = self._bind(client, spec)
        except Exception as err:  # a label or layout the sidecar would refuse, metadata of another shape, exit
            _warn_once(self._original_name, f"{self._original_name}{labels} is not pushed ({err})")
            self._push_generation = -1
            return None
        self._push, self._push_client, self._push_generation = child, client, _clients.generation
        return child

    def _push_failed(self, err: Exception) -> None:
        """A write the push side refused (the engine's own metric took it): this series is pushed no more."""
        _warn_once(f"{self._original_name} write", f"{self._original_name}{self._labelvalues} is no longer pushed: "
                                                   f"its push side refused a write ({type(err).__name__}: {err})")
        self._push, self._push_client, self._push_generation = None, None, -1

    def _bind(self, client: RankClient, spec: BuiltFamily) -> Child:
        raise NotImplementedError

    def _forward(self, write: str, *args: Any) -> None:
        """Make the write the engine's metric just took on this series' push child too, never raising into the engine.
        (Function gauges are read before every push: nobody calls set() on them.)"""
        try:
            push = self._push_child()
            if push is not None:
                getattr(push, write)(*args)
        except Exception as err:
            self._push_failed(err)

    def _bound_clients(self) -> list[RankClient]:
        """The push clients this metric's children count in now (on the labelled parent)."""
        with self._lock:
            children = list(self._metrics.values())
        clients: dict[int, RankClient] = {}
        for child in children:
            client = child._push_client if child._push_generation == _clients.generation else None
            if client is not None:
                clients[id(client)] = client
        return list(clients.values())

    def _clear_epochs(self, clear: Callable[[], None]) -> None:
        """`clear()` the engine's metric, and start a new epoch of every client whose series it held."""
        clients = self._bound_clients() if self._labelnames and not self._labelvalues else []
        clear()
        try:
            for client in clients:
                # One clear of each of the logger's 43 counters and histograms per reset: the first starts the
                # epoch, the others find nothing counted in it yet and leave it.
                if client.metrics.counted():
                    client.new_epoch()
        except Exception as err:  # the engine's metric is cleared; the push side must not raise into it
            _warn_once(f"{self._original_name} clear", f"{self._original_name}: a new push epoch failed ({err})")


class PushingCounter(_Pushing, prometheus_client.Counter):
    """prometheus_client's Counter; a profile family's children also count in the rank's push client."""

    _kind = MetricType.COUNTER

    def inc(self, amount: float = 1, exemplar: dict[str, str] | None = None) -> None:
        super().inc(amount, exemplar)
        self._forward("inc", amount)

    def clear(self) -> None:
        self._clear_epochs(super().clear)

    def _bind(self, client: RankClient, spec: BuiltFamily) -> Child:
        return client.counter(spec.name)


class PushingGauge(_Pushing, prometheus_client.Gauge):
    """prometheus_client's Gauge; a profile family's children also hold their value (or function) in the push client."""

    _kind = MetricType.GAUGE

    def set(self, value: float) -> None:
        super().set(value)
        self._forward("set", float(value))

    def inc(self, amount: float = 1) -> None:
        super().inc(amount)
        self._forward("inc", amount)

    def dec(self, amount: float = 1) -> None:
        super().dec(amount)
        self._forward("dec", amount)

    def set_function(self, f: Callable[[], float]) -> None:
        super().set_function(f)
        self._forward("set_function", f)

    def clear(self) -> None:
        self._clear_epochs(super().clear)

    def _bind(self, client: RankClient, spec: BuiltFamily) -> Child:
        return client.gauge(spec.name)


class PushingHistogram(_Pushing, prometheus_client.Histogram):
    """prometheus_client's Histogram; a profile family's children also observe in the push client, with the engine's buckets."""

    _kind = MetricType.HISTOGRAM
    _upper_bounds: list[float]

    def observe(self, amount: float, exemplar: dict[str, str] | None = None) -> None:
        super().observe(amount, exemplar)
        self._forward("observe", amount)

    def clear(self) -> None:
        self._clear_epochs(super().clear)

    def _bind(self, client: RankClient, spec: BuiltFamily) -> Child:
        bounds = _finite(self._upper_bounds)
        problem = bucket_layout_problem(bounds)
        if problem:  # e.g. a repeated bound from extra_config histogram_bucket_<name>
            raise ValueError(f"{problem}, got {list(self._upper_bounds)}")
        return client.histogram(spec.name, buckets=bounds)


def _finite(bounds: Iterable[float]) -> tuple[float, ...]:
    return tuple(b for b in bounds if b != math.inf)
