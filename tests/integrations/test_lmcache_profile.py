"""The lmcache profile (exporter/defaults/lmcache.yaml) is LMCache 0.5.6's own families: every family
the released `PrometheusLogger` registers, with its type, HELP text, buckets, multiprocess mode and labels.

A spawned process builds the released logger (tests.upstream_lmcache, from the hash-pinned wheel) for
one worker's metadata and sends back what it registered (as prometheus_client describes it); the test
compares that with the profile the sidecar loads, family by family, so a profile entry that drifted
from the engine fails here and names the family.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exporter.catalog import Catalog, MetricType, load_profile
from tests.integrations.support import run_processes

LABELS = ("model_name", "worker_id", "role", "served_model_name")  # observability.py:1905-1913, in order

Registered = dict[str, tuple[str, str, tuple[float, ...] | None, str | None, tuple[str, ...]]]


def registered(conn: Any) -> None:
    """Build the released logger for one worker and send what it registered: name -> (type, help, buckets, mode, labels)."""
    from prometheus_client import REGISTRY

    from tests.upstream_lmcache import install

    lmcache = install()
    before = set(REGISTRY._collector_to_names)  # prometheus_client keeps no public list of collectors (0.26)
    lmcache.PrometheusLogger.GetOrCreate(lmcache.LMCacheMetadata(
        model_name="m", world_size=1, local_world_size=1, worker_id=0, local_worker_id=0, kv_dtype=None,
        kv_shape=(1, 2, 16, 1, 8), role="worker", served_model_name="s"))
    out: Registered = {}
    for collector in set(REGISTRY._collector_to_names) - before:
        bounds = getattr(collector, "_upper_bounds", None)
        for metric in collector.describe():
            out[metric.name] = (
                metric.type, metric.documentation,
                tuple(b for b in bounds if b != float("inf")) if bounds else None,
                getattr(collector, "_multiprocess_mode", None) if metric.type == "gauge" else None,
                tuple(collector._labelnames))
    conn.send(out)
    conn.close()


@pytest.fixture(scope="module")
def released(released_wheel: Path) -> Registered:
    return run_processes(registered, [()], receive=True)[0]


@pytest.fixture(scope="module")
def profile() -> Catalog:
    return load_profile("lmcache")


def test_the_profile_holds_exactly_the_families_the_released_logger_registers(released: Registered,
                                                                              profile: Catalog) -> None:
    prefix = profile.default_profile.upstream_prefix
    assert len(released) == 94
    assert all(name.startswith(prefix) for name in released)
    # A counter's family name is without `_total` as prometheus_client describes it; the profile's has it.
    assert {spec.exported_name(prefix) for spec in profile} == set(released)


def test_each_family_has_the_released_type_help_buckets_mode_and_labels(released: Registered,
                                                                        profile: Catalog) -> None:
    prefix = profile.default_profile.upstream_prefix
    for spec in profile:
        kind, documentation, buckets, mode, labels = released[spec.exported_name(prefix)]
        assert (spec.type.value, spec.help) == (kind, documentation), spec.name
        assert spec.buckets == buckets, spec.name
        assert spec.multiprocess_mode == mode, spec.name
        assert labels == LABELS, spec.name
    assert {spec.type for spec in profile} == set(MetricType)
