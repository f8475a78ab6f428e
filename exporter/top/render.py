"""The status document as rich renderables: a pure function of the View and the time, no I/O.

Everything from the document is put on screen as `Text`, never as markup, so a label value such
as `[bold]x[/bold]` shows as written. No value of the document reaches a `Text` but through one of
the accessors at the end: `literal` for what is shown as written (control characters escaped, so a
label cannot move the cursor, retitle the window or recolour the terminal), and `count`,
`integer`, `duration`, `size` for numbers, which refuse anything that is not a finite number in
range. The document's types are the model's (exporter.api.v1): fetch.received refuses a body of
the wrong shape (`"\x1b]0;..."` where a count belongs, 1e999) in one line before anything is drawn;
what the model's types still let through (a 400-digit integer) makes its section one red line,
and the others are still shown.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence

from rich.columns import Columns
from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.measure import Measurement
from rich.styled import Styled
from rich.table import Table
from rich.text import Text

from exporter.api import v1
from exporter.top.view import View

STATES = ("live", "stale", "departed", "expired")
STATE_STYLE = {"live": "black on green", "stale": "black on yellow", "departed": "white on blue",
               "expired": "white on red"}
ABSENT_STYLE = "dim"  # a grid position no rank of the group has reported from
# A position the ranks' world expects and no known rank holds: its own colour, and a mark after the
# tp number so that it reads without colour too.
MISSING_STYLE = "bold white on magenta"
MISSING_MARK = "?"
MISSING_SHOWN = 8  # positions named per line under the grid; the rest are counted
# The sidecar's caps on what a grid draws (status.GRID_CELLS_PER_GROUP, status.GRID_CELLS): top draws no more
# than they allow whatever a document lists, and bounds a sidecar's from before the grid was bounded alike.
GRID_CELLS_PER_GROUP = 1024
GRID_CELLS = 4096
SECTION = "bold underline"
BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 30
NOT_LIVE_SHOWN = 6  # ranks listed under the grid, one a line; the rest are counted
SPREAD_SHOWN = 6  # replica groups listed; the rest are counted
OCCUPANCY = ("hicache_host_used_tokens", "hicache_host_total_tokens")


def render_frame(view: View, now: float | None = None) -> RenderableType:
    """The whole frame: the header, then every section of the document (or why there is none)."""
    return Group(render_header(view, time.time() if now is None else now), *body_or_problem(view))


def render_header(view: View, now: float) -> RenderableType:
    """The title line and, when the last poll failed, the line saying why."""
    doc = view.document
    title = Text.assemble(("hicache-exporter top", "bold"), "  ", literal(view.target.url))
    if doc is not None:
        sidecar = doc.sidecar
        title.append("  sidecar ")
        title.append_text(literal(f"{sidecar.version} ({sidecar.revision[:12]})"[:80]))
        if shows_as_number(sidecar.uptime_seconds):  # else left out: the header is never the line that breaks
            title.append(f"  up {duration(sidecar.uptime_seconds)}")
        title.append("  ")
        title.append(*(("ready", "green") if sidecar.ready else ("NOT READY", "bold red")))
    if view.document_at is not None:
        title.append(f"  read {duration(max(0.0, now - view.document_at))} ago")
    title.append("   q quits", "dim")
    lines: list[RenderableType] = [title]
    if view.failure is not None:
        problem = literal(view.failure.line)  # a redirect's Location, say, is the server's text
        problem.stylize("bold red")
        problem.append(f"  (retrying every {view.interval:g} s", style="red")
        if view.document_at is not None:
            problem.append(f"; below: the status read at {time.strftime('%H:%M:%S', time.localtime(view.document_at))}",
                           style="red")
        problem.append(")", style="red")
        lines.append(problem)
    elif doc is None:
        lines.append(literal(f"connecting to {view.target.status_url} ...", style="yellow"))
    return Group(*lines)


# What a decoded document can still raise while a section reads it: a value out of range (Unshowable,
# ArithmeticError), an id naming no group or label set (LookupError); the rest is a bug, still one line.
UNSHOWABLE = (LookupError, TypeError, ValueError, AttributeError, ArithmeticError, RecursionError)


def render_body(view: View) -> list[RenderableType]:
    """The sections of the last document read, dimmed while the sidecar cannot be read; none before the first.

    Each section stands alone: one that cannot read its part of the document is one red line.
    """
    doc = view.document
    if doc is None:
        return []
    body: list[RenderableType] = []
    for name, section in SECTIONS:
        body.append(Text(""))
        body.extend(section_or_problem(name, section, doc))
    return body if view.failure is None else [Styled(Group(*body), "dim")]


def section_or_problem(name: str, section: Callable[[v1.StatusDocument], list[RenderableType]],
                       doc: v1.StatusDocument) -> list[RenderableType]:
    """`section(doc)`, or one red line naming the section and what it could not read (never a traceback)."""
    try:
        return section(doc)
    except UNSHOWABLE as err:
        return [problem(f"cannot show the {name} section", err)]


def problem(what: str, err: BaseException) -> Text:
    """`what (why)` in bold red, on one line, the why escaped (it may quote the document)."""
    why = f"no field {err}" if isinstance(err, KeyError) else f"{type(err).__name__}: {err}"
    return literal(f"{what} ({why})"[:300], style="bold red")


def body_or_problem(view: View) -> list[RenderableType]:
    """render_body, or one line saying why not (never a traceback on screen)."""
    try:
        return render_body(view)
    except UNSHOWABLE as err:
        return [problem(f"cannot show the status document of {view.target.status_url}", err)]


# --- ranks ---------------------------------------------------------------------------------


def ranks_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Counts by state (also the legend), a grid per replica group, and the ranks that are not live or missing."""
    sidecar = doc.sidecar
    by_state = sidecar.ranks_by_state
    missing_groups = doc.missing_groups
    totals = doc.missing_totals
    head = Text("Ranks", style=SECTION)
    for state in STATES:
        head.append("  ")
        head.append(f" {count(getattr(by_state, state))} {state} ", style=STATE_STYLE[state])
    if missing_groups or any(group.expected for group in doc.groups):  # some layout is known
        head.append("  ")
        head.append(f" {count(totals.positions)} missing ", style=MISSING_STYLE)
    limits = sidecar.limits
    head.append(f"   {count(limits.ranks_known)} known, at most {count(limits.ranks_allowed)}", style="dim")
    names = Names(doc)
    members: dict[str, list[v1.Rank]] = {}
    for rank in doc.ranks:
        members.setdefault(rank.group, []).append(rank)
    blocks: list[RenderableType] = []
    room = GRID_CELLS
    for group in doc.groups:
        block = group_block(group, members.get(group.id, []), names, min(GRID_CELLS_PER_GROUP, room))
        blocks.append(block)
        room -= block.cells
    blocks += [missing_group_block(absent, names) for absent in missing_groups]
    out: list[RenderableType] = [head, *(literal(line, style="bold yellow") for line in world_conflicts(doc))]
    if blocks:
        out.append(Columns(blocks, padding=(0, 3)))
    else:
        out.append(Text("no ranks have connected yet", style="yellow"))
    not_live = [rank for rank in doc.ranks if rank.state != "live"]
    for rank in not_live[:NOT_LIVE_SHOWN]:
        line = chip(rank.state, STATE_STYLE.get(rank.state, "reverse"))
        line.append_text(literal(names.rank(rank)))
        since = rank.seconds_since_push
        line.append(f"  {duration(since)} since a push" if since is not None else "  never pushed", style="dim")
        out.append(line)
    if len(not_live) > NOT_LIVE_SHOWN:
        out.append(Text(f"   and {len(not_live) - NOT_LIVE_SHOWN} more ranks not live", style="bold"))
    out.extend(missing_lines(doc.groups, missing_groups, integer(totals.groups), names))
    return out


