"""Reading a sidecar's status document over HTTP: where, with which credentials and TLS, and why not.

The standard library (urllib) and msgspec, which decodes the body into the model of
exporter.api.v1: the fetch path needs nothing beyond the sidecar's own dependencies. Every failure
becomes a `FetchFailed` with one line for the screen; nothing here raises past `fetch_status` except
a `HicacheExporterError` from `build_target` for bad flags.
"""

from __future__ import annotations

import base64
import http.client
import os
import socket
import ssl
import time
import urllib.error
import urllib.parse
import urllib.request
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import msgspec

from exporter import __version__
from exporter.api.v1 import API_VERSION, StatusDocument
from exporter.defaults import DEFAULT_PORT
from exporter.errors import HicacheExporterError

STATUS_PATH = "/api/v1/status"
DEFAULT_URL = f"http://127.0.0.1:{DEFAULT_PORT}"
ENV_PASSWORD = "HICACHE_EXPORTER_PASSWORD"
MAX_DOCUMENT_BYTES = 32 * 1024 * 1024  # a status of thousands of ranks is a few MiB; past this it is not a status
PASSWORD_IN_URL_WARNING = (f"warning: the password in --url is in the process list for every user of this host to "
                           f"read; pass --web.password-file FILE or ${ENV_PASSWORD} instead")
CREDENTIAL_HINT = f"pass --web.user with --web.password-file or ${ENV_PASSWORD}, or http://USER:PASSWORD@HOST:PORT"


@dataclass(frozen=True)
class Target:
    """One sidecar to poll: the status URL (no userinfo), its Authorization header and TLS context."""

    url: str  # the base URL as shown on screen, without credentials
    status_url: str
    user: str | None = None
    authorization: str | None = None
    ssl_context: ssl.SSLContext | None = None
    password_in_url: bool = False  # http://USER:PASSWORD@HOST: the password is in the process list


class FailureKind(str, Enum):
    """Why a poll brought no document; each kind says something different to the operator."""

    UNREACHABLE = "unreachable"  # no HTTP answer: refused, timed out, DNS, TLS
    UNAUTHORIZED = "unauthorized"  # 401: credentials missing or wrong
    HTTP = "http"  # another HTTP status (404 from an older sidecar, 429, 5xx)
    INVALID = "invalid"  # an answer that is not a status document
    ERROR = "error"  # the poll itself raised: a bug in top, said on screen instead of ending the polls


@dataclass(frozen=True)
class Fetched:
    """A status document and when it was read (wall clock) and how long the request took."""

    document: StatusDocument
    at: float
    seconds: float


@dataclass(frozen=True)
class FetchFailed:
    """A poll that brought no document, with the one line the screen shows."""

    kind: FailureKind
    message: str
    at: float

    @property
    def line(self) -> str:
        return f"{self.kind.value}: {self.message}"


FetchResult = Fetched | FetchFailed


def build_target(
    url: str, user: str | None = None, password_file: Path | None = None, *, insecure: bool = False,
    ca_file: Path | None = None, cert_file: Path | None = None, key_file: Path | None = None,
    env: dict[str, str] | None = None,
) -> Target:
    """The Target that flags, environment and URL userinfo describe; one-line HicacheExporterError if they cannot."""
    env = dict(os.environ) if env is None else env
    parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    if parts.scheme not in ("http", "https"):
        raise HicacheExporterError(f"--url {url!r}: only http:// and https:// are supported")
    try:
        hostname, port = parts.hostname, parts.port  # .port raises on a non-numeric or out-of-range port
    except ValueError as err:
        raise HicacheExporterError(f"--url {url!r}: {err}") from None
    if not hostname:
        raise HicacheExporterError(f"--url {url!r}: no host")
    url_user = urllib.parse.unquote(parts.username) if parts.username is not None else None
    url_password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    # Flags beat the environment, which beats the URL's userinfo (as serve's flags beat its env and file).
    password: str | None = None
    if password_file is not None:
        try:
            password = password_file.read_text(encoding="utf-8").rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as err:
            raise HicacheExporterError(f"--web.password-file {password_file}: cannot read it ({_reason(err)})") from None
    elif env.get(ENV_PASSWORD):
        password = env[ENV_PASSWORD]
    else:
        password = url_password
    user = user if user is not None else url_user
    if password is not None and not user:
        raise HicacheExporterError("a password was given but no user: pass --web.user or http://USER@HOST:PORT")
    if user and password is None:
        raise HicacheExporterError(f"user {user!r} needs a password: --web.password-file FILE or ${ENV_PASSWORD}")
    if user is not None and ":" in user:
        raise HicacheExporterError("a basic-auth user name cannot contain ':'")
    authorization = None
    if user:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        authorization = f"Basic {token}"
    context = None
    if parts.scheme == "https":
        context = _client_ssl_context(insecure, ca_file, cert_file, key_file)
    elif insecure or ca_file or cert_file or key_file:
        raise HicacheExporterError("--insecure, --ca-file, --cert-file and --key-file are for https:// URLs")
    host = f"[{hostname}]" if ":" in hostname else hostname
    netloc = host if port is None else f"{host}:{port}"
    base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    return Target(url=base, status_url=base + STATUS_PATH, user=user or None, authorization=authorization,
                  ssl_context=context, password_in_url=url_password is not None)


