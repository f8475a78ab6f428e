"""The status document as rich renderables: a pure function of the View and the time, no I/O.

Everything from the document is put on screen as `Text`, never as markup, so a label value such
as `[bold]x[/bold]` shows as written. No value of the document reaches a `Text` but through one of
the accessors of exporter.top.text: `literal` for what is shown as written (control characters escaped, so a
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

from exporter.api import v1, view
from exporter.api.view import GRID_CELLS, GRID_CELLS_PER_GROUP, KIND_ORDER, MISSING, STREAM_STATES
from exporter.top.text import count, duration, integer, labels_text, literal, number, shows_as_number, size, speed
from exporter.top.view import View

STATE_STYLE = {"live": "black on green", "stale": "black on yellow", "departed": "white on blue",
               "expired": "white on red"}
ABSENT_STYLE = "dim"  # a grid position no stream reports for and no world expects
# A rank the server's world expects and no unexpired stream reports for: its own colour, and a mark
# after the tp number so that it reads without colour too.
MISSING_STYLE = "bold white on magenta"
MISSING_MARK = "?"
MISSING_SHOWN = 8  # missing ranks named per line under the grids; the rest are counted
# top draws no more than the view model's caps on a grid (view.GRID_CELLS_PER_GROUP, view.GRID_CELLS) allow,
# whatever a document lists.
SECTION = "bold underline"
BLOCKS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 30
NOT_LIVE_SHOWN = 6  # streams (and dp groups with missing ranks) listed under the grids, one a line; the rest counted
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
        totals = doc.totals
        if shows_as_number(totals.ranks) and shows_as_number(totals.streams):
            title.append(f"  {count(totals.ranks)} rank{plural(totals.ranks)}, {count(totals.streams)} "
                         f"stream{plural(totals.streams)}")
            if totals.missing and shows_as_number(totals.missing):
                title.append("  ")
                title.append(f"{count(totals.missing)} missing", style=MISSING_STYLE)
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
        shown = section_or_problem(name, section, doc)
        if shown:  # a section with nothing to say takes no line (prefill, from a sidecar without the field)
            body.append(Text(""))
            body.extend(shown)
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
    """Ranks and streams counted apart (also the legend), a block per server with a grid per dp group, then
    the streams that are not live and the ranks that are missing."""
    names = Names(doc)
    totals = doc.totals
    head = Text("Ranks", style=SECTION)
    head.append(f"   {count(totals.ranks)} rank{plural(totals.ranks)}, {count(totals.streams)} "
                f"stream{plural(totals.streams)}", style="bold")
    if len(doc.servers) > 1:
        head.append(f" of {count(totals.servers)} servers", style="bold")
    live = integer(totals.live_ranks)
    ranks = Text(" ranks   ")
    ranks.append(f" {live} live ", style=STATE_STYLE["live"])
    ranks.append("  ")
    not_live = max(integer(totals.ranks) - live, 0)
    ranks.append(f" {count(not_live)} not live ", style="reverse" if not_live else "dim")
    if totals.missing or any(server.expected is not None for server in doc.servers):  # some layout is known
        ranks.append("  ")
        ranks.append(f" {count(totals.missing)} missing ", style=MISSING_STYLE)
    streams = Text(" streams ")
    by_state = doc.sidecar.streams_by_state
    for state in STREAM_STATES:
        streams.append(f" {count(getattr(by_state, state))} {state} ", style=STATE_STYLE[state])
        streams.append("  ")
    limits = doc.sidecar.limits
    streams.append(f" {count(limits.ranks_known)} known, at most {count(limits.ranks_allowed)}", style="dim")
    out: list[RenderableType] = [head, ranks, streams]
    cells_of: dict[tuple[str, int], list[v1.RankCell]] = {}
    for cell in doc.ranks:
        cells_of.setdefault((cell.server, cell.dp_rank), []).append(cell)
    if any(lettered(cells, names) for cells in cells_of.values()):
        out.append(Text(LEGEND, style="dim"))
    room = GRID_CELLS
    for server in doc.servers:
        out.append(Text(""))
        block, room = server_block(server, cells_of, names, room)
        out.extend(block)
    if not doc.servers:
        out.append(Text("no ranks have connected yet", style="yellow"))
    out.extend(stream_lines(doc, names))
    out.extend(missing_lines(doc, cells_of, names))
    return out


# A cell: its attention tp rank (`N?` when missing), then one letter per stream on the stream's state colour.
KIND_LETTERS = dict(zip(KIND_ORDER, "RSEC", strict=True))
LETTERS_SHOWN = 6  # per cell; a seventh stream and more are one `+`
LEGEND = (" a cell is a rank: its attention tp rank, then one letter per stream on the stream's state colour "
          "(R radix, S storage, E scheduler, C client); N? missing")


def plural(n: object) -> str:
    """`s` unless `n` is 1."""
    return "" if n == 1 else "s"


def kind_letter(kind: str) -> str:
    """A stream kind's letter; a kind this top does not know is its first letter, lower case."""
    return KIND_LETTERS.get(kind) or literal(kind[:1].lower() or "?").plain


