"""The file is input (issue 30, finding 11): a saved value no sidecar writes is refused at restore, whatever
the file's checksum says, and the rest of the file stands.

Before: a cell of NaN, -1e18, 1e300 or +Inf was served as a rollup (with +Inf the status page answered 500,
with NaN or +Inf `top --once` exited 1). After: that series is left out, counted as `invalid`, logged once.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import msgspec
import pytest

from exporter.config import SidecarConfig
from exporter.sidecar.core import saved as saved_module
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.saved import SavedCore, dump, restore
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.expose.status import StatusView
from tests.exporter.sidecar.core.test_saved import LIMITS, build, identity, rollups
from tests.exporter.sidecar.harness import BYTES, DURATION, TOKENS, Harness

MAX_SAVED_VALUE = getattr(saved_module, "MAX_SAVED_VALUE", 2.0**80)  # (the test also runs on the code before it)
BAD = [math.nan, -1e18, 1e300, math.inf, -math.inf, MAX_SAVED_VALUE * 2]


def saved_plain() -> tuple[Harness, Any]:
    """A state of skewed replicas, restarts and an expired rank (test_saved.build), as the file's plain data."""
    h = Harness(ranks_config=LIMITS)
    build(h)
    return h, msgspec.to_builtins(msgspec.msgpack.decode(msgspec.msgpack.encode(dump(h.state))))


def restored(plain: Any) -> tuple[Harness, Any]:
    into = Harness(ranks_config=LIMITS)
    return into, restore(into.state, msgspec.convert(plain, SavedCore))


def cell_of(plain: Any, family: str) -> list[Any]:
    """The first saved rollup cell of `family` (SavedCell as a list)."""
    return next(cell for cell in plain[2] if cell[0] == family)


def renders(h: Harness) -> None:
    """/metrics in both formats and the status document (the page's and top's model) render."""
    renderer = TextRenderer(SidecarCollector(h.state, SidecarHealth(), "sglang_"))
    renderer.render()
    renderer.render(openmetrics=True)
    msgspec.json.encode(StatusView(SidecarConfig(), h.state, SidecarHealth()).document())


@pytest.mark.parametrize("bad", BAD, ids=repr)
def test_a_rollup_cell_of_a_value_no_sidecar_writes_is_left_out_and_the_rest_stands(
    bad: float, caplog: pytest.LogCaptureFixture,
) -> None:
    h, plain = saved_plain()
    cell_of(plain, BYTES)[4] = bad
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        into, result = restored(plain)
    assert result.dropped == {"invalid": 1}
    counters, histograms = rollups(into)
    expected_counters, expected_histograms = rollups(h)
    assert counters == {key: value for key, value in expected_counters.items() if key[0] != BYTES}
    assert histograms == expected_histograms
    assert result.identities == len(h.state.registry.ranks)
    assert "1 saved series hold values no sidecar writes" in caplog.text
    renders(into)


@pytest.mark.parametrize("edit", ["not cumulative", "negative count", "NaN sum", "bound not rising", "-Inf bound",
                                  "count beyond the bound", "time NaN", "time negative"])
def test_a_histogram_cell_or_start_time_that_cannot_be_is_left_out(edit: str) -> None:
    h, plain = saved_plain()
    cell = cell_of(plain, DURATION)
    value = cell[4]  # HistValue: bounds, counts, sum
    bounds, counts = value["bounds"], value["counts"]
    if edit == "not cumulative":
        counts[0] = counts[-1] + 1
    elif edit == "negative count":
        counts[0] = -1
    elif edit == "NaN sum":
        value["sum"] = math.nan
    elif edit == "bound not rising":
        bounds[1] = bounds[0]
    elif edit == "-Inf bound":
        bounds[0] = -math.inf
    elif edit == "count beyond the bound":
        value["counts"] = [2**81] * len(counts)
    elif edit == "time NaN":
        cell[3] = math.nan
    else:
        cell[3] = -1.0
    into, result = restored(plain)
    assert result.dropped == {"invalid": 1}
    assert set(rollups(into)[1]) == set(rollups(h)[1]) - {(cell[0], *_cell_key(plain, cell))}
    renders(into)


def _cell_key(plain: Any, cell: list[Any]) -> tuple[Any, Any]:
    statics, label_sets = plain[6], plain[7]
    return tuple(tuple(pair) for pair in statics[cell[1]]), tuple(label_sets[cell[2]])


def test_a_rank_holding_an_invalid_value_is_forgotten_so_it_comes_back_as_baselines() -> None:
    """A rank's value left out alone would make its next push count that value twice: the whole rank is
    forgotten (as the registry forgets one to make room), its rollup contribution kept."""
    h, plain = saved_plain()
    rank = next(r for r in plain[1] if (r[3], r[1]) == (0, 0))  # dp 0, tp 0
    rank[17][0][2] = math.inf  # its first value
    into, result = restored(plain)
    assert result.dropped == {"invalid": len({(v[0], v[1]) for v in rank[17]} | {(p[0], p[1]) for p in rank[18]})}
    assert into.state.rank(identity(0, 0)) is None
    assert into.state.registry.forgotten[rank[0]][identity(0, 0)] == rank[6]  # its epoch, for baselines
    assert rollups(into) == rollups(h)  # every rollup stands
    assert result.identities == len(h.state.registry.ranks) - 1


def test_a_position_or_bucket_position_that_cannot_be_forgets_its_rank() -> None:
    h, plain = saved_plain()
    rank = next(r for r in plain[1] if (r[3], r[1]) == (1, 1))
    rank[18][0][2] = -5.0  # a counter's position below zero
    into, result = restored(plain)
    assert into.state.rank(identity(1, 1)) is None and result.dropped.get("invalid", 0) > 0
    h2, plain2 = saved_plain()
    rank2 = next(r for r in plain2[1] if r[19])  # one with bucket positions
    rank2[19][0][3] = [5, 1] + rank2[19][0][3][2:]
    into2, result2 = restored(plain2)
    assert into2.state.rank(identity(rank2[3], rank2[1])) is None and result2.dropped.get("invalid", 0) > 0


def test_an_invalid_watermark_leaves_out_its_cell_too_so_nothing_counts_twice() -> None:
    """With its group's watermark gone, a replicated rollup would count the group's whole value again."""
    h, plain = saved_plain()
    mark = next(m for m in plain[3] if m[2] == TOKENS)
    mark[4] = math.nan
    into, result = restored(plain)
    key = (TOKENS, tuple(tuple(pair) for pair in plain[6][mark[1]]), tuple(plain[7][mark[3]]))
    assert key not in rollups(into)[0] and key in rollups(h)[0]
    assert result.dropped == {"invalid": 1}
    assert all(not isinstance(v, float) or not math.isnan(v) for v in _marks(into))


def _marks(h: Harness) -> list[Any]:
    return [getattr(mark, "value", None) for group in h.state.ledger.watermarks.values() for mark in group.values()]


def test_values_at_the_bound_stand() -> None:
    h, plain = saved_plain()
    cell_of(plain, BYTES)[4] = MAX_SAVED_VALUE
    into, result = restored(plain)
    assert result.dropped == {} and max(rollups(into)[0].values()) == MAX_SAVED_VALUE
