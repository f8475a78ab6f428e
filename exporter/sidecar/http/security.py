"""HTTP-side protection, as the Prometheus exporter-toolkit does it: TLS and bcrypt basic auth."""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import ssl
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web
from aiohttp.typedefs import Middleware

from exporter.config import TLSServerConfig
from exporter.errors import ConfigError

# Probes carry no credentials and reveal nothing; everything else needs them when users are set.
OPEN_PATHS = frozenset({"/-/healthy", "/-/ready"})
REALM = 'Basic realm="hicache-exporter", charset="UTF-8"'
MAX_CACHED = 1024
MAX_CONCURRENT_CHECKS = 2
MAX_WAITING_CHECKS = 64

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class BasicAuth:
    """Checks `Authorization: Basic` against bcrypt hashes, off the event loop.

    bcrypt costs tens of milliseconds by design; run on the event loop, eight clients sending
    wrong passwords held every probe for seconds. Checks run in a small thread pool, at most
    MAX_CONCURRENT_CHECKS at a time with at most MAX_WAITING_CHECKS queued behind them (more get
    429 at once), and successful credentials are remembered so that a scraper pays once.
    """

    def __init__(self, users: dict[str, str]) -> None:
        import bcrypt  # only needed when basic auth is configured

        self._bcrypt = bcrypt
        self.users = {user: hashed.encode() for user, hashed in users.items()}
        self._verified: set[bytes] = set()
        # Checked for unknown users, so that they cost the same time as known ones.
        self._dummy = bcrypt.hashpw(b"no such user", bcrypt.gensalt(10))
        self._pool = ThreadPoolExecutor(MAX_CONCURRENT_CHECKS, thread_name_prefix="bcrypt")
        self._slots = asyncio.Semaphore(MAX_CONCURRENT_CHECKS)
        self._waiting = 0

    async def allows(self, header: str | None) -> bool | None:
        """True or False; None when too many checks are already waiting (the caller answers 429)."""
        credentials = _credentials(header)
        if credentials is None:
            return False
        user, password = credentials
        token = hashlib.sha256(f"{user}\0{password}".encode()).digest()
        if token in self._verified:
            return True
        if self._waiting >= MAX_WAITING_CHECKS:
            return None
        self._waiting += 1
        try:
            async with self._slots:
                ok = await asyncio.get_running_loop().run_in_executor(self._pool, self._check, user, password)
        finally:
            self._waiting -= 1
        if ok:
            if len(self._verified) >= MAX_CACHED:
                self._verified.clear()
            self._verified.add(token)
        return ok

    def _check(self, user: str, password: str) -> bool:
        hashed = self.users.get(user)
        try:
            return bool(self._bcrypt.checkpw(password.encode(), hashed or self._dummy)) and hashed is not None
        except ValueError:
            return False

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _credentials(header: str | None) -> tuple[str, str] | None:
    if not header or not header.startswith("Basic "):
        return None
    try:
        decoded = base64.b64decode(header[6:], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


def auth_middleware(auth: BasicAuth) -> Middleware:
    """An aiohttp middleware answering 401 without valid credentials, except on the probe routes."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in OPEN_PATHS:
            return await handler(request)
        allowed = await auth.allows(request.headers.get("Authorization"))
        if allowed:
            return await handler(request)
        if allowed is None:
            return web.Response(status=429, text="Too many password checks at once; retry later\n",
                                headers={"Retry-After": "1"})
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
        context.verify_mode = ssl.CERT_OPTIONAL if tls.verifies_clients == "optional" else ssl.CERT_REQUIRED
    return context
