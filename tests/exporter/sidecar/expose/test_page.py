"""The status page's HTML (exporter.sidecar.expose.page) on the server/rank/stream model: one cell per rank
(position) listing its streams, a block per server, a grid per dp group; on the harness's fake clocks.

The script (static/status.js) swaps in the same sections on a refresh: tests/e2e/test_status_page_browser.py
compares the two in Chromium.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from html.parser import HTMLParser

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.api import v1
from exporter.api.view import identity_text
from exporter.config import RanksConfig, SidecarConfig
from exporter.protocol.messages import RankId, World
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.ranks import Join
from exporter.sidecar.expose import page
from exporter.sidecar.expose.status import StatusView
from tests.exporter.sidecar.harness import Harness, tokens

RADIX = {"cache_type": "UnifiedRadixCache"}
STORAGE = {"storage_backend": "file", "pp_size": "2", "attn_cp_size": "1"}
SCHEDULER = {"model_name": "m", "engine_type": "unified", "moe_ep_rank": "0"}
DEMO = World(tp_size=4, pp_size=2, dp_size=2, attn_tp_size=2)  # `make demo`: DP attention, tp 2 per dp group
PAGE_TAGS = {"html", "head", "meta", "title", "link", "script", "noscript", "body", "header", "h1", "h2", "h3", "p",
             "span", "nav", "a", "main", "section", "div", "table", "caption", "thead", "tbody", "tfoot", "tr", "th",
             "td", "svg", "path", "rect", "meter"}


@dataclass
class Cell:
    """A rank cell as the page draws it: its attributes and the text of its parts."""

    rank: str
    classes: list[str]
    title: str
    state: str = ""
    mark: str = ""
    streams: list[tuple[str, str, str]] = field(default_factory=list)  # (text, class, title) per stream line


class Drawn(HTMLParser):
    """What a page draws: its tags, its rank cells, and the text of elements by class."""

    def __init__(self, text: str) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.cells: list[Cell] = []
        self.texts: dict[str, list[str]] = {}  # by class
        self.tag_texts: dict[str, list[str]] = {}  # by tag
        self._open: list[tuple[str, str, dict[str, str]]] = []  # (tag, class, attributes) of open elements
        self._text: list[list[str]] = []
        self.feed(text)
        self.close()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        found = {name: value or "" for name, value in attrs}
        if tag in ("meta", "link"):
            return  # void elements: no end tag comes
        if tag == "td" and "data-rank" in found:
            self.cells.append(Cell(found["data-rank"], found["class"].split(), found["title"]))
        self._open.append((tag, found.get("class", ""), found))
        self._text.append([])

    def handle_data(self, data: str) -> None:
        for parts in self._text:
            parts.append(data)

    def handle_endtag(self, tag: str) -> None:
        _, classes, attrs = self._open.pop()
        text = "".join(self._text.pop())
        self.tag_texts.setdefault(tag, []).append(text)
        for name in classes.split():
            self.texts.setdefault(name, []).append(text)
        inside_cell = self.cells and any(t == "td" and "data-rank" in a for t, _, a in self._open)
        if inside_cell and tag == "span":
            cell = self.cells[-1]
            if classes == "st":
                cell.state = text
            elif classes == "mark":
                cell.mark = text
            elif classes.startswith("stream "):
                cell.streams.append((text, classes, attrs["title"]))

    def cell(self, position: str) -> Cell:
        """The cell whose id ends in `position` (`dp=..,pp=..,cp=..,tp=..`)."""
        (found,) = [c for c in self.cells if c.rank.split("/", 1)[1] == position]
        return found


def document(h: Harness) -> v1.StatusDocument:
    """The status document as a client reads it: its JSON decoded into the model."""
    return msgspec.json.decode(StatusView(SidecarConfig(), h.state, SidecarHealth()).encode(), type=v1.StatusDocument)


def drawn(h: Harness) -> Drawn:
    return Drawn(page.render_page(document(h)))


def join(h: Harness, tp: int, pp: int = 0, dp: int = 0, labels: dict[str, str] = RADIX, world: World | None = None,
         cp: int | None = None) -> object:
    """A stream's hello on a fresh connection; the connection."""
    conn = object()
    h.state.join(conn, Join(rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_cp_rank=cp), labels=dict(labels),
                            epoch=f"e-{tp}-{pp}-{dp}-{cp}-{len(labels)}", pid=1, world=world))
    return conn


