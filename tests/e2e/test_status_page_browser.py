"""The status page in a real headless Chromium (Debian's `chromium`, which `make test` installs),
driven by Playwright: a real sidecar fed by rank processes pushing over its Unix socket.

Asserted on the page as a person sees it: one cell per rank (position), each listing its streams in
their states; the demo's server (tp 2 × pp 2 × dp 2 under DP attention, its radix, storage and
scheduler streams) is 8 cells and 20 streams; a rank that hangs turns stale and a killed one departed
without a reload; a rank its server's world expects and that never started is a `missing` cell until
it starts; label values with markup are shown as text (and no script runs from them); the script
draws the same DOM as the server; the strict Content-Security-Policy blocks nothing the page needs;
it refreshes behind basic auth; and with JavaScript off the server's page reads the same.
Screenshots go to test-artifacts/status-page/ (git-ignored); with HICACHE_SCREENSHOT=PATH the demo
test also writes the README's screenshot there (`make screenshot`).
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
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import msgspec
import pytest
from playwright.sync_api import Browser, Page, Route, sync_playwright
from playwright.sync_api import Error as PlaywrightError

from exporter.api import v1, view
from exporter.client import RankClient
from exporter.config import RanksConfig, SidecarConfig
from exporter.protocol.messages import World
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.expose import page
from exporter.sidecar.expose import status as api
from exporter.sidecar.expose.status import StatusView
from tests.exporter.sidecar.expose.test_page import RADIX, join
from tests.exporter.sidecar.harness import Harness
from tests.helpers import RawClient, SidecarThread, hello, http_get, sidecar_config, steady_rank, wait_until

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts" / "status-page"
SCREENSHOT_ENV = "HICACHE_SCREENSHOT"  # where the demo test writes the README's screenshot (`make screenshot`)
SCREENSHOT_HISTORY_POINTS = 20  # bandwidth history drawn before the screenshot (a point a second here)
CHROMIUM = shutil.which("chromium")  # Debian's package: /usr/bin/chromium
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
HOSTILE = "<img src=x onerror=alert(1)>\"'&amp;"
MODELS = {0: "llama", 1: HOSTILE}  # the `model` static label of each steady dp group: a server each
STALE_AFTER = 2.0
PUSH_INTERVAL = 0.2
SPAWN = multiprocessing.get_context("spawn")


def rank_process(socket_path: str, tp: int, pp: int, dp: int, model: str) -> None:
    """A rank moving pages at a steady rate until it is stopped or killed from outside."""
    steady_rank(socket_path, {"tp_rank": tp, "pp_rank": pp, "dp_rank": dp},
                {**RADIX, "model": model}, PUSH_INTERVAL, 0.2, unfulfilled=8)


def rank_id(tp: int, pp: int, dp: int, model: str) -> str:
    """A stream's identity as the page writes it (the document's own ids are short and renumber as ranks come)."""
    return view.identity_text(tp, pp, dp, None, (("cache_type", "UnifiedRadixCache"), ("model", model)))


def server_name(model: str) -> str:
    """A server as the page names it: its quoted static labels (the radix stream's cache_type is not one)."""
    return " ".join(view.quoted_labels((("model", model),)))


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


# The demo's server (`make demo`: tp 2 per dp group under DP attention, pp 2, dp 2) as the engine's
# collectors label it (cache_core/parallel.py): a radix and a storage stream per rank at its attention tp
# rank, and a scheduler stream on attention-tp-0 ranks at the engine's global tp rank.
DEMO_WORLD = {"tp_size": 4, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1}
DEMO_POSITIONS = [(dp, pp, tp) for dp in range(2) for pp in range(2) for tp in range(2)]
STORAGE = {"storage_backend": "file", "pp_size": "2", "attn_cp_size": "1"}
SCHEDULER = {"model_name": "demo-model", "engine_type": "unified", "moe_ep_rank": "0"}
DEMO_PREFILL = {"device_hit": 96, "host_hit": 48, "storage_hit": 16, "input": 32}  # tokens per unit of load
DEMO_SHARES = "device 50 % · host 25 % · storage 8 % · computed 17 %"


def demo_cell(dp: int, pp: int, tp: int) -> str:
    """A demo rank's cell as the page's data-rank writes it, less its server id."""
    return f"dp={dp},pp={pp},cp=0,tp={tp}"


def demo_streams(tp: int) -> list[str]:
    """What a demo rank's cell lists: radix and storage, and the scheduler at attention tp 0."""
    return ["radix live", "storage live"] + (["scheduler live"] if tp == 0 else [])


class Demo:
    """The demo's server pushing through real RankClients, a rank at a time, with steady traffic."""

    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path
        self.clients: list[RankClient] = []
        self.steps: list[Callable[[int], object]] = []
        self.lock = threading.Lock()
        self.stopping = threading.Event()
        self.feeder = threading.Thread(target=self._feed, daemon=True)
        self.feeder.start()

    def _client(self, rank: dict[str, int], labels: dict[str, str]) -> RankClient:
        return RankClient(self.socket_path, rank=rank, labels=labels, interval=PUSH_INTERVAL, world=DEMO_WORLD,
                          preset=False)

    def start(self, dp: int, pp: int, tp: int) -> None:
        """One rank's streams: its radix and storage collectors, and its scheduler at attention tp 0."""
        radix = self._client({"tp_rank": tp, "pp_rank": pp, "dp_rank": dp}, RADIX)
        storage = self._client({"tp_rank": tp, "pp_rank": pp, "dp_rank": dp, "attn_cp_rank": 0}, STORAGE)
        loaded, moved, took = (radix.counter("load_back_tokens_total", pool="kv"),
                               radix.counter("load_back_bytes_total"), radix.histogram("load_back_duration_seconds"))
        backed, backed_bytes, backup_took = (radix.counter("hicache_backup_tokens_total", pool="kv"),
                                             radix.counter("hicache_backup_bytes_total"),
                                             radix.histogram("hicache_backup_duration_seconds"))
        missed = storage.counter("storage_prefetch_unfulfilled_tokens_total", reason="host_capacity")
        prefetched, fetched, fetch_took = (storage.counter("prefetched_tokens_total"),
                                           storage.counter("storage_prefetch_bytes_total"),
                                           storage.histogram("storage_prefetch_duration_seconds"))
        stored, stored_bytes, store_took = (storage.counter("backuped_tokens_total"),
                                            storage.counter("storage_backup_bytes_total"),
                                            storage.histogram("storage_backup_duration_seconds"))

        def step(load: int) -> None:
            loaded.inc(64 * load)
            moved.inc(64 * load * 4096)
            took.observe(0.002)
            backed.inc(48 * load)
            backed_bytes.inc(48 * load * 4096)
            backup_took.observe(0.003)
            missed.inc(8 * load)
            prefetched.inc(32 * load)
            fetched.inc(32 * load * 4096)
            fetch_took.observe(0.004)
            stored.inc(16 * load)
            stored_bytes.inc(16 * load * 4096)
            store_took.observe(0.008)

        clients = [radix, storage]
        steps = [step]
        if tp == 0:
            scheduler = self._client({"tp_rank": dp * DEMO_WORLD["attn_tp_size"] + tp, "pp_rank": pp, "dp_rank": dp},
                                     SCHEDULER)
            scheduler.gauge("hicache_host_total_tokens").set(65536)
            used = scheduler.gauge("hicache_host_used_tokens")
            # Tokens by tier in fixed proportions: device 50 %, host 25 %, storage 8 %, computed 17 %.
            prefilled = [(scheduler.counter("prefill_effective_tokens_total", mode=mode), per_load)
                         for mode, per_load in DEMO_PREFILL.items()]
            clients.append(scheduler)
            steps.append(lambda load: (used.set(4096 + 64 * load),
                                       [counter.inc(per_load * load) for counter, per_load in prefilled]))
        for client in clients:
            client.start()
        with self.lock:
            self.clients += clients
            self.steps += steps

    def _feed(self) -> None:
        tick = 0
        while not self.stopping.wait(0.05):  # a rate of traffic, not a wait for anything
            tick += 1
            load = 1 + tick // 20 % 4  # rising and falling every few seconds: the sparklines have a shape
            with self.lock:
                steps = list(self.steps)
            for step in steps:
                step(load)

    def close(self) -> None:
        self.stopping.set()
        self.feeder.join(10)
        for client in self.clients:
            client.close()


@pytest.fixture
def demo(fast_refresh: None) -> Iterator[tuple[SidecarThread, Demo]]:
    """A sidecar of its own (the header's counts are the demo's) and the demo's server, no rank started yet."""
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:
        sidecar = _sidecar(Path(directory))
        server = Demo(sidecar.socket_path)
        try:
            yield sidecar, server
        finally:
            server.close()
            sidecar.stop()


class Watched:
    """A page with every dialog, page error and console error it raised."""

    def __init__(self, page: Page) -> None:
        self.page = page
        self.dialogs: list[str] = []
        self.errors: list[str] = []
        page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        page.on("pageerror", lambda error: self.errors.append(str(error)))
        page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)

    def cells(self) -> dict[tuple[str, str], tuple[str, list[str]]]:
        """Rank cells as the page shows them now: (server name, `dp=..,pp=..,cp=..,tp=..`) -> (state, the
        stream lines it lists)."""
        found = self.page.eval_on_selector_all("td.rank[data-rank]", """cells => cells.map(c => [
            c.closest('div.server').querySelector('.server-name').textContent, c.dataset.rank.replace(/^v[0-9]+\\//, ''),
            c.querySelector('.st').textContent, c.className,
            Array.from(c.querySelectorAll('.stream'), s => [s.textContent, s.className])])""")
        out = {}
        for server, position, state, classes, streams in found:
            assert f"state-{state}" in classes.split(), (position, state, classes)  # the colour says what the text says
            for line, stream_classes in streams:
                assert f"stream state-{line.split()[-1]}" == stream_classes, (position, line, stream_classes)
            out[(server, position)] = (state, [line for line, _ in streams])
        return out

    def streams(self) -> dict[str, str]:
        """Streams listed in the cells: full identity (the first line of the line's tooltip) -> state."""
        found = self.page.eval_on_selector_all(
            "td.rank .stream", "lines => lines.map(s => [s.title.split('\\n')[0], s.textContent])")
        return {identity: line.split()[-1] for identity, line in found}

    def missing(self) -> set[tuple[str, str]]:
        """The cells that say missing, by (server name, position)."""
        return {key for key, (state, _) in self.cells().items() if state == "missing"}

    def header(self) -> str:
        return self.page.locator("#summary").inner_text()

    def refreshes(self) -> int:
        return int(self.page.evaluate("Number(document.body.dataset.refreshes || 0)"))

    def screenshot(self, name: str) -> None:
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        self.page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def _open(browser: Browser, url: str, width: int = 1400, **context: Any) -> Watched:
    watched = Watched(browser.new_context(viewport={"width": width, "height": 1000}, **context).new_page())
    watched.page.goto(url + "/")
    return watched


