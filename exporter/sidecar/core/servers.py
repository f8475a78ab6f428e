"""Servers, their ranks and their streams (DESIGN section 13): the whole picture a sidecar has.

A *rank* is a position of one server: dp group, pp stage, attention cp rank and attention tp rank
(one engine process on a GPU). A *stream* is one identity that reports for it: one engine collector
(radix, storage, scheduler: the catalog's `streams` table names them by a marker label) or one pushed
client. A *server* is the streams whose static labels differ only by the labels their collector adds.

The expected world of a server is the one its streams said hello with (an upstream's configured
world reaches the registry the same way); a position it expects that no unexpired stream holds is
missing. Everything here is derived from the registry when read: nothing is stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from exporter.catalog import StreamSpec, dp_attention_by_sizes
from exporter.protocol.messages import World
from exporter.sidecar.core.keys import StaticKey
from exporter.sidecar.core.ranks import RankState

CLIENT_KIND = "client"  # a stream whose labels carry no collector's marker (a pushed RankClient of one's own)
WORLDS_LISTED = 8  # distinct worlds kept per server for the conflict message; more only make it longer
Position = tuple[int, int, int, int]  # (dp_rank, pp_rank, attn_cp_rank, attention tp_rank)
CellState = Literal["live", "stale", "departed", "expired", "missing"]
_LIVELINESS: dict[CellState, int] = {"live": 0, "stale": 1, "departed": 2, "expired": 3}


@dataclass(frozen=True, slots=True)
class Layout:
    """A server's world as positions: dp groups x pp stages x attention cp ranks x attention tp ranks."""

    tp_size: int  # the engine's tp size
    pp_size: int
    dp_size: int
    attn_tp_size: int
    attn_cp_size: int

    @classmethod
    def of(cls, world: World) -> Layout:
        return cls(world.tp_size, world.pp_size, world.dp_size,
                   world.tp_size if world.attn_tp_size is None else world.attn_tp_size, world.attn_cp_size)

    @property
    def positions(self) -> int:
        return self.dp_size * self.pp_size * self.attn_cp_size * self.attn_tp_size

    @property
    def dp_attention(self) -> bool:
        """The dp groups share one tp group (the engine's tp_size spans them all), as under DP attention."""
        return dp_attention_by_sizes(self.tp_size, self.dp_size, self.attn_cp_size, self.attn_tp_size)

    @property
    def span(self) -> int:
        """The engine tp ranks of one tp group: every dp group's under DP attention, else one replica's."""
        return self.attn_cp_size * self.attn_tp_size * (self.dp_size if self.dp_attention else 1)

    @property
    def engine_tp_everywhere(self) -> bool:
        """Every collector labels the engine's tp rank: a replica's tp group without DP attention, where the
        radix and storage labels carry tp_rank, not attn_tp_rank (its sizes say so: tp = cp x attention tp)."""
        return not self.dp_attention and self.tp_size == self.attn_cp_size * self.attn_tp_size

    def attention_ranks(self, global_tp: int) -> tuple[int, int]:
        """(attention cp rank, attention tp rank) of the engine's tp rank `global_tp` (the layout of
        sglang runtime_context.py derive_attention_ranks: attention tp changes fastest, then cp, then dp)."""
        return (global_tp // self.attn_tp_size) % self.attn_cp_size, global_tp % self.attn_tp_size

    def global_tp(self, dp: int, cp: int, tp: int) -> int:
        """The engine's tp rank of a position: under DP attention the dp groups are blocks of one tp group."""
        return self._block(dp).start + cp * self.attn_tp_size + tp

    def _block(self, dp: int) -> range:
        """The engine's tp ranks of dp group `dp`: its block of the one tp group under DP attention, else a
        replica's own tp group."""
        width = self.attn_cp_size * self.attn_tp_size
        start = dp * width if self.dp_attention else 0
        return range(start, start + width)

    def _shared(self, share: NodeShare | None) -> tuple[range, range, range]:
        """(dp groups, pp stages, global tp ranks) that `share` holds of this layout (all of it without one)."""
        if share is None:
            return range(self.dp_size), range(self.pp_size), range(self.span)
        pp = range(max(share.pp.start, 0), min(share.pp.stop, self.pp_size))
        tp = range(share.tp.start, min(share.tp.stop, self.span))
        if not pp or not tp:
            return range(0), pp, tp  # nothing of this layout on the node: no dp group to visit
        if not self.dp_attention:
            return range(self.dp_size), pp, tp
        width = self.attn_cp_size * self.attn_tp_size
        return range(tp.start // width, min((tp.stop - 1) // width + 1, self.dp_size)), pp, tp

    def expected_count(self, share: NodeShare | None) -> int:
        """How many positions of this layout `share` holds (the whole layout without one), by arithmetic."""
        dps, pps, tps = self._shared(share)
        if self.dp_attention:  # the dp groups' blocks split the one tp group: count its ranks on the node
            return len(pps) * len(_overlap(range(self.span), tps))
        return len(pps) * len(dps) * len(_overlap(self._block(0), tps))

    def expected(self, share: NodeShare | None) -> Iterator[Position]:
        """The positions `share` holds (the whole layout without one); as many as expected_count says."""
        dps, pps, tps = self._shared(share)
        if not self.expected_count(share):
            return  # a layout wholly on other nodes: not one dp group to visit
        for dp in dps:
            block = self._block(dp)
            for pp in pps:
                for global_tp in _overlap(block, tps):
                    offset = global_tp - block.start
                    yield dp, pp, offset // self.attn_tp_size, offset % self.attn_tp_size


def _overlap(a: range, b: range) -> range:
    return range(max(a.start, b.start), min(a.stop, b.stop))


@dataclass(frozen=True, slots=True)
class NodeShare:
    """The part of a multi-node server on one node, by the engine's placement (sglang
    entrypoints/engine.py:2045-2075 `_calculate_rank_ranges`): a block of global tp ranks of a block of
    pp stages."""

    node_rank: int
    nodes: int
    tp: range
    pp: range

    @classmethod
    def of(cls, layout: Layout, node_rank: int, nodes: int) -> NodeShare:
        pp_per_node = max(layout.pp_size // nodes, 1)
        nodes_per_pp = max(nodes // layout.pp_size, 1)
        tp_per_node = max(layout.tp_size // nodes_per_pp, 1)
        return cls(
            node_rank, nodes,
            tp=range(tp_per_node * (node_rank % nodes_per_pp), tp_per_node * (node_rank % nodes_per_pp + 1)),
            pp=range(pp_per_node * (node_rank // nodes_per_pp), pp_per_node * (node_rank // nodes_per_pp + 1)),
        )

    def holds(self, layout: Layout, position: Position) -> bool:
        dp, pp, cp, tp = position
        return pp in self.pp and layout.global_tp(dp, cp, tp) in self.tp


@dataclass(slots=True)
class Stream:
    """One identity as a stream: its kind and the position it reports for."""

    rank: RankState
    kind: str
    position: Position


@dataclass(slots=True)
class Cell:
    """One rank of a server: its position and the streams that report for it (none: missing)."""

    position: Position
    streams: list[Stream] = field(default_factory=list)
    expected: bool = False

    @property
    def state(self) -> CellState:
        """Its liveliest stream's state; `missing` when expected and no stream is unexpired."""
        states: list[CellState] = [s.rank.status.value for s in self.streams]
        best: CellState = min(states, key=_LIVELINESS.__getitem__) if states else "missing"
        return "missing" if self.expected and best in ("missing", "expired") else best

    @property
    def held(self) -> bool:
        """Some stream reports for it and has not expired."""
        return any(s.rank.status.value != "expired" for s in self.streams)


@dataclass(slots=True)
class Server:
    """A server: its labels, its streams by position, its expected world and what of it is missing."""

    labels: StaticKey
    cells: dict[Position, Cell] = field(default_factory=dict)
    worlds: list[World] = field(default_factory=list)  # one per layout, unexpired streams' (else expired ones')
    layout: Layout | None = None
    conflict: bool = False
    implausible: bool = False
    share: NodeShare | None = None
    streams: int = 0
    missing_by_dp: dict[int, int] = field(default_factory=dict)

    @property
    def missing(self) -> int:
        return sum(self.missing_by_dp.values())

    @property
    def known_cells(self) -> list[Cell]:
        return [cell for cell in self.cells.values() if cell.streams]


def stream_kind(static: StaticKey, streams: Mapping[str, StreamSpec]) -> tuple[str, StreamSpec | None]:
    """The collector whose marker label the identity carries, or (CLIENT_KIND, None)."""
    names = {name for name, _ in static}
    for collector, spec in streams.items():
        if spec.marker in names:
            return collector, spec
    return CLIENT_KIND, None


def server_labels(rank: RankState, spec: StreamSpec | None) -> StaticKey:
    """The static labels that name a stream's server: its replica group's, less what its collector adds."""
    if spec is None:
        return rank.shared
    return tuple(item for item in rank.shared if item[0] not in spec.labels)


def build_servers(ranks: Iterable[RankState], streams: Mapping[str, StreamSpec], max_ranks: int,
                  node_rank: int = 0, nodes: int = 1) -> list[Server]:
    """Every server of `ranks`, by its labels, with cells for every position seen or expected.

    A world with more positions than `max_ranks` is implausible (the sidecar could never hold it) and
    expects nothing, as do streams that disagree on their world. The work is linear in the streams and
    the expected positions, which a plausible world bounds by max_ranks.
    """
    by_key: dict[StaticKey, Server] = {}
    placed: list[tuple[Server, RankState, str, StreamSpec | None]] = []
    # Per server, its worlds by layout: unexpired streams' and expired ones'. An engine relaunched with
    # another layout leaves expired identities with the old world; they do not outvote the live ones.
    worlds: dict[StaticKey, tuple[dict[Layout, World], dict[Layout, World]]] = {}
    sorts: dict[StaticKey, tuple[str, StreamSpec | None, StaticKey]] = {}  # by static labels: a server's streams share few
    for rank in ranks:
        sort = sorts.get(rank.static)
        if sort is None:
            kind, spec = stream_kind(rank.static, streams)
            sort = sorts[rank.static] = (kind, spec, server_labels(rank, spec))
        kind, spec, key = sort
        server = by_key.get(key)
        if server is None:
            server = by_key[key] = Server(labels=key)
            worlds[key] = ({}, {})
        server.streams += 1
        if rank.world is not None:
            live, expired = worlds[key]
            (expired if rank.expired else live).setdefault(Layout.of(rank.world), rank.world)
        placed.append((server, rank, kind, spec))
    # Expected positions over every server together are bounded by what the sidecar could ever hold:
    # ranks.max_ranks identities, one stream at least per rank. Servers with an unexpired stream come
    # first, then in label order; a world past what is left is implausible and expects nothing, so the
    # work and the ranks_missing series stay bounded whatever worlds are claimed.
    room = max_ranks
    for key in sorted(by_key, key=lambda k: (not worlds[k][0], k)):
        server = by_key[key]
        live, expired = worlds[key]
        reported = live or expired
        server.worlds = list(reported.values())[:WORLDS_LISTED]
        if len(reported) == 1:
            layout = next(iter(reported))
            share = NodeShare.of(layout, node_rank, nodes) if nodes > 1 else None
            count = layout.expected_count(share)
            if count <= room:
                server.layout, server.share = layout, share
                room -= count
            else:
                server.conflict = server.implausible = True
        elif reported:
            server.conflict = True
    for server, rank, kind, spec in placed:
        position = _position(rank, spec, server.layout)
        cell = server.cells.get(position)
        if cell is None:
            cell = server.cells[position] = Cell(position)
        cell.streams.append(Stream(rank, kind, position))
    order = {collector: n for n, collector in enumerate(streams)}  # the catalog's order: radix, storage, ...
    for server in by_key.values():
        for cell in server.cells.values():
            cell.streams.sort(key=lambda s: order.get(s.kind, len(order)))  # stable: exposition order within a kind
        _expect(server)
    return [by_key[key] for key in sorted(by_key)]


def _position(rank: RankState, spec: StreamSpec | None, layout: Layout | None) -> Position:
    """The position a stream reports for. The scheduler labels the engine's tp rank; without DP attention
    so do the radix and storage collectors (radix_cache_metric_labels: tp_rank, not attn_tp_rank), which
    only differs from the attention tp rank under context parallelism. Such a tp rank maps through the
    world to (cp, attention tp); one outside the world keeps its label, as an unexpected cell."""
    cp = rank.attn_cp_rank or 0
    engine_tp = spec is not None and spec.tp_rank == "global" or layout is not None and layout.engine_tp_everywhere
    if layout is not None and engine_tp and rank.tp_rank < layout.span:
        cp, tp = layout.attention_ranks(rank.tp_rank)
        return rank.dp_rank, rank.pp_rank, cp, tp
    return rank.dp_rank, rank.pp_rank, cp, rank.tp_rank


def _expect(server: Server) -> None:
    """Mark the cells of the expected world (this node's share of it) and count the missing per dp group."""
    layout = server.layout
    if layout is None:
        return
    for position in layout.expected(server.share):
        cell = server.cells.get(position)
        if cell is None:
            cell = server.cells[position] = Cell(position)
        cell.expected = True
        dp = position[0]
        server.missing_by_dp[dp] = server.missing_by_dp.get(dp, 0) + (not cell.held)
