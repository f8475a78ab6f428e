"""Values derived at scrape time: gauge rollups, active bandwidth and replica spread."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from itertools import repeat

from exporter.catalog import FamilySpec, MetricType, Semantics
from exporter.sidecar.ranks import RankState
from exporter.sidecar.series import GroupKey, LabelValues, RollupKey
from exporter.sidecar.state import SidecarState


@dataclass(slots=True)
class Bandwidth:
    """Active bandwidth of one series over the window: bytes moved per second of transfer time."""

    bytes_delta: float
    seconds_delta: float

    @property
    def value(self) -> float:
        return self.bytes_delta / self.seconds_delta


def gauge_rollups(state: SidecarState) -> dict[RollupKey, float]:
    """Gauges over live ranks: per_shard sums every live rank, replicated sums each group's leader."""
    out: dict[RollupKey, float] = defaultdict(float)
    gauges = {f.name: f for f in state.catalog if f.type is MetricType.GAUGE}
    if not gauges:
        return {}
    for rank in state.live_ranks():
        leads = state.groups[rank.group].leader is rank
        values = rank.values
        for key in rank.gauge_keys:
            family, labels = key
            if gauges[family].semantics is Semantics.PER_SHARD or leads:
                out[(family, rank.static, labels)] += values[key]  # type: ignore[operator]
    return dict(out)


def window_increases(state: SidecarState, now: float) -> dict[int, dict[tuple[str, LabelValues], float]]:
    """Per rank (by id), the increase of every windowed series over the window ending now."""
    return {id(rank): rank.history.increases(now, rank.totals) for rank in state.ranks.values()}


def bandwidths(
    state: SidecarState, increases: dict[int, dict[tuple[str, LabelValues], float]]
) -> tuple[list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]], dict[RollupKey, Bandwidth]]:
    """Per-rank and rolled-up active bandwidth; a series only where the window saw transfer time."""
    per_rank: list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]] = []
    rolled: dict[RollupKey, list[float]] = {}
    pairs = state.catalog.bandwidth_pairs()
    # Unlabelled pairs (the usual case) are two lookups per rank; labelled ones scan the rank's series.
    plain = [(b, (d.name, ()), (b.name, ())) for b, d in pairs if not d.labels]
    labelled = {d.name: b for b, d in pairs if d.labels}
    for rank in sorted(state.ranks.values(), key=lambda r: (r.static, r.dp_rank, r.pp_rank, r.tp_rank)):
        inc = increases[id(rank)]
        found = [(b, key[1], seconds, inc.get(bytes_key, 0.0)) for b, key, bytes_key in plain if (seconds := inc.get(key, 0.0)) > 0]
        if labelled:
            found += [(labelled[family], labels, seconds, inc.get((labelled[family].name, labels), 0.0))
                      for (family, labels), seconds in inc.items() if family in labelled and seconds > 0]
        for bytes_spec, labels, seconds, moved in found:
            moved = max(moved, 0.0)
            if not rank.expired:
                per_rank.append((bytes_spec, rank, labels, Bandwidth(moved, seconds)))
            acc = rolled.setdefault((bytes_spec.name, rank.static, labels), [0.0, 0.0])
            acc[0] += moved
            acc[1] += seconds
    return per_rank, {key: Bandwidth(b, s) for key, (b, s) in rolled.items() if s > 0}


def replica_spreads(
    state: SidecarState, increases: dict[int, dict[tuple[str, LabelValues], float]]
) -> dict[tuple[str, GroupKey, LabelValues], float]:
    """(max - min) / max of live replicas' increases over the window, per replicated counter and group."""
    replicated = {f.name for f in state.catalog if f.type is MetricType.COUNTER and f.semantics is Semantics.REPLICATED}
    spreads: dict[tuple[str, GroupKey, LabelValues], float] = {}
    for group_key, group in state.groups.items():
        live = [r for r in group.members if r.live and r.ready]
        if len(live) < 2:
            continue
        per_rank = [increases[id(rank)] for rank in live]
        keys = set(per_rank[0]).union(*per_rank[1:])  # C-level: thousands of keys in a large group
        for key in keys:
            if key[0] not in replicated:
                continue
            # A replica that never pushed a series has counted none of it.
            values = list(map(dict.get, per_rank, repeat(key), repeat(0.0)))
            top = max(values)
            spreads[(key[0], group_key, key[1])] = (top - min(values)) / top if top > 0 else 0.0
    return spreads


__all__ = ["Bandwidth", "bandwidths", "gauge_rollups", "replica_spreads", "window_increases"]
