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
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

API_VERSION = 1
SCHEMA_PATH = Path("docs/api/v1.schema.json")
WRITE_COMMAND = f"python -m exporter.api.v1 --write-schema {SCHEMA_PATH}"
BANDWIDTH_SERIES_LISTED = 20  # per bytes family, the fastest (the rest only counted)
SPREAD_SERIES_LISTED = 5  # per replica group, the widest (the rest only counted)

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
Semantics = Literal["per_shard", "replicated"]
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


class RanksByState(Model):
    """Known ranks in each state."""

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


class Sidecar(Model):
    """The sidecar itself: build, uptime, ingest traffic, rejections, limits and its state file."""

    version: str
    revision: Annotated[str, Meta(description='git commit, or "unknown"')]
    python_version: str
    namespace: Annotated[str, Meta(description="prefix of every exported catalog family")]
    started_at: UnixTime
    uptime_seconds: Seconds
    ready: Annotated[bool, Meta(description="what /-/ready answers: the ingest socket is listening")]
    ingest: Ingest
    connections: Connections
    frames_received: Count
    snapshots_received: Count
    snapshots_applied: Count
    samples_applied: Count
    ranks_by_state: RanksByState
    rejections: Annotated[CountsByName, Meta(
        description="every rejection reason (wire protocol error code), including those still at 0")]
    rejections_total: Count
    rollup_layout_conflicts: Annotated[CountsByName, Meta(
        description="by family: rank histogram series left out of their rollup (bucket layout differs)")]
    limits: Limits
    persistence: Annotated[Persistence | None, Meta(description="null: no state file (--persistence.file)")] = None


# --- ranks, groups and the layout their worlds expect ------------------------------------------


class WorldSizes(Model):
    """Parallel sizes: how many values of tp_rank, pp_rank and dp_rank the ranks of one label set take."""

    tp_size: Annotated[int, Meta(ge=1)]
    pp_size: Annotated[int, Meta(ge=1)]
    dp_size: Annotated[int, Meta(ge=1)]


class Rank(Model):
    """One rank identity (rank axes, its group's label set and its own labels), in exposition order."""

    id: Annotated[str, Meta(pattern="^g[0-9]+/tp=[0-9]+,pp=[0-9]+(,cp=[0-9]+)?( .+)?$", description=(
        'unique within the document: <group id>/tp=..,pp=..[,cp=..] then its own labels as name="value" '
        "(backslash, quote and newline escaped), if any"))]
    group: GroupId
    tp_rank: Count
    pp_rank: Count
    dp_rank: Count
    attn_cp_rank: Annotated[Count | None, Meta(description="null: the rank has no context-parallel axis")]
    own_labels: Annotated[Labels, Meta(description=(
        "static labels of its identity that its group's label set leaves out (moe_ep_rank); usually empty"))]
    state: RankStateName
    source: Annotated[str, Meta(pattern="^(push|upstream:.+)$")]
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
    world: Annotated[WorldSizes | None, Meta(description="null: the rank said hello without a world")]


class LabelSet(Model):
    """A static label set some replica group carries, written once for the whole document."""

    id: Annotated[str, Meta(pattern="^s[0-9]+$", description=(
        "s<N>, numbered in ascending order of the labels; unique within the document"))]
    labels: Labels


class Position(Model):
    """A (pp_rank, tp_rank) position of a group's grid that no known rank holds at any cp rank."""

    pp_rank: Count
    tp_rank: Count


class GridRow(Model):
    """A row of a group's grid: a pp stage, and a cp rank where the group has that axis."""

    pp_rank: Count
    attn_cp_rank: Count | None


class Grid(Model):
    """What a group's grid draws (the page, its script and top): pp (x cp) rows by tp columns, at most 1,024 cells
    per group and 4,096 over the document; the counts are exact."""

    rows: Annotated[list[GridRow], Meta(description="ascending by pp, the row without a cp axis first, then by cp")]
    tp_ranks: Annotated[list[Count], Meta(description="the columns, ascending")]
    row_count: Annotated[Count, Meta(description="the rows the grid has, drawn or not")]
    column_count: Annotated[Count, Meta(description="the tp columns the grid has, drawn or not")]
    hidden_ranks: Annotated[Count, Meta(description="members in no drawn cell")]


