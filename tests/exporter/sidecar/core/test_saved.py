"""The core's durable state (exporter.sidecar.core.saved): dump, MessagePack, restore into a fresh state.

A restored state must behave as the state it was saved from would have after every connection closed
(what a restart of the sidecar does to the ranks): a twin harness that never restarted takes the same
steps, and every rollup of the two is equal, exactly, after each. Fake clocks; no sockets, no sleeps.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from exporter.catalog import Catalog, MetricType, Semantics, default_catalog
from exporter.config import RanksConfig, SidecarConfig
from exporter.errors import ProtocolError
from exporter.protocol import messages
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.keys import RollupCounter, RollupKey
from exporter.sidecar.core.ranks import RankIdentity, RankState, RankStatus
from exporter.sidecar.core.saved import Restored, SavedCore, dump, restore
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.expose.status import StatusView
from tests.exporter.sidecar.harness import (
    BYTES,
    DROPPED,
    DURATION,
    PGS,
    STATIC_KEY,
    TOKENS,
    Harness,
    bytes_,
    codes,
    dropped,
    hist,
    one_hot,
    tokens,
    used,
)

LIMITS = RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0)
Place = tuple[int, int]  # (dp_rank, tp_rank)


def identity(dp: int, tp: int) -> RankIdentity:
    return (tp, 0, dp, 0, STATIC_KEY)


class World:
    """One harness's ranks by place, and the cumulative values each last pushed (to push on from)."""

    def __init__(self, h: Harness) -> None:
        self.h = h
        self.conns: dict[Place, object] = {}

    def rank(self, place: Place) -> RankState:
        rank = self.h.state.rank(identity(*place))
        assert rank is not None
        return rank

    def hello(self, place: Place, epoch: str) -> RankState:
        conn, rank = self.h.hello(tp=place[1], dp=place[0], epoch=epoch)
        self.conns[place] = conn
        return rank

    def push(self, place: Place, *samples: object) -> None:
        rank = self.rank(place)
        result = self.h.push(rank, *samples, seq=rank.seq + 1)  # type: ignore[arg-type]
        assert not result.ignored and result.rejections == [], result

    def leave(self, place: Place) -> None:
        self.h.state.disconnect(self.conns.pop(place), self.rank(place))

    def leave_all(self) -> None:
        for place in list(self.conns):
            self.leave(place)


def pgs(per_bucket: list[int], total: float) -> object:
    return hist(PGS, per_bucket, total)


def duration(index: int, n: int, total: float) -> object:
    return hist(DURATION, one_hot(DURATION, index, n), total)


PLACES = [(dp, tp) for dp in (0, 1, 2) for tp in (0, 1)]


def build(h: Harness) -> World:
    """Three dp groups of two skewed replicas each; dp1's tp0 restarted to a new epoch; dp2's tp1 pushed
    its duration with another layout (a layout conflict); dp2's tp0 expired, dp2's tp1 departed; then
    every connection closed, as a restart of the sidecar closes them."""
    world = World(h)
    n_pgs = len(one_hot(PGS, 0))
    for dp, tp in PLACES:
        world.hello((dp, tp), f"e-{dp}-{tp}")
        lag = 0 if tp == 0 else 1  # tp1 is the lagging replica of each group
        samples = [
            bytes_(1000.0 * dp + 100.0 * tp + 10.0),
            tokens(500.0 + 100 * dp - 200 * lag),
            tokens(50.0 + dp - 20 * lag, pool="host"),
            dropped(7.0 + dp - 3 * lag, reason="evicted", pool="kv"),
            pgs([3 - lag, 2, *([0] * (n_pgs - 3)), 1 - lag], 9.5 - lag),
            used(11.0 + tp),
        ]
        if (dp, tp) == (2, 1):
            samples.append(hist(DURATION, [1, 2, 3], 4.0, finite=(0.5, 1.0)))  # another layout than the rollup's
        else:
            samples.append(duration(tp, dp + 1, 0.001 * (dp + 1)))
        world.push((dp, tp), *samples)
        h.clock.advance(1.0)
        h.wall.advance(1.0)
    # dp1's tp0 restarts: a new epoch, values from zero again.
    world.leave((1, 0))
    world.hello((1, 0), "e-1-0-b")
    world.push((1, 0), bytes_(7.0), tokens(40.0), pgs(one_hot(PGS, 1, 2), 0.25), duration(0, 1, 0.5))
    h.clock.advance(2.0)
    h.wall.advance(2.0)
    # dp2's tp0 goes silent past expire_after; the others push on, then dp2's tp1 leaves (departed).
    world.leave((2, 0))
    h.clock.advance(31.0)
    h.wall.advance(31.0)
    for place in [(0, 0), (0, 1), (1, 0), (1, 1), (2, 1)]:
        world.push(place, bytes_(world.rank(place).values[(BYTES, ())] + 1.0))  # type: ignore[operator]
    world.leave((2, 1))
    world.leave_all()
    return world


