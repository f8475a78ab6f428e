"""Servers, ranks and streams (exporter.sidecar.core.servers): positions, expected worlds and node shares."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.catalog import default_catalog
from exporter.config import RanksConfig
from exporter.protocol.messages import Hello, RankId, World
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.servers import CLIENT_KIND, Layout, NodeShare, build_servers, stream_kind
from tests.exporter.sidecar.harness import Harness

STREAMS = default_catalog().streams
LAYOUTS = st.builds(
    lambda dp, pp, cp, tp, attention: World(
        tp_size=(dp if attention else 1) * cp * tp, pp_size=pp, dp_size=dp, attn_tp_size=tp, attn_cp_size=cp),
    st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 4), st.booleans())


def join(h: Harness, tp: int, world: World | None, pp: int = 0, dp: int = 0, cp: int | None = None,
         labels: dict[str, str] | None = None) -> RankState:
    labels = {"cache_type": "UnifiedRadixCache"} if labels is None else labels
    msg = Hello(protocol=1, epoch=f"e{tp}.{pp}.{dp}.{cp}.{sorted(labels)}", pid=1, labels=labels, world=world,
                rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_cp_rank=cp))
    return h.state.hello(object(), msg).rank


def servers_of(h: Harness) -> list:  # type: ignore[type-arg]
    config = h.state.config
    return build_servers(h.state.known_ranks(), STREAMS, config.max_ranks, config.node_rank, config.nodes)


@settings(max_examples=200, deadline=None)
@given(world=LAYOUTS)
def test_a_global_tp_rank_maps_back_to_its_position(world: World) -> None:
    """sglang's layout (runtime_context.py derive_attention_ranks): global tp = (dp x cp_size + cp) x attn_tp + tp
    under DP attention; the scheduler's tp rank read back through the world is its position again."""
    layout = Layout.of(world)
    seen: dict[int, set[int]] = {}  # per tp group (all dp groups under DP attention, else each replica): its tp ranks
    for dp in range(layout.dp_size):
        for cp in range(layout.attn_cp_size):
            for tp in range(layout.attn_tp_size):
                global_tp = layout.global_tp(dp, cp, tp)
                assert layout.attention_ranks(global_tp) == (cp, tp)
                seen.setdefault(0 if layout.dp_attention else dp, set()).add(global_tp)
    assert all(ranks == set(range(layout.tp_size)) for ranks in seen.values())  # each tp rank once per tp group


@settings(max_examples=200, deadline=None)
@given(world=LAYOUTS, data=st.data())
def test_the_nodes_of_a_server_share_its_positions_without_overlap(world: World, data: st.DataObject) -> None:
    """With nodes dividing the engine's tp x pp GPUs as sglang places them (engine.py _calculate_rank_ranges),
    every position is expected on exactly one node."""
    layout = Layout.of(world)
    divisors = [n for n in range(1, layout.tp_size * layout.pp_size + 1)
                if (layout.tp_size * layout.pp_size) % n == 0
                and (n % layout.pp_size == 0 and layout.tp_size % (n // layout.pp_size) == 0
                     or layout.pp_size % n == 0)]
    nodes = data.draw(st.sampled_from(divisors))
    shares = [NodeShare.of(layout, k, nodes) for k in range(nodes)]
    for dp in range(layout.dp_size):
        for pp in range(layout.pp_size):
            for cp in range(layout.attn_cp_size):
                for tp in range(layout.attn_tp_size):
                    holders = [s.node_rank for s in shares if s.holds(layout, (dp, pp, cp, tp))]
                    assert len(holders) == 1, (nodes, (dp, pp, cp, tp), holders)


@settings(max_examples=100, deadline=None)
@given(world=LAYOUTS, data=st.data())
def test_missing_is_every_expected_position_no_stream_holds(world: World, data: st.DataObject) -> None:
    layout = Layout.of(world)
    positions = [(dp, pp, cp, tp) for dp in range(layout.dp_size) for pp in range(layout.pp_size)
                 for cp in range(layout.attn_cp_size) for tp in range(layout.attn_tp_size)]
    held = data.draw(st.sets(st.sampled_from(positions)))
    h = Harness()
    for dp, pp, cp, tp in held:  # labelled as the engine labels its radix series: its tp rank without DP attention
        join(h, layout.global_tp(dp, cp, tp) if layout.engine_tp_everywhere else tp, world, pp=pp, dp=dp, cp=cp)
    (server,) = servers_of(h) or [None]
    if server is None:
        return  # nothing joined: no server, nothing to expect
    assert server.missing == len(positions) - len(held)
    assert {p for p, c in server.cells.items() if c.state == "missing"} == set(positions) - held
    assert sum(server.missing_by_dp.values()) == server.missing and set(server.missing_by_dp) == set(
        range(layout.dp_size))


def test_the_streams_of_a_rank_share_its_cell_and_their_kinds_come_from_the_catalog() -> None:
    h = Harness()
    world = World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2)
    join(h, 1, world, dp=1)
    join(h, 1, world, dp=1, cp=0, labels={"storage_backend": "file", "pp_size": "1", "attn_cp_size": "1"})
    join(h, 2, world, dp=1, labels={"model_name": "m", "engine_type": "unified", "moe_ep_rank": "2"})
    join(h, 0, world, dp=1, labels={"model": "own"})  # a client's own labels: a server of its own
    own, engine = sorted(servers_of(h), key=lambda s: s.labels != ())
    assert own.labels == () and sorted(p for p, c in own.cells.items() if c.streams) == [(1, 0, 0, 0), (1, 0, 0, 1)]
    assert [s.kind for s in own.cells[(1, 0, 0, 1)].streams] == ["radix", "storage"]
    assert [s.kind for s in own.cells[(1, 0, 0, 0)].streams] == ["scheduler"]
    assert engine.labels == (("model", "own"),) and engine.streams == 1
    assert stream_kind((("model", "own"),), STREAMS) == (CLIENT_KIND, None)