def letters(cell: v1.RankCell, names: Names) -> list[tuple[str, str]]:
    """(letter, state) of each stream of a cell, radix, storage, scheduler then client; at most LETTERS_SHOWN."""
    shown: list[tuple[str, str]] = [(kind_letter(s.kind), s.state) for s in names.cell_streams(cell)]
    if len(shown) > LETTERS_SHOWN:
        shown = [*shown[:LETTERS_SHOWN - 1], ("+", "")]
    return shown


def lettered(cells: Sequence[v1.RankCell], names: Names) -> bool:
    """Whether a grid's cells list their streams: not when every rank is one pushed client (the rank itself)."""
    return any(len(cell.streams) > 1 or any(names.streams[sid].kind != "client" for sid in cell.streams)
               for cell in cells)


def world_text(world: v1.WorldSizes, engine_tp: bool = False) -> str:
    """`dp 2 × pp 2 × tp 2` (v1.world_name), every size checked as an integer first; with `engine_tp`, the
    engine's tp size after it where it is not the attention tp size (two worlds may differ only there)."""
    for axis in (world.tp_size, world.pp_size, world.dp_size, world.attn_tp_size, world.attn_cp_size):
        integer(axis)
    engine = f" (engine tp {world.tp_size})" if engine_tp and world.tp_size != world.attn_tp_size else ""
    return v1.world_name(world) + engine


def span(what: str, bounds: tuple[int, int]) -> str:
    """`tp ranks 0-3`, `pp stage 1`: the range [first, last + 1] of a node share."""
    first, end = integer(bounds[0]), integer(bounds[1])
    return f"{what} {first}" if end - first == 1 else f"{what}s {first}-{end - 1}"


def server_block(server: v1.Server, cells_of: Mapping[tuple[str, int], list[v1.RankCell]], names: Names,
                 room: int) -> tuple[list[RenderableType], int]:
    """A server's title (labels, expected world, counts), its warnings and node share, then its dp groups' grids
    side by side, within `room` cells; and the room left."""
    title = Text("server ", style="bold")
    labels = names.server(server)
    labels.stylize("bold" if labels.plain != NO_LABELS else "dim")
    title.append_text(labels)
    expected = server.expected
    if expected is not None:
        title.append(f"  expects {world_text(expected)}")
    elif not server.world_conflict:
        title.append("  no world reported: only the ranks seen are drawn", style="dim")
    ranks, live = integer(server.ranks), integer(server.live_ranks)
    title.append(f"  {count(ranks)} rank{plural(ranks)}, {count(server.streams)} stream{plural(server.streams)}")
    title.append(f"  {live}/{ranks} live", style="green" if live == ranks else "yellow")
    if server.missing:
        title.append("  ")
        title.append(f" {count(server.missing)} missing ", style=MISSING_STYLE)
    out: list[RenderableType] = [title]
    if server.world_conflict:
        out.append(literal(conflict_line(server, names.ranks_allowed), style="bold yellow"))
    node = server.node
    if node is not None:
        out.append(Text(f"node {integer(node.node_rank)} of {integer(node.nodes)}: this sidecar expects "
                        f"{span('global tp rank', node.tp_ranks)} of {span('pp stage', node.pp_ranks)}", style="cyan"))
    blocks = []
    show_cp = (expected is not None and expected.attn_cp_size > 1) or any(
        row.attn_cp_rank for group in server.dp_groups for row in group.grid.rows)
    for group in server.dp_groups:
        block = group_block(server, group, cells_of.get((server.id, integer(group.dp_rank)), []), names,
                            min(GRID_CELLS_PER_GROUP, room), show_cp)
        blocks.append(block)
        room -= block.cells
    if blocks:
        out.append(Columns(blocks, padding=(0, 3)))
    return out, room


