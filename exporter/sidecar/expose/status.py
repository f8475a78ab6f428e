"""The JSON API v1 (docs/api.md): the sidecar's state as the model of exporter.api.v1; no I/O.

The numbers are the ones /metrics shows, read through the same computations (collector.py's
`rollup_cells`, `window_increases`, the window's bandwidths and spreads): this module only
reshapes them for people and for `hicache-exporter top`. What it adds is read off the ranks'
hellos: the layout their worlds expect, and the positions of it no known rank holds.
"""

from __future__ import annotations

import gzip
import math
import platform
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypedDict

import msgspec

from exporter import __version__
from exporter.api import v1, view
from exporter.api.v1 import API_VERSION, BANDWIDTH_SERIES_LISTED, SPREAD_SERIES_LISTED
from exporter.api.view import GRID_CELLS, GRID_CELLS_PER_GROUP, cell_id, server_id
from exporter.catalog import Catalog
from exporter.config import SidecarConfig
from exporter.protocol.messages import World
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import GroupKey, HistAccumulator, LabelValues, RollupKey, StaticKey
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.servers import Cell, Layout, Server, build_servers
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.core.window import Bandwidth
from exporter.sidecar.expose.collector import build_revision, rollup_cells, window_increases
from exporter.sidecar.expose.families import ExposedFamilies
from exporter.sidecar.expose.prefill import PrefillView

HISTORY_INTERVAL_SECONDS = 5.0  # bandwidth history: one point per interval, sampled by housekeeping
BANDWIDTH_HISTORY_POINTS = 60  # five minutes of points at 5 s: a few KiB whatever the number of ranks
# Listings that a rank's label values can grow are cut to their largest entries; the counts and
# sums beside them stay exact (docs/api.md). Every catalog family's own rollup series are on /metrics.
# The bandwidth and spread listings' bounds are the model's (v1.BANDWIDTH_SERIES_LISTED,
# v1.SPREAD_SERIES_LISTED): the schema states them as maxItems.
REASONS_LISTED = 20  # per reason family, after its preset reasons
ENCODED_MAX_AGE_SECONDS = 1.0  # one housekeeping tick: viewers within it share one encoded document
# A family's unit, by the ending of its name (catalog names follow the Prometheus naming rules).
_UNITS: tuple[tuple[str, v1.Unit], ...] = (
    ("_tokens_total", "tokens"), ("_tokens", "tokens"), ("_bytes_total", "bytes"), ("_seconds", "seconds"),
    ("_pgs", "pages"), ("_states", "states"), ("_bandwidth", "gigabytes_per_second"),
)


def unit_of(name: str) -> v1.Unit | None:
    """The unit a family's name says (docs/api.md lists them), or None."""
    return next((unit for suffix, unit in _UNITS if name.endswith(suffix)), None)


def own_labels(rank: RankState) -> StaticKey:
    """The static labels of a rank's identity that its replica group leaves out (derived ones: moe_ep_rank)."""
    return tuple(item for item in rank.static if item not in rank.shared)


def short_rank_id(group: str, rank: RankState) -> str:
    """A rank's id in the document: its group's id, its axes, and its own labels quoted, if any
    (`g3/tp=1,pp=0,cp=0`): unique, since the group id stands for dp_rank and the shared labels."""
    cp = "" if rank.attn_cp_rank is None else f",cp={rank.attn_cp_rank}"
    own = own_labels(rank)
    return f"{group}/tp={rank.tp_rank},pp={rank.pp_rank}{cp}" + ("".join(" " + q for q in view.quoted_labels(own)))


