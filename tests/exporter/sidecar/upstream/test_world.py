"""An upstream's expected world (exporter.sidecar.upstream.world and the feed that applies it): the configured
`world:`, completed by the engine's storage labels, judged by each read's ranks, and given to every rank the
feed says hello for.

Expositions are written by prometheus_client with the labels SGLang 0.5.23's collectors write (radix:
metrics_collector.py:2416, storage: storage_attachment.py, scheduler: metrics_collector.py:1380-1394).
"""

from __future__ import annotations

import logging

import msgspec
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.exposition import generate_latest

from exporter.catalog import DEFAULT_STREAMS
from exporter.config import UpstreamConfig, UpstreamWorld
from exporter.protocol.messages import RankId, World
from exporter.sidecar.core import saved as core_saved
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.keys import static_key
from exporter.sidecar.core.ranks import Join
from exporter.sidecar.core.servers import Server, build_servers
from exporter.sidecar.upstream import saved as feed_saved
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.world import MAX_PROBLEM_CHARS, NO_WORLD, Judgement, judge
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import read

RADIX = {"cache_type": "UnifiedRadixCache"}
SCHEDULER = {"model_name": "m", "engine_type": "unified"}


def storage(pp_size: int | str = 2, cp_size: int | str = 1) -> dict[str, str]:
    return {"storage_backend": "file", "pp_size": str(pp_size), "attn_cp_size": str(cp_size)}


def rank(tp: int, dp: int = 0, pp: int = 0, cp: int | None = None) -> RankId:
    return RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_cp_rank=cp)


def configured(**sizes: object) -> UpstreamWorld:
    return UpstreamWorld.model_validate(sizes)


# --- the judgement ---


def test_the_storage_labels_fill_in_pp_and_cp_and_dp_attention_gives_the_attention_tp_size() -> None:
    ranks = [(rank(1, dp=1, pp=1), static_key(storage(pp_size=2))), (rank(1, dp=1, pp=1), static_key(RADIX)),
             (rank(3, dp=1, pp=1), static_key(SCHEDULER))]  # the scheduler's tp rank is the engine's (global) one
    world = World(tp_size=4, pp_size=2, dp_size=2, attn_tp_size=2, attn_cp_size=1)
    assert judge(configured(tp_size=4, dp_size=2, dp_attention=True), ranks, DEFAULT_STREAMS) == Judgement(world, world)
    # Without DP attention each dp group is a whole tp group, and cp divides it (derive_attn_tp_size).
    cp = [(rank(1, cp=1), static_key(storage(pp_size=1, cp_size=2)))]
    world = World(tp_size=4, pp_size=1, dp_size=1, attn_tp_size=2, attn_cp_size=2)
    assert judge(configured(tp_size=4), cp, DEFAULT_STREAMS) == Judgement(world, world)
    # Neither configured nor labelled: 1. Configured and labelled alike: trusted.
    world = World(tp_size=2, pp_size=1, dp_size=1)
    assert judge(configured(tp_size=2), [(rank(1), static_key(RADIX))], DEFAULT_STREAMS) == Judgement(world, world)
    world = World(tp_size=2, pp_size=2, dp_size=1)
    assert judge(configured(tp_size=2, pp_size=2), [(rank(1, pp=1), static_key(storage(2)))], DEFAULT_STREAMS) \
        == Judgement(world, world)
    assert judge(None, [(rank(9), static_key(RADIX))], DEFAULT_STREAMS) is NO_WORLD


def test_labels_and_ranks_that_contradict_the_configured_world_are_listed_and_it_is_not_trusted() -> None:
    ranks = [
        (rank(0, pp=1), static_key(storage(pp_size=2))),  # pp 2 by its labels, pp rank 1
        (rank(2), static_key(RADIX)), (rank(3), static_key(RADIX)), (rank(2), static_key(storage(pp_size=1))),
        (rank(1, dp=2, cp=1), static_key(storage(pp_size=1))),
        (rank(3), static_key(SCHEDULER)), (rank(4), static_key(SCHEDULER)),  # global tp 4 is past tp_size 4
    ]
    judgement = judge(configured(tp_size=4, dp_size=2, pp_size=1, dp_attention=True), ranks, DEFAULT_STREAMS)
    assert judgement.world is None
    assert judgement.shown == World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2, attn_cp_size=1)
    assert judgement.problems == (
        "pp_size is configured 1, the engine's storage series say 1, 2",
        "radix and storage series have tp_rank 2, 3, outside the world's attention tp size 2",
        "scheduler series have tp_rank 4, outside the world's tp_size 4",
        "storage series have pp_rank 1, outside the world's pp_size 1",
        "storage series have dp_rank 2, outside the world's dp_size 2",
        "storage series have attn_cp_rank 1, outside the world's attn_cp_size 1",
    )


