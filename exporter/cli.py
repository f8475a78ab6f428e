"""Command line: `hicache-exporter serve | demo | check-config | top | version`."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
import traceback
import typing
from collections.abc import Sequence
from pathlib import Path

from exporter import __version__
from exporter.catalog import load_profiles
from exporter.config import (
    MAX_DURATION_MS,
    WORLD_SPEC_FORM,
    SidecarConfig,
    apply_web_config,
    load_config,
    setting_origin,
)
from exporter.defaults import DEFAULT_PORT, DEFAULT_SOCKET_PATH, ENV_CONFIG, ENV_PORT, ENV_SOCKET, LOG_LEVELS
from exporter.errors import ConfigError, HicacheExporterError, StartupError, quoted

EXIT_USAGE = 2

DESCRIPTION = """\
Rank-aware Prometheus exporter for hierarchical KV caches (HiCache) of sharded LLM servers.
Ranks push cumulative snapshots over a Unix socket; the sidecar serves per-rank series and
rollups (summed bytes, one-replica tokens, active bandwidth) on /metrics."""
MAX_SECONDS = MAX_DURATION_MS / 1000  # about 292 years, Prometheus' longest duration (and under threading's)
MAX_SIZE = 1 << 16  # a parallel size, as the wire protocol bounds a rank number


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors in one line as every other error of the command line (and no usage block)."""

    def error(self, message: str) -> typing.NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see --help)\n")


def _path(text: str) -> Path:
    """A path flag: an empty one (an unset $VAR in a manifest) is refused, not taken as the current directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path must not be empty (an unset variable?)")
    return Path(text)


def _int(text: str) -> int:
    """A whole number flag (its range is the config's, or the command's)."""
    if not text.strip().lstrip("+-").isdigit():
        raise argparse.ArgumentTypeError(f"{quoted(text)} is not a whole number")
    if len(text) > 20:  # no flag takes one so large, and int() refuses thousands of digits by raising
        raise argparse.ArgumentTypeError(f"{quoted(text)} is out of range (more than 20 digits)")
    return int(text)


def _size(text: str) -> int:
    """A parallel size: 1 to MAX_SIZE."""
    value = _int(text)
    if not 1 <= value <= MAX_SIZE:
        raise argparse.ArgumentTypeError(f"{quoted(text)} must be a whole number from 1 to {MAX_SIZE}")
    return value


def _positive(text: str, high: float, unit: str, shown_high: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= high):  # nan, inf, zero and below
        raise argparse.ArgumentTypeError(f"{quoted(text)} must be positive: a number of {unit} above 0, at most {shown_high}")
    return value


def _seconds(text: str) -> float:
    """A number of seconds: finite, above 0, at most Prometheus' longest duration (nan would never end a wait)."""
    return _positive(text, MAX_SECONDS, "seconds", "292 years")


def _mebibytes(text: str) -> float:
    """A size in MiB: finite, above 0, at most 1 PiB."""
    return _positive(text, float(1 << 30), "MiB", "1 PiB")


def _add_listen_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=_int, help=f"HTTP port for /metrics (default {DEFAULT_PORT}; env {ENV_PORT})")
    parser.add_argument("--host", help="HTTP listen address (default 0.0.0.0)")
    parser.add_argument("--socket", type=_path,
                        help=f"ingest Unix socket path (default {DEFAULT_SOCKET_PATH}; env {ENV_SOCKET})")



def _add_exporter_flags(parser: argparse.ArgumentParser) -> None:
    """The flags every Prometheus exporter has (exporter-toolkit's names); the older ones stay."""
    parser.add_argument("--web.listen-address", dest="web_listen_address", metavar="HOST:PORT",
                        help="HTTP listen address: HOST:PORT, [IPV6]:PORT, or :PORT for every IPv4 address "
                             "(instead of --host and --port)")
    parser.add_argument("--web.config.file", dest="web_config_file", type=_path, metavar="FILE",
                        help="Prometheus exporter-toolkit web config file: tls_server_config and "
                             "basic_auth_users (bcrypt), as http.tls_server_config and http.basic_auth_users; "
                             "beats the config file's")
    parser.add_argument("--log.level", dest="log_level", choices=LOG_LEVELS,
                        help="log level (as --log-level); debug also prints the traceback of a start-up error")
    parser.add_argument("--log.format", dest="log_format", choices=["logfmt", "json"],
                        help="log line format (default: plain text)")


