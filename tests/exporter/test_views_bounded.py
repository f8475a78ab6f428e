"""Views are linear in what they show (issue 19, finding 6): the status grid of the page, its script
and `top` draws from one bounded model (api.grid_model, each group's `grid` in the status document).

Ranks at (i, i, i) made every view build the full pp x cp x tp cube: 130 hello-only ranks gave a 71 MB
page (562 MiB at the peak, 2 s of a blocked loop) and a 28.6 MB `top --once` frame (1.6 GiB, 206 s);
40 ranks claiming a 65,536 x 65,536 world a 51.5 MB page. Each test counts what is drawn, exactly.
"""

from __future__ import annotations

import html
import http.server
import io
import json
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from rich.console import Console, RenderableType

from exporter.api import view
from exporter.config import SidecarConfig
from exporter.protocol.messages import Hello, RankId, World
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.expose.page import render_page
from exporter.sidecar.expose.status import StatusView
from exporter.top import render
from exporter.top.fetch import Target, received
from exporter.top.render import render_frame
from exporter.top.view import View
from tests.exporter.sidecar.expose.test_status import assert_valid, typed
from tests.exporter.sidecar.harness import STATIC, Harness
from tests.exporter.sidecar.upstream.test_feed import feed, read

CLI = [sys.executable, "-m", "exporter.cli"]
TARGET = Target(url="http://sidecar:9400", status_url="http://sidecar:9400/api/v1/status")
BIG = World(tp_size=1 << 16, pp_size=1 << 16, dp_size=1)  # within the protocol's bounds; 2**32 positions


def diagonal(h: Harness, n: int, world: World | None = None, labels: dict[str, str] = STATIC) -> None:
    """`n` hello-only ranks at tp = pp = cp = i, in one replica group."""
    for i in range(n):
        msg = Hello(protocol=1, epoch=f"e{i}", pid=1, labels=dict(labels), world=world,
                    rank=RankId(tp_rank=i, pp_rank=i, dp_rank=0, attn_cp_rank=i))
        h.state.hello(object(), msg)


def document(h: Harness) -> tuple[bytes, dict[str, Any]]:
    body = StatusView(SidecarConfig(), h.state, SidecarHealth()).encode()
    doc = json.loads(body)
    assert_valid("status", doc)
    return body, doc


def page_cells(page: str) -> int:
    """Grid cells on the page: a rank's, an absent position's or a missing one's."""
    return page.count('<td class="rank')


def drawn(n: int) -> tuple[int, int]:
    """(rows, cells) the grid draws of `n` ranks on a diagonal: every tp column, as many rows as fit in
    1,024 cells (view.GRID_CELLS_PER_GROUP, written out: the counts are the test's own)."""
    rows = 1024 // n
    return rows, rows * n


def screen_text(renderable: RenderableType, width: int = 200) -> str:
    out = Console(file=io.StringIO(), width=width, color_system=None, record=True)
    out.print(renderable)
    return out.export_text()


def view_of(doc: dict[str, Any]) -> View:
    """A View that polled `doc`, read as top reads a body (decoded into the model)."""
    view = View(TARGET, interval=2.0)
    view.update(received(json.dumps(doc).encode(), TARGET.status_url, at=1_764_400_000.0, seconds=0.01))
    return view


def test_hello_only_ranks_on_a_diagonal_draw_a_bounded_grid() -> None:
    h = Harness()
    diagonal(h, 130)
    body, doc = document(h)
    page = render_page(typed(doc))
    rows, cells = drawn(130)  # 7 rows of 130 columns: 910 cells, where the cube had 130**3
    assert page_cells(page) == cells
    assert len(page.encode()) < 200_000  # 65.5 KB measured (the cube's page: 71 MB)
    assert len(body) < 100_000  # 55 KB: the grid's model adds 7 rows and 130 columns
    ((group,),) = (server["dp_groups"] for server in doc["servers"])
    assert group["grid"] == {
        "rows": [{"pp_rank": i, "attn_cp_rank": i} for i in range(rows)],  # the rows some rank holds
        "tp_ranks": list(range(130)), "row_count": 130, "column_count": 130, "hidden_ranks": 130 - rows,
    }
    assert len(doc["ranks"]) == rows  # the cells listed are the drawn ones: the diagonal's first 7
    assert ("drawn: 7 of 130 rows, 130 of 130 tp columns; 123 ranks not drawn (their streams are under All streams)"
            in html.unescape(page))
    assert page.count('class="state-live"') == 130  # the All ranks table lists every rank


def test_a_world_of_65536_by_65536_is_a_conflict_and_only_its_ranks_are_drawn() -> None:
    h = Harness()
    diagonal(h, 40, BIG)
    body, doc = document(h)
    page = render_page(typed(doc))
    rows, cells = drawn(40)  # 25 rows of 40: no missing position of the claimed world is drawn
    assert page_cells(page) == cells and 'class="rank state-missing"' not in page
    assert len(page.encode()) < 100_000  # 54 KB measured (was 51.5 MB)
    (server,) = doc["servers"]
    assert server["world_conflict"] and server["world_implausible"] and server["expected"] is None
    assert server["missing"] == 0 and doc["totals"]["missing"] == 0
    (group,) = server["dp_groups"]
    assert (group["grid"]["row_count"], len(group["grid"]["rows"]), group["grid"]["hidden_ranks"]) == (40, rows, 40 - rows)
    assert "world conflict" in html.unescape(page) and "ranks.max_ranks" in html.unescape(page)
    assert len(body) < 50_000  # 27 KB: the claimed world's first 1,024 missing positions are no longer listed