def _steady_ids() -> set[str]:
    return {rank_id(tp, pp, dp, model) for dp, model in MODELS.items() for pp in range(2) for tp in range(2)}


def _steady_cells() -> dict[tuple[str, str], tuple[str, list[str]]]:
    return {(server_name(model), f"dp={dp},pp={pp},cp=0,tp={tp}"): ("live", ["radix live"])
            for dp, model in MODELS.items() for pp in range(2) for tp in range(2)}


def test_grid_shows_every_rank_live_and_refreshes(fed: tuple[SidecarThread, Ranks], browser: Browser) -> None:
    sidecar, _ = fed
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: watched.refreshes() >= 2, timeout=20)
        wait_until(lambda: watched.cells() == _steady_cells(), timeout=20)
        assert watched.streams() == dict.fromkeys(_steady_ids(), "live")
        # A server per model label, each one dp group laid out as pp rows by tp columns.
        names = watched.page.locator("div.server h3").all_inner_texts()
        assert sorted(names) == sorted(f"{server_name(model)} · no world reported" for model in MODELS.values())
        captions = watched.page.locator("table.grid caption").all_inner_texts()
        assert sorted(captions) == [f"dp {dp}: 4 of 4 ranks live" for dp in MODELS]
        for group in watched.page.locator("table.grid").all():
            assert group.locator("thead th").all_inner_texts() == ["", "tp 0", "tp 1"]
            assert group.locator("tbody th").all_inner_texts() == ["pp 0", "pp 1"]
        assert watched.header().startswith("ready · 8 ranks, 8 streams · ranks: 8 live · streams: 8 live · up ")
        # Totals, bandwidth with its sparkline, and reasons come from the pushed counters.
        wait_until(lambda: "L" in (watched.page.locator("#bandwidth svg.spark path").first.get_attribute("d") or ""),
                   timeout=20)
        load_back = watched.page.locator("#totals-body tbody tr").first.locator("td").all_inner_texts()
        assert load_back[0] == "load_back" and load_back[1] == "L2 → L1" and load_back[4] != "idle"
        reasons = watched.page.locator("#reasons-body").inner_text()
        assert "storage_prefetch_unfulfilled_tokens_total" in reasons and "host_capacity" in reasons
        health = watched.page.locator("#health-body").inner_text()
        assert "no rejections" in health and "not kept (--persistence.file)" in health  # after a refresh
        watched.screenshot("grid-live")
        assert watched.errors == [] and watched.dialogs == []  # nothing the CSP blocked, no script error
    finally:
        watched.page.context.close()


