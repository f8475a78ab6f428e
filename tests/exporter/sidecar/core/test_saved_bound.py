"""The durable state's file against the keeper's bound on it (exporter/sidecar/durable/keeper.py,
`max_file_bytes`): the file a state within the limits writes must load back at the next start."""

from __future__ import annotations

from pathlib import Path

from exporter.catalog import default_catalog
from exporter.config import PersistenceConfig, RanksConfig
from exporter.protocol.messages import Hello, RankId, ScalarSample, Snapshot
from exporter.sidecar.core.health import PersistenceHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.durable.keeper import MAX_BYTES_PER_SERIES, StateKeeper

FAMILY = "hicache_dropped_tokens_total"  # replicated, labels (reason, pool): a rollup cell and a watermark per series
SERIES_PER_RANK = 200


def _fill(state: SidecarState) -> int:
    """Fill the series budget with the longest labels the limits allow, each rank a replica group of its own; the ranks."""
    limits = state.config
    length = min(limits.max_label_value_length, limits.max_static_label_chars // limits.max_static_labels)
    own = limits.max_family_label_value_length
    ranks = 0
    while True:
        static = {f"l{i}": chr(97 + i) * (length - 8) + f"{ranks:08d}" for i in range(limits.max_static_labels)}
        rank = state.hello(object(), Hello(protocol=1, epoch=f"e{ranks}", pid=1, labels=static,
                                           rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0))).rank
        samples = [ScalarSample(FAMILY, 1.0, {"reason": "r" * (own - 8) + f"{j:08d}", "pool": "p" * own})
                   for j in range(SERIES_PER_RANK)]
        result = state.snapshot(rank, Snapshot(seq=1, time=0.0, samples=samples))
        ranks += 1
        if result.rejections:  # the budget is full
            return ranks


def test_a_full_budget_of_the_longest_labels_writes_a_file_that_loads(tmp_path: Path) -> None:
    state = SidecarState(default_catalog(), RanksConfig(max_series_total=4096))
    ranks = _fill(state)
    budget = state.registry.budget
    # Each series weighs its labels (keys.series_cost): 2,662 characters on its line and its group's spread line
    # is 11 units, its rollup cell's 2,626 on one line 6; the fill stops within one such pair of the limit.
    rank = next(iter(state.registry.ranks.values()))
    assert (rank.cost / len(rank.values), budget.rollup / len(state.ledger.counter_cells)) == (11, 6)
    assert budget.per_rank + budget.rollup > 4096 - (11 + 6)
    path = tmp_path / "state"
    keeper = StateKeeper(PersistenceConfig(file=path), state, {}, PersistenceHealth(), "sglang_")
    written = keeper.encode()
    path.write_bytes(written)
    fresh = state.fresh()
    health = PersistenceHealth()
    StateKeeper(PersistenceConfig(file=path), fresh, {}, health, "sglang_").load()
    assert health.load_failures == {}, f"{len(written)} bytes for {budget.per_rank + budget.rollup} series"
    assert health.loaded_identities == ranks
    # Each label set once (SavedCore.statics, .label_sets): written out in every place it appears, the
    # file was 1.7 kB per series here, and its save held 84 MB for a moment at the default budget.
    assert len(written) <= MAX_BYTES_PER_SERIES * (budget.per_rank + budget.rollup), len(written)
