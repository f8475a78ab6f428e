"""The proxy feed's bounds (exporter.sidecar.upstream.feed): identities it stops listing, what one read
may hold, and the names its pass-through may write.

Expositions are written by prometheus_client or by hand where an engine's could be malformed; the
state runs on the harness's fake clock.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import pytest
from prometheus_client import Counter, Gauge

from exporter.config import RanksConfig, UpstreamConfig
from exporter.errors import ProtocolError
from exporter.sidecar.core.health import SidecarHealth, UpstreamHealth
from exporter.sidecar.core.ranks import RankStatus
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.upstream import feed as upstream_module
from exporter.sidecar.upstream.continuity import FORGET_SERIES_SECONDS
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.plan import MAX_PASS_THROUGH_BYTES, MAX_PASS_THROUGH_SAMPLES, FeedResult
from exporter.sidecar.upstream.text import parse_exposition
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine, read, rollup


def feed(h: Harness, **config: object) -> UpstreamFeed:
    """A feed whose reserved names are those a real sidecar with the `sglang_` namespace makes."""
    upstream = UpstreamConfig.model_validate({"url": "http://engine:30000/metrics", **config})
    names = SidecarCollector(h.state, SidecarHealth(), "sglang_").exposed_names()
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""), names)


def small(max_ranks: int = 4) -> Harness:
    return Harness(ranks_config=RanksConfig(max_ranks=max_ranks, stale_after_seconds=10, expire_after_seconds=30))


def engine_of(*tps: int, moved: float = 100) -> Engine:
    engine = Engine()
    for tp in tps:
        engine.rank(tp, moved=moved + tp)
    return engine


# --- identities a read no longer lists (finding 9) ---


def test_identities_a_read_no_longer_lists_depart_expire_and_free_their_slots_for_pushed_ranks() -> None:
    h = small()
    up = feed(h)
    assert up.apply(read(engine_of(0, 1, 2, 3).text())).ranks == 4  # the registry is full
    result = up.apply(read(Engine().text()))  # the engine lists no rank any more
    assert result.departed == 4 and result.ranks == 0
    assert {r.status for r in h.state.ranks.values()} == {RankStatus.DEPARTED}
    with pytest.raises(ProtocolError, match="max_ranks=4"):
        h.hello(tp=9)  # not yet expired: their slots are still held, as a departed pushed rank's
    h.clock.advance(31)
    _, rank = h.hello(tp=9)  # expired: forgotten to make room
    assert rank.status is RankStatus.LIVE
    up.apply(read(Engine().text()))
    assert up.ranks == {}  # the feed forgets what the registry forgot


def test_an_identity_listed_again_reconnects_in_its_epoch_and_its_rollup_goes_on() -> None:
    h = small()
    up = feed(h)
    up.apply(read(engine_of(0, 1).text()))
    up.apply(read(engine_of(0).text()))
    by_tp = {r.tp_rank: r for r in h.state.ranks.values()}
    assert by_tp[1].status is RankStatus.DEPARTED and by_tp[0].status is RankStatus.LIVE
    engine = engine_of(0, 1)
    engine.rank(1, moved=5)  # tp 1 moved 101 + 5 bytes in all
    result = up.apply(read(engine.text()))
    assert result.ranks == 2 and result.resets == 0 and by_tp[1].status is RankStatus.LIVE
    assert by_tp[1].restarts == 0 and by_tp[1].reconnects == 1
    assert rollup(h, "load_back_bytes_total") == 100 + 106  # each rank's cumulative bytes, once


def test_an_identity_listed_again_after_the_registry_forgot_it_resumes_without_counting_twice() -> None:
    h = small(max_ranks=2)
    up = feed(h)
    up.apply(read(engine_of(0).text()))
    up.apply(read(Engine().text()))
    h.clock.advance(31)
    h.hello(tp=7)
    h.state.disconnect(*h.hello(tp=8))  # the registry forgot tp 0 to make room for pushed ranks; one left again
    assert up.apply(read(Engine().text())).ranks == 0 and up.ranks == {}
    assert rollup(h, "load_back_bytes_total") == 100
    h.clock.advance(31)
    engine = engine_of(0)
    engine.rank(0, moved=10)
    assert up.apply(read(engine.text())).ranks == 1
    # Resumed in the epoch the registry remembered: its first values are a baseline, not new bytes
    # (the 10 moved while it was forgotten are not seen), and what it moves next counts.
    assert rollup(h, "load_back_bytes_total") == 100
    engine.rank(0, moved=5)
    up.apply(read(engine.text()))
    assert rollup(h, "load_back_bytes_total") == 105


def test_new_identities_on_every_read_keep_the_feed_bounded_and_are_fed() -> None:
    h = small()
    up = feed(h)
    for n in range(10):
        tps = range(4 * n, 4 * n + 4)
        result = up.apply(read(engine_of(*tps).text()))
        live = {r.tp_rank for r in h.state.ranks.values() if r.status is RankStatus.LIVE}
        assert result.ranks == 4 and live == set(tps)
        assert len(up.ranks) <= 8 and len(h.state.ranks) <= 4
        h.clock.advance(31)
    assert up.health.errors == {}


def test_release_expired_frees_the_slots_of_an_upstream_that_cannot_be_read() -> None:
    h = small()
    up = feed(h)
    up.apply(read(engine_of(0, 1, 2, 3).text()))
    h.clock.advance(31)
    # no read since: expired, yet still connected
    assert up.release_expired() == 4
    assert h.hello(tp=9)[1].status is RankStatus.LIVE


# --- what one read may hold (finding 7) ---


def test_a_read_lists_at_most_max_ranks_identities_and_counts_the_rest() -> None:
    h = small()
    up = feed(h)
    result = up.apply(read(engine_of(*range(10)).text()))
    assert result.ranks == 4 and len(h.state.ranks) == 4
    # 6 identities left out, 2 catalog series each (tokens and bytes; no histogram observed)
    assert result.cut == {"too_many_ranks": "12 series of rank identities past the first 4 of this read are "
                                            "left out (ranks.max_ranks)"}
    assert up.health.errors == {"too_many_ranks": 1}  # once per read, not once per identity


def test_a_text_with_more_sample_lines_than_the_read_bound_is_refused_before_it_is_parsed() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_total=2))
    up = feed(h)
    bound = 4 * 2 + MAX_PASS_THROUGH_SAMPLES
    assert up.max_read_samples == bound
    text = "# TYPE a gauge\n" + "a 1\n" * bound
    assert len(up.plan_text(text, False).values) == bound
    with pytest.raises(ValueError, match=rf"the answer has {bound + 1} sample lines, more than the {bound} one read"):
        up.plan_text(text + "a 1\n", False)


def test_a_directory_reading_past_the_read_bound_is_refused_by_plan_exposition() -> None:
    h = Harness(ranks_config=RanksConfig(max_series_total=2))
    up = feed(h, url=None, multiprocess_dir="/nonexistent")
    families = parse_exposition("".join(f"a{i} 1\n" for i in range(up.max_read_samples + 1)), False)
    with pytest.raises(ValueError, match=r"the directory holds 16393 samples, more than the 16392"):
        up.plan_exposition([("1", 0.0, families)])


def test_pass_through_is_held_to_its_sample_and_byte_caps_whole_families_at_a_time() -> None:
    h = Harness()
    up = feed(h)
    fits = "# TYPE kept gauge\nkept 1\n"
    many = "# TYPE many gauge\n" + "".join(f'many{{i="{i}"}} 1\n' for i in range(MAX_PASS_THROUGH_SAMPLES))
    size = MAX_PASS_THROUGH_BYTES // 500  # 600-byte label values: more than the bytes cap in all
    wide = "# TYPE wide gauge\n" + "".join(f'wide{{i="{i}",v="{"x" * 600}"}} 1\n' for i in range(size))
    result = up.apply(read(fits + many + wide))
    assert [f.name for f in result.pass_through] == ["kept"]
    assert result.cut["pass_through_too_large"].startswith(
        f"2 families ({MAX_PASS_THROUGH_SAMPLES + size} samples; the first: many) are not passed through")
    assert up.health.errors == {"pass_through_too_large": 1}
    assert up.pass_through_text(False) == "# HELP kept \n# TYPE kept gauge\nkept 1.0\n"
    result = up.apply(read(wide + fits))  # each cap alone
    assert [f.name for f in result.pass_through] == ["kept"] and "(1 families" not in result.cut.get(
        "pass_through_too_large", "(1 families")


# --- names pass-through may write (finding 12) ---


@pytest.mark.parametrize("line, family", [
    ('{"sglang.rollup_load_back_bytes_total"} 1\n', "sglang.rollup_load_back_bytes_total"),  # quoted UTF-8
    ('{"hicache_exporter.rank_up",tp_rank="7"} 1\n', "hicache_exporter.rank_up"),
    ("# TYPE sglang_rollup_load_back_bytes_total gauge\nsglang_rollup_load_back_bytes_total 1\n",
     "sglang_rollup_load_back_bytes_total"),  # a gauge named as a sidecar counter's sample
    ("# TYPE sglang_rollup_load_back_duration_seconds_count gauge\nsglang_rollup_load_back_duration_seconds_count 1\n",
     "sglang_rollup_load_back_duration_seconds_count"),  # a histogram's sample
    ("# TYPE hicache_exporter_rank_up_created gauge\nhicache_exporter_rank_up_created 1\n",
     "hicache_exporter_rank_up_created"),
])
def test_pass_through_that_writes_a_name_of_the_sidecars_is_refused(line: str, family: str) -> None:
    up = feed(Harness())
    result = up.apply(read("# TYPE kept gauge\nkept 1\n" + line))
    assert result.clashes == {family} and [f.name for f in result.pass_through] == ["kept"]
    assert "rollup" not in up.pass_through_text(False) and "rank_up" not in up.pass_through_text(True)


def test_a_clashing_counters_created_family_is_refused_with_it_and_not_named_apart() -> None:
    engine = Engine()
    Counter("sglang_rollup_load_back_bytes_total", "a clash", registry=engine.registry).inc()
    result = feed(Harness()).apply(read(engine.text()))
    assert result.clashes == {"sglang_rollup_load_back_bytes"}
    assert not [f for f in result.pass_through if f.name.startswith("sglang_rollup")]


def promtool(text: str) -> subprocess.CompletedProcess[str]:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed")
    return subprocess.run([path, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("text, passed, duplicates", [
    # prometheus_client parses this to an empty counter `passed` and an untyped `passed_total`: both TYPE passed_total
    ("# TYPE passed counter\npassed_total 1\n", ["passed_total"], set()),
    ('{"x.y"} 1\nx_y 2\n', ["x.y"], {"x_y"}),  # two families written as one name
    ("# TYPE a counter\na_total 1\n# TYPE a_total gauge\na_total 2\n", ["a_total"], {"a_total"}),
    ("# TYPE c_total counter\nc_total 1\n# TYPE c gauge\nc 2\n", ["c"], {"c"}),  # OpenMetrics: two TYPE c lines
])
def test_pass_through_writes_each_name_once_and_promtool_reads_it(
    text: str, passed: list[str], duplicates: set[str],
) -> None:
    up = feed(Harness())
    result = up.apply(read(text))
    assert [f.name for f in result.pass_through] == passed and result.duplicates == duplicates
    assert up.health.errors == ({"duplicate_name": 1} if duplicates else {})
    rendered = up.pass_through_text(False)
    types = [line.split()[2] for line in rendered.splitlines() if line.startswith("# TYPE ")]
    assert len(types) == len(set(types))
    checked = promtool(rendered)
    assert checked.returncode != 1 and "error while linting" not in checked.stderr + checked.stdout


# --- applying a read in slices ---


async def applied_in_slices(up: UpstreamFeed, text: str) -> tuple[FeedResult, int]:
    """`apply_async` of one text read, and how many times the loop ran something else meanwhile."""
    turns = 0

    async def ticker() -> None:
        nonlocal turns
        while True:
            await asyncio.sleep(0)
            turns += 1

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0)
    try:
        return await up.apply_async(up.plan_text(text, False)), turns
    finally:
        task.cancel()


def test_apply_async_gives_the_loop_back_and_leaves_what_apply_leaves(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(upstream_module, "APPLY_SLICE_SERIES", 2)
    results: list[FeedResult] = []
    states = []
    turns = 0

    engine = engine_of(*range(8))
    Gauge("sglang:other_gauge", "passed", registry=engine.registry).set(2)
    texts = [engine.text()]
    engine.rank(3, moved=7)
    texts.append(engine.text())  # the same shape: read by its values alone
    for sliced in (False, True):
        h = Harness()
        up = feed(h)
        for text in texts:
            if sliced:
                result, read_turns = asyncio.run(applied_in_slices(up, text))
                turns += read_turns
            else:
                result = up.apply(up.plan_text(text, False))
        results.append(result)
        states.append(({k: (r.status, dict(r.values)) for k, r in h.state.ranks.items()},
                       dict(h.state.ledger.counters), up.pass_through_text(False)))
    assert turns >= 2 * 8  # 8 ranks of 2 series, one slice each, per read
    assert states[0] == states[1]
    assert (results[0].ranks, results[0].samples, results[0].departed) == (results[1].ranks, results[1].samples, 0)
    assert [f.name for f in results[0].pass_through] == [f.name for f in results[1].pass_through]


# --- series per rank (review 19: findings 2, 3, 10) ---


def pools(*names: str, value: float = 5) -> str:
    """One rank's load-back tokens counter, one series per `pool` name."""
    labels = 'cache_type="c",tp_rank="0",pp_rank="0",dp_rank="0"'
    return "# TYPE sglang:load_back_tokens_total counter\n" + "".join(
        f'sglang:load_back_tokens_total{{{labels},pool="{name}"}} {value}\n' for name in names)


