"""Response bodies in flight: a byte budget across connections, and a deadline for each write.

aiohttp writes a `web.Response`'s body into the transport, and the transport holds what the peer
has not read yet; a client that asks for /metrics and never reads pins that body for as long as it
keeps the connection. 512 such clients (http.max_connections) would pin gigabytes. This middleware
writes every large body itself, in slices that wait for the peer to drain (so the transport never
holds more than about one slice beside the body), counts it against
http.max_response_bytes_in_flight from when it is built until the last slice is drained, and closes
a connection whose body is not sent within http.write_timeout_seconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

# Bodies below this are not counted: the transport takes them whole (its high-water mark is
# 64 KiB), and probes, 401s and the static files stay answerable when the budget is spent.
COUNTED_BODY_BYTES = 64 << 10
# Written a slice at a time: each write waits for drain once the transport holds more than 64 KiB.
SLICE_BYTES = 64 << 10
RETRY_AFTER_SECONDS = 1


class BodyBudget:
    """Bytes of large response bodies built and not yet taken by their peers.

    A body is admitted while the total stays within `limit`, and always when nothing is in flight,
    so that one body larger than the whole budget is still served, alone. `expected` remembers the
    last size a route answered with, so that a request likely to overflow is refused before its
    body is built."""

    def __init__(self, limit: int, write_timeout: float) -> None:
        self.limit = limit
        self.write_timeout = write_timeout  # seconds a counted body may take to be sent
        self.in_flight = 0
        self.expected: dict[tuple[str, bool], int] = {}

    def admits(self, size: int) -> bool:
        return self.in_flight == 0 or self.in_flight + size <= self.limit


def refusal() -> web.Response:
    return web.Response(status=503, text="too many response bytes in flight (http.max_response_bytes_in_flight); "
                        "retry shortly\n", headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def bodies_in_flight(budget: BodyBudget, extra_headers: dict[str, str],
                     gzipped: Callable[[web.Request], bool]) -> Middleware:
    """The middleware; it should be the outermost, so that every other one's headers are on the
    response before it is written. `extra_headers` go on its own 503s; `gzipped` tells whether a
    request will get a gzipped body (its size is remembered apart)."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        resource = request.match_info.route.resource
        key = (resource.canonical if resource is not None else "", gzipped(request))
        if not budget.admits(budget.expected.get(key, 0)):  # refused before the body is built
            return _refused(extra_headers)
        response = await handler(request)
        body = response.body if isinstance(response, web.Response) and not response.prepared else None
        if not isinstance(body, bytes) or len(body) < COUNTED_BODY_BYTES or request.method == "HEAD":
            return response
        size = len(body)
        budget.expected[key] = size
        if not budget.admits(size):  # larger than the route's last body: built, then dropped
            return _refused(extra_headers)
        budget.in_flight += size
        stream = web.StreamResponse(status=response.status, reason=response.reason, headers=response.headers)
        stream.content_length = size

        async def send() -> None:
            await stream.prepare(request)
            view = memoryview(body)
            for start in range(0, size, SLICE_BYTES):
                await stream.write(view[start:start + SLICE_BYTES])
            await stream.write_eof()

        try:
            await asyncio.wait_for(send(), budget.write_timeout)  # not asyncio.timeout: the package runs on 3.10
        except asyncio.TimeoutError:  # a peer reading too slowly, or not at all: drop what it has not taken
            if request.transport is not None:
                request.transport.abort()
        except ConnectionError:  # the peer went away; aiohttp closes the connection when it sees it
            pass
        finally:
            budget.in_flight -= size
        return stream

    return middleware


def _refused(extra_headers: dict[str, str]) -> web.Response:
    response = refusal()
    response.headers.update(extra_headers)
    return response