class _AppendUpstream(argparse.Action):
    """--upstream or --upstream-multiprocess-dir: appended to its list, and to the command line's
    upstreams in the order given, which --upstream-world follows."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, [*getattr(namespace, self.dest), values])
        namespace.upstream_order = [*namespace.upstream_order, str(values)]


def per_upstream(args: argparse.Namespace, values: list[str], flag: str) -> dict[str, str]:
    """Each command-line upstream's `flag` value, by its URL or directory: one for all, or one per upstream in order."""
    order: list[str] = args.upstream_order
    if not values:
        return {}
    if not order:
        raise HicacheExporterError(f"{flag} applies to the upstreams given with --upstream or "
                                   "--upstream-multiprocess-dir, and none is (config upstreams[] for the file's)")
    if len(values) == 1:
        return dict.fromkeys(order, values[0])
    if len(values) != len(order):
        raise HicacheExporterError(f"{len(values)} {flag} for {len(order)} upstreams: give one for all of "
                                   "them, or one per --upstream and --upstream-multiprocess-dir, in their order")
    return dict(zip(order, values))


def upstream_worlds(args: argparse.Namespace) -> dict[str, str]:
    """Each command-line upstream's --upstream-world SPEC, by its URL or directory."""
    return per_upstream(args, args.upstream_world, "--upstream-world")


def parse_listen_address(text: str) -> tuple[str, int]:
    """HOST:PORT, [IPV6]:PORT or :PORT (0.0.0.0), as exporter-toolkit's --web.listen-address."""
    usage = f"--web.listen-address {text!r}: expected HOST:PORT, [IPV6]:PORT or :PORT"
    if text.startswith("["):
        host, sep, port = text[1:].partition("]:")
        if not sep or not host:
            raise HicacheExporterError(usage)
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            raise HicacheExporterError(usage)
        if ":" in host:
            raise HicacheExporterError(f"{usage} (an IPv6 address goes in brackets: [{host}]:{port})")
        host = host or "0.0.0.0"
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise HicacheExporterError(f"{usage} (the port must be 0 to 65535)")
    return host, int(port)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hicache-exporter", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hicache-exporter {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the sidecar",
                           description="Run the sidecar until SIGTERM/SIGINT. Flags beat environment, "
                                       "which beats the config file, which beats the defaults.")
    serve.add_argument("--config", type=_path, help=f"YAML config file (env {ENV_CONFIG})")
    _add_listen_flags(serve)
    _add_exporter_flags(serve)
    serve.add_argument("--upstream", action=_AppendUpstream, metavar="URL", default=[],
                       help="proxy an engine's own /metrics at URL (repeatable); settings per upstream in the config")
    serve.add_argument("--upstream-multiprocess-dir", action=_AppendUpstream, type=_path, metavar="DIR", default=[],
                       help="proxy a prometheus_client multiprocess directory (the engine's PROMETHEUS_MULTIPROC_DIR, "
                            "shared as a volume; repeatable), each process's files read apart")
    serve.add_argument("--upstream-world", action="append", metavar="SPEC", default=[],
                       help=f"the parallel layout the engine was started with, {WORLD_SPEC_FORM} (its tp, dp, pp "
                            "and attention cp sizes, and whether DP attention is on), so that a rank that never "
                            "reports is counted missing; the engine's storage labels fill in pp and cp left out. "
                            "One for every --upstream and --upstream-multiprocess-dir, or one per upstream in "
                            "the order they are given (config upstreams[].world)")
    serve.add_argument("--upstream-profile", action="append", metavar="NAME", default=[],
                       help="the engine profile an upstream serves: sglang (default) or lmcache (vLLM + LMCache), "
                            "or a profile YAML file; one for every upstream, or one per upstream in the order they "
                            "are given (config upstreams[].profile)")
    serve.add_argument("--profile", action="append", metavar="NAME", default=[],
                       help="serve an engine profile besides sglang for ranks that push (lmcache, or a profile YAML "
                            "file; repeatable; config metrics.profiles)")
    serve.set_defaults(upstream_order=[])
    serve.add_argument("--persistence.file", dest="persistence_file", type=_path, metavar="FILE",
                       help="keep the rollups' durable state in FILE, so that they continue exactly across restarts "
                            "of the sidecar (config persistence.file; default: not kept)")
    serve.add_argument("--persistence.interval", dest="persistence_interval", metavar="DURATION",
                       help="how often the state file is written, as a Prometheus duration (default 5s; config "
                            "persistence.interval); it is written once more at SIGTERM")

    serve.add_argument("--ranks.nodes", dest="ranks_nodes", type=_int, metavar="N",
                       help="nodes the server spans (the engine's --nnodes; config ranks.nodes; default 1): this "
                            "sidecar then expects only its own node's ranks")
    serve.add_argument("--ranks.node-rank", dest="ranks_node_rank", type=_int, metavar="K",
                       help="which node this sidecar runs on, 0 to N-1 (the engine's --node-rank; in a "
                            "LeaderWorkerSet $(LWS_WORKER_INDEX); config ranks.node_rank; default 0)")
    serve.add_argument("--log-level", choices=LOG_LEVELS, help="override log_level")

    demo = sub.add_parser("demo", help="run the sidecar plus simulated ranks on a synthetic workload",
                          description="Start the sidecar and one cache_core process per rank (needs torch). "
                                      "With --requests or --duration the ranks stop after that much work and "
                                      "the sidecar keeps serving until interrupted.")
    demo.add_argument("--attn-tp", "--tp", dest="attn_tp", type=_size, default=2,
                      help="attention tensor-parallel size: ranks per dp group and cp rank (default 2; "
                           "--tp is an alias); the server's tp size is attn-tp x cp x dp")
    demo.add_argument("--cp", type=_size, default=1, help="attention context-parallel size (default 1)")
    demo.add_argument("--pp", type=_size, default=1, help="pipeline-parallel size (default 1)")
    demo.add_argument("--dp", type=_size, default=1, help="attention data-parallel groups (default 1; more than 1 "
                                                       "turns DP attention on)")
    _add_listen_flags(demo)
    demo.add_argument("--requests", type=_int, help="requests per dp group, then the ranks stop")
    demo.add_argument("--duration", type=_seconds, help="seconds of work, then the ranks stop")
    demo.add_argument("--seed", type=_int, default=0, help="workload seed (default 0)")
    demo.add_argument("--interval", type=_seconds, default=1.0, help="rank push interval in seconds (default 1)")
    demo.add_argument("--l3-capacity-mb", type=_mebibytes, default=256.0,
                      help="L3 store budget of all ranks together, in MiB (default 256); past it the least "
                           "recently used pages are evicted. The demo's directory is removed on exit")

    check = sub.add_parser("check-config", help="validate a config file and its catalog, then exit")
    check.add_argument("file", type=_path)

    _add_top_parser(sub)

    sub.add_parser("version", help="print the version")
    return parser


