"""Fixtures for the engine integrations: the released collectors, and a sidecar with the engine's names."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import SidecarThread, sidecar_config
from tests.upstream_sglang import WheelUnavailable


@pytest.fixture(scope="session")
def ranks() -> ModuleType:
    """tests.integrations.ranks, over the released collectors; a wheel that cannot be had fails the test (never skips)."""
    try:
        from tests.integrations import ranks
    except WheelUnavailable as err:
        problem = str(err)
    else:
        return ranks
    pytest.fail(f"the released SGLang collectors are needed: {problem}", pytrace=False)


@pytest.fixture(scope="session")
def released_wheel() -> Path:
    """The LMCache wheel, fetched and checked once, here rather than in each worker process (where it would
    surface as a broken barrier a minute later): without it the tests fail in one line (never skip)."""
    from tests.upstream_lmcache import WheelUnavailable as LMCacheWheelUnavailable
    from tests.upstream_lmcache import wheel_path

    try:
        return wheel_path()
    except LMCacheWheelUnavailable as err:
        problem = str(err)
    pytest.fail(f"the released LMCache PrometheusLogger is needed: {problem}", pytrace=False)


@pytest.fixture(scope="session")
def integration(ranks: ModuleType) -> ModuleType:
    """exporter.integrations.sglang, importing the released collectors."""
    from exporter.integrations import sglang

    return sglang


@pytest.fixture
def in_process(integration: ModuleType) -> Iterator[ModuleType]:
    """The integration for a test that binds series in the test process itself: its clients close after
    the test (ask for the sidecar first, so that they close before it stops)."""
    yield integration
    integration.close()


@pytest.fixture
def engine_sidecar(socket_dir: Path) -> Iterator[SidecarThread]:
    """A sidecar exposing the engine's own names (namespace `sglang:`)."""
    running = SidecarThread(sidecar_config(socket_dir / "run" / "metrics.sock", metrics={"namespace": "sglang:"})).start()
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture
def push_to(monkeypatch: pytest.MonkeyPatch) -> Callable[[SidecarThread], None]:
    """Point rank processes started from now on at `sidecar`; a long interval leaves the last push to their exit."""

    def point(sidecar: SidecarThread) -> None:
        monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)
        monkeypatch.setenv("HICACHE_EXPORTER_PUSH_INTERVAL", "600")

    return point


@pytest.fixture
def running() -> Iterator[list[Any]]:
    """Things to stop after the test, last started first."""
    things: list[Any] = []
    yield things
    for thing in reversed(things):
        thing.stop()
