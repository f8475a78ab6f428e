"""The rank side: bind counters once, increment them in memory, push snapshots in the background."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from exporter.client.metrics import CounterChild, GaugeChild, HistogramChild, LabelError, MetricSet
from exporter.client.pusher import Pusher, PushStats
from exporter.defaults import DEFAULT_PUSH_INTERVAL, DEFAULT_SOCKET_PATH, ENV_SOCKET
from exporter.labels import OPTIONAL_RANK_KEYS, RANK_AXES, RANK_KEYS, split_rank_labels, static_label_problem
from exporter.protocol.messages import MAX_HELP_LENGTH, PROTOCOL_VERSION, Hello, RankId, Snapshot, World
from exporter.rank_catalog import MetricType, RankCatalog, built_catalog

__all__ = ["RankClient", "CounterChild", "GaugeChild", "HistogramChild", "LabelError", "PushStats"]


class RankClient:
    """One rank's metrics: in-memory children plus a background pusher to the sidecar."""

    def __init__(
        self,
        socket_path: str | os.PathLike[str] | None = None,
        rank: Mapping[str, int] | None = None,
        labels: Mapping[str, Any] | None = None,
        interval: float = DEFAULT_PUSH_INTERVAL,
        *,
        world: Mapping[str, int] | None = None,
        catalog: RankCatalog | None = None,
        max_backoff: float = 5.0,
        preset: bool = True,
    ) -> None:
        """`preset=False` starts with no series at all: only what is bound is pushed, as an engine's
        own collectors do (exporter.integrations.sglang), instead of every catalog preset at 0. Without
        `catalog`, the packaged sglang profile's, pre-built (exporter.rank_catalog)."""
        rank = dict(rank or {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0})
        if not set(RANK_KEYS) <= set(rank) <= set(RANK_AXES):  # a rank is its axes: no static label goes here
            raise LabelError(
                f"rank must have the keys {list(RANK_KEYS)} and may have {list(OPTIONAL_RANK_KEYS)}, got {sorted(rank)}"
            )
        self.rank, _ = split_rank_labels(rank)
        self._rank_id = RankId(**self.rank)
        self.metrics = MetricSet(catalog or built_catalog())
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        family_labels = self.metrics.catalog.static_label_conflicts(set(self.labels))
        for name, value in self.labels.items():
            problem = static_label_problem(name, value, family_labels=family_labels)
            if problem:
                raise LabelError(f"static label: {problem}")
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.world = dict(world) if world else None
        self._world = _world(self.world) if self.world else None
        self.epoch = uuid.uuid4().hex
        self._help: dict[str, str] = {}
        self._help_lock = threading.Lock()
        self._help_version = 0
        self._help_sent = -1  # the HELP version the current connection has been sent
        if preset:
            self.metrics.preset()
        path = socket_path or os.environ.get(ENV_SOCKET) or DEFAULT_SOCKET_PATH
        self.socket_path = os.fspath(path)
        self._pusher = Pusher(self.socket_path, self._hello, self._snapshot, interval, max_backoff,
                              functions=self.metrics.functions)

    # --- binding (once, off the hot path) ---

    def counter(self, family: str, **labels: Any) -> CounterChild:
        """The counter child of `family` with `labels`; keep it and call `.inc()` on the hot path."""
        child = self.metrics.child(family, labels, MetricType.COUNTER)
        assert isinstance(child, CounterChild)
        return child

    def gauge(self, family: str, **labels: Any) -> GaugeChild:
        """The gauge child of `family` with `labels`."""
        child = self.metrics.child(family, labels, MetricType.GAUGE)
        assert isinstance(child, GaugeChild)
        return child

    def describe(self, family: str, help_text: str) -> None:
        """Give `family` the HELP text the sidecar exposes for it (an engine's own wording).

        Cut to the protocol's 4,096 characters (a longer one would make every snapshot malformed);
        an empty one is ignored (the catalog's stays)."""
        self.metrics.catalog.get(family)  # an unknown family fails here, not at the sidecar
        help_text = help_text[:MAX_HELP_LENGTH]
        if not help_text:
            return
        with self._help_lock:
            if self._help.get(family) != help_text:
                self._help[family] = help_text
                self._help_version += 1

    def histogram(self, family: str, *, buckets: Sequence[float] | None = None, **labels: Any) -> HistogramChild:
        """The histogram child of `family` with `labels`; `buckets` (finite upper bounds, ascending) replaces
        the catalog's layout, as an engine's bucket overrides do. A series keeps its first layout (a preset
        one has the catalog's)."""
        child = self.metrics.child(family, labels, MetricType.HISTOGRAM, bounds=buckets)
        assert isinstance(child, HistogramChild)
        return child

    # --- pushing ---

    @property
    def stats(self) -> PushStats:
        return self._pusher.stats

    def start(self) -> RankClient:
        """Start the background pusher (first push right away)."""
        self._pusher.start()
        return self

    def push_now(self) -> None:
        """Push at the next opportunity instead of waiting for the interval."""
        self._pusher.push_now()

    def new_epoch(self) -> str:
        """Start this rank again in the same process, as a restart would: counters and histograms back to 0
        (gauges keep their values), a fresh epoch id and a new hello; returns the new epoch.

        For an engine that clears its metrics while it runs: the epoch's last snapshot goes out first,
        then the sidecar continues the rank's positions from the new epoch's zeros (a restart), so no
        rollup falls. Increments that race with it from other threads may land in either epoch or, between
        the last snapshot and the zeroing, be lost."""

        def begin() -> None:
            self.metrics.restart()
            self.epoch = uuid.uuid4().hex

        self._pusher.restart(begin)
        return self.epoch

    def close(self) -> None:
        """Send a last snapshot and `bye`, then stop; safe to call twice."""
        self._pusher.close()

    def __enter__(self) -> RankClient:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _hello(self) -> Hello:
        self._help_sent = -1  # a new connection: the next snapshot carries every HELP text
        return Hello(protocol=PROTOCOL_VERSION, epoch=self.epoch, pid=os.getpid(), rank=self._rank_id,
                     labels=self.labels, world=self._world)

    def _snapshot(self, seq: int) -> Snapshot:
        help_texts: dict[str, str] = {}
        if self._help_sent != self._help_version:
            with self._help_lock:
                help_texts, self._help_sent = dict(self._help), self._help_version
        return Snapshot(seq=seq, time=time.time(), samples=self.metrics.wire_samples(), help=help_texts)


# The world keys a hello must have: World's fields without a default (the attention sizes are optional).
WORLD_REQUIRED = World.__struct_fields__[:len(World.__struct_fields__) - len(World.__struct_defaults__)]


def _world(sizes: dict[str, int]) -> World:
    """The hello's world: tp_size, pp_size and dp_size, and optionally attn_tp_size and attn_cp_size (1 to 65536)."""
    keys = set(sizes)
    if not set(WORLD_REQUIRED) <= keys <= set(World.__struct_fields__):
        raise LabelError(f"world must have the keys {list(WORLD_REQUIRED)} and may have attn_tp_size and "
                         f"attn_cp_size, got {sorted(sizes)}")
    try:
        return msgspec.convert(sizes, World)
    except msgspec.ValidationError as err:
        raise LabelError(f"world: {err}") from None
