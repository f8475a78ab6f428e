"""The proxy's reads: each upstream read on an interval (HTTP or its multiprocess directory) and handed to its feed.

Reading a source never raises past its loop: every failure is counted on its health by kind, logged
at most once a minute per upstream and kind, and stops neither the sidecar nor another upstream.
Each source's blocking work (its files, its parse) runs on its own daemon thread, one read at a
time: a read stuck in the kernel starves no other source, holds up no exit, and while it is stuck
the next reads are counted as `busy` rather than piling up threads.
"""

from __future__ import annotations

import asyncio
import codecs
import concurrent.futures
import logging
import re
import ssl
import sys
import time
from collections.abc import AsyncIterator, Callable
from itertools import islice
from pathlib import Path
from typing import TypeVar

import aiohttp
from aiohttp.helpers import parse_mimetype
from yarl import URL

from exporter.config import UpstreamConfig
from exporter.errors import ConfigError
from exporter.log_throttle import LogThrottle
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.files import Skipped, TooLarge, read_directory
from exporter.sidecar.upstream.plan import FeedResult, PlannedRead
from exporter.sidecar.worker import WorkerThread

log = logging.getLogger("hicache_exporter.upstream")
T = TypeVar("T")


# An upstream's answer is read up to this size: about 4 times what a 256-rank engine writes
# (BENCHMARKS.md, The proxy rows), as the feed's sample-line cap is, so that a runaway or hostile
# upstream cannot fill the pod (the answer is held twice at most: its bytes, then its text).
MAX_BODY_BYTES = 16 << 20
LOG_EVERY_SECONDS = 60.0  # one log line per upstream and error kind at most this often
ENTRIES_PER_SERIES = 4  # a directory read's entries, per series of the sidecar's budget
MAX_REDIRECTS = 5  # same-origin hops followed with follow_redirects: true
LINE_OF_TRIES, LINE_OF_CHARS = 3, 200  # how a parse error's line is looked for (see _line_of)
# The longest line a text may have: an engine's lines are well under a kilobyte, and the parser
# copies a line several times over, so one line of megabytes costs several times its size.
MAX_LINE_CHARS = 1 << 16
_LONG_LINE = re.compile(f"(?m)^[^\\n]{{{MAX_LINE_CHARS + 1}}}")  # anchored at line starts: linear
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


