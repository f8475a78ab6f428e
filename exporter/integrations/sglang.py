"""SGLang's stat-logger hook: the engine's own collectors push their HiCache series to the sidecar.

    import sglang
    from exporter.integrations.sglang import stat_loggers

    engine = sglang.Engine(model_path=..., enable_metrics=True, stat_loggers=stat_loggers())

`ServerArgs.stat_loggers` maps a collector role to a subclass of the engine's collector; every
collector builds its metrics from the class attributes `_counter_cls`, `_gauge_cls` and
`_histogram_cls` (SGLang's `_StatLoggerDIMixin`). The subclasses here set them to classes with
prometheus_client's constructor and `labels()`:

* a family of the metric catalog (its engine name is `sglang:` + the catalog name) gets children
  of a `RankClient`, which pushes over the sidecar's socket (`HICACHE_EXPORTER_SOCKET`, default
  /run/hicache/metrics.sock) every `HICACHE_EXPORTER_PUSH_INTERVAL` seconds (default 1);
* every other family (most of the scheduler's) is prometheus_client's own metric, so the
  engine's own /metrics keeps serving it.

Each `labels(**kw)` call's label names split three ways, by the proxy's rule too
(exporter.labels.split_rank_labels): the rank axes (`tp_rank`, `pp_rank`, `dp_rank`, `attn_cp_rank`),
the family's own labels as the catalog lists them (`pool`, `reason`, `mode`), and static labels
(everything else the engine passes with a value: `cache_type`, `storage_backend`, `pp_size`,
`model_name`, extra labels, ...). Rank axes plus static labels are a rank identity in
the sidecar; a process pushes through one `RankClient` per identity it meets, created on first
use, so a scheduler process with a radix cache, a storage backend and scheduler statistics holds
three connections. The radix cache's labels carry no context-parallel rank, so in an engine
process where `attn_cp_size > 1` the process's `attn_cp_rank` joins identities that lack one:
CP peers are then replicas of one dp group instead of one identity claimed twice.

Every hello carries the server's world (tp, pp and dp sizes, attention tp and cp sizes) as the
engine's runtime context has it in the scheduler process, so that the sidecar knows which ranks
should be there and counts the ones that never report as missing; outside an engine, or before
the engine has published its layout, a client sends none.

The engine's HELP texts go with the series (`RankClient.describe`), and the engine's buckets
(including `SGLANG_BUCKET_*` overrides) are the pushed layout. Clients start in the process that
first binds a series: the engine spawns its scheduler processes after importing this module, and
a forked child forgets its parent's clients. A last snapshot is pushed at a normal interpreter
exit. This module imports the engine; the sidecar never imports this module.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import prometheus_client
from sglang.srt.observability.metrics_collector import (
    STAT_LOGGER_ROLE_RADIX_CACHE,
    STAT_LOGGER_ROLE_SCHEDULER,
    STAT_LOGGER_ROLE_STORAGE,
    RadixCacheMetricsCollector,
    SchedulerMetricsCollector,
    StorageMetricsCollector,
)

from exporter.client import CounterChild, GaugeChild, HistogramChild, LabelError, RankClient
from exporter.integrations.push_clients import ProcessPushClients, push_interval, set_push_environment
from exporter.labels import split_rank_labels
from exporter.rank_catalog import (
    DEFAULT_PROFILE,
    BuiltFamily,
    MetricType,
    bucket_layout_problem,
    packaged_engine_family,
)

__all__ = [
    "stat_loggers", "close", "SidecarCounter", "SidecarGauge", "SidecarHistogram",
    "SidecarRadixCacheMetricsCollector", "SidecarStorageMetricsCollector", "SidecarSchedulerMetricsCollector",
]

ENGINE_PREFIX = "sglang:"

log = logging.getLogger("hicache_exporter.integrations.sglang")

Child = CounterChild | GaugeChild | HistogramChild


def stat_loggers(socket_path: str | os.PathLike[str] | None = None, *, interval: float | None = None) -> dict[str, type]:
    """The role -> collector-class mapping for `ServerArgs.stat_loggers` (`sglang.Engine(stat_loggers=...)`).

    `socket_path` and `interval`, when given, are set in this process's environment
    (`HICACHE_EXPORTER_SOCKET`, `HICACHE_EXPORTER_PUSH_INTERVAL`): the classes travel to the
    engine's scheduler processes by reference, and the environment travels with them.
    """
    set_push_environment(socket_path, interval)
    return {
        STAT_LOGGER_ROLE_RADIX_CACHE: SidecarRadixCacheMetricsCollector,
        STAT_LOGGER_ROLE_STORAGE: SidecarStorageMetricsCollector,
        STAT_LOGGER_ROLE_SCHEDULER: SidecarSchedulerMetricsCollector,
    }


# --- this process's push clients ---


def _make_client(rank: dict[str, int], static: dict[str, str]) -> RankClient:
    return RankClient(rank=rank, labels=static, interval=push_interval(), preset=False, world=_server_world())


_clients = ProcessPushClients(_make_client)


def close() -> None:
    """Push this process's last snapshots and say bye now (what happens at interpreter exit).

    Series bound later start new clients, with new epochs (a restart, as far as the sidecar knows).
    """
    _clients.close()


def _server_world() -> dict[str, int] | None:
    """The server's world (World's keys) from the engine's runtime context; None outside an engine or before it is published."""
    # sglang 0.5.23: get_parallel() (sglang/srt/runtime_context.py:1285) reads the widths the scheduler
    # process computed when it published its config (runtime_context.py:910; publish at
    # managers/scheduler.py:6327). num_dp_ranks counts the dp groups, DP-attention groups or DP-controller
    # replicas, one of the two being 1 (runtime_context.py:202-207): the deprecated
    # `--enable-dp-attention --dp-size N` is attn_dp_size=N, dp_size=1 by then (arg_groups/parallel_hook.py:39-61).
    # attn_tp_size is tp_size over the attention dp and cp widths (runtime_context.py:73-76).
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        world = {
            "tp_size": int(parallel.tp_size),
            "pp_size": int(parallel.pp_size),
            "dp_size": int(parallel.num_dp_ranks),
            "attn_tp_size": int(parallel.attn_tp_size),
            "attn_cp_size": int(parallel.attn_cp_size),
        }
    except Exception:  # not an engine process, or its parallel state is not published yet
        return None
    if min(world.values()) < 1:
        return None  # the sidecar would refuse the hello, and with it every series of the identity
    return world