def test_the_demo_server_is_8_rank_cells_each_listing_its_streams(demo: tuple[SidecarThread, Demo],
                                                                   browser: Browser) -> None:
    """`make demo`'s server: 20 streams (radix and storage per rank, scheduler per dp group and pp stage)
    are 8 ranks, one cell each, in one server's grid per dp group. With HICACHE_SCREENSHOT set, the
    README's screenshot is taken here."""
    sidecar, server = demo
    for position in DEMO_POSITIONS:
        server.start(*position)
    watched = _open(browser, sidecar.url, width=1280)
    try:
        expected = {("server", demo_cell(dp, pp, tp)): ("live", demo_streams(tp)) for dp, pp, tp in DEMO_POSITIONS}
        wait_until(lambda: watched.refreshes() >= 1 and watched.cells() == expected, timeout=30)
        assert watched.page.locator("td.rank").count() == 8
        assert watched.page.locator("td.rank .stream").count() == 20
        header = watched.header()
        assert header.startswith("ready · 8 ranks, 20 streams · ranks: 8 live · streams: 20 live · up "), header
        assert watched.page.locator("div.server h3").all_inner_texts() == ["server · dp 2 × pp 2 × tp 2"]
        assert watched.page.locator("p.server-counts").inner_text() == "8 ranks, 20 streams; 8 live"
        assert watched.page.locator("table.grid caption").all_inner_texts() == [
            "dp 0: 4 of 4 ranks live", "dp 1: 4 of 4 ranks live"]
        # A stream's full identity is its line's tooltip: the scheduler of dp 1 labels global tp 2.
        scheduler = view.identity_text(2, 1, 1, None, tuple(sorted(SCHEDULER.items())))
        cell = watched.page.locator(f'td.rank[data-rank$="/{demo_cell(1, 1, 0)}"]')
        assert cell.locator(".stream").nth(2).get_attribute("title").startswith(f"{scheduler}\nstate live, last push ")
        assert watched.page.locator("#streams-body tbody tr").count() == 20
        assert "20 live" in watched.page.locator("#health-body").inner_text()
        wait_until(lambda: "L" in (watched.page.locator("#bandwidth svg.spark path").first.get_attribute("d") or ""),
                   timeout=20)
        # The first section: each tier's share beside its name, a stacked bar, the cost per hit token.
        assert watched.page.locator("main section").first.get_attribute("id") == "prefill"
        shares = watched.page.locator("#prefill .shares-text")
        wait_until(lambda: shares.inner_text() == DEMO_SHARES, timeout=20)
        assert watched.page.locator("#prefill svg.shares rect").count() == 4
        rows = watched.page.locator("#prefill-body table").first.locator("tbody tr")
        assert rows.nth(0).locator("td").all_inner_texts()[:2] == ["device", "50 %"]
        assert rows.nth(1).locator("td").nth(3).inner_text().startswith("load back ")  # the demo loads back
        watched.screenshot("demo")
        target = os.environ.get(SCREENSHOT_ENV)
        if target:  # the README's screenshot: the first screen as a person opens it, sparklines drawn out
            wait_until(lambda: watched.page.locator("#bandwidth svg.spark path").first.get_attribute("d").count("L")
                       >= SCREENSHOT_HISTORY_POINTS, timeout=SCREENSHOT_HISTORY_POINTS * 3)
            watched.page.screenshot(path=str(REPO / target), full_page=False)
        assert watched.errors == [] and watched.dialogs == []
    finally:
        watched.page.context.close()


