"""Fixtures of the sidecar core's unit tests, over the helpers in harness.py."""

from __future__ import annotations

import pytest

from exporter.config import RanksConfig
from tests.exporter.sidecar.harness import Harness, gauge_catalog


@pytest.fixture
def h() -> Harness:
    """A harness over the default catalog and ranks config."""
    return Harness()


@pytest.fixture
def gauge_harness() -> Harness:
    """A harness whose catalog has a per_shard gauge too, with short staleness and expiry."""
    return Harness(catalog=gauge_catalog(), ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0))
