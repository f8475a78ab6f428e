"""Sidecar configuration: strict pydantic models, loaded from defaults, a file, env and flags."""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exporter.catalog import load_yaml
from exporter.defaults import DEFAULT_LOG_LEVEL, DEFAULT_PORT, DEFAULT_SOCKET_PATH, ENV_CONFIG, ENV_PORT, ENV_SOCKET, LogLevel
from exporter.errors import ConfigError, quoted

NAMESPACE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)?$")


class _Strict(BaseModel):
    # allow_inf_nan=False: a YAML .inf or .nan is no duration, size or count (an infinite timeout never fires)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def _path_is_given(value: Any) -> Any:
    """An empty path is refused, not read as the current directory (an unset $VAR in a manifest gives one)."""
    if isinstance(value, str) and not value.strip():
        raise ValueError("the path must not be empty (an unset variable?)")
    return value


def _parse_mode(value: Any) -> int:
    """File modes may be written as octal strings ("0660") or integers."""
    if isinstance(value, str):
        try:
            value = int(value, 8)
        except ValueError:
            raise ValueError(f"{value!r} is not an octal file mode like \"0660\"") from None
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= 0o777:
        raise ValueError("a file mode must be between 0000 and 0777")
    return value


BCRYPT_RE = re.compile(r"^\$2[aby]\$\d{2}\$[./A-Za-z0-9]{53}$")


ClientAuthType = Literal["NoClientCert", "RequestClientCert", "RequireAnyClientCert", "RequireClientCert",
                         "VerifyClientCertIfGiven", "RequireAndVerifyClientCert"]
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")


class TLSServerConfig(_Strict):
    """TLS for the HTTP side, named as in the Prometheus exporter-toolkit web config."""

    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # the CA that signs client certificates (mutual TLS)
    # exporter-toolkit's policy names; unset with a client CA: RequireAndVerifyClientCert
    client_auth_type: ClientAuthType | None = None
    min_version: Literal["TLS12", "TLS13"] = "TLS12"

    @model_validator(mode="after")
    def _client_auth(self) -> TLSServerConfig:
        policy = self.client_auth_type
        if policy in UNVERIFIED_CLIENT_AUTH:
            raise ValueError(f"client_auth_type {policy} asks for a client certificate without verifying it, which "
                             "Python's TLS cannot do; use VerifyClientCertIfGiven or RequireAndVerifyClientCert "
                             "with client_ca_file")
        if policy in ("VerifyClientCertIfGiven", "RequireAndVerifyClientCert") and self.client_ca_file is None:
            raise ValueError(f"client_auth_type {policy} needs client_ca_file, the CA that signs client certificates")
        if policy == "NoClientCert" and self.client_ca_file is not None:
            raise ValueError("client_ca_file is set but client_auth_type is NoClientCert; "
                             "set client_auth_type to RequireAndVerifyClientCert or drop client_ca_file")
        return self

    @property
    def verifies_clients(self) -> Literal["required", "optional", "no"]:
        """Whether a client certificate is required, verified when given, or not asked for."""
        if self.client_ca_file is None:
            return "no"
        return "optional" if self.client_auth_type == "VerifyClientCertIfGiven" else "required"


class HttpConfig(_Strict):
    """Where /metrics and the health routes listen, and who may read them."""

    host: str = "0.0.0.0"
    port: int = Field(DEFAULT_PORT, ge=0, le=65535)
    tls_server_config: TLSServerConfig | None = None
    # user name -> bcrypt hash (as exporter-toolkit's basic_auth_users); empty: no authentication
    basic_auth_users: dict[str, str] = Field(default_factory=dict)
    max_connections: int = Field(512, ge=1)  # open HTTP connections; more are answered 503 and closed
    idle_timeout_seconds: float = Field(15.0, gt=0)  # a connection with no complete request for this long is closed
    # large response bodies built and not yet read by their clients, all connections together; past
    # it a request is answered 503 with Retry-After (docs/reliability.md budgets it)
    max_response_bytes_in_flight: int = Field(48 << 20, ge=1)
    write_timeout_seconds: float = Field(30.0, gt=0)  # a response not fully sent in this long closes its connection

    @field_validator("basic_auth_users")
    @classmethod
    def _hashes_are_bcrypt(cls, users: dict[str, str]) -> dict[str, str]:
        for user, hashed in users.items():
            if not user or ":" in user:
                raise ValueError(f"user name {user!r} must be non-empty and contain no ':'")
            if not BCRYPT_RE.match(hashed):
                raise ValueError(f"the password of {user!r} must be a bcrypt hash ($2b$...), not plain text")
        return users


