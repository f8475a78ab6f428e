"""Shared fixtures: a real sidecar per test on a temporary socket and an ephemeral port."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import SidecarThread, sidecar_config

# pytest-xdist exports COLUMNS and LINES (the controlling terminal's size) to its workers, and the
# processes tests start inherit them: rich then draws `top` at that size whatever its pty says (a
# resize was never seen), and argparse wraps help text at it. A worker's tests see what a run
# without xdist sees.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for name in ("COLUMNS", "LINES"):
        os.environ.pop(name, None)


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


@pytest.fixture
def cleanup() -> Iterator[list[Any]]:
    """Callables run after the test, last added first."""
    done: list[Any] = []
    yield done
    for undo in reversed(done):
        undo()