def conflict_line(server: v1.Server, allowed: object) -> str:
    """Why a server expects nothing: its streams' worlds disagree, or the one world is larger than the sidecar keeps."""
    worlds = ", ".join(world_text(world, engine_tp=True) for world in server.worlds) or "no world"
    if server.world_implausible:
        said = (f"its streams report {worlds}, more positions than the {count(allowed)} rank identities this "
                "sidecar keeps (ranks.max_ranks)")
    else:
        said = f"its streams report different worlds: {worlds}"
    return f"world conflict: {said}; no missing rank can be worked out"


def grid_of(grid: v1.Grid, room: int) -> tuple[list[tuple[int, int]], list[int], int, int]:
    """The rows (pp, cp) and tp columns of a dp group's grid that fit `room` cells, and how many it has.

    Read from the group's `grid` (the sidecar's status.grid_model), cut to the room as the sidecar cuts it:
    a document listing more than the caps allow is still drawn within them.
    """
    columns = [integer(tp) for tp in grid.tp_ranks[:max(room, 0)]]
    fit = room // len(columns) if columns else 0
    rows = [(integer(row.pp_rank), integer(row.attn_cp_rank)) for row in grid.rows[:fit]]
    return rows, columns, integer(grid.row_count), integer(grid.column_count)


def group_block(server: v1.Server, group: v1.ServerGroup, cells: Sequence[v1.RankCell], names: Names,
                room: int = GRID_CELLS_PER_GROUP, show_cp: bool = False) -> GridBlock:
    """One dp group of a server: pp stage (and cp rank) rows by attention tp columns, each cell a rank on its
    state's colour with its streams' letters (`lettered`), at most `room` cells (`grid_of`), and a line saying
    what is left out. A missing rank is `N?` on the missing colour."""
    title = Text(f"dp{integer(group.dp_rank)}", style="bold")
    ranks, live, missing = integer(group.ranks), integer(group.live), integer(group.missing)
    title.append(f"  {live}/{ranks} live", style="green" if live == ranks else "yellow")
    if missing:
        title.append("  ")
        title.append(f"{missing} missing", style=MISSING_STYLE)
    if server.expected is not None and not group.expected:
        title.append("  outside the expected world", style="dim")
    at = {(integer(c.pp_rank), integer(c.attn_cp_rank), integer(c.tp_rank)): c for c in cells}
    rows, tps, row_count, column_count = grid_of(group.grid, room)
    drawn = [at[(pp, cp, tp)] for pp, cp in rows for tp in tps if (pp, cp, tp) in at]
    with_letters = lettered(drawn, names)
    marked = any(c.state == MISSING for c in drawn)
    digits = max((len(str(tp)) for tp in tps), default=1)
    if with_letters:
        room_for = max((len(letters(c, names)) for c in drawn), default=0)
        width = digits + 1 + room_for
    else:
        room_for, width = 0, digits + (len(MISSING_MARK) if marked else 0)
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column()
    for pp, cp in rows:
        row = [cell_text(at.get((pp, cp, tp)), tp, digits, room_for, width, with_letters, names) for tp in tps]
        grid.add_row(Text(f"pp{pp} cp{cp}" if show_cp else f"pp{pp}", style="dim"), CellRow(row, width))
    parts: list[RenderableType] = [title, grid]
    if len(rows) < row_count or len(tps) < column_count:
        drawn_rows, drawn_columns = set(rows), set(tps)
        # The sidecar counts what it left out; a document listing past the caps is cut here too.
        cut = sum(1 for pp, cp, tp in at if (pp, cp) not in drawn_rows or tp not in drawn_columns)
        hidden = integer(group.grid.hidden_ranks) + cut
        parts.append(Text(f"drawn {count(len(rows))} of {count(row_count)} rows, {count(len(tps))} of {count(column_count)} tp "
                          f"columns; {count(hidden)} rank{plural(hidden)} not drawn", style="yellow"))
    return GridBlock(len(rows) * len(tps), *parts)


