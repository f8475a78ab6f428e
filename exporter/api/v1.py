"""The JSON API v1 as msgspec Structs: GET /api/v1/status and GET /api/v1/ranks, stated once.

The sidecar builds these (exporter.sidecar.expose.status), the status page renders them
(expose.page), `hicache-exporter top` decodes its polls into them, and docs/api/v1.schema.json is
generated from them: `python -m exporter.api.v1 --write-schema docs/api/v1.schema.json`
(`--check` says whether the committed file is current). Only msgspec and the standard library are
imported, so `top` reads the model without the sidecar's runtime. Field order is the order the
sidecar writes the keys in. docs/api.md explains every field.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

API_VERSION = 1
SCHEMA_PATH = Path("docs/api/v1.schema.json")
WRITE_COMMAND = f"python -m exporter.api.v1 --write-schema {SCHEMA_PATH}"
BANDWIDTH_SERIES_LISTED = 20  # per bytes family, the fastest (the rest only counted)
SPREAD_SERIES_LISTED = 5  # per replica group, the widest (the rest only counted)
PREFILL_SCOPES_LISTED = 64  # prefill's servers and dp groups, those with the most tokens (the rest only counted)

Count = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(ge=0)]
UnixTime = Annotated[float, Meta(description="Wall-clock time, seconds since the Unix epoch.")]
Ratio = Annotated[float, Meta(ge=0, le=1)]
Labels = Annotated[dict[str, str], Meta(description="Label name to label value; values are arbitrary strings, shown as text.")]
CountsByName = dict[str, Count]
GroupId = Annotated[str, Meta(pattern="^g[0-9]+$", description="id of a replica group in `groups`")]
LabelSetId = Annotated[str, Meta(pattern="^s[0-9]+$", description="id of its static labels in `label_sets`")]
RankStateName = Literal["live", "stale", "departed", "expired"]
Tier = Literal["L1", "L2", "L3"]
Semantics = Literal["per_shard", "replicated", "per_engine"]
Unit = Literal["tokens", "bytes", "seconds", "pages", "states", "gigabytes_per_second"]


class Model(msgspec.Struct, kw_only=True, gc=False):
    """Every object of the API: built once per document and only read after (gc=False: they hold no cycles)."""


# --- the sidecar -----------------------------------------------------------------------------


class Ingest(Model):
    """The ingest socket ranks push to."""

    listening: bool
    socket_path: str


class Connections(Model):
    """Rank connections to the ingest socket."""

    open: Count
    accepted: Count
    allowed: Count


class StreamsByState(Model):
    """Known streams (rank identities) in each state."""

    live: Count
    stale: Count
    departed: Count
    expired: Count


class Limits(Model):
    """The sidecar's bounds and how much of them is used."""

    series_used: Count
    series_rank: Count
    series_rollup: Count
    series_allowed: Count
    series_per_rank_allowed: Count
    ranks_known: Count
    ranks_allowed: Count
    stale_after_seconds: Seconds
    expire_after_seconds: Seconds
    window_seconds: Seconds


class Persistence(Model):
    """The state file (--persistence.file): what the load at start took back, and how the writes go."""

    file: str
    interval_seconds: Seconds
    loaded_identities: Annotated[Count, Meta(description="rank identities taken back at start; 0: started fresh")]
    load_duration_seconds: Annotated[float | None, Meta(description="null: nothing was loaded")]
    load_failures: Annotated[CountsByName, Meta(description="by reason: files set aside at start")]
    dropped_series: Annotated[CountsByName, Meta(description="by reason: series of the file left out at load")]
    writes: Count
    last_write_time: Annotated[UnixTime | None, Meta(description="null: not written yet")]
    last_write_duration_seconds: Annotated[float | None, Meta(description="null: not written yet")]
    write_failures: Annotated[CountsByName, Meta(description="by reason")]
    file_bytes: Annotated[Count | None, Meta(description="the file last written or loaded; null: neither yet")]


class Profile(Model):
    """One engine profile the sidecar serves (DESIGN section 14)."""

    name: Annotated[str, Meta(description="sglang, lmcache, or an operator's profile file's name")]
    namespace: Annotated[str, Meta(description="prefix of its exported families")]
    families: Count