def chip(word: str, style: str) -> Text:
    """`   word  `, the word on its state's colour, to start a line naming ranks."""
    line = Text("   ")
    line.append_text(literal(word))
    line.append(" ")
    line.stylize(style, 2)  # a chip: " stale " in the grid's colour
    line.append(" ")
    return line


def missing_lines(groups: Sequence[v1.Group], missing_groups: Sequence[v1.MissingGroup],
                  groups_missing: int, names: Names) -> list[Text]:
    """One line per group with missing positions, then per missing dp group; at most NOT_LIVE_SHOWN lines."""
    lines = []
    for group in groups:
        missing = integer(group.missing_count)
        if not missing:
            continue
        line = chip("missing", MISSING_STYLE)
        line.append_text(names.group(group))
        shown = group.missing[:MISSING_SHOWN]
        line.append(": " + ", ".join(f"pp{integer(m.pp_rank)} tp{integer(m.tp_rank)}" for m in shown))
        if missing > len(shown):
            line.append(f" and {count(missing - len(shown))} more", style="bold")
        lines.append(line)
    for absent in missing_groups:
        line = chip("missing", MISSING_STYLE)
        line.append_text(names.group(absent))
        expected = absent.expected
        line.append(f": the whole dp group (tp {integer(expected.tp_size)} × pp {integer(expected.pp_size)}), "
                    "no rank has reported")
        lines.append(line)
    unlisted = groups_missing - len(missing_groups)  # the sidecar lists a bounded number
    out = lines[:NOT_LIVE_SHOWN]
    if len(lines) > NOT_LIVE_SHOWN or unlisted > 0:
        out.append(Text(f"   and {len(lines) - len(out) + max(unlisted, 0)} more groups with missing ranks",
                        style="bold"))
    return out


