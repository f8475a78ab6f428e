"""The status page at `/`: the status document (exporter.api.v1, built by status.py) rendered as HTML; no I/O.

Readable without JavaScript. With it, static/status.js rebuilds the same sections from
/api/v1/status every few seconds: the element ids and classes here are what it fills in, and
the two must agree (tests/e2e/test_status_page_browser.py reads both). Every value goes through
`esc`; the page has no inline script or style, so its Content-Security-Policy can forbid them.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Iterable, Sequence

import msgspec

from exporter.api import v1
from exporter.sidecar.expose.status import identity_text, quoted_labels

REFRESH_MS = 2000  # how often the script fetches /api/v1/status
NOSCRIPT_REFRESH_SECONDS = 15  # without JavaScript, the browser reloads the page this often
STATES = ("live", "stale", "departed", "expired")
MISSING = "missing"  # a grid position, or a dp group, that the ranks' world expects and no known rank holds
SPARK_WIDTH, SPARK_HEIGHT = 120, 24


def esc(value: object) -> str:
    """Any value as HTML text or a quoted attribute value."""
    return html.escape(str(value), quote=True)


# --- number formats (static/status.js has the same ones) ---


def fmt_number(value: float | None) -> str:
    """A count with thousands separators; fractions to three significant digits."""
    if value is None:
        return "–"
    if float(value).is_integer():
        return f"{int(value):,}"
    return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def fmt_bytes(value: float | None) -> str:
    """Bytes in binary units (KiB, MiB, ...)."""
    if value is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def fmt_rate(value: float | None) -> str:
    """Bytes per second in decimal units (GB/s, as the engine's bandwidth histograms count)."""
    if value is None:
        return "idle"
    for unit in ("B/s", "kB/s", "MB/s", "GB/s"):
        if abs(value) < 1000 or unit == "GB/s":
            return f"{value:.2f} {unit}" if unit != "B/s" else f"{value:.0f} B/s"
        value /= 1000
    raise AssertionError("unreachable")


def fmt_seconds(value: float | None) -> str:
    """A duration for people: 0.4 s, 42 s, 3 m 5 s, 2 h 10 m, 3 d 4 h."""
    if value is None:
        return "never"
    if value < 10:
        return f"{value:.1f} s"
    whole = int(value)
    for size, unit, sub_size, sub_unit in ((86400, "d", 3600, "h"), (3600, "h", 60, "m"), (60, "m", 1, "s")):
        if whole >= size:
            return f"{whole // size} {unit} {(whole % size) // sub_size} {sub_unit}"
    return f"{whole} s"


def fmt_time(value: float) -> str:
    """A wall-clock time as HH:MM:SS UTC."""
    return time.strftime("%H:%M:%S UTC", time.gmtime(value))


def fmt_ratio(value: float) -> str:
    return f"{value * 100:.1f}%"


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
        parts.append(f"{'L' if pen_down else 'M'}{x:.1f} {y:.1f}")
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
        f'<span class="swatch state-{state}">{state}</span>' for state in (*STATES, MISSING)) + "</p>"


def by_state(sidecar: v1.Sidecar) -> dict[str, int]:
    """Known ranks by state, in the document's order (live, stale, departed, expired)."""
    return msgspec.structs.asdict(sidecar.ranks_by_state)


def fmt_world(world: v1.WorldSizes) -> str:
    return f"tp {world.tp_size} × pp {world.pp_size} × dp {world.dp_size}"


def label_text(labels: dict[str, str]) -> str:
    return " ".join(f"{name}={value}" for name, value in labels.items()) or "no static labels"


class Names:
    """What the document writes once and references by id, read back as text: a group's `dp=<n>` and
    quoted static labels, and a rank's full identity (`status.identity_text`), both as /metrics quotes them."""

    def __init__(self, doc: v1.StatusDocument) -> None:
        self.labels: dict[str, dict[str, str]] = {s.id: s.labels for s in doc.label_sets}
        self.groups: dict[str, v1.Group] = {g.id: g for g in doc.groups}

    def group(self, group: v1.Group | v1.MissingGroup) -> str:
        """A group, or a missing group (which has no id): `dp=<n> name="value" ...`."""
        return " ".join((f"dp={group.dp_rank}", *quoted_labels(tuple(self.labels[group.label_set].items()))))

    def rank(self, rank: v1.Rank) -> str:
        """`tp=.. pp=.. dp=.. [cp=..] name="value" ...`: the axes, then every static label in name order."""
        labels = {**self.labels[self.groups[rank.group].label_set], **rank.own_labels}
        return identity_text(rank.tp_rank, rank.pp_rank, rank.dp_rank, rank.attn_cp_rank,
                             tuple(sorted(labels.items())))