def round_trip(state_h: Harness, into: Harness) -> Restored:
    """Dump `state_h`'s state, encode it as the file does (MessagePack), decode it as SavedCore, restore it into `into`."""
    saved = msgspec.msgpack.decode(msgspec.msgpack.encode(dump(state_h.state)), type=SavedCore)
    return restore(into.state, saved)


def rollups(h: Harness) -> tuple[dict[RollupKey, float], dict[RollupKey, tuple[object, tuple[int, ...], float]]]:
    counters = h.state.ledger.counters
    histograms = {key: (acc.bounds, tuple(acc.counts), acc.sum) for key, acc in h.state.ledger.histograms.items()}
    return counters, histograms


def marks(h: Harness) -> dict[tuple[object, ...], object]:
    """Every replica group's watermarks as plain values."""
    return {(group, key): (mark.value if isinstance(mark, RollupCounter) else (mark.bounds, tuple(mark.counts), mark.sum))
            for group, by_key in h.state.ledger.watermarks.items() for key, mark in by_key.items()}


def assert_not_lower(before: Harness | tuple, after: Harness) -> None:
    """No rollup of `after` is absent or lower than it was (counters, and histograms bucket by bucket and sum)."""
    counters, histograms = rollups(before) if isinstance(before, Harness) else before
    now_counters, now_histograms = rollups(after)
    for key, value in counters.items():
        assert now_counters.get(key, -1.0) >= value, key
    for key, (bounds, counts, total) in histograms.items():
        assert key in now_histograms, key
        now_bounds, now_counts, now_total = now_histograms[key]
        assert now_bounds == bounds and all(a >= b for a, b in zip(now_counts, counts, strict=True)) and now_total >= total


# --- the round trip ---


def test_a_restored_state_serves_the_same_rollups_and_knows_every_rank() -> None:
    before, after = Harness(ranks_config=LIMITS), Harness(ranks_config=LIMITS)
    build(before)
    result = round_trip(before, after)
    assert (result.identities, result.dropped, result.changed, result.unknown) == (6, {}, [], [])
    assert result.cells == len(before.state.ledger.counter_cells) + len(before.state.ledger.histograms)
    assert rollups(after) == rollups(before)
    assert after.state.rollup_created() == before.state.rollup_created()
    assert after.state.layout_conflicts() == before.state.layout_conflicts() == {DURATION: 1}
    # Exact values, by hand: per_shard bytes sum every rank's position (dp1 tp0 across its two epochs,
    # plus one more each for the five that pushed on); replicated tokens take each group's furthest replica.
    assert after.counter(BYTES) == 10 + 110 + (1010 + 7) + 1110 + 2010 + 2110 + 5
    assert after.counter(TOKENS, "kv") == 500 + (600 + 40) + 700
    assert after.counter(TOKENS, "host") == 50 + 51 + 52
    assert after.counter(DROPPED, "evicted", "kv") == 7 + 8 + 9
    assert marks(after) == marks(before)
    # Every identity known with its epoch and the epochs it replaced; departed now, the expired one expired.
    known = {r.identity: (r.epoch, tuple(r.replaced_epochs), r.restarts) for r in after.state.ranks.values()}
    assert known == {r.identity: (r.epoch, tuple(r.replaced_epochs), r.restarts) for r in before.state.ranks.values()}
    assert known[identity(1, 0)] == ("e-1-0-b", ("e-1-0",), 1)
    assert {r.identity: r.status for r in after.state.ranks.values()} == {
        **{identity(*p): RankStatus.DEPARTED for p in PLACES}, identity(2, 0): RankStatus.EXPIRED}
    for rank in after.state.ranks.values():
        twin = before.state.rank(rank.identity)
        assert twin is not None
        assert rank.positions == twin.positions and rank.bucket_positions == twin.bucket_positions
        assert rank.values == {k: v for k, v in twin.values.items() if k not in twin.gauge_keys}  # gauges are not kept
        assert (rank.seq, rank.snapshots, rank.last_push_wall) == (twin.seq, twin.snapshots, twin.last_push_wall)
    assert after.state.series_budget().per_rank == sum(r.cost for r in after.state.ranks.values())


