"""The status page in a real headless Chromium (Debian's `chromium`, which `make test` installs),
driven by Playwright: a real sidecar fed by rank processes pushing over its Unix socket.

Asserted on the page as a person sees it: the grid shows every rank in its state, a rank that
hangs turns stale and a killed one departed without a reload, a rank its world expects and that
never started is a `missing` cell (a whole dp group, a missing group) until it starts, label values with markup are shown
as text (and no script runs from them), the strict Content-Security-Policy blocks nothing the page
needs, it refreshes behind basic auth, and with JavaScript off the server's page reads the same.
Screenshots go to test-artifacts/status-page/ (git-ignored).
"""

from __future__ import annotations

import html
import json
import multiprocessing
import os
import re
import shutil
import signal
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import msgspec
import pytest
from playwright.sync_api import Browser, Page, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from exporter.api import v1
from exporter.client import RankClient
from exporter.sidecar.expose import page
from exporter.sidecar.expose import status as api
from tests.helpers import RawClient, SidecarThread, hello, http_get, sidecar_config, steady_rank, wait_until

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "status-page"
CHROMIUM = shutil.which("chromium")  # Debian's package: /usr/bin/chromium
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HOSTILE = "<img src=x onerror=alert(1)>\"'&amp;"
MODELS = {0: "llama", 1: HOSTILE}  # the `model` static label of each steady dp group
STALE_AFTER = 2.0
PUSH_INTERVAL = 0.2
SPAWN = multiprocessing.get_context("spawn")


def rank_process(socket_path: str, tp: int, pp: int, dp: int, model: str) -> None:
    """A rank moving pages at a steady rate until it is stopped or killed from outside."""
    steady_rank(socket_path, {"tp_rank": tp, "pp_rank": pp, "dp_rank": dp},
                {"cache_type": "UnifiedRadixCache", "model": model}, PUSH_INTERVAL, 0.2, unfulfilled=8)


def rank_id(tp: int, pp: int, dp: int, model: str) -> str:
    """A rank's identity as the page writes it (the document's own ids are short and renumber as ranks come)."""
    return api.identity_text(tp, pp, dp, None, (("cache_type", "UnifiedRadixCache"), ("model", model)))


def group_id(dp: int, model: str) -> str:
    """A group as the page names it: `dp=<n>` and its quoted static labels."""
    return " ".join((f"dp={dp}", *api.quoted_labels((("cache_type", "UnifiedRadixCache"), ("model", model)))))


# A grid's caption, `g<N> <group name>: <live> of <size> live[, <n> missing]`, as the group's name.
GROUP_NAME_JS = "t.dataset.missingGroup || t.querySelector('caption').textContent" \
    ".replace(/^g[0-9]+ /, '').replace(/: [0-9]+ of [0-9]+ live(, [0-9]+ missing)?$/, '')"


def css(value: str) -> str:
    """`value` inside a double-quoted CSS attribute selector."""
    return value.replace("\\", "\\\\").replace('"', '\\"')