@dataclass(frozen=True, slots=True)
class DocumentIds:
    """One document's short ids: `s<N>` per static label set (of a replica group or a server) and `g<N>`
    per replica group, numbered in exposition order (static labels, then dp rank). Unique and stable
    within one document only: a rank arriving or being forgotten renumbers what sorts after it. Every
    label set is written once, in `label_sets`, and everything else names it by these ids."""

    label_sets: dict[StaticKey, str]
    groups: dict[GroupKey, str]

    @classmethod
    def of(cls, groups: Iterable[GroupKey], servers: Iterable[StaticKey] = ()) -> DocumentIds:
        keys = sorted(groups, key=lambda key: (key[1], key[0]))
        statics = sorted({static for _, static in keys} | set(servers))
        return cls({static: f"s{n}" for n, static in enumerate(statics)},
                   {key: f"g{n}" for n, key in enumerate(keys)})


def rate(bw: Bandwidth | None) -> float | None:
    """A bandwidth as the API shows it: bytes per second, or None when the window saw no transfer
    time or the quotient is not a finite number (bytes over a duration sum so small that it overflows,
    say 2**62 bytes in 1e-300 s). /metrics keeps such a gauge at +Inf, which its format can say and
    JSON cannot; every bandwidth the API shows goes through here."""
    if bw is None or bw.seconds_delta <= 0:
        return None
    value = bw.value
    return value if math.isfinite(value) else None


def _labels(names: tuple[str, ...], values: LabelValues, static: StaticKey) -> dict[str, str]:
    labels = dict(zip(names, values))
    labels.update(static)
    return labels


def _total(bandwidths: Iterable[Bandwidth]) -> Bandwidth:
    moved = seconds = 0.0
    for bw in bandwidths:
        moved += bw.bytes_delta
        seconds += bw.seconds_delta
    return Bandwidth(moved, seconds)


def rolled_bandwidth(state: SidecarState, increases: dict[int, Increases], known: list[RankState]
                     ) -> dict[str, list[tuple[RollupKey, Bandwidth]]]:
    """The window's rolled-up active bandwidth by bytes family (the rollup gauges on /metrics)."""
    _, rolled = state.bandwidths(known, increases)
    by_family: dict[str, list[tuple[RollupKey, Bandwidth]]] = {}
    for key, bw in rolled.items():
        by_family.setdefault(key[0], []).append((key, bw))
    return by_family


class BandwidthHistory:
    """Each bytes family's rolled-up active bandwidth, one point per `interval`, the last `points` kept.

    Sampled by the app's housekeeping task, never per request, so a page left open costs the
    sidecar nothing more than the JSON it fetches (bench/status_api.py measures a sample).
    """

    def __init__(self, families: Iterable[str], interval: float | None = None, points: int | None = None) -> None:
        self.interval = HISTORY_INTERVAL_SECONDS if interval is None else interval
        self.points = BANDWIDTH_HISTORY_POINTS if points is None else points
        self._series: dict[str, deque[tuple[float, float | None]]] = {name: deque(maxlen=self.points) for name in families}
        self._next = float("-inf")

    def due(self, now: float) -> bool:
        """Whether a sample is due at monotonic time `now` (and, if so, the next one is `interval` later)."""
        if now < self._next:
            return False
        self._next = now + self.interval
        return True

    def sample(self, state: SidecarState, wall: float) -> None:
        """Append one point per bytes family: its bandwidth over the window ending now (None while idle)."""
        known, increases = window_increases(state)
        rolled = rolled_bandwidth(state, increases, known)
        for name, points in self._series.items():
            points.append((wall, rate(_total(bw for _, bw in rolled.get(name, ())))))

    def history(self, family: str) -> list[tuple[float, float | None]]:
        """A family's points, oldest first, as (time, bytes per second) pairs."""
        return list(self._series.get(family, ()))


def world_sizes(world: World | None) -> v1.WorldSizes | None:
    """A world as the API shows it, its attention sizes filled in; None for a stream that gave none."""
    return None if world is None else layout_sizes(Layout.of(world))


def layout_sizes(layout: Layout) -> v1.WorldSizes:
    return v1.WorldSizes(tp_size=layout.tp_size, pp_size=layout.pp_size, dp_size=layout.dp_size,
                         attn_tp_size=layout.attn_tp_size, attn_cp_size=layout.attn_cp_size)