def test_a_demo_rank_that_never_started_is_missing_until_it_starts(demo: tuple[SidecarThread, Demo],
                                                                   browser: Browser) -> None:
    sidecar, server = demo
    late = (1, 1, 0)  # dp 1, pp 1, attention tp 0: its radix, storage and scheduler streams
    for position in DEMO_POSITIONS:
        if position != late:
            server.start(*position)
    watched = _open(browser, sidecar.url)
    try:
        key = ("server", demo_cell(*late))
        wait_until(lambda: watched.refreshes() >= 1 and watched.page.locator("td.rank .stream").count() == 17, timeout=30)
        assert watched.missing() == {key}
        assert watched.cells()[key] == ("missing", [])
        missing = watched.page.locator(f'td.rank[data-rank$="/{demo_cell(*late)}"]')
        assert missing.get_attribute("title") == (
            "dp 1 pp 1 cp 0 tp 0 of server: missing, expected by the server's world, no unexpired stream reports for it")
        assert watched.header().startswith("ready · 7 ranks, 17 streams · ranks: 7 live, 1 missing · streams: 17 live")
        assert watched.page.locator("table.grid caption").all_inner_texts() == [
            "dp 0: 4 of 4 ranks live", "dp 1: 3 of 3 ranks live, 1 missing"]
        assert watched.page.locator("p.legend .swatch").all_inner_texts()[-1] == "missing"
        watched.screenshot("demo-missing")
        watched.page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
        server.start(*late)
        wait_until(lambda: watched.cells().get(key) == ("live", demo_streams(0)), timeout=30)
        assert watched.missing() == set()
        wait_until(lambda: watched.header().startswith("ready · 8 ranks, 20 streams · ranks: 8 live · streams: 20 live"),
                   timeout=20)
        assert watched.page.evaluate("window.__loadedOnce === true"), "the page reloaded"
        assert watched.errors == [] and watched.dialogs == []
    finally:
        watched.page.context.close()