@dataclass
class Ranks:
    """Rank processes by their rank id."""

    socket_path: str
    procs: dict[str, Any] = field(default_factory=dict)

    def start(self, tp: int, pp: int, dp: int, model: str) -> str:
        proc = SPAWN.Process(target=rank_process, args=(self.socket_path, tp, pp, dp, model), daemon=True)
        proc.start()
        self.procs[rank_id(tp, pp, dp, model)] = proc
        return rank_id(tp, pp, dp, model)

    def stop_all(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                os.kill(proc.pid, signal.SIGKILL)  # a SIGSTOPped process dies of SIGKILL too
            proc.join(10)


def _sidecar(socket_dir: Path, persistence: dict[str, str] | None = None, **http: Any) -> SidecarThread:
    sections: dict[str, Any] = {"persistence": persistence} if persistence else {}
    return SidecarThread(sidecar_config(socket_dir / "m.sock", ranks={"stale_after_seconds": STALE_AFTER},
                                        http=http, **sections)).start()


@pytest.fixture(scope="module")
def fast_refresh() -> Iterator[None]:
    """The page refreshes every 0.5 s and the bandwidth history takes a point every second."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(page, "REFRESH_MS", 500)
        patch.setattr(api, "HISTORY_INTERVAL_SECONDS", 1.0)
        yield


@pytest.fixture(scope="module")
def module_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:  # short: a Unix socket path
        yield Path(directory)


@pytest.fixture(scope="module")
def fed(fast_refresh: None, module_dir: Path) -> Iterator[tuple[SidecarThread, Ranks]]:
    """A sidecar and 8 steady ranks: tp 2 x pp 2 x dp 2, one dp group with markup in its label."""
    sidecar = _sidecar(module_dir)
    ranks = Ranks(sidecar.socket_path)
    try:
        for dp, model in MODELS.items():
            for pp in range(2):
                for tp in range(2):
                    ranks.start(tp, pp, dp, model)
        yield sidecar, ranks
    finally:
        ranks.stop_all()
        sidecar.stop()


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM, "Chromium is required (Debian package `chromium`; `make test` installs it)"
    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield launched
        finally:
            launched.close()


class Watched:
    """A page with every dialog, page error and console error it raised."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)

    def cells(self) -> dict[str, str]:
        """Grid cells: rank identity (the first line of the cell's title) -> state, as the page shows them now."""
        found = self.page.eval_on_selector_all(
            "td.rank[data-rank]",
            "cells => cells.map(c => [c.title.split('\\n')[0], c.querySelector('.st').textContent, c.className])")
        out = {}
        for rank, state, classes in found:
            assert f"state-{state}" in classes.split(), (rank, state, classes)  # the colour says what the text says
            out[rank] = state
        return out

    def missing(self) -> dict[str, list[str]]:
        """Missing cells by group id ("pp/tp" each), and missing dp groups under their id, as the page shows them."""
        found = self.page.eval_on_selector_all(
            "table.grid", """tables => tables.map(t => [""" + GROUP_NAME_JS + """,
                Array.from(t.querySelectorAll('td.state-missing'), c => [c.dataset.missing || '',
                    (c.querySelector('.st') || c).textContent])])""")
        out: dict[str, list[str]] = {}
        for group, cells in found:
            for position, said in cells:
                assert said.startswith("missing"), (group, position, said)  # the word, not only the colour
                out.setdefault(group, []).append(position or "group")
        return out

    def refreshes(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.refreshes || 0)"))

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _open(browser: Browser, url: str, **context: Any) -> Watched:
    watched = Watched(browser.new_context(viewport={"width": 1400, "height": 1000}, **context).new_page())
    watched.page.goto(url + "/")
    return watched


def _steady_ids() -> set[str]:
    return {rank_id(tp, pp, dp, model) for dp, model in MODELS.items() for pp in range(2) for tp in range(2)}


def test_grid_shows_every_rank_live_and_refreshes(fed: tuple[SidecarThread, Ranks], browser: Browser) -> None:
    sidecar, _ = fed
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: watched.refreshes() >= 2, timeout=20)
        wait_until(lambda: watched.cells() == dict.fromkeys(_steady_ids(), "live"), timeout=20)
        # The grid lays each dp group out as pp rows by tp columns.
        captions = watched.page.locator("table.grid caption").all_inner_texts()
        assert sorted(re.sub("^g[0-9]+ ", "", caption) for caption in captions) == sorted(
            f"{group_id(dp, model)}: 4 of 4 live" for dp, model in MODELS.items())
        for group in watched.page.locator("table.grid").all():
            assert group.locator("thead th").all_inner_texts() == ["", "tp 0", "tp 1"]
            assert group.locator("tbody th").all_inner_texts() == ["pp 0", "pp 1"]
        # Totals, bandwidth with its sparkline, and reasons come from the pushed counters.
        wait_until(lambda: "L" in (watched.page.locator("#bandwidth svg.spark path").first.get_attribute("d") or ""),
                   timeout=20)
        load_back = watched.page.locator("#totals-body tbody tr").first.locator("td").all_inner_texts()
        assert load_back[0] == "load_back" and load_back[1] == "L2 → L1" and load_back[4] != "idle"
        reasons = watched.page.locator("#reasons-body").inner_text()
        assert "storage_prefetch_unfulfilled_tokens_total" in reasons and "host_capacity" in reasons
        health = watched.page.locator("#health-body").inner_text()
        assert "no rejections" in health and "not kept (--persistence.file)" in health  # status.js: stateFile
        watched.screenshot("grid-live")
        assert watched.errors == [] and watched.dialogs == []  # nothing the CSP blocked, no script error
    finally:
        watched.page.context.close()