def cell_text(cell: v1.RankCell | None, tp: int, digits: int, room_for: int, width: int, with_letters: bool,
              names: Names) -> Text:
    """A grid cell `width` wide: the tp rank (and `?` when missing) on the rank's colour, then its streams' letters."""
    if cell is None:  # a position of the grid no stream reports for and the world does not expect
        return Text(f"{tp:>{digits}}".ljust(width), style=ABSENT_STYLE)
    missing = cell.state == MISSING
    style = MISSING_STYLE if missing else STATE_STYLE.get(cell.state, "reverse")
    if not with_letters:
        return Text(f"{f'{tp}{MISSING_MARK}' if missing else str(tp):>{width}}", style=style)
    text = Text()  # no style of its own: the letters are on their own colours, not the rank's
    text.append(f"{tp:>{digits}}{MISSING_MARK if missing else ' '}", style=style)
    shown = letters(cell, names)
    for letter, state in shown:
        text.append(letter, style=STATE_STYLE.get(state, "reverse"))
    text.append(" " * (room_for - len(shown)), style=style if not shown else "")
    return text


class GridBlock(Group):
    """A group's block, knowing how many cells its grid draws (they count against the frame's GRID_CELLS)."""

    def __init__(self, cells: int, *renderables: RenderableType) -> None:
        super().__init__(*renderables)
        self.cells = cells


def chip(word: str, style: str) -> Text:
    """`   word  `, the word on its state's colour, to start a line naming streams or ranks."""
    line = Text("   ")
    line.append_text(literal(word))
    line.append(" ")
    line.stylize(style, 2)  # a chip: " stale " in the grid's colour
    line.append(" ")
    return line


def stream_lines(doc: v1.StatusDocument, names: Names) -> list[Text]:
    """The streams that are not live, one a line (at most NOT_LIVE_SHOWN; the rest counted): state, kind,
    identity, the rank it reports for when its tp rank is not the attention one, source, seq, restarts, silence."""
    not_live = [stream for stream in doc.streams if stream.state != "live"]
    out = []
    for stream in not_live[:NOT_LIVE_SHOWN]:
        line = chip(stream.state, STATE_STYLE.get(stream.state, "reverse"))
        line.append_text(literal(stream.kind))
        line.append("  ")
        line.append_text(literal(names.stream(stream)))
        cell = names.rank_elsewhere(stream)
        if cell is not None:
            cp = integer(cell.attn_cp_rank)
            line.append(f"  (rank tp={integer(cell.tp_rank)}" + (f" cp={cp}" if cp else "") + ")")
        line.append("  ")
        line.append_text(literal(stream.source))
        line.append(f"  seq {integer(stream.seq)}  restarts {count(stream.restarts)}", style="dim")
        since = stream.seconds_since_push
        line.append(f"  {duration(since)} since a push" if since is not None else "  never pushed", style="dim")
        out.append(line)
    if len(not_live) > NOT_LIVE_SHOWN:
        out.append(Text(f"   and {len(not_live) - NOT_LIVE_SHOWN} more streams not live", style="bold"))
    return out


def missing_lines(doc: v1.StatusDocument, cells_of: Mapping[tuple[str, int], list[v1.RankCell]],
                  names: Names) -> list[Text]:
    """One line per dp group with missing ranks, naming them (the drawn ones; the rest counted); at most
    NOT_LIVE_SHOWN lines."""
    lines = []
    for server in doc.servers:
        expected = server.expected
        for group in server.dp_groups:
            missing = integer(group.missing)
            if not missing:
                continue
            line = chip("missing", MISSING_STYLE)
            if names.labels[server.label_set] or len(doc.servers) > 1:  # else the one server needs no name
                line.append_text(names.server(server))
                line.append(" ")
            line.append(f"dp{integer(group.dp_rank)}")
            if not group.ranks and expected is not None:
                cp = f" × cp {integer(expected.attn_cp_size)}" if expected.attn_cp_size > 1 else ""
                line.append(f": the whole dp group (pp {integer(expected.pp_size)}{cp} × tp "
                            f"{integer(expected.attn_tp_size)}), no stream has reported")
                lines.append(line)
                continue
            drawn = [c for c in cells_of.get((server.id, integer(group.dp_rank)), []) if c.state == MISSING]
            cp_named = expected is not None and expected.attn_cp_size > 1
            named = [f"pp{integer(c.pp_rank)}" + (f" cp{integer(c.attn_cp_rank)}" if cp_named else "")
                     + f" tp{integer(c.tp_rank)}" for c in drawn[:MISSING_SHOWN]]
            rest = missing - len(named)
            line.append(": " + ", ".join(named) if named else f": {count(missing)} not drawn")
            if named and rest > 0:
                line.append(f" and {count(rest)} more", style="bold")
            lines.append(line)
    out = lines[:NOT_LIVE_SHOWN]
    if len(lines) > NOT_LIVE_SHOWN:
        out.append(Text(f"   and {len(lines) - NOT_LIVE_SHOWN} more dp groups with missing ranks", style="bold"))
    return out


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


