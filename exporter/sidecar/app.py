"""The aiohttp application: /metrics, health and readiness, a JSON view of ranks and a status page.

Everything that lives as long as the application (the ingest listener, housekeeping) starts
and stops in its cleanup context, so `AppRunner.setup()` and `cleanup()` are the whole lifecycle.
"""

from __future__ import annotations

import asyncio
import gzip
import html
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Middleware
from prometheus_client.exposition import choose_encoder

from exporter import __version__
from exporter.config import SidecarConfig
from exporter.sidecar.listener import IngestServer
from exporter.sidecar.registry import exposition_order
from exporter.sidecar.render import TextRenderer
from exporter.sidecar.security import BasicAuth, auth_middleware
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import SidecarStats
from exporter.sidecar.upstream import UPSTREAMS, UpstreamScraper, run_upstreams

HOUSEKEEPING_SECONDS = 1.0
CONFIG: web.AppKey[SidecarConfig] = web.AppKey("config", SidecarConfig)
STATE: web.AppKey[SidecarState] = web.AppKey("state", SidecarState)
STATS: web.AppKey[SidecarStats] = web.AppKey("stats", SidecarStats)
RENDERER: web.AppKey[TextRenderer] = web.AppKey("renderer", TextRenderer)
INGEST: web.AppKey[IngestServer] = web.AppKey("ingest", IngestServer)


class BadRequestLogFilter(logging.Filter):
    """aiohttp logs a malformed request with its traceback, which quotes the offending bytes (an
    over-long `Authorization` header, say): keep one line that names the kind of error instead."""

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        if isinstance(error, HttpProcessingError):
            said = record.getMessage()
            record.msg = "%s: refused a malformed HTTP request (%s %s)"
            record.args = (said, error.code, type(error).__name__)
            record.exc_info = None
            record.exc_text = None
        return True


_BAD_REQUESTS = BadRequestLogFilter()


def build_app(
    config: SidecarConfig, state: SidecarState, stats: SidecarStats, renderer: TextRenderer, ingest: IngestServer,
    upstreams: list[UpstreamScraper] | None = None,
) -> web.Application:
    """The application over in-memory state; its cleanup context runs the ingest listener and housekeeping."""
    middlewares: list[Middleware] = []
    auth = BasicAuth(config.http.basic_auth_users) if config.http.basic_auth_users else None
    if auth is not None:
        middlewares.append(auth_middleware(auth))
    app = web.Application(middlewares=middlewares)
    server_log = logging.getLogger("aiohttp.server")
    if _BAD_REQUESTS not in server_log.filters:
        server_log.addFilter(_BAD_REQUESTS)
    if auth is not None:
        app.on_cleanup.append(lambda _: _close(auth))
    app[CONFIG] = config
    app[STATE] = state
    app[STATS] = stats
    app[RENDERER] = renderer
    app[INGEST] = ingest
    app.cleanup_ctx.append(_ingest_listener)
    app.cleanup_ctx.append(_housekeeping)
    app[UPSTREAMS] = upstreams or []
    app.cleanup_ctx.append(run_upstreams)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/-/healthy", _healthy)
    app.router.add_get("/-/ready", _ready)
    app.router.add_get("/api/v1/ranks", _ranks)
    app.router.add_get("/", _status_page)
    return app


async def _close(auth: BasicAuth) -> None:
    auth.close()


async def _ingest_listener(app: web.Application) -> AsyncIterator[None]:
    await app[INGEST].start()
    yield
    await app[INGEST].stop()