def demo_rank(h: Harness, dp: int, pp: int, tp: int) -> None:
    """One rank of `make demo`'s server as its collectors label it: radix and storage at the attention tp rank,
    the scheduler at the global tp rank on attention tp 0."""
    join(h, tp, pp, dp, RADIX, DEMO)
    join(h, tp, pp, dp, STORAGE, DEMO, cp=0)
    if tp == 0:
        join(h, dp * 2 + tp, pp, dp, SCHEDULER, DEMO)


DEMO_POSITIONS = [(dp, pp, tp) for dp in range(2) for pp in range(2) for tp in range(2)]


def test_the_demo_is_8_rank_cells_listing_20_streams_and_the_header_counts_them_apart() -> None:
    h = Harness()
    for position in DEMO_POSITIONS:
        demo_rank(h, *position)
    doc = document(h)
    shown = Drawn(page.render_page(doc))
    assert page.summary(doc).startswith("NOT READY · 8 ranks, 20 streams · ranks: 8 live · streams: 20 live · up ")
    assert shown.texts["server-name"] == ["server"] and shown.texts["world"] == ["dp 2 × pp 2 × tp 2"]
    assert shown.texts["server-counts"] == ["8 ranks, 20 streams; 8 live"]
    assert [c.rank.split("/", 1)[1] for c in shown.cells] == [
        f"dp={dp},pp={pp},cp=0,tp={tp}" for dp, pp, tp in DEMO_POSITIONS]
    for (dp, pp, tp), cell in zip(DEMO_POSITIONS, shown.cells, strict=True):
        assert cell.state == "live" and "state-live" in cell.classes and cell.mark == ""
        assert cell.title == f"dp {dp} pp {pp} cp 0 tp {tp} of server: live, {3 if tp == 0 else 2} streams"
        # Radix, storage, then scheduler, whatever order the document lists them in.
        assert [(text, classes) for text, classes, _ in cell.streams] == [
            ("radix live", "stream state-live"), ("storage live", "stream state-live"),
            *([("scheduler live", "stream state-live")] if tp == 0 else [])]
    # The scheduler of dp 1 labels the engine's global tp rank: its identity says tp=2, its cell is tp 0.
    _, _, tip = shown.cell("dp=1,pp=1,cp=0,tp=0").streams[2]
    assert tip == (identity_text(2, 1, 1, None, tuple(sorted(SCHEDULER.items())))
                   + "\nstate live, never pushed, restarts 0, push")
    assert shown.tag_texts["caption"] == ["dp 0: 4 of 4 ranks live", "dp 1: 4 of 4 ranks live"]
    assert shown.tag_texts["h3"][0] == "server · dp 2 × pp 2 × tp 2"


def test_a_stale_stream_is_stale_in_its_line_and_the_rank_keeps_its_liveliest_state() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=2.0, expire_after_seconds=600.0))
    join(h, 0)
    _, storage = h.hello(tp=0, labels=STORAGE, cp=0, epoch="storage")
    h.clock.advance(3.0)
    h.push(storage, tokens(64))  # the storage stream pushes on; the radix one has been silent past stale_after
    cell = drawn(h).cell("dp=0,pp=0,cp=0,tp=0")
    assert cell.state == "live" and "state-live" in cell.classes
    assert [(text, classes) for text, classes, _ in cell.streams] == [
        ("radix stale", "stream state-stale"), ("storage live", "stream state-live")]
    h.clock.advance(3.0)  # now both are silent
    cell = drawn(h).cell("dp=0,pp=0,cp=0,tp=0")
    assert cell.state == "stale" and [text for text, _, _ in cell.streams] == ["radix stale", "storage stale"]


def test_a_rank_that_never_started_is_a_missing_cell_until_it_starts() -> None:
    h = Harness()
    late = (1, 1, 0)  # dp 1, pp 1, attention tp 0: its three streams
    for position in DEMO_POSITIONS:
        if position != late:
            demo_rank(h, *position)
    doc = document(h)
    shown = Drawn(page.render_page(doc))
    missing = [c for c in shown.cells if "state-missing" in c.classes]
    assert [c.rank.split("/", 1)[1] for c in missing] == ["dp=1,pp=1,cp=0,tp=0"]
    assert missing[0].state == "missing" and missing[0].streams == [] and missing[0].mark == ""
    assert missing[0].title == ("dp 1 pp 1 cp 0 tp 0 of server: missing, expected by the server's world, "
                                "no unexpired stream reports for it")
    assert page.summary(doc).startswith("NOT READY · 7 ranks, 17 streams · ranks: 7 live, 1 missing · streams: 17 live")
    assert shown.texts["server-counts"] == ["7 ranks, 17 streams; 7 live, 1 missing"]
    assert shown.tag_texts["caption"] == ["dp 0: 4 of 4 ranks live", "dp 1: 3 of 3 ranks live, 1 missing"]
    demo_rank(h, *late)
    shown = drawn(h)
    assert [c for c in shown.cells if c.state == "missing"] == []
    assert [text for text, _, _ in shown.cell("dp=1,pp=1,cp=0,tp=0").streams] == [
        "radix live", "storage live", "scheduler live"]


