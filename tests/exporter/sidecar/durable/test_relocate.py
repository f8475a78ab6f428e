"""What operators do between two starts of a sidecar on one state file: rename an upstream, give an LMCache
upstream a world, change it, move from the proxy to push, or to another URL of the same engine. Each start
continues the same physical series exactly or starts over visibly; no history is ever counted twice.

Each sidecar is a state, its feeds and a StateKeeper on a real file in tmp_path, on the harness's fake
clocks (exporter.sidecar.durable.keeper: its encode and load, as a running sidecar saves and starts).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest

from exporter.catalog import Catalog
from exporter.config import PersistenceConfig, UpstreamConfig
from exporter.protocol.messages import RankId, ScalarSample
from exporter.sidecar.core.health import PersistenceHealth, UpstreamHealth
from exporter.sidecar.core.ranks import PUSH_SOURCE, RELEASED_SOURCE, Join
from exporter.sidecar.durable.keeper import StateKeeper
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.text import parse_exposition
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine, read, rollup
from tests.exporter.sidecar.upstream.test_profiles import LABELS, STATIC, catalog

URL = "http://engine:30000/metrics"
BYTES, TOKENS = "load_back_bytes_total", "load_back_tokens_total"
LM_BYTES, LM_HITS = "num_remote_read_bytes_total", "num_hit_tokens_total"
NAMESPACE = "sglang_"


class Sidecar:
    """One start of a sidecar on `path`: its state, its upstreams' feeds and its keeper (the file loaded)."""

    def __init__(self, path: Path, upstreams: list[dict[str, Any]], cat: Catalog | None = None,
                 clock_at: float = 1000.0) -> None:
        self.h = Harness(cat)
        self.h.clock.advance(clock_at - self.h.clock.now)
        self.feeds: dict[str, UpstreamFeed] = {}
        for raw in upstreams:
            config = UpstreamConfig.model_validate(raw)
            self.feeds[config.label] = UpstreamFeed(config, self.h.state, UpstreamHealth(config.label, config.url or ""))
        self.health = PersistenceHealth()
        self.keeper = StateKeeper(PersistenceConfig(file=path), self.h.state, self.feeds, self.health, NAMESPACE)
        self.keeper.load()

    @property
    def feed(self) -> UpstreamFeed:
        (only,) = self.feeds.values()
        return only

    def save(self) -> None:
        """What the interval's save writes (encode on the loop; the file written whole)."""
        self.keeper.path.write_bytes(self.keeper.encode())

    def restart(self, upstreams: list[dict[str, Any]], cat: Catalog | None = None) -> Sidecar:
        """Save, then a new sidecar on the same file (another process: its monotonic clock elsewhere)."""
        self.save()
        return Sidecar(self.keeper.path, upstreams, cat, clock_at=self.h.clock.now + 5000.0)


def two_groups(engine: Engine, scale: float) -> None:
    """Four ranks (tp 0-1, dp 0-1) of an SGLang engine move `scale` times their share."""
    for tp in (0, 1):
        for dp in (0, 1):
            engine.rank(tp, dp, tokens=scale * 100 * (dp + 1), moved=scale * 1000 * (tp + 1))


BYTES_PER_SCALE = 1000.0 * (1 + 2) * 2  # every rank's bytes, summed
TOKENS_PER_SCALE = 100.0 * (1 + 2)  # one replica of each dp group


