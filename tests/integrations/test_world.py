"""The server's world through the stat-logger hook: every rank of the declared layout accounted for.

Each rank is a spawned process whose runtime context is the released engine's own
(sglang/srt/runtime_context.py from the wheel, tests.integrations.ranks.publish_parallel), stated
as the engine's publish states it; the hook reads the layout there and sends it in every hello.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import SidecarThread, http_get, wait_until
from tests.integrations.support import SPAWN, run_processes

PUSH_INTERVAL = "0.5"  # well inside the sidecar's stale_after (10 s): a started rank stays live
START_SECONDS = 120.0  # a spawned rank imports the collectors and the wheel's runtime context


class EngineRank:
    """One scheduler process of the server (tests.integrations.ranks.serve_engine_rank)."""

    def __init__(self, ranks: ModuleType, loggers: Mapping[str, type], server: Any, tp_rank: int) -> None:
        self.commands, child = SPAWN.Pipe()
        self.process = SPAWN.Process(target=ranks.serve_engine_rank, args=(loggers, server, tp_rank, child))
        self.process.start()
        child.close()
        self._child: Connection | None = child

    def ready(self) -> None:
        """Wait until its collectors have bound and reported (its clients are connected or connecting)."""
        assert self.commands.poll(START_SECONDS), f"rank process {self.process.pid} did not report"
        assert self.commands.recv() == "ready"

    def stop(self) -> int | None:
        if self.process.is_alive():
            self.commands.send("shutdown")
        self.process.join(60)
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()
            return None
        return self.process.exitcode


@pytest.fixture
def engine(ranks: ModuleType, integration: ModuleType, sidecar: SidecarThread,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Start scheduler processes of a server, pointed at `sidecar`; every one must exit normally."""
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", sidecar.socket_path)
    monkeypatch.setenv("HICACHE_EXPORTER_PUSH_INTERVAL", PUSH_INTERVAL)
    loggers = integration.stat_loggers()
    started: list[EngineRank] = []

    def start(server: Any, *tp_ranks: int) -> None:
        new = [EngineRank(ranks, loggers, server, tp_rank) for tp_rank in tp_ranks]
        started.extend(new)
        for rank in new:
            rank.ready()

    yield start
    codes = [rank.stop() for rank in started]
    assert codes == [0] * len(started), f"rank processes exited with {codes}"


def status(sidecar: SidecarThread) -> dict[str, Any]:
    code, body, _ = http_get(sidecar.url + "/api/v1/status")
    assert code == 200
    document: dict[str, Any] = json.loads(body)
    return document


def cells(document: Mapping[str, Any]) -> dict[str, str]:
    """State per rank cell id."""
    return {cell["id"]: cell["state"] for cell in document["ranks"]}


def missing_gauge(sidecar: SidecarThread) -> dict[str, float]:
    """hicache_exporter_ranks_missing per dp_rank (the server's other labels must be none here)."""
    found = {}
    for sample in sidecar.scrape().find("hicache_exporter_ranks_missing"):
        assert set(sample.labels) == {"dp_rank"}, sample.labels
        found[sample.labels["dp_rank"]] = sample.value
    return found


