"""The aiohttp application: /metrics, health and readiness, the JSON API (expose/status.py) and the status page (expose/page.py).

Everything that lives as long as the application (the ingest listener, housekeeping) starts
and stops in its cleanup context, so `AppRunner.setup()` and `cleanup()` are the whole lifecycle.
"""

from __future__ import annotations

import asyncio
import gzip
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from importlib import resources

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.typedefs import Handler, Middleware
from prometheus_client.exposition import choose_encoder

from exporter.config import SidecarConfig
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.page import render_page
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.expose.status import EncodedStatus, StatusView, ranks_body
from exporter.sidecar.http.bodies import BodyBudget, bodies_in_flight
from exporter.sidecar.http.security import BasicAuth, auth_middleware

HOUSEKEEPING_SECONDS = 1.0
CONFIG: web.AppKey[SidecarConfig] = web.AppKey("config", SidecarConfig)
STATE: web.AppKey[SidecarState] = web.AppKey("state", SidecarState)
HEALTH: web.AppKey[SidecarHealth] = web.AppKey("health", SidecarHealth)
RENDERER: web.AppKey[TextRenderer] = web.AppKey("renderer", TextRenderer)
VIEW: web.AppKey[StatusView] = web.AppKey("view", StatusView)
ENCODED: web.AppKey[EncodedStatus] = web.AppKey("encoded", EncodedStatus)
BODIES: web.AppKey[BodyBudget] = web.AppKey("bodies", BodyBudget)
STATIC: web.AppKey[dict[str, tuple[bytes, str]]] = web.AppKey("static", dict)
STATIC_FILES = {"status.js": "text/javascript", "status.css": "text/css"}
# The page loads only its own script and style sheet, and its script fetches only the page itself (docs/api.md).
CONTENT_SECURITY_POLICY = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "no-referrer"}


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
    config: SidecarConfig, state: SidecarState, health: SidecarHealth, renderer: TextRenderer,
    sources: Sequence[Callable[[web.Application], AsyncIterator[None]]] = (),
) -> web.Application:
    """The application over in-memory state; its cleanup context runs the sources (the ingest listener,
    the upstreams' scrapers), then housekeeping."""
    bodies = BodyBudget(config.http.max_response_bytes_in_flight, config.http.write_timeout_seconds)
    # Outermost: the headers every other middleware sets are on a large body before it is written.
    middlewares: list[Middleware] = [
        bodies_in_flight(bodies, SECURITY_HEADERS, _gzipped), _security_headers]
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
    app[HEALTH] = health
    app[RENDERER] = renderer
    app[VIEW] = StatusView(config, state, health)
    app[ENCODED] = EncodedStatus(app[VIEW], render=render_page)
    app[STATIC] = _static_files()
    app[BODIES] = bodies
    app.cleanup_ctx.extend(sources)
    app.cleanup_ctx.append(_housekeeping)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/-/healthy", _healthy)
    app.router.add_get("/-/ready", _ready)
    app.router.add_get("/api/v1/ranks", _ranks)
    app.router.add_get("/api/v1/status", _status)
    app.router.add_get("/", _status_page)
    app.router.add_get("/static/{name}", _static)
    return app


async def _close(auth: BasicAuth) -> None:
    auth.close()


async def _housekeeping(app: web.Application) -> AsyncIterator[None]:
    """The bandwidth history is sampled even while nobody scrapes (ranks turn stale and expire as they are read)."""

    history = app[VIEW].history

    async def keep_house() -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_SECONDS)
            if history.due(time.monotonic()):
                history.sample(app[STATE], time.time())

    task = asyncio.create_task(keep_house())
    yield
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _metrics(request: web.Request) -> web.Response:
    started = time.perf_counter()
    _, content_type = choose_encoder(request.headers.get("Accept", ""))  # prometheus_client's negotiation
    body = request.app[RENDERER].render(openmetrics=content_type.startswith("application/openmetrics-text"))
    request.app[HEALTH].scrape_duration.observe(time.perf_counter() - started)
    return _negotiated(request, body, {"Content-Type": content_type})


# Fast path: gzip at level 1, not aiohttp's 6, and q-values as RFC 9110 reads them (payoff: BENCHMARKS.md "Fast paths").
def _negotiated(request: web.Request, body: bytes, headers: dict[str, str]) -> web.Response:
    """`body`, gzipped (level 1: the fastest) when the client accepts it (tests/exporter/sidecar/http/test_gzip.py)."""
    headers["Vary"] = "Accept-Encoding"
    if accepts_gzip(request.headers.get("Accept-Encoding", "")):
        body = gzip.compress(body, compresslevel=1)
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=body, headers=headers)


def _gzipped(request: web.Request) -> bool:
    return accepts_gzip(request.headers.get("Accept-Encoding", ""))


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
    if request.app[HEALTH].ingest_listening:
        return web.Response(text="ready\n")
    return web.Response(status=503, text="ingest socket is not listening\n")


async def _ranks(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.Response(body=ranks_body(state, request.app[HEALTH]), headers={"Content-Type": "application/json; charset=utf-8"})


async def _status(request: web.Request) -> web.Response:
    # Sized by ranks, not series (docs/reliability.md): a page left open fetches it every 2 s, and
    # viewers within one housekeeping tick share one encoded copy (api.EncodedStatus).
    gzipped = accepts_gzip(request.headers.get("Accept-Encoding", ""))
    headers = {"Content-Type": "application/json; charset=utf-8", "Cache-Control": "no-store",
               "Vary": "Accept-Encoding"}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=request.app[ENCODED].body(gzipped), headers=headers)


async def _status_page(request: web.Request) -> web.Response:
    # The page's script fetches it every few seconds: viewers within one tick share one copy, as for the JSON.
    gzipped = _gzipped(request)
    headers = {"Content-Type": "text/html; charset=utf-8", "Cache-Control": "no-store", "Vary": "Accept-Encoding"}
    if gzipped:
        headers["Content-Encoding"] = "gzip"
    return web.Response(body=request.app[ENCODED].page(gzipped), headers=headers)


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The page's script and style sheet, read from package data once."""
    folder = resources.files("exporter.sidecar.http") / "static"
    return {name: ((folder / name).read_bytes(), kind) for name, kind in STATIC_FILES.items()}


async def _static(request: web.Request) -> web.Response:
    found = request.app[STATIC].get(request.match_info["name"])
    if found is None:
        raise web.HTTPNotFound()
    body, content_type = found
    return web.Response(body=body, content_type=content_type, charset="utf-8", headers={"Cache-Control": "no-cache"})


@web.middleware
async def _security_headers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every response, errors and 401s included, forbids sniffing, framing and any script or style
    that is not one of the page's own files (the page has no inline ones)."""
    try:
        response = await handler(request)
    except web.HTTPException as err:
        err.headers.update(SECURITY_HEADERS)
        raise
    response.headers.update(SECURITY_HEADERS)
    return response
