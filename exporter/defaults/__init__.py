"""Packaged defaults: the sidecar config and the metric catalog (also linked from config/), the packaged
profiles' catalogs pre-built for ranks (rank_catalogs.json, written by `python -m exporter.catalog`), and
the names and default values that the sidecar, its ranks and `top` must agree on, each written once.

Imported by the rank client, so it imports nothing heavy (no pydantic, yaml or aiohttp)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Literal, get_args

# Where the sidecar listens for ranks and where a rank pushes, unless told otherwise.
DEFAULT_SOCKET_PATH = "/run/hicache/metrics.sock"
# NVIDIA dcgm-exporter's default port too: a GPU node's scrape config already reaches it.
DEFAULT_PORT = 9400
DEFAULT_PUSH_INTERVAL = 1.0  # seconds between a rank's snapshots

# The environment variables that set the above (and the config file) for the sidecar and its ranks.
ENV_CONFIG = "HICACHE_EXPORTER_CONFIG"
ENV_PORT = "HICACHE_EXPORTER_PORT"
ENV_SOCKET = "HICACHE_EXPORTER_SOCKET"
ENV_PUSH_INTERVAL = "HICACHE_EXPORTER_PUSH_INTERVAL"

LogLevel = Literal["debug", "info", "warning", "error"]
LOG_LEVELS: tuple[LogLevel, ...] = get_args(LogLevel)
DEFAULT_LOG_LEVEL: LogLevel = "info"


def default_path(name: str) -> Path:
    """Path of a packaged default file, e.g. `catalog.yaml` or `sidecar.yaml`."""
    return Path(str(resources.files(__package__).joinpath(name)))