def _context_parallel_rank() -> int | None:
    """This engine process's attention context-parallel rank when CP is on, else None (or outside an engine)."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(parallel.attn_cp_size) > 1:
            return int(parallel.attn_cp_rank)
    except Exception:  # not an engine process, or its parallel state is not published yet
        return None
    return None


def _replica_dp_rank() -> int | None:
    """This process's data-parallel replica when a DP controller runs replicas without DP attention, else None.

    The radix and storage collectors then label every replica dp_rank 0 (metrics_collector.py:2423-2426,
    cache_controller.py:755-763); only the scheduler's labels carry the replica (parallel.dp_rank,
    metrics_collector.py:1390). Without it the replicas' identities would be one identity claimed twice."""
    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        if int(parallel.attn_dp_size) <= 1 and parallel.dp_rank is not None:
            return int(parallel.dp_rank)
    except Exception:  # not an engine process, or its parallel state is not published yet
        return None
    return None


# --- routing a family ---

_warned: set[str] = set()


def catalog_family(name: str, kind: MetricType) -> BuiltFamily | None:
    """The catalog family that the engine's metric `name` of type `kind` is, or None."""
    spec = packaged_engine_family(DEFAULT_PROFILE, name, ENGINE_PREFIX, kind)
    if spec is None:
        return None
    if spec.type is not kind:
        _warn_once(name, f"{name} is a {kind.value} in the engine but a {spec.type.value} in the catalog; "
                         "the engine's /metrics serves it")
        return None
    return spec