def _add_top_parser(sub: argparse._SubParsersAction[_Parser]) -> None:
    from exporter.top.fetch import DEFAULT_URL, ENV_PASSWORD

    top = sub.add_parser("top", help="a refreshing terminal view of a sidecar's status (needs the `top` extra: rich)",
                         description="Poll a sidecar's /api/v1/status and show its ranks, rollups, bandwidth, "
                                     "reasons, replica spread, upstreams and health, refreshed in place. "
                                     "q or Ctrl-C quits. A sidecar that cannot be read is shown as such "
                                     "and polled again.")
    top.add_argument("--url", default=DEFAULT_URL,
                     help=f"the sidecar's base URL, http:// or https://, with an optional path prefix and "
                          f"USER:PASSWORD@ (default {DEFAULT_URL})")
    top.add_argument("--interval", type=_seconds, default=2.0, help="seconds between polls (default 2)")
    top.add_argument("--timeout", type=_seconds, default=5.0,
                     help="seconds one poll may take before it counts as unreachable (default 5)")
    top.add_argument("--once", action="store_true",
                     help="print one frame and exit: 0 when the sidecar was read, 1 when it could not be")
    top.add_argument("--web.user", dest="web_user", metavar="USER", help="basic-auth user (beats the URL's)")
    top.add_argument("--web.password-file", dest="web_password_file", type=_path, metavar="FILE",
                     help=f"file holding the basic-auth password (beats ${ENV_PASSWORD}, which beats the URL's)")
    top.add_argument("--ca-file", type=_path, metavar="FILE", help="CA bundle that signed the sidecar's certificate")
    top.add_argument("--insecure", action="store_true", help="do not verify the sidecar's TLS certificate")
    top.add_argument("--cert-file", type=_path, metavar="FILE", help="client certificate, when the sidecar asks for one")
    top.add_argument("--key-file", type=_path, metavar="FILE", help="the client certificate's key")


def _logfmt_value(value: str) -> str:
    if value and not any(c in value for c in ' "=\\') and value.isprintable():
        return value
    return json.dumps(value, ensure_ascii=False)


