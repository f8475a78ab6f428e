"""The Sidecar: wires state, ingest server, collector and HTTP app, and runs them until stopped."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from exporter.catalog import Catalog, load_catalog
from exporter.config import SidecarConfig
from exporter.sidecar.exposition import SidecarCollector
from exporter.sidecar.http import build_app
from exporter.sidecar.ingest import IngestServer
from exporter.sidecar.render import TextRenderer
from exporter.sidecar.security import server_ssl_context
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import SidecarStats

log = logging.getLogger("hicache_exporter")
HOUSEKEEPING_SECONDS = 1.0


class Sidecar:
    """One sidecar process: `await start()`, then `await stop()` (or `run()` until a signal)."""

    def __init__(self, config: SidecarConfig, catalog: Catalog | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self.catalog = catalog or load_catalog(config.metrics.catalog)
        self.stats = SidecarStats()
        self.state = SidecarState(self.catalog, config.ranks, config.rollup.window_seconds, clock=clock)
        collector = SidecarCollector(self.state, self.stats, config.metrics.namespace)
        # The registry is the reference exposition (prometheus_client's own); /metrics is served by
        # the renderer, which caches each rank's lines and gives the same samples much faster.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        self.renderer = TextRenderer(collector)
        self.ingest = IngestServer(config.ingest, self.state, self.stats)
        self._runner: web.AppRunner | None = None
        self._housekeeping: asyncio.Task[None] | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        tls = self.config.http.tls_server_config
        ssl_context = server_ssl_context(tls) if tls is not None else None  # fail before binding anything
        await self.ingest.start()
        self._runner = web.AppRunner(build_app(self), access_log=None, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.http.host, self.config.http.port, ssl_context=ssl_context)
        try:
            await site.start()
        except OSError:
            await self.ingest.stop(grace=0)
            await self._runner.cleanup()
            raise
        addresses = self._runner.addresses
        self.http_port = addresses[0][1] if addresses else self.config.http.port
        self._housekeeping = asyncio.create_task(self._keep_house())
        log.info("serving /metrics on http://%s:%s", self.config.http.host, self.http_port)

    async def _keep_house(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            self.state.tick()

    async def stop(self) -> None:
        """Stop accepting, let in-flight frames finish, remove the socket, close HTTP."""
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        await self.ingest.stop()
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
