"""The scraper (exporter.sidecar.upstream.scrape): a read never raises past its loop, a stuck source
starves no other and holds up no exit, redirects keep credentials at their origin, and what an
upstream says never reaches the unauthenticated views.

Upstreams are real aiohttp servers on 127.0.0.1 and real directories (FIFOs included); the
shutdown tests run a real `hicache-exporter serve` process.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from exporter.config import UpstreamConfig, config_from_data
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.upstream import scrape as upstream_scrape
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.scrape import UpstreamScraper
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine, EngineHTTP
from tests.helpers import SidecarThread, free_port, http_get, wait_until

BODY = Engine()
BODY.rank(0, tokens=3, moved=30)
TEXT = BODY.text().encode()

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@asynccontextmanager
async def http_server(handler: Handler, seen: list[web.Request] | None = None) -> AsyncIterator[str]:
    """A real aiohttp server on 127.0.0.1 answering every path with `handler`; its base URL."""

    async def record(request: web.Request) -> web.StreamResponse:
        if seen is not None:
            seen.append(request)
        return await handler(request)

    app = web.Application()
    app.router.add_route("GET", "/{tail:.*}", record)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def answer(body: bytes, content_type: str) -> Handler:
    async def handler(_: web.Request) -> web.StreamResponse:
        return web.Response(body=body, headers={"Content-Type": content_type})
    return handler


def scraper(h: Harness, **config: Any) -> UpstreamScraper:
    upstream = UpstreamConfig.model_validate({"interval_seconds": 60, "timeout_seconds": 2, **config})
    feed = UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""), ())
    return UpstreamScraper(upstream, feed)


def run(coro: Awaitable[Any]) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


@pytest.mark.parametrize("content_type, body, up, errors", [
    ("text/plain; version=0.0.4", TEXT, True, {}),  # no charset: UTF-8
    ("text/plain; charset=iso-8859-1", TEXT.replace(b" tokens\n", b" tok\xe9ns\n"), True, {}),
    ("text/plain; charset=hex", TEXT, False, {"charset": 1}),
    ("text/plain; charset=no-such-thing", TEXT, False, {"charset": 1}),
    ("text/plain; charset=utf-8", TEXT + b"# HELP x \xff\n", False, {"decode": 1}),
    ("text/plain; charset=undefined", TEXT, False, {"decode": 1}),  # a codec that decodes nothing: was `internal`
])
def test_charsets_absent_means_utf8_and_unknown_is_a_read_error(content_type: str, body: bytes, up: bool,
                                                                errors: dict[str, int]) -> None:
    h = Harness()

    async def start_and_stop() -> None:
        async with http_server(answer(body, content_type)) as base:
            s = scraper(h, url=base + "/metrics")
            await s.start()  # the first read is start-up's: it must not raise
            await s.stop()
            assert (s.health.up, s.health.errors) == (up, errors)

    run(start_and_stop())
    assert len(h.state.ranks) == (1 if up else 0)


def test_what_an_upstream_says_is_reduced_to_its_kind_and_line(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness()
    secret = b"AWS_SECRET_ACCESS_KEY=wJalrXUtnFEMI/K7MDENG\n"

    async def read() -> UpstreamScraper:
        async with http_server(answer(TEXT + secret, "text/plain")) as base:
            s = scraper(h, url=base + "/metrics")
            await s.scrape_once()
            return s

    with caplog.at_level(logging.WARNING, "hicache_exporter.upstream"):
        s = run(read())
    line = TEXT.count(b"\n") + 1
    assert s.health.errors == {"parse": 1} and s.health.last_error == f"parse at line {line}"
    assert "wJalrXUtnFEMI" in caplog.text  # the whole text goes to the log only


@pytest.mark.timeout(30)
def test_a_parse_error_quoting_a_line_of_colons_is_looked_for_in_linear_time() -> None:
    """Every colon of the message was tried against the whole text: minutes for a long line of colons."""
    line = "x " + ":" * 200_000
    text = "a 1\n" * 1000 + line + "\n"
    assert upstream_scrape._line_of(text, f"Invalid line: '{line}'") == 1001  # its quotes dropped, found at once
    assert upstream_scrape._line_of(text, "Invalid line: " + "y:" * 100_000) is None  # a few searches, then none


@pytest.mark.parametrize("tail, said", [
    ("\U0001f600".encode() + b"\n", "takes"),  # one emoji: every character of a 16 MiB text in 4 bytes
    (b"", "longer than"),  # an ASCII line of megabytes: the parser copies it several times
])
def test_an_answer_whose_text_costs_more_than_its_bytes_may_is_refused_before_the_parse(tail: bytes, said: str) -> None:
    h = Harness()
    line = b'sglang:m_total{tp_rank="0",pp_rank="0",dp_rank="0",x="' + b"a" * (upstream_scrape.MAX_LINE_CHARS + 1)
    body = TEXT + (b"# HELP f " + b"a" * (len(TEXT) * 2) + tail if said == "takes" else line + b'"} 1\n')

    async def read() -> UpstreamScraper:
        async with http_server(answer(body, "text/plain; charset=utf-8")) as base:
            s = scraper(h, url=base + "/metrics")
            s.max_body_bytes = len(body) + 16  # the bytes fit; the text does not
            await s.scrape_once()
            return s

    s = run(read())
    assert s.health.errors == {"too_large": 1} and not h.state.ranks


def test_redirects_are_not_followed_unless_asked_and_never_to_another_origin() -> None:
    h = Harness()
    seen_a: list[web.Request] = []
    seen_b: list[web.Request] = []

    async def reads() -> dict[str, tuple[bool, dict[str, int], str | None]]:
        out = {}
        async with http_server(answer(TEXT, "text/plain"), seen_b) as other:
            async def origin(request: web.Request) -> web.StreamResponse:
                if request.path == "/here":
                    return web.Response(body=TEXT, headers={"Content-Type": "text/plain"})
                target = "/here" if request.path == "/same" else other + "/secret"
                raise web.HTTPFound(target)

            async with http_server(origin, seen_a) as base:
                auth = {"basic_auth": {"username": "u", "password": "p"}, "headers": {"X-Token": "t"}}
                for name, path, follow in (("off", "/same", False), ("same", "/same", True), ("other", "/other", True)):
                    s = scraper(h, url=base + path, follow_redirects=follow, name=name, **auth)
                    await s.start()
                    await s.stop()
                    out[name] = (s.health.up, s.health.errors, s.health.last_error)
        return out

    out = run(reads())
    assert out == {"off": (False, {"redirect": 1}, "redirect"), "same": (True, {}, None),
                   "other": (False, {"redirect": 1}, "redirect")}
    assert not seen_b  # the other origin never got a request, so neither credentials nor headers
    assert [r.path for r in seen_a] == ["/same", "/same", "/here", "/other"]
    assert all(r.headers.get("Authorization") == "Basic dTpw" and r.headers.get("X-Token") == "t" for r in seen_a)


def test_an_answer_with_more_lines_than_the_cap_is_refused_before_it_is_parsed() -> None:
    h = Harness()

    async def reads() -> UpstreamScraper:
        async with http_server(answer(TEXT, "text/plain")) as base:
            s = scraper(h, url=base + "/metrics")
            s.feed.max_read_samples = 1  # fewer than the text's sample lines
            await s.scrape_once()
            return s

    s = run(reads())
    assert not s.health.up and s.health.errors == {"too_large": 1} and not h.state.ranks


def test_the_caps_follow_the_series_budget_and_a_directory_past_its_cap_is_refused(tmp_path: Path) -> None:
    h = Harness()
    s = scraper(h, multiprocess_dir=str(tmp_path))
    assert (s.feed.max_read_samples, s.max_entries) == (4 * 24576 + 16384, 4 * 24576) == (
        4 * h.state.config.max_series_total + 16384, 4 * h.state.config.max_series_total)
    for pid in ("1", "2"):
        values = MmapedDict(str(tmp_path / f"counter_{pid}.db"))
        values.write_value(mmap_key("sglang:m", "sglang:m_total", ["tp_rank"], [pid], "m"), 1.0, 0.0)
        values.close()
    s.max_entries = 1

    async def read() -> None:
        await s.scrape_once()
        await s.stop()

    run(read())
    assert not s.health.up and s.health.errors == {"too_large": 1} and not h.state.ranks


def test_a_failure_nothing_foresaw_is_counted_as_internal_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h = Harness()
    now = [1000.0]

    async def reads() -> tuple[UpstreamScraper, list[Any]]:
        async with http_server(answer(TEXT, "text/plain")) as base:
            s = scraper(h, url=base + "/metrics")
            s.clock = lambda: now[0]

            async def broken(*_: object) -> None:
                raise RuntimeError("a bug")

            s.feed.apply_async = broken  # type: ignore[assignment,method-assign]
            results = [await s.scrape_once(), await s.scrape_once()]
            now[0] += 60
            results.append(await s.scrape_once())
            return s, results

    with caplog.at_level(logging.WARNING, "hicache_exporter.upstream"):
        s, results = run(reads())
    assert results == [None, None, None] and s.health.errors == {"internal": 3}
    assert [r.exc_info is not None for r in caplog.records] == [True, True]  # the first, then a minute later


def test_a_stuck_read_is_busy_and_starves_no_other_upstream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def stuck(*_: object, **__: object) -> None:
        release.wait()

    for name in ("read_directory", "read_multiprocess_dir"):  # the reader, whatever its name
        monkeypatch.setattr(upstream_scrape, name, stuck, raising=False)
    h = Harness()

    async def reads() -> tuple[UpstreamScraper, UpstreamScraper]:
        try:
            async with http_server(answer(TEXT, "text/plain")) as base:
                stuck_dir = scraper(h, multiprocess_dir=str(tmp_path), timeout_seconds=0.05)
                url = scraper(h, url=base + "/metrics")
                for _ in range(8):  # more than the default thread pool's 6 threads on 2 cores
                    await stuck_dir.scrape_once()
                for _ in range(8):
                    await asyncio.wait_for(url.scrape_once(), 10)
                await stuck_dir.stop()
                await url.stop()
                return stuck_dir, url
        finally:
            release.set()  # before the loop closes: it waits for its default pool's threads

    stuck_dir, url = run(reads())
    assert stuck_dir.health.errors == {"timeout": 1, "busy": 7}
    assert url.health.up and url.health.scrapes == 8 and not url.health.errors


@pytest.mark.timeout(30)  # before the fix, stop() and then asyncio.run's own cleanup waited for ever
def test_stop_ends_the_reads_even_when_a_timeout_swallows_the_cancellation() -> None:
    """A timeout firing as stop() cancels the read turned the cancellation into a counted timeout,
    and the loop read on: stop() waited for ever (a test's teardown hung for 60 s)."""
    h = Harness()
    reads = [0]

    async def swallowing_read() -> None:
        reads[0] += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:  # what a timer that fired at the same instant makes of it
            pass

    async def start_then_stop() -> None:
        s = scraper(h, url="http://127.0.0.1:9/metrics", interval_seconds=0.01, timeout_seconds=0.01)
        s.scrape_once = swallowing_read  # type: ignore[method-assign,assignment]
        s._task = asyncio.create_task(s._loop())
        while reads[0] < 1:
            await asyncio.sleep(0.01)
        await asyncio.wait_for(s.stop(), 10)

    run(start_then_stop())
    assert reads[0] == 1


# --- a real `serve`: SIGTERM exits within seconds whatever a source is doing ---


STUCK = """
import sys, threading
import exporter.sidecar.upstream.scrape as scrape
for name in ("read_directory", "read_multiprocess_dir"):  # a read that never returns, whatever it is called
    if hasattr(scrape, name):
        setattr(scrape, name, lambda *a, **k: threading.Event().wait())
from exporter.cli import main
sys.exit(main())
"""
PLAIN = "import sys\nfrom exporter.cli import main\nsys.exit(main())\n"


@pytest.mark.parametrize("source", ["fifo", "stuck"])
def test_sigterm_stops_serve_within_seconds_whatever_a_source_is_doing(socket_dir: Path, source: str) -> None:
    mp = socket_dir / "mp"
    mp.mkdir()
    os.mkfifo(mp / "counter_1.db")
    port = free_port()
    config = {"http": {"host": "127.0.0.1", "port": port}, "ingest": {"socket_path": str(socket_dir / "run" / "m.sock")},
              "upstreams": [{"multiprocess_dir": str(mp), "interval_seconds": 0.05, "timeout_seconds": 0.05}]}
    (socket_dir / "c.json").write_text(json.dumps(config))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[4])}
    process = subprocess.Popen([sys.executable, "-c", STUCK if source == "stuck" else PLAIN, "serve", "--config",
                                str(socket_dir / "c.json")], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    status = f"http://127.0.0.1:{port}/api/v1/status"

    def read_a_few_times() -> bool:
        assert process.poll() is None, process.stderr.read().decode() if process.stderr else ""
        try:
            (upstream,) = json.loads(http_get(status)[1])["upstreams"]
        except (OSError, ValueError):
            return False
        return sum(upstream["errors"].values()) >= 8  # each read skipped the FIFO, or found the stuck one busy

    try:
        wait_until(read_a_few_times, timeout=20)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=10) == 0  # before: not within 15 s (the reading threads held up exit)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        fd = os.open(mp / "counter_1.db", os.O_RDWR | os.O_NONBLOCK)  # frees any reader still in open()
        os.close(fd)


