"""An upstream feed's durable state (exporter.sidecar.upstream.saved) with the core's: saved, MessagePack, taken back
into a fresh state and feed. The restored pair must read as a twin that never restarted: a read at or above the
saved values continues exactly, a lower one is an engine restart, and no rollup falls.

Expositions are written by prometheus_client (tests.exporter.sidecar.upstream.test_feed.Engine); fake clocks.
"""

from __future__ import annotations

import msgspec
from prometheus_client.exposition import generate_latest

from exporter.config import UpstreamConfig
from exporter.sidecar.core import saved as core_saved
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.ranks import RankStatus
from exporter.sidecar.upstream import saved as feed_saved
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.text import parse_exposition
from tests.exporter.sidecar.core.test_saved import assert_not_lower, rollups
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine, read, rollup

BYTES, TOKENS = "load_back_bytes_total", "load_back_tokens_total"


def url_feed(h: Harness) -> UpstreamFeed:
    upstream = UpstreamConfig.model_validate({"url": "http://engine:30000/metrics"})
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""), {"sglang_rollup_x"})


def dir_feed(h: Harness) -> UpstreamFeed:
    upstream = UpstreamConfig.model_validate({"multiprocess_dir": "/prometheus-multiproc"})
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, ""), {"sglang_rollup_x"})


def restart_sidecar(h: Harness, up: UpstreamFeed, make_feed: type | object = url_feed) -> tuple[Harness, UpstreamFeed]:
    """What a new sidecar on the file has: the core's and the feed's state, encoded, decoded and taken back."""
    core = msgspec.msgpack.decode(msgspec.msgpack.encode(core_saved.dump(h.state)), type=core_saved.SavedCore)
    feed = msgspec.msgpack.decode(msgspec.msgpack.encode(feed_saved.dump(up)), type=feed_saved.SavedFeed)
    again = Harness()
    again.clock.advance(5000.0)  # another process: its monotonic clock is anywhere
    restored = core_saved.restore(again.state, core)
    assert restored.dropped == {}
    new_up = make_feed(again)  # type: ignore[operator]
    assert feed_saved.restore(new_up, feed) == len(up.ranks)
    return again, new_up


def four_ranks(engine: Engine, scale: float = 1.0) -> None:
    for tp in (0, 1):
        for dp in (0, 1):
            engine.rank(tp, dp, tokens=scale * (100 * (dp + 1) + 10 * tp), moved=scale * (1000 * (tp + 1) + dp),
                        seconds=0.05)


def engine_restarted_before_the_save() -> tuple[Harness, UpstreamFeed, Engine]:
    """A URL upstream whose engine restarted once (its counters from zero), then read again."""
    h = Harness()
    up = url_feed(h)
    first = Engine()
    four_ranks(first, scale=0.5)
    four_ranks(first, scale=0.5)  # two observations of the histogram: the restarted engine's one is lower
    up.apply(read(first.text()))
    engine = Engine()  # restarted
    four_ranks(engine, scale=0.5)
    assert up.apply(read(engine.text())).resets == 4
    four_ranks(engine, scale=0.25)  # it went on
    up.apply(read(engine.text()))
    return h, up, engine


def test_a_restored_url_feed_serves_the_saved_rollups_and_knows_its_ranks() -> None:
    h, up, _ = engine_restarted_before_the_save()
    again, new_up = restart_sidecar(h, up)
    assert rollups(again) == rollups(h)
    assert rollup(again, BYTES) == (1000 + 1001 + 2000 + 2001) * (1 + 0.5 + 0.25)
    assert rollup(again, TOKENS, pool="kv") == (110 + 210) * 1.75  # the furthest replica (tp1) of each group
    assert {i: e.epoch for i, e in new_up.ranks.items()} == {i: e.epoch for i, e in up.ranks.items()}
    assert all(e.generation == 1 for e in new_up.ranks.values())
    assert all(r.status is RankStatus.DEPARTED for r in again.state.ranks.values())


def test_a_read_at_or_above_the_saved_values_continues_exactly() -> None:
    h, up, engine = engine_restarted_before_the_save()
    again, new_up = restart_sidecar(h, up)
    saved = rollups(again)
    four_ranks(engine, scale=0.125)  # the engine went on while the sidecar was down
    results = [feed.apply(read(engine.text())) for feed in (up, new_up)]
    assert [(r.resets, r.series_resets, r.rejected) for r in results] == [(0, 0, 0), (0, 0, 0)]
    assert rollups(again) == rollups(h)  # as if the sidecar had never restarted
    assert rollup(again, BYTES) == (1000 + 1001 + 2000 + 2001) * 1.875
    assert_not_lower(saved, again)
    assert all(r.status is RankStatus.LIVE and r.reconnects == 1 and r.restarts == 1
               for r in again.state.ranks.values())  # the same epoch, reconnected
    # A read that holds (nothing moved) is no restart either.
    assert new_up.apply(read(engine.text())).resets == 0 and rollups(again) == rollups(h)