def grid_model(cells: Iterable[Cell], room: int) -> tuple[v1.Grid, list[Cell]]:
    """What the grid of one dp group draws, at most `room` cells: rows of (pp, cp), columns of tp, exact
    counts of what is left out, and the cells drawn (by row, then column).

    Columns are the tp ranks some cell (known or expected) has. Rows are every pp stage by every cp rank
    of its cells, as a layout has them, where that product fits the room; where it does not (ranks at
    (i, i, i) make a cube of them), only the (pp, cp) pairs some cell has. Both are cut to the room,
    columns first. The work is linear in the cells, which the expected worlds' bound keeps bounded.
    """
    cells = list(cells)
    tps = sorted({c.position[3] for c in cells})
    pps = sorted({c.position[1] for c in cells})
    cps = sorted({c.position[2] for c in cells})
    columns = tps[:max(room, 0)]
    fit = room // len(columns) if columns else 0
    if len(pps) * len(cps) <= fit:
        pairs = [(pp, cp) for pp in pps for cp in cps]
    else:
        pairs = sorted({(c.position[1], c.position[2]) for c in cells})
    rows = pairs[:fit]
    drawn_rows, drawn_columns = set(rows), set(columns)
    drawn = [c for c in cells if (c.position[1], c.position[2]) in drawn_rows and c.position[3] in drawn_columns]
    drawn.sort(key=lambda c: c.position)
    grid = v1.Grid(rows=[v1.GridRow(pp_rank=pp, attn_cp_rank=cp) for pp, cp in rows], tp_ranks=columns,
                   row_count=len(pairs), column_count=len(tps), hidden_ranks=len(cells) - len(drawn))
    return grid, drawn


class Lifecycle(TypedDict):
    """The fields v1.Rank and v1.RankRow share, typed for `**` into either."""

    epoch: str
    pid: int
    seq: int
    restarts: int
    reconnects: int
    snapshots: int
    series: int
    seconds_since_activity: float
    last_push_time: float | None
    world: v1.WorldSizes | None


def lifecycle(rank: RankState, now: float) -> Lifecycle:
    """What both rank listings (v1.Rank, v1.RankRow) say of a rank's process, connection and pushes."""
    return {
        "epoch": rank.epoch,
        "pid": rank.pid,
        "seq": rank.seq,
        "restarts": rank.restarts,
        "reconnects": rank.reconnects,
        "snapshots": rank.snapshots,
        "series": len(rank.values),
        "seconds_since_activity": round(now - rank.last_activity, 3),
        "last_push_time": rank.last_push_wall,
        "world": world_sizes(rank.world),
    }


def rank_rows(state: SidecarState) -> list[v1.RankRow]:
    """GET /api/v1/ranks' rows: one per known rank, in exposition order."""
    now = state.clock()
    return [
        v1.RankRow(tp_rank=rank.tp_rank, pp_rank=rank.pp_rank, dp_rank=rank.dp_rank, attn_cp_rank=rank.attn_cp_rank,
                   labels=dict(rank.static), status=rank.status.value, **lifecycle(rank, now))
        for rank in state.known_ranks()
    ]


def ranks_body(state: SidecarState, health: SidecarHealth) -> bytes:
    """GET /api/v1/ranks as JSON."""
    return msgspec.json.encode(v1.RanksResponse(ranks=rank_rows(state), upstreams=upstream_rows(health)))


def upstream_rows(health: SidecarHealth) -> list[v1.Upstream]:
    """One row per configured upstream, in config order."""
    return [
        v1.Upstream(
            name=h.name, source=h.source, up=h.up, last_scrape_time=h.last_scrape_wall,
            last_scrape_duration_seconds=h.last_duration, samples=h.samples, scrapes=h.scrapes,
            ranks=h.ranks, pass_through_families=h.pass_through, errors=dict(h.errors),
            last_error=h.last_error, unranked_families=sorted(h.unranked),
            cp_colliding_families=sorted(h.cp_colliding), world=world_sizes(h.world),
            world_problems=list(h.world_problems),
        )
        for h in health.upstreams.values()
    ]