def _warn_once(name: str, message: str) -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning(message)


class _SidecarMetric:
    """prometheus_client's constructor and `labels()`; catalog families push, others stay prometheus_client's.

    `labels()` returns the push client's child (`inc`, `set`, `observe`), bound once per label values.
    """

    _kind: ClassVar[MetricType]
    _prometheus_cls: ClassVar[type[prometheus_client.metrics.MetricWrapperBase]]
    _push_options: ClassVar[frozenset[str]] = frozenset()  # constructor keywords the push path understands

    def __new__(cls, name: str, documentation: str = "", labelnames: Iterable[str] = (), *args: Any, **kwargs: Any) -> Any:
        labelnames = tuple(labelnames)
        spec = None if args or set(kwargs) - cls._push_options else catalog_family(name, cls._kind)
        if spec is not None and not cls._routable(name, spec, labelnames, kwargs):
            spec = None
        if spec is None:
            return cls._prometheus_cls(name, documentation, labelnames, *args, **kwargs)
        metric = super().__new__(cls)
        metric._spec = spec
        return metric

    def __init__(self, name: str, documentation: str = "", labelnames: Iterable[str] = (), **kwargs: Any) -> None:
        self._spec: BuiltFamily
        self._name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._label_set = frozenset(self._labelnames)
        self._kwargs = kwargs
        self._children: dict[tuple[str, ...], Child] = {}
        self._generation = _clients.generation
        self._fallback: prometheus_client.metrics.MetricWrapperBase | None = None

    @classmethod
    def _routable(cls, name: str, spec: BuiltFamily, labelnames: tuple[str, ...], kwargs: Mapping[str, Any]) -> bool:
        missing = {"tp_rank", "pp_rank", *spec.labels} - set(labelnames)
        if missing:
            _warn_once(name, f"{name} has no {sorted(missing)} labels; the engine's /metrics serves it")
            return False
        return True

    def labels(self, *labelvalues: Any, **labelkwargs: Any) -> Any:
        if labelvalues:
            if labelkwargs:
                raise ValueError("Can't pass both *args and **kwargs")
            if len(labelvalues) != len(self._labelnames):
                raise ValueError("Incorrect label count")
            labelkwargs = dict(zip(self._labelnames, labelvalues))
        elif labelkwargs.keys() != self._label_set:
            raise ValueError("Incorrect label names")
        if self._generation != _clients.generation:
            self._children, self._generation = {}, _clients.generation
        key = tuple(str(labelkwargs[name]) for name in self._labelnames)
        child = self._children.get(key)
        if child is None:
            child = self._bind(labelkwargs)
            self._children[key] = child
        return child

    def _bind(self, labels: dict[str, Any]) -> Any:
        """The push child for `labels`, or prometheus_client's when they make no valid rank identity."""
        spec = self._spec
        try:
            # An engine without DP attention may leave dp_rank out: its one dp group is 0.
            rank, static = split_rank_labels({"dp_rank": 0, **labels}, own=spec.labels)
            if "attn_cp_rank" not in rank:
                cp_rank = _context_parallel_rank()
                if cp_rank is not None:
                    rank["attn_cp_rank"] = cp_rank
            replica = _replica_dp_rank()
            if replica is not None and rank["dp_rank"] == 0:
                rank["dp_rank"] = replica
            client = _clients.client(rank, static)
            if self._documentation:
                client.describe(spec.name, self._documentation)
            return self._child(client, {name: labels[name] for name in spec.labels})
        except (LabelError, ValueError, TypeError, RuntimeError) as err:
            _warn_once(self._name, f"{self._name}{labels} is not pushed ({err}); the engine's /metrics serves it")
            return self._prometheus().labels(**labels)

    def _child(self, client: RankClient, labels: dict[str, Any]) -> Child:
        raise NotImplementedError

    def _prometheus(self) -> prometheus_client.metrics.MetricWrapperBase:
        if self._fallback is None:
            try:
                self._fallback = self._prometheus_cls(self._name, self._documentation, self._labelnames, **self._kwargs)
            except ValueError:  # already registered by another collector: keep the values, unexposed
                self._fallback = self._prometheus_cls(self._name, self._documentation, self._labelnames,
                                                      registry=None, **self._kwargs)
        return self._fallback