def test_a_dp_group_with_no_stream_is_a_grid_of_missing_cells() -> None:
    h = Harness()
    world = World(tp_size=1, pp_size=2, dp_size=4)
    for dp in (0, 1, 3):
        for pp in range(2):
            join(h, 0, pp, dp, world=world)
    shown = drawn(h)
    assert shown.tag_texts["caption"] == ["dp 0: 2 of 2 ranks live", "dp 1: 2 of 2 ranks live",
                                          "dp 2: 0 of 0 ranks live, 2 missing", "dp 3: 2 of 2 ranks live"]
    assert [(c.rank.split("/", 1)[1], c.state) for c in shown.cells if "state-missing" in c.classes] == [
        ("dp=2,pp=0,cp=0,tp=0", "missing"), ("dp=2,pp=1,cp=0,tp=0", "missing")]
    assert shown.texts["world"] == ["dp 4 × pp 2 × tp 1"]


def test_a_position_is_missing_per_attention_cp_rank() -> None:
    h = Harness()
    world = World(tp_size=4, pp_size=1, dp_size=1, attn_tp_size=2, attn_cp_size=2)
    for tp, cp in ((0, 0), (2, 1), (1, 0)):  # without DP attention the radix label is the engine's tp rank
        join(h, tp, world=world, cp=cp)
    shown = drawn(h)
    assert shown.tag_texts["th"][:5] == ["", "tp 0", "tp 1", "pp 0 cp 0", "pp 0 cp 1"]  # rows of (pp, cp)
    assert [(c.rank.split("/", 1)[1], c.state) for c in shown.cells] == [
        ("dp=0,pp=0,cp=0,tp=0", "live"), ("dp=0,pp=0,cp=0,tp=1", "live"),
        ("dp=0,pp=0,cp=1,tp=0", "live"), ("dp=0,pp=0,cp=1,tp=1", "missing")]
    assert shown.texts["world"] == ["dp 1 × pp 1 × cp 2 × tp 2"]


def test_ranks_and_dp_groups_outside_the_world_are_marked() -> None:
    h = Harness()
    world = World(tp_size=2, pp_size=1, dp_size=1)
    join(h, 0, world=world)
    join(h, 1, world=world)
    join(h, 2, world=world)  # tp 2 of a tp-2 world
    join(h, 0, dp=1, world=world)  # dp 1 of a dp-1 world
    shown = drawn(h)
    marked = {c.rank.split("/", 1)[1]: (c.mark, "unexpected" in c.classes, c.title) for c in shown.cells if c.mark}
    assert marked == {
        "dp=0,pp=0,cp=0,tp=2": (page.UNEXPECTED, True, "dp 0 pp 0 cp 0 tp 2 of server: live, 1 stream; "
                                                       "outside the server's expected world"),
        "dp=1,pp=0,cp=0,tp=0": (page.UNEXPECTED, True, "dp 1 pp 0 cp 0 tp 0 of server: live, 1 stream; "
                                                       "outside the server's expected world"),
    }
    assert shown.tag_texts["caption"] == ["dp 0: 3 of 3 ranks live", "dp 1: 1 of 1 rank live; outside world"]
    assert "unexpected" not in shown.cell("dp=0,pp=0,cp=0,tp=1").classes


def test_a_server_without_a_world_marks_nothing_and_says_so() -> None:
    h = Harness()
    join(h, 0)
    join(h, 3, dp=2)
    shown = drawn(h)
    assert shown.texts["world"] == ["no world reported"]
    assert [c.mark for c in shown.cells] == ["", ""] and "warning" not in shown.texts


