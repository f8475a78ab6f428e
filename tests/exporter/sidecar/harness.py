"""Shared helpers of the sidecar core's unit tests: a fake clock, a SidecarState harness and
builders of protocol samples. Fixtures over them are in conftest.py.

Every test drives the state with injected clocks; no sockets, no sleeps.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from exporter.catalog import Catalog, FamilySpec, MetricType, Semantics, default_catalog
from exporter.config import RanksConfig
from exporter.errors import ErrorCode
from exporter.protocol.messages import BucketBound, HistogramSample, RankId, Sample, ScalarSample, Snapshot
from exporter.sidecar.core.keys import HistAccumulator, Layout, RollupKey, StaticKey
from exporter.sidecar.core.ranks import HelloResult, Join, RankState
from exporter.sidecar.core.state import SidecarState, SnapshotResult

STATIC: dict[str, str] = {"cache_type": "UnifiedRadixCache"}
STATIC_KEY: StaticKey = (("cache_type", "UnifiedRadixCache"),)

BYTES = "load_back_bytes_total"  # per_shard counter, no labels, paired with DURATION for bandwidth
TOKENS = "load_back_tokens_total"  # replicated counter, label pool
DROPPED = "hicache_dropped_tokens_total"  # replicated counter, labels (reason, pool)
DURATION = "load_back_duration_seconds"  # per_shard histogram
PGS = "prefetch_pgs"  # replicated histogram
USED = "hicache_host_used_tokens"  # replicated gauge
SHARD_GAUGE = "test_shard_resident_bytes"  # per_shard gauge (added to the catalog by gauge_catalog())


class FakeClock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Harness:
    """A SidecarState with fake clocks and helpers that build protocol messages."""

    def __init__(
        self, catalog: Catalog | None = None, ranks_config: RanksConfig | None = None, window_seconds: float = 60.0,
    ) -> None:
        self.clock = FakeClock()
        self.wall = FakeClock(1_764_400_000.0)
        self.catalog = catalog or default_catalog()
        self.state = SidecarState(
            self.catalog, ranks_config=ranks_config, window_seconds=window_seconds,
            clock=self.clock, wall_clock=self.wall,
        )
        self._seq = itertools.count(1)

    def hello_result(
        self, tp: int = 0, pp: int = 0, dp: int = 0, epoch: str = "epoch-a",
        labels: dict[str, str] | None = None, connection: object | None = None, cp: int | None = None,
    ) -> tuple[object, HelloResult]:
        conn = connection if connection is not None else object()
        msg = Join(
            rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_cp_rank=cp),
            labels=dict(STATIC if labels is None else labels), epoch=epoch, pid=4242,
        )
        return conn, self.state.join(conn, msg)

    def hello(
        self, tp: int = 0, pp: int = 0, dp: int = 0, epoch: str = "epoch-a",
        labels: dict[str, str] | None = None, connection: object | None = None, cp: int | None = None,
    ) -> tuple[object, RankState]:
        """Say hello on a fresh connection token; return (connection, rank)."""
        conn, result = self.hello_result(tp, pp, dp, epoch, labels, connection, cp)
        return conn, result.rank

    def push(self, rank: RankState, *samples: Sample, seq: int | None = None) -> SnapshotResult:
        """Send one snapshot with a rising seq (or the given one)."""
        msg = Snapshot(seq=next(self._seq) if seq is None else seq, time=self.wall(), samples=list(samples))
        return self.state.snapshot(rank, msg)

    def counter(self, family: str, *label_values: str, static: StaticKey = STATIC_KEY) -> float | None:
        return self.state.ledger.counters.get(rollup_key(family, *label_values, static=static))

    def histogram(self, family: str, *label_values: str, static: StaticKey = STATIC_KEY) -> HistAccumulator | None:
        return self.state.ledger.histograms.get(rollup_key(family, *label_values, static=static))

    def gauges(self) -> dict[RollupKey, float]:
        return self.state.ledger.gauges(self.state.ranks.values())


def rollup_key(family: str, *label_values: str, static: StaticKey = STATIC_KEY) -> RollupKey:
    return (family, static, tuple(label_values))


def static_of(labels: dict[str, str]) -> StaticKey:
    return tuple(sorted(labels.items()))


def gauge_catalog() -> Catalog:
    """The default catalog plus a per_shard gauge (the default catalog has none)."""
    spec = FamilySpec(
        name=SHARD_GAUGE, type=MetricType.GAUGE, semantics=Semantics.PER_SHARD, help="Resident bytes of a shard."
    )
    return Catalog(families=(*default_catalog().families, spec))


def bytes_(value: float) -> Sample:
    return ScalarSample(family=BYTES, labels={}, value=value)


def tokens(value: float, pool: str = "kv") -> Sample:
    return ScalarSample(family=TOKENS, labels={"pool": pool}, value=value)


def dropped(value: float, **labels: str) -> Sample:
    return ScalarSample(family=DROPPED, labels=labels, value=value)


def used(value: float) -> Sample:
    return ScalarSample(family=USED, labels={}, value=value)


def shard(value: float) -> Sample:
    return ScalarSample(family=SHARD_GAUGE, labels={}, value=value)


def bounds(family: str) -> tuple[float, ...]:
    """The catalog's finite bucket bounds of `family`."""
    spec = default_catalog().get(family)
    assert spec.buckets is not None
    return spec.buckets


def layout(family: str) -> Layout:
    """The catalog's bucket layout of `family` as pushed: finite bounds, then "+Inf"."""
    return (*bounds(family), "+Inf")


def hist(family: str, per_bucket: Sequence[int], total: float, finite: Sequence[float] | None = None) -> Sample:
    """A histogram sample from non-cumulative per-bucket counts (the last entry is the +Inf bucket).

    `finite` gives another layout's finite bounds; the catalog's are the default.
    """
    bnds = tuple(bounds(family) if finite is None else finite)
    assert len(per_bucket) == len(bnds) + 1
    counts = list(itertools.accumulate(per_bucket))
    pairs: list[tuple[BucketBound, int]] = [*zip(bnds, counts), ("+Inf", counts[-1])]
    return HistogramSample(family=family, labels={}, buckets=pairs, sum=total, count=counts[-1])


def one_hot(family: str, index: int, n: int = 1, finite: Sequence[float] | None = None) -> list[int]:
    """Per-bucket counts with `n` observations in bucket `index` only."""
    counts = [0] * (len(bounds(family) if finite is None else finite) + 1)
    counts[index] = n
    return counts


def cumulative(per_bucket: Sequence[int]) -> list[int]:
    return list(itertools.accumulate(per_bucket))


def codes(result: SnapshotResult) -> list[ErrorCode]:
    return [code for code, _ in result.rejections]