async def _housekeeping(app: web.Application) -> AsyncIterator[None]:
    """Ranks turn stale and expire on time even while nobody scrapes."""

    async def keep_house() -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            app[STATE].tick()

    task = asyncio.create_task(keep_house())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _metrics(request: web.Request) -> web.Response:
    started = time.perf_counter()
    _, content_type = choose_encoder(request.headers.get("Accept", ""))  # prometheus_client's negotiation
    body = request.app[RENDERER].render(openmetrics=content_type.startswith("application/openmetrics-text"))
    request.app[STATS].scrape_duration.observe(time.perf_counter() - started)
    headers = {"Content-Type": content_type, "Vary": "Accept-Encoding"}
    if accepts_gzip(request.headers.get("Accept-Encoding", "")):
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header allows gzip (RFC 9110 section 12.5.3: codings are
    case-insensitive, `q=0` refuses one, `*` stands for any not named). aiohttp's own check is a
    substring test, which reads `gzip;q=0` as yes and `GZIP` as no."""
    named: float | None = None
    star: float | None = None
    for item in accept_encoding.split(","):
        coding, *params = (part.strip() for part in item.split(";"))
        weight = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        coding = coding.lower()
        if coding in ("gzip", "x-gzip"):
            named = weight if named is None else max(named, weight)
        elif coding == "*":
            star = weight
    if named is not None:
        return named > 0
    return star is not None and star > 0


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


async def _ready(request: web.Request) -> web.Response:
    if request.app[STATS].ingest_listening:
        return web.Response(text="ready\n")
    return web.Response(status=503, text="ingest socket is not listening\n")


def rank_rows(state: SidecarState) -> list[dict[str, Any]]:
    """One JSON-friendly row per known rank."""
    now = state.clock()
    return [
        {
            "tp_rank": rank.tp_rank,
            "pp_rank": rank.pp_rank,
            "dp_rank": rank.dp_rank,
            "attn_cp_rank": rank.attn_cp_rank,
            "labels": dict(rank.static),
            "status": rank.status.value,
            "epoch": rank.epoch,
            "pid": rank.pid,
            "seq": rank.seq,
            "restarts": rank.restarts,
            "reconnects": rank.reconnects,
            "snapshots": rank.snapshots,
            "series": len(rank.values),
            "seconds_since_activity": round(now - rank.last_activity, 3),
            "last_push_time": rank.last_push_wall,
            "world": msgspec.structs.asdict(rank.world) if rank.world else None,
        }
        for rank in sorted(state.ranks.values(), key=exposition_order)
    ]


def upstream_rows(stats: SidecarStats) -> list[dict[str, Any]]:
    """One JSON-friendly row per configured upstream."""
    return [
        {
            "name": h.name, "source": h.source, "up": h.up, "last_scrape_time": h.last_scrape_wall,
            "last_scrape_duration_seconds": h.last_duration, "samples": h.samples, "scrapes": h.scrapes,
            "ranks": h.ranks, "pass_through_families": h.pass_through, "errors": dict(h.errors),
            "last_error": h.last_error, "unranked_families": sorted(h.unranked),
            "cp_colliding_families": sorted(h.cp_colliding),
        }
        for h in stats.upstreams.values()
    ]


async def _ranks(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.tick()
    return web.json_response({"ranks": rank_rows(state), "upstreams": upstream_rows(request.app[STATS])})


async def _status_page(request: web.Request) -> web.Response:
    state = request.app[STATE]
    state.tick()
    rows = rank_rows(state)
    cells = "".join(
        "<tr>" + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (r["tp_rank"], r["pp_rank"], r["dp_rank"], r["labels"], r["status"],
                      r["restarts"], r["series"], r["seconds_since_activity"])
        ) + "</tr>"
        for r in rows
    )
    upstream_cells = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in (
            u["name"], "up" if u["up"] else "down", u["ranks"], u["samples"], u["last_error"] or ""))
        + "</tr>"
        for u in upstream_rows(request.app[STATS])
    )
    upstream_table = (
        "<h2>Upstreams</h2><table><tr><th>upstream</th><th>status</th><th>ranks</th><th>samples</th>"
        f"<th>last error</th></tr>{upstream_cells}</table>" if upstream_cells else ""
    )
    socket_path = request.app[CONFIG].ingest.socket_path
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hicache-exporter</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style></head>
<body><h1>hicache-exporter {html.escape(__version__)}</h1>
<p>Ingest socket: <code>{html.escape(str(socket_path))}</code> &middot;
<a href="/metrics">/metrics</a> &middot; <a href="/api/v1/ranks">/api/v1/ranks</a> &middot;
<a href="/-/healthy">/-/healthy</a> &middot; <a href="/-/ready">/-/ready</a></p>
<table><tr><th>tp</th><th>pp</th><th>dp</th><th>labels</th><th>status</th>
<th>restarts</th><th>series</th><th>seconds since push</th></tr>{cells}</table>
{upstream_table}
</body></html>"""
    return web.Response(text=page, content_type="text/html")
