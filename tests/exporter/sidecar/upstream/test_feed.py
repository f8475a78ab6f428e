"""The proxy feed (exporter.sidecar.upstream.feed): upstream expositions into the same state pushed ranks use.

Expositions are written by prometheus_client itself (a registry per engine process), parsed by
its parsers; the state runs on the harness's fake clock.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

from exporter.config import RanksConfig, UpstreamConfig
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.ranks import RankStatus
from exporter.sidecar.upstream import problems as problems_module
from exporter.sidecar.upstream.continuity import REPLACED_PIDS_KEPT
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.plan import PlannedRead, exposition_text
from exporter.sidecar.upstream.problems import LOG_AGAIN_SECONDS, MAX_LOG_LINES_PER_READ
from exporter.sidecar.upstream.text import parse_exposition
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.support import directory_exposition
from tests.exporter.sidecar.upstream_texts import read_sequences

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


def test_counters_that_all_go_down_are_an_engine_restart_and_rollups_continue() -> None:
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
    assert result.series_resets == 2 and up.health.series_resets == 2
    # Every series went down at once: the engine restarted, and so does its rank, with a new epoch.
    assert result.resets == 1 and rank.restarts == 1 and rank.epoch != first_epoch and rank.status is RankStatus.LIVE
    assert rollup(h, "load_back_bytes_total") == 5200 and rollup(h, "load_back_tokens_total", pool="kv") == 520
    assert rank.values[("load_back_bytes_total", ())] == 200  # the per-rank series start again from the engine's
    restarted.rank(0, tokens=5, moved=50)
    assert up.apply(read(restarted.text())).series_resets == 0
    assert rollup(h, "load_back_bytes_total") == 5250


def test_an_upstream_that_cannot_be_read_turns_its_ranks_stale_then_expired_and_they_recover() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10, expire_after_seconds=30))
    engine = Engine()
    engine.rank(0, tokens=10, moved=100)
    up = feed(h)
    up.apply(read(engine.text()))
    (rank,) = h.state.ranks.values()
    h.clock.advance(11)
    assert rank.status is RankStatus.STALE
    h.clock.advance(20)
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


def test_a_gauge_that_goes_down_is_not_a_restart() -> None:
    h, registry = Harness(), CollectorRegistry()
    used = Gauge("sglang:hicache_host_used_tokens", "used", ["model_name", "tp_rank", "pp_rank", "dp_rank"],
                 registry=registry)
    used.labels("m", "0", "0", "0").set(100)
    up = feed(h)
    up.apply(read(generate_latest(registry).decode()))
    used.labels("m", "0", "0", "0").set(40)  # the host pool freed tokens
    assert up.apply(read(generate_latest(registry).decode())).resets == 0
    (rank,) = h.state.ranks.values()
    assert rank.restarts == 0 and rank.values[("hicache_host_used_tokens", ())] == 40


def test_histogram_counts_or_bounds_that_are_no_numbers_refuse_that_series_not_the_read() -> None:
    h = Harness()
    up = feed(h)
    labels = 'cache_type="c",tp_rank="0",pp_rank="0",dp_rank="0"'
    for count, bound in (("NaN", "0.1"), ("+Inf", "0.1"), ("1", "a tenth")):
        text = ("# TYPE sglang:load_back_duration_seconds histogram\n"
                f'sglang:load_back_duration_seconds_bucket{{{labels},le="{bound}"}} {count}\n'
                f'sglang:load_back_duration_seconds_bucket{{{labels},le="+Inf"}} 1\n'
                "# TYPE sglang:load_back_bytes_total counter\n"
                f"sglang:load_back_bytes_total{{{labels}}} 5\n")
        result = up.apply(read(text))  # the released code raised here, which ended the scraper's loop
        assert result.rejected == 1 and rollup(h, "load_back_bytes_total") == 5
    assert not h.state.ledger.histograms


def test_a_text_the_parser_overflows_on_is_a_parse_error() -> None:
    import pytest

    with pytest.raises(ValueError):
        parse_exposition("x 1 1" + "0" * 400 + "\n", False)  # a timestamp too large for a float
    up = feed(Harness())
    with pytest.raises(ValueError):
        up.plan_text("x 1 1" + "0" * 400 + "\n", False)


def test_a_read_with_the_last_reads_shape_is_read_by_its_values_and_any_other_by_the_parser() -> None:
    h, engine = Harness(), Engine()
    engine.rank(0, tokens=10, moved=100, seconds=0.05)
    up = feed(h)
    first = up.plan_text(engine.text(), False)
    assert first.parsed
    up.apply(first)
    engine.rank(0, tokens=5, moved=50, seconds=0.5)
    again = up.plan_text(engine.text(), False)
    assert not again.parsed
    up.apply(again)
    assert rollup(h, "load_back_bytes_total") == 150 and rollup(h, "load_back_tokens_total", pool="kv") == 15
    (duration,) = h.state.ledger.histograms.values()
    assert list(duration.counts) == [0, 1, 2] and duration.sum == 0.55
    engine.rank(1, tokens=1)  # a new rank's series: a new shape
    assert up.plan_text(engine.text(), False).parsed
    text = engine.text()
    up.apply(up.plan_text(text, False))
    assert up.plan_text(text.replace("# HELP sglang:load_back_bytes_total bytes",
                                     "# HELP sglang:load_back_bytes_total other bytes"), False).parsed
    assert up.plan_text(text, False).parsed  # back to the old HELP: parsed again, then known
    assert not up.plan_text(text, False).parsed


def test_no_layout_is_kept_for_a_text_beyond_the_series_budget() -> None:
    h, engine = Harness(ranks_config=RanksConfig(max_series_total=2)), Engine()
    for tp in range(4):
        engine.rank(tp, tokens=10, moved=100, seconds=0.05)
    up = feed(h)
    assert up.layout_lines < sum(len(f.samples) for f in parse_exposition(engine.text(), False))
    assert up.plan_text(engine.text(), False).parsed and up.plan_text(engine.text(), False).parsed


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


def proxy_config(socket_dir, url: str, read_timeout: float = 1.0, **metrics: object):  # type: ignore[no-untyped-def]
    from exporter.config import config_from_data

    upstream = {"url": url, "interval_seconds": max(0.2, read_timeout), "timeout_seconds": read_timeout}
    return config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "run" / "m.sock")},
        "metrics": metrics, "upstreams": [upstream],
    }, "test")


@pytest.mark.parametrize("name, said", [("sglang_rollup_load_back_bytes_total", "sglang_rollup_load_back_bytes"),
                                         ("process_cpu_seconds_total", "process_cpu_seconds")])
def test_a_pass_through_family_that_clashes_stops_start_up_with_a_message(socket_dir, name, said) -> None:  # type: ignore[no-untyped-def]
    from exporter.errors import ConfigError
    from tests.helpers import SidecarThread

    engine = Engine()
    engine.rank(0, tokens=1)
    Counter(name, "a clash", registry=engine.registry).inc()  # the sidecar's rollup, or its own process metrics
    http = EngineHTTP(engine)
    # The start-up read must answer for the clash to show: a loaded machine may take longer than 0.2 s.
    thread = SidecarThread(proxy_config(socket_dir, http.url, read_timeout=10.0))
    try:
        with pytest.raises(ConfigError, match=rf"{said}'\] are passed through and are also "
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


# --- reads by their values alone (the text layout) give what the parser gives ---


def _state(h: Harness, up: UpstreamFeed, result: Any) -> Any:
    """Everything a read leaves behind: ranks (values, positions, epochs), rollups, HELP texts, what
    is passed through (as prometheus_client writes it) and what the read reported."""
    ranks = {identity: (r.epoch, r.restarts, r.seq, r.status, r.values, r.positions, r.bucket_positions,
                        r.layout_conflicts, r.last_push_wall) for identity, r in h.state.ranks.items()}
    ledger = h.state.ledger
    rollups = (ledger.counters, {k: (v.bounds, v.counts, v.sum) for k, v in ledger.histograms.items()},
               {g: {k: (getattr(m, "value", None), getattr(m, "counts", None), getattr(m, "sum", None))
                    for k, m in marks.items()} for g, marks in ledger.watermarks.items()},
               ledger.gauges(h.state.ranks.values()), ledger.layout_conflicts)
    passed = exposition_text(up.pass_through, False)  # as prometheus_client's generate_latest writes them
    report = None if result is None else (result.samples, result.ranks, result.resets, result.rejected,
                                          result.unranked, result.cp_colliding, result.clashes)
    return ranks, rollups, dict(h.state.help), passed, report, up.health.unranked, up.health.cp_colliding


@settings(max_examples=250, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(sequence=read_sequences(), openmetrics=st.booleans(), quirk=st.booleans())
def test_reads_by_their_values_alone_leave_the_state_the_parser_and_the_slow_path_leave(
    sequence: list[Any], openmetrics: bool, quirk: bool,
) -> None:
    """For every read of a sequence, the feed that reads texts by their layout where it can ends in
    the same state as a feed given prometheus_client's parse of every text."""
    fast_h, slow_h = Harness(), Harness()
    fast, slow = feed(fast_h), feed(slow_h)
    for exposition in sequence:
        text = exposition.text(openmetrics, quirk)
        try:
            reading: PlannedRead | None = fast.plan_text(text, openmetrics)
        except ValueError:
            reading = None
        try:
            families = parse_exposition(text, openmetrics)
        except ValueError:
            families = None
        assert (reading is None) == (families is None), "the two ways of reading disagree on whether the text parses"
        fast_result = None if reading is None else fast.apply(reading)
        slow_result = None if families is None else slow.apply([(None, 0.0, families)])
        assert _state(fast_h, fast, fast_result) == _state(slow_h, slow, slow_result)
        fast_h.clock.advance(1)
        slow_h.clock.advance(1)