def test_streams_that_disagree_on_the_world_get_a_warning_and_no_missing_cell() -> None:
    h = Harness()
    join(h, 0, world=World(tp_size=2, pp_size=1, dp_size=1))
    join(h, 0, labels=STORAGE, cp=0, world=World(tp_size=2, pp_size=1, dp_size=1))
    join(h, 1, world=World(tp_size=4, pp_size=1, dp_size=1))
    shown = drawn(h)
    assert shown.texts["world-conflict"] == [
        "world conflict: the streams of this server report different worlds: dp 1 × pp 1 × tp 2 (2 streams), "
        "dp 1 × pp 1 × tp 4 (1 stream); no missing rank can be worked out for it"]
    assert shown.texts["world"] == ["world conflict"]
    assert [c.state for c in shown.cells] == ["live", "live"] and [c.mark for c in shown.cells] == ["", ""]


def test_worlds_that_read_alike_are_told_apart_by_the_engine_tp_size() -> None:
    h = Harness()
    join(h, 0, world=World(tp_size=2, pp_size=1, dp_size=2))  # two replicas of tp 2
    join(h, 1, world=World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2))  # DP attention over tp 4
    (warning,) = drawn(h).texts["world-conflict"]
    assert warning == ("world conflict: the streams of this server report different worlds: dp 2 × pp 1 × tp 2 "
                       "(engine tp 2) (1 stream), dp 2 × pp 1 × tp 2 (engine tp 4) (1 stream); no missing rank "
                       "can be worked out for it")


def test_a_world_at_the_protocol_bounds_is_implausible_and_expects_nothing() -> None:
    h = Harness(ranks_config=RanksConfig(max_ranks=64))
    most = 1 << 16  # the protocol's largest world size
    join(h, 5, dp=3, world=World(tp_size=most, pp_size=most, dp_size=most))
    shown = drawn(h)
    assert shown.texts["world-conflict"] == [
        "world conflict: the streams of this server report dp 65536 × pp 65536 × tp 65536 (1 stream), more positions "
        "than the 64 rank identities this sidecar keeps (ranks.max_ranks); no missing rank can be worked out for it"]
    assert [(c.rank.split("/", 1)[1], c.state) for c in shown.cells] == [("dp=3,pp=0,cp=0,tp=5", "live")]


def test_servers_apart_get_blocks_apart_titled_by_their_labels() -> None:
    h = Harness()
    world = World(tp_size=1, pp_size=1, dp_size=1)
    join(h, 0, labels={**RADIX, "model": "a"}, world=world)
    join(h, 0, labels={**STORAGE, "model": "a"}, cp=0, world=world)
    join(h, 0, labels={**RADIX, "model": "b"})
    shown = drawn(h)
    assert shown.texts["server-name"] == ['model="a"', 'model="b"']
    assert shown.tag_texts["h3"][:2] == ['model="a" · dp 1 × pp 1 × tp 1', 'model="b" · no world reported']
    assert shown.texts["server-counts"] == ["1 rank, 2 streams; 1 live", "1 rank, 1 stream; 1 live"]
    assert [[text for text, _, _ in c.streams] for c in shown.cells] == [["radix live", "storage live"], ["radix live"]]


def test_a_sidecar_of_one_node_says_its_share() -> None:
    h = Harness(ranks_config=RanksConfig(nodes=2, node_rank=1))
    world = World(tp_size=4, pp_size=1, dp_size=1)  # tp 0-1 on node 0, tp 2-3 on node 1
    join(h, 2, world=world)
    join(h, 0, world=world)  # node 0's rank, reporting here after all
    shown = drawn(h)
    assert shown.texts["node-share"] == [
        "node 1 of 2: this sidecar expects the ranks at global tp 2–3 of pp stages 0–0"]
    states = {c.rank.split("/", 1)[1]: (c.state, c.mark) for c in shown.cells}
    assert states == {"dp=0,pp=0,cp=0,tp=0": ("live", page.UNEXPECTED), "dp=0,pp=0,cp=0,tp=2": ("live", ""),
                      "dp=0,pp=0,cp=0,tp=3": ("missing", "")}


def test_a_grid_cut_says_how_many_ranks_it_leaves_out_and_the_page_stays_small() -> None:
    h = Harness()
    for i in range(130):  # a diagonal: 130 rows of (pp, cp) by 130 tp columns, 1,024 cells drawn at most
        join(h, i, pp=i, cp=i)
    text = page.render_page(document(h))
    shown = Drawn(text)
    assert len(shown.cells) == 7  # the diagonal's cells in the 7 rows drawn
    assert text.count('<td class="rank') == 7 * 130  # theirs and the blank positions of those rows
    assert shown.texts["grid-cut"] == [
        "drawn: 7 of 130 rows, 130 of 130 tp columns; 123 ranks not drawn (their streams are under All streams)"]
    assert text.count('<tr class="state-live">') == 130  # the streams table lists every one
    assert len(text.encode()) < 200_000  # 71 KB measured