class IngestConfig(_Strict):
    """The Unix socket ranks push to, and its limits."""

    socket_path: Path = Path(DEFAULT_SOCKET_PATH)
    socket_mode: int = 0o660
    dir_mode: int = 0o750
    max_frame_bytes: int = Field(1 << 20, ge=64, le=64 << 20)
    max_buffered_bytes: int = Field(32 << 20, ge=64)  # partial frames of every connection together
    max_connections: int = Field(1024, ge=1)
    hello_timeout_seconds: float = Field(5.0, gt=0)
    idle_timeout_seconds: float = Field(120.0, gt=0)
    allowed_uids: tuple[int, ...] | None = None

    _modes = field_validator("socket_mode", "dir_mode", mode="before")(_parse_mode)
    _socket_path = field_validator("socket_path", mode="before")(_path_is_given)


class RanksConfig(_Strict):
    """When a silent rank turns stale, then expires; per-rank bounds."""

    stale_after_seconds: float = Field(10.0, gt=0)
    expire_after_seconds: float = Field(300.0, gt=0)
    max_series_per_rank: int = Field(4096, ge=1)
    # a static label holds a model path (LMCache's model_name is vLLM's, a Hugging Face snapshot path)
    max_label_value_length: int = Field(1024, ge=1, le=4096)
    # A family's own label values (pool, reason, mode) are an engine's short words, one per series: a bound far
    # below the static labels' keeps what the series budget may hold (docs/reliability.md, "Memory budget").
    max_family_label_value_length: int = Field(128, ge=1, le=4096)
    # Every per-rank line on /metrics carries the rank's static labels: their values together are held to two
    # model paths (LMCache labels model_name and served_model_name, vLLM's path twice) and a few short words.
    max_static_label_chars: int = Field(2304, ge=1, le=32768)
    max_static_labels: int = Field(8, ge=0, le=64)
    # Rank and rollup series together, each weighed by its buckets and by the label characters its lines
    # write (sidecar/core/keys.py, series_cost): sized to a 320 Mi pod whatever the labels (docs/reliability.md).
    max_series_total: int = Field(24_576, ge=1)
    max_ranks: int = Field(1024, ge=1)  # rank identities remembered (expired ones are forgotten first)
    # A server over several nodes (a LeaderWorkerSet group): this sidecar sees only its own node's
    # ranks, so it expects only those, by the engine's own placement (nodes: sglang's --nnodes,
    # node_rank: its --node-rank; in a LeaderWorkerSet LWS_GROUP_SIZE and LWS_WORKER_INDEX).
    nodes: int = Field(1, ge=1, le=4096)
    node_rank: int = Field(0, ge=0)

    @model_validator(mode="after")
    def _expire_after_stale(self) -> RanksConfig:
        if self.expire_after_seconds < self.stale_after_seconds:
            raise ValueError("expire_after_seconds must be at least stale_after_seconds")
        if self.node_rank >= self.nodes:
            raise ValueError(f"node_rank {self.node_rank} must be below nodes ({self.nodes})")
        return self


class MetricsConfig(_Strict):
    """Exported names and the catalog that defines the families."""

    namespace: str = "sglang_"
    catalog: Path | None = None
    # Engine profiles served beside the default one (metrics.catalog's): a packaged profile's name
    # (lmcache) or a profile YAML file. An upstream's `profile` is served without being listed here.
    profiles: tuple[Annotated[str, Field(min_length=1)], ...] = ()
    # False: only rollups (and derived gauges) of the catalog families on /metrics, no per-rank
    # series; the JSON view and the status page still list every rank.
    per_rank_series: bool = True

    @field_validator("namespace")
    @classmethod
    def _namespace_is_a_name_prefix(cls, value: str) -> str:
        if not NAMESPACE_RE.match(value):
            raise ValueError(f"{value!r} is not a valid metric name prefix")
        return value