def test_a_lower_read_is_an_engine_restart_while_the_sidecar_was_down_and_no_rollup_falls() -> None:
    h, up, _ = engine_restarted_before_the_save()
    again, new_up = restart_sidecar(h, up)
    saved = rollups(again)
    engine = Engine()  # restarted again while the sidecar was down: its counters below the saved values
    four_ranks(engine, scale=0.0625)
    results = [feed.apply(read(engine.text())) for feed in (up, new_up)]
    assert results[1].resets == 4 and results[0].resets == 4
    assert_not_lower(saved, again)
    assert rollups(again) == rollups(h)
    assert rollup(again, BYTES) == (1000 + 1001 + 2000 + 2001) * (1.75 + 0.0625)
    epochs = {r.epoch for r in again.state.ranks.values()}
    assert all(r.restarts == 2 and len(r.replaced_epochs) == 2 for r in again.state.ranks.values())
    assert len(epochs) == 1 and epochs == {r.epoch for r in h.state.ranks.values()}


def process_read(pid: str, families: list) -> tuple[str, float, list]:
    return (pid, 0.0, families)


def rank_families(engine: Engine) -> list:
    return parse_exposition(generate_latest(engine.registry).decode(), False)


def test_a_directory_rank_whose_pid_changed_while_the_sidecar_was_down_counts_from_zero_on_top() -> None:
    h = Harness()
    up = dir_feed(h)
    ranks = {0: Engine(), 1: Engine()}  # one process per rank, each its own files
    ranks[0].rank(0, tokens=100, moved=1000, seconds=0.05)
    ranks[1].rank(1, tokens=90, moved=2000, seconds=0.05)
    up.apply([process_read("101", rank_families(ranks[0])), process_read("102", rank_families(ranks[1]))])
    again, new_up = restart_sidecar(h, up, dir_feed)
    assert {e.pid for e in new_up.ranks.values()} == {"101", "102"}
    saved = rollups(again)
    # While the sidecar was down, rank 0's process was replaced (pid 201, counters from zero); rank 1 went on.
    replaced = Engine()
    replaced.rank(0, tokens=7, moved=30, seconds=0.05)
    ranks[1].rank(1, tokens=10, moved=5)
    reading = [process_read("201", rank_families(replaced)), process_read("102", rank_families(ranks[1]))]
    results = [feed.apply(reading) for feed in (up, new_up)]
    assert results[1].resets == 1 == results[0].resets
    assert rollups(again) == rollups(h)
    assert rollup(again, BYTES) == 1000 + 2000 + 30 + 5
    assert rollup(again, TOKENS, pool="kv") == 100 + 7  # one dp group: its furthest replica, rank 0 continued on top
    assert_not_lower(saved, again)
    entry0 = next(e for i, e in new_up.ranks.items() if i[0] == 0)
    assert entry0.pid == "201" and list(entry0.replaced_pids) == ["101"]
    # The replaced process's files, read again (not yet removed), are an ended epoch's: ignored.
    before = rollups(again)
    new_up.apply([process_read("101", rank_families(ranks[0]))])
    assert rollups(again) == before


def test_a_saved_series_no_read_could_make_is_not_taken_back() -> None:
    # A file with a correct checksum is still input: a feed's series with NaN, an infinity or a negative count
    # starts over from its next read instead of continuing from a value no engine wrote.
    h, up, _ = engine_restarted_before_the_save()
    feed = msgspec.msgpack.decode(msgspec.msgpack.encode(feed_saved.dump(up)), type=feed_saved.SavedFeed)
    rank = feed.ranks[0]
    bad = [msgspec.structs.replace(rank.series[0], last=[float("nan")]),
           msgspec.structs.replace(rank.series[1], high=[-5.0] + rank.series[1].high[1:]),
           msgspec.structs.replace(rank.series[2], offset=[float("inf")] * len(rank.series[2].offset))]
    tampered = msgspec.structs.replace(feed, ranks=[msgspec.structs.replace(rank, series=bad + rank.series[3:]),
                                                    *feed.ranks[1:]])
    core = msgspec.msgpack.decode(msgspec.msgpack.encode(core_saved.dump(h.state)), type=core_saved.SavedCore)
    again = Harness()
    core_saved.restore(again.state, core)
    new_up = url_feed(again)
    assert feed_saved.restore(new_up, tampered) == len(up.ranks)
    identity = (rank.tp_rank, rank.pp_rank, rank.dp_rank, rank.attn_cp_rank, rank.static)
    assert len(new_up.ranks[identity].series) == len(rank.series) - 3
    assert all(len(entry.series) == len(up.ranks[i].series) for i, entry in new_up.ranks.items() if i != identity)