# --- the fuzz run: a hostile directory beside a healthy upstream ---


def _hostile(rng: random.Random, directory: Path, good: bytes) -> None:
    """One random change to the directory: random bytes, cuts, sizes, names, gauge modes, FIFOs and links."""
    name = rng.choice([f"{kind}_{rng.randint(1, 4)}.db" for kind in ("counter", "histogram", "gauge", "gauge_livesum",
                                                                       "gauge_bogus", "summary", "x")] + ["junk.db"])
    path = directory / name
    if path.is_symlink() or path.exists():
        if path.is_dir() and not path.is_symlink():
            path.rmdir()
        else:
            path.unlink()
    how = rng.choice(["bytes", "cut", "flip", "header", "sparse", "fifo", "link", "dir", "key", "good"])
    if how == "bytes":
        path.write_bytes(rng.randbytes(rng.randint(0, 300)))
    elif how == "cut":
        path.write_bytes(good[:rng.randint(0, len(good))])
    elif how == "flip":
        at = rng.randrange(len(good))
        path.write_bytes(good[:at] + bytes([rng.randrange(256)]) + good[at + 1:])
    elif how == "header":
        path.write_bytes(struct.pack("i", rng.randint(-(1 << 31), (1 << 31) - 1)) + good[4:])
    elif how == "sparse":
        with open(path, "wb") as file:
            file.write(struct.pack("i", rng.choice([(1 << 31) - 1, 40 << 20])))
            file.truncate(1 << 30)
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "link":
        path.symlink_to(rng.choice(["/dev/zero", "/proc/self/mem", str(directory)]))
    elif how == "dir":
        path.mkdir()
    elif how == "key":
        values = MmapedDict(str(path))
        values.write_value(rng.choice(['{"a": 1, "b": 2, "c": 3, "d": 4}', "[1, 2, 3, 4]", '["a", "a", {"le": "x"}, "h"]']),
                           1.0, 0.0)
        values.close()
    else:
        path.write_bytes(good)


