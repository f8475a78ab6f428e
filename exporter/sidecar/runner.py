"""The Sidecar: builds state, listener, collector and application, serves them until stopped."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web
from prometheus_client.process_collector import ProcessCollector

from exporter.catalog import Catalog, load_profiles
from exporter.config import SidecarConfig
from exporter.errors import StartupError
from exporter.sidecar.core.health import SidecarHealth, UpstreamHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.durable.keeper import StateKeeper
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.http.app import build_app
from exporter.sidecar.http.security import server_ssl_context
from exporter.sidecar.ingest.listener import IngestServer
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.scrape import UpstreamScraper, running

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


DCGM_EXPORTER_PORT = 9400  # NVIDIA dcgm-exporter's default port, and this sidecar's


def http_startup_error(host: str, port: int, err: OSError) -> StartupError:
    """One line naming the address and why it cannot be listened on."""
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if isinstance(err, socket.gaierror):
        return StartupError(f"cannot listen on {where}: the host {host!r} does not resolve ({err.strerror})", "http.host")
    if err.errno == errno.EADDRINUSE:
        clash = (f"; {DCGM_EXPORTER_PORT} is also the default port of NVIDIA's dcgm-exporter, so move one of them"
                 if port == DCGM_EXPORTER_PORT else "")
        return StartupError(f"cannot listen on {where}: the port is already in use{clash}", "http.port")
    if err.errno == errno.EADDRNOTAVAIL:
        return StartupError(f"cannot listen on {where}: {host} is not an address of this machine", "http.host")
    if err.errno == errno.EACCES and 0 < port < 1024:
        return StartupError(f"cannot listen on {where}: ports below 1024 need privileges", "http.port")
    return StartupError(f"cannot listen on {where}: {err.strerror or err}", "http.port")


def bind_http(host: str, port: int, backlog: int = 128) -> list[socket.socket]:
    """Listening sockets for every address `host` resolves to, as asyncio's create_server makes
    them; bound before anything else starts, so that a taken port fails start-up at once."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise http_startup_error(host, port, err) from err
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            target: tuple[Any, ...] = (address[0], port, *address[2:])
            sock.bind(target)
            sock.listen(backlog)
            port = sock.getsockname()[1]  # port 0: every address on the port the first one got
    except OSError as err:
        for sock in sockets:
            sock.close()
        raise http_startup_error(host, port, err) from err
    return sockets


class Sidecar:
    """One sidecar process: `await start()`, then `await stop()` (or `run()` until a signal)."""

    def __init__(
        self, config: SidecarConfig, catalog: Catalog | None = None, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.catalog = catalog or load_profiles(config.metrics.catalog, config.profiles_in_use)
        self.health = SidecarHealth()
        self.state = SidecarState(self.catalog, config.ranks, config.rollup.window_seconds, clock=clock)
        # prometheus_client's own process_* families (memory, CPU, file descriptors) follow the sidecar's.
        process = ProcessCollector(registry=None)
        collector = SidecarCollector(self.state, self.health, config.metrics.namespace, config.metrics.per_rank_series,
                                     extra=(process,))
        self.upstreams: list[UpstreamScraper] = []
        for upstream in config.upstreams:
            upstream_health = self.health.upstreams[upstream.label] = UpstreamHealth(
                upstream.label, upstream.url or str(upstream.multiprocess_dir))
            feed = UpstreamFeed(upstream, self.state, upstream_health, collector.exposed_names())
            self.upstreams.append(UpstreamScraper(upstream, feed))
        self.renderer = TextRenderer(collector, pass_through=[u.feed.pass_through_text for u in self.upstreams])
        self.ingest = IngestServer(config.ingest, self.state, self.health)
        # The durable state loads before any source starts and is saved last, after they stopped.
        self.keeper = (StateKeeper(config.persistence, self.state, {u.feed.health.name: u.feed for u in self.upstreams},
                                   self.health.persistence, config.metrics.namespace)
                       if config.persistence.file is not None else None)
        self._runner: web.AppRunner | None = None
        self.http_port: int | None = None

    async def start(self) -> None:
        """Start the ingest listener and housekeeping (the app's cleanup context), then HTTP."""
        tls = self.config.http.tls_server_config
        ssl_context = server_ssl_context(tls) if tls is not None else None  # fail before binding anything
        sources = [self.ingest.running, running(self.upstreams)]
        if self.keeper is not None:
            sources.insert(0, self.keeper.running)
        app = build_app(self.config, self.state, self.health, self.renderer, sources)
        http = self.config.http
        # aiohttp's keep-alive timer runs from accept until a request is whole, so it is also the
        # header deadline that keeps idle or dribbling connections from holding descriptors.
        self._runner = CappedRunner(app, http.max_connections, access_log=None, handle_signals=False,
                                    shutdown_timeout=HTTP_SHUTDOWN_SECONDS, keepalive_timeout=http.idle_timeout_seconds)
        sockets = bind_http(http.host, http.port)  # before the ingest socket: a taken port fails first
        try:
            await self._runner.setup()  # starts the listener, housekeeping and the upstreams' first reads
        except BaseException:
            for sock in sockets:
                sock.close()
            await self._runner.cleanup()  # whatever of the cleanup context did start stops again
            raise
        try:
            for sock in sockets:
                await web.SockSite(self._runner, sock, ssl_context=ssl_context).start()
        except OSError as err:
            await self._runner.cleanup()
            raise http_startup_error(http.host, http.port, err) from err
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
