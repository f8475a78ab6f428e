"""The HTTP side: /metrics, health and readiness, a JSON view of ranks and a status page."""

from __future__ import annotations

import gzip
import html
import time
from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web
from prometheus_client.exposition import choose_encoder

from exporter import __version__
from exporter.sidecar.security import BasicAuth, auth_middleware

if TYPE_CHECKING:
    from exporter.sidecar.runner import Sidecar

SIDECAR_KEY: web.AppKey["Sidecar"] = web.AppKey("sidecar")


def build_app(sidecar: "Sidecar") -> web.Application:
    """The aiohttp application; all routes read in-memory state only."""
    middlewares = []
    if sidecar.config.http.basic_auth_users:
        middlewares.append(auth_middleware(BasicAuth(sidecar.config.http.basic_auth_users)))
    app = web.Application(middlewares=middlewares)
    app[SIDECAR_KEY] = sidecar
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/-/healthy", _healthy)
    app.router.add_get("/-/ready", _ready)
    app.router.add_get("/api/v1/ranks", _ranks)
    app.router.add_get("/", _status_page)
    return app


async def _metrics(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    started = time.perf_counter()
    _, content_type = choose_encoder(request.headers.get("Accept", ""))  # prometheus_client's negotiation
    body = sidecar.renderer.render(openmetrics=content_type.startswith("application/openmetrics-text"))
    sidecar.stats.scrape_duration.observe(time.perf_counter() - started)
    headers = {"Content-Type": content_type}
    if "gzip" in request.headers.get("Accept-Encoding", ""):
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


async def _healthy(request: web.Request) -> web.Response:
    return web.Response(text="OK\n")


async def _ready(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    if sidecar.stats.ingest_listening:
        return web.Response(text="ready\n")
    return web.Response(status=503, text="ingest socket is not listening\n")


def rank_rows(sidecar: "Sidecar") -> list[dict[str, Any]]:
    """One JSON-friendly row per known rank."""
    state = sidecar.state
    now = state.clock()
    rows = []
    for rank in sorted(state.ranks.values(), key=lambda r: (r.static, r.dp_rank, r.pp_rank, r.tp_rank)):
        rows.append({
            "tp_rank": rank.tp_rank,
            "pp_rank": rank.pp_rank,
            "dp_rank": rank.dp_rank,
            "labels": dict(rank.static),
            "status": rank.status.value,
            "leader": state.groups[rank.group].leader is rank,
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
        })
    return rows


async def _ranks(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    sidecar.state.tick()
    return web.json_response({"ranks": rank_rows(sidecar)})


async def _status_page(request: web.Request) -> web.Response:
    sidecar = request.app[SIDECAR_KEY]
    sidecar.state.tick()
    rows = rank_rows(sidecar)
    cells = "".join(
        "<tr>" + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (r["tp_rank"], r["pp_rank"], r["dp_rank"], r["labels"], r["status"],
                      "yes" if r["leader"] else "", r["restarts"], r["series"], r["seconds_since_activity"])
        ) + "</tr>"
        for r in rows
    )
    page = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>hicache-exporter</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:left}}</style></head>
<body><h1>hicache-exporter {html.escape(__version__)}</h1>
<p>Ingest socket: <code>{html.escape(str(sidecar.config.ingest.socket_path))}</code> &middot;
<a href="/metrics">/metrics</a> &middot; <a href="/api/v1/ranks">/api/v1/ranks</a> &middot;
<a href="/-/healthy">/-/healthy</a> &middot; <a href="/-/ready">/-/ready</a></p>
<table><tr><th>tp</th><th>pp</th><th>dp</th><th>labels</th><th>status</th><th>leader</th>
<th>restarts</th><th>series</th><th>seconds since push</th></tr>{cells}</table>
</body></html>"""
    return web.Response(text=page, content_type="text/html")