class RollupConfig(_Strict):
    """The window behind active bandwidth and replica spread."""

    window_seconds: float = Field(60.0, gt=0)


# Prometheus' duration syntax: units from the largest down, each at most once (`1m30s`, `500ms`, `5s`).
DURATION_RE = re.compile(r"^(?:(\d+)y)?(?:(\d+)w)?(?:(\d+)d)?(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?(?:(\d+)ms)?$")
DURATION_UNITS_MS = (365 * 86_400_000, 7 * 86_400_000, 86_400_000, 3_600_000, 60_000, 1000, 1)
# Prometheus holds a duration in int64 nanoseconds: nothing longer (about 292 years) is one.
MAX_DURATION_MS = (2**63 - 1) // 1_000_000


def parse_duration(text: str) -> float:
    """Seconds of a Prometheus duration (`5s`, `1m30s`, `250ms`); ValueError naming the syntax or the range otherwise."""
    shown = quoted(text)
    match = DURATION_RE.match(text)
    if not text or match is None:
        raise ValueError(f"{shown} is not a duration like 5s, 1m30s or 500ms (Prometheus' syntax)")
    numbers = [(n, unit) for n, unit in zip(match.groups(), DURATION_UNITS_MS) if n]
    # len(): int() of thousands of digits is refused by Python itself, and no such number is in range
    if any(len(n) > 20 for n, _ in numbers) or sum(int(n) * unit for n, unit in numbers) > MAX_DURATION_MS:
        raise ValueError(f"{shown} is longer than the longest duration Prometheus takes (292y)")
    return sum(int(n) * unit for n, unit in numbers) / 1000


class PersistenceConfig(_Strict):
    """The durable state: where it is kept and how often it is written (no file: nothing is kept)."""

    file: Path | None = None
    interval: str = "5s"

    @field_validator("file", mode="before")
    @classmethod
    def _names_a_file(cls, value: Any) -> Any:
        _path_is_given(value)
        if isinstance(value, str) and Path(value).name in ("", ".", ".."):
            raise ValueError(f"{value!r} names a directory, not the state file")
        return value

    @field_validator("interval")
    @classmethod
    def _interval_is_a_duration(cls, value: str) -> str:
        if parse_duration(value) <= 0:
            raise ValueError(f"{value!r}: the interval must be longer than zero")
        return value

    @property
    def interval_seconds(self) -> float:
        return parse_duration(self.interval)


class UpstreamBasicAuth(_Strict):
    """HTTP basic authentication towards an upstream; the password inline or read from a file."""

    username: str = Field(min_length=1)
    password: str | None = None
    password_file: Path | None = None

    @model_validator(mode="after")
    def _one_password(self) -> UpstreamBasicAuth:
        if (self.password is None) == (self.password_file is None):
            raise ValueError("give exactly one of password and password_file")
        return self


class UpstreamTLS(_Strict):
    """TLS towards an https upstream."""

    ca_file: Path | None = None  # None: the system's trust store
    cert_file: Path | None = None  # a client certificate, with key_file
    key_file: Path | None = None
    insecure_skip_verify: bool = False

    @model_validator(mode="after")
    def _cert_with_key(self) -> UpstreamTLS:
        if (self.cert_file is None) != (self.key_file is None):
            raise ValueError("cert_file and key_file go together")
        return self


class UpstreamWorld(_Strict):
    """The parallel layout of an upstream's server, as its engine was started: what makes its ranks
    expected (docs/api.md). What is left out the engine's storage labels fill in (pp_size,
    attn_cp_size), else 1. The attention tp size is the engine's: tp_size / (dp_size x attn_cp_size)
    with DP attention, tp_size / attn_cp_size without (sglang runtime_context.derive_attn_tp_size)."""

    tp_size: int = Field(ge=1, le=65536)
    dp_size: int = Field(1, ge=1, le=65536)
    pp_size: int | None = Field(None, ge=1, le=65536)
    attn_cp_size: int | None = Field(None, ge=1, le=65536)
    dp_attention: bool = False

    @model_validator(mode="after")
    def _divides(self) -> UpstreamWorld:
        if self.dp_attention and self.tp_size % (self.dp_size * (self.attn_cp_size or 1)):
            raise ValueError(f"with dp_attention, tp_size {self.tp_size} must be a multiple of dp_size x attn_cp_size")
        if not self.dp_attention and self.tp_size % (self.attn_cp_size or 1):
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of attn_cp_size")
        return self