class StatusView:
    """Builds GET /api/v1/status from the sidecar's state; what depends only on the catalog is worked out once."""

    def __init__(self, config: SidecarConfig, state: SidecarState, stats: SidecarHealth,
                 history: BandwidthHistory | None = None) -> None:
        self.config = config
        self.state = state
        self.stats = stats
        catalog: Catalog = state.catalog
        self.catalog = catalog
        self.families = ExposedFamilies(catalog, config.metrics.namespace)
        self.pairs = catalog.bandwidth_pairs()
        self.history = history or BandwidthHistory(b.name for b, _ in self.pairs)
        self.transfers = catalog.transfers()
        self.transfer_of = {t.bytes: t.name for _, t in self.transfers if t.bytes is not None}
        self.spread_threshold = {name: profile.spread_threshold for name, profile in catalog.profiles.items()}
        self.reason_specs = [spec for spec in catalog if "reason" in spec.labels]
        self.specs = {spec.name: spec for spec in catalog}
        self.prefill = PrefillView(catalog, self.families)
        self.revision = build_revision()

    def document(self) -> v1.StatusDocument:
        """The whole status document, as of now."""
        state = self.state
        known, increases = window_increases(state)
        rolled = rollup_cells(state)
        sums = {name: self._series_total(entries) for name, entries in rolled.items()}
        bandwidth = rolled_bandwidth(state, increases, known)
        bw_totals = {name: _total(bw for _, bw in entries) for name, entries in bandwidth.items()}
        registry_groups = state.replica_groups()
        config = state.config
        built = build_servers(known, self.catalog.streams, config.max_ranks, config.node_rank, config.nodes)
        ids = DocumentIds.of(registry_groups, (server.labels for server in built))
        totals, servers, cells, streams, groups = self._servers(known, built, registry_groups, ids)
        return v1.StatusDocument(
            api_version=API_VERSION,
            generated_at=state.wall_time(),
            sidecar=self._sidecar(),
            label_sets=[v1.LabelSet(id=set_id, labels=dict(static)) for static, set_id in ids.label_sets.items()],
            totals=totals,
            servers=servers,
            ranks=cells,
            streams=streams,
            groups=groups,
            rollups=self._rollups(rolled, sums),
            transfers=self._transfers(rolled, sums, bw_totals),
            bandwidth=self._bandwidth(bandwidth, bw_totals),
            reasons=self._reasons(rolled),
            spread=self._spread(registry_groups, increases, ids),
            upstreams=upstream_rows(self.stats),
            prefill=self.prefill.report(state, increases, built, registry_groups),
        )

    def encode(self) -> bytes:
        """The status document as JSON (msgspec: any label value, markup or control characters, comes out escaped)."""
        return msgspec.json.encode(self.document())

    def _sidecar(self) -> v1.Sidecar:
        stats, state, config = self.stats, self.state, self.config
        budget = state.series_budget()
        return v1.Sidecar(
            version=__version__,
            revision=self.revision,
            python_version=platform.python_version(),
            namespace=config.metrics.namespace,
            profiles=[v1.Profile(name=name, namespace=self.catalog.profile_namespace(name, config.metrics.namespace),
                                 families=sum(1 for f in self.catalog if f.profile == name))
                      for name in self.catalog.profiles],
            started_at=stats.started_at,
            uptime_seconds=round(time.monotonic() - stats.started_monotonic, 3),
            ready=stats.ingest_listening,
            ingest=v1.Ingest(listening=stats.ingest_listening, socket_path=str(config.ingest.socket_path)),
            connections=v1.Connections(open=stats.connections_open, accepted=stats.connections_accepted,
                                       allowed=config.ingest.max_connections),
            frames_received=stats.frames_received,
            snapshots_received=stats.snapshots_received,
            snapshots_applied=stats.snapshots_applied,
            samples_applied=stats.samples_applied,
            streams_by_state=v1.StreamsByState(**{status.value: count for status, count in state.ranks_by_status().items()}),
            rejections=dict(sorted(stats.rejections.items())),
            rejections_total=sum(stats.rejections.values()),
            rollup_layout_conflicts=state.layout_conflicts(),
            limits=v1.Limits(
                series_used=budget.per_rank + budget.rollup,
                series_rank=budget.per_rank,
                series_rollup=budget.rollup,
                series_allowed=budget.limit,
                series_per_rank_allowed=state.config.max_series_per_rank,
                ranks_known=state.rank_count(),
                ranks_allowed=state.config.max_ranks,
                stale_after_seconds=state.config.stale_after_seconds,
                expire_after_seconds=state.config.expire_after_seconds,
                window_seconds=state.window_seconds,
            ),
            persistence=self._persistence(),
        )

    def _persistence(self) -> v1.Persistence | None:
        """The state file's loads and writes; None without one."""
        saving, config = self.stats.persistence, self.config.persistence
        if not saving.enabled or config.file is None:
            return None
        return v1.Persistence(
            file=str(config.file),
            interval_seconds=config.interval_seconds,
            loaded_identities=saving.loaded_identities,
            load_duration_seconds=saving.load_duration,
            load_failures=dict(sorted(saving.load_failures.items())),
            dropped_series=dict(sorted(saving.dropped.items())),
            writes=saving.writes,
            last_write_time=saving.last_write_wall,
            last_write_duration_seconds=saving.last_write_duration,
            write_failures=dict(sorted(saving.write_failures.items())),
            file_bytes=saving.file_bytes,
        )

    def _servers(self, known: list[RankState], servers: list[Server], registry_groups: dict[GroupKey, list[RankState]],
                 ids: DocumentIds
                 ) -> tuple[v1.RankTotals, list[v1.Server], list[v1.RankCell], list[v1.Stream], list[v1.Group]]:
        """The servers with their dp groups' grids, the rank cells they draw, every stream and every replica
        group: ranks and streams counted apart (DESIGN section 13)."""
        state = self.state
        server_ids = {server.labels: server_id(n) for n, server in enumerate(servers)}
        now, wall = state.clock(), state.wall_time()
        cell_of: dict[int, str] = {}  # id(rank) -> its cell's id
        stream_kind: dict[int, str] = {}
        server_of: dict[int, str] = {}
        out_servers: list[v1.Server] = []
        out_cells: list[v1.RankCell] = []
        room = GRID_CELLS
        stream_ids = {id(rank): short_rank_id(ids.groups[rank.replica_group], rank) for rank in known}
        for server in servers:
            sid = server_ids[server.labels]
            by_dp: dict[int, list[Cell]] = {}
            for cell in server.cells.values():
                by_dp.setdefault(cell.position[0], []).append(cell)
                cid = cell_id(sid, *cell.position)
                for stream in cell.streams:
                    cell_of[id(stream.rank)] = cid
                    stream_kind[id(stream.rank)] = stream.kind
                    server_of[id(stream.rank)] = sid
            groups: list[v1.ServerGroup] = []
            for dp in sorted(by_dp):
                cells = by_dp[dp]
                grid, drawn = grid_model(cells, min(GRID_CELLS_PER_GROUP, room))
                room -= len(grid.rows) * len(grid.tp_ranks)
                known_cells = [c for c in cells if c.streams]
                groups.append(v1.ServerGroup(
                    dp_rank=dp, ranks=len(known_cells), live=sum(1 for c in known_cells if c.state == "live"),
                    missing=server.missing_by_dp.get(dp, 0), expected=dp in server.missing_by_dp, grid=grid))
                out_cells.extend(v1.RankCell(
                    id=cell_id(sid, *c.position), server=sid, dp_rank=c.position[0], pp_rank=c.position[1],
                    attn_cp_rank=c.position[2], tp_rank=c.position[3], state=c.state, expected=c.expected,
                    streams=[stream_ids[id(s.rank)] for s in c.streams]) for c in drawn)
            known_cells = server.known_cells
            out_servers.append(v1.Server(
                id=sid, label_set=ids.label_sets[server.labels],
                expected=None if server.layout is None else layout_sizes(server.layout),
                world_conflict=server.conflict, world_implausible=server.implausible,
                worlds=[sizes for world in server.worlds if (sizes := world_sizes(world)) is not None],
                node=None if server.share is None else v1.NodeShare(
                    node_rank=server.share.node_rank, nodes=server.share.nodes,
                    tp_ranks=(server.share.tp.start, server.share.tp.stop),
                    pp_ranks=(server.share.pp.start, server.share.pp.stop)),
                ranks=len(known_cells), live_ranks=sum(1 for c in known_cells if c.state == "live"),
                streams=server.streams, missing=server.missing, dp_groups=groups,
            ))
        streams = [
            v1.Stream(
                id=stream_ids[id(rank)],
                group=ids.groups[rank.replica_group],
                server=server_of[id(rank)],
                rank=cell_of[id(rank)],
                kind=stream_kind[id(rank)],
                tp_rank=rank.tp_rank,
                pp_rank=rank.pp_rank,
                dp_rank=rank.dp_rank,
                attn_cp_rank=rank.attn_cp_rank,
                own_labels=dict(own_labels(rank)),
                state=rank.status.value,
                source=rank.source,
                seconds_since_push=None if rank.last_push_wall is None else round(wall - rank.last_push_wall, 3),
                **lifecycle(rank, now),
            )
            for rank in known
        ]
        group_server = {rank.replica_group: server_of[id(rank)] for rank in known}
        groups_out = [
            v1.Group(
                id=ids.groups[key], label_set=ids.label_sets[key[1]], server=group_server[key], dp_rank=key[0],
                size=len(members), live=sum(1 for rank in members if rank.live),
                pp_ranks=sorted({rank.pp_rank for rank in members}),
                tp_ranks=sorted({rank.tp_rank for rank in members}),
                attn_cp_ranks=sorted({rank.attn_cp_rank for rank in members if rank.attn_cp_rank is not None}),
            )
            for key, members in sorted(registry_groups.items(), key=lambda item: (item[0][1], item[0][0]))
        ]
        all_known = [c for server in servers for c in server.known_cells]
        totals = v1.RankTotals(
            servers=len(servers), ranks=len(all_known), live_ranks=sum(1 for c in all_known if c.state == "live"),
            streams=len(known), missing=sum(server.missing for server in servers))
        return totals, out_servers, out_cells, streams, groups_out

    @staticmethod
    def _series_total(entries: list[tuple[RollupKey, float | HistAccumulator]]) -> float:
        return sum(value.counts[-1] if isinstance(value, HistAccumulator) else value for _, value in entries)

    def _rollups(self, cells: dict[str, list[tuple[RollupKey, float | HistAccumulator]]],
                 totals: dict[str, float]) -> list[v1.Rollup]:
        return [
            v1.Rollup(
                family=spec.name,
                exported=self.families.rollup[spec.name].name,
                type=spec.type.value,
                semantics=spec.semantics.value,
                attempt_level=spec.attempt_level,
                unit=unit_of(spec.name),
                total=totals.get(spec.name, 0.0),
                series_count=len(cells.get(spec.name, ())),
            )
            for spec in self.catalog
        ]

    def _transfers(self, cells: dict[str, list[tuple[RollupKey, float | HistAccumulator]]], totals: dict[str, float],
                   bw_totals: dict[str, Bandwidth]) -> list[v1.Transfer]:
        """Every profile's tier transfers (the catalog's), their rolled-up totals and active bandwidth."""
        catalog = self.catalog
        out = []
        for profile, transfer in self.transfers:
            tokens, moved, seconds = catalog.held(transfer.tokens), catalog.held(transfer.bytes), catalog.held(transfer.seconds)
            out.append(v1.Transfer(
                name=transfer.name,
                profile=profile.name,
                source=transfer.source,
                target=transfer.target,
                tokens_family=tokens,
                tokens=None if tokens is None else totals.get(tokens, 0.0),
                bytes_family=moved,
                bytes=None if moved is None else totals.get(moved, 0.0),
                bytes_per_second=None if moved is None else rate(bw_totals.get(moved)),
                seconds_family=seconds,
                seconds=None if seconds is None else sum(
                    value.sum for _, value in cells.get(seconds, ()) if isinstance(value, HistAccumulator)),
            ))
        return out

    def _bandwidth(self, bandwidth: dict[str, list[tuple[RollupKey, Bandwidth]]],
                   bw_totals: dict[str, Bandwidth]) -> v1.Bandwidth:
        families = []
        for bytes_spec, duration_spec in self.pairs:
            total = bw_totals.get(bytes_spec.name, Bandwidth(0.0, 0.0))
            moving = [(key, value) for key, value in
                      ((key, rate(bw)) for key, bw in bandwidth.get(bytes_spec.name, ())) if value is not None]
            listed = sorted(moving, key=lambda item: -item[1])[:BANDWIDTH_SERIES_LISTED]
            families.append(v1.BandwidthFamily(
                family=bytes_spec.name,
                exported=self.families.bandwidth[bytes_spec.name][1].name,
                duration_family=duration_spec.name,
                transfer=self.transfer_of.get(bytes_spec.name),
                bytes_per_second=rate(total),
                bytes_delta=total.bytes_delta,
                seconds_delta=total.seconds_delta,
                series=[v1.BandwidthSeries(labels=_labels(bytes_spec.labels, values, static), bytes_per_second=value)
                        for (_, static, values), value in listed],
                series_count=len(moving),
                history=self.history.history(bytes_spec.name),
            ))
        return v1.Bandwidth(
            window_seconds=self.state.window_seconds,
            history_interval_seconds=self.history.interval,
            history_points=self.history.points,
            families=families,
        )

    def _reasons(self, cells: dict[str, list[tuple[RollupKey, float | HistAccumulator]]]) -> list[v1.ReasonFamily]:
        out: list[v1.ReasonFamily] = []
        for spec in self.reason_specs:
            at = spec.labels.index("reason")
            by_reason = dict.fromkeys(spec.preset.get("reason", ()), 0.0)
            found: dict[str, float] = {}
            for (_, _, values), value in cells.get(spec.name, ()):
                amount = value.counts[-1] if isinstance(value, HistAccumulator) else value
                if values[at] in by_reason:
                    by_reason[values[at]] += amount
                else:
                    found[values[at]] = found.get(values[at], 0.0) + amount
            # The largest pushed reasons, ties alphabetically; the rest only counted and summed.
            largest = sorted(found.items(), key=lambda item: (-item[1], item[0]))
            rest = largest[REASONS_LISTED:]
            by_reason.update(sorted(largest[:REASONS_LISTED]))
            out.append(v1.ReasonFamily(
                family=spec.name,
                semantics=spec.semantics.value,
                attempt_level=spec.attempt_level,
                total=sum(by_reason.values()) + sum(value for _, value in rest),
                by_reason=[v1.ReasonValue(reason=reason, value=value) for reason, value in by_reason.items()],
                other_reasons=len(rest),
                other_value=sum(value for _, value in rest),
            ))
        return out

    def _spread(self, registry_groups: dict[GroupKey, list[RankState]], increases: dict[int, Increases],
                ids: DocumentIds) -> v1.Spread:
        state = self.state
        # The window's rule: a group is read while at least two of its replicas are current.
        current = {key for key, members in registry_groups.items() if sum(1 for r in members if r.current) >= 2}
        per_group: dict[GroupKey, list[tuple[str, LabelValues, float]]] = {}
        for (family, group_key, values), ratio in state.spreads(increases).items():
            per_group.setdefault(group_key, []).append((family, values, ratio))
        groups: list[v1.SpreadGroup] = []
        default = self.catalog.default_profile
        for key in sorted(current, key=lambda k: (k[1], k[0])):
            entries = sorted((e for e in per_group.get(key, ()) if e[2] > 0), key=lambda e: -e[2])
            top = entries[0][2] if entries else 0.0
            # A group's families are of one profile: the widest series' says which threshold applies.
            threshold = self.spread_threshold[self.specs[entries[0][0]].profile] if entries else default.spread_threshold
            groups.append(v1.SpreadGroup(
                group=ids.groups[key],
                max_ratio=top,
                diverging=top > threshold,
                series=[v1.SpreadSeries(family=family, labels=dict(zip(self.specs[family].labels, values)), ratio=ratio)
                        for family, values, ratio in entries[:SPREAD_SERIES_LISTED]],
                series_count=len(entries),
            ))
        return v1.Spread(threshold=default.spread_threshold, groups=groups)