class Sidecar(Model):
    """The sidecar itself: build, uptime, ingest traffic, rejections, limits and its state file."""

    version: str
    revision: Annotated[str, Meta(description='git commit, or "unknown"')]
    python_version: str
    namespace: Annotated[str, Meta(description="prefix of the default profile's (sglang's) exported families")]
    profiles: Annotated[list[Profile], Meta(description="the engine profiles served, the default one first")]
    started_at: UnixTime
    uptime_seconds: Seconds
    ready: Annotated[bool, Meta(description="what /-/ready answers: the ingest socket is listening")]
    ingest: Ingest
    connections: Connections
    frames_received: Count
    snapshots_received: Count
    snapshots_applied: Count
    samples_applied: Count
    streams_by_state: StreamsByState
    rejections: Annotated[CountsByName, Meta(
        description="every rejection reason (wire protocol error code), including those still at 0")]
    rejections_total: Count
    rollup_layout_conflicts: Annotated[CountsByName, Meta(
        description="by family: rank histogram series left out of their rollup (bucket layout differs)")]
    limits: Limits
    persistence: Annotated[Persistence | None, Meta(description="null: no state file (--persistence.file)")] = None


# --- servers, their ranks (positions) and streams (identities that report for a rank) ----------


class WorldSizes(Model):
    """A server's parallel layout: its dp groups, each pp stages x attention cp ranks x attention tp ranks."""

    tp_size: Annotated[int, Meta(ge=1, description="the engine's tp size (--tp)")]
    pp_size: Annotated[int, Meta(ge=1)]
    dp_size: Annotated[int, Meta(ge=1, description="dp groups: attention dp groups, or data-parallel replicas")]
    attn_tp_size: Annotated[int, Meta(ge=1, description="tp ranks per dp group and cp rank")]
    attn_cp_size: Annotated[int, Meta(ge=1, description="attention context-parallel ranks per dp group")]


class NodeShare(Model):
    """The part of a multi-node server this sidecar expects (ranks.node_rank of ranks.nodes): the engine's
    own placement, by global tp rank and pp stage."""

    node_rank: Count
    nodes: Annotated[int, Meta(ge=1)]
    tp_ranks: Annotated[tuple[Count, Count], Meta(description="[first, last + 1] global tp ranks on this node")]
    pp_ranks: Annotated[tuple[Count, Count], Meta(description="[first, last + 1] pp stages on this node")]


StreamKind = Annotated[str, Meta(description=(
    "the engine collector the stream is (radix, storage, scheduler), by the catalog's stream markers; "
    "\"client\" for an identity that carries no marker"))]
RankCellId = Annotated[str, Meta(pattern="^v[0-9]+/dp=[0-9]+,pp=[0-9]+,cp=[0-9]+,tp=[0-9]+$", description=(
    "id of a rank cell in `ranks`: <server id>/dp=..,pp=..,cp=..,tp=.. (attention tp rank)"))]
ServerId = Annotated[str, Meta(pattern="^v[0-9]+$", description="id of a server in `servers`")]
CellState = Literal[RankStateName, "missing"]  # a stream's states, then a rank no unexpired stream holds


class Stream(Model):
    """One stream: a rank identity (rank axes, its group's label set and its own labels) that reports for a
    rank, in exposition order. An engine process reports through one stream per collector."""

    id: Annotated[str, Meta(pattern="^g[0-9]+/tp=[0-9]+,pp=[0-9]+(,cp=[0-9]+)?( .+)?$", description=(
        'unique within the document: <group id>/tp=..,pp=..[,cp=..] then its own labels as name="value" '
        "(backslash, quote and newline escaped), if any"))]
    group: GroupId
    server: ServerId
    rank: Annotated[RankCellId, Meta(description="the rank (position) it reports for")]
    kind: StreamKind
    tp_rank: Annotated[Count, Meta(description="as labelled: the scheduler's is the global tp rank")]
    pp_rank: Count
    dp_rank: Count
    attn_cp_rank: Annotated[Count | None, Meta(description="null: the stream has no context-parallel axis")]
    own_labels: Annotated[Labels, Meta(description=(
        "static labels of its identity that its group's label set leaves out (moe_ep_rank); usually empty"))]
    state: RankStateName
    source: Annotated[str, Meta(pattern="^(push|released|upstream:.+)$")]
    seconds_since_push: Annotated[float | None, Meta(description="null: never pushed a snapshot")]
    epoch: str
    pid: int
    seq: Annotated[int, Meta(ge=-1, description="-1: no snapshot yet this epoch")]
    restarts: Count
    reconnects: Count
    snapshots: Count
    series: Count
    seconds_since_activity: Seconds
    last_push_time: UnixTime | None
    world: Annotated[WorldSizes | None, Meta(description="null: the stream said hello without a world")]