# `--upstream-world SPEC`: its keys, as the fields of UpstreamWorld they set.
WORLD_SPEC_KEYS = {"tp": "tp_size", "dp": "dp_size", "pp": "pp_size", "cp": "attn_cp_size"}
WORLD_SPEC_FLAG = "dp-attention"
WORLD_SPEC_FORM = "tp=N[,dp=N][,pp=N][,cp=N][,dp-attention]"


def parse_upstream_world(spec: str) -> dict[str, Any]:
    """`tp=4,dp=2,pp=2,cp=1,dp-attention` as an upstream's `world:` mapping (ConfigError, one line, where it is not one)."""
    def bad(why: str) -> ConfigError:
        shown = spec if len(spec) <= 80 else spec[:80] + "..."
        return ConfigError(f"--upstream-world {shown!r}: {why}; the form is {WORLD_SPEC_FORM}")

    world: dict[str, Any] = {}
    for item in spec.split(","):
        key, sep, value = item.strip().partition("=")
        if not sep and key == WORLD_SPEC_FLAG:
            world["dp_attention"] = True
            continue
        field = WORLD_SPEC_KEYS.get(key)
        if field is None or not sep:
            shown_key = key if len(key) <= 20 else key[:20] + "..."
            raise bad(f"{shown_key!r} is not one of {', '.join([*WORLD_SPEC_KEYS, WORLD_SPEC_FLAG])}")
        if field in world:
            raise bad(f"{key} is given twice")
        if not value.isascii() or not value.isdigit():
            raise bad(f"{key} must be a whole number")
        # a number of thousands of digits is refused by int() itself; none past 65536 is a size
        world[field] = int(value) if len(value) <= 20 else 1 << 64
    try:
        UpstreamWorld.model_validate(world, strict=True)
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        names = {v: k for k, v in WORLD_SPEC_KEYS.items()}
        message = str(first["msg"]).removeprefix("Value error, ")  # a model validator's, as pydantic words it
        raise bad(f"{names.get(where, where) + ': ' if where else ''}{message}") from None
    return world


class UpstreamConfig(_Strict):
    """One engine the sidecar reads as a proxy: its /metrics URL, or its prometheus_client multiprocess directory."""

    name: str | None = Field(None, min_length=1, max_length=128)  # the `upstream` label; default: the URL or directory
    url: str | None = None
    multiprocess_dir: Path | None = None
    interval_seconds: float = Field(5.0, gt=0)
    # unset: 3 s, at most interval_seconds (Prometheus clamps its default scrape_timeout so)
    timeout_seconds: float = Field(3.0, gt=0)
    format: Literal["text", "openmetrics"] = "text"  # which exposition to ask a URL upstream for
    # The engine profile whose families the upstream serves (sglang, lmcache, or a profile file); None:
    # the default profile (metrics.catalog's, sglang unless that file says otherwise).
    profile: str | None = Field(None, min_length=1)
    prefix: str | None = None  # stripped from the upstream's names to find its families; default: the profile's
    headers: dict[str, str] = Field(default_factory=dict)
    basic_auth: UpstreamBasicAuth | None = None
    tls: UpstreamTLS | None = None
    labels: dict[str, str] = Field(default_factory=dict)  # static labels added to every rank of this upstream
    pass_through: bool = True  # families outside the catalog are re-exposed unchanged
    follow_redirects: bool = False  # true: same-origin redirects only (credentials never go to another origin)
    world: UpstreamWorld | None = None  # the engine's layout: its ranks are expected; None: only the ones seen

    _multiprocess_dir = field_validator("multiprocess_dir", mode="before")(_path_is_given)

    @model_validator(mode="after")
    def _one_source(self) -> UpstreamConfig:
        if (self.url is None) == (self.multiprocess_dir is None):
            raise ValueError("give exactly one of url and multiprocess_dir")
        if self.url is not None and not re.match(r"^https?://[^/\s]+", self.url):
            raise ValueError(f"url {self.url!r} must be an http:// or https:// URL")
        if self.multiprocess_dir is not None and (self.basic_auth or self.tls or self.headers or self.follow_redirects):
            raise ValueError("headers, basic_auth, tls and follow_redirects apply to a url upstream only")
        if "timeout_seconds" not in self.model_fields_set:
            object.__setattr__(self, "timeout_seconds", min(self.timeout_seconds, self.interval_seconds))
        elif self.timeout_seconds > self.interval_seconds:
            raise ValueError(f"timeout_seconds {self.timeout_seconds:g} must not exceed interval_seconds "
                             f"{self.interval_seconds:g}")
        if self.prefix is not None and not NAMESPACE_RE.match(self.prefix):
            raise ValueError(f"prefix {self.prefix!r} is not a valid metric name prefix")
        return self

    @property
    def label(self) -> str:
        """The value of the `upstream` label: the configured name, else the URL or directory."""
        return self.name or self.url or str(self.multiprocess_dir)