def world_conflicts(doc: v1.StatusDocument) -> list[str]:
    """One warning per static label set whose ranks reported different worlds, or a world larger than the
    sidecar can hold (`world_implausible`): which worlds, by how many ranks."""
    names = Names(doc)
    allowed = doc.sidecar.limits.ranks_allowed
    lines = []
    for key, implausible, counts in v1.world_conflicts(doc, fmt_world):
        worlds = ", ".join(f"{world} ({n} rank{'' if n == 1 else 's'})" for world, n in counts.items())
        said = (f"report {worlds}, more positions than the {fmt_number(allowed)} rank identities this sidecar "
                "keeps (ranks.max_ranks)" if implausible else f"report different parallel sizes: {worlds}")
        lines.append(f"world conflict: the ranks with {label_text(names.labels[key])} {said}; "
                     "no missing rank can be worked out for them")
    return lines


def grid_cut(group: v1.Group) -> str:
    """What the group's grid leaves out (status.grid_model caps it), with exact counts; empty when nothing."""
    grid = group.grid
    rows, columns = len(grid.rows), len(grid.tp_ranks)
    if rows == grid.row_count and columns == grid.column_count:
        return ""
    hidden = grid.hidden_ranks
    return (f"drawn: {rows} of {grid.row_count} rows, {columns} of {grid.column_count} tp columns; "
            f"{hidden} rank{'' if hidden == 1 else 's'} not drawn (all are under All ranks)")


def grid(doc: v1.StatusDocument) -> str:
    """The ranks of each replica group as a table: pp stage (× cp rank) rows by tp rank columns.

    What is drawn is the group's `grid` (status.grid_model: bounded, with exact counts of what it leaves
    out). Positions the group's world expects and no rank holds are `missing` cells; one cell spans
    its pp stage's rows (no rank holds that pp and tp at any cp rank). Missing dp groups follow.
    """
    if not doc.groups:
        return '<p class="empty">No rank has connected yet.</p>'
    names = Names(doc)
    members: dict[str, list[v1.Rank]] = {}
    for rank in doc.ranks:
        members.setdefault(rank.group, []).append(rank)
    parts = []
    for group in doc.groups:
        name = names.group(group)
        at: dict[tuple[int, int | None, int], v1.Rank] = {}
        for rank in members.get(group.id, ()):
            at[(rank.pp_rank, rank.attn_cp_rank, rank.tp_rank)] = rank
        missing = {(m.pp_rank, m.tp_rank) for m in group.missing}
        rows = [(row.pp_rank, row.attn_cp_rank) for row in group.grid.rows]
        tps = group.grid.tp_ranks
        span: dict[int, int] = {}  # a pp stage's rows drawn: what its missing cells span
        for pp, _ in rows:
            span[pp] = span.get(pp, 0) + 1
        head = "".join(f"<th>tp {esc(tp)}</th>" for tp in tps)
        body = []
        started: set[int] = set()
        for pp, cp in rows:
            first = pp not in started  # the later rows of a stage are under its missing cells' rowspan
            started.add(pp)
            label = f"pp {pp}" + ("" if cp is None else f" cp {cp}")
            cells = []
            for tp in tps:
                if (pp, tp) in missing:
                    if first:
                        attr = f' rowspan="{span[pp]}"' if span[pp] > 1 else ""
                        tip = (f"pp {pp} tp {tp} of {name}: expected by the ranks' world, "
                               "no known rank holds it")
                        cells.append(f'<td class="rank state-{MISSING}"{attr} data-missing="{esc(f"{pp}/{tp}")}" '
                                     f'title="{esc(tip)}"><span class="tp">tp {esc(tp)}</span>'
                                     f'<span class="st">{MISSING}</span></td>')
                    continue
                held = at.get((pp, cp, tp))
                if held is None:
                    cells.append('<td class="rank absent">–</td>')
                    continue
                tip = (f"{names.rank(held)}\nstate {held.state}, last push {fmt_seconds(held.seconds_since_push)} "
                       f"ago, restarts {held.restarts}, {held.source}")
                cells.append(f'<td class="rank state-{esc(held.state)}" data-rank="{esc(held.id)}" '
                             f'title="{esc(tip)}"><span class="tp">tp {esc(tp)}</span>'
                             f'<span class="st">{esc(held.state)}</span></td>')
            body.append(f'<tr><th scope="row">{esc(label)}</th>{"".join(cells)}</tr>')
        caption = f"{group.id} {name}: {group.live} of {group.size} live" + (
            f", {group.missing_count} {MISSING}" if group.missing_count else "")
        cut = grid_cut(group)
        foot = (f'<tfoot><tr><td class="note grid-cut" colspan="{len(tps) + 1}">{esc(cut)}</td></tr></tfoot>'
                if cut else "")
        parts.append(f'<table class="grid" data-group="{esc(group.id)}"><caption>{esc(caption)}</caption>'
                     f"<thead><tr><th></th>{head}</tr></thead><tbody>{''.join(body)}</tbody>{foot}</table>")
    for absent in doc.missing_groups:
        expected = absent.expected
        text = (f"{MISSING}: no rank of this dp group has reported "
                f"(expected tp {expected.tp_size} × pp {expected.pp_size})")
        name = names.group(absent)
        parts.append(f'<table class="grid missing-group" data-missing-group="{esc(name)}">'
                     f"<caption>{esc(name)}: {MISSING}</caption>"
                     f'<tbody><tr><td class="rank state-{MISSING}">{esc(text)}</td></tr></tbody></table>')
    listed = len(doc.missing_groups)
    more = doc.missing_totals.groups - listed
    tail = f'<p class="note">and {esc(more)} more missing dp groups</p>' if more > 0 else ""
    warnings = "".join(f'<p class="warning world-conflict">{esc(line)}</p>' for line in world_conflicts(doc))
    return warnings + '<div class="groups">' + "".join(parts) + "</div>" + tail


