"""Packaged defaults: the sidecar config and the metric catalog (also linked from config/)."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def default_path(name: str) -> Path:
    """Path of a packaged default file, e.g. `catalog.yaml` or `sidecar.yaml`."""
    return Path(str(resources.files(__package__).joinpath(name)))