def test_a_restored_state_continues_exactly_as_one_that_never_restarted() -> None:
    """(a) a reconnect with the same epoch continues exactly; (b) a new epoch continues from the saved last
    value; (c) no rollup is ever lower. The twin never restarted; after each step both read the same."""
    twin, restored = Harness(ranks_config=LIMITS), Harness(ranks_config=LIMITS)
    worlds = [build(twin), World(restored)]
    round_trip(twin, restored)
    saved_tokens = restored.counter(TOKENS, "kv")

    def step(action: Callable[[World], None]) -> None:
        previous = rollups(restored)
        for world in worlds:
            action(world)
        assert_not_lower(previous, restored)
        assert rollups(restored) == rollups(twin)

    def reconnect(world: World) -> None:  # (a) the same epoch, values on from where they were
        world.hello((0, 0), "e-0-0")
        world.push((0, 0), bytes_(11.0 + 5), tokens(500.0 + 20), tokens(50.0, pool="host"),
                   pgs([4, 2, *([0] * (len(one_hot(PGS, 0)) - 3)), 1], 10.0),
                   duration(0, 2, 0.002))

    def restart(world: World) -> None:  # (b) a new epoch: from zero again, its position on from the saved last value
        world.hello((0, 1), "e-0-1-b")
        world.push((0, 1), bytes_(3.0), tokens(250.0), duration(1, 1, 0.25))

    def expired_comes_back(world: World) -> None:
        world.hello((2, 0), "e-2-0")
        world.push((2, 0), bytes_(2010.0 + 4), tokens(700.0 + 1))

    def restarted_again(world: World) -> None:
        world.hello((1, 0), "e-1-0-c")
        world.push((1, 0), bytes_(1.0), tokens(1.0))

    for action in (reconnect, restart, expired_comes_back, restarted_again):
        step(action)
    assert restored.counter(BYTES) == 10 + 110 + 1017 + 1110 + 2010 + 2110 + 5 + 5 + 3 + 4 + 1
    # dp0: tp0 reached 520, then tp1's new epoch continued from its saved last value 300 to 300 + 250 = 550,
    # the group's watermark; dp1's tp0 on from 640 to 641; dp2's tp0 701.
    assert restored.counter(TOKENS, "kv") == 550 + 641 + 701 != saved_tokens
    assert restored.state.rank(identity(0, 1)).positions[(TOKENS, ("kv",))] == 550.0  # type: ignore[union-attr]
    assert restored.state.rank(identity(0, 0)).status is RankStatus.LIVE  # type: ignore[union-attr]


def test_a_reconnect_below_its_saved_values_is_another_writer_and_no_rollup_falls() -> None:
    twin, restored = Harness(ranks_config=LIMITS), Harness(ranks_config=LIMITS)
    build(twin)
    round_trip(twin, restored)
    before = rollups(restored)
    world = World(restored)
    world.hello((0, 0), "e-0-0")
    rank = world.rank((0, 0))
    result = restored.push(rank, bytes_(1.0), tokens(1.0), seq=rank.seq + 1)
    assert result.conflict is not None and rank.epoch_conflicts == 1
    assert_not_lower(before, restored)


def test_a_new_sidecar_on_a_restored_state_saves_the_same_state() -> None:
    """Restore, dump again: the same durable state (no field lost on the way), times aside."""
    first, second, third = (Harness(ranks_config=LIMITS) for _ in range(3))
    build(first)
    round_trip(first, second)
    round_trip(second, third)
    assert rollups(third) == rollups(first) and third.state.rollup_created() == first.state.rollup_created()
    a, b = (msgspec.msgpack.decode(msgspec.msgpack.encode(dump(h.state)), type=SavedCore) for h in (first, third))
    assert (a.cells, a.marks, a.layout_conflicts, a.families, a.forgotten) == \
        (b.cells, b.marks, b.layout_conflicts, b.families, b.forgotten)
    assert sorted(map(msgspec.msgpack.encode, a.ranks)) == sorted(map(msgspec.msgpack.encode, b.ranks))