SECTION_HTML_JS = """() => Object.fromEntries(
    Array.from(document.querySelectorAll('main .body'), b => [b.id, b.innerHTML]).concat(
    ['summary', 'updated', 'version'].map(id => [id, document.getElementById(id).innerHTML])))"""


def drawn_both_ways(browser: Browser, url: str, body: bytes) -> tuple[dict[str, str], dict[str, str]]:
    """A status document as page.py renders it (JavaScript off) and as status.js swaps it in on a refresh (the
    page and every refresh get this one document; the script and style sheet come from the sidecar at `url`):
    each section's and the header's markup, as the browser serializes it."""
    served = page.render_page(msgspec.json.decode(body, type=v1.StatusDocument))

    def fixed(route: Route) -> None:
        if route.request.url.endswith("/api/v1/status"):
            route.fulfill(status=200, content_type="application/json; charset=utf-8", body=body)
        else:
            route.fulfill(status=200, content_type="text/html; charset=utf-8", body=served)

    drawn = {}
    for script in (False, True):
        context = browser.new_context(java_script_enabled=script)
        tab = Watched(context.new_page())
        try:
            tab.page.route(re.compile(r".*/(api/v1/status)?$"), fixed)
            tab.page.goto(url + "/")
            if script:
                wait_until(lambda: tab.refreshes() >= 1, timeout=20)  # noqa: B023 (called within the iteration)
            drawn[script] = tab.page.evaluate(SECTION_HTML_JS)
            assert tab.errors == [] and tab.dialogs == []
        finally:
            context.close()
    assert set(drawn[False]) == {f"{name}-body" for name, _, _ in page.SECTIONS} | {"summary", "updated", "version"}
    return drawn[False], drawn[True]