def client_ssl_context(config: UpstreamConfig) -> ssl.SSLContext | None:
    tls = config.tls
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if tls.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class UpstreamScraper:
    """Reads one upstream every `interval_seconds` and applies what it read to the state."""

    def __init__(self, config: UpstreamConfig, feed: UpstreamFeed) -> None:
        self.config = config
        self.feed = feed
        self.health = feed.health
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self.max_body_bytes = MAX_BODY_BYTES
        # A text's sample lines are bounded by the feed before it parses (UpstreamFeed.max_read_samples);
        # a directory's entries cost 2 KiB each in prometheus_client's reader, so they get 4 per
        # series of max_series_total (98,304: 3 times a 256-rank engine), counted as they are read.
        self.max_entries = ENTRIES_PER_SERIES * feed.state.config.max_series_total
        self.clock: Callable[[], float] = time.monotonic
        self.interval_seconds = config.interval_seconds  # the wait between reads (a test shortens it)
        self._thread = WorkerThread(f"upstream {self.health.name}")
        self._running: concurrent.futures.Future[object] | None = None
        # Error kinds are few and fixed: the throttle's bound is never reached. Its clock is `clock`'s, read
        # at each call (a test sets `clock` after construction).
        self._logged = LogThrottle(LOG_EVERY_SECONDS, clock=lambda: self.clock())

    async def start(self) -> None:
        """Read once (a pass-through family that clashes with the sidecar's stops start-up), then on an interval."""
        if self.config.url is not None:
            self._session = self._open_session()
        result = await self.scrape_once()
        if result is not None and result.clashes:
            await self.stop()
            # A new namespace moves only the rollups and per-rank families: never process_* (an engine serving
            # prometheus_client's default REGISTRY, as LMCache's API server does) nor the self-metrics.
            renamed = any(not name.startswith(("process_", "hicache_exporter_")) for name in result.clashes)
            raise ConfigError(
                f"upstream {self.health.name}: families {sorted(result.clashes)} are passed through and are also "
                "families the sidecar makes (its rollups, self-metrics and process_* metrics); set "
                + ("metrics.namespace to another prefix, or " if renamed else "") + "pass_through: false on this upstream"
            )
        self._task = asyncio.create_task(self._loop())

    def _open_session(self) -> aiohttp.ClientSession:
        headers = dict(self.config.headers)
        if self.config.basic_auth is not None:  # a header of the session (aiohttp's `auth=` is deprecated)
            ba = self.config.basic_auth
            password = ba.password if ba.password is not None else Path(ba.password_file or "").read_text().strip()
            encode = getattr(aiohttp, "encode_basic_auth", None)  # aiohttp 3.12+; BasicAuth is deprecated there
            headers["Authorization"] = (encode(ba.username, password) if encode is not None
                                        else aiohttp.BasicAuth(ba.username, password).encode())
        return aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_seconds),
            connector=aiohttp.TCPConnector(ssl=client_ssl_context(self.config) or True, limit=1),
        )

    async def stop(self) -> None:
        """Stop reading, at once whatever the source is doing (a read stuck in its thread is left behind)."""
        # The loop also checks this: a timeout that fires as the task is cancelled (aiohttp's timer,
        # wait_for) can turn the cancellation into a TimeoutError, which the read counts and returns
        # from, and the loop would read on while this waits for it (a test's stop hung for 60 s).
        self._stopping = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None
        self._thread.shutdown()

    async def _loop(self) -> None:
        while not self._stopping:
            await asyncio.sleep(self.interval_seconds)
            if not self._stopping:
                await self.scrape_once()

    async def _off_loop(self, fn: Callable[[], T], timeout: float | None) -> T:
        """`fn` on this source's thread; `busy` while its previous call is still running there."""
        if self._running is not None and not self._running.done():
            raise _ReadError("busy", "the previous read is still running in its thread; this read is skipped")
        future = self._thread.submit(fn)
        self._running = future  # type: ignore[assignment]
        return await asyncio.wait_for(asyncio.wrap_future(future), timeout)

    async def read(self) -> tuple[PlannedRead, list[Skipped]]:
        """One read of the upstream, planned, and the files it skipped (file reading, parsing and planning
        run on this source's thread)."""
        if self.config.multiprocess_dir is not None:
            return await self._off_loop(self._read_directory, self.config.timeout_seconds)
        try:  # asyncio.wait_for, not asyncio.timeout: the package runs on Python 3.10
            raw, charset, openmetrics = await asyncio.wait_for(self._fetch(), self.config.timeout_seconds)
        except asyncio.TimeoutError:
            raise _ReadError("timeout", f"no answer within {self.config.timeout_seconds} s") from None
        except aiohttp.ClientError as err:
            raise _ReadError("connect", str(err) or type(err).__name__) from None
        return await self._off_loop(lambda: (self._parse(raw, charset, openmetrics), []), None)

    def _read_directory(self) -> tuple[PlannedRead, list[Skipped]]:
        """The directory's files read and planned (on this source's thread), with the files skipped."""
        directory = self.config.multiprocess_dir
        assert directory is not None
        try:
            read = read_directory(directory, self.config.pass_through or self.feed.merges_processes, self.max_entries)
            exposition = (self.feed.held.hold(read.exposition, read.skipped) if self.feed.merges_processes
                          else read.exposition)
            return self.feed.plan_exposition(exposition), read.skipped
        except TooLarge as err:
            raise _ReadError("too_large", str(err)) from None
        except NotADirectoryError:
            raise _ReadError("read", f"{directory} is not a directory") from None

    async def _fetch(self) -> tuple[bytearray, str, bool]:
        """The answer's bytes, charset and whether it is OpenMetrics, following same-origin redirects only if asked to."""
        assert self.config.url is not None
        if self._session is None:  # read before start(), as a test or a one-off read does
            self._session = self._open_session()
        openmetrics = self.config.format == "openmetrics"
        accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain; version=0.0.4"
        url = URL(self.config.url)
        for _ in range(MAX_REDIRECTS + 1):
            # Redirects are never left to aiohttp: it would send the configured headers to another origin.
            async with self._session.get(url, headers={"Accept": accept}, allow_redirects=False) as response:
                if response.status in _REDIRECTS:
                    url = self._redirect(url, response.headers.get("Location"), response.status)
                    continue
                if response.status != 200:
                    raise _ReadError("http_status", f"HTTP {response.status}")
                charset = _charset(response.headers.get("Content-Type", ""))
                content_type = response.headers.get("Content-Type", "")
                return await self._body(response), charset, content_type.startswith("application/openmetrics-text")
        raise _ReadError("redirect", f"more than {MAX_REDIRECTS} redirects")

    def _redirect(self, url: URL, location: str | None, status: int) -> URL:
        """Where a redirect goes: only followed with follow_redirects, and only within the upstream's origin."""
        if location is None:
            raise _ReadError("redirect", f"HTTP {status} without a Location")
        try:
            target = url.join(URL(location))
        except ValueError:
            raise _ReadError("redirect", f"HTTP {status} to a Location that is no URL") from None
        if not self.config.follow_redirects:
            raise _ReadError("redirect", f"HTTP {status} to {target} is not followed (follow_redirects: false)")
        if target.origin() != url.origin():
            raise _ReadError("redirect", f"HTTP {status} to another origin ({target.origin()}) is not followed")
        return target

    async def _body(self, response: aiohttp.ClientResponse) -> bytearray:
        """The answer's bytes, refused (not read on) once it is longer than `max_body_bytes`."""
        body = bytearray()  # decoded in place: chunks joined into bytes would hold the answer twice
        async for chunk in response.content.iter_chunked(1 << 16):
            if len(body) + len(chunk) > self.max_body_bytes:
                raise _ReadError("too_large", f"the answer is longer than {self.max_body_bytes} bytes")
            body += chunk
        return body

    def _parse(self, raw: bytearray, charset: str, openmetrics: bool) -> PlannedRead:
        """The answer decoded, then planned by the feed (which refuses more sample lines than a read may have)."""
        try:
            text = raw.decode(charset)
        except UnicodeDecodeError as err:
            line = raw.count(b"\n", 0, err.start) + 1
            raise _ReadError("decode", f"not {charset} at byte {err.start}", line) from None
        except UnicodeError as err:  # a codec that decodes nothing (charset=undefined)
            raise _ReadError("decode", f"{charset} decodes no text: {type(err).__name__}") from None
        raw.clear()  # the bytes, freed before the parse (the text is what is read from here)
        # One character beyond Latin-1 makes Python hold every character of the text in 4 bytes:
        # the text may take no more memory than the answer's cap allows its bytes.
        if sys.getsizeof(text) > self.max_body_bytes + (1 << 10):
            raise _ReadError("too_large", f"the answer takes {sys.getsizeof(text)} bytes as text (characters beyond "
                             f"Latin-1 take 4 bytes each), more than {self.max_body_bytes}")
        long_line = _LONG_LINE.search(text)
        if long_line is not None:
            raise _ReadError("too_large", f"a line is longer than {MAX_LINE_CHARS} characters",
                             text.count("\n", 0, long_line.start()) + 1)
        try:
            return self.feed.plan_text(text, openmetrics)
        except TooLarge as err:
            raise _ReadError("too_large", str(err)) from None
        except ValueError as err:
            raise _ReadError("parse", str(err), _line_of(text, str(err))) from None

    async def scrape_once(self) -> FeedResult | None:
        """One read applied to the state; never raises (each failure is counted by kind on its health)."""
        health = self.health
        started = time.perf_counter()
        result = None
        try:
            planned, skipped_files = await self.read()
            for skipped in skipped_files:
                health.error(skipped.kind)
                self._log(skipped.kind, "upstream %s: %s skipped: %s (%s); %d files skipped in this read",
                          health.name, skipped.name, skipped.message, skipped.kind, len(skipped_files))
            result = await self.feed.apply_async(planned)
        except _ReadError as err:
            self._failed(err.kind, err.message, err.line)
        except TimeoutError:
            self._failed("timeout", f"no read within {self.config.timeout_seconds} s")
        except OSError as err:
            self._failed("read", f"{type(err).__name__}: {err}")
        except Exception as err:  # a bug or an input nothing above foresaw: count it, read again next time
            self._failed("internal", f"{type(err).__name__}: {err}", exc_info=True)
        else:
            health.up = True
            health.scrapes += 1
            health.last_scrape_wall = time.time()
            health.samples = result.samples
            health.ranks = result.ranks
            health.pass_through = len(result.pass_through)
            if result.rejected:
                health.error("rejected_samples")
            if result.clashes:
                health.error("name_clash")
        health.last_duration = time.perf_counter() - started
        return result

    def _failed(self, kind: str, message: str, line: int | None = None, exc_info: bool = False) -> None:
        where = "" if line is None else f" at line {line}"
        self._log(kind, "upstream %s: %s%s (%s); its ranks turn stale, then expire",
                  self.health.name, message, where, kind, exc_info=exc_info)
        self.health.up = False
        self.health.error(kind, line)
        # Identities no read lists any more expire like silent pushed ranks and free their slots,
        # even while the upstream never answers again.
        self.feed.release_expired()

    def _log(self, kind: str, message: str, *args: object, exc_info: bool = False) -> None:
        """Log at most once a minute per error kind: a source that fails every read must not flood the log."""
        if self._logged.due(kind):
            log.warning(message, *args, exc_info=exc_info)


