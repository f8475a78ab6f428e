"""The status page at `/`: the status document (exporter.api.v1, built by status.py) rendered as HTML; no I/O.

The page's one renderer: what it shows of the document is decided in exporter.api.view, and this
module only writes it as HTML. Readable without JavaScript; with it, static/status.js fetches this
page again every few seconds and swaps in its sections (the elements with the ids written here), so
the script draws nothing of its own (tests/e2e/test_status_page_browser.py compares the two in
Chromium). Every value goes through `esc`; the page has no inline script or style, so its
Content-Security-Policy can forbid them.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Sequence
from decimal import ROUND_HALF_UP, Context, Decimal

from exporter.api import v1
from exporter.api.view import (
    CELL_STATES,
    MISSING,
    NO_PREFILL,
    Names,
    ShareSegment,
    cells_by_group,
    grid_cut,
    label_text,
    prefill_segments,
    rejections,
    shares_text,
    streams_by_state,
    transfer_rows,
)

REFRESH_MS = 2000  # how often the script fetches the page again
NOSCRIPT_REFRESH_SECONDS = 15  # without JavaScript, the browser reloads the page this often
UNEXPECTED = "outside world"  # a rank or dp group that its server's expected world does not hold
SPARK_WIDTH, SPARK_HEIGHT = 120, 24
SHARES_WIDTH, SHARES_HEIGHT = 360, 18  # the stacked bar of prefill shares


def esc(value: object) -> str:
    """Any value as HTML text or a quoted attribute value."""
    return html.escape(str(value), quote=True)


# --- number formats (they round as JavaScript rounds, as the page's script once drew them) ---

_EXACT = Context(prec=400)  # room for any float's every digit: a float converts to Decimal exactly


def fixed(value: float, digits: int) -> str:
    """`value` with `digits` decimals, a tie rounded away from zero as JavaScript's toFixed rounds it
    (Python's format rounds a tie to even: 12.25 MiB would read 12.2; the page has always read 12.3)."""
    return f"{Decimal(value).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP, context=_EXACT):f}"


def js_number(value: float) -> str:
    """A number as JavaScript's String(number) writes it: `432`, not `432.0`; `0.000015`, not `1.5e-05`."""
    if float(value).is_integer() and abs(value) < 1e21:
        return str(int(value))
    text = repr(float(value))
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    power = int(exponent)
    if -7 < power < 21:
        return f"{Decimal(text):f}"
    return f"{mantissa}e{'+' if power > 0 else '-'}{abs(power)}"


def fmt_number(value: float | None) -> str:
    """A count with thousands separators; fractions to three significant digits."""
    if value is None:
        return "–"
    if float(value).is_integer():
        return f"{int(value):,}"
    if abs(value) >= 1000:
        return f"{int(Decimal(value).quantize(Decimal(1), rounding=ROUND_HALF_UP, context=_EXACT)):,}"
    exact = Decimal(value)  # three significant digits, a tie rounded up as toPrecision(3) rounds it
    rounded = exact.quantize(Decimal(1).scaleb(exact.adjusted() - 2), rounding=ROUND_HALF_UP, context=_EXACT)
    return js_number(float(rounded))


def fmt_bytes(value: float | None) -> str:
    """Bytes in binary units (KiB, MiB, ...)."""
    if value is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{fixed(value, 0)} {unit}" if unit == "B" else f"{fixed(value, 1)} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_rate(value: float | None) -> str:
    """Bytes per second in decimal units (GB/s, as the engine's bandwidth histograms count)."""
    if value is None:
        return "idle"
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(value) < 1000 or unit == "GB/s":
            return f"{fixed(value, 2)} {unit}" if unit != "B/s" else f"{fixed(value, 0)} B/s"
        value /= 1000
    raise AssertionError("unreachable")


def fmt_seconds(value: float | None) -> str:
    """A duration for people: 0.4 s, 42 s, 3 m 5 s, 2 h 10 m, 3 d 4 h."""
    if value is None:
        return "never"
    if value < 10:
        return f"{fixed(value, 1)} s"
    whole = int(value)
    for size, unit, sub_size, sub_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if whole >= size:
            return f"{whole // size} {unit} {(whole % size) // sub_size} {sub_unit}"
    return f"{whole} s"


def fmt_time(value: float) -> str:
    """A wall-clock time as HH:MM:SS UTC."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(value))


def fmt_ratio(value: float) -> str:
    return f"{fixed(value * 100, 1)}%"


def sparkline_path(history: Sequence[Sequence[float | None]], points: int) -> str:
    """SVG path data of a bandwidth history, right-aligned in `points` slots; a null breaks the line,
    and so does a value that is not a finite number (the API sends none, but a path with `nan` in it
    is not drawn at all)."""
    values = [v for _, v in history if v is not None and math.isfinite(v)]
    top = max(values, default=0.0) or 1.0
    first = points - len(history)
    step = SPARK_WIDTH / max(points - 1, 1)
    parts: list[str] = []
    pen_down = False
    for index, (_, value) in enumerate(history):
        if value is None or not math.isfinite(value):
            pen_down = False
            continue
        x = (first + index) * step
        y = (SPARK_HEIGHT - 1) - value / top * (SPARK_HEIGHT - 2)
        parts.append(f"{'L' if pen_down else 'M'}{fixed(x, 1)} {fixed(y, 1)}")
        pen_down = True
    return " ".join(parts)


# --- sections ---


def _table(head: Iterable[str], rows: Iterable[str], empty: str, cols: int) -> str:
    body = "".join(rows) or f'<tr><td colspan="{cols}" class="empty">{esc(empty)}</td></tr>'
    heads = list(head)
    thead = "<thead><tr>" + "".join(f"<th>{esc(h)}</th>" for h in heads) + "</tr></thead>" if any(heads) else ""
    return f"<table>{thead}<tbody>{body}</tbody></table>"


def _row(*cells: object, cls: str = "") -> str:
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<tr{attr}>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>"


def legend() -> str:
    return '<p class="legend">' + "".join(
        f'<span class="swatch state-{state}">{state}</span>' for state in CELL_STATES) + "</p>"


def plural(count: int, word: str) -> str:
    """`1 rank`, `20 streams`."""
    return f"{fmt_number(count)} {word}{'' if count == 1 else 's'}"


def server_name(names: Names, server: v1.Server) -> str:
    """A server by its labels, or `server` when its streams share none."""
    return label_text(names.server_labels(server)) or "server"


def server_world(server: v1.Server) -> str:
    """The world a server is expected in, or why there is none."""
    if server.expected is not None:
        return v1.world_name(server.expected)
    return "world conflict" if server.world_conflict else "no world reported"


def world_key(world: v1.WorldSizes) -> tuple[int, ...]:
    return (world.dp_size, world.pp_size, world.attn_cp_size, world.attn_tp_size, world.tp_size)


def world_conflict(doc: v1.StatusDocument, server: v1.Server) -> str:
    """The warning of a server whose streams reported different worlds, or one larger than the sidecar can
    hold (`world_implausible`): which worlds, by how many streams."""
    counts: dict[tuple[int, ...], int] = {}
    for stream in doc.streams:
        if stream.server == server.id and stream.world is not None:
            counts[world_key(stream.world)] = counts.get(world_key(stream.world), 0) + 1
    names = [v1.world_name(w) for w in server.worlds]
    listed = ", ".join(
        # Two worlds that differ only in the engine's tp size read alike: that size tells them apart.
        f"{name}{f' (engine tp {w.tp_size})' if names.count(name) > 1 else ''} "
        f"({plural(counts.get(world_key(w), 0), 'stream')})"
        for name, w in zip(names, server.worlds, strict=True))
    if server.world_implausible:
        said = (f"report {listed}, more positions than the {fmt_number(doc.sidecar.limits.ranks_allowed)} rank "
                "identities this sidecar keeps (ranks.max_ranks)")
    else:
        said = f"report different worlds: {listed}"
    return f"world conflict: the streams of this server {said}; no missing rank can be worked out for it"


def node_share(node: v1.NodeShare) -> str:
    """What part of a multi-node server this sidecar expects."""
    tp, pp = node.tp_ranks, node.pp_ranks
    return (f"node {node.node_rank} of {node.nodes}: this sidecar expects the ranks at global tp "
            f"{tp[0]}–{tp[1] - 1} of pp stages {pp[0]}–{pp[1] - 1}")


def cut_text(grid: v1.Grid) -> str:
    """What a dp group's grid leaves out (view.grid_cut), with exact counts; empty when nothing."""
    cut = grid_cut(grid)
    if cut is None:
        return ""
    return (f"drawn: {cut.rows} of {cut.row_count} rows, {cut.columns} of {cut.column_count} tp columns; "
            f"{plural(cut.hidden_ranks, 'rank')} not drawn (their streams are under All streams)")


def stream_tip(names: Names, stream: v1.Stream) -> str:
    """A stream's full identity and how it goes: the tooltip of its line in a cell."""
    pushed = ("never pushed" if stream.seconds_since_push is None
              else f"last push {fmt_seconds(stream.seconds_since_push)} ago")
    return f"{names.identity(stream)}\nstate {stream.state}, {pushed}, restarts {stream.restarts}, {stream.source}"


def cell(names: Names, server: v1.Server, rank: v1.RankCell) -> str:
    """One rank: its tp rank, its state, a mark when the server's world does not expect it, and a line per
    stream (kind and state, its identity in the tooltip)."""
    unexpected = server.expected is not None and not rank.expected
    where = f"dp {rank.dp_rank} pp {rank.pp_rank} cp {rank.attn_cp_rank} tp {rank.tp_rank} of {server_name(names, server)}"
    said = ("expected by the server's world, no unexpired stream reports for it" if rank.state == MISSING
            else plural(len(rank.streams), "stream"))
    tip = f"{where}: {rank.state}, {said}" + ("; outside the server's expected world" if unexpected else "")
    streams = names.cell_streams(rank)
    lines = "".join(f'<span class="stream state-{esc(s.state)}" title="{esc(stream_tip(names, s))}">'
                    f"{esc(s.kind)} {esc(s.state)}</span>" for s in streams)
    return (f'<td class="rank state-{esc(rank.state)}{" unexpected" if unexpected else ""}" '
            f'data-rank="{esc(rank.id)}" title="{esc(tip)}"><span class="tp">tp {esc(rank.tp_rank)}</span>'
            f'<span class="st">{esc(rank.state)}</span>'
            + (f'<span class="mark">{UNEXPECTED}</span>' if unexpected else "")
            + (f'<span class="streams">{lines}</span>' if lines else "") + "</td>")


def dp_group(names: Names, server: v1.Server, group: v1.ServerGroup, at: dict[tuple[int, int, int], v1.RankCell]
             ) -> str:
    """One dp group of a server as a table: pp stage (× cp rank) rows by attention tp rank columns."""
    grid = group.grid
    tps = grid.tp_ranks
    with_cp = any(row.attn_cp_rank for row in grid.rows)
    head = "".join(f"<th>tp {esc(tp)}</th>" for tp in tps)
    body = []
    for row in grid.rows:
        label = f"pp {row.pp_rank}" + (f" cp {row.attn_cp_rank}" if with_cp else "")
        cells = []
        for tp in tps:
            rank = at.get((row.pp_rank, row.attn_cp_rank, tp))
            cells.append('<td class="rank absent">–</td>' if rank is None else cell(names, server, rank))
        body.append(f'<tr><th scope="row">{esc(label)}</th>{"".join(cells)}</tr>')
    caption = (f"dp {group.dp_rank}: {group.live} of {plural(group.ranks, 'rank')} live"
               + (f", {group.missing} {MISSING}" if group.missing else "")
               + (f"; {UNEXPECTED}" if server.expected is not None and not group.expected else ""))
    cut = cut_text(grid)
    foot = (f'<tfoot><tr><td class="note grid-cut" colspan="{len(tps) + 1}">{esc(cut)}</td></tr></tfoot>'
            if cut else "")
    return (f'<table class="grid" data-server="{esc(server.id)}" data-dp="{esc(group.dp_rank)}">'
            f"<caption>{esc(caption)}</caption><thead><tr><th></th>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody>{foot}</table>")


def server_block(doc: v1.StatusDocument, names: Names, server: v1.Server,
                 cells: dict[tuple[str, int], dict[tuple[int, int, int], v1.RankCell]]) -> str:
    """A server: its name and world, its counts, its warnings, and a grid per dp group."""
    counts = (f"{plural(server.ranks, 'rank')}, {plural(server.streams, 'stream')}; {server.live_ranks} live"
              + (f", {server.missing} {MISSING}" if server.missing else ""))
    notes = "".join((
        f'<p class="warning world-conflict">{esc(world_conflict(doc, server))}</p>' if server.world_conflict else "",
        f'<p class="note node-share">{esc(node_share(server.node))}</p>' if server.node is not None else "",
    ))
    groups = "".join(
        dp_group(names, server, group, cells.get((server.id, group.dp_rank), {}))
        for group in server.dp_groups)
    return (f'<div class="server" data-server="{esc(server.id)}"><h3><span class="server-name">'
            f'{esc(server_name(names, server))}</span> · <span class="world">{esc(server_world(server))}</span></h3>'
            f'<p class="note server-counts">{esc(counts)}</p>{notes}<div class="groups">{groups}</div></div>')


def grid(doc: v1.StatusDocument) -> str:
    """Every server's ranks, one cell per rank (position) listing its streams, a grid per dp group.

    What is drawn is each dp group's `grid` (status.grid_model: bounded, with exact counts of what it
    leaves out) and the `ranks` it holds; a position of a drawn row and column that no cell holds is
    blank. Positions the server's world expects and no unexpired stream reports for are `missing`.
    """
    if not doc.servers:
        return '<p class="empty">No rank has connected yet.</p>'
    names = Names(doc)
    cells = cells_by_group(doc)
    return "".join(server_block(doc, names, server, cells) for server in doc.servers)


def totals(doc: v1.StatusDocument) -> str:
    """Each profile's tier transfers (view.transfer_rows): tiers, totals and active bandwidth."""
    rows = (_row(t.name, f"{t.source} → {t.target}", fmt_number(t.tokens), fmt_bytes(t.bytes),
                 fmt_rate(t.bytes_per_second))
            for t in transfer_rows(doc))
    return _table(("transfer", "tiers", "tokens", "bytes", "active bandwidth"), rows, "no transfer families in the catalog", 5)


def share_bar(segments: Sequence[ShareSegment]) -> str:
    """The shares as one stacked bar (SVG: the page allows no inline style), the nearest tier first."""
    rects, x = [], 0.0
    for segment in segments:
        width = segment.share * SHARES_WIDTH
        if width > 0:
            rects.append(f'<rect class="tier-{esc(segment.kind)}" x="{fixed(x, 1)}" y="0" width="{fixed(width, 1)}" '
                         f'height="{SHARES_HEIGHT}"/>')
        x += width
    return (f'<svg class="shares" width="{SHARES_WIDTH}" height="{SHARES_HEIGHT}" '
            f'viewBox="0 0 {SHARES_WIDTH} {SHARES_HEIGHT}" role="img" aria-label="{esc(shares_text(segments))}">'
            f'{"".join(rects)}</svg>')


def prefill(doc: v1.StatusDocument) -> str:
    """Where prefill tokens come from (view.prefill_segments): each tier's share since start as text and as a
    stacked bar, a row per tier with its tokens and the cost per hit token, the window's shares, and each
    dp group's shares."""
    report = doc.prefill
    if report is None:
        return '<p class="empty">No profile in use counts prefill tokens by tier.</p>'
    since = report.since_start
    segments = prefill_segments(since, report.tiers)
    if not segments:
        return f'<p class="empty">{esc(NO_PREFILL)}.</p>'
    rows = (f'<tr><td><span class="swatch tier-{esc(s.kind)}">{esc(s.kind)}</span></td><td>{esc(s.percent)}</td>'
            f"<td>{esc(fmt_number(s.tokens))}</td><td>{esc(s.cost or '–')}</td></tr>" for s in segments)
    window = shares_text(prefill_segments(report.window, report.tiers))
    parts = [f'<p class="shares-text">{esc(shares_text(segments))}</p>', share_bar(segments),
             f'<p class="note">Since the sidecar started: {esc(fmt_number(since.tokens.total))} prefill tokens. '
             f"Over the last {esc(fmt_seconds(report.window_seconds))}: {esc(window)}.</p>",
             _table(("tier", "share", "tokens", "cost per hit token"), rows, "", 4)]
    if len(since.dp_groups) > 1:
        names = Names(doc)
        servers = {server.id: server for server in doc.servers}
        groups = (_row(server_name(names, servers[g.server]) if g.server in servers else g.server, g.dp_rank,
                       shares_text(prefill_segments(g, report.tiers)), fmt_number(g.tokens.total))
                  for g in since.dp_groups)
        more = since.dp_groups_count - len(since.dp_groups)
        parts.append(_table(("server", "dp", "shares since start", "tokens"), groups, "", 4)
                     + (f'<p class="note">and {esc(plural(more, "more dp group"))}</p>' if more else ""))
    return "".join(parts)


def sparkline(history: Sequence[Sequence[float | None]], points: int) -> str:
    return (f'<svg class="spark" width="{SPARK_WIDTH}" height="{SPARK_HEIGHT}" viewBox="0 0 {SPARK_WIDTH} {SPARK_HEIGHT}" '
            f'role="img" aria-label="bandwidth history"><path d="{esc(sparkline_path(history, points))}"/></svg>')


def bandwidth(doc: v1.StatusDocument) -> str:
    bw = doc.bandwidth
    rows = (
        f"<tr><td>{esc(f.transfer or '–')}</td><td>{esc(f.family)}</td><td>{esc(fmt_rate(f.bytes_per_second))}</td>"
        f"<td>{sparkline(f.history, bw.history_points)}</td></tr>"
        for f in bw.families
    )
    note = (f'<p class="note">Over the last {esc(fmt_seconds(bw.window_seconds))}; history: one point every '
            f'{esc(fmt_seconds(bw.history_interval_seconds))}, the last {esc(bw.history_points)}.</p>')
    return note + _table(("transfer", "bytes family", "now", "history"), rows, "no bandwidth pairs in the catalog", 4)


def reasons(doc: v1.StatusDocument) -> str:
    parts = []
    for family in doc.reasons:
        top = max((r.value for r in family.by_reason), default=0.0) or 1.0
        rows = (f"<tr><td>{esc(r.reason)}</td><td>{esc(fmt_number(r.value))}</td>"
                f'<td><meter min="0" max="{esc(js_number(top))}" value="{esc(js_number(r.value))}"></meter></td></tr>'
                for r in family.by_reason)
        note = " (attempt-level: not a final cache-miss count)" if family.attempt_level else ""
        more = (f'<p class="note">and {esc(fmt_number(family.other_reasons))} more reasons, '
                f'{esc(fmt_number(family.other_value))} tokens</p>') if family.other_reasons else ""
        parts.append(f'<h3>{esc(family.family)}</h3><p class="note">total {esc(fmt_number(family.total))} tokens'
                     f"{esc(note)}</p>" + _table(("reason", "tokens", ""), rows, "none yet", 3) + more)
    return "".join(parts) or '<p class="empty">No family with a reason label.</p>'


def spread(doc: v1.StatusDocument) -> str:
    sp = doc.spread
    names = Names(doc)
    rows = []
    for group in sp.groups:
        worst = group.series[0] if group.series else None
        where = "–" if worst is None else worst.family + "".join(f" {k}={v}" for k, v in worst.labels.items())
        rows.append(_row(f"{group.group} {names.group_text(names.groups[group.group])}", fmt_ratio(group.max_ratio), where,
                         "diverging" if group.diverging else "agree", cls="diverging" if group.diverging else ""))
    note = (f'<p class="note">(max − min) / max of the replicas\' increases over the window; above '
            f'{esc(fmt_ratio(sp.threshold))} a group is diverging.</p>')
    return note + _table(("group", "max spread", "widest series", ""), rows, "no group has two current replicas", 4)


def state_file(p: v1.Persistence | None) -> str:
    """The state file's line: where, how often, what the start took back and what failed."""
    if p is None:
        return "not kept (--persistence.file)"
    failed = sum(p.write_failures.values())
    line = (f"{p.file}: {fmt_number(p.writes)} writes, every {fmt_seconds(p.interval_seconds)}; "
            f"{p.loaded_identities} rank identities taken back at start")
    return line + (f"; {fmt_number(failed)} writes failed" if failed else "")


def health(doc: v1.StatusDocument) -> str:
    s = doc.sidecar
    limits = s.limits
    states = ", ".join(f"{count} {state}" for state, count in streams_by_state(s))
    t = doc.totals
    ranks = (f"{t.ranks} in {plural(t.servers, 'server')}: {t.live_ranks} live"
             + (f", {t.missing} {MISSING}" if t.missing else ""))
    items = (
        ("ready", "yes" if s.ready else "no: the ingest socket is not listening"),
        ("ingest socket", s.ingest.socket_path),
        ("uptime", fmt_seconds(s.uptime_seconds)),
        ("ranks", ranks),
        ("streams", states),
        ("connections", f"{s.connections.open} open of {s.connections.allowed}, "
                        f"{s.connections.accepted} accepted"),
        ("snapshots applied", f"{fmt_number(s.snapshots_applied)} of {fmt_number(s.snapshots_received)} received"),
        ("samples applied", fmt_number(s.samples_applied)),
        ("series", f"{fmt_number(limits.series_used)} of {fmt_number(limits.series_allowed)} "
                   f"({fmt_number(limits.series_rank)} rank, {fmt_number(limits.series_rollup)} rollup)"),
        ("rank identities", f"{limits.ranks_known} of {limits.ranks_allowed}"),
        ("stale / expired after",
         f"{fmt_seconds(limits.stale_after_seconds)} / {fmt_seconds(limits.expire_after_seconds)}"),
        ("state file", state_file(s.persistence)),
    )
    table = _table(("", ""), (_row(k, v) for k, v in items), "", 2)
    rejected = _table(("rejection reason", "count"), (_row(n, fmt_number(c)) for n, c in rejections(s)),
                      "no rejections", 2)
    conflicts = s.rollup_layout_conflicts
    extra = _table(("family left out of its rollup (bucket layout)", "series"),
                   (_row(f, c) for f, c in conflicts.items()), "", 2) if conflicts else ""
    return (f'<div class="cols"><div>{table}</div><div><p class="note">{esc(fmt_number(s.rejections_total))} '
            f"rejected in all</p>{rejected}{extra}</div></div>")


def stream_table(doc: v1.StatusDocument) -> str:
    """Every stream: its identity, kind, the rank it reports for and how it goes."""
    names = Names(doc)
    rows = (_row(names.identity(r), r.kind, r.rank, r.state, r.source, fmt_seconds(r.seconds_since_push), r.restarts,
                 r.epoch, r.pid, r.series, cls=f"state-{r.state}")
            for r in doc.streams)
    return _table(("stream", "kind", "rank", "state", "source", "last push", "restarts", "epoch", "pid", "series"),
                  rows, "no streams", 10)


def upstreams(doc: v1.StatusDocument) -> str:
    """The upstreams read (proxy mode), their expected worlds, and a line per way the engine's labels
    contradict a configured world."""
    rows = (_row(u.name, u.source, "up" if u.up else "down", u.ranks, u.samples,
                 "–" if u.world is None else v1.world_name(u.world),
                 fmt_time(u.last_scrape_time) if u.last_scrape_time is not None else "never",
                 u.last_error or "", cls="up" if u.up else "down")
            for u in doc.upstreams)
    problems = "".join(f'<p class="warning world-problem">{esc(u.name)}: {esc(problem)}</p>'
                       for u in doc.upstreams for problem in u.world_problems)
    return _table(("upstream", "source", "status", "ranks", "samples", "world", "last read", "last error"), rows,
                  "no upstreams configured", 8) + problems


SECTIONS = (
    ("prefill", "Where prefill tokens come from", prefill),
    ("grid", "Ranks", lambda doc: legend() + grid(doc)),
    ("totals", "Totals per tier", totals),
    ("bandwidth", "Active bandwidth", bandwidth),
    ("reasons", "Reasons", reasons),
    ("spread", "Replica spread", spread),
    ("health", "Sidecar", health),
    ("streams", "All streams", stream_table),
    ("upstreams", "Upstreams", upstreams),
)


def render_page(doc: v1.StatusDocument) -> str:
    """The whole page for one status document."""
    s = doc.sidecar
    sections = "".join(
        f'<section id="{name}"><h2>{esc(title)}</h2><div class="body" id="{name}-body">{render(doc)}</div></section>'
        for name, title, render in SECTIONS
    )
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>hicache-exporter</title>
<link rel="icon" href="data:,">
<link rel="stylesheet" href="static/status.css">
<script src="static/status.js" defer></script>
<noscript><meta http-equiv="refresh" content="{NOSCRIPT_REFRESH_SECONDS}"></noscript>
</head>
<body data-refresh-ms="{REFRESH_MS}">
<header><h1>hicache-exporter <span id="version">{esc(s.version)}</span></h1>
<p class="meta"><span id="summary">{esc(summary(doc))}</span> &middot;
<span id="updated">as of {esc(fmt_time(doc.generated_at))}</span> <span id="refresh-state"></span></p>
<nav><a href="metrics">/metrics</a> &middot; <a href="api/v1/status">/api/v1/status</a> &middot;
<a href="api/v1/ranks">/api/v1/ranks</a> &middot; <a href="-/healthy">/-/healthy</a> &middot;
<a href="-/ready">/-/ready</a></nav>
<noscript><p class="note">JavaScript is off: this page reloads every {NOSCRIPT_REFRESH_SECONDS} s.</p></noscript>
</header>
<main>{sections}</main>
</body></html>
"""


def summary(doc: v1.StatusDocument) -> str:
    """The header line: ranks and streams counted apart, ranks live and missing, streams by state, uptime,
    revision."""
    s, t = doc.sidecar, doc.totals
    parts = [f"{'ready' if s.ready else 'NOT READY'}", f"{plural(t.ranks, 'rank')}, {plural(t.streams, 'stream')}"]
    if t.ranks or t.missing:
        parts.append(f"ranks: {t.live_ranks} live" + (f", {t.missing} {MISSING}" if t.missing else ""))
    states = ", ".join(f"{count} {state}" for state, count in streams_by_state(s) if count)
    if states:
        parts.append(f"streams: {states}")
    parts += [f"up {fmt_seconds(s.uptime_seconds)}", f"revision {s.revision[:12]}"]
    return " · ".join(parts)