class LogfmtFormatter(logging.Formatter):
    """`ts=... level=info logger=... msg="..."`, as Prometheus exporters log with --log.format logfmt."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                  "msg": record.getMessage()}
        if record.exc_info:
            fields["err"] = self.formatException(record.exc_info)
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg (and err with a traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        fields = {"ts": _timestamp(record), "level": record.levelname.lower(), "logger": record.name,
                  "msg": record.getMessage()}
        if record.exc_info:
            fields["err"] = self.formatException(record.exc_info)
        return json.dumps(fields, ensure_ascii=False)


def _timestamp(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


def _setup_logging(level: str, fmt: str | None = None) -> None:
    if fmt is None:
        logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                            stream=sys.stderr)
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else LogfmtFormatter())
    logging.basicConfig(level=level.upper(), handlers=[handler])


def _listen_settings(args: argparse.Namespace) -> tuple[str | None, int | None, dict[str, str]]:
    """host, port and which flag set each config key, from --web.listen-address or --host/--port."""
    flags = {key: flag for key, flag, value in (("http.host", "--host", args.host), ("http.port", "--port", args.port),
                                                ("ingest.socket_path", "--socket", args.socket)) if value is not None}
    address = getattr(args, "web_listen_address", None)
    if address is None:
        return args.host, args.port, flags
    if args.host is not None or args.port is not None:
        raise HicacheExporterError("give either --web.listen-address or --host/--port, not both")
    host, port = parse_listen_address(address)
    flags.update({"http.host": "--web.listen-address", "http.port": "--web.listen-address"})
    return host, port, flags


def _naming_the_setting(err: StartupError, path: Path | None, flags: dict[str, str]) -> StartupError:
    named = StartupError(f"{err} ({err.setting}, {setting_origin(err.setting, path, flags=flags)})", err.setting)
    named.__cause__ = err
    return named


def _serve(args: argparse.Namespace) -> int:
    from exporter.sidecar.process import raise_fd_limit, tune_gc, tune_malloc
    from exporter.sidecar.runner import Sidecar

    host, port, flags = _listen_settings(args)
    config = load_config(args.config, port=port, host=host, socket_path=args.socket,
                         upstreams=args.upstream, upstream_dirs=args.upstream_multiprocess_dir,
                         upstream_worlds=upstream_worlds(args),
                         upstream_profiles=per_upstream(args, args.upstream_profile, "--upstream-profile"),
                         profiles=args.profile,
                         persistence_file=args.persistence_file, persistence_interval=args.persistence_interval,
                         nodes=args.ranks_nodes, node_rank=args.ranks_node_rank)
    if args.web_config_file is not None:
        config = apply_web_config(config, args.web_config_file)
    _setup_logging(args.log_level or config.log_level, args.log_format)
    raise_fd_limit()
    tune_gc()
    tune_malloc()
    try:
        asyncio.run(Sidecar(config).run())
    except StartupError as err:
        raise _naming_the_setting(err, args.config, flags) from err
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from exporter.sidecar.expose.families import ExposedFamilies
    from exporter.sidecar.http.security import server_ssl_context

    config: SidecarConfig = load_config(args.file, env={})
    catalog = load_profiles(config.metrics.catalog, config.profiles_in_use)
    ExposedFamilies(catalog, config.metrics.namespace)  # refuses names that would clash on /metrics, as serve does
    for upstream in config.upstreams:  # what serve's feeds would refuse at start
        profile = catalog.of_profile(upstream.profile or catalog.default_profile.name).default_profile
        world = upstream.world
        problem = profile.world_problem(world.dp_size, world.dp_attention) if world is not None else None
        if problem:
            raise ConfigError(f"upstream {upstream.label}: {problem}")
    if config.http.tls_server_config is not None:
        server_ssl_context(config.http.tls_server_config)  # the files exist and load, as serve needs them
    print(f"{args.file}: OK ({len(catalog)} families, namespace {config.metrics.namespace!r}, "
          f"http port {config.http.port}, socket {config.ingest.socket_path})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from exporter.demo import run_demo

    _, _, flags = _listen_settings(args)
    try:
        return run_demo(args)
    except StartupError as err:
        raise _naming_the_setting(err, None, flags) from err


def _top(args: argparse.Namespace) -> int:
    from exporter.top.fetch import build_target

    target = build_target(args.url, args.web_user, args.web_password_file, insecure=args.insecure,
                          ca_file=args.ca_file, cert_file=args.cert_file, key_file=args.key_file)
    try:
        import rich  # noqa: F401  (the optional `top` extra; the sidecar image ships without it)
    except ImportError:
        raise HicacheExporterError("top needs the rich library: pip install 'hicache-exporter[top]'") from None
    from exporter.top.screen import run_top

    return run_top(target, interval=args.interval, timeout=args.timeout, once=args.once)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "version":
        print(f"hicache-exporter {__version__}")
        return 0
    handlers = {"serve": _serve, "check-config": _check_config, "demo": _demo, "top": _top}
    try:
        return handlers[args.command](args)
    except HicacheExporterError as err:
        if getattr(args, "log_level", None) == "debug":
            traceback.print_exc()  # --log.level debug: the whole story, then the one line
        print(f"hicache-exporter: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
