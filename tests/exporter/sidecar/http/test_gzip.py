"""The sidecar's own gzip negotiation (http/app.py `accepts_gzip`) against the plain ways.

The plain ways are prometheus_client's `gzip_accepted` (its own exposition server's check) and
aiohttp's `Response.enable_compression()`. Where a header has no q-values, no `*` and offers no
other coding they would pick, the sidecar decides exactly as both do; where they misread RFC 9110
(a substring or name test that ignores `q=0` and `*`), the row says how, and the sidecar follows
the RFC. The body it sends, decompressed, is byte for byte the one it sends uncompressed, and the
one aiohttp's compression carries.
"""

from __future__ import annotations

import asyncio
import gzip
import zlib
from pathlib import Path

import pytest
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestServer
from prometheus_client.exposition import gzip_accepted

from exporter.catalog import default_catalog
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.http.app import accepts_gzip, build_app
from tests.helpers import sidecar_config

BODY = (Path(__file__).parents[1] / "golden" / "metrics.txt").read_bytes()  # a full exposition, over 64 KiB
AGREE = None  # the plain ways decide as the sidecar does

# Accept-Encoding, whether the sidecar gzips (RFC 9110 section 12.5.3), and how the plain ways differ.
ROWS: list[tuple[str, bool, str | None]] = [
    ("", False, AGREE),
    ("gzip", True, AGREE),  # what a Prometheus server sends
    ("GZIP", True, AGREE),
    ("gzip, br", True, AGREE),
    ("br", False, AGREE),
    ("identity", False, AGREE),
    ("identity, gzip", True, AGREE),
    ("gzip;q=1.0", True, AGREE),
    ("gzip;q=0.5, identity;q=1", True, AGREE),
    ("*;q=0", False, AGREE),
    ("gzip;q=0", False, "they see the name and compress; q=0 means not acceptable"),
    ("gzip; q=0.000", False, "they see the name and compress; q=0 means not acceptable"),
    ("gzip;q=x", False, "they see the name and compress; a q-value that does not parse is no weight"),
    ("gzip;q=0, *", False, "they see the name; a named coding's q=0 overrides `*`"),
    ("*", True, "they know only a named gzip; `*` accepts any coding"),
    ("br;q=1, *;q=0.1", True, "they know only a named gzip; `*` accepts any coding not named"),
    ("x-gzip", True, "prometheus_client does not know x-gzip, the alias RFC 9110 keeps"),
    ("deflate, gzip;q=0.5", True, "aiohttp picks deflate, the first coding of its own list that it finds"),
]


class FixedBody(TextRenderer):
    """The same body on every scrape, so that two answers can be compared byte for byte."""

    def render(self, openmetrics: bool = False) -> bytes:
        return BODY


async def _plain(request: web.Request) -> web.Response:
    response = web.Response(body=BODY, content_type="text/plain")
    response.enable_compression()  # aiohttp's own negotiation
    return response


async def _answers(socket_dir: Path) -> dict[str, dict[str, tuple[str | None, bytes]]]:
    """Each header's (Content-Encoding, decoded body) from the sidecar's /metrics and from aiohttp's plain way."""
    state = SidecarState(default_catalog())
    stats = SidecarHealth()
    sidecar = build_app(sidecar_config(socket_dir / "s.sock"), state, stats,
                        FixedBody(SidecarCollector(state, stats, "sglang_")))
    plain = web.Application()
    plain.router.add_get("/metrics", _plain)
    answers: dict[str, dict[str, tuple[str | None, bytes]]] = {}
    async with TestServer(sidecar) as sidecar_server, TestServer(plain) as plain_server, \
            ClientSession(auto_decompress=False) as session:
        for name, server in (("sidecar", sidecar_server), ("aiohttp", plain_server)):
            for header, _, _ in ROWS:
                async with session.get(server.make_url("/metrics"), headers={"Accept-Encoding": header}) as response:
                    assert response.status == 200
                    coding = response.headers.get("Content-Encoding")
                    raw = await response.read()
                decoded = {"gzip": gzip.decompress, "deflate": zlib.decompress}.get(coding or "", lambda b: b)(raw)
                answers.setdefault(name, {})[header] = (coding, decoded)
                if name == "sidecar":
                    assert response.headers["Vary"] == "Accept-Encoding"
    return answers


@pytest.fixture(scope="module")
def answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, tuple[str | None, bytes]]]:
    return asyncio.run(_answers(tmp_path_factory.mktemp("gzip")))


@pytest.mark.parametrize(("header", "gzipped", "differs"), ROWS)
def test_the_sidecar_gzips_as_the_plain_ways_do_unless_they_misread_the_rfc(
    answers: dict[str, dict[str, tuple[str | None, bytes]]], header: str, gzipped: bool, differs: str | None,
) -> None:
    assert accepts_gzip(header) is gzipped
    coding, body = answers["sidecar"][header]
    assert coding == ("gzip" if gzipped else None)
    assert body == BODY  # decompressed, exactly the uncompressed body
    plain_coding, plain_body = answers["aiohttp"][header]
    assert plain_body == BODY
    if differs is AGREE:
        assert gzip_accepted(header) is gzipped
        assert plain_coding == coding
    else:  # the reason is real: one of the plain ways answers otherwise
        assert gzip_accepted(header) is not gzipped or plain_coding != coding, differs