def test_label_markup_is_shown_as_text(fed: tuple[SidecarThread, Ranks], browser: Browser) -> None:
    sidecar, _ = fed
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: watched.refreshes() >= 2, timeout=20)
        hostile = rank_id(0, 0, 1, HOSTILE)
        wait_until(lambda: hostile in watched.cells(), timeout=20)
        assert watched.page.locator("img").count() == 0  # the markup made no element
        assert hostile in watched.page.locator("#ranks-body").inner_text()  # quoted as in the id: `model="...\\"'..."`
        assert any(group_id(1, HOSTILE) in caption for caption in watched.page.locator("table.grid caption").all_inner_texts())
        seen = watched.refreshes()  # two more refreshes, each rebuilding the DOM from the JSON
        wait_until(lambda: watched.refreshes() >= seen + 2, timeout=20)
        assert watched.page.locator("img").count() == 0
        assert watched.dialogs == [] and watched.errors == []
        watched.screenshot("label-markup")
    finally:
        watched.page.context.close()


def test_hung_rank_turns_stale_and_killed_rank_departs_without_reload(
    fed: tuple[SidecarThread, Ranks], browser: Browser, module_dir: Path,
) -> None:
    sidecar, _ = fed
    ranks = Ranks(sidecar.socket_path)  # a dp group of its own, so the steady ranks stay as they are
    hung, killed = ranks.start(0, 0, 2, "llama"), ranks.start(1, 0, 2, "llama")
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: {k: v for k, v in watched.cells().items() if k in (hung, killed)}
                   == {hung: "live", killed: "live"}, timeout=20)
        watched.page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
        os.kill(ranks.procs[hung].pid, signal.SIGSTOP)  # connected but silent: stale after stale_after_seconds
        os.kill(ranks.procs[killed].pid, signal.SIGKILL)  # its socket closes: departed
        wait_until(lambda: watched.cells().get(killed) == "departed", timeout=20)
        wait_until(lambda: watched.cells().get(hung) == "stale", timeout=20)
        # Stale only once silent for stale_after, as the sidecar's own clock counts the silence from
        # the last push it got (a loaded machine can delay that push well before the SIGSTOP).
        rows = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]
        (hung_row,) = [r for r in rows
                       if (r["tp_rank"], r["pp_rank"], r["dp_rank"], r["labels"].get("model")) == (0, 0, 2, "llama")]
        assert hung_row["status"] == "stale" and hung_row["seconds_since_activity"] >= STALE_AFTER, hung_row
        assert watched.page.evaluate("window.__loadedOnce === true"), "the page reloaded"
        cells = watched.cells()
        assert {rank for rank in _steady_ids() if cells.get(rank) != "live"} == set()
        caption = watched.page.locator("table.grid", has_text="dp=2").locator("caption").inner_text()
        assert caption.endswith(": 0 of 2 live")
        row = watched.page.locator("#ranks-body tr", has_text=hung).locator("td").all_inner_texts()
        assert row[2] == "stale"
        watched.screenshot("stale-and-departed")
        assert watched.errors == []
    finally:
        watched.page.context.close()
        ranks.stop_all()