def test_labels_that_are_no_size_or_disagree_or_do_not_divide_tp_are_problems_bounded_in_length() -> None:
    huge = "9" * 5000
    ranks = [(rank(0), static_key(storage(pp_size=huge, cp_size=3))), (rank(0, dp=1), static_key(storage(1, 3))),
             (rank(0), static_key(storage(pp_size=2, cp_size=3)))]
    judgement = judge(configured(tp_size=4, dp_size=2, dp_attention=True), ranks, DEFAULT_STREAMS)
    assert judgement.world is None
    assert judgement.problems == (
        f"the engine's storage series say pp_size='{'9' * 24}...', which is not a size",
        "the engine's storage series say pp_size 1, 2: one server has one",
        "tp_size 4 is not a multiple of dp_size 2 x attn_cp_size 3 (DP attention)",
    )
    assert judgement.shown == World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=1, attn_cp_size=3)
    # However many ranks contradict it, a problem names a few of them and counts the rest.
    many = [(rank(tp), static_key(RADIX)) for tp in range(2, 4000)]
    (line,) = judge(configured(tp_size=2), many, DEFAULT_STREAMS).problems
    assert line == "radix series have tp_rank 2, 3, 4, 5 (3998 in all), outside the world's tp_size 2"
    assert all(len(p) <= MAX_PROBLEM_CHARS for p in judgement.problems)


# --- the feed: every rank says hello with the judged world ---


class Engine:
    """An engine's /metrics with its three collectors' labels: radix, storage and the scheduler's."""

    def __init__(self, pp_size: int = 2) -> None:
        self.registry = CollectorRegistry()
        self.pp_size = pp_size
        self.radix = Counter("sglang:load_back_bytes_total", "bytes", ["cache_type", "tp_rank", "pp_rank", "dp_rank"],
                             registry=self.registry)
        self.storage = Counter("sglang:prefetched_tokens_total", "tokens",
                               ["storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank",
                                "attn_cp_size"], registry=self.registry)
        self.scheduler = Gauge("sglang:hicache_host_used_tokens", "used",
                               ["model_name", "engine_type", "tp_rank", "pp_rank", "dp_rank"], registry=self.registry)

    def rank(self, tp: int, dp: int, pp: int, attn_tp_size: int = 2) -> None:
        """One scheduler process under DP attention: its caches label the attention tp rank, its scheduler the global one."""
        self.radix.labels("UnifiedRadixCache", tp, pp, dp).inc(100)
        self.storage.labels("file", tp, dp, pp, self.pp_size, 0, 1).inc(10)
        self.scheduler.labels("m", "unified", dp * attn_tp_size + tp, pp, dp).set(5)

    def text(self) -> str:
        return generate_latest(self.registry).decode()


DP_ATTENTION_TP4: dict[str, object] = {"tp_size": 4, "dp_size": 2, "dp_attention": True}  # pp from the storage labels
EXPECTED = World(tp_size=4, pp_size=2, dp_size=2, attn_tp_size=2, attn_cp_size=1)
POSITIONS = [(tp, dp, pp) for dp in (0, 1) for pp in (0, 1) for tp in (0, 1)]


def feed(h: Harness, world: dict[str, object] | None = DP_ATTENTION_TP4) -> UpstreamFeed:
    upstream = UpstreamConfig.model_validate({"url": "http://engine:30000/metrics", "world": world})
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""))


def server(h: Harness) -> Server:
    (one,) = build_servers(h.state.ranks.values(), h.catalog.streams, h.state.config.max_ranks)
    return one