# --- a changed catalog, limits ---


def catalog_with(change: Callable[[Catalog], list]) -> Catalog:
    return Catalog(families=tuple(change(default_catalog())))


def test_a_family_the_catalog_no_longer_has_is_dropped_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    without = catalog_with(lambda c: [f for f in c.families if f.name != PGS])
    restored = Harness(catalog=without, ranks_config=LIMITS)
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        result = round_trip(saved_from, restored)
    # Its one rollup series and the six ranks' series of it; nothing else.
    assert result.unknown == [PGS] and result.changed == []
    assert result.dropped == {"unknown_family": 1 + 6}  # watermarks are no series: not counted
    assert restored.histogram(PGS) is None
    assert all(key[0] != PGS for r in restored.state.ranks.values() for key in (*r.values, *r.positions))
    assert all(key[0] != PGS for group in restored.state.ledger.watermarks.values() for key in group)
    assert restored.counter(BYTES) == saved_from.counter(BYTES) and result.identities == 6
    assert [r.getMessage() for r in caplog.records if r.name == "hicache_exporter.durable"] == [
        f"durable state: 1 families are no longer in the catalog, their series dropped: {PGS}"]


@pytest.mark.parametrize("change", ["semantics", "labels"])
def test_a_family_whose_semantics_or_labels_changed_starts_over_logged_by_name(
    change: str, caplog: pytest.LogCaptureFixture,
) -> None:
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    update = {"semantics": Semantics.PER_SHARD} if change == "semantics" else {"labels": ("pool", "tier")}
    changed = catalog_with(lambda c: [f.model_copy(update=update) if f.name == TOKENS else f for f in c.families])
    restored = Harness(catalog=changed, ranks_config=LIMITS)
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        result = round_trip(saved_from, restored)
    assert result.changed == [TOKENS] and result.unknown == []
    # Its two rollup series (pools kv and host) and the ranks' series of it: two each, but one for dp1's
    # tp0, whose new epoch pushed pool kv only.
    assert result.dropped == {"changed_family": 2 + 5 * 2 + 1}
    assert all(key[0] != TOKENS for key in restored.state.ledger.counter_cells)
    assert all(key[0] != TOKENS for r in restored.state.ranks.values() for key in (*r.values, *r.positions))
    assert all(key[0] != TOKENS for group in restored.state.ledger.watermarks.values() for key in group)
    assert restored.counter(BYTES) == saved_from.counter(BYTES) and restored.histogram(PGS) is not None
    assert [r.getMessage() for r in caplog.records if r.name == "hicache_exporter.durable"] == [
        f"durable state: family {TOKENS} changed its type, semantics or labels since the file was written: "
        "its rollups and positions start over"]
    if change == "semantics":  # it starts over: now per_shard, the first values the ranks push are the rollup
        world = World(restored)
        for place in [(0, 0), (0, 1)]:
            world.hello(place, f"e-{place[0]}-{place[1]}")
            world.push(place, tokens(600.0))
        assert restored.counter(TOKENS, "kv") == 1200.0


def test_a_family_whose_type_changed_starts_over_logged_by_name(caplog: pytest.LogCaptureFixture) -> None:
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    changed = catalog_with(lambda c: [f.model_copy(update={"type": MetricType.GAUGE, "buckets": None}) if f.name == PGS
                                      else f for f in c.families])
    restored = Harness(catalog=changed, ranks_config=LIMITS)
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        result = round_trip(saved_from, restored)
    assert (result.changed, result.dropped) == ([PGS], {"changed_family": 1 + 6})
    assert restored.histogram(PGS) is None and all((PGS, ()) not in r.values for r in restored.state.ranks.values())
    assert f"family {PGS} changed its type" in caplog.text


