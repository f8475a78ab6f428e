"""The proxy feed (exporter.sidecar.upstream): upstream expositions into the same state pushed ranks use.

Expositions are written by prometheus_client itself (a registry per engine process), parsed by
its parsers; the state runs on the harness's fake clock.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.config import RanksConfig, UpstreamConfig
from exporter.sidecar.registry import RankStatus
from exporter.sidecar.stats import UpstreamHealth
from exporter.sidecar.upstream import UpstreamFeed, parse_exposition
from tests.exporter.sidecar.harness import Harness

RADIX = ("cache_type", "tp_rank", "pp_rank", "dp_rank")


class Engine:
    """An engine's /metrics: radix counters and a histogram per rank, with the engine's `sglang:` names."""

    def __init__(self, labels: tuple[str, ...] = RADIX) -> None:
        self.registry = CollectorRegistry()
        self.labels = labels
        self.tokens = Counter("sglang:load_back_tokens_total", "tokens", [*labels, "pool"], registry=self.registry)
        self.bytes = Counter("sglang:load_back_bytes_total", "bytes", list(labels), registry=self.registry)
        self.duration = Histogram("sglang:load_back_duration_seconds", "seconds", list(labels),
                                  buckets=(0.01, 0.1), registry=self.registry)
        self.other = Counter("sglang:num_requests_total", "requests", ["model_name"], registry=self.registry)

    def rank(self, tp: int, dp: int = 0, tokens: float = 0, moved: float = 0, seconds: float | None = None) -> None:
        values = {"cache_type": "UnifiedRadixCache", "tp_rank": str(tp), "pp_rank": "0", "dp_rank": str(dp)}
        values = {k: v for k, v in values.items() if k in self.labels}
        self.tokens.labels(**values, pool="kv").inc(tokens)
        self.bytes.labels(**values).inc(moved)
        if seconds is not None:
            self.duration.labels(**values).observe(seconds)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def feed(h: Harness, **config: object) -> UpstreamFeed:
    upstream = UpstreamConfig.model_validate({"url": "http://engine:30000/metrics", **config})
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""), {"sglang_rollup_x"})


def read(text: str, openmetrics: bool = False) -> list[tuple[None, float, list]]:
    return [(None, 0.0, parse_exposition(text, openmetrics))]


def rollup(h: Harness, family: str, **labels: str) -> float:
    values = tuple(labels.values())
    return sum(v for (f, _, vals), v in h.state.ledger.counters.items() if f == family and vals == values)


def test_each_upstream_series_is_a_rank_and_rolls_up_as_pushed_ranks_do() -> None:
    h, engine = Harness(), Engine()
    for tp in (0, 1):
        for dp in (0, 1):
            engine.rank(tp, dp, tokens=100 * (dp + 1), moved=1000 * (tp + 1) + dp, seconds=0.05)
    result = feed(h).apply(read(engine.text()))
    assert result.ranks == 4 and not result.unranked and result.rejected == 0
    assert {(r.tp_rank, r.dp_rank) for r in h.state.ranks.values()} == {(0, 0), (1, 0), (0, 1), (1, 1)}
    assert all(dict(r.static) == {"cache_type": "UnifiedRadixCache"} for r in h.state.ranks.values())
    assert rollup(h, "load_back_tokens_total", pool="kv") == 100 + 200  # one replica per dp group
    assert rollup(h, "load_back_bytes_total") == 1000 + 2000 + 1001 + 2001  # every shard
    (duration,) = h.state.ledger.histograms.values()
    assert list(duration.counts) == [0, 4, 4] and duration.sum == 4 * 0.05


def test_a_counter_that_goes_down_is_a_restart_and_rollups_continue() -> None:
    h, up = Harness(), None
    engine = Engine()
    engine.rank(0, tokens=500, moved=5000)
    up = feed(h)
    up.apply(read(engine.text()))
    (rank,) = h.state.ranks.values()
    first_epoch = rank.epoch
    restarted = Engine()  # the engine restarted: its counters from zero
    restarted.rank(0, tokens=20, moved=200)
    result = up.apply(read(restarted.text()))
    assert result.resets == 1
    assert rank.restarts == 1 and rank.epoch != first_epoch and rank.status is RankStatus.LIVE
    assert rollup(h, "load_back_bytes_total") == 5200 and rollup(h, "load_back_tokens_total", pool="kv") == 520
    restarted.rank(0, tokens=5, moved=50)
    assert up.apply(read(restarted.text())).resets == 0
    assert rollup(h, "load_back_bytes_total") == 5250


def test_an_upstream_that_cannot_be_read_turns_its_ranks_stale_then_expired_and_they_recover() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10, expire_after_seconds=30))
    engine = Engine()
    engine.rank(0, tokens=10, moved=100)
    up = feed(h)
    up.apply(read(engine.text()))
    (rank,) = h.state.ranks.values()
    h.clock.advance(11)
    h.state.tick()
    assert rank.status is RankStatus.STALE
    h.clock.advance(20)
    h.state.tick()
    assert rank.status is RankStatus.EXPIRED and rollup(h, "load_back_bytes_total") == 100
    engine.rank(0, moved=1)
    up.apply(read(engine.text()))
    assert rank.status is RankStatus.LIVE and rollup(h, "load_back_bytes_total") == 101


def test_a_family_without_rank_labels_is_flagged_and_not_rolled_up() -> None:
    h, engine = Harness(), Engine(labels=("cache_type",))  # an engine before per-rank labels
    engine.rank(0, tokens=800, moved=8000, seconds=0.5)
    up = feed(h)
    result = up.apply(read(engine.text()))
    assert result.unranked == {"load_back_tokens_total", "load_back_bytes_total", "load_back_duration_seconds"}
    assert up.health.unranked == result.unranked
    assert not h.state.ranks and not h.state.ledger.counters


def test_radix_series_whose_cp_peers_collide_are_flagged() -> None:
    h, engine = Harness(), Engine()
    engine.rank(0, tokens=10, moved=100, seconds=0.5)
    storage = Counter("sglang:prefetched_tokens_total", "t", ["storage_backend", "tp_rank", "dp_rank", "pp_rank",
                                                              "pp_size", "attn_cp_rank", "attn_cp_size"],
                      registry=engine.registry)
    for cp in (0, 1):
        storage.labels("file", "0", "0", "0", "1", str(cp), "2").inc(7)
    result = feed(h).apply(read(engine.text()))
    assert result.cp_colliding == {"load_back_tokens_total", "load_back_bytes_total", "load_back_duration_seconds"}
    assert {r.attn_cp_rank for r in h.state.ranks.values()} == {0, 1}  # the storage ranks are fed
    assert rollup(h, "prefetched_tokens_total") == 7  # replicated across the CP peers of one dp group
    assert not [k for k in h.state.ledger.counters if k[0] == "load_back_bytes_total"]


def test_families_outside_the_catalog_pass_through_unless_they_clash_or_are_turned_off() -> None:
    h, engine = Harness(), Engine()
    engine.rank(0, tokens=1)
    engine.other.labels("m").inc(3)
    clash = Counter("sglang_rollup_x", "made by the sidecar too", registry=engine.registry)
    clash.inc()
    result = feed(h).apply(read(engine.text()))
    # (prometheus_client outside multiprocess mode adds `_created` gauges: families of their own, passed too)
    assert [f.name for f in result.pass_through if not f.name.endswith("_created")] == ["sglang:num_requests"]
    assert result.clashes == {"sglang_rollup_x"}
    assert feed(Harness(), pass_through=False).apply(read(engine.text())).pass_through == []


def test_the_engines_openmetrics_quirk_parses_to_the_same_ranks() -> None:
    engine = Engine()
    engine.rank(1, dp=1, tokens=64, moved=640, seconds=0.002)
    om = openmetrics_latest(engine.registry).decode()
    assert "# TYPE sglang:load_back_bytes counter" in om and "sglang_load_back_bytes_total{" in om  # the quirk
    by_text, by_om = Harness(), Harness()
    feed(by_text).apply(read(engine.text()))
    feed(by_om).apply(read(om, openmetrics=True))
    assert by_om.state.ledger.counters == by_text.state.ledger.counters
    assert [r.values for r in by_om.state.ranks.values()] == [r.values for r in by_text.state.ranks.values()]


# --- the scraper inside a real sidecar, over real HTTP ---


class EngineHTTP:
    """prometheus_client's own HTTP server over an Engine's registry, on a free loopback port."""

    def __init__(self, engine: Engine) -> None:
        from prometheus_client import start_http_server

        from tests.helpers import free_port

        self.port = free_port()
        self.server, self.thread = start_http_server(self.port, addr="127.0.0.1", registry=engine.registry)
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def proxy_config(socket_dir, url: str, **metrics: object):  # type: ignore[no-untyped-def]
    from exporter.config import config_from_data

    return config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "run" / "m.sock")},
        "metrics": metrics, "upstreams": [{"url": url, "interval_seconds": 0.2, "timeout_seconds": 0.2}],
    }, "test")


def test_a_pass_through_family_that_clashes_stops_start_up_with_a_message(socket_dir) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from exporter.errors import ConfigError
    from tests.helpers import SidecarThread

    engine = Engine()
    engine.rank(0, tokens=1)
    Counter("sglang_rollup_load_back_bytes_total", "a clash", registry=engine.registry).inc()
    http = EngineHTTP(engine)
    thread = SidecarThread(proxy_config(socket_dir, http.url))
    try:
        with pytest.raises(ConfigError, match=r"sglang_rollup_load_back_bytes'\] are passed through and are also "
                                              "families the sidecar makes"):
            thread.start()
    finally:
        thread.sidecar = None
        thread.stop()
        http.stop()
    assert not (socket_dir / "run" / "m.sock").exists()  # what start-up had begun is undone


def test_rollups_only_leave_out_the_per_rank_series_and_the_json_view_lists_ranks_and_upstreams(socket_dir) -> None:  # type: ignore[no-untyped-def]
    import json

    from tests.helpers import SidecarThread, http_get

    engine = Engine()
    engine.rank(0, tokens=10, moved=100)
    engine.rank(1, tokens=10, moved=200)
    engine.other.labels("m").inc(2)
    http = EngineHTTP(engine)
    sidecar = SidecarThread(proxy_config(socket_dir, http.url, per_rank_series=False)).start()
    try:
        scrape = sidecar.scrape()
        assert not scrape.find("sglang_load_back_bytes_total")
        assert scrape.value("sglang_rollup_load_back_bytes_total", cache_type="UnifiedRadixCache") == 300
        assert scrape.value("sglang:num_requests_total", model_name="m") == 2
        assert scrape.value("hicache_exporter_upstream_up", upstream=http.url) == 1
        view = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])
        assert {(r["tp_rank"], r["status"]) for r in view["ranks"]} == {(0, "live"), (1, "live")}
        (upstream,) = view["upstreams"]
        assert upstream["name"] == http.url and upstream["up"] and upstream["ranks"] == 2
        assert b"Upstreams" in http_get(sidecar.url + "/")[1]
        om = http_get(sidecar.url + "/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"})[1].decode()
        assert om.endswith("# EOF\n") and om.count("# EOF") == 1
    finally:
        sidecar.stop()
        http.stop()