def upstream_rows() -> list[dict[str, Any]]:
    """Two upstreams as the document lists them: one with a configured world its engine's labels contradict
    (markup in a problem, to stay text), one down with none."""
    common = {"last_scrape_time": None, "last_scrape_duration_seconds": None, "pass_through_families": 0,
              "errors": {}, "unranked_families": [], "cp_colliding_families": []}
    return [
        {**common, "name": "engine-0", "source": "http://127.0.0.1:30000/metrics", "up": True, "samples": 10,
         "scrapes": 3, "ranks": 2, "last_error": None,
         "world": {"tp_size": 4, "pp_size": 2, "dp_size": 1, "attn_tp_size": 4, "attn_cp_size": 1},
         "world_problems": [f"pp_size {HOSTILE} on the storage series, 2 configured"]},
        {**common, "name": "engine-1", "source": "/tmp/multiproc", "up": False, "samples": 0, "scrapes": 0,
         "ranks": 0, "last_error": "connection refused", "world": None, "world_problems": []},
    ]


def test_the_script_draws_the_same_dom_as_the_server(demo: tuple[SidecarThread, Demo], browser: Browser) -> None:
    """The demo's server with a rank missing and traffic in every section that has numbers, with upstreams;
    then servers with a world conflict, an implausible world, ranks outside their world, a node's share, a cut
    grid and a hostile label; then no rank at all: each document is the same markup from both."""
    sidecar, server = demo
    for position in DEMO_POSITIONS[:-1]:
        server.start(*position)
    wait_until(lambda: json.loads(http_get(sidecar.url + "/api/v1/status")[1])["totals"]["streams"] == 18, timeout=30)
    wait_until(lambda: any(len(f["history"]) >= 2 for f in
                           json.loads(http_get(sidecar.url + "/api/v1/status")[1])["bandwidth"]["families"]), timeout=20)
    live = {**json.loads(http_get(sidecar.url + "/api/v1/status")[1]), "upstreams": upstream_rows()}
    h = Harness(ranks_config=RanksConfig(nodes=2, node_rank=1, max_ranks=256))
    join(h, 2, labels={**RADIX, "model": "shared"}, world=World(tp_size=4, pp_size=1, dp_size=1))
    join(h, 0, labels={**RADIX, "model": "shared"}, world=World(tp_size=4, pp_size=1, dp_size=1))  # node 0's
    join(h, 0, labels={**RADIX, "model": HOSTILE}, world=World(tp_size=2, pp_size=1, dp_size=1))
    join(h, 1, labels={**RADIX, "model": HOSTILE}, world=World(tp_size=4, pp_size=1, dp_size=1))
    join(h, 0, labels={**RADIX, "model": "huge"}, world=World(tp_size=1 << 16, pp_size=1 << 16, dp_size=1))
    for i in range(40):
        join(h, i, pp=i, cp=i, labels={**RADIX, "model": "diagonal"})
    made, empty = (StatusView(SidecarConfig(), state, SidecarHealth()).encode() for state in (h.state, Harness().state))
    # What each document was made to have, as the server draws it.
    assert 'class="rank state-missing"' in page.render_page(msgspec.convert(live, v1.StatusDocument))
    marked = page.render_page(msgspec.json.decode(made, type=v1.StatusDocument))
    for needle in ('class="warning world-conflict"', 'class="note node-share"', 'class="note grid-cut"', " unexpected",
                   "more positions than", 'class="rank state-missing"'):
        assert needle in marked, needle
    for body in (json.dumps(live).encode(), made, empty):
        server_side, script_side = drawn_both_ways(browser, sidecar.url, body)
        assert {k: v for k, v in script_side.items() if v != server_side[k]} == {}


