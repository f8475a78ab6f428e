"""The state file's self-metrics (hicache_exporter_persistence_*): shown exactly as PersistenceHealth holds
them, and only by a sidecar that has a state file."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.families import SELF, SELF_FAMILIES
from exporter.sidecar.expose.render import TextRenderer
from tests.exporter.sidecar.harness import Harness
from tests.helpers import (
    LOOP_WAIT_SECONDS,
    RawClient,
    Scrape,
    SidecarThread,
    counter,
    hello,
    http_get,
    sidecar_config,
    snapshot,
    wait_until,
)

PERSISTENCE = sorted(name for name in SELF_FAMILIES if name.startswith(SELF + "persistence_"))


def scrape(health: SidecarHealth) -> Scrape:
    return Scrape(TextRenderer(SidecarCollector(Harness().state, health, "sglang_")).render().decode())


def samples(scrape: Scrape) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for s in scrape.samples if s.name.startswith(SELF + "persistence_")}


def test_nine_families_are_declared() -> None:
    assert [name.removeprefix(SELF + "persistence_") for name in PERSISTENCE] == [
        "dropped_series", "file_bytes", "last_write_timestamp_seconds", "load_duration_seconds", "load_failures",
        "loaded_identities", "write_duration_seconds", "write_failures", "writes"]


def test_a_sidecar_without_a_state_file_shows_no_persistence_family() -> None:
    health = SidecarHealth()
    health.persistence.writes = 3  # never happens without a file; shown or not by `enabled` alone
    body = TextRenderer(SidecarCollector(Harness().state, health, "sglang_")).render().decode()
    assert "persistence" not in body
    assert "persistence" not in TextRenderer(SidecarCollector(Harness().state, health, "sglang_")).render(True).decode()


def test_a_fresh_state_file_shows_zero_writes_and_no_times_yet() -> None:
    health = SidecarHealth()
    health.persistence.enabled = True
    text = scrape(health)
    assert samples(text) == {(SELF + "persistence_writes_total", ()): 0.0,
                             (SELF + "persistence_loaded_identities", ()): 0.0}
    for name in PERSISTENCE:  # every family is declared, those without a value yet with no sample
        assert f"# TYPE {SELF_FAMILIES[name].sample_name} " in text.text, name


def test_every_value_is_shown_exactly() -> None:
    health = SidecarHealth()
    saving = health.persistence
    saving.enabled = True
    saving.load_failures = {"truncated": 1}
    saving.write_failures = {"no_space": 4, "read_only": 2}
    saving.dropped = {"unknown_family": 7}
    saving.writes, saving.last_write_wall, saving.last_write_duration = 12, 1_764_400_123.25, 0.0125
    saving.file_bytes, saving.load_duration, saving.loaded_identities = 65_536, 0.5, 256
    assert samples(scrape(health)) == {
        (SELF + "persistence_load_failures_total", (("reason", "truncated"),)): 1.0,
        (SELF + "persistence_write_failures_total", (("reason", "no_space"),)): 4.0,
        (SELF + "persistence_write_failures_total", (("reason", "read_only"),)): 2.0,
        (SELF + "persistence_dropped_series_total", (("reason", "unknown_family"),)): 7.0,
        (SELF + "persistence_writes_total", ()): 12.0,
        (SELF + "persistence_last_write_timestamp_seconds", ()): 1_764_400_123.25,
        (SELF + "persistence_write_duration_seconds", ()): 0.0125,
        (SELF + "persistence_file_bytes", ()): 65_536.0,
        (SELF + "persistence_load_duration_seconds", ()): 0.5,
        (SELF + "persistence_loaded_identities", ()): 256.0,
    }


def test_a_real_sidecar_counts_a_corrupt_file_and_its_writes(tmp_path: Path) -> None:
    """A file of another format version: the sidecar serves, counts the load failure, and its first save is counted and timed."""
    state_file = tmp_path / "state"
    state_file.write_bytes(b"HCXSTATE" + b"\xff" * 100)  # the magic, then format version 2**32 - 1
    config = sidecar_config(tmp_path / "ingest.sock", persistence={"file": str(state_file), "interval": "1h"})
    sidecar = SidecarThread(config).start()
    try:
        text = sidecar.scrape()
        values = samples(text)
        assert values[(SELF + "persistence_load_failures_total", (("reason", "version"),))] == 1
        assert values[(SELF + "persistence_writes_total", ())] == 0
        assert (SELF + "persistence_file_bytes", ()) not in values  # nothing loaded, nothing written
        assert sidecar.sidecar is not None and sidecar.sidecar.keeper is not None
        keeper = sidecar.sidecar.keeper
        assert asyncio.run_coroutine_threadsafe(keeper.save(force=True), sidecar.loop).result(LOOP_WAIT_SECONDS) is True
        values = samples(sidecar.scrape())
        assert values[(SELF + "persistence_writes_total", ())] == 1
        assert values[(SELF + "persistence_file_bytes", ())] == state_file.stat().st_size
        assert values[(SELF + "persistence_write_duration_seconds", ())] > 0
        assert values[(SELF + "persistence_last_write_timestamp_seconds", ())] > 1_700_000_000
        # The OpenMetrics scrape parses too (prometheus_client's strict parser).
        body = http_get(sidecar.url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})[1]
        names = {f.name for f in parse_openmetrics(body.decode())}
        assert SELF + "persistence_writes" in names and SELF + "persistence_load_failures" in names
    finally:
        sidecar.stop()


def test_the_status_document_tells_the_same_as_the_self_metrics(tmp_path: Path) -> None:
    """/api/v1/status's sidecar.persistence: schema-valid, and its numbers are the persistence families'
    on /metrics; null for a sidecar without a state file."""
    from tests.exporter.sidecar.expose.test_status import assert_valid

    state_file = tmp_path / "state"
    config = sidecar_config(tmp_path / "ingest.sock", persistence={"file": str(state_file), "interval": "1h"})
    first = SidecarThread(config).start()
    try:
        client = RawClient(first.socket_path)
        try:
            client.send(hello(tp=0, cache_type="HiRadixCache"))
            assert client.recv() is not None
            client.send(snapshot(1, counter("load_back_bytes_total", 4096)))
            # The rank's own series shows the push applied; the rollups wait for a save (an hour away:
            # the one at stop), since with a state file /metrics shows the rollups as of the last save.
            wait_until(lambda: first.scrape().find("sglang_load_back_bytes_total", tp_rank="0") != [], LOOP_WAIT_SECONDS)
            assert first.scrape().find("sglang_rollup_load_back_bytes_total") == []
        finally:
            client.close()
        document = json.loads(http_get(first.url + "/api/v1/status")[1])
        assert_valid("status", document)
        assert document["sidecar"]["persistence"] == {
            "file": str(state_file), "interval_seconds": 3600.0, "loaded_identities": 0, "load_duration_seconds": None,
            "load_failures": {}, "dropped_series": {}, "writes": 0, "last_write_time": None,
            "last_write_duration_seconds": None, "write_failures": {}, "file_bytes": None}
    finally:
        first.stop()  # the save at stop
    second = SidecarThread(config).start()
    try:
        document = json.loads(http_get(second.url + "/api/v1/status")[1])
        assert_valid("status", document)
        saving = document["sidecar"]["persistence"]
        values = samples(second.scrape())
        assert saving["loaded_identities"] == values[(SELF + "persistence_loaded_identities", ())] == 1
        assert saving["file_bytes"] == values[(SELF + "persistence_file_bytes", ())] == state_file.stat().st_size
        assert saving["load_duration_seconds"] == values[(SELF + "persistence_load_duration_seconds", ())]
        assert saving["writes"] == 0 and saving["load_failures"] == {} and saving["dropped_series"] == {}
    finally:
        second.stop()
    plain = SidecarThread(sidecar_config(tmp_path / "plain.sock")).start()
    try:
        document = json.loads(http_get(plain.url + "/api/v1/status")[1])
        assert_valid("status", document)
        assert document["sidecar"]["persistence"] is None
    finally:
        plain.stop()