def world_conflicts(doc: v1.StatusDocument) -> list[str]:
    """One warning per static label set whose ranks reported different worlds, or a world larger than the
    sidecar can hold (`world_implausible`): which worlds, by how many ranks."""
    names = Names(doc)
    allowed = doc.sidecar.limits.ranks_allowed
    lines = []
    for key, implausible, counts in v1.world_conflicts(doc, world_name):
        worlds = ", ".join(f"{name} ({n} rank{'' if n == 1 else 's'})" for name, n in counts.items())
        labels = literal(" ".join(f"{k}={v}" for k, v in names.labels[key].items()) or "no static labels").plain
        said = (f"report {worlds}, more positions than the {count(allowed)} rank identities this sidecar keeps "
                "(ranks.max_ranks)" if implausible else f"report different parallel sizes: {worlds}")
        lines.append(f"world conflict: the ranks with {labels} {said}; no missing rank can be worked out for them")
    return lines


def world_name(world: v1.WorldSizes) -> str:
    """`tp 2 × pp 1 × dp 2`: a reported world as the conflict warning names it."""
    return f"tp {integer(world.tp_size)} × pp {integer(world.pp_size)} × dp {integer(world.dp_size)}"


Row = tuple[int, int | None]  # (pp_rank, attn_cp_rank)


def grid_of(group: v1.Group, room: int) -> tuple[list[Row], list[int], int, int]:
    """The rows and tp columns of a group's grid that fit `room` cells, and how many rows and columns it has.

    Read from the group's `grid` (the sidecar's status.grid_model), cut to the room as the sidecar cuts it:
    a document listing more than the caps allow is still drawn within them.
    """
    grid = group.grid
    columns = [integer(tp) for tp in grid.tp_ranks[:max(room, 0)]]
    fit = room // len(columns) if columns else 0
    rows = [(integer(row.pp_rank), optional_integer(row.attn_cp_rank)) for row in grid.rows[:fit]]
    return rows, columns, integer(grid.row_count), integer(grid.column_count)