def test_label_markup_is_shown_as_text(fed: tuple[SidecarThread, Ranks], browser: Browser) -> None:
    sidecar, _ = fed
    watched = _open(browser, sidecar.url)
    try:
        wait_until(lambda: watched.refreshes() >= 2, timeout=20)
        hostile = rank_id(0, 0, 1, HOSTILE)
        wait_until(lambda: hostile in watched.streams(), timeout=20)
        assert watched.page.locator("img").count() == 0  # the markup made no element
        assert hostile in watched.page.locator("#streams-body").inner_text()  # quoted as in the id: `model="...\\"'..."`
        assert server_name(HOSTILE) in watched.page.locator("span.server-name").all_inner_texts()
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
        wait_until(lambda: {k: v for k, v in watched.streams().items() if k in (hung, killed)}
                   == {hung: "live", killed: "live"}, timeout=20)
        watched.page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
        os.kill(ranks.procs[hung].pid, signal.SIGSTOP)  # connected but silent: stale after stale_after_seconds
        os.kill(ranks.procs[killed].pid, signal.SIGKILL)  # its socket closes: departed
        wait_until(lambda: watched.streams().get(killed) == "departed", timeout=20)
        wait_until(lambda: watched.streams().get(hung) == "stale", timeout=20)
        # Stale only once silent for stale_after, as the sidecar's own clock counts the silence from
        # the last push it got (a loaded machine can delay that push well before the SIGSTOP).
        rows = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]
        (hung_row,) = [r for r in rows
                       if (r["tp_rank"], r["pp_rank"], r["dp_rank"], r["labels"].get("model")) == (0, 0, 2, "llama")]
        assert hung_row["status"] == "stale" and hung_row["seconds_since_activity"] >= STALE_AFTER, hung_row
        assert watched.page.evaluate("window.__loadedOnce === true"), "the page reloaded"
        cells = watched.cells()
        assert {key: cells.get(key) for key in _steady_cells()} == _steady_cells()
        llama = server_name("llama")
        assert cells[(llama, "dp=2,pp=0,cp=0,tp=0")] == ("stale", ["radix stale"])
        assert cells[(llama, "dp=2,pp=0,cp=0,tp=1")] == ("departed", ["radix departed"])
        block = watched.page.locator("div.server", has=watched.page.locator("span.server-name", has_text=llama))
        assert block.locator('table.grid[data-dp="2"] caption').inner_text() == "dp 2: 0 of 2 ranks live"
        row = watched.page.locator("#streams-body tr", has_text=hung).locator("td").all_inner_texts()
        assert row[1:2] + row[3:4] == ["radix", "stale"]
        watched.screenshot("stale-and-departed")
        assert watched.errors == []
    finally:
        watched.page.context.close()
        ranks.stop_all()