class Group(Model):
    """A replica group: the ranks sharing dp_rank and static labels (they count the same logical tokens)."""

    id: Annotated[str, Meta(pattern="^g[0-9]+$", description=(
        "g<N>, numbered in order (static labels, then dp_rank); unique within the document"))]
    label_set: LabelSetId
    dp_rank: Count
    size: Count
    live: Count
    pp_ranks: list[Count]
    tp_ranks: list[Count]
    attn_cp_ranks: list[Count]
    expected: Annotated[WorldSizes | None, Meta(description=(
        "the world every rank with these static labels reported; null: none reported one, or they disagree "
        "(world_conflict)"))]
    world_conflict: Annotated[bool, Meta(description=(
        "ranks with these static labels reported different worlds, or one with more positions than the sidecar "
        "keeps rank identities (world_implausible)"))]
    world_implausible: Annotated[bool, Meta(description=(
        "the one world these ranks reported has more positions (tp_size x pp_size x dp_size) than "
        "ranks.max_ranks: a conflict, nothing expected"))]
    missing: Annotated[list[Position], Meta(description=(
        "ascending (pp, tp); at most ranks.max_ranks listed over all groups"))]
    missing_count: Annotated[Count, Meta(description=(
        "exact: every position of `expected` (pp_size x tp_size) no member holds"))]
    grid: Grid


class MissingGroup(Model):
    """A dp group of an agreed world that no known rank is in."""

    label_set: LabelSetId
    dp_rank: Count
    expected: WorldSizes


class MissingTotals(Model):
    """Exact counts of what is missing, whatever the listings hold."""

    positions: Annotated[Count, Meta(description=(
        "(pp, tp) positions missing: the groups' missing_count plus tp_size x pp_size per missing group"))]
    groups: Annotated[Count, Meta(description="dp groups missing")]


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
    """Totals per tier: one data movement between two cache tiers, its logical tokens and physical bytes."""

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


# --- the two bodies ----------------------------------------------------------------------------


class StatusDocument(Model):
    """GET /api/v1/status: everything the status page and `hicache-exporter top` show, as of one instant."""

    api_version: Annotated[int, Meta(extra_json_schema={"const": API_VERSION})]
    generated_at: UnixTime
    sidecar: Sidecar
    label_sets: Annotated[list[LabelSet], Meta(description="every static label set of a replica group, once, ascending")]
    ranks: list[Rank]
    groups: list[Group]
    missing_groups: Annotated[list[MissingGroup], Meta(description=(
        "dp groups an agreed world expects that no known rank is in; at most ranks.max_ranks listed"))]
    missing_totals: MissingTotals
    rollups: list[Rollup]
    transfers: list[Transfer]
    bandwidth: Bandwidth
    reasons: list[ReasonFamily]
    spread: Spread
    upstreams: list[Upstream]


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


def world_conflicts(doc: StatusDocument, name: Callable[[WorldSizes], str]
                    ) -> list[tuple[str, bool, dict[str, int]]]:
    """Each static label set whose groups report a world conflict: its label set id, whether its one
    world is implausible (`world_implausible`), and how many of its ranks reported each world, the
    worlds by `name` in first-seen order. One pass over the ranks; the page and `top` word it."""
    conflicting: dict[str, bool] = {}  # label set -> whether its one world is implausible
    for group in doc.groups:
        if group.world_conflict:
            conflicting[group.label_set] = group.world_implausible
    counts: dict[str, dict[str, int]] = {key: {} for key in conflicting}
    label_set_of = {group.id: group.label_set for group in doc.groups}
    for rank in doc.ranks:
        key = label_set_of[rank.group]
        if rank.world is not None and key in counts:
            world = name(rank.world)
            counts[key][world] = counts[key].get(world, 0) + 1
    return [(key, implausible, counts[key]) for key, implausible in conflicting.items()]


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