def test_upstreams_show_their_world_and_a_line_per_problem() -> None:
    """The proxy's configured worlds (Upstream.world, world_problems) as the page shows them, on a document
    whose upstream rows are set here: the hostile problem text stays text."""
    problem = '<b>pp_size="4"</b> on the engine\'s storage series, pp_size 2 configured'
    doc = msgspec.structs.replace(document(Harness()), upstreams=[
        v1.Upstream(name="engine-0", source="http://127.0.0.1:30000/metrics", up=True, last_scrape_time=None,
                    last_scrape_duration_seconds=None, samples=10, scrapes=1, ranks=2, pass_through_families=0,
                    errors={}, last_error=None, unranked_families=[], cp_colliding_families=[],
                    world=v1.WorldSizes(tp_size=4, pp_size=2, dp_size=1, attn_tp_size=4, attn_cp_size=1),
                    world_problems=[problem, "dp_rank 3 outside dp_size 1"]),
        v1.Upstream(name="engine-1", source="/tmp/prometheus_multiproc", up=False, last_scrape_time=None,
                    last_scrape_duration_seconds=None, samples=0, scrapes=0, ranks=0, pass_through_families=0,
                    errors={}, last_error="connection refused", unranked_families=[], cp_colliding_families=[],
                    world=None, world_problems=[]),
    ])
    text = page.render_page(doc)
    shown = Drawn(text)
    assert shown.texts["world-problem"] == [f"engine-0: {problem}", "engine-0: dp_rank 3 outside dp_size 1"]
    assert "<b>" not in text and html.escape(problem) in text
    rows = page.upstreams(doc)
    assert "<td>dp 1 × pp 2 × tp 4</td>" in rows and "<td>–</td>" in rows


def test_an_empty_sidecar_draws_no_server() -> None:
    doc = document(Harness())
    shown = Drawn(page.render_page(doc))
    # The prefill section first, then the grid's.
    assert shown.texts["empty"][:2] == ["no prefill token counted yet.", "No rank has connected yet."]
    assert shown.cells == []
    assert page.summary(doc).startswith("NOT READY · 0 ranks, 0 streams · up ")


LABEL_VALUES = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=128)


@settings(max_examples=60, deadline=None)
@given(value=LABEL_VALUES)
def test_any_label_value_is_text_on_the_page(value: str) -> None:
    h = Harness(ranks_config=RanksConfig(max_label_value_length=128))
    join(h, 0, labels={**RADIX, "model": value}, world=World(tp_size=1, pp_size=1, dp_size=1))
    doc = document(h)
    text = page.render_page(doc)
    shown = Drawn(text)
    assert shown.tags <= PAGE_TAGS  # the value made no element of its own
    (cell,) = shown.cells
    assert cell.rank == doc.ranks[0].id
    identity = identity_text(0, 0, 0, None, (("cache_type", "UnifiedRadixCache"), ("model", value)))
    assert cell.streams == [("radix live", "stream state-live", f"{identity}\nstate live, never pushed, restarts 0, push")]
    assert shown.texts["server-name"] == [page.label_text({"model": value})]
    assert html.escape(identity) in text  # in the stream's tooltip and the streams table, quoted as in /metrics


def test_numbers_are_written_as_the_script_writes_them() -> None:
    """JavaScript's toFixed and toPrecision round a tie away from zero, and String(number) writes no `.0` and no
    `e-05`: the page writes the same characters (the browser test compares the two DOMs)."""
    assert [page.fixed(v, 1) for v in (12.25, 0.125, 0.05, 2.0)] == ["12.3", "0.1", "0.1", "2.0"]
    assert page.fmt_bytes(12.25 * 1024 * 1024) == "12.3 MiB" and page.fmt_rate(1.125e6) == "1.13 MB/s"
    assert [page.fmt_number(v) for v in (1.125, 999.5, 1234.5, 0.000015, 1e-7, 1234)] == [
        "1.13", "1000", "1,235", "0.000015", "1e-7", "1,234"]  # 999.5: three digits, as toPrecision(3)
    assert [page.js_number(v) for v in (432.0, 0.5, 1.5e-05, 1e-7, 2.5e25)] == ["432", "0.5", "0.000015", "1e-7", "2.5e+25"]