def test_a_never_started_rank_is_missing_until_it_starts_without_reload(
    fed: tuple[SidecarThread, Ranks], browser: Browser,
) -> None:
    sidecar, _ = fed
    world = {"tp_size": 2, "pp_size": 1, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1}  # of model "gaps"

    def start(tp: int, dp: int, sizes: dict[str, int] = world) -> RankClient:
        client = RankClient(sidecar.socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": dp},
                            labels={**RADIX, "model": "gaps"}, interval=PUSH_INTERVAL, world=sizes, preset=False)
        client.counter("load_back_tokens_total", pool="kv").inc(64)
        return client.start()

    gaps = server_name("gaps")
    clients = [start(0, 0)]
    watched = _open(browser, sidecar.url)
    try:
        # dp 1 has no stream at all: a grid of missing cells all the same.
        wait_until(lambda: watched.missing() == {(gaps, "dp=0,pp=0,cp=0,tp=1"), (gaps, "dp=1,pp=0,cp=0,tp=0"),
                                                 (gaps, "dp=1,pp=0,cp=0,tp=1")}, timeout=20)
        block = watched.page.locator("div.server", has=watched.page.locator("span.server-name", has_text=gaps))
        assert block.locator("h3").inner_text() == f"{gaps} · dp 2 × pp 1 × tp 2"
        assert block.locator("table.grid caption").all_inner_texts() == [
            "dp 0: 1 of 1 rank live, 1 missing", "dp 1: 0 of 0 ranks live, 2 missing"]
        assert "ranks: 9 live, 3 missing" in watched.header()  # the 8 steady ranks, gaps' one; gaps' three
        watched.screenshot("missing")
        watched.page.evaluate("window.__loadedOnce = true")  # gone if the page reloads
        clients.append(start(1, 0))  # the rank that was missing starts: its cell turns live
        wait_until(lambda: watched.cells().get((gaps, "dp=0,pp=0,cp=0,tp=1")) == ("live", ["radix live"]), timeout=20)
        assert watched.missing() == {(gaps, "dp=1,pp=0,cp=0,tp=0"), (gaps, "dp=1,pp=0,cp=0,tp=1")}
        clients.append(start(0, 1))
        wait_until(lambda: watched.missing() == {(gaps, "dp=1,pp=0,cp=0,tp=1")}, timeout=20)
        assert ", 1 missing" in watched.header()
        clients.append(start(1, 1, {**world, "tp_size": 4, "attn_tp_size": 4}))  # another world: nothing expected
        warning = block.locator("p.warning.world-conflict")
        wait_until(lambda: warning.count() == 1 and watched.missing() == set(), timeout=20)
        assert warning.inner_text() == (
            "world conflict: the streams of this server report different worlds: dp 2 × pp 1 × tp 2 (3 streams), "
            "dp 2 × pp 1 × tp 4 (1 stream); no missing rank can be worked out for it")
        assert block.locator("h3").inner_text() == f"{gaps} · world conflict"
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
        rows = watched.page.locator("#streams-body tbody tr").all()
        table = {r.locator("td").nth(0).inner_text(): r.locator("td").nth(3).inner_text() for r in rows}
        assert set(table) >= _steady_ids()
        assert set(watched.streams()) >= _steady_ids()
        cells = watched.cells()
        assert {key: cells.get(key) for key in _steady_cells()} == _steady_cells()
        assert rank_id(0, 0, 1, HOSTILE) in watched.page.locator("#streams-body").inner_text()
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
                wait_until(lambda: watched.refreshes() >= 2 and watched.streams() == {only: "live"}, timeout=20)
                assert watched.errors == []
            finally:
                watched.page.context.close()
        finally:
            ranks.stop_all()
            sidecar.stop()


def test_the_state_file_line_is_the_same_from_the_script_and_the_server(fast_refresh: None, browser: Browser) -> None:
    """The refreshed page's state file line against page.py's state_file, on a sidecar that keeps a state file and wrote it."""
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
    and reports the world as a conflict."""
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
                    "drawn: 25 of 40 rows, 40 of 40 tp columns; 15 ranks not drawn (their streams are under All streams)")
                assert watched.page.locator("p.warning.world-conflict").inner_text() == (
                    "world conflict: the streams of this server report dp 1 × pp 65536 × tp 65536 (40 streams), more "
                    "positions than the 1,024 rank identities this sidecar keeps (ranks.max_ranks); no missing rank "
                    "can be worked out for it")
                assert watched.page.locator("td.state-missing").count() == 0
                watched.screenshot("bounded-grid")
                assert watched.errors == []
            finally:
                watched.page.context.close()
        finally:
            for client in clients:
                client.close()
            sidecar.stop()