def _both_read_again(hostile: UpstreamHealth, hostile_reads: int, healthy: UpstreamHealth, healthy_reads: int) -> bool:
    """The healthy upstream read twice more, and the hostile one once more (a read or a failure)."""
    return healthy.scrapes >= healthy_reads + 2 and hostile.scrapes + sum(hostile.errors.values()) > hostile_reads


def test_a_hostile_directory_never_stops_the_sidecar_or_another_upstreams_reads(socket_dir: Path) -> None:
    mp = socket_dir / "mp"
    mp.mkdir()
    values = MmapedDict(str(mp / "counter_1.db"))
    values.write_value(mmap_key("sglang:load_back_bytes", "sglang:load_back_bytes_total",
                                ["cache_type", "tp_rank", "pp_rank", "dp_rank"], ["c", "5", "0", "0"], "b"), 7.0, 0.0)
    values.close()
    good = (mp / "counter_1.db").read_bytes()[:200]
    engine = Engine()
    engine.rank(0, tokens=1, moved=10)
    http = EngineHTTP(engine)
    config = config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "run" / "m.sock")},
        # Timeouts far above a read's cost: a loaded machine timed a 50 ms one out (`timeout`, then
        # `busy` while that read finished), which is no failure of the sidecar's. 2 s, not 1: the
        # suite's other tests run beside this one (pytest-xdist).
        "upstreams": [{"name": "hostile", "multiprocess_dir": str(mp), "interval_seconds": 2.0, "timeout_seconds": 2.0},
                      {"name": "healthy", "url": http.url, "interval_seconds": 2.0, "timeout_seconds": 2.0}],
    }, "test")
    sidecar = SidecarThread(config).start()
    assert sidecar.sidecar is not None
    # Reads 20 times a second (20 rounds of two reads a second apart took 41 s): the timeouts are
    # at 2 s, and the loop's next wait is the short one (the first, already begun, is the 2 s).
    for running in sidecar.sidecar.upstreams:
        running.interval_seconds = 0.05
    hostile, healthy = (sidecar.sidecar.health.upstreams[name] for name in ("hostile", "healthy"))
    rng = random.Random(19)
    try:
        for _ in range(20):
            _hostile(rng, mp, good)
            hostile_reads = hostile.scrapes + sum(hostile.errors.values())
            healthy_reads = healthy.scrapes
            wait_until(partial(_both_read_again, hostile, hostile_reads, healthy, healthy_reads))
            assert http_get(sidecar.url + "/metrics")[0] == 200
        status = json.loads(http_get(sidecar.url + "/api/v1/status")[1])
    finally:
        sidecar.stop()
        http.stop()
        for path in mp.iterdir():  # frees any reader still in a FIFO's open() (there should be none)
            if path.is_fifo():
                os.close(os.open(path, os.O_RDWR | os.O_NONBLOCK))
    by_name = {u["name"]: u for u in status["upstreams"]}
    assert by_name["healthy"]["up"] and by_name["healthy"]["errors"] == {}
    assert set(by_name["hostile"]["errors"]) <= {"truncated", "corrupt", "too_large", "bad_name", "not_regular"}
    assert "internal" not in by_name["hostile"]["errors"] and "busy" not in by_name["hostile"]["errors"]