def group_block(group: v1.Group, members: Sequence[v1.Rank], names: Names,
                room: int = GRID_CELLS_PER_GROUP) -> GridBlock:
    """One replica group: pp stage (and cp rank) rows by tp rank columns, each cell its rank's state colour,
    at most `room` cells (`grid_of`), and a line saying what is left out.

    A position the world expects and no rank holds (at any cp rank) is a missing cell, `1?`, on each
    of its pp stage's rows.
    """
    title = names.group(group)
    title.stylize("bold")
    live, size = integer(group.live), integer(group.size)
    title.append(f"  {live}/{size} live", style="green" if live == size else "yellow")
    missing = {(integer(m.pp_rank), integer(m.tp_rank)) for m in group.missing}
    if group.missing_count:
        title.append("  ")
        title.append(f"{integer(group.missing_count)} missing", style=MISSING_STYLE)
    at = {(integer(rank.pp_rank), optional_integer(rank.attn_cp_rank), integer(rank.tp_rank)): rank
          for rank in members}
    rows, tps, row_count, column_count = grid_of(group, room)
    # One more column for the mark, in every cell of a group that has one, to keep the columns aligned.
    width = max((len(str(tp)) for tp in tps), default=1) + (len(MISSING_MARK) if missing else 0)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for pp, cp in rows:
        cells = []
        for tp in tps:
            if (pp, tp) in missing:
                cells.append(Text(f"{f'{tp}{MISSING_MARK}':>{width}}", style=MISSING_STYLE))
                continue
            rank = at.get((pp, cp, tp))
            style = STATE_STYLE.get(rank.state, "reverse") if rank is not None else ABSENT_STYLE
            cells.append(Text(f"{tp:>{width}}", style=style))
        label = f"pp{pp}" if cp is None else f"pp{pp} cp{cp}"
        grid.add_row(Text(label, style="dim"), CellRow(cells, width))
    parts: list[RenderableType] = [title, grid]
    if len(rows) < row_count or len(tps) < column_count:
        drawn_rows, drawn_columns = set(rows), set(tps)
        hidden = sum(1 for pp, cp, tp in ((integer(r.pp_rank), optional_integer(r.attn_cp_rank),
                                           integer(r.tp_rank)) for r in members)
                     if (pp, cp) not in drawn_rows or tp not in drawn_columns)
        parts.append(Text(f"drawn {len(rows)} of {count(row_count)} rows, {len(tps)} of {count(column_count)} tp "
                          f"columns; {hidden} rank{'' if hidden == 1 else 's'} not drawn", style="yellow"))
    return GridBlock(len(rows) * len(tps), *parts)


class GridBlock(Group):
    """A group's block, knowing how many cells its grid draws (they count against the frame's GRID_CELLS)."""

    def __init__(self, cells: int, *renderables: RenderableType) -> None:
        super().__init__(*renderables)
        self.cells = cells


def missing_group_block(absent: v1.MissingGroup, names: Names) -> RenderableType:
    """A dp group the world expects and no rank is in: its name, `missing`, and the layout it should have."""
    title = names.group(absent)
    title.stylize("bold")
    title.append("  ")
    title.append("missing", style=MISSING_STYLE)
    expected = absent.expected
    return Group(title, Text(f"no rank has reported (tp {integer(expected.tp_size)} × "
                             f"pp {integer(expected.pp_size)} expected)", style="magenta"))