def test_a_scheduler_without_a_world_keeps_its_global_tp_rank_as_its_cell() -> None:
    h = Harness()
    join(h, 2, None, dp=1, labels={"model_name": "m", "engine_type": "unified"})
    (server,) = servers_of(h)
    assert list(server.cells) == [(1, 0, 0, 2)] and server.layout is None and server.missing == 0


def test_a_cell_is_as_live_as_its_liveliest_stream_and_missing_once_all_expired() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=1.0, expire_after_seconds=5.0))
    world = World(tp_size=1, pp_size=1, dp_size=1)
    radix = join(h, 0, world)
    storage = join(h, 0, world, cp=0, labels={"storage_backend": "file"})
    h.state.disconnect(radix.connection, radix)
    assert servers_of(h)[0].cells[(0, 0, 0, 0)].state == "live"
    h.clock.advance(2.0)
    assert servers_of(h)[0].cells[(0, 0, 0, 0)].state == "stale"  # the storage stream is connected, silent
    h.state.disconnect(storage.connection, storage)
    assert servers_of(h)[0].cells[(0, 0, 0, 0)].state == "departed"
    h.clock.advance(5.0)
    (server,) = servers_of(h)
    assert server.cells[(0, 0, 0, 0)].state == "missing" and server.missing == 1


def test_an_implausible_or_conflicting_world_expects_nothing() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=8))
    join(h, 0, World(tp_size=3, pp_size=3, dp_size=1))  # 9 positions, more than 8 identities
    (server,) = servers_of(h)
    assert server.implausible and server.conflict and server.layout is None and server.missing == 0
    h2 = Harness()
    join(h2, 0, World(tp_size=2, pp_size=1, dp_size=1))
    join(h2, 1, World(tp_size=2, pp_size=1, dp_size=1, attn_tp_size=1))  # the same sizes, another layout
    (server,) = servers_of(h2)
    assert server.conflict and not server.implausible and len(server.worlds) == 2


@settings(max_examples=200, deadline=None)
@given(world=LAYOUTS, data=st.data())
def test_a_nodes_expected_positions_are_counted_and_listed_alike(world: World, data: st.DataObject) -> None:
    """expected_count (arithmetic) and expected (a listing within the share) agree with testing every
    position of the layout against the share, for any node count, dividing or not."""
    layout = Layout.of(world)
    nodes = data.draw(st.integers(1, 9))
    share = NodeShare.of(layout, data.draw(st.integers(0, nodes - 1)), nodes)
    every = [(dp, pp, cp, tp) for dp in range(layout.dp_size) for pp in range(layout.pp_size)
             for cp in range(layout.attn_cp_size) for tp in range(layout.attn_tp_size)]
    held = [p for p in every if share.holds(layout, p)]
    assert sorted(layout.expected(share)) == held
    assert layout.expected_count(share) == len(held)
    assert layout.expected_count(None) == layout.positions == len(list(layout.expected(None)))