class SidecarConfig(_Strict):
    """The whole sidecar config."""

    http: HttpConfig = HttpConfig()
    ingest: IngestConfig = IngestConfig()
    ranks: RanksConfig = RanksConfig()
    metrics: MetricsConfig = MetricsConfig()
    rollup: RollupConfig = RollupConfig()
    upstreams: tuple[UpstreamConfig, ...] = ()
    persistence: PersistenceConfig = PersistenceConfig()
    log_level: LogLevel = DEFAULT_LOG_LEVEL

    @property
    def profiles_in_use(self) -> tuple[str, ...]:
        """The profiles served besides the default one: metrics.profiles, then the upstreams' own."""
        return tuple(dict.fromkeys([*self.metrics.profiles, *(u.profile for u in self.upstreams if u.profile)]))

    @field_validator("upstreams")
    @classmethod
    def _names_are_unique(cls, upstreams: tuple[UpstreamConfig, ...]) -> tuple[UpstreamConfig, ...]:
        seen: set[str] = set()
        for upstream in upstreams:
            if upstream.label in seen:
                raise ValueError(f"two upstreams are named {upstream.label!r}; give each a distinct name")
            seen.add(upstream.label)
        return upstreams


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _normalise(data: Any, source: str) -> dict[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the config must be a mapping, got {type(data).__name__}")
    # A section whose keys are all commented out parses as null: treat it as empty.
    return {key: ({} if value is None else value) for key, value in data.items()}


def config_from_data(data: Any, source: str) -> SidecarConfig:
    """Validate a parsed config mapping strictly (no bool-as-int, no str-as-number); errors name every bad field."""
    data = _normalise(data, source)
    try:
        # Strict JSON-mode validation: YAML scalars are JSON scalars, and paths/lists still map.
        return SidecarConfig.model_validate_json(json.dumps(data, default=str), strict=True)
    except ValidationError as err:
        raise ConfigError(format_config_error(err, source)) from None


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The config model a location points into (None past a plain field)."""
    model: Any = SidecarConfig
    for part in loc:
        field = model.model_fields.get(part) if isinstance(model, type) and issubclass(model, BaseModel) else None
        if field is None:
            return None
        annotation = field.annotation
        if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
            annotation = next((a for a in typing.get_args(annotation) if a is not type(None)), None)
        model = annotation
    return model if isinstance(model, type) and issubclass(model, BaseModel) else None


def _origin_of(key: str, source: str) -> str:
    """Which source gave `key`, from the layer's name: the file, the variable or the flag."""
    if source.startswith("environment") and key in SETTING_ENV:
        return f"from {SETTING_ENV[key]} in the environment"
    if source == "command-line flags" and key in ERROR_FLAGS:
        return f"from {ERROR_FLAGS[key]}"
    return f"from {source}"


def _shown(value: Any) -> str:
    text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 80 else text[:77] + "..."


def format_config_error(err: ValidationError, source: str) -> str:
    """One line per problem: the key, what is wrong, the value received and where it came from;
    for an unknown key, the closest known one (`did you mean ...?`)."""
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for problem in err.errors():
        loc = tuple(problem["loc"])
        key = ".".join(str(part) for part in loc) or "(top level)"
        value = problem.get("input")
        if problem["type"] == "extra_forbidden":
            model = _model_at(loc[:-1])
            known = list(model.model_fields) if model is not None else []
            close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
            hint = f"; did you mean `{close[0]}`?" if close else (f"; known keys: {', '.join(known)}" if known else "")
            lines.append(f"  {key}: unknown key (value {_shown(value)}, {_origin_of(key, source)}){hint}")
        elif isinstance(value, dict):  # a whole section (a check across its fields): its value says little
            lines.append(f"  {key}: {problem['msg']} ({_origin_of(key, source)})")
        else:
            lines.append(f"  {key}: {problem['msg']} (got {_shown(value)}, {_origin_of(key, source)})")
    return "\n".join(lines)


def load_config(
    path: Path | str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    port: int | None = None,
    host: str | None = None,
    socket_path: Path | str | None = None,
    upstreams: list[str] | None = None,
    upstream_dirs: list[str] | None = None,
    upstream_worlds: Mapping[str, str] | None = None,
    upstream_profiles: Mapping[str, str] | None = None,
    profiles: Sequence[str] | None = None,
    persistence_file: Path | str | None = None,
    persistence_interval: str | None = None,
    nodes: int | None = None,
    node_rank: int | None = None,
) -> SidecarConfig:
    """Build the config: flags beat environment, which beats the file, which beats defaults.

    Each layer is validated on its own, so an error names where the bad value came from.
    """
    env = os.environ if env is None else env
    if path is None and env.get(ENV_CONFIG):
        path = env[ENV_CONFIG]
    data: dict[str, Any] = {}
    if path is not None:
        data = _normalise(load_yaml(Path(path)), str(path))
        config_from_data(data, str(path))
    layers: list[tuple[str, dict[str, Any]]] = []
    env_layer: dict[str, Any] = {}
    if env.get(ENV_PORT):
        try:
            env_layer.setdefault("http", {})["port"] = int(env[ENV_PORT])
        except ValueError:
            raise ConfigError(f"{ENV_PORT}={env[ENV_PORT]!r} is not a port number") from None
    if env.get(ENV_SOCKET):
        env_layer.setdefault("ingest", {})["socket_path"] = env[ENV_SOCKET]
    layers.append((f"environment ({ENV_PORT}, {ENV_SOCKET})", env_layer))
    flag_layer: dict[str, Any] = {}
    if port is not None:
        flag_layer.setdefault("http", {})["port"] = port
    if host is not None:
        flag_layer.setdefault("http", {})["host"] = host
    if socket_path is not None:
        flag_layer.setdefault("ingest", {})["socket_path"] = str(socket_path)
    if persistence_file is not None:
        flag_layer.setdefault("persistence", {})["file"] = str(persistence_file)
    if persistence_interval is not None:
        flag_layer.setdefault("persistence", {})["interval"] = persistence_interval
    if profiles:
        flag_layer.setdefault("metrics", {})["profiles"] = list(dict.fromkeys(profiles))
    if nodes is not None:
        flag_layer.setdefault("ranks", {})["nodes"] = nodes
    if node_rank is not None:
        flag_layer.setdefault("ranks", {})["node_rank"] = node_rank
    # --upstream and --upstream-multiprocess-dir add upstreams with default settings; one the file
    # already names (same URL or directory) keeps the file's settings. --upstream-world (by URL or
    # directory) gives such an upstream its world, in place of the file's.
    worlds = {source: parse_upstream_world(spec) for source, spec in (upstream_worlds or {}).items()}
    given = [dict(u) for u in data.get("upstreams") or []] if isinstance(data.get("upstreams"), list) else None
    added = [{"url": url} for url in upstreams or ()] + [{"multiprocess_dir": str(d)} for d in upstream_dirs or ()]
    if added:
        known = {(u.get("url"), str(u["multiprocess_dir"]) if u.get("multiprocess_dir") else None) for u in given or ()}
        fresh = [u for u in added if (u.get("url"), u.get("multiprocess_dir")) not in known]
        listed = [*(given or []), *fresh]
        for upstream in listed:
            source = upstream.get("url") or str(upstream.get("multiprocess_dir"))
            if isinstance(source, str) and source in worlds:
                upstream["world"] = worlds[source]
            if isinstance(source, str) and source in (upstream_profiles or {}):
                upstream["profile"] = (upstream_profiles or {})[source]
        flag_layer["upstreams"] = listed
    layers.append(("command-line flags", flag_layer))
    config = config_from_data(data, str(path) if path is not None else "built-in defaults")
    for source, layer in layers:
        if layer:
            data = _deep_merge(data, layer)
            config = config_from_data(data, source)
    return config


# --- where a setting came from, and the exporter-toolkit web config file ---------------------

SETTING_FLAGS = {"http.port": "--port", "http.host": "--host", "ingest.socket_path": "--socket",
                 "persistence.file": "--persistence.file", "persistence.interval": "--persistence.interval"}
SETTING_ENV = {"http.port": ENV_PORT, "ingest.socket_path": ENV_SOCKET}
ERROR_FLAGS = {"http.port": "--port or --web.listen-address", "http.host": "--host or --web.listen-address",
               "ingest.socket_path": "--socket", "persistence.file": "--persistence.file",
               "persistence.interval": "--persistence.interval"}


def _lookup(data: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def setting_origin(
    key: str, path: Path | str | None = None, *, env: Mapping[str, str] | None = None,
    flags: Mapping[str, str] | None = None,
) -> str:
    """Which layer gave the config key `key` its value, in load_config's order, for messages:
    `flags` maps the keys set on the command line to the flag that set them."""
    env = os.environ if env is None else env
    if flags and key in flags:
        return f"set by {flags[key]}"
    name = SETTING_ENV.get(key)
    if name and env.get(name):
        return f"set by {name} in the environment"
    if path is None and env.get(ENV_CONFIG):
        path = env[ENV_CONFIG]
    if path is not None:
        try:
            found, _ = _lookup(_normalise(load_yaml(Path(path)), str(path)), key)
        except ConfigError:
            found = False
        if found:
            return f"set in {path}"
    ways = [way for way in (SETTING_FLAGS.get(key), SETTING_ENV.get(key)) if way]
    return "the default; set it with " + ", ".join([*ways, f"{key} in the config file"])


WEB_CONFIG_KEYS = ("tls_server_config", "basic_auth_users", "http_server_config")


def web_config_layer(path: Path | str) -> dict[str, Any]:
    """The http settings of a Prometheus exporter-toolkit web config file (`--web.config.file`):
    `tls_server_config` and `basic_auth_users`, named as the config file's http section names them.
    `http_server_config` is accepted and ignored (this sidecar speaks HTTP/1.1 only)."""
    data = _normalise(load_yaml(Path(path)), str(path))
    unknown = sorted(set(data) - set(WEB_CONFIG_KEYS))
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; a web config file holds "
                          + ", ".join(WEB_CONFIG_KEYS))
    layer: dict[str, Any] = {key: data[key] for key in ("tls_server_config", "basic_auth_users")
                             if key in data and data[key] != {}}
    tls = layer.get("tls_server_config")
    if isinstance(tls, dict):
        tls = dict(tls)
        base = Path(path).parent  # relative file names are relative to the web config file, as in the toolkit
        for name in ("cert_file", "key_file", "client_ca_file"):
            if isinstance(tls.get(name), str) and not Path(tls[name]).is_absolute():
                tls[name] = str(base / tls[name])
        layer["tls_server_config"] = tls
    return layer


def apply_web_config(config: SidecarConfig, path: Path | str) -> SidecarConfig:
    """`config` with the web config file's http settings on top (they beat the config file's)."""
    data = config.model_dump(mode="json", exclude_none=True)
    data["http"] = {**data.get("http", {}), **web_config_layer(path)}
    return config_from_data(data, f"{path} (--web.config.file)")