class CellRow:
    """Equal-width cells a space apart, as many a line as fit, so a wide tp row wraps into aligned columns."""

    # Text's own wrapping breaks at spaces, splitting a right-aligned cell's padding from its number.

    def __init__(self, cells: Sequence[Text], width: int) -> None:
        self.cells, self.width = list(cells), width

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement(self.width, max(self.width, len(self.cells) * (self.width + 1) - 1))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        per_line = max(1, (options.max_width + 1) // (self.width + 1))
        for start in range(0, len(self.cells), per_line):
            yield Text(" ", no_wrap=True, overflow="crop").join(self.cells[start:start + per_line])


# --- transfers and bandwidth ----------------------------------------------------------------


def transfers_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Per transfer between tiers: rolled-up tokens and bytes, active bandwidth now and its history."""
    bandwidth = doc.bandwidth
    by_transfer = {family.transfer: family for family in bandwidth.families if family.transfer is not None}
    head = Text("Transfers", style=SECTION)
    head.append(f"   totals since the sidecar started; active bandwidth over {duration(bandwidth.window_seconds)}, "
                f"history every {duration(bandwidth.history_interval_seconds)}", style="dim")
    table = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
    for name, justify in (("transfer", "left"), ("tiers", "left"), ("tokens", "right"), ("bytes", "right"),
                          ("active bandwidth", "right"), ("history", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for transfer in doc.transfers:
        family = by_transfer.get(transfer.name)
        rate = transfer.bytes_per_second
        table.add_row(literal(transfer.name), literal(f"{transfer.source}→{transfer.target}"),
                      Text(count(transfer.tokens) if transfer.tokens is not None else "–"),
                      Text(size(transfer.bytes) if transfer.bytes is not None else "–"),
                      Text(speed(rate), style="bold cyan" if rate is not None else "dim"),
                      sparkline([point[1] for point in family.history] if family is not None else []))
    for family in bandwidth.families:
        if family.transfer is None:  # a bytes counter outside the known tiers (an operator's own family)
            rate = family.bytes_per_second
            table.add_row(literal(family.family), Text("–"), Text("–"), Text("–"),
                          Text(speed(rate), style="bold cyan" if rate is not None else "dim"),
                          sparkline([point[1] for point in family.history]))
    out: list[RenderableType] = [head, table]
    occupancy = host_occupancy(doc.rollups)
    if occupancy is not None:
        out.append(occupancy)
    return out


def host_occupancy(rollups: Sequence[v1.Rollup]) -> Text | None:
    """L2 host pool use, from the rolled-up host gauges (one live replica per group, summed)."""
    totals = {rollup.family: rollup.total for rollup in rollups if rollup.family in OCCUPANCY}
    if set(totals) != set(OCCUPANCY) or not totals[OCCUPANCY[1]]:
        return None
    used, capacity = number(totals[OCCUPANCY[0]]), number(totals[OCCUPANCY[1]])
    return Text(f"L2 host pool: {count(used)} of {count(capacity)} tokens in use ({100 * used / capacity:.0f}%)")


def sparkline(values: Sequence[float | None], width: int = SPARK_WIDTH) -> Text:
    """The last `width` values as block characters scaled to their maximum; a gap where nothing moved."""
    shown = [None if value is None else number(value) for value in list(values)[-width:]]
    peak = max((v for v in shown if v is not None), default=0.0)
    line = Text(style="cyan")
    for value in shown:
        if value is None or peak <= 0:
            line.append(" ")
        else:
            index = min(len(BLOCKS) - 1, max(0, math.ceil(value / peak * len(BLOCKS)) - 1))
            line.append(BLOCKS[index])
    return line


# --- reasons, spread, upstreams, the sidecar ------------------------------------------------


def reasons_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Every family with a `reason` label, its reasons by value (those at 0 counted, not listed)."""
    out: list[RenderableType] = [Text("Reasons", style=SECTION).append(
        "   tokens, rolled up; attempt-level counts are not final cache misses", style="dim")]
    for family in doc.reasons:
        line = literal(family.family)
        line.stylize("bold")
        if family.attempt_level:
            line.append(" (attempt-level)", style="dim")
        line.append(f"  {count(family.total)}")
        by_reason = family.by_reason  # a capped listing may list fewer than the family has
        nonzero = sorted((r for r in by_reason if number(r.value)), key=lambda r: -number(r.value))
        zeros = len(by_reason) - len(nonzero)
        if not by_reason:
            line.append("  (no reason reported yet)", style="dim")
        elif not nonzero:
            line.append(f"  ({zeros} reasons, all at 0)", style="dim")
        else:
            line.append(":")
        for reason in nonzero:
            line.append("  ")
            line.append_text(literal(reason.reason))
            line.append(f" {count(reason.value)}", style="bold")
        if nonzero and zeros:
            line.append(f"  ({zeros} more at 0)", style="dim")
        out.append(line)
    if len(out) == 1:
        out.append(Text("no reason families reported yet", style="dim"))
    return out


def spread_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Replica groups by how far their live replicas disagree, the diverging ones first and in red."""
    spread = doc.spread
    names = Names(doc)
    out: list[RenderableType] = [Text("Replica spread", style=SECTION).append(
        f"   (max - min) / max of the replicas' increases; diverging above {number(spread.threshold):g}",
        style="dim")]
    ordered = sorted(spread.groups, key=lambda g: (not g.diverging, -number(g.max_ratio)))
    for entry in ordered[:SPREAD_SHOWN]:
        group = names.groups.get(entry.group)
        line = names.group(group) if group is not None else literal(entry.group)
        if entry.diverging:
            line.append(f"  DIVERGING {number(entry.max_ratio):.2f}", style="bold white on red")
            worst = sorted(entry.series, key=lambda s: -number(s.ratio))[:3]
            for series in worst:
                line.append("  ")
                line.append_text(literal(series.family))
                if series.labels:
                    line.append("{")
                    line.append_text(labels_text(series.labels))
                    line.append("}")
                line.append(f" {number(series.ratio):.2f}", style="bold red")
        else:
            line.append(f"  agree ({number(entry.max_ratio):.2f})", style="green")
        out.append(line)
    if len(ordered) > SPREAD_SHOWN:
        rest = ordered[SPREAD_SHOWN:]
        diverging = sum(1 for g in rest if g.diverging)
        out.append(Text(f"and {len(rest)} more groups ({diverging} diverging)", style="bold red" if diverging else "dim"))
    if not ordered:
        out.append(Text("no replica group has two live replicas with increases in the window yet", style="dim"))
    return out


class Names:
    """What the document writes once and references by id (label sets, groups), read back as text."""

    def __init__(self, doc: v1.StatusDocument) -> None:
        self.labels: dict[str, Mapping[str, str]] = {s.id: s.labels for s in doc.label_sets}
        self.groups: dict[str, v1.Group] = {g.id: g for g in doc.groups}

    def group(self, group: v1.Group | v1.MissingGroup) -> Text:
        """`dp0 cache_type=...`: a replica group (or a missing one) as its dp rank and static labels."""
        name = Text(f"dp{integer(group.dp_rank)}")
        labels = self.labels[group.label_set]
        if labels:
            name.append(" ")
            name.append_text(labels_text(labels))
        return name

    def rank(self, rank: v1.Rank) -> str:
        """`tp=1 pp=0 dp=0 [cp=0] name="value" ...`: a rank's axes and every static label in name order,
        quoted as /metrics writes them (the sidecar's `status.identity_text`); shown through `literal`."""
        labels = {**self.labels[self.groups[rank.group].label_set], **rank.own_labels}
        cp = rank.attn_cp_rank
        axes = [f"tp={integer(rank.tp_rank)}", f"pp={integer(rank.pp_rank)}", f"dp={integer(rank.dp_rank)}",
                *(() if cp is None else (f"cp={integer(cp)}",))]
        return " ".join((*axes, *(f'{k}="{quote(str(v))}"' for k, v in sorted(labels.items()))))


def quote(value: str) -> str:
    """A label value as /metrics writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def upstreams_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """The engines the sidecar proxies (none when every rank pushes)."""
    if not doc.upstreams:
        return [Text("Upstreams", style=SECTION).append("   none: every rank pushes", style="dim")]
    table = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
    for name in ("upstream", "source", "state", "ranks", "samples", "last read", "errors", "last error"):
        table.add_column(name, overflow="fold")
    for upstream in doc.upstreams:
        errors = sum(number(n) for n in upstream.errors.values())
        took = upstream.last_scrape_duration_seconds
        table.add_row(literal(upstream.name), literal(upstream.source),
                      Text("up", style="green") if upstream.up else Text("DOWN", style="bold red"),
                      Text(count(upstream.ranks)), Text(count(upstream.samples)),
                      Text(f"{number(took) * 1000:.0f} ms" if took is not None else "never"),
                      Text(count(errors), style="red" if errors else ""),
                      literal(upstream.last_error or ""))
    return [Text("Upstreams", style=SECTION), table]


def sidecar_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """The sidecar's own health: ingest, connections, throughput, limits, and rejections by reason."""
    sidecar = doc.sidecar
    ingest, conns, limits = sidecar.ingest, sidecar.connections, sidecar.limits
    health = Text("Sidecar", style=SECTION)
    health.append("  ingest ")
    health.append(*(("listening", "green") if ingest.listening else ("NOT LISTENING", "bold red")))
    health.append(" on ")
    health.append_text(literal(ingest.socket_path))
    health.append(f" · connections {count(conns.open)} open of {count(conns.allowed)} "
                  f"({count(conns.accepted)} accepted)")
    traffic = Text(f"received: frames {count(sidecar.frames_received)} · snapshots "
                   f"{count(sidecar.snapshots_applied)} applied of {count(sidecar.snapshots_received)}"
                   f" · samples {count(sidecar.samples_applied)}")
    full = number(limits.series_allowed) and number(limits.series_used) >= number(limits.series_allowed)
    limit_line = Text(f"limits: series {count(limits.series_used)} of {count(limits.series_allowed)}",
                      style="bold red" if full else "")
    limit_line.append(f" · stale after {duration(limits.stale_after_seconds)}, expired after "
                      f"{duration(limits.expire_after_seconds)} · window {duration(limits.window_seconds)}"
                      " · namespace ")
    limit_line.append_text(literal(repr(sidecar.namespace)))
    rejected = Text(f"rejections {count(sidecar.rejections_total)}",
                    style="bold red" if sidecar.rejections_total else "green")
    nonzero = sorted(((reason, n) for reason, n in sidecar.rejections.items() if number(n)), key=lambda item: -item[1])
    for reason, n in nonzero:
        rejected.append("  ")
        rejected.append_text(literal(reason))
        rejected.append(f" {count(n)}", style="bold red")
    out: list[RenderableType] = [health, traffic, limit_line, rejected]
    conflicts = {family: n for family, n in sidecar.rollup_layout_conflicts.items() if n}
    if conflicts:
        line = Text("histogram layouts left out of their rollup:", style="yellow")
        for family, n in sorted(conflicts.items()):
            line.append("  ")
            line.append_text(literal(family))
            line.append(f" {count(n)}")
        out.append(line)
    return out


SECTIONS: tuple[tuple[str, Callable[[v1.StatusDocument], list[RenderableType]]], ...] = (
    ("Ranks", ranks_section), ("Transfers", transfers_section), ("Reasons", reasons_section),
    ("Replica spread", spread_section), ("Upstreams", upstreams_section), ("Sidecar", sidecar_section),
)


# --- text and numbers -----------------------------------------------------------------------


def literal(value: object, style: str = "") -> Text:
    """`value` as plain text: no markup, control characters shown as escapes (\\x1b), never sent to the terminal."""
    text = str(value)
    if not text.isprintable():
        text = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text)
    return Text(text, style=style)


def labels_text(labels: Mapping[str, str]) -> Text:
    """`name=value, ...` with every name and value literal."""
    out = Text()
    for i, (name, value) in enumerate(labels.items()):
        if i:
            out.append(", ")
        out.append_text(literal(name))
        out.append("=")
        out.append_text(literal(value))
    return out


LARGEST = 1e24  # past any real count, byte total or duration; its digits still fit on a line


class Unshowable(ValueError):
    """A document value that cannot be shown where the schema puts a number: wrong type, not finite, out of range."""


def number(value: object) -> float:
    """`value` if it is a finite number within ±LARGEST (not a bool); else Unshowable, quoting it escaped."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Unshowable(f"{glimpse(value)} where a number belongs")
    if not -LARGEST <= value <= LARGEST:  # an int compares exactly, NaN compares False: both land here
        raise Unshowable(f"{glimpse(value)} is out of range")
    return value


def integer(value: object) -> int:
    """`value` if it is an integer within ±LARGEST (a rank, a size); else Unshowable."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise Unshowable(f"{glimpse(value)} where an integer belongs")
    number(value)
    return value


def optional_integer(value: object) -> int | None:
    return None if value is None else integer(value)


def shows_as_number(value: object) -> bool:
    """Whether `number(value)` would take it."""
    try:
        number(value)
    except Unshowable:
        return False
    return True


def glimpse(value: object) -> str:
    """A short, escaped quotation of a value for a one-line complaint."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > LARGEST:
        return f"an integer of {len(str(abs(value)))} digits"
    text = literal(repr(value)).plain
    return text if len(text) <= 40 else text[:37] + "..."


def count(value: object) -> str:
    """12,080; a fraction keeps two places."""
    shown = number(value)
    return f"{shown:,}" if isinstance(shown, int) else f"{int(shown):,}" if shown.is_integer() else f"{shown:,.2f}"


def size(value: object) -> str:
    """Bytes in binary units: 118.0 MiB."""
    shown = number(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(shown) < 1024 or unit == "TiB":
            return f"{shown:.0f} B" if unit == "B" else f"{shown:.1f} {unit}"
        shown /= 1024
    raise AssertionError("unreachable")


def speed(bytes_per_second: object) -> str:
    """An active bandwidth, or `idle` when the window saw no transfer."""
    return "idle" if bytes_per_second is None else size(bytes_per_second) + "/s"


def duration(value: object) -> str:
    """45s, 3m12s, 2h05m, 1d02h."""
    seconds = number(value)
    whole = int(seconds)
    if seconds < 10 and not float(seconds).is_integer():
        return f"{seconds:.1f}s"
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    if whole < 86400:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 86400}d{whole % 86400 // 3600:02d}h"
