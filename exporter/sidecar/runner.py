"""The Sidecar: builds state, listener, collector and application, serves them until stopped."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from exporter.catalog import Catalog, load_catalog
from exporter.config import SidecarConfig
from exporter.sidecar.app import build_app
from exporter.sidecar.exposition import SidecarCollector
from exporter.sidecar.listener import IngestServer
from exporter.sidecar.render import TextRenderer
from exporter.sidecar.security import server_ssl_context
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import SidecarStats, UpstreamHealth
from exporter.sidecar.upstream import UpstreamFeed, UpstreamScraper

log = logging.getLogger("hicache_exporter")
HTTP_SHUTDOWN_SECONDS = 5.0  # open HTTP requests get this long at shutdown (aiohttp's default is 60 s)


class _Refused(asyncio.Protocol):
    """A connection past http.max_connections: answered 503 and closed, before anything is read."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
        transport.close()


class CappedServer(web.Server):
    """aiohttp's server, refusing connections past a cap (it has none of its own)."""

    max_connections = 512

    def __call__(self) -> asyncio.BaseProtocol:  # type: ignore[override]
        if len(self.connections) >= self.max_connections:
            return _Refused()
        return super().__call__()


class CappedRunner(web.AppRunner):
    """An AppRunner whose server is a CappedServer."""

    def __init__(self, app: web.Application, max_connections: int, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.max_connections = max_connections

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = CappedServer  # the app builds the server itself; only the factory call differs
        server.max_connections = self.max_connections  # type: ignore[attr-defined]
        return server


class Sidecar:
    """One sidecar process: `await start()`, then `await stop()` (or `run()` until a signal)."""

    def __init__(
        self, config: SidecarConfig, catalog: Catalog | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.catalog = catalog or load_catalog(config.metrics.catalog)
        self.stats = SidecarStats()
        self.state = SidecarState(self.catalog, config.ranks, config.rollup.window_seconds, clock=clock)
        collector = SidecarCollector(self.state, self.stats, config.metrics.namespace, config.metrics.per_rank_series)
        self.upstreams: list[UpstreamScraper] = []
        for upstream in config.upstreams:
            health = self.stats.upstreams[upstream.label] = UpstreamHealth(
                upstream.label, upstream.url or str(upstream.multiprocess_dir))
            feed = UpstreamFeed(upstream, self.state, health, collector.exposed_names())
            self.upstreams.append(UpstreamScraper(upstream, feed))
        self.renderer = TextRenderer(collector, pass_through=[u.pass_through_text for u in self.upstreams])
        self.ingest = IngestServer(config.ingest, self.state, self.stats)
        self._runner: web.AppRunner | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        """Start the ingest listener and housekeeping (the app's cleanup context), then HTTP."""
        tls = self.config.http.tls_server_config
        ssl_context = server_ssl_context(tls) if tls is not None else None  # fail before binding anything
        app = build_app(self.config, self.state, self.stats, self.renderer, self.ingest, self.upstreams)
        http = self.config.http
        # aiohttp's keep-alive timer runs from accept until a request is whole, so it is also the
        # header deadline that keeps idle or dribbling connections from holding descriptors.
        self._runner = CappedRunner(app, http.max_connections, access_log=None, handle_signals=False,
                                    shutdown_timeout=HTTP_SHUTDOWN_SECONDS, keepalive_timeout=http.idle_timeout_seconds)
        try:
            await self._runner.setup()  # starts the listener, housekeeping and the upstreams' first reads
        except BaseException:
            await self._runner.cleanup()
            raise
        site = web.TCPSite(self._runner, self.config.http.host, self.config.http.port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError:
            await self._runner.cleanup()
            raise
        addresses = self._runner.addresses
        self.http_port = addresses[0][1] if addresses else self.config.http.port
        log.info("serving /metrics on http://%s:%s", self.config.http.host, self.http_port)

    async def stop(self) -> None:
        """Close HTTP, then stop the listener (in-flight frames finish) and remove the socket."""
        if self._runner is not None:
            await self._runner.cleanup()
        log.info("stopped")

    async def run(self) -> None:
        """Run until SIGTERM or SIGINT."""
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await stop.wait()
        finally:
            await self.stop()