class LabelSet(Model):
    """A static label set some replica group or server carries, written once for the whole document."""

    id: Annotated[str, Meta(pattern="^s[0-9]+$", description=(
        "s<N>, numbered in ascending order of the labels; unique within the document"))]
    labels: Labels


class RankCell(Model):
    """A rank: one position of a server (dp group, pp stage, attention cp and tp rank), one process on a GPU,
    with the streams that report for it. Listed for the cells its server's grids draw."""

    id: RankCellId
    server: ServerId
    dp_rank: Count
    pp_rank: Count
    attn_cp_rank: Count
    tp_rank: Annotated[Count, Meta(description="the attention tp rank")]
    state: Annotated[CellState, Meta(description=(
        "its liveliest stream's state; missing: expected by the server's world, and no stream, or only "
        "expired ones"))]
    expected: Annotated[bool, Meta(description="inside the server's expected world (and this node's share)")]
    streams: Annotated[list[str], Meta(description="ids in `streams`, in their order")]


class GridRow(Model):
    """A row of a dp group's grid: a pp stage and an attention cp rank."""

    pp_rank: Count
    attn_cp_rank: Count


class Grid(Model):
    """What a dp group's grid draws (the page and top): pp x cp rows by tp columns, at most 1,024 cells
    per dp group and 4,096 over the document; the counts are exact."""

    rows: Annotated[list[GridRow], Meta(description="ascending by pp, then cp")]
    tp_ranks: Annotated[list[Count], Meta(description="the columns (attention tp ranks), ascending")]
    row_count: Annotated[Count, Meta(description="the rows the grid has, drawn or not")]
    column_count: Annotated[Count, Meta(description="the tp columns the grid has, drawn or not")]
    hidden_ranks: Annotated[Count, Meta(description="ranks (known or missing) in no drawn cell")]


class ServerGroup(Model):
    """One dp group of a server: its ranks as a grid of cells."""

    dp_rank: Count
    ranks: Annotated[Count, Meta(description="positions some known stream reports for")]
    live: Annotated[Count, Meta(description="ranks with a live stream")]
    missing: Annotated[Count, Meta(description="exact: positions of the expected world with no unexpired stream")]
    expected: Annotated[bool, Meta(description="the dp group is in the expected world")]
    grid: Grid


class Server(Model):
    """A server: streams whose static labels differ only by the labels their collector adds (the catalog's
    stream labels), with its expected world and its dp groups."""

    id: Annotated[str, Meta(pattern="^v[0-9]+$", description=(
        "v<N>, numbered in ascending order of its labels; unique within the document"))]
    label_set: Annotated[LabelSetId, Meta(description=(
        "its labels in `label_sets`: the static labels its streams share, less the labels their collector adds"))]
    expected: Annotated[WorldSizes | None, Meta(description=(
        "the world its streams reported or its upstream configures; null: none, or they disagree (world_conflict)"))]
    world_conflict: Annotated[bool, Meta(description=(
        "its streams reported different worlds, or one with more positions than the sidecar keeps rank identities "
        "(world_implausible)"))]
    world_implausible: Annotated[bool, Meta(description=(
        "the one world reported has more positions (dp x pp x cp x attention tp) than ranks.max_ranks"))]
    worlds: Annotated[list[WorldSizes], Meta(description="every distinct world its streams reported, at most 8")]
    node: Annotated[NodeShare | None, Meta(description="null: the whole server is expected here (ranks.nodes 1)")]
    ranks: Annotated[Count, Meta(description="positions some known stream reports for")]
    live_ranks: Count
    streams: Count
    missing: Annotated[Count, Meta(description="exact: expected positions with no unexpired stream")]
    dp_groups: Annotated[list[ServerGroup], Meta(description="ascending by dp_rank; expected ones and ones seen")]


