"""HTTP-side protection, as the Prometheus exporter-toolkit does it: TLS and bcrypt basic auth."""

from __future__ import annotations

import base64
import binascii
import hashlib
import ssl
from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware

from exporter.config import TLSServerConfig
from exporter.errors import ConfigError

# Probes carry no credentials and reveal nothing; everything else needs them when users are set.
OPEN_PATHS = frozenset({"/-/healthy", "/-/ready"})
REALM = 'Basic realm="hicache-exporter", charset="UTF-8"'
MAX_CACHED = 1024

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes; successful checks are cached (bcrypt is slow)."""

    def __init__(self, users: dict[str, str]) -> None:
        import bcrypt  # only needed when basic auth is configured

        self._bcrypt = bcrypt
        self.users = {user: hashed.encode() for user, hashed in users.items()}
        self._verified: set[bytes] = set()
        # Checked for unknown users, so that they cost the same time as known ones.
        self._dummy = bcrypt.hashpw(b"no such user", bcrypt.gensalt(10))

    def allows(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            decoded = base64.b64decode(header[6:], validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        user, sep, password = decoded.partition(":")
        if not sep:
            return False
        token = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if token in self._verified:
            return True
        hashed = self.users.get(user)
        try:
            ok = self._bcrypt.checkpw(password.encode(), hashed or self._dummy) and hashed is not None
        except ValueError:
            ok = False
        if ok:
            if len(self._verified) >= MAX_CACHED:
                self._verified.clear()
            self._verified.add(token)
        return ok


def auth_middleware(auth: BasicAuth) -> Middleware:
    """An aiohttp middleware answering 401 without valid credentials, except on the probe routes."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS or auth.allows(request.headers.get("Authorization")):
            return await handler(request)
        return web.Response(status=401, text="Unauthorized\n", headers={"WWW-Authenticate": REALM})

    return check


def server_ssl_context(tls: TLSServerConfig) -> ssl.SSLContext:
    """The server TLS context; file problems stop start-up with the file named."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3 if tls.min_version == "TLS13" else ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    except (OSError, ssl.SSLError) as err:
        raise ConfigError(f"http.tls_server_config: cannot load {tls.cert_file} / {tls.key_file}: {err}") from None
    if tls.client_ca_file is not None:
        try:
            context.load_verify_locations(str(tls.client_ca_file))
        except (OSError, ssl.SSLError) as err:
            raise ConfigError(f"http.tls_server_config.client_ca_file: cannot load {tls.client_ca_file}: {err}") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return context