def test_more_saved_ranks_than_max_ranks_are_left_out_as_limit_and_come_back_as_baselines() -> None:
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    small = RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_ranks=5)
    restored = Harness(ranks_config=small)
    result = round_trip(saved_from, restored)
    # The expired identity is the one left out (the registry would forget it first); its series counted.
    expired = saved_from.state.rank(identity(2, 0))
    assert expired is not None and restored.state.rank(identity(2, 0)) is None and result.identities == 5
    assert result.dropped == {"limit": 6} == {"limit": len({*expired.values} - {*expired.gauge_keys} | {*expired.positions})}
    assert rollups(restored) == rollups(saved_from)  # its contribution stays in the rollups
    assert restored.state.registry.forgotten == {"push": {identity(2, 0): "e-2-0"}}
    # It comes back once an identity expired to make room for it: with its epoch, its values are
    # baselines (before: counted again from zero, the bytes rollup 2,010 too high).
    restored.clock.advance(31.0)
    world = World(restored)
    for place in [(0, 0), (0, 1), (1, 0), (1, 1)]:  # four come back; (2, 1) stays away and expires
        world.hello(place, saved_from.state.rank(identity(*place)).epoch)  # type: ignore[union-attr]
    bytes_before = restored.counter(BYTES)
    world.hello((2, 0), "e-2-0")
    assert restored.state.rank(identity(2, 0)).resumed  # type: ignore[union-attr]
    world.push((2, 0), bytes_(2010.0 + 2))
    assert restored.counter(BYTES) == bytes_before  # what it moved while left out is not known: never twice
    world.push((2, 0), bytes_(2010.0 + 5))
    assert restored.counter(BYTES) == bytes_before + 3


def test_a_series_budget_too_small_for_the_rollups_drops_them_as_limit() -> None:
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    tiny = RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_series_total=3)
    restored = Harness(ranks_config=tiny)
    result = round_trip(saved_from, restored)
    assert result.dropped["limit"] > 0
    assert restored.state.series_budget().rollup + restored.state.series_budget().per_rank <= 3



def test_a_restored_state_weighs_its_series_as_the_pushes_did() -> None:
    """The budget weighs each series by its labels (keys.series_cost): a load weighs the same values and
    cells alike, whatever their labels (long ones, a derived one, one outside the BMP, a histogram's)."""
    before, after = Harness(ranks_config=LIMITS), Harness(ranks_config=LIMITS)
    statics = [{f"l{i}": chr(97 + i) * 288 for i in range(8)}, {"cache_type": "😀" * 200, "moe_ep_rank": "7" * 300},
               {"cache_type": "HiRadixCache"}]
    for tp, static in enumerate(statics):
        _, rank = before.hello(tp=tp, labels=static)
        assert codes(before.push(rank, bytes_(5.0), tokens(7.0, pool="p" * 128), dropped(2.0, reason="ā" * 100, pool="kv"),
                                 pgs([1, 0, 2, 0, 0, 0], 3.0), duration(0, 19, 0.5))) == []
    budget = before.state.registry.budget
    assert budget.per_rank > 100 and budget.rollup > 50  # far from one a series: their labels weigh
    result = round_trip(before, after)
    assert result.dropped == {} and result.identities == 3
    assert after.state.registry.budget == budget
    costs = {identity: rank.cost for identity, rank in before.state.registry.ranks.items()}
    assert {identity: rank.cost for identity, rank in after.state.registry.ranks.items()} == costs


def test_a_load_leaves_out_what_its_weight_has_no_room_for() -> None:
    """The same file into a budget that held every series at one unit each: the long-labelled ones are
    left out as `limit`, and what is loaded stays within the budget."""
    before = Harness(ranks_config=LIMITS)
    _, rank = before.hello(labels={f"l{i}": chr(97 + i) * 288 for i in range(8)})
    before.push(rank, *(dropped(1.0, reason=f"{j:03d}", pool="kv") for j in range(10)))
    budget = before.state.registry.budget
    assert (budget.per_rank, budget.rollup) == (10 * 10, 10 * 5)  # 2,411 characters on 2 lines; 2,375 on one
    small = RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_series_total=100)
    after = Harness(ranks_config=small)
    result = round_trip(before, after)
    # The cells first, each with room for itself twice (a rank series may make it again); then the values.
    assert result.dropped == {"limit": 6}
    assert (after.state.registry.budget.per_rank, after.state.registry.budget.rollup) == (4 * 10, 10 * 5)


def test_the_first_window_after_a_restore_reads_what_moved_since_the_load_not_the_whole_history() -> None:
    saved_from, restored = Harness(ranks_config=LIMITS), Harness(ranks_config=LIMITS)
    build(saved_from)
    round_trip(saved_from, restored)
    world = World(restored)
    world.hello((0, 0), "e-0-0")
    restored.clock.advance(5.0)
    world.push((0, 0), bytes_(11.0 + 5), duration(0, 3, 0.003))
    rank = world.rank((0, 0))
    increases = restored.state.window_increases([rank])[id(rank)]
    assert increases[(BYTES, ())] == 5.0 and increases[(DURATION, ())] == pytest.approx(0.003 - 0.001)
    assert increases[(TOKENS, ("kv",))] == 0.0