class SidecarCounter(_SidecarMetric):
    """`prometheus_client.Counter`'s constructor and `labels()`; a catalog family's children push."""

    _kind = MetricType.COUNTER
    _prometheus_cls = prometheus_client.Counter

    def _child(self, client: RankClient, labels: dict[str, Any]) -> Child:
        return client.counter(self._spec.name, **labels)


class SidecarGauge(_SidecarMetric):
    """`prometheus_client.Gauge`'s; `multiprocess_mode` means nothing here (the sidecar keeps ranks apart)."""

    _kind = MetricType.GAUGE
    _prometheus_cls = prometheus_client.Gauge
    _push_options = frozenset({"multiprocess_mode"})

    def _child(self, client: RankClient, labels: dict[str, Any]) -> Child:
        return client.gauge(self._spec.name, **labels)


class SidecarHistogram(_SidecarMetric):
    """`prometheus_client.Histogram`'s; the engine's `buckets` (its SGLANG_BUCKET_* overrides included) are pushed."""

    _kind = MetricType.HISTOGRAM
    _prometheus_cls = prometheus_client.Histogram
    _push_options = frozenset({"buckets"})

    @classmethod
    def _routable(cls, name: str, spec: BuiltFamily, labelnames: tuple[str, ...], kwargs: Mapping[str, Any]) -> bool:
        if not super()._routable(name, spec, labelnames, kwargs):
            return False
        if "buckets" not in kwargs:
            return True
        bounds = cls._bounds(kwargs["buckets"])
        if bounds is None:
            return False  # prometheus_client refuses them with its own message, as without this hook
        problem = bucket_layout_problem(bounds)
        if problem:
            # prometheus_client takes a repeated bound; the sidecar's one layout rule does not (a bucket
            # of width 0). Decided here, not per label set: no push client is started for it.
            _warn_once(name, f"{name}: {problem}, got {list(kwargs['buckets'])}; the engine's /metrics serves it")
            return False
        return True

    @staticmethod
    def _bounds(buckets: Iterable[float]) -> tuple[float, ...] | None:
        """The finite upper bounds (+Inf implied), or None where prometheus_client refuses the layout
        (not numbers, not sorted, or no bucket but +Inf)."""
        try:
            bounds = [float(b) for b in buckets]
        except (TypeError, ValueError):
            return None
        if bounds and bounds[-1] == math.inf:
            bounds.pop()
        if not bounds or bounds != sorted(bounds):
            return None
        return tuple(bounds)

    def _child(self, client: RankClient, labels: dict[str, Any]) -> Child:
        buckets = self._kwargs.get("buckets")
        return client.histogram(self._spec.name, buckets=None if buckets is None else self._bounds(buckets), **labels)


class SidecarRadixCacheMetricsCollector(RadixCacheMetricsCollector):
    """The engine's L1/L2 (radix cache) collector, pushing its catalog families to the sidecar."""

    _counter_cls = SidecarCounter
    _histogram_cls = SidecarHistogram


class SidecarStorageMetricsCollector(StorageMetricsCollector):
    """The engine's L3 (storage) collector, pushing its catalog families to the sidecar."""

    _counter_cls = SidecarCounter
    _gauge_cls = SidecarGauge
    _histogram_cls = SidecarHistogram


class SidecarSchedulerMetricsCollector(SchedulerMetricsCollector):
    """The engine's scheduler collector: its hicache_host_* gauges and prefill_effective_tokens_total push;
    the rest of its families stay prometheus_client's, on the engine's own /metrics."""

    _counter_cls = SidecarCounter
    _gauge_cls = SidecarGauge
    _histogram_cls = SidecarHistogram