def test_a_never_started_rank_is_missing_until_it_starts_without_reload(
    fed: tuple[SidecarThread, Ranks], browser: Browser,
) -> None:
    sidecar, _ = fed
    world = {"tp_size": 2, "pp_size": 1, "dp_size": 2}  # said by every rank of model "gaps"; only some start

    def start(tp: int, dp: int, sizes: dict[str, int] = world) -> RankClient:
        client = RankClient(sidecar.socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": dp},
                            labels={"cache_type": "UnifiedRadixCache", "model": "gaps"}, interval=PUSH_INTERVAL,
                            world=sizes, preset=False)
        client.counter("load_back_tokens_total", pool="kv").inc(64)
        return client.start()

    dp0, dp1 = (group_id(dp, "gaps") for dp in range(2))
    clients = [start(0, 0)]
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: watched.missing() == {dp0: ["0/1"], dp1: ["group"]}, timeout=20)
        assert watched.page.locator("p.legend .swatch").all_inner_texts()[-1] == "missing"
        assert watched.page.locator("table.grid[data-group]", has_text=dp0).locator("caption").inner_text().endswith(
            ": 1 of 1 live, 1 missing")
        assert watched.page.locator(f'table[data-missing-group="{css(dp1)}"] caption').inner_text() == f"{dp1}: missing"
        assert ", 3 missing" in watched.page.locator("#summary").inner_text()  # tp 1 of dp 0, dp 1's two positions
        watched.screenshot("missing")
        watched.page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
        clients.append(start(1, 0))  # the rank that was missing starts: its cell turns live
        wait_until(lambda: watched.cells().get(rank_id(1, 0, 0, "gaps")) == "live", timeout=20)
        assert watched.missing() == {dp1: ["group"]}
        clients.append(start(0, 1))  # a rank of the missing group: the group appears, its tp 1 missing
        wait_until(lambda: watched.missing() == {dp1: ["0/1"]}, timeout=20)
        assert ", 1 missing" in watched.page.locator("#summary").inner_text()
        clients.append(start(1, 1, {**world, "tp_size": 4}))  # says another world: nothing can be expected
        warning = watched.page.locator("p.warning.world-conflict")
        wait_until(lambda: warning.count() == 1 and watched.missing() == {}, timeout=20)
        assert warning.inner_text() == (
            "world conflict: the ranks with cache_type=UnifiedRadixCache model=gaps report different parallel "
            "sizes: tp 2 × pp 1 × dp 2 (3 ranks), tp 4 × pp 1 × dp 2 (1 rank); no missing rank can be worked out "
            "for them")
        watched.screenshot("world-conflict")
        assert watched.page.evaluate("window.__loadedOnce === true"), "the page reloaded"
        assert watched.errors == [] and watched.dialogs == []
    finally:
        watched.page.context.close()
        for client in clients:
            client.close()


def test_page_without_javascript_is_readable(fed: tuple[SidecarThread, Ranks], browser: Browser) -> None:
    sidecar, _ = fed
    wait_until(lambda: all(f'title="{html.escape(r)}\n' in http_get(sidecar.url + "/")[1].decode()
                           for r in _steady_ids()), timeout=20)
    watched = _open(browser, sidecar.url, java_script_enabled=False)
    try:
        assert watched.page.locator("#refresh-state").inner_text() == ""  # status.js never ran
        rows = watched.page.locator("#ranks-body tbody tr").all()
        table = {r.locator("td").nth(0).inner_text(): r.locator("td").nth(2).inner_text() for r in rows}
        assert set(table) >= _steady_ids()
        assert set(watched.cells()) >= _steady_ids()
        assert rank_id(0, 0, 1, HOSTILE) in watched.page.locator("#ranks-body").inner_text()
        assert watched.page.locator("img").count() == 0 and watched.dialogs == []
        assert "JavaScript is off" in watched.page.locator("header").inner_text()
        assert watched.page.locator("#totals-body tbody tr").count() == 4
        watched.screenshot("no-javascript")
    finally:
        watched.page.context.close()


