"""The feed of an upstream whose profile names its ranks with one linear label (lmcache: worker_id).

Expositions are written by prometheus_client (a registry, or multiprocess files by its own writer),
read by the feed into a state on the harness's fake clock, as in test_feed.py.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.exposition import generate_latest
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from exporter.catalog import Catalog, load_profiles
from exporter.config import UpstreamConfig
from exporter.errors import ConfigError
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.files import read_directory
from exporter.sidecar.upstream.merged import HeldProcesses
from exporter.sidecar.upstream.text import parse_exposition
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.test_feed import Engine

LABELS = ("model_name", "worker_id", "role", "served_model_name")  # every LMCache family's (observability.py:1905-1913)
STATIC = {"model_name": "m", "role": "worker", "served_model_name": "s"}
_catalog: Catalog | None = None


def catalog() -> Catalog:
    """The sglang and lmcache profiles as the sidecar merges them (loaded once)."""
    global _catalog
    if _catalog is None:
        _catalog = load_profiles(None, ["lmcache"])
    return _catalog


class LMCache:
    """An LMCache engine's /metrics: a replicated token counter and a per-shard byte counter per worker_id."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.hits = Counter("lmcache:num_hit_tokens", "tokens", LABELS, registry=self.registry)
        self.bytes = Counter("lmcache:num_remote_read_bytes", "bytes", LABELS, registry=self.registry)

    def worker(self, worker_id: str, hits: float, moved: float) -> None:
        self.hits.labels("m", worker_id, "worker", "s").inc(hits)
        self.bytes.labels("m", worker_id, "worker", "s").inc(moved)

    def read(self) -> list[tuple[None, float, list[Any]]]:
        return [(None, 0.0, parse_exposition(generate_latest(self.registry).decode(), False))]


def feed(h: Harness, profile: str = "lmcache", **config: object) -> UpstreamFeed:
    upstream = UpstreamConfig.model_validate({"url": "http://engine:8000/metrics", "profile": profile, **config})
    return UpstreamFeed(upstream, h.state, UpstreamHealth(upstream.label, upstream.url or ""))


def ranks(h: Harness) -> dict[str, tuple[int, int, int]]:
    """worker_id -> (tp_rank, pp_rank, dp_rank) of every rank the state holds."""
    return {dict(r.static)["worker_id"]: (r.tp_rank, r.pp_rank, r.dp_rank) for r in h.state.ranks.values()}