def test_a_configured_world_reaches_every_rank_and_a_rank_that_never_reports_is_missing() -> None:
    h, engine = Harness(), Engine()
    for tp, dp, pp in POSITIONS[:-1]:  # tp 1 of dp group 1, pp stage 1, never runs
        engine.rank(tp, dp, pp)
    up = feed(h)
    assert up.health.world == World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2)  # as configured, before a read
    joins: list[Join] = []
    join = h.state.join
    h.state.join = lambda connection, msg, source: (joins.append(msg), join(connection, msg, source))[1]  # type: ignore[method-assign]
    up.apply(read(engine.text()))
    assert len(joins) == 3 * 7 and {j.world for j in joins} == {EXPECTED}  # the hello carries it, as a pushed rank's
    assert len(h.state.ranks) == 3 * 7 and {r.world for r in h.state.ranks.values()} == {EXPECTED}
    assert up.health.world == EXPECTED and up.health.world_problems == []
    one = server(h)
    assert one.layout is not None and one.missing_by_dp == {0: 0, 1: 1}
    assert one.cells[(1, 1, 0, 1)].state == "missing" and one.cells[(1, 1, 0, 0)].state == "live"
    # The scheduler's global tp rank 3 is tp 1 of dp group 1: its stream shares the cell of the caches'.
    assert sorted(s.kind for s in one.cells[(1, 0, 0, 1)].streams) == ["radix", "scheduler", "storage"]
    engine.rank(1, 1, 1)  # it runs
    up.apply(read(engine.text()))
    assert server(h).missing_by_dp == {0: 0, 1: 0} and {r.world for r in h.state.ranks.values()} == {EXPECTED}


def test_without_a_configured_world_nothing_is_expected() -> None:
    h, engine = Harness(), Engine()
    engine.rank(0, 0, 0)
    up = feed(h, world=None)
    up.apply(read(engine.text()))
    assert {r.world for r in h.state.ranks.values()} == {None} and up.health.world is None
    assert server(h).layout is None and server(h).missing_by_dp == {}


def test_a_contradicting_read_withdraws_the_world_from_every_rank_until_a_read_agrees(
    caplog: pytest.LogCaptureFixture,
) -> None:
    h, engine = Harness(), Engine()
    for tp, dp, pp in POSITIONS[:-1]:
        engine.rank(tp, dp, pp)
    up = feed(h)
    up.apply(read(engine.text()))
    ranks = list(h.state.ranks.values())
    epochs = [r.epoch for r in ranks]
    # A rank past the attention tp size appears (an engine started with more tp than configured).
    wider = Engine()
    for tp, dp, pp in POSITIONS:
        wider.rank(tp, dp, pp)
    wider.radix.labels("UnifiedRadixCache", 2, 0, 0).inc(1)
    with caplog.at_level(logging.INFO, logger="hicache_exporter.upstream"):
        up.apply(read(wider.text()))
        up.apply(read(wider.text()))
    problems = ["radix series have tp_rank 2, outside the world's attention tp size 2"]
    assert up.health.world_problems == problems and up.health.world == EXPECTED
    assert {r.world for r in h.state.ranks.values()} == {None}  # every rank: listed before, and the new one
    assert server(h).layout is None and server(h).missing_by_dp == {}
    warned = [r for r in caplog.records if "not trusted" in r.getMessage()]
    assert len(warned) == 1 and problems[0] in warned[0].getMessage()  # once per change, not per read
    # The engine without that rank again: the world is trusted again, for the ranks still listed and the
    # one no longer listed (departed, its stream still known), without a new hello's restart or reconnect.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hicache_exporter.upstream"):
        up.apply(read(engine.text()))
    assert up.health.world_problems == [] and {r.world for r in h.state.ranks.values()} == {EXPECTED}
    assert server(h).missing_by_dp == {0: 0, 1: 0}  # the departed streams still hold their cells
    assert [r.epoch for r in ranks] == epochs and {(r.restarts, r.reconnects) for r in ranks} == {(0, 0)}
    assert [r.getMessage() for r in caplog.records] == [
        "upstream http://engine:30000/metrics: the engine's labels agree with the configured world again: its "
        "ranks are expected in it"]