# --- where prefill tokens come from ----------------------------------------------------------

SHARES_WIDTH = 40  # the stacked bar, in cells
TIER_STYLE = {"device": "blue", "host": "green", "storage": "yellow", "offload": "magenta", "computed": "bright_black"}
GROUPS_SHOWN = 4  # dp groups given a line of their own shares; the rest are counted


def share_bar(segments: Sequence[view.ShareSegment], width: int = SHARES_WIDTH) -> Text:
    """The shares as one stacked bar of `width` cells, the nearest tier first (each segment ends where the
    running share rounds to, so the cells add up to `width`)."""
    bar, running, drawn = Text(), 0.0, 0
    for segment in segments:
        running += number(segment.share)
        end = min(width, math.floor(running * width + 0.5))
        bar.append("█" * (end - drawn), style=TIER_STYLE.get(segment.kind, ""))
        drawn = max(drawn, end)
    return bar


def shares_line(segments: Sequence[view.ShareSegment]) -> Text:
    """`device 61 % · host 22 % · ...` (view.shares_text), each tier's name in its bar's colour."""
    if not segments:
        return Text(view.NO_PREFILL, style="dim")
    line = Text()
    for i, segment in enumerate(segments):
        if i:
            line.append(" · ")
        line.append(segment.kind, style=f"bold {TIER_STYLE.get(segment.kind, '')}")
        line.append(f" {segment.percent}")
    return line


def prefill_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Where prefill tokens come from since the sidecar started (view.prefill_segments): the bar and the shares,
    a line per tier with its tokens and the cost per hit token, the window's shares and each dp group's."""
    report = doc.prefill
    if report is None:  # no profile in use counts them (or a sidecar from before the field): no section
        return []
    head = Text("Where prefill tokens come from", style=SECTION)
    segments = view.prefill_segments(report.since_start, report.tiers)
    head.append(f"   since the sidecar started: {count(report.since_start.tokens.total)} tokens", style="dim")
    if not segments:
        return [head, Text(view.NO_PREFILL, style="dim")]
    out: list[RenderableType] = [head, Text.assemble(share_bar(segments), "  ", shares_line(segments))]
    table = Table(box=None, padding=(0, 2), show_edge=False, show_header=False)
    for justify in ("left", "right", "right", "left"):
        table.add_column(justify=justify, no_wrap=True)
    for segment in segments:
        table.add_row(Text(segment.kind, style=TIER_STYLE.get(segment.kind, "")), Text(segment.percent),
                      Text(f"{count(segment.tokens)} tokens"), literal(segment.cost))
    out.append(table)
    window = Text(f"over {duration(report.window_seconds)}: ", style="dim")
    out.append(window.append_text(shares_line(view.prefill_segments(report.window, report.tiers))))
    groups = report.since_start.dp_groups
    if len(groups) > 1:
        servers = {server.id: server for server in doc.servers}
        names = Names(doc) if len(servers) > 1 else None
        for group in groups[:GROUPS_SHOWN]:
            line = Text(style="dim")
            if names is not None and group.server in servers:  # one server: its dp rank says which group
                line.append_text(labels_text(names.server_labels(servers[group.server])))
                line.append(" ")
            line.append(f"dp{integer(group.dp_rank)}: ")
            out.append(line.append_text(shares_line(view.prefill_segments(group, report.tiers))))
        more = integer(report.since_start.dp_groups_count) - min(len(groups), GROUPS_SHOWN)
        if more > 0:
            out.append(Text(f"and {count(more)} more dp group{plural(more)}", style="dim"))
    return out


# --- transfers and bandwidth ----------------------------------------------------------------


def transfers_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """Per transfer between tiers (view.transfer_rows): rolled-up tokens and bytes, active bandwidth now and its
    history; then the bytes families outside every profile's transfers."""
    bandwidth = doc.bandwidth
    head = Text("Transfers", style=SECTION)
    head.append(f"   totals since the sidecar started; active bandwidth over {duration(bandwidth.window_seconds)}, "
                f"history every {duration(bandwidth.history_interval_seconds)}", style="dim")
    table = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
    for name, justify in (("transfer", "left"), ("tiers", "left"), ("tokens", "right"), ("bytes", "right"),
                          ("active bandwidth", "right"), ("history", "left")):
        table.add_column(name, justify=justify, no_wrap=True)  # type: ignore[arg-type]
    for transfer in view.transfer_rows(doc):
        rate = transfer.bytes_per_second
        table.add_row(literal(transfer.name), literal(f"{transfer.source}→{transfer.target}"),
                      Text(count(transfer.tokens) if transfer.tokens is not None else "–"),
                      Text(size(transfer.bytes) if transfer.bytes is not None else "–"),
                      Text(speed(rate), style="bold cyan" if rate is not None else "dim"),
                      sparkline(transfer.history))
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