def _client_ssl_context(insecure: bool, ca_file: Path | None, cert_file: Path | None, key_file: Path | None) -> ssl.SSLContext:
    if key_file is not None and cert_file is None:
        raise HicacheExporterError("--key-file needs --cert-file")
    try:
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    except (OSError, ssl.SSLError) as err:
        raise HicacheExporterError(f"--ca-file {ca_file}: cannot load it ({_reason(err)})") from None
    if insecure:
        context.check_hostname = False  # must go before verify_mode, which ssl refuses to relax otherwise
        context.verify_mode = ssl.CERT_NONE
    if cert_file is not None:
        try:
            context.load_cert_chain(str(cert_file), str(key_file) if key_file is not None else None)
        except (OSError, ssl.SSLError) as err:
            raise HicacheExporterError(f"--cert-file {cert_file}: cannot load it ({_reason(err)})") from None
    return context


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A sidecar never redirects; following one would send the Authorization header elsewhere."""

    def redirect_request(self, req: urllib.request.Request, fp: Any, code: int, msg: str, headers: Any,
                         newurl: str) -> None:
        return None


def fetch_status(target: Target, timeout: float, clock: Callable[[], float] = time.time) -> FetchResult:
    """One GET of the status document: a Fetched, or a FetchFailed that says why in one line."""
    started = time.monotonic()
    handlers: list[urllib.request.BaseHandler] = [_NoRedirects()]
    if target.ssl_context is not None:
        handlers.append(urllib.request.HTTPSHandler(context=target.ssl_context))
    opener = urllib.request.build_opener(*handlers)
    # gzip: the document compresses about tenfold, and top polls it over the network (BENCHMARKS.md, Fast paths).
    opener.addheaders = [("User-Agent", f"hicache-exporter-top/{__version__}"), ("Accept", "application/json"),
                         ("Accept-Encoding", "gzip")]
    request = urllib.request.Request(target.status_url)
    if target.authorization is not None:
        request.add_header("Authorization", target.authorization)
    try:
        with opener.open(request, timeout=timeout) as response:
            body = response.read(MAX_DOCUMENT_BYTES + 1)
            encoding = (response.headers.get("Content-Encoding") or "").strip().lower()
    except urllib.error.HTTPError as err:
        err.close()
        return FetchFailed(*_http_failure(target, err.code, err.headers.get("Location")), at=clock())
    except urllib.error.URLError as err:
        return FetchFailed(FailureKind.UNREACHABLE, _unreachable(target, err.reason, timeout), at=clock())
    except (OSError, ValueError) as err:  # a timeout or reset while reading the body; a malformed status line
        return FetchFailed(FailureKind.UNREACHABLE, _unreachable(target, err, timeout), at=clock())
    seconds = time.monotonic() - started
    if encoding in ("gzip", "x-gzip") and len(body) <= MAX_DOCUMENT_BYTES:
        try:
            body = _gunzip(body, MAX_DOCUMENT_BYTES + 1)
        except (OSError, EOFError, zlib.error) as err:
            return FetchFailed(FailureKind.INVALID, f"{target.status_url} sent broken gzip ({err})", at=clock())
    if len(body) > MAX_DOCUMENT_BYTES:
        return FetchFailed(FailureKind.INVALID, f"{target.status_url} sent more than {MAX_DOCUMENT_BYTES} bytes",
                           at=clock())
    return received(body, target.status_url, clock(), seconds)


class _Versioned(msgspec.Struct):
    """Just the api_version of a body, whatever else it holds: to say so when a sidecar speaks another."""

    api_version: object = None


def received(body: bytes, status_url: str, at: float, seconds: float = 0.0) -> FetchResult:
    """A body as the status document (exporter.api.v1.StatusDocument), or the one line saying why it is not one."""
    try:
        document = msgspec.json.decode(body, type=StatusDocument)
    except RecursionError:  # [[[[... past the decoder's depth: not a status, whatever else it is
        return FetchFailed(FailureKind.INVALID, f"{status_url} sent JSON nested too deeply to read", at=at)
    except msgspec.ValidationError as err:  # JSON, but not this version's status document (a DecodeError too)
        return FetchFailed(FailureKind.INVALID, _mismatch(body, status_url, err), at=at)
    except msgspec.DecodeError as err:  # not JSON, NaN or Infinity, a control character in a string
        return FetchFailed(FailureKind.INVALID, f"{status_url} did not send JSON ({str(err)[:200]})", at=at)
    if document.api_version != API_VERSION:
        return FetchFailed(FailureKind.INVALID, _other_version(status_url, document.api_version), at=at)
    return Fetched(document, at=at, seconds=seconds)


def _mismatch(body: bytes, status_url: str, err: msgspec.ValidationError) -> str:
    try:
        version = msgspec.json.decode(body, type=_Versioned).api_version
    except msgspec.ValidationError:
        return f"{status_url} sent JSON that is not an object"
    except RecursionError:
        return f"{status_url} sent JSON nested too deeply to read"
    except msgspec.DecodeError as malformed:  # the first decode stopped at a wrong type before the break
        return f"{status_url} did not send JSON ({str(malformed)[:200]})"
    if version != API_VERSION:
        return _other_version(status_url, version)
    return f"{status_url} sent a status document this top cannot read: {str(err)[:200]}"


def _other_version(status_url: str, version: object) -> str:
    return f"{status_url} speaks api_version {str(version)[:20]}; this top reads {API_VERSION}"


def _gunzip(data: bytes, limit: int) -> bytes:
    """gzip-decoded `data`, at most `limit` bytes of it (a small body can inflate without bound)."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)  # 16+: expect the gzip header and trailer
    body = inflater.decompress(data, limit)
    if len(body) < limit and not inflater.eof:
        raise EOFError("the gzip stream ends early")
    return body