def test_storage_labels_that_contradict_the_configured_pp_size_are_flagged() -> None:
    h, engine = Harness(), Engine(pp_size=2)
    for tp, dp, pp in POSITIONS:
        engine.rank(tp, dp, pp)
    up = feed(h, world={**DP_ATTENTION_TP4, "pp_size": 1})
    up.apply(read(engine.text()))
    assert up.health.world_problems == [
        "pp_size is configured 1, the engine's storage series say 2",
        "radix and scheduler and storage series have pp_rank 1, outside the world's pp_size 1",
    ]
    assert up.health.world == World(tp_size=4, pp_size=1, dp_size=2, attn_tp_size=2)
    assert {r.world for r in h.state.ranks.values()} == {None} and server(h).missing_by_dp == {}


def test_a_restored_feed_gives_its_ranks_the_world_again_at_its_first_read() -> None:
    """The durable state keeps each rank's world, and the feed judges it anew from the config at its first read."""
    h, engine = Harness(), Engine()
    for tp, dp, pp in POSITIONS[:-1]:
        engine.rank(tp, dp, pp)
    up = feed(h)
    up.apply(read(engine.text()))
    core = msgspec.msgpack.decode(msgspec.msgpack.encode(core_saved.dump(h.state)), type=core_saved.SavedCore)
    saved = msgspec.msgpack.decode(msgspec.msgpack.encode(feed_saved.dump(up)), type=feed_saved.SavedFeed)
    again = Harness()
    core_saved.restore(again.state, core)
    new_up = feed(again)
    assert feed_saved.restore(new_up, saved) == 21
    assert {r.world for r in again.state.ranks.values()} == {EXPECTED}  # kept by the state file
    engine.rank(0, 0, 0)
    new_up.apply(read(engine.text()))
    assert {r.world for r in again.state.ranks.values()} == {EXPECTED}
    assert {(r.restarts, r.reconnects) for r in again.state.ranks.values()} == {(0, 1)}  # taken back, not restarted
    assert server(again).missing_by_dp == {0: 0, 1: 1}


def test_a_stage_past_a_pp_size_that_nothing_gave_says_so() -> None:
    """An engine without a storage backend has no storage series: its pp_size must be configured."""
    judgement = judge(configured(tp_size=2), [(rank(0, pp=1), static_key(RADIX))], DEFAULT_STREAMS)
    assert judgement.problems == ("radix series have pp_rank 1, outside the world's pp_size 1 (not configured, and no "
                                  "storage series says it)",)


def test_without_dp_attention_radix_and_storage_tp_ranks_are_the_engines_and_are_not_outside() -> None:
    """tp 4 = cp 2 x attention tp 2, no DP attention: radix_cache_metric_labels gives tp_rank 0-3 (the engine's);
    they are inside the world (the judgement used to bound them by the attention tp size 2 and withdrew it)."""
    ranks = [(rank(tp, cp=tp // 2), static_key(storage(pp_size=1, cp_size=2))) for tp in range(4)]
    ranks += [(rank(tp), static_key(RADIX)) for tp in range(4)]
    world = World(tp_size=4, pp_size=1, dp_size=1, attn_tp_size=2, attn_cp_size=2)
    assert judge(configured(tp_size=4), ranks, DEFAULT_STREAMS) == Judgement(world, world)


def test_replicas_without_dp_attention_and_dp_attention_cp_without_storage_series_are_not_trusted() -> None:
    """Two layouts one /metrics cannot tell apart: DP-controller replicas (every replica's radix series say
    dp_rank 0) and DP attention with cp peers whose radix series carry no cp rank and no storage series say it."""
    replicas = [(rank(tp), static_key(RADIX)) for tp in range(2)] + [(rank(0, dp=1), static_key(SCHEDULER))]
    judged = judge(configured(tp_size=2, dp_size=2), replicas, DEFAULT_STREAMS)
    assert judged.world is None and len(judged.problems) == 1 and "replicas cannot be told apart" in judged.problems[0]
    peers = [(rank(0, dp=dp), static_key(RADIX)) for dp in range(2)]
    judged = judge(configured(tp_size=8, dp_size=2, attn_cp_size=2, dp_attention=True), peers, DEFAULT_STREAMS)
    assert judged.world is None and "context-parallel peers cannot be told apart" in judged.problems[0]
    with_storage = peers + [(rank(0, dp=dp, cp=cp), static_key(storage(pp_size=1, cp_size=2)))
                            for dp in range(2) for cp in range(2)]
    assert judge(configured(tp_size=8, dp_size=2, attn_cp_size=2, dp_attention=True), with_storage,
                 DEFAULT_STREAMS).world is not None
