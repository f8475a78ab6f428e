"""Rollup start times as OpenMetrics `_created`: exact, kept across a sidecar restart, never per rank.

A rollup counter's or histogram's `_created` is the wall-clock time its first value came in
(RollupLedger.created), and the durable state keeps it, so a sidecar that restarts on its file
shows the same start time: to Prometheus the series never reset. The 0.0.4 text format has no
`_created`: the sidecar's (and the golden file's) stay without.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.client import RankClient
from exporter.sidecar.core import saved
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer
from tests.exporter.sidecar.expose.reference import ReferenceCollector
from tests.exporter.sidecar.harness import BYTES, DURATION, TOKENS, Harness, bytes_, hist, one_hot, tokens
from tests.helpers import LOOP_WAIT_SECONDS, SidecarThread, http_get, sidecar_config, wait_until

NS = "sglang_"
OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"}


def created_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every `_created` sample of an OpenMetrics body, parsed by prometheus_client's strict parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parse_openmetrics(text) for s in family.samples if s.name.endswith("_created")}


def render(state: SidecarState, openmetrics: bool = True) -> str:
    return TextRenderer(SidecarCollector(state, SidecarHealth(), NS)).render(openmetrics=openmetrics).decode()


def two_ranks_over_time() -> Harness:
    """Two replicas of dp group 0: bytes, tokens and a duration from 1_764_400_000.5, a second token
    pool 100 s later, then replica 1 restarts (a new epoch) 100 s after that."""
    h = Harness()
    h.wall.now = 1_764_400_000.5
    _, r0 = h.hello(tp=0)
    _, r1 = h.hello(tp=1)
    for rank in (r0, r1):
        assert h.push(rank, bytes_(100), tokens(10), hist(DURATION, one_hot(DURATION, 2), 0.003)).rejections == []
    h.wall.now += 100.25
    assert h.push(r0, bytes_(200), tokens(20), tokens(5, pool="other")).rejections == []
    h.wall.now += 100
    h.state.disconnect(r1.connection, r1)
    _, r1 = h.hello(tp=1, epoch="epoch-b")
    assert h.push(r1, bytes_(7), tokens(3), hist(DURATION, one_hot(DURATION, 1), 0.002)).rejections == []
    return h


def test_openmetrics_carries_each_rollup_counters_and_histograms_exact_start_time() -> None:
    h = two_ranks_over_time()
    text = render(h.state)
    static = (("cache_type", "UnifiedRadixCache"),)
    assert created_samples(text) == {
        (f"{NS}rollup_{BYTES.removesuffix('_total')}_created", static): 1_764_400_000.5,
        (f"{NS}rollup_{TOKENS.removesuffix('_total')}_created", (*static, ("pool", "kv"))): 1_764_400_000.5,
        (f"{NS}rollup_{TOKENS.removesuffix('_total')}_created", (*static, ("pool", "other"))): 1_764_400_100.75,
        (f"{NS}rollup_{DURATION}_created", static): 1_764_400_000.5,
    }  # the restart of replica 1 200 s in changed none: the rollups went on; no per-rank series has one
    # Each `_created` is the last sample of its series, after the value (OpenMetrics' order; the parser holds to it).
    lines = text.splitlines()
    created = lines.index(f'{NS}rollup_{DURATION}_created{{cache_type="UnifiedRadixCache"}} 1764400000.5')
    assert lines[created - 1].startswith(f"{NS}rollup_{DURATION}_sum{{")
    # prometheus_client's own OpenMetrics exposition of the collector gives the same start times.
    registry = CollectorRegistry(auto_describe=False)
    registry.register(ReferenceCollector(h.state, SidecarHealth(), NS))
    assert created_samples(generate_openmetrics(registry).decode()) == created_samples(text)


def test_the_prometheus_text_format_has_no_created_samples() -> None:
    h = two_ranks_over_time()
    assert "_created" not in render(h.state, openmetrics=False)
    assert "_created" in render(h.state)


def test_a_restored_state_shows_the_saved_start_times() -> None:
    """The start times go through the durable state (dump, msgpack, restore) unchanged, whatever the new clock says."""
    h = two_ranks_over_time()
    before = created_samples(render(h.state))
    later = Harness()
    later.wall.now = 1_764_500_000.0
    encoded = msgspec.msgpack.encode(saved.dump(h.state))
    saved.restore(later.state, msgspec.msgpack.decode(encoded, type=saved.SavedCore))
    assert created_samples(render(later.state)) == before
    # A series born after the restart gets the new clock's time.
    _, rank = later.hello(tp=3, dp=1)
    assert later.push(rank, bytes_(1), tokens(1, pool="third")).rejections == []
    after = created_samples(render(later.state))
    assert {k: v for k, v in after.items() if k in before} == before
    assert after[(f"{NS}rollup_{TOKENS.removesuffix('_total')}_created",
                  (("cache_type", "UnifiedRadixCache"), ("pool", "third")))] == 1_764_500_000.0


def test_a_sidecar_restarted_on_its_state_file_serves_the_same_start_times(tmp_path: Path) -> None:
    """A real sidecar (socket, HTTP, state file): a rank pushes, the sidecar stops (its save at stop) and a new
    one starts on the file. Before any rank is back, its OpenMetrics scrape shows the same rollups with the same
    `_created`, and its persistence self-metrics tell what it loaded."""
    state_file = tmp_path / "state"
    config = sidecar_config(tmp_path / "ingest.sock", persistence={"file": str(state_file), "interval": "1h"})
    first = SidecarThread(config).start()
    pushed_after = time.time()
    client = RankClient(first.socket_path, rank={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0},
                        labels={"cache_type": "UnifiedRadixCache"}, interval=0.1)
    client.counter(BYTES).inc(4096)
    client.histogram(DURATION).observe(0.004)
    client.start()
    try:
        rollup = f"{NS}rollup_{BYTES}"
        wait_until(lambda: first.scrape().find(NS + BYTES, tp_rank="0") != [] and
                   first.scrape().value(NS + BYTES, tp_rank="0") == 4096, timeout=LOOP_WAIT_SECONDS)
        # /metrics shows the rollups as of the last save (none yet: the interval is an hour): save now.
        assert first.scrape().find(rollup) == []
        assert first.sidecar is not None and first.sidecar.keeper is not None
        keeper = first.sidecar.keeper
        assert asyncio.run_coroutine_threadsafe(keeper.save(force=True), first.loop).result(LOOP_WAIT_SECONDS) is True
        assert first.scrape().value(rollup) == 4096
        body = http_get(first.url + "/metrics", OPENMETRICS)[1].decode()
    finally:
        client.close()
    pushed_before = time.time()
    before = created_samples(body)
    # The client sends every catalog family (preset label sets at zero): each rollup counter and histogram has one.
    assert {(f"{NS}rollup_{BYTES.removesuffix('_total')}_created", (("cache_type", "UnifiedRadixCache"),)),
            (f"{NS}rollup_{DURATION}_created", (("cache_type", "UnifiedRadixCache"),))} <= set(before)
    assert not [key for key in before if not key[0].startswith(f"{NS}rollup_")]
    assert all(pushed_after <= value <= pushed_before for value in before.values())  # wall-clock seconds
    first.stop()  # the save at stop
    size = state_file.stat().st_size
    second = SidecarThread(config).start()
    try:
        status, body, _ = http_get(second.url + "/metrics", OPENMETRICS)
        assert status == 200
        assert created_samples(body.decode()) == before
        families = {f.name: f for f in parse_openmetrics(body.decode())}
        assert [s.value for s in families[f"{NS}rollup_{BYTES.removesuffix('_total')}"].samples
                if s.name.endswith("_total")] == [4096.0]
        value = {s.name: s.value for f in families.values() if f.name.startswith("hicache_exporter_persistence_")
                 for s in f.samples}
        assert value["hicache_exporter_persistence_loaded_identities"] == 1
        assert value["hicache_exporter_persistence_file_bytes"] == size
        assert value["hicache_exporter_persistence_load_duration_seconds"] > 0
        assert value["hicache_exporter_persistence_writes_total"] == 0  # nothing changed since the load
        assert not [name for name in value if "failures" in name or "dropped" in name]
    finally:
        second.stop()