# --- a file that decodes but holds nonsense (hand-edited, or written by a buggy sidecar) ---


def _leaves(value: object, path: tuple = ()) -> list[tuple[tuple, object]]:
    """Every number and string inside nested lists and dicts, with its path."""
    if isinstance(value, dict):
        return [leaf for key, item in value.items() for leaf in _leaves(item, (*path, key))]
    if isinstance(value, list | tuple):
        return [leaf for i, item in enumerate(value) for leaf in _leaves(item, (*path, i))]
    return [(path, value)] if isinstance(value, int | float | str) and not isinstance(value, bool) else []


def _replaced(value: object, path: tuple, new: object) -> object:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        return {k: (_replaced(v, rest, new) if k == head else v) for k, v in value.items()}
    assert isinstance(value, list | tuple)
    return [(_replaced(v, rest, new) if i == head else v) for i, v in enumerate(value)]


NUMBERS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-(2**63), 2**64 - 1),
                    st.sampled_from([0, -1, 1 << 40]))
STRINGS = st.one_of(st.sampled_from(["", "+Inf", "-Inf", "NaN", "x", BYTES, TOKENS, PGS, DURATION, "kv", "e-0-0"]),
                    st.text(max_size=8))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_restored_state_of_edited_values_never_fails_a_render_or_a_push(data: st.DataObject) -> None:
    """Whatever a file that decodes holds, `restore` takes it back or raises (the keeper then sets the file
    aside); what it took back renders and takes pushes without an error."""
    saved_from = Harness(ranks_config=LIMITS)
    build(saved_from)
    plain = msgspec.to_builtins(msgspec.msgpack.decode(msgspec.msgpack.encode(dump(saved_from.state))))
    leaves = _leaves(plain)
    for _ in range(data.draw(st.integers(1, 4), label="edits")):
        path, old = data.draw(st.sampled_from(leaves), label="where")
        new = data.draw(STRINGS if isinstance(old, str) else NUMBERS, label="value")
        plain = _replaced(plain, path, new)
    try:
        saved = msgspec.convert(plain, SavedCore)
    except msgspec.ValidationError:
        event("refused by the decode")
        return  # the keeper's decode refuses it: corrupt
    restored = Harness(ranks_config=LIMITS)
    try:
        restore(restored.state, saved)
    except Exception as err:
        event(f"refused by restore: {type(err).__name__}")
        return  # the keeper sets the file aside: corrupt
    event("taken back")
    renderer = TextRenderer(SidecarCollector(restored.state, SidecarHealth(), "sglang_"))
    view = StatusView(SidecarConfig(), restored.state, SidecarHealth())
    renderer.render()
    renderer.render(openmetrics=True)
    view.document()
    world = World(restored)
    for place in PLACES:
        rank = restored.state.rank(identity(*place))
        try:
            world.hello(place, rank.epoch if rank is not None else "fresh")
        except ProtocolError:
            continue
        rank = world.rank(place)
        restored.push(rank, bytes_(1e6), tokens(1e6), pgs([1] * len(one_hot(PGS, 0)), 1.0), duration(0, 1, 0.5),
                      seq=rank.seq + 1 if rank.seq < 2**62 else 1)
    restored.clock.advance(40.0)
    renderer.render()
    renderer.render(openmetrics=True)
    view.document()


def test_the_world_a_rank_said_hello_with_survives_a_restart_so_what_is_missing_stays_missing() -> None:
    """A server of tp 2 whose tp 1 never started: after a restart, before any rank says hello again, the
    restored identity still carries the world, so the position stays missing (not silently forgotten)."""
    before, after = Harness(), Harness()
    world = messages.World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2)
    before.state.hello(object(), messages.Hello(
        protocol=1, epoch="e0", pid=1, labels={"cache_type": "UnifiedRadixCache"}, world=world,
        rank=messages.RankId(tp_rank=0, pp_rank=0, dp_rank=0)))
    round_trip(before, after)
    (rank,) = after.state.ranks.values()
    assert rank.world == world
    doc = StatusView(SidecarConfig(), after.state, SidecarHealth()).document()
    assert doc.totals.missing == 3 and doc.servers[0].expected is not None