def totals(doc: v1.StatusDocument) -> str:
    rows = (_row(t.name, f"{t.source} → {t.target}", fmt_number(t.tokens), fmt_bytes(t.bytes),
                 fmt_rate(t.bytes_per_second))
            for t in doc.transfers)
    return _table(("transfer", "tiers", "tokens", "bytes", "active bandwidth"), rows, "no transfer families in the catalog", 5)


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
                f'<td><meter min="0" max="{esc(top)}" value="{esc(r.value)}"></meter></td></tr>'
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
        rows.append(_row(f"{group.group} {names.group(names.groups[group.group])}", fmt_ratio(group.max_ratio), where,
                         "diverging" if group.diverging else "agree", cls="diverging" if group.diverging else ""))
    note = (f'<p class="note">(max − min) / max of the replicas\' increases over the window; above '
            f'{esc(fmt_ratio(sp.threshold))} a group is diverging.</p>')
    return note + _table(("group", "max spread", "widest series", ""), rows, "no group has two current replicas", 4)


def state_file(p: v1.Persistence | None) -> str:
    """The state file's line: where, how often, what the start took back and what failed (status.js: stateFile)."""
    if p is None:
        return "not kept (--persistence.file)"
    failed = sum(p.write_failures.values())
    line = (f"{p.file}: {fmt_number(p.writes)} writes, every {fmt_seconds(p.interval_seconds)}; "
            f"{p.loaded_identities} rank identities taken back at start")
    return line + (f"; {fmt_number(failed)} writes failed" if failed else "")


def health(doc: v1.StatusDocument) -> str:
    s = doc.sidecar
    limits = s.limits
    states = ", ".join(f"{count} {state}" for state, count in by_state(s).items())
    items = (
        ("ready", "yes" if s.ready else "no: the ingest socket is not listening"),
        ("ingest socket", s.ingest.socket_path),
        ("uptime", fmt_seconds(s.uptime_seconds)),
        ("ranks", states),
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
    rejected = sorted(((n, c) for n, c in s.rejections.items() if c), key=lambda item: (-item[1], item[0]))
    rejections = _table(("rejection reason", "count"), (_row(n, fmt_number(c)) for n, c in rejected), "no rejections", 2)
    conflicts = s.rollup_layout_conflicts
    extra = _table(("family left out of its rollup (bucket layout)", "series"),
                   (_row(f, c) for f, c in conflicts.items()), "", 2) if conflicts else ""
    return (f'<div class="cols"><div>{table}</div><div><p class="note">{esc(fmt_number(s.rejections_total))} '
            f"rejected in all</p>{rejections}{extra}</div></div>")


def rank_table(doc: v1.StatusDocument) -> str:
    names = Names(doc)
    rows = (_row(names.rank(r), r.group, r.state, r.source, fmt_seconds(r.seconds_since_push), r.restarts,
                 r.epoch, r.pid, r.series, cls=f"state-{r.state}")
            for r in doc.ranks)
    return _table(("rank", "group", "state", "source", "last push", "restarts", "epoch", "pid", "series"), rows,
                  "no ranks", 9)


def upstreams(doc: v1.StatusDocument) -> str:
    rows = (_row(u.name, u.source, "up" if u.up else "down", u.ranks, u.samples,
                 fmt_time(u.last_scrape_time) if u.last_scrape_time is not None else "never",
                 u.last_error or "", cls="up" if u.up else "down")
            for u in doc.upstreams)
    return _table(("upstream", "source", "status", "ranks", "samples", "last read", "last error"), rows,
                  "no upstreams configured", 7)


SECTIONS = (
    ("grid", "Ranks", lambda doc: legend() + grid(doc)),
    ("totals", "Totals per tier", totals),
    ("bandwidth", "Active bandwidth", bandwidth),
    ("reasons", "Reasons", reasons),
    ("spread", "Replica spread", spread),
    ("health", "Sidecar", health),
    ("ranks", "All ranks", rank_table),
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
    """The header line: ranks by state, uptime, revision."""
    s = doc.sidecar
    states = ", ".join(f"{count} {state}" for state, count in by_state(s).items() if count) or "no ranks"
    missing = doc.missing_totals.positions
    if missing:
        states += f", {missing} {MISSING}"
    ready = "ready" if s.ready else "NOT READY"
    return f"{ready} · {states} · up {fmt_seconds(s.uptime_seconds)} · revision {s.revision[:12]}"