def test_an_answer_longer_than_the_bound_is_refused_not_read() -> None:
    import asyncio

    from exporter.sidecar.upstream.scrape import UpstreamScraper

    engine = Engine()
    for tp in range(8):
        engine.rank(tp, tokens=1, moved=1)
    http = EngineHTTP(engine)
    h = Harness()
    up = feed(h, url=http.url)
    scraper = UpstreamScraper(up.config, up)

    async def two_reads() -> tuple[object, object]:
        await scraper.start()  # the first read: within the bound
        scraper.max_body_bytes = len(engine.text()) // 2
        refused = await scraper.scrape_once()
        await scraper.stop()
        return len(h.state.ranks), refused

    try:
        ranks, refused = asyncio.run(two_reads())
    finally:
        http.stop()
    assert ranks == 8 and refused is None
    assert not up.health.up and up.health.errors == {"too_large": 1}


def test_a_directory_read_without_pass_through_skips_the_merged_reading_and_feeds_the_same(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from exporter.sidecar.upstream.files import MERGED

    labels = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
    for pid, tp in (("101", "0"), ("102", "1")):  # two rank processes' files, written by prometheus_client's writer
        values = MmapedDict(str(tmp_path / f"counter_{pid}.db"))
        family = "sglang:load_back_bytes"  # (a family, and the name of its sample)
        values.write_value(mmap_key(family, family + "_total", labels, ["c", tp, "0", "0"], "bytes"), 100.0 * (int(tp) + 1), 0.0)
        values.write_value(mmap_key("sglang:num_requests", "sglang:num_requests_total", ["m"], ["x"], "r"), 1.0, 0.0)
        values.close()
    assert [pid for pid, _, _ in directory_exposition(tmp_path)] == ["101", "102", MERGED]
    assert [pid for pid, _, _ in directory_exposition(tmp_path, merged=False)] == ["101", "102"]
    both, apart = Harness(), Harness()
    feed(both, pass_through=False).apply(directory_exposition(tmp_path))
    feed(apart, pass_through=False).apply(directory_exposition(tmp_path, merged=False))
    assert rollup(apart, "load_back_bytes_total") == 300 == rollup(both, "load_back_bytes_total")
    assert [r.values for r in apart.state.ranks.values()] == [r.values for r in both.state.ranks.values()]


# --- what the feed logs (review 19: findings 9, 11) ---


def _bad_ranks(count: int) -> str:
    """A counter with `count` series whose tp_rank has a leading zero: each refused, each a problem to log."""
    return "# TYPE sglang:load_back_bytes_total counter\n" + "".join(
        f'sglang:load_back_bytes_total{{cache_type="c",tp_rank="0{i}",pp_rank="0",dp_rank="0"}} 1\n'
        for i in range(count))


def test_a_read_logs_at_most_its_share_and_the_log_memory_forgets(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: one read of 10,000 bad rank labels logged 10,000 lines and filled the once-only memory
    for good: a NaN counter an hour later was never logged."""
    monkeypatch.setattr(problems_module, "MAX_LOGGED", 30)
    h = Harness()
    up = feed(h)
    caplog.set_level(logging.INFO, logger="hicache_exporter.upstream")
    result = up.apply(read(_bad_ranks(100)))
    lines = [r.getMessage() for r in caplog.records]
    assert result.rejected == 100 and len(lines) == MAX_LOG_LINES_PER_READ + 1
    assert all("tp_rank='0" in line for line in lines[:-1])
    assert lines[-1] == ("upstream http://engine:30000/metrics: 80 more problems this read, not logged; see "
                         "hicache_exporter_upstream_scrape_errors_total")
    caplog.clear()
    up.apply(read(_bad_ranks(100)))  # the next 20 problems are logged: the first 20 were, a moment ago
    lines = [r.getMessage() for r in caplog.records]
    assert "tp_rank='020'" in lines[0] and "60 more problems" in lines[-1] and len(up.problems.throttle) == 30
    caplog.clear()
    h.clock.advance(LOG_AGAIN_SECONDS)
    up.apply(read('# TYPE sglang:load_back_bytes_total counter\nsglang:load_back_bytes_total{cache_type="c",'
                  'tp_rank="0",pp_rank="0",dp_rank="0"} NaN\n'))
    assert [r.getMessage() for r in caplog.records] == [
        "upstream http://engine:30000/metrics: load_back_bytes_total{cache_type='c',dp_rank='0',pp_rank='0',"
        "tp_rank='0'} refused this read: counter value nan is not a finite number of zero or more"]


def test_a_parse_error_without_a_message_is_named() -> None:
    """Before: `# TYPE evil.name counter` raised ValueError() and the log line read `upstream …:  (parse)`."""
    with pytest.raises(ValueError) as raised:
        parse_exposition("# TYPE evil.name counter\n", False)
    assert str(raised.value) == ("ValueError: prometheus_client's parser refused a line and gave no reason "
                                 "(an invalid metric name or TYPE line?)")


def test_a_refused_value_that_moves_every_read_is_logged_once_not_every_read(caplog: pytest.LogCaptureFixture) -> None:
    """Before: the log key quoted the value, so a negative counter that moved was a new problem each read."""
    h = Harness()
    up = feed(h)
    caplog.set_level(logging.INFO, logger="hicache_exporter.upstream")
    for n in range(10):
        up.apply(read('# TYPE sglang:load_back_bytes_total counter\nsglang:load_back_bytes_total{cache_type="c",'
                      f'tp_rank="0",pp_rank="0",dp_rank="0"}} -{n + 1}\n'))
    assert up.health.errors == {} and len(caplog.records) == 1  # counted ten times in `rejected`, logged once


def test_a_nan_bucket_bound_is_refused_and_never_reads_as_a_layout_change() -> None:
    """Before: NaN != NaN made every parsed read a new layout: rank restarts, series resets, a flapping series."""
    h = Harness()
    up = feed(h)
    name, labels = "sglang:load_back_duration_seconds", 'cache_type="c",tp_rank="0",pp_rank="0",dp_rank="0"'
    text = (f"# TYPE {name} histogram\n{name}_bucket{{{labels},le=\"NaN\"}} 1\n{name}_bucket{{{labels},le=\"+Inf\"}} 2\n"
            f"{name}_count{{{labels}}} 2\n{name}_sum{{{labels}}} 0.5\n")
    results = [up.apply(read(text)) for _ in range(8)]
    assert all(r.rejected == 1 for r in results)
    assert (up.health.series_resets, up.health.flapping) == (0, 0)
    assert all(rank.restarts == 0 for rank in h.state.ranks.values())


def test_the_pids_a_rank_replaced_are_remembered_boundedly() -> None:
    """Before: every new pid of a rank in a directory read stayed in a set for good (20,000 reads, 19,999 pids)."""
    h = Harness()
    up = feed(h)
    engine = Engine()
    engine.rank(0, tokens=1, moved=10)
    families = parse_exposition(engine.text(), False)
    for pid in range(200):
        up.apply([(str(pid), float(pid), families)])
    (entry,) = up.ranks.values()
    assert len(entry.replaced_pids) == REPLACED_PIDS_KEPT
    assert list(entry.replaced_pids)[-1] == "198"
    assert rollup(h, "load_back_bytes_total") == 200 * 10  # each new process counted from zero, as before


def test_the_feed_makes_no_wire_messages() -> None:
    """The feed hands the core typed records (Join, Push): it builds no protocol Hello or Snapshot to reuse the push path."""
    import exporter.sidecar.upstream.feed as feed_module

    assert not hasattr(feed_module, "Hello") and not hasattr(feed_module, "Snapshot")
    assert not hasattr(feed_module, "PROTOCOL_VERSION")