def test_worlds_past_what_the_sidecar_could_hold_expect_nothing_so_the_work_stays_bounded() -> None:
    """1,024 streams, each its own server claiming a world of 1,024 positions: only the first server's world
    fits ranks.max_ranks (1,024 identities); the others are implausible. Before this bound every server
    expected its world: 1,048,576 cells and ranks_missing series, 11 s per scrape."""
    h = Harness()
    world = World(tp_size=1, pp_size=1, dp_size=1024)
    for n in range(1024):
        join(h, 0, world, labels={"cache_type": "c", "model": f"m{n:04d}"})
    servers = servers_of(h)
    assert len(servers) == 1024
    assert [s.implausible for s in servers] == [False] + [True] * 1023
    assert sum(len(s.cells) for s in servers) == 1024 + 1023
    assert servers[0].missing == 1023 and sum(s.missing for s in servers) == 1023


def test_without_dp_attention_the_radix_tp_rank_is_the_engines_and_maps_to_its_cp_rank() -> None:
    """tp 4 = cp 2 x attention tp 2, no DP attention: radix_cache_metric_labels gives the engine's tp rank
    (3), which is cp 1, attention tp 1; a tp rank outside the world keeps its label as an unexpected cell."""
    h = Harness()
    world = World(tp_size=4, pp_size=1, dp_size=1, attn_tp_size=2, attn_cp_size=2)
    join(h, 3, world)
    join(h, 9, world)
    (server,) = servers_of(h)
    assert [p for p, c in server.cells.items() if c.streams] == [(0, 0, 1, 1), (0, 0, 0, 9)]
    assert not server.cells[(0, 0, 0, 9)].expected and server.missing == 3


def test_an_engine_relaunched_with_a_smaller_world_is_judged_by_its_live_streams() -> None:
    """tp 4, then relaunched as tp 2 under the same labels: the expired tp 2 and tp 3 identities still carry
    the old world; the live streams' world is the one expected (it used to be a conflict, nothing missing)."""
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=1.0, expire_after_seconds=2.0))
    old = [join(h, tp, World(tp_size=4, pp_size=1, dp_size=1)) for tp in range(4)]
    for rank in old:
        h.state.disconnect(rank.connection, rank)
    h.clock.advance(3.0)
    join(h, 0, World(tp_size=2, pp_size=1, dp_size=1))  # tp 0 says hello again with the new world
    (server,) = servers_of(h)
    assert not server.conflict and server.layout is not None and server.layout.tp_size == 2
    assert {p: c.state for p, c in server.cells.items()} == {
        (0, 0, 0, 0): "live", (0, 0, 0, 1): "missing", (0, 0, 0, 2): "expired", (0, 0, 0, 3): "expired"}


def test_a_server_with_a_live_stream_gets_the_room_before_a_dead_one() -> None:
    """Room for expected positions goes to servers with an unexpired stream first: a redeployed server's
    expired predecessor, sorting first by its labels, no longer makes the live one implausible."""
    h = Harness(ranks_config=RanksConfig(max_ranks=16, stale_after_seconds=1.0, expire_after_seconds=2.0))
    gone = join(h, 0, World(tp_size=10, pp_size=1, dp_size=1), labels={"cache_type": "c", "rev": "a"})
    h.state.disconnect(gone.connection, gone)
    h.clock.advance(3.0)
    join(h, 0, World(tp_size=8, pp_size=1, dp_size=1), labels={"cache_type": "c", "rev": "b"})
    dead, live = servers_of(h)
    assert (live.implausible, live.missing) == (False, 7)
    assert (dead.implausible, dead.missing) == (True, 0)  # 10 positions no longer fit the 8 left


def test_a_huge_world_on_other_nodes_visits_nothing() -> None:
    """dp 65,536 under DP attention (attention tp 1): node 1 of 2 holds global tp 32,768 on, counted by
    arithmetic and listed from its first dp group; a share past the world holds nothing and visits nothing."""
    layout = Layout.of(World(tp_size=65536, pp_size=1, dp_size=65536, attn_tp_size=1))
    share = NodeShare.of(layout, 1, 2)
    assert layout.expected_count(share) == 32768
    assert next(iter(layout.expected(share))) == (32768, 0, 0, 0)
    far = NodeShare(node_rank=1, nodes=2, tp=range(70000, 70001), pp=range(0, 1))
    assert layout.expected_count(far) == 0 and list(layout.expected(far)) == []