class Group(Model):
    """A replica group: the streams sharing dp_rank and static labels (they count the same logical tokens)."""

    id: Annotated[str, Meta(pattern="^g[0-9]+$", description=(
        "g<N>, numbered in order (static labels, then dp_rank); unique within the document"))]
    label_set: LabelSetId
    server: ServerId
    dp_rank: Count
    size: Count
    live: Count
    pp_ranks: list[Count]
    tp_ranks: list[Count]
    attn_cp_ranks: list[Count]


class RankTotals(Model):
    """Ranks and streams counted apart, over every server: what the page's and top's headers say."""

    servers: Count
    ranks: Annotated[Count, Meta(description="positions some known stream reports for")]
    live_ranks: Count
    streams: Count
    missing: Annotated[Count, Meta(description="exact: expected positions with no unexpired stream")]


# --- rollups, transfers, bandwidth, reasons, spread --------------------------------------------


class Rollup(Model):
    """One catalog family's rollup (as on /metrics under <namespace>rollup_): its total and how many series;
    the series themselves are on /metrics."""

    family: str
    exported: Annotated[str, Meta(description="the rollup's exported name (counters without _total)")]
    type: Literal["counter", "gauge", "histogram"]
    semantics: Semantics
    attempt_level: bool
    unit: Unit | None
    total: Annotated[float, Meta(description="sum of the series' values (a histogram: its counts)")]
    series_count: Annotated[Count, Meta(description="rollup series of the family on /metrics")]


class Transfer(Model):
    """Totals per tier: one data movement between two cache tiers, its logical tokens and physical bytes, as
    its profile's catalog declares it (DESIGN section 17)."""

    name: str
    source: Tier = msgspec.field(name="from")
    target: Tier = msgspec.field(name="to")
    tokens_family: str | None
    tokens: Annotated[float | None, Meta(description=(
        "rolled-up tokens (replicated: one replica per group); null: the family is not in the catalog"))]
    bytes_family: str | None
    bytes: Annotated[float | None, Meta(description=(
        "rolled-up bytes (sum of shards); null: the family is not in the catalog"))]
    bytes_per_second: Annotated[float | None, Meta(description=(
        "active bandwidth over the window; null: no transfer in the window, or not a finite number"))]
    seconds_family: Annotated[str | None, Meta(description=(
        "the histogram of its durations; null: the profile names none, or it is not in the catalog"))] = None
    seconds: Annotated[float | None, Meta(description=(
        "rolled-up seconds spent moving (sum of shards: the histogram's sum); null: no seconds family"))] = None
    profile: Annotated[str | None, Meta(description=(
        "the engine profile that declares it; absent from a sidecar before profiles declared their transfers"))] = None


# --- prefill: where prefill tokens come from, and what a hit costs (DESIGN section 18) -------------------

Tokens = Annotated[float, Meta(ge=0)]
NonNegative = Annotated[float, Meta(ge=0)]
PerHitToken = Annotated[NonNegative | None, Meta(description=(
    "per hit token; null: no hit token, the transfer (or its family) is not in the catalog, or no rank reports it"))]


class PrefillTokens(Model):
    """Prefill tokens by where they came from (the profile's counts: `prefill.counts`), and their sum."""

    computed: Annotated[Tokens, Meta(description=(
        "computed, no tier held them: counted, or what the prompt leaves after the hits (never below 0)"))]
    device: Tokens
    host: Annotated[Tokens | None, Meta(description=(
        "null: the profile's families cannot tell host hits from storage hits (`offload` holds both)"))]
    storage: Annotated[Tokens | None, Meta(description="null: as `host`")]
    offload: Annotated[Tokens, Meta(description="every hit past the device: host and storage hits")]
    total: Annotated[Tokens, Meta(description="every prefill token: counted apart (the prompt), or the kinds' sum")]


class HitRatio(Model):
    """Each tier's share of all prefill tokens, 0-1; null: no prefill token at all, or (host, storage) the
    profile cannot tell the two apart."""

    device: Ratio | None
    host: Ratio | None
    storage: Ratio | None
    offload: Annotated[Ratio | None, Meta(description="host and storage hits together")]


