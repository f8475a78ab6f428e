"""The window's reads over the ranks' position histories (history.py): active bandwidth and replica spread."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain, repeat

from exporter.catalog import Catalog, FamilySpec
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import GroupKey, LabelValues, RollupKey, make_rollup_key
from exporter.sidecar.core.ranks import RankState


@dataclass(slots=True)
class Bandwidth:
    """Active bandwidth of one series over the window: bytes moved per second of transfer time."""

    bytes_delta: float
    seconds_delta: float

    @property
    def value(self) -> float:
        return self.bytes_delta / self.seconds_delta


class SeriesWindow:
    """Reads the ranks' window histories: active bandwidth per bytes counter, spread per replicated counter."""

    def __init__(self, catalog: Catalog) -> None:
        self.pairs = catalog.bandwidth_pairs()
        self.replicated = frozenset(f.name for f in catalog if f.replicated_counter)

    @staticmethod
    def increases(ranks: Iterable[RankState], now: float) -> dict[int, Increases]:
        """Per rank (by id), the increase of every position over the window ending at `now`."""
        return {id(rank): rank.history.increases(now, rank.positions) for rank in ranks}

    def bandwidths(
        self, ranks: list[RankState], increases: dict[int, Increases]
    ) -> tuple[list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]], dict[RollupKey, Bandwidth]]:
        """Per-rank (for unexpired ranks) and rolled-up active bandwidth, where the window saw transfer time."""
        per_rank: list[tuple[FamilySpec, RankState, LabelValues, Bandwidth]] = []
        rolled: dict[RollupKey, list[float]] = {}
        # Unlabelled pairs (the usual case) are two lookups per rank; labelled ones scan the rank's series.
        plain = [(b, (d.name, ()), (b.name, ())) for b, d in self.pairs if not d.labels]
        labelled = {d.name: b for b, d in self.pairs if d.labels}
        for rank in ranks:
            inc = increases[id(rank)]
            found: list[tuple[FamilySpec, LabelValues, float, float]] = [
                (b, key[1], seconds, inc.get(bytes_key, 0.0))
                     for b, key, bytes_key in plain if (seconds := inc.get(key, 0.0)) > 0]
            if labelled:
                found += [(labelled[family], labels, seconds, inc.get((labelled[family].name, labels), 0.0))
                          for (family, labels), seconds in inc.items() if family in labelled and seconds > 0]
            for bytes_spec, labels, seconds, moved in found:
                moved = max(moved, 0.0)
                if not rank.expired:
                    per_rank.append((bytes_spec, rank, labels, Bandwidth(moved, seconds)))
                acc = rolled.setdefault(make_rollup_key(bytes_spec.name, rank.shared, labels), [0.0, 0.0])
                acc[0] += moved
                acc[1] += seconds
        return per_rank, {key: Bandwidth(b, s) for key, (b, s) in rolled.items() if s > 0}

    def spreads(
        self, groups: dict[GroupKey, list[RankState]], increases: dict[int, Increases]
    ) -> dict[tuple[str, GroupKey, LabelValues], float]:
        """(max - min) / max of current replicas' increases over the window, per replicated counter and group."""
        replicated = self.replicated
        spreads: dict[tuple[str, GroupKey, LabelValues], float] = {}
        for group_key, members in groups.items():
            current = [r for r in members if r.current]
            if len(current) < 2:
                continue
            per_rank = [increases[id(rank)] for rank in current]
            # Every series any of them has, in first-seen order (C-level: thousands of keys in a large group).
            for key in dict.fromkeys(chain.from_iterable(per_rank)):
                if key[0] not in replicated:
                    continue
                # A replica that never pushed a series has counted none of it.
                values = list(map(dict.get, per_rank, repeat(key), repeat(0.0)))
                top = max(values)
                spreads[(key[0], group_key, key[1])] = (top - min(values)) / top if top > 0 else 0.0
        return spreads
