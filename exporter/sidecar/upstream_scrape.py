"""The proxy's reads: each upstream read on an interval (HTTP or its multiprocess directory) and handed to its feed."""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
from aiohttp import web

from exporter.config import UpstreamConfig
from exporter.errors import ConfigError
from exporter.sidecar.upstream import FeedResult, TextReading, UpstreamFeed
from exporter.sidecar.upstream_files import Reading, read_multiprocess_dir

log = logging.getLogger("hicache_exporter.upstream")


# An upstream's answer is read up to this size: about 8 times what a 256-rank engine writes
# (33,000 sample lines, 4.3 MB), so that a runaway or hostile upstream cannot fill the pod.
MAX_BODY_BYTES = 32 << 20


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
        self.max_body_bytes = MAX_BODY_BYTES

    async def start(self) -> None:
        """Read once (a pass-through family that clashes with the sidecar's stops start-up), then on an interval."""
        if self.config.url is not None:
            auth = None
            if self.config.basic_auth is not None:
                ba = self.config.basic_auth
                password = ba.password if ba.password is not None else Path(ba.password_file or "").read_text().strip()
                auth = aiohttp.BasicAuth(ba.username, password)
            self._session = aiohttp.ClientSession(
                auth=auth, headers=self.config.headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_seconds),
                connector=aiohttp.TCPConnector(ssl=client_ssl_context(self.config) or True, limit=1),
            )
        result = await self.scrape_once()
        if result is not None and result.clashes:
            await self.stop()
            raise ConfigError(
                f"upstream {self.health.name}: families {sorted(result.clashes)} are passed through and are also "
                "families the sidecar makes (its rollups, self-metrics and process_* metrics); set "
                "metrics.namespace to another prefix, or pass_through: false on this upstream"
            )
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_seconds)
            try:
                await self.scrape_once()
            except Exception as err:  # a bug must not end the reads: log it, count it, read again next time
                log.exception("upstream %s: read failed", self.health.name)
                self._failed("internal", f"{type(err).__name__}: {err}")

    async def read(self) -> Reading | TextReading:
        """One read of the upstream (the parsing and file reading run off the event loop)."""
        if self.config.multiprocess_dir is not None:
            directory = self.config.multiprocess_dir
            if not directory.is_dir():
                raise _ReadError("read", f"{directory} is not a directory")
            return await asyncio.wait_for(asyncio.to_thread(read_multiprocess_dir, directory, self.config.pass_through),
                                          self.config.timeout_seconds)
        assert self._session is not None and self.config.url is not None
        openmetrics = self.config.format == "openmetrics"
        accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain; version=0.0.4"
        try:
            async with self._session.get(self.config.url, headers={"Accept": accept}) as response:
                if response.status != 200:
                    raise _ReadError("http_status", f"HTTP {response.status}")
                body = await self._body(response)
                openmetrics = response.headers.get("Content-Type", "").startswith("application/openmetrics-text")
        except asyncio.TimeoutError:
            raise _ReadError("timeout", f"no answer within {self.config.timeout_seconds} s") from None
        except aiohttp.ClientError as err:
            raise _ReadError("connect", str(err) or type(err).__name__) from None
        try:
            return await asyncio.to_thread(self.feed.read_text, body, openmetrics)
        except ValueError as err:
            raise _ReadError("parse", str(err)) from None

    async def _body(self, response: aiohttp.ClientResponse) -> str:
        """The answer's text, refused (not read on) once it is longer than `max_body_bytes`."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in response.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _ReadError("too_large", f"the answer is longer than {self.max_body_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks).decode(response.get_encoding())

    async def scrape_once(self) -> FeedResult | None:
        health = self.health
        started = time.perf_counter()
        try:
            reading = await self.read()
        except _ReadError as err:
            self._failed(err.kind, err.message)
        except asyncio.TimeoutError:
            self._failed("timeout", f"no read within {self.config.timeout_seconds} s")
        except (OSError, ValueError) as err:
            self._failed("read", str(err))
        else:
            result = self.feed.apply(reading)
            health.up = True
            health.scrapes += 1
            health.last_scrape_wall = time.time()
            health.samples = result.samples
            health.ranks = result.ranks
            health.pass_through = len(result.pass_through)
            if result.rejected:
                health.error("rejected_samples", f"{result.rejected} samples refused")
            if result.clashes:
                health.error("name_clash", ", ".join(sorted(result.clashes)))
            health.last_duration = time.perf_counter() - started
            return result
        health.last_duration = time.perf_counter() - started
        return None

    def _failed(self, kind: str, message: str) -> None:
        if self.health.up or not self.health.errors:
            log.warning("upstream %s: %s (%s); its ranks turn stale, then expire", self.health.name, message, kind)
        self.health.up = False
        self.health.error(kind, message)


class _ReadError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


UPSTREAMS: web.AppKey[list[UpstreamScraper]] = web.AppKey("upstreams", list)


async def run_upstreams(app: web.Application) -> AsyncIterator[None]:
    """The cleanup context of the proxy: every upstream's scraper, started and stopped with the app."""
    started: list[UpstreamScraper] = []
    try:
        for scraper in app[UPSTREAMS]:
            await scraper.start()
            started.append(scraper)
    except BaseException:
        for scraper in started:
            await scraper.stop()
        raise
    yield
    for scraper in started:
        await scraper.stop()