def test_a_renamed_upstream_continues_its_state_and_counts_nothing_twice(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = Engine()
    first = Sidecar(tmp_path / "state", [{"url": URL}])
    two_groups(engine, 1.0)
    first.feed.apply(read(engine.text()))
    assert rollup(first.h, BYTES) == BYTES_PER_SCALE
    with caplog.at_level(logging.INFO, "hicache_exporter.durable"):
        named = first.restart([{"url": URL, "name": "engine"}])
    two_groups(engine, 0.5)
    errors = named.feed.health.errors.copy()
    named.feed.apply(read(engine.text()))
    # Past expire_after its identities were taken back as new ranks before: their history counted again.
    named.h.clock.advance(400.0)
    two_groups(engine, 0.5)
    named.feed.apply(read(engine.text()))
    assert rollup(named.h, BYTES) == BYTES_PER_SCALE * 2.0
    assert rollup(named.h, TOKENS, pool="kv") == TOKENS_PER_SCALE * 2.0
    assert errors == named.feed.health.errors == {}
    assert {r.source for r in named.h.state.ranks.values()} == {"upstream:engine"}
    assert any("is now upstream engine" in r.getMessage() for r in caplog.records)


class LMCache:
    """An LMCache engine's /metrics: 8 workers, each moving its own bytes and counting the engine's hit tokens."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hits = Counter("lmcache:num_hit_tokens", "tokens", LABELS, registry=self.registry)
        self.bytes = Counter("lmcache:num_remote_read_bytes", "bytes", LABELS, registry=self.registry)

    def step(self, hits: float, moved: float) -> None:
        for worker in range(8):
            self.hits.labels("m", str(worker), "worker", "s").inc(hits)
            self.bytes.labels("m", str(worker), "worker", "s").inc(moved)

    def read(self) -> list[tuple[None, float, list[Any]]]:
        return [(None, 0.0, parse_exposition(generate_latest(self.registry).decode(), False))]


def lm_rollup(sidecar: Sidecar, family: str) -> float:
    static = tuple(sorted(STATIC.items()))
    return sum(v for (f, s, _), v in sidecar.h.state.ledger.counters.items() if f == family and s == static)


def lm_ranks(sidecar: Sidecar) -> dict[str, tuple[int, int]]:
    return {dict(r.static)["worker_id"]: (r.tp_rank, r.pp_rank) for r in sidecar.h.state.ranks.values()}


def lmcache_upstream(**world: int) -> dict[str, Any]:
    return {"url": URL, "profile": "lmcache", **({"world": {"dp_size": 1, **world}} if world else {})}


def test_a_world_added_then_changed_moves_each_workers_history_to_its_new_rank(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    engine = LMCache()
    first = Sidecar(tmp_path / "state", [lmcache_upstream()], catalog())
    engine.step(hits=100, moved=1000)
    first.feed.apply(engine.read())
    assert lm_ranks(first) == {str(w): (w, 0) for w in range(8)}
    assert (lm_rollup(first, LM_BYTES), lm_rollup(first, LM_HITS)) == (8000, 100)
    with caplog.at_level(logging.WARNING, "hicache_exporter.durable"):
        placed = first.restart([lmcache_upstream(tp_size=4, pp_size=2)], catalog())
    placed.feed.apply(engine.read())  # nothing moved since the save: nothing is added
    assert (lm_rollup(placed, LM_BYTES), lm_rollup(placed, LM_HITS)) == (8000, 100)
    assert lm_ranks(placed) == {str(w): (w % 4, w // 4) for w in range(8)}
    assert [r.getMessage().split(": ", 1)[1] for r in caplog.records if "workers at other ranks" in r.getMessage()] == [
        "upstream http://engine:30000/metrics's world places 4 of its workers at other ranks than when it was saved: "
        "each worker's history moves with it (nothing is counted again)"]
    engine.step(hits=10, moved=5)
    placed.feed.apply(engine.read())
    assert (lm_rollup(placed, LM_BYTES), lm_rollup(placed, LM_HITS)) == (8040, 110)
    assert placed.feed.health.errors == {} and all(r.restarts == 0 for r in placed.h.state.ranks.values())
    # Changed again (tp 2 x pp 4): every worker but 0 and 1 moves, and still nothing is counted twice.
    again = placed.restart([lmcache_upstream(tp_size=2, pp_size=4)], catalog())
    assert lm_ranks(again) == {str(w): (w % 2, w // 2) for w in range(8)}
    engine.step(hits=1, moved=1)
    again.feed.apply(engine.read())
    assert (lm_rollup(again, LM_BYTES), lm_rollup(again, LM_HITS)) == (8048, 111)


def push_join(sidecar: Sidecar, tp: int, dp: int, epoch: str) -> Any:
    """A pushed rank's hello for an SGLang rank (the identity the proxy read it under)."""
    join = Join(rank=RankId(tp_rank=tp, pp_rank=0, dp_rank=dp), labels={"cache_type": "UnifiedRadixCache"},
                epoch=epoch, pid=7)
    return sidecar.h.state.join(object(), join, PUSH_SOURCE).rank


def test_moving_from_the_proxy_to_push_continues_each_rank_at_once(tmp_path: Path) -> None:
    engine = Engine()
    proxy = Sidecar(tmp_path / "state", [{"url": URL}])
    two_groups(engine, 1.0)
    proxy.feed.apply(read(engine.text()))
    pushed = proxy.restart([])  # the upstream is gone from the config: its identities are released
    assert {r.source for r in pushed.h.state.ranks.values()} == {RELEASED_SOURCE}
    for tp in (0, 1):
        for dp in (0, 1):
            rank = push_join(pushed, tp, dp, epoch=f"pushed-{tp}-{dp}")  # refused as identity_owned before
            assert rank.source == PUSH_SOURCE
            # The engine restarted with the hook: its counters count from zero in the new epoch.
            result = pushed.h.push(rank, ScalarSample(family=BYTES, labels={}, value=10.0 * (tp + 1)),
                                   ScalarSample(family=TOKENS, labels={"pool": "kv"}, value=5.0 * (dp + 1)))
            assert result.rejections == []
    assert rollup(pushed.h, BYTES) == BYTES_PER_SCALE + (10 + 20) * 2
    assert rollup(pushed.h, TOKENS, pool="kv") == TOKENS_PER_SCALE + 5 + 10


@pytest.mark.parametrize("restarted", [False, True], ids=["engine went on", "engine restarted"])
def test_another_url_of_the_same_engine_continues_its_released_ranks(tmp_path: Path, restarted: bool) -> None:
    engine = Engine()
    proxy = Sidecar(tmp_path / "state", [{"url": URL}])
    two_groups(engine, 1.0)
    proxy.feed.apply(read(engine.text()))
    moved = proxy.restart([{"url": "http://engine.svc:30000/metrics"}])
    if restarted:
        engine = Engine()
    two_groups(engine, 0.5)
    result = moved.feed.apply(read(engine.text()))
    assert result.rejected == 0 and moved.feed.health.errors == {}
    # The engine's values continue the saved ones (only the increase counts), or are lower: a restart.
    assert rollup(moved.h, BYTES) == BYTES_PER_SCALE * 1.5
    assert rollup(moved.h, TOKENS, pool="kv") == TOKENS_PER_SCALE * 1.5


def test_moving_from_push_to_the_proxy_continues_each_rank_once_the_pushed_ones_expire(tmp_path: Path) -> None:
    pushing = Sidecar(tmp_path / "state", [])
    for tp in (0, 1):
        for dp in (0, 1):
            rank = push_join(pushing, tp, dp, epoch=f"pushed-{tp}-{dp}")
            pushing.h.push(rank, ScalarSample(family=BYTES, labels={}, value=1000.0 * (tp + 1)),
                           ScalarSample(family=TOKENS, labels={"pool": "kv"}, value=100.0 * (dp + 1)))
    proxy = pushing.restart([{"url": URL}])
    engine = Engine()  # the engine restarted without the hook: its own counters from zero
    two_groups(engine, 0.25)
    proxy.feed.apply(read(engine.text()))
    assert proxy.feed.health.errors == {"identity_owned": 4}  # the pushed ranks may still come back
    assert rollup(proxy.h, BYTES) == BYTES_PER_SCALE
    proxy.h.clock.advance(301.0)  # they did not, within expire_after: the upstream continues them in place
    two_groups(engine, 0.25)
    proxy.feed.apply(read(engine.text()))
    assert {r.source for r in proxy.h.state.ranks.values()} == {"upstream:" + URL}
    assert rollup(proxy.h, BYTES) == BYTES_PER_SCALE * 1.5
    # Replicated: each group's watermark goes on from the pushed position (a new rank from zero stayed under it).
    assert rollup(proxy.h, TOKENS, pool="kv") == TOKENS_PER_SCALE * 1.5
