"""Command line: `hicache-exporter serve | demo | check-config | version`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from exporter import __version__
from exporter.catalog import load_catalog
from exporter.config import ENV_CONFIG, ENV_PORT, ENV_SOCKET, SidecarConfig, load_config
from exporter.errors import HicacheExporterError

EXIT_USAGE = 2

DESCRIPTION = """\
Rank-aware Prometheus exporter for hierarchical KV caches (HiCache) of sharded LLM servers.
Ranks push cumulative snapshots over a Unix socket; the sidecar serves per-rank series and
rollups (summed bytes, one-replica tokens, active bandwidth) on /metrics."""


def _add_listen_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help=f"HTTP port for /metrics (default 9400; env {ENV_PORT})")
    parser.add_argument("--host", help="HTTP listen address (default 0.0.0.0)")
    parser.add_argument("--socket", type=Path,
                        help=f"ingest Unix socket path (default /run/hicache/metrics.sock; env {ENV_SOCKET})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hicache-exporter", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the sidecar",
                           description="Run the sidecar until SIGTERM/SIGINT. Flags beat environment, "
                                       "which beats the config file, which beats the defaults.")
    serve.add_argument("--config", type=Path, help=f"YAML config file (env {ENV_CONFIG})")
    _add_listen_flags(serve)
    serve.add_argument("--upstream", action="append", metavar="URL", default=[],
                       help="proxy an engine's own /metrics at URL (repeatable); settings per upstream in the config")
    serve.add_argument("--upstream-multiprocess-dir", action="append", metavar="DIR", default=[],
                       help="proxy a prometheus_client multiprocess directory (the engine's PROMETHEUS_MULTIPROC_DIR, "
                            "shared as a volume; repeatable), each process's files read apart")
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"], help="override log_level")

    demo = sub.add_parser("demo", help="run the sidecar plus simulated ranks on a synthetic workload",
                          description="Start the sidecar and one cache_core process per rank (needs torch). "
                                      "With --requests or --duration the ranks stop after that much work and "
                                      "the sidecar keeps serving until interrupted.")
    demo.add_argument("--attn-tp", "--tp", dest="attn_tp", type=int, default=2,
                      help="attention tensor-parallel size: ranks per dp group and cp rank (default 2; "
                           "--tp is an alias); the server's tp size is attn-tp x cp x dp")
    demo.add_argument("--cp", type=int, default=1, help="attention context-parallel size (default 1)")
    demo.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (default 1)")
    demo.add_argument("--dp", type=int, default=1, help="attention data-parallel groups (default 1; more than 1 "
                                                       "turns DP attention on)")
    _add_listen_flags(demo)
    demo.add_argument("--requests", type=int, help="requests per dp group, then the ranks stop")
    demo.add_argument("--duration", type=float, help="seconds of work, then the ranks stop")
    demo.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    demo.add_argument("--interval", type=float, default=1.0, help="rank push interval in seconds (default 1)")

    check = sub.add_parser("check-config", help="validate a config file and its catalog, then exit")
    check.add_argument("file", type=Path)

    sub.add_parser("version", help="print the version")
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _serve(args: argparse.Namespace) -> int:
    from exporter.sidecar.process import raise_fd_limit, tune_gc
    from exporter.sidecar.runner import Sidecar

    config = load_config(args.config, port=args.port, host=args.host, socket_path=args.socket,
                         upstreams=args.upstream, upstream_dirs=args.upstream_multiprocess_dir)
    _setup_logging(args.log_level or config.log_level)
    raise_fd_limit()
    tune_gc()
    asyncio.run(Sidecar(config).run())
    return 0


def _check_config(args: argparse.Namespace) -> int:
    from exporter.sidecar.security import server_ssl_context

    config: SidecarConfig = load_config(args.file, env={})
    catalog = load_catalog(config.metrics.catalog)
    if config.http.tls_server_config is not None:
        server_ssl_context(config.http.tls_server_config)  # the files exist and load, as serve needs them
    print(f"{args.file}: OK ({len(catalog)} families, namespace {config.metrics.namespace!r}, "
          f"http port {config.http.port}, socket {config.ingest.socket_path})")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from exporter.demo import run_demo

    return run_demo(args)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "version":
        print(f"hicache-exporter {__version__}")
        return 0
    handlers = {"serve": _serve, "check-config": _check_config, "demo": _demo}
    try:
        return handlers[args.command](args)
    except HicacheExporterError as err:
        print(f"hicache-exporter: error: {err}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
