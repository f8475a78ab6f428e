"""Shared fixtures: a real sidecar per test on a temporary socket and an ephemeral port."""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import SidecarThread, sidecar_config


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    # Unix socket paths are limited to ~108 bytes, so stay short instead of using tmp_path.
    with tempfile.TemporaryDirectory(prefix="hc-", dir="/tmp") as directory:
        yield Path(directory)


@pytest.fixture
def sidecar(socket_dir: Path) -> Iterator[SidecarThread]:
    running = SidecarThread(sidecar_config(socket_dir / "run" / "metrics.sock")).start()
    try:
        yield running
    finally:
        running.stop()