@dataclass(slots=True)
class _Served:
    """One encoded body and when it was built: the JSON, or the page."""

    built_at: float = float("-inf")
    token: tuple[int, ...] = ()
    plain: bytes = b""
    gzipped: bytes | None = None


class EncodedStatus:
    """The status document as served, as JSON and (with `render`) as the page: each encoded once per `max_age`
    (one housekeeping tick) and shared by every request until then, with its gzipped form made on first
    demand; one copy of each is held.

    Without it each request built its own copy, and viewers of a sidecar whose series were all
    escape-heavy labels held one document each at once (measured: docs/reliability.md, section
    Memory budget); the page's script fetches the page every few seconds, so its viewers share one too.
    A frame, a connection or an upstream read since the build makes it stale at once, so a reader
    polling for a change sees it on its next request.
    """

    def __init__(self, view: StatusView, max_age: float = ENCODED_MAX_AGE_SECONDS,
                 render: Callable[[v1.StatusDocument], str] | None = None) -> None:
        self.view = view
        self.max_age = max_age
        self.render = render
        self._json = _Served()
        self._page = _Served()

    def _change_token(self) -> tuple[int, ...]:
        stats = self.view.stats
        saving = stats.persistence
        return (stats.frames_received, stats.connections_accepted, stats.connections_open,
                saving.writes, sum(saving.write_failures.values()),
                *(health.scrapes for health in stats.upstreams.values()))

    def _served(self, served: _Served, build: Callable[[], bytes], gzipped: bool) -> bytes:
        now = self.view.state.clock()
        token = self._change_token()
        if now - served.built_at >= self.max_age or token != served.token:
            served.plain, served.gzipped = b"", None  # let the old copy go before the new one is built
            served.plain = build()
            served.built_at, served.token = now, token
        if not gzipped:
            return served.plain
        if served.gzipped is None:
            served.gzipped = gzip.compress(served.plain, compresslevel=1)
        return served.gzipped

    def body(self, gzipped: bool) -> bytes:
        """The current document's JSON, gzipped (level 1) if asked."""
        return self._served(self._json, self.view.encode, gzipped)

    def page(self, gzipped: bool) -> bytes:
        """The current document as the status page (`render`), gzipped (level 1) if asked."""
        render = self.render
        if render is None:
            raise RuntimeError("EncodedStatus.page needs a render function")
        return self._served(self._page, lambda: render(self.view.document()).encode(), gzipped)