class TierCost(Model):
    """What one tier's hits cost in one scope (the transfers: `prefill.tiers`): bytes and seconds read back to
    the tier above, and bytes written to keep the tier filled; each also per hit token of the tier (the host
    tier's: host and storage hits, both loaded back from host memory). Bytes: sum of shards; seconds: summed
    over the ranks that moved them. Null: the family is not in the catalog, or no rank reports it."""

    read_bytes: NonNegative | None
    read_seconds: NonNegative | None
    fill_bytes: NonNegative | None
    bytes_per_hit_token: PerHitToken
    seconds_per_hit_token: PerHitToken
    fill_bytes_per_hit_token: PerHitToken


class TierCosts(Model):
    """By tier; null: the profile has no such tier (`host` and `storage` where it cannot tell them apart,
    `offload` where it can)."""

    host: TierCost | None
    storage: TierCost | None
    offload: TierCost | None


class PrefillFigures(Model):
    """One scope's figures: its tokens, each tier's share and what each tier's hits cost."""

    tokens: PrefillTokens
    hit_ratio: HitRatio
    computed_ratio: Annotated[Ratio | None, Meta(description="share computed (no tier held it); null: no token")]
    cost: TierCosts


class PrefillServer(PrefillFigures):
    server: Annotated[str, Meta(description="id of the server in `servers`")]


class PrefillGroup(PrefillFigures):
    server: Annotated[str, Meta(description="id of the server in `servers`")]
    dp_rank: Count


class PrefillPeriod(PrefillFigures):
    """The whole sidecar over one period, and its breakdowns: per server and per dp group of a server (the
    ones with the most prefill tokens since start, in document order; the counts say how many there are)."""

    servers: Annotated[list[PrefillServer], Meta(max_length=PREFILL_SCOPES_LISTED)]
    servers_count: Count
    dp_groups: Annotated[list[PrefillGroup], Meta(max_length=PREFILL_SCOPES_LISTED)]
    dp_groups_count: Count


class TierTransfers(Model):
    """Which transfers a tier's costs count, from its profile's catalog (DESIGN section 17): a hit in L<k> is
    read back to L<k-1>, and the tier is filled from it. Null: the profile declares no such transfer."""

    level: Tier
    read_transfer: Annotated[str | None, Meta(description="`transfers[].name` of the transfer serving a hit")]
    fill_transfer: Annotated[str | None, Meta(description="`transfers[].name` of the transfer filling the tier")]


class TiersTransfers(Model):
    """By tier, as `TierCosts`."""

    host: TierTransfers | None
    storage: TierTransfers | None
    offload: TierTransfers | None


class PrefillCount(Model):
    """Where the profile counts one kind of prefill token: a counter family and, where that family counts
    several kinds, its label's value for this one."""

    family: str
    exported: Annotated[str, Meta(description="its rollup family on /metrics")]
    label: str | None
    value: str | None


class Prefill(Model):
    """Where prefill tokens come from and what a hit costs: exact since the sidecar started (the rollups) and
    over the window (the ranks' positions, as the bandwidth is)."""

    profile: str
    counts: Annotated[dict[str, PrefillCount], Meta(description=(
        "by kind: `computed` (or `prompt`, all prompt tokens, where computed is what they leave after the "
        "hits), then each tier's hits: `device`, then `host` and `storage`, or `offload`"))]
    tiers: TiersTransfers
    window_seconds: Seconds
    since_start: PrefillPeriod
    window: PrefillPeriod


BandwidthPoint = Annotated[tuple[UnixTime, float | None], Meta(
    description="[sample time, bytes per second]; null: no transfer in the window ending then")]


class BandwidthSeries(Model):
    """One rolled-up series of a bytes family and its active bandwidth."""

    labels: Labels
    bytes_per_second: Annotated[float, Meta(ge=0)]


class BandwidthFamily(Model):
    """A bytes counter's rolled-up active bandwidth over the window, its fastest series and its history."""

    family: Annotated[str, Meta(description="the bytes counter")]
    exported: Annotated[str, Meta(description="the rolled-up gauge on /metrics")]
    duration_family: str
    transfer: Annotated[str | None, Meta(description="name in `transfers`; null: a family outside the known tiers")]
    bytes_per_second: Annotated[float | None, Meta(description=(
        "all series together; null: no transfer in the window, or not a finite number"))]
    bytes_delta: Annotated[float, Meta(ge=0)]
    seconds_delta: Annotated[float, Meta(ge=0)]
    series: Annotated[list[BandwidthSeries], Meta(max_length=BANDWIDTH_SERIES_LISTED, description=(
        "the fastest series (finite rates only), fastest first"))]
    series_count: Annotated[Count, Meta(description="series with a finite rate in the window, listed or not")]
    history: Annotated[list[BandwidthPoint], Meta(description="oldest first, at most history_points")]