def _http_failure(target: Target, code: int, location: str | None) -> tuple[FailureKind, str]:
    if code == 401:
        if target.user is None:
            return FailureKind.UNAUTHORIZED, f"{target.url} needs credentials (HTTP 401): {CREDENTIAL_HINT}"
        return FailureKind.UNAUTHORIZED, f"{target.url} refused user {target.user!r} (HTTP 401): check the password"
    if code == 404:
        return FailureKind.HTTP, f"{target.status_url} not found (HTTP 404): is this a hicache-exporter new enough to serve it?"
    if code == 429:
        return FailureKind.HTTP, f"{target.url} is busy checking passwords (HTTP 429); retrying"
    if 300 <= code < 400:
        return FailureKind.HTTP, f"{target.status_url} redirects (HTTP {code}) to {location or '?'}; not followed"
    return FailureKind.HTTP, f"{target.status_url} answered HTTP {code}"


def _unreachable(target: Target, reason: object, timeout: float) -> str:
    where = target.url
    if isinstance(reason, (TimeoutError, socket.timeout)):
        return f"{where}: no answer within {timeout:g} s"
    if isinstance(reason, ConnectionRefusedError):
        return f"{where}: connection refused"
    if isinstance(reason, socket.gaierror):
        return f"{where}: the host does not resolve ({reason.strerror})"
    if isinstance(reason, ssl.SSLCertVerificationError):
        return f"{where}: TLS: {reason.verify_message or reason} (pass --ca-file, or --insecure)"
    if isinstance(reason, ssl.SSLError):
        plain = " (does it serve plain http://?)" if reason.reason == "WRONG_VERSION_NUMBER" else ""
        return f"{where}: TLS: {reason.reason or reason}{plain}"
    if isinstance(reason, http.client.RemoteDisconnected) and target.ssl_context is None:
        return f"{where}: {_reason(reason)} (does it serve https://?)"  # what a TLS port does to plain HTTP
    return f"{where}: {_reason(reason)}"


def _reason(err: object) -> str:
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    text = str(err)
    return text or type(err).__name__