def continued(up: UpstreamFeed) -> set[str]:
    """The pools of the one identity whose series the feed makes continuous."""
    (entry,) = up.ranks.values()
    return {dict(key[1])["pool"] for key in entry.series}


def test_the_feed_continues_at_most_max_series_per_rank_series_and_forgets_only_long_unlisted_ones() -> None:
    """Before: every new series was remembered (300,000 after 6 reads of 50,000 new ones, 567 MB)."""
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=4))
    up = feed(h)
    up.apply(read(pools("a", "b", "c", "d")))
    h.clock.advance(10)
    result = up.apply(read(pools("a", "e", "f", "g")))  # three new series: the rank holds four
    assert continued(up) == {"a", "b", "c", "d"} and result.rejected == 3
    h.clock.advance(FORGET_SERIES_SECONDS + 1)
    result = up.apply(read(pools("a", "e", "f")))  # b, c and d unlisted for an hour: two of them make room
    assert len(continued(up)) == 4 and {"a", "e", "f"} <= continued(up)
    assert result.rejected == 2  # the state holds b, c and d until the rank's epoch ends: it refuses e and f
    (rank,) = h.state.ranks.values()
    assert rank.values[("load_back_tokens_total", ("a",))] == 5


def test_a_rank_lists_at_most_max_series_per_rank_series_and_is_fed_a_slice_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: every series of a rank was planned and fed in one snapshot (110,000 blocked the loop 2.9 s)."""
    monkeypatch.setattr(upstream_module, "APPLY_SLICE_SERIES", 2)
    h = Harness(ranks_config=RanksConfig(max_series_per_rank=5))
    up = feed(h)
    result, turns = asyncio.run(applied_in_slices(up, pools(*"abcdefg")))
    assert result.cut == {"series_limit": "2 series of ranks past the first 5 of their rank in this read are left "
                                          "out (ranks.max_series_per_rank)"}
    assert up.health.errors == {"series_limit": 1} and result.rejected == 0
    (entry,) = up.ranks.values()
    assert entry.seq == 3 and turns >= 3  # five series in snapshots of 2, 2 and 1, the loop run between them
    (rank,) = h.state.ranks.values()
    assert {labels[0]: value for (_, labels), value in rank.values.items()} == dict.fromkeys("abcde", 5)


def test_a_family_passed_through_that_lists_a_sample_twice_keeps_the_first() -> None:
    """Before: `dupx{a="1"} 1.0` and `dupx{a="1"} 2.0` were both re-exposed (Prometheus refuses that)."""
    h = Harness()
    up = feed(h)
    for values in ((1, 2, 3), (4, 5, 6)):  # the second read has the first's shape: read by its values alone
        one, again, two = values
        text = f'# TYPE dupx gauge\ndupx{{a="1"}} {one}\ndupx{{a="1"}} {again}\ndupx{{a="2"}} {two}\n'
        result = up.apply(up.plan_text(text, False))
        lines = [line for line in up.pass_through_text(False).splitlines() if line.startswith("dupx")]
        assert lines == [f'dupx{{a="1"}} {values[0]}.0', f'dupx{{a="2"}} {values[2]}.0']
    assert result.cut == {"duplicate_series": "1 series are listed more than once in this read (the first: "
                                              "dupx{a='1'}); the first listing of each is kept, the others left "
                                              "out (Prometheus would refuse the exposition)"}
    assert up.health.errors == {"duplicate_series": 2}