def rollups(h: Harness, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """One counter family's rollup series, by their static labels."""
    return {static: value for (name, static, _), value in h.state.ledger.counters.items() if name == family}


def world(tp: int, pp: int = 1, dp: int = 1) -> dict[str, int]:
    return {"tp_size": tp, "pp_size": pp, "dp_size": dp}


def test_worker_id_names_tp_and_pp_ranks_by_the_worlds_tp_size() -> None:
    h, engine = Harness(catalog()), LMCache()
    for worker_id in range(4):
        engine.worker(str(worker_id), hits=100, moved=10 * (worker_id + 1))
    result = feed(h, world=world(tp=2, pp=2)).apply(engine.read())
    assert result.ranks == 4 and not result.unranked
    # vLLM's layout: worker = pp_rank * tp_size + tp_rank.
    assert ranks(h) == {"0": (0, 0, 0), "1": (1, 0, 0), "2": (0, 1, 0), "3": (1, 1, 0)}
    # worker_id stays on the rank's series, and is left out of the rollups.
    assert all(dict(r.static) == {**STATIC, "worker_id": dict(r.static)["worker_id"]} for r in h.state.ranks.values())
    static = tuple(sorted(STATIC.items()))
    assert rollups(h, "num_remote_read_bytes_total") == {static: 10 + 20 + 30 + 40}  # per shard: every worker
    assert rollups(h, "num_hit_tokens_total") == {static: 100}  # replicated: the engine's furthest worker, once


def test_without_a_world_every_worker_is_a_tp_rank_of_one_stage() -> None:
    h, engine = Harness(catalog()), LMCache()
    for worker_id in range(4):
        engine.worker(str(worker_id), hits=100 + worker_id, moved=1)
    feed(h).apply(engine.read())
    assert ranks(h) == {str(w): (w, 0, 0) for w in range(4)}
    assert rollups(h, "num_hit_tokens_total") == {tuple(sorted(STATIC.items())): 103}


def exposition(workers: list[dict[str, str]], hits: list[float], moved: list[float]) -> str:
    """An LMCache /metrics text whose series carry each worker's labels as given (worker_id left out where absent)."""
    lines = []
    for family, values in (("num_hit_tokens", hits), ("num_remote_read_bytes", moved)):
        lines += [f"# HELP lmcache:{family}_total {family}", f"# TYPE lmcache:{family}_total counter"]
        for labels, value in zip(workers, values):
            listed = ",".join(f'{k}="{v}"' for k, v in {**STATIC, **labels}.items())
            lines.append(f"lmcache:{family}_total{{{listed}}} {value}")
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("bad", [{"worker_id": "01"}, {"worker_id": "-1"}, {"worker_id": "1_0"}, {},
                                 {"worker_id": "65536"}, {"worker_id": "x"}, {"worker_id": "1.0"}, {"worker_id": ""}])
def test_a_series_whose_worker_id_is_missing_or_no_rank_number_is_refused_alone(
        bad: dict[str, str], caplog: pytest.LogCaptureFixture) -> None:
    """Before: the whole family was flagged unranked, its rollup and all four per-rank series gone (0 of 4 kept)."""
    h = Harness(catalog())
    text = exposition([{"worker_id": "0"}, {"worker_id": "1"}, {"worker_id": "2"}, bad],
                      hits=[100, 101, 102, 999], moved=[1, 2, 3, 1000])
    up = feed(h, world=world(tp=4))
    with caplog.at_level(logging.WARNING, "hicache_exporter.upstream"):
        results = [up.apply([(None, 0.0, parse_exposition(text, False))]) for _ in range(2)]
    assert [(r.rejected, r.ranks, r.unranked) for r in results] == [(2, 3, set()), (2, 3, set())]
    assert not up.health.unranked
    assert ranks(h) == {"0": (0, 0, 0), "1": (1, 0, 0), "2": (2, 0, 0)}
    static = tuple(sorted(STATIC.items()))
    assert rollups(h, "num_hit_tokens_total") == {static: 102}  # replicated: the furthest good worker
    assert rollups(h, "num_remote_read_bytes_total") == {static: 1 + 2 + 3}  # per shard: the good workers'
    why = ("has no worker_id label, so it names no rank; its family's other series are rolled up" if not bad else
           f"worker_id={bad['worker_id']!r} is not a rank number: a whole number from 0 to 65535 in ASCII digits, "
           "without a sign, spaces, underscores or a leading zero")
    shown = ",".join(f"{k}={v!r}" for k, v in sorted({**STATIC, **bad}.items()))
    assert [r.message for r in caplog.records] == [  # each refused series logged once, not again at the next read
        f"upstream http://engine:8000/metrics: {family}{{{shown}}} refused: {'it ' if not bad else ''}{why}"
        for family in ("num_hit_tokens_total", "num_remote_read_bytes_total")]


MODEL_PATH = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/"  # vLLM's model path, as model_name


@pytest.mark.parametrize("length", [129, 600, 1024])
def test_a_model_path_up_to_the_default_limit_is_a_static_label_of_the_upstreams_ranks(length: int) -> None:
    """Before: a model_name over 128 characters was refused at hello (invalid_hello): no rank, no rollup."""
    h, model = Harness(catalog()), (MODEL_PATH + "0" * length)[:length]
    text = exposition([{"worker_id": str(w), "model_name": model} for w in range(4)], hits=[7] * 4, moved=[1, 2, 3, 4])
    up = feed(h, world=world(tp=4))
    result = up.apply([(None, 0.0, parse_exposition(text, False))])
    assert (result.ranks, result.rejected, up.health.errors) == (4, 0, {})
    assert {dict(r.static)["model_name"] for r in h.state.ranks.values()} == {model}
    assert rollups(h, "num_remote_read_bytes_total") == {tuple(sorted({**STATIC, "model_name": model}.items())): 10}


def test_a_model_path_past_the_limit_is_refused_naming_the_label_and_the_limit(caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(catalog())
    text = exposition([{"worker_id": "0", "model_name": "m" * 1025}], hits=[7], moved=[1])
    up = feed(h)
    with caplog.at_level(logging.ERROR, "hicache_exporter.upstream"):
        up.apply([(None, 0.0, parse_exposition(text, False))])
    assert not h.state.ranks
    why = "static label: value of label 'model_name' is longer than 1024 characters"
    assert up.health.errors == {"invalid_hello": 1}
    assert [r.message for r in caplog.records] == [f"upstream http://engine:8000/metrics: rank refused: {why}"]


def test_a_series_without_worker_id_is_unranked() -> None:
    h = Harness(catalog())
    registry = CollectorRegistry()
    Counter("lmcache:num_hit_tokens", "tokens", ["model_name", "role"], registry=registry).labels("m", "worker").inc(7)
    result = feed(h).apply([(None, 0.0, parse_exposition(generate_latest(registry).decode(), False))])
    assert result.unranked == {"num_hit_tokens_total"} and result.ranks == 0 and not h.state.ranks


def write_process(directory: Path, pid: str, values: dict[str, float], family: str = "lmcache:num_hit_tokens") -> None:
    """One worker process's counter file, by prometheus_client's own writer: worker_id -> value."""
    db = MmapedDict(str(directory / f"counter_{pid}.db"))
    for worker_id, value in values.items():
        db.write_value(mmap_key(family, family + "_total", list(LABELS), ["m", worker_id, "worker", "s"], "tokens"),
                       value, 0.0)
    db.close()


def test_a_directory_is_read_merged_one_rank_per_worker_holding_the_sum_of_its_processes(tmp_path: Path) -> None:
    h = Harness(catalog())
    up = feed(h, url=None, multiprocess_dir=str(tmp_path), world=world(tp=2))
    held = HeldProcesses(lambda name: up.planner.spec_of(name) is not None)
    assert up.merges_processes

    def read() -> Any:
        """A read as the directory source makes it: merged, held steady (upstream/merged.py), then fed."""
        directory = read_directory(tmp_path)
        return up.apply(held.hold(directory.exposition, directory.skipped))

    def per_rank() -> dict[str, float]:
        return {dict(r.static)["worker_id"]: r.values[("num_hit_tokens_total", ())] for r in h.state.ranks.values()}

    static = tuple(sorted(STATIC.items()))
    # Two DP replicas' workers: pids 101, 102 (replica A), 201, 202 (replica B), one worker_id each.
    write_process(tmp_path, "101", {"0": 100})
    write_process(tmp_path, "102", {"1": 100})
    write_process(tmp_path, "201", {"0": 40})
    write_process(tmp_path, "202", {"1": 40})
    result = read()
    assert result.ranks == 2 and ranks(h) == {"0": (0, 0, 0), "1": (1, 0, 0)}
    assert per_rank() == {"0": 140, "1": 140}
    assert rollups(h, "num_hit_tokens_total") == {static: 140}  # replica A's 100 + replica B's 40
    # A new process for worker 0 (a replica restarted) adds to the sum; nothing is a restart.
    write_process(tmp_path, "301", {"0": 25})
    write_process(tmp_path, "302", {"1": 25})
    result = read()
    assert result.resets == 0 and result.series_resets == 0
    assert rollups(h, "num_hit_tokens_total") == {static: 165}
    assert all(r.restarts == 0 for r in h.state.ranks.values())
    # A process's files removed while the others go on: what it counted stays counted, and the others are
    # not counted again (the sum alone would fall by 100 and read as a reset of worker 0's series).
    (tmp_path / "counter_101.db").unlink()
    result = read()
    assert result.series_resets == 0 and rollups(h, "num_hit_tokens_total") == {static: 165}
    write_process(tmp_path, "401", {"0": 10, "1": 10})
    read()
    assert rollups(h, "num_hit_tokens_total") == {static: 175} and per_rank() == {"0": 175, "1": 175}
    # A file that cannot be read this time stands at its last values; it counts on once it reads again.
    (tmp_path / "counter_202.db").write_bytes(b"\x00" * 3)
    result = read()
    assert result.series_resets == 0 and per_rank() == {"0": 175, "1": 175}
    (tmp_path / "counter_202.db").unlink()
    write_process(tmp_path, "202", {"1": 60})  # 40 before: 20 more
    read()
    assert per_rank() == {"0": 175, "1": 195}
    assert rollups(h, "num_hit_tokens_total") == {static: 195}  # the furthest worker
    # The engine restarts in a wiped directory: every process is new, the sums fall, a restart; rollups go on.
    for old in tmp_path.iterdir():
        old.unlink()
    write_process(tmp_path, "501", {"0": 5})
    write_process(tmp_path, "502", {"1": 5})
    read()
    assert per_rank() == {"0": 5, "1": 5} and rollups(h, "num_hit_tokens_total") == {static: 200}


def test_world_dp_size_above_one_on_an_lmcache_upstream_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError) as refused:
        feed(Harness(catalog()), world=world(tp=4, dp=2))
    assert str(refused.value) == (
        "upstream http://engine:8000/metrics: profile 'lmcache' labels no data-parallel replica, so its replicas read "
        "as one engine here (their sum); give world dp_size 1, or push through the hook, which tells replicas apart")


def test_dp_attention_on_an_lmcache_upstream_is_refused_in_one_line() -> None:
    """The profile's DP-attention rule (never: each vLLM replica has its own tp group) refuses the flag."""
    with pytest.raises(ConfigError) as refused:
        feed(Harness(catalog()), world={"tp_size": 4, "dp_attention": True})
    assert str(refused.value) == (
        "upstream http://engine:8000/metrics: profile 'lmcache' has no DP attention (each data-parallel replica of "
        "its engine has its own tp group): drop dp_attention from its world")


def test_the_sglang_profiles_feed_is_unchanged_by_the_lmcache_profile_beside_it() -> None:
    # The same engine read with and without the lmcache profile in the catalog gives the same ranks and rollups.
    engine = Engine()
    for tp in (0, 1):
        for dp in (0, 1):
            engine.rank(tp, dp, tokens=100 * (dp + 1), moved=1000 * (tp + 1) + dp, seconds=0.05)
    engine.other.labels("demo").inc(3)
    states = []
    for h in (Harness(), Harness(catalog())):
        up = feed(h, profile="sglang", world={"tp_size": 2, "dp_size": 2, "dp_attention": True})
        assert up.linear is None and not up.merges_processes  # a multiprocess directory is read per process
        result = up.apply([(None, 0.0, parse_exposition(engine.text(), False))])
        assert result.ranks == 4 and not result.unranked
        states.append((sorted((r.tp_rank, r.dp_rank, r.static, sorted(r.values.items())) for r in h.state.ranks.values()),
                       sorted(h.state.ledger.counters.items()), up.pass_through_text(False)))
    assert states[0] == states[1]


def test_the_sglang_profile_refuses_a_series_without_rank_labels_alone_beside_ranked_ones() -> None:
    """As for worker_id: before, the one series without tp_rank, pp_rank and dp_rank flagged its whole family."""
    h = Harness()
    text = ("# TYPE sglang:load_back_bytes_total counter\n"
            'sglang:load_back_bytes_total{cache_type="c",tp_rank="0",pp_rank="0",dp_rank="0"} 100\n'
            'sglang:load_back_bytes_total{cache_type="c",tp_rank="1",pp_rank="0",dp_rank="0"} 20\n'
            'sglang:load_back_bytes_total{cache_type="c"} 5\n')
    up = feed(h, profile="sglang")
    result = up.apply([(None, 0.0, parse_exposition(text, False))])
    assert (result.rejected, result.ranks, result.unranked) == (1, 2, set())
    assert rollups(h, "load_back_bytes_total") == {(("cache_type", "c"),): 120}