class Bandwidth(Model):
    """Active bandwidth per bytes family, and how its history is sampled."""

    window_seconds: Seconds
    history_interval_seconds: Seconds
    history_points: Count
    families: list[BandwidthFamily]


class ReasonValue(Model):
    """One reason's rolled-up value."""

    reason: str
    value: float


class ReasonFamily(Model):
    """A rolled-up family with a `reason` label, summed by reason over its other labels and static labels."""

    family: str
    semantics: Semantics
    attempt_level: bool
    total: Annotated[float, Meta(description="every reason, listed or not")]
    by_reason: Annotated[list[ReasonValue], Meta(description=(
        "the catalog's preset reasons, then at most 20 others, the largest"))]
    other_reasons: Annotated[Count, Meta(description="reasons pushed and not listed")]
    other_value: Annotated[float, Meta(description="their sum")]


class SpreadSeries(Model):
    """One series of a replica group and how far its replicas' increases disagree."""

    family: str
    labels: Annotated[Labels, Meta(description="the family's own labels")]
    ratio: Ratio


class SpreadGroup(Model):
    """A replica group with at least two current replicas, and its widest series."""

    group: GroupId
    max_ratio: Ratio
    diverging: bool
    series: Annotated[list[SpreadSeries], Meta(max_length=SPREAD_SERIES_LISTED, description=(
        "the widest series, widest first"))]
    series_count: Annotated[Count, Meta(description="series whose ratio is above 0, listed or not")]


class Spread(Model):
    """How far replicas disagree over the window, per replica group."""

    threshold: Annotated[float, Meta(description="a group whose max_ratio exceeds it is diverging")]
    groups: list[SpreadGroup]


class Upstream(Model):
    """An engine the sidecar reads (proxy mode), and how its reads go."""

    name: str
    source: Annotated[str, Meta(description="URL or multiprocess directory")]
    up: bool
    last_scrape_time: Annotated[UnixTime | None, Meta(description="null: never read successfully")]
    last_scrape_duration_seconds: Annotated[float | None, Meta(description="null: never read")]
    samples: Count
    scrapes: Count
    ranks: Count
    pass_through_families: Count
    errors: CountsByName
    last_error: str | None
    unranked_families: list[str]
    cp_colliding_families: list[str]
    world: Annotated[WorldSizes | None, Meta(description=(
        "the world its ranks are expected in: `world:` in its config, completed by the engine's pp_size and "
        "attn_cp_size labels; null: none configured"))]
    world_problems: Annotated[list[str], Meta(description=(
        "where the engine's labels contradict the configured world (at most 8, one line each); "
        "the configured world is then not trusted"))]


# --- the two bodies ----------------------------------------------------------------------------


class StatusDocument(Model):
    """GET /api/v1/status: everything the status page and `hicache-exporter top` show, as of one instant."""

    api_version: Annotated[int, Meta(extra_json_schema={"const": API_VERSION})]
    generated_at: UnixTime
    sidecar: Sidecar
    label_sets: Annotated[list[LabelSet], Meta(description=(
        "every static label set of a replica group or a server, once, ascending"))]
    totals: RankTotals
    servers: list[Server]
    ranks: Annotated[list[RankCell], Meta(description="the rank cells the grids draw, by server, dp, pp, cp, tp")]
    streams: list[Stream]
    groups: list[Group]
    rollups: list[Rollup]
    transfers: list[Transfer]
    bandwidth: Bandwidth
    reasons: list[ReasonFamily]
    spread: Spread
    upstreams: list[Upstream]
    prefill: Annotated[Prefill | None, Meta(description=(
        "null: no profile in use counts prefill tokens by tier; absent from a sidecar before it did"))] = None