def test_an_upstream_with_ranks_on_a_diagonal_draws_the_same_bounded_grid() -> None:
    h = Harness()
    lines = "".join(f'sglang:load_back_bytes_total{{cache_type="UnifiedRadixCache",tp_rank="{i}",pp_rank="{i}",'
                    f'attn_cp_rank="{i}",dp_rank="0"}} 1\n' for i in range(130))
    feed(h).apply(read("# TYPE sglang:load_back_bytes_total counter\n" + lines))
    assert len(h.state.ranks) == 130
    _, doc = document(h)
    page = render_page(typed(doc))
    assert page_cells(page) == drawn(130)[1]
    assert len(page.encode()) < 200_000  # 66 KB measured (was 71 MB)


def test_groups_share_the_documents_cap_on_cells() -> None:
    h = Harness()
    for n in range(5):  # five groups of 40 ranks on a diagonal, 1,000 cells each
        diagonal(h, 40, labels={"cache_type": "c", "model": f"m{n}"})  # five servers
    _, doc = document(h)
    grids = [group["grid"] for server in doc["servers"] for group in server["dp_groups"]]
    # The last group has 96 cells of room left: 2 rows of its 40 columns.
    assert [len(g["rows"]) * len(g["tp_ranks"]) for g in grids] == [1000] * 4 + [80]
    assert [g["hidden_ranks"] for g in grids] == [15] * 4 + [38]
    assert page_cells(render_page(typed(doc))) == 4080 <= view.GRID_CELLS


def test_an_ordinary_layout_is_drawn_whole_as_before() -> None:
    h = Harness()
    for tp in range(2):
        for pp in range(2):
            for cp in range(2):
                h.hello(tp=tp, pp=pp, cp=cp, epoch=f"e{tp}{pp}{cp}")
    h.hello(tp=0, pp=0, cp=0, dp=1, epoch="a")  # a group whose pp 0 cp 1 and pp 1 cp 0 rows no rank holds:
    h.hello(tp=0, pp=1, cp=1, dp=1, epoch="b")  # drawn as before, their cells absent (a cp peer that never came)
    _, doc = document(h)
    every_row = [{"pp_rank": pp, "attn_cp_rank": cp} for pp in range(2) for cp in range(2)]
    whole, sparse = (group["grid"] for server in doc["servers"] for group in server["dp_groups"])
    assert whole == {"rows": every_row, "tp_ranks": [0, 1], "row_count": 4, "column_count": 2, "hidden_ranks": 0}
    assert sparse == {"rows": every_row, "tp_ranks": [0], "row_count": 4, "column_count": 1, "hidden_ranks": 0}
    page = render_page(typed(doc))
    assert page_cells(page) == 8 + 4 and page.count('class="rank absent"') == 2 and "drawn:" not in page


# --- top ----------------------------------------------------------------------------------------


def grid_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if re.match(r"pp[0-9]+ ", line)]


def test_top_draws_the_same_bounded_grid() -> None:
    h = Harness()
    diagonal(h, 40)
    _, doc = document(h)
    text = screen_text(render_frame(view_of(doc)), width=240)  # a row of 40 cells on one line
    rows, _ = drawn(40)
    # Each row's one rank lists its stream (R: a radix stream, by its cache_type).
    assert [line.split() for line in grid_rows(text)] == [
        [f"pp{i}", f"cp{i}", *(word for tp in range(40) for word in ((str(tp), "R") if tp == i else (str(tp),)))]
        for i in range(rows)]
    assert "drawn 25 of 40 rows, 40 of 40 tp columns; 15 ranks not drawn" in text


def test_top_bounds_a_grid_a_document_lists_past_the_caps() -> None:
    h = Harness()
    diagonal(h, 40)
    _, doc = document(h)
    (group,) = doc["servers"][0]["dp_groups"]
    group["grid"]["rows"] = [{"pp_rank": i, "attn_cp_rank": i} for i in range(5000)]  # more than any sidecar sends
    group["grid"]["tp_ranks"] = list(range(5000))
    text = screen_text(render_frame(view_of(doc)), width=200)
    assert sum(line.startswith("pp") for line in text.splitlines()) == 1  # 1,024 columns leave room for one row
    del group["grid"]  # a sidecar from before the grid: not this model's document, refused in one line
    text = screen_text(render_frame(view_of(doc)), width=200)
    assert ("cannot read: Object missing required field `grid` - at `$.servers[0].dp_groups[0]`" in text
            and not grid_rows(text))
    # One bound for the sidecar and top: both read the view model's caps.
    assert render.GRID_CELLS_PER_GROUP is view.GRID_CELLS_PER_GROUP and render.GRID_CELLS is view.GRID_CELLS


class _Serve(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def serving() -> Iterator[tuple[str, type[_Serve]]]:
    handler = type("Handler", (_Serve,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


def test_top_once_prints_a_bounded_frame(serving: tuple[str, type[_Serve]]) -> None:
    url, handler = serving
    h = Harness()
    diagonal(h, 40)
    handler.body, _ = document(h)
    result = subprocess.run([*CLI, "top", "--once", "--url", url], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "COLUMNS": "200"})
    assert result.returncode == 0, result.stderr
    assert len(grid_rows(result.stdout)) == drawn(40)[0]
    assert "drawn 25 of 40 rows, 40 of 40 tp columns; 15 ranks not drawn" in result.stdout