def test_a_rank_of_the_declared_world_that_never_started_is_missing_until_it_starts(ranks, engine, sidecar):
    # tp 4 under DP attention: 2 dp groups of 2 attention tp ranks; engine tp rank = dp * 2 + attention tp.
    server = ranks.Server(tp_size=4, attn_dp_size=2)
    engine(server, 0, 1, 2)  # tp rank 3 (dp 1, attention tp 1) never starts
    absent = "v0/dp=1,pp=0,cp=0,tp=1"
    started = {"v0/dp=0,pp=0,cp=0,tp=0", "v0/dp=0,pp=0,cp=0,tp=1", "v0/dp=1,pp=0,cp=0,tp=0"}

    # Three processes: radix and storage streams each, and a scheduler stream on each attention-TP leader.
    wait_until(lambda: status(sidecar)["totals"]["streams"] == 8 and missing_gauge(sidecar) == {"0": 0, "1": 1},
               timeout=30)
    document = status(sidecar)
    assert cells(document) == {**dict.fromkeys(started, "live"), absent: "missing"}
    assert document["totals"] == {"servers": 1, "ranks": 3, "live_ranks": 3, "streams": 8, "missing": 1}
    (only,) = document["servers"]
    (server_labels,) = (s["labels"] for s in document["label_sets"] if s["id"] == only["label_set"])
    assert server_labels == {}  # the collectors' own labels are not the server's
    world = {"tp_size": 4, "pp_size": 1, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1}
    assert only["expected"] == world and not only["world_conflict"]
    assert [stream["world"] for stream in document["streams"]] == [world] * 8  # every collector's hello carries it
    kinds = {stream["id"]: stream["kind"] for stream in document["streams"]}
    by_cell = {cell["id"]: sorted(kinds[stream] for stream in cell["streams"]) for cell in document["ranks"]}
    # The scheduler at the engine's tp rank 2 lands in dp 1's attention tp 0, not in a cell of its own.
    assert by_cell == {
        "v0/dp=0,pp=0,cp=0,tp=0": ["radix", "scheduler", "storage"],
        "v0/dp=0,pp=0,cp=0,tp=1": ["radix", "storage"],
        "v0/dp=1,pp=0,cp=0,tp=0": ["radix", "scheduler", "storage"],
        absent: [],
    }
    schedulers = [s for s in document["streams"] if s["kind"] == "scheduler"]
    assert sorted((s["rank"], s["tp_rank"]) for s in schedulers) == [
        ("v0/dp=0,pp=0,cp=0,tp=0", 0), ("v0/dp=1,pp=0,cp=0,tp=0", 2)]

    engine(server, 3)
    wait_until(lambda: missing_gauge(sidecar) == {"0": 0, "1": 0} and cells(status(sidecar))[absent] == "live",
               timeout=30)
    document = status(sidecar)
    assert cells(document) == dict.fromkeys([*started, absent], "live")
    assert document["totals"] == {"servers": 1, "ranks": 4, "live_ranks": 4, "streams": 10, "missing": 0}


def test_the_hook_reads_the_world_of_each_layout_from_the_engines_runtime_context(ranks, integration):
    # Resolved leaves, as the engine publishes them: --enable-dp-attention --dp-size N is attn_dp_size N.
    layouts = [
        ranks.Server(tp_size=4, attn_dp_size=2),  # DP attention: the engine's tp spans both dp groups
        ranks.Server(tp_size=2, dp_size=3),  # DP-controller replicas, each a tp group of its own
        ranks.Server(tp_size=8, attn_dp_size=2, attn_cp_size=2, pp_size=2),
        ranks.Server(tp_size=1),
    ]
    (worlds,) = run_processes(ranks.report_worlds, [(layouts,)], receive=True)
    assert worlds == [
        None,  # nothing published: no world, rather than a wrong one
        {"tp_size": 4, "pp_size": 1, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1},
        {"tp_size": 2, "pp_size": 1, "dp_size": 3, "attn_tp_size": 2, "attn_cp_size": 1},
        {"tp_size": 8, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 2},
        {"tp_size": 1, "pp_size": 1, "dp_size": 1, "attn_tp_size": 1, "attn_cp_size": 1},
    ]
    assert integration._server_world() is None  # outside an engine (this process has no runtime context)


def test_a_replicas_radix_and_storage_streams_take_the_replica_as_their_dp_rank(ranks, integration):
    """DP-controller replicas label their radix and storage series dp_rank 0, every one of them; the hook
    gives such a stream its replica's number, so the replicas are not one identity claimed twice."""
    (found,) = run_processes(ranks.report_replicas, [()], receive=True)
    assert found == [2, None]
    assert integration._replica_dp_rank() is None  # outside an engine