def test_page_refreshes_behind_basic_auth(fast_refresh: None, browser: Browser) -> None:
    password = "s3cret"
    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(4)).decode()
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:
        sidecar = _sidecar(Path(directory), basic_auth_users={"admin": hashed})
        ranks = Ranks(sidecar.socket_path)
        try:
            anonymous = browser.new_context().new_page()
            try:  # without credentials Chromium gets a 401 and gives up on the navigation
                with pytest.raises(PlaywrightError, match="ERR_INVALID_AUTH_CREDENTIALS"):
                    anonymous.goto(sidecar.url + "/")
            finally:
                anonymous.context.close()
            only = ranks.start(0, 0, 0, "llama")
            watched = _open(browser, sidecar.url, http_credentials={"username": "admin", "password": password})
            try:
                wait_until(lambda: watched.refreshes() >= 2 and watched.cells() == {only: "live"}, timeout=20)
                assert watched.errors == []
            finally:
                watched.page.context.close()
        finally:
            ranks.stop_all()
            sidecar.stop()


def test_the_state_file_line_is_the_same_from_the_script_and_the_server(fast_refresh: None, browser: Browser) -> None:
    """status.js' stateFile against page.py's state_file, on a sidecar that keeps a state file and wrote it."""
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:
        state = Path(directory) / "state"
        sidecar = _sidecar(Path(directory), persistence={"file": str(state), "interval": "100ms"})
        ranks = Ranks(sidecar.socket_path)
        try:
            ranks.start(0, 0, 0, "llama")
            wait_until(lambda: state.exists(), timeout=20)
            watched = _open(browser, sidecar.url)
            try:
                line = f"{state}: "
                wait_until(lambda: watched.refreshes() >= 1 and line in watched.page.locator("#health-body").inner_text(),
                           timeout=20)
                shown = next(row for row in watched.page.locator("#health-body tr").all_inner_texts() if line in row)
                status, body, _ = http_get(sidecar.url + "/api/v1/status")
                document = msgspec.json.decode(body, type=v1.StatusDocument)
                assert status == 200 and document.sidecar.persistence is not None
                # The script's line matches the server's for the document it read (the write count moves on).
                expected = page.state_file(document.sidecar.persistence)
                assert re.sub("[0-9,]+ writes", "N writes", shown.split("\t")[-1]) == re.sub("[0-9,]+ writes", "N writes",
                                                                                             expected)
                assert watched.errors == []
            finally:
                watched.page.context.close()
        finally:
            ranks.stop_all()
            sidecar.stop()


def test_ranks_on_a_diagonal_claiming_a_huge_world_draw_a_bounded_grid(fast_refresh: None, browser: Browser) -> None:
    """40 hello-only ranks at tp = pp = cp = i that claim a 65,536 x 65,536 world: the script draws the
    sidecar's bounded grid (25 rows of 40 columns, the cut said beside it), not the 40 x 40 x 40 cube,
    and reports the world as a conflict (issue 19, finding 6)."""
    world = {"tp_size": 1 << 16, "pp_size": 1 << 16, "dp_size": 1}
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:
        sidecar = _sidecar(Path(directory))
        clients: list[RawClient] = []
        try:
            for i in range(40):
                client = RawClient(sidecar.socket_path)
                clients.append(client)
                message = hello(tp=i, pp=i, epoch=f"e{i}", cache_type="UnifiedRadixCache", model="diagonal")
                message["rank"]["attn_cp_rank"] = i
                client.send({**message, "world": world})
                assert client.recv() is not None
            watched = _open(browser, sidecar.url)
            try:
                wait_until(lambda: watched.refreshes() >= 1, timeout=20)
                assert watched.page.locator("table.grid td.rank").count() == 25 * 40
                assert watched.page.locator("table.grid tbody tr").count() == 25
                assert watched.page.locator("td.grid-cut").inner_text() == (
                    "drawn: 25 of 40 rows, 40 of 40 tp columns; 15 ranks not drawn (all are under All ranks)")
                assert watched.page.locator("p.warning.world-conflict").inner_text() == (
                    "world conflict: the ranks with cache_type=UnifiedRadixCache model=diagonal report "
                    "tp 65536 × pp 65536 × dp 1 (40 ranks), more positions than the 1,024 rank identities this "
                    "sidecar keeps (ranks.max_ranks); no missing rank can be worked out for them")
                assert watched.page.locator("td.state-missing").count() == 0
                watched.screenshot("bounded-grid")
                assert watched.errors == []
            finally:
                watched.page.context.close()
        finally:
            for client in clients:
                client.close()
            sidecar.stop()
