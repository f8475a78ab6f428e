"""Helpers the upstream tests share (test-only code the package does not ship)."""

from __future__ import annotations

from pathlib import Path

from exporter.sidecar.upstream.files import Exposition, read_directory


def directory_exposition(directory: Path, merged: bool = True) -> Exposition:
    """The exposition `read_directory` gives, without the files it left out."""
    return read_directory(directory, merged).exposition