class RankRow(Model):
    """A row of GET /api/v1/ranks (kept as it was before /api/v1/status)."""

    tp_rank: Count
    pp_rank: Count
    dp_rank: Count
    attn_cp_rank: Count | None
    labels: Labels
    status: RankStateName
    epoch: str
    pid: int
    seq: Annotated[int, Meta(ge=-1)]
    restarts: Count
    reconnects: Count
    snapshots: Count
    series: Count
    seconds_since_activity: Seconds
    last_push_time: UnixTime | None
    world: WorldSizes | None


class RanksResponse(Model):
    """GET /api/v1/ranks"""

    ranks: list[RankRow]
    upstreams: list[Upstream]


# --- reading the document --------------------------------------------------------------------


def world_name(world: WorldSizes) -> str:
    """`dp 2 × pp 2 × tp 2` (with `× cp N` when context parallel): a world as the page and top name it."""
    cp = f" × cp {world.attn_cp_size}" if world.attn_cp_size > 1 else ""
    return f"dp {world.dp_size} × pp {world.pp_size}{cp} × tp {world.attn_tp_size}"


# --- the schema --------------------------------------------------------------------------------

# The names the schema's definitions had when it was written by hand (docs/api.md and clients cite
# `#/$defs/status`): a definition is the Struct's name in snake_case, but for these.
_DEFINITION_NAMES = {"StatusDocument": "status", "RanksResponse": "ranks_response", "RankRow": "ranks_row"}


def _definition(name: str) -> str:
    return _DEFINITION_NAMES.get(name) or re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _closed(node: Any) -> Any:
    """Every object with properties closed (additionalProperties: false), so a field the sidecar adds without
    a model change fails the tests; clients (`top`) still decode past unknown fields, as v1 may grow."""
    if isinstance(node, dict):
        out = {key: _closed(value) for key, value in node.items()}
        if out.get("type") == "object" and "properties" in out:
            out["additionalProperties"] = False
        return out
    if isinstance(node, list):
        return [_closed(item) for item in node]
    return node


def json_schema() -> dict[str, Any]:
    """docs/api/v1.schema.json: the two bodies (`#/$defs/status`, `#/$defs/ranks_response`) and what they hold."""
    (status, ranks), components = msgspec.json.schema_components(
        (StatusDocument, RanksResponse), ref_template="#/$defs/{name}")
    renames = {f"#/$defs/{name}": f"#/$defs/{_definition(name)}" for name in components}

    def renamed(node: Any) -> Any:
        if isinstance(node, dict):
            return {key: renames.get(value, value) if key == "$ref" else renamed(value) for key, value in node.items()}
        if isinstance(node, list):
            return [renamed(item) for item in node]
        return node

    definitions = {_definition(name): _closed(renamed(schema)) for name, schema in sorted(components.items())}
    for schema in definitions.values():
        schema.pop("title", None)  # the class name again; the definition's name says it
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": "https://github.com/hicache-exporter/hicache-exporter/docs/api/v1.schema.json",
        "title": "hicache-exporter JSON API v1",
        "description": (
            "Responses of GET /api/v1/status and GET /api/v1/ranks. docs/api.md explains every field, its unit and "
            "what null means. Objects are closed (additionalProperties: false) so a field added without a schema "
            "change fails the tests; a client should still ignore fields it does not know, as v1 may grow. "
            f"Generated from exporter/api/v1.py: {WRITE_COMMAND}"),
        "oneOf": [renamed(status), renamed(ranks)],
        "$defs": definitions,
    }


def schema_text() -> str:
    """The schema as committed: two-space indents, keys in the model's order, a final newline."""
    return json.dumps(json_schema(), indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Write the generated schema, or check that the committed one is current (1 when it is not)."""
    parser = argparse.ArgumentParser(prog="python -m exporter.api.v1", description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--write-schema", type=Path, metavar="FILE", help="write the JSON Schema to FILE")
    group.add_argument("--check", type=Path, metavar="FILE", help="exit 1 unless FILE is what --write-schema writes")
    args = parser.parse_args(argv)
    if args.write_schema is not None:
        args.write_schema.write_text(schema_text(), encoding="utf-8")
        return 0
    current = args.check.read_text(encoding="utf-8") if args.check.exists() else ""
    if current != schema_text():
        print(f"{args.check} is not what exporter/api/v1.py generates; run: {WRITE_COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