NO_LABELS = "(no labels of its own)"


class Names(view.Names):
    """The view model's references read back as rich Text, every value through `literal`."""

    def __init__(self, doc: v1.StatusDocument) -> None:
        super().__init__(doc)
        self.ranks_allowed = doc.sidecar.limits.ranks_allowed

    def group(self, group: v1.Group) -> Text:
        """`dp0 cache_type=...`: a replica group as its dp rank and static labels."""
        name = Text(f"dp{integer(group.dp_rank)}")
        labels = self.labels[group.label_set]
        if labels:
            name.append(" ")
            name.append_text(labels_text(labels))
        return name

    def server(self, server: v1.Server) -> Text:
        """`model=m, pod=a`: a server as its labels (what its streams share, less what their collectors add)."""
        labels = self.server_labels(server)
        return labels_text(labels) if labels else Text(NO_LABELS)

    def stream(self, stream: v1.Stream) -> str:
        """A stream's identity (view.identity_text), its axes checked as integers first; shown through `literal`."""
        for axis in (stream.tp_rank, stream.pp_rank, stream.dp_rank, stream.attn_cp_rank or 0):
            integer(axis)
        return self.identity(stream)


def upstreams_section(doc: v1.StatusDocument) -> list[RenderableType]:
    """The engines the sidecar proxies (none when every rank pushes), the world each is expected in, and
    where an engine's labels contradict it."""
    if not doc.upstreams:
        return [Text("Upstreams", style=SECTION).append("   none: every rank pushes", style="dim")]
    table = Table(box=None, padding=(0, 2), show_edge=False, header_style="bold")
    for name in ("upstream", "source", "state", "ranks", "world", "samples", "last read", "errors", "last error"):
        table.add_column(name, overflow="fold")
    problems: list[Text] = []
    for upstream in doc.upstreams:
        errors = sum(number(n) for n in upstream.errors.values())
        took = upstream.last_scrape_duration_seconds
        world = upstream.world
        table.add_row(literal(upstream.name), literal(upstream.source),
                      Text("up", style="green") if upstream.up else Text("DOWN", style="bold red"),
                      Text(count(upstream.ranks)),
                      Text(world_text(world) if world is not None else "–",
                           style="bold yellow" if upstream.world_problems else ""),
                      Text(count(upstream.samples)),
                      Text(f"{number(took) * 1000:.0f} ms" if took is not None else "never"),
                      Text(count(errors), style="red" if errors else ""),
                      literal(upstream.last_error or ""))
        for said in upstream.world_problems[:WORLD_PROBLEMS_SHOWN]:
            line = literal(upstream.name, style="bold yellow")
            line.append_text(literal(f": world not trusted: {said}"[:300], style="yellow"))
            problems.append(line)
        if len(upstream.world_problems) > WORLD_PROBLEMS_SHOWN:
            problems.append(Text(f"   and {len(upstream.world_problems) - WORLD_PROBLEMS_SHOWN} more", style="yellow"))
    return [Text("Upstreams", style=SECTION), table, *problems]


WORLD_PROBLEMS_SHOWN = 8  # per upstream, as many as the sidecar lists


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
    for profile in sidecar.profiles[1:]:  # profiles besides the default one, each with its own namespace
        limit_line.append(" · ")
        limit_line.append_text(literal(f"{profile.name} {profile.namespace!r}"))
    rejected = Text(f"rejections {count(sidecar.rejections_total)}",
                    style="bold red" if sidecar.rejections_total else "green")
    for reason, n in view.rejections(sidecar):
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
    ("Prefill", prefill_section), ("Ranks", ranks_section), ("Transfers", transfers_section), ("Reasons", reasons_section),
    ("Replica spread", spread_section), ("Upstreams", upstreams_section), ("Sidecar", sidecar_section),
)