def _charset(content_type: str) -> str:
    """The answer's charset: UTF-8 where none is given, a read error (`charset`) where it is no text encoding."""
    charset = parse_mimetype(content_type).parameters.get("charset", "").strip()
    if not charset:
        return "utf-8"
    try:
        codec = codecs.lookup(charset)
    except (LookupError, ValueError):
        codec = None
    # codecs.lookup also finds bytes-to-bytes codecs such as `hex`, which decode to no text.
    if codec is None or not getattr(codec, "_is_text_encoding", True):
        raise _ReadError("charset", f"unknown charset {charset[:40]!r}")
    return codec.name


def _line_of(text: str, message: str) -> int | None:
    """The line of `text` a parser's message quotes, if it quotes one: the page shows the number, never the line.

    Linear in the text: at most LINE_OF_TRIES searches, each for at most LINE_OF_CHARS characters
    (a message quoting a line of a million colons took minutes when every colon was tried)."""
    for colon in islice((m.start() for m in re.finditer(":", message)), LINE_OF_TRIES):
        fragment = message[colon + 1:].strip().strip("'\"")[:LINE_OF_CHARS]
        if len(fragment) >= 3:
            at = text.find(fragment)
            if at >= 0:
                return text.count("\n", 0, at) + 1
    return None


class _ReadError(Exception):
    def __init__(self, kind: str, message: str, line: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.line = line


def running(scrapers: list[UpstreamScraper]) -> Callable[[object], AsyncIterator[None]]:
    """The proxy as a cleanup context of the app: every upstream's scraper, started and stopped with it."""

    async def run(_app: object) -> AsyncIterator[None]:
        started: list[UpstreamScraper] = []
        try:
            for scraper in scrapers:
                await scraper.start()
                started.append(scraper)
        except BaseException:
            for scraper in started:
                await scraper.stop()
            raise
        yield
        for scraper in started:
            await scraper.stop()

    return run
