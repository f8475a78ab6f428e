"""The prefill shares through every door, with the released SGLang 0.5.23 scheduler collector counting known tier hits.

One server runs DP attention, 2 dp groups × 2 attention tp ranks (tests/integrations/prefill_ranks.py):
every scheduler process counts its dp group's prefill batches through the released
`SchedulerMetricsCollector.increment_effective_prefill_tokens`, so each group's two replicas agree. The
same processes run twice, each time to a real `hicache-exporter serve`:

* the hook door: the stat-logger classes of exporter.integrations.sglang, pushing to the sidecar's socket;
* the proxy doors: the released collectors in prometheus_client's multiprocess mode, the directory read by
  `serve --upstream-multiprocess-dir`, and served as the engine's /metrics (tests/integrations/engine_server.py)
  read by `serve --upstream URL`.

Through each door, `/api/v1/status`'s `prefill.since_start` gives the hand-computed token counts and shares
exactly, for the whole server and per dp group: one replica per dp group, summed over the groups, never TP×.
They equal the shares computed from the sidecar's own `sglang_rollup_prefill_effective_tokens_total{mode}`.

Each process also reports its radix and storage events (tests.integrations.ranks.events: bytes and seconds of
its own shard), so the host tier's cost per hit token is known too and the same through every door. The
released 0.5.23 collectors count no storage (L3) bytes or seconds (those families are beyond upstream): the
storage tier's cost is only compared across the doors.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import Scrape, free_port, http_get, wait_until
from tests.integrations.support import ServeProcess, run_processes
from tests.integrations.test_proxy import DIRECTORY_PACE, HTTP_PACE, EngineServer

TP_RANKS = range(4)  # the engine's tp ranks: dp group = tp rank // 2
DP_GROUPS = (0, 1)
KINDS = {"computed": "input", "device": "device_hit", "host": "host_hit", "storage": "storage_hit"}
SETTLE = 30.0  # a bound on how long a sidecar may take to show what the ranks counted
DOORS = ("hook", "directory", "url")


def expected(groups: tuple[int, ...] = DP_GROUPS) -> dict[str, Any]:
    """The hand-computed figures of `groups`: each group's tokens once (one replica), summed over the groups."""
    from tests.integrations.prefill_ranks import group_tokens

    by_mode = {mode: float(sum(group_tokens(g)[mode] for g in groups)) for mode in KINDS.values()}
    tokens = {kind: by_mode[mode] for kind, mode in KINDS.items()}
    total = tokens["computed"] + tokens["device"] + tokens["host"] + tokens["storage"]
    offload = tokens["host"] + tokens["storage"]
    return {"tokens": {**tokens, "offload": offload, "total": total},
            "hit_ratio": {**{tier: tokens[tier] / total for tier in ("device", "host", "storage")},
                          "offload": offload / total},
            "computed_ratio": tokens["computed"] / total}


def expected_host_cost(groups: tuple[int, ...] = DP_GROUPS) -> dict[str, float]:
    """The host tier's cost in `groups`, by hand: what every rank (each its own shard) loaded back and backed up,
    paid per host and storage hit token (a storage hit is loaded back from host memory too)."""
    from tests.integrations.prefill_ranks import cache_rank
    from tests.integrations.ranks import events, total

    shards = [cache_rank(tp) for tp in TP_RANKS if cache_rank(tp).dp_rank in groups]
    read_bytes = float(sum(total(rank, "increment_load_back_num_bytes") for rank in shards))
    read_seconds = sum(args[0] for rank in shards for _, name, args in events(rank) if name == "observe_load_back_duration")
    fill_bytes = float(sum(total(rank, "increment_backup_num_bytes") for rank in shards))
    tokens = expected(groups)["tokens"]
    hits = tokens["host"] + tokens["storage"]
    return {"read_bytes": read_bytes, "read_seconds": read_seconds, "fill_bytes": fill_bytes,
            "bytes_per_hit_token": read_bytes / hits, "seconds_per_hit_token": read_seconds / hits,
            "fill_bytes_per_hit_token": fill_bytes / hits}


def host_cost(scope: dict[str, Any]) -> dict[str, Any]:
    """A scope's host cost, its seconds (float sums, in whatever order a door adds the ranks) to 1e-9."""
    cost = dict(scope["cost"]["host"])
    for key in ("read_seconds", "seconds_per_hit_token"):
        cost[key] = pytest.approx(cost[key], rel=1e-9)
    return cost


def figures(scope: dict[str, Any]) -> dict[str, Any]:
    """A scope of `prefill` without its costs and ids: what the doors must agree on."""
    return {key: scope[key] for key in ("tokens", "hit_ratio", "computed_ratio")}


def from_rollups(scrape: Scrape) -> dict[str, Any]:
    """The same figures, computed from the sidecar's own rollups on /metrics."""
    rolled = {s.labels["mode"]: s.value for s in scrape.find("sglang_rollup_prefill_effective_tokens_total")}
    tokens = {kind: rolled[mode] for kind, mode in KINDS.items()}
    total = sum(tokens.values())
    offload = tokens["host"] + tokens["storage"]
    return {"tokens": {**tokens, "offload": offload, "total": total},
            "hit_ratio": {**{tier: tokens[tier] / total for tier in ("device", "host", "storage")},
                          "offload": offload / total},
            "computed_ratio": tokens["computed"] / total}


class Serve(ServeProcess):
    def status(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(http_get(f"http://127.0.0.1:{self.port}/api/v1/status")[1])
        return document


def settled(sidecar: Serve) -> bool:
    """The status document shows every dp group's and the whole server's tokens (both replicas of each group
    pushed or were read: the rollup is a group's furthest replica, so it shows before the other replica)."""
    prefill = sidecar.status().get("prefill") or {}
    started = prefill.get("since_start") or {}
    groups = {g["dp_rank"]: g["tokens"] for g in started.get("dp_groups", [])}
    per_rank = sidecar.scrape().find("sglang_prefill_effective_tokens_total")
    return (started.get("tokens") == expected()["tokens"]
            and groups == {g: expected((g,))["tokens"] for g in DP_GROUPS}
            and len(per_rank) == len(TP_RANKS) * len(KINDS)
            # Every rank's radix stream too (a stream of its own, pushed or read apart from the scheduler's).
            and started["cost"]["host"]["read_bytes"] == expected_host_cost()["read_bytes"]
            and started["cost"]["host"]["fill_bytes"] == expected_host_cost()["fill_bytes"])


Seen = dict[str, dict[str, Any]]  # door -> {"status": ..., "scrape": ...}


@pytest.fixture(scope="module")
def doors(ranks: ModuleType, integration: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    """The schedulers counted through each door, each sidecar settled on them."""
    from tests.integrations import prefill_ranks

    root = tmp_path_factory.mktemp("prefill")
    directory = root / "multiproc"
    directory.mkdir()
    started: list[Any] = []
    try:
        with pytest.MonkeyPatch.context() as env:
            # The engine without the hook: the released collectors on prometheus_client, one directory.
            env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
            run_processes(prefill_ranks.count_prefill, [(None, tp) for tp in TP_RANKS])
        engine = EngineServer(directory, free_port()).start()
        started.append(engine)
        world = ["--upstream-world", prefill_ranks.WORLD]
        sidecars = {
            "hook": Serve(root / "hook", {}),
            "directory": Serve(root / "dir", {"upstreams": [
                {"name": "engine", "multiprocess_dir": str(directory), **DIRECTORY_PACE}]},
                ["--upstream-multiprocess-dir", str(directory), *world]),
            "url": Serve(root / "url", {"upstreams": [{"name": "engine", "url": engine.url, **HTTP_PACE}]},
                         ["--upstream", engine.url, *world]),
        }
        started.extend(sidecars.values())
        with pytest.MonkeyPatch.context() as env:
            # The engine with the hook: the stat-logger classes; a long interval leaves the last push to the exit.
            env.setenv("HICACHE_EXPORTER_SOCKET", sidecars["hook"].socket_path)
            env.setenv("HICACHE_EXPORTER_PUSH_INTERVAL", "600")
            run_processes(prefill_ranks.count_prefill, [(integration.stat_loggers(), tp) for tp in TP_RANKS])
        for sidecar in sidecars.values():
            wait_until(lambda sidecar=sidecar: settled(sidecar), timeout=SETTLE)
        yield {door: {"status": sidecar.status(), "scrape": sidecar.scrape()} for door, sidecar in sidecars.items()}
    finally:
        for thing in reversed(started):
            thing.stop()


@pytest.mark.parametrize("door", DOORS)
def test_the_shares_are_the_hand_computed_ones_once_per_dp_group_not_tp_times(doors: Seen, door: str) -> None:
    started = doors[door]["status"]["prefill"]["since_start"]
    truth = expected()
    assert truth["tokens"] == {"computed": 1332.0, "device": 1460.0, "host": 384.0, "storage": 128.0, "offload": 512.0,
                               "total": 3304.0}
    assert figures(started) == truth
    # Everything was counted inside the window, so the window's figures (the positions' increases) are the same.
    assert figures(doors[door]["status"]["prefill"]["window"]) == truth
    assert started["hit_ratio"] == {"device": 1460 / 3304, "host": 384 / 3304, "storage": 128 / 3304,
                                    "offload": 512 / 3304}
    (server,) = started["servers"]
    assert figures(server) == truth and started["servers_count"] == 1
    # Per dp group: each group's own traffic, its replicas counted once.
    assert started["dp_groups_count"] == 2
    assert {g["dp_rank"]: figures(g) for g in started["dp_groups"]} == {g: expected((g,)) for g in DP_GROUPS}
    assert {g["server"] for g in started["dp_groups"]} == {server["server"]}
    # What the host tier cost per hit token, for the server and per dp group.
    assert expected_host_cost() == host_cost(started) == host_cost(server)
    assert {g["dp_rank"]: host_cost(g) for g in started["dp_groups"]} == {g: expected_host_cost((g,)) for g in DP_GROUPS}
    # Not TP×: every scheduler's own series holds its group's count, and summing them doubles it.
    scrape: Scrape = doors[door]["scrape"]
    for kind, mode in KINDS.items():
        per_rank = scrape.find("sglang_prefill_effective_tokens_total", mode=mode)
        assert sorted(s.labels["tp_rank"] for s in per_rank) == ["0", "1", "2", "3"]
        assert {(s.labels["tp_rank"], s.labels["dp_rank"]): s.value for s in per_rank} == {
            (str(tp), str(tp // 2)): expected((tp // 2,))["tokens"][kind] for tp in TP_RANKS}
        assert sum(s.value for s in per_rank) == 2 * truth["tokens"][kind]


@pytest.mark.parametrize("door", DOORS)
def test_the_shares_are_those_of_the_sidecars_own_rollups(doors: Seen, door: str) -> None:
    scrape: Scrape = doors[door]["scrape"]
    assert from_rollups(scrape) == figures(doors[door]["status"]["prefill"]["since_start"]) == expected()


def test_every_door_gives_the_same_prefill_figures(doors: Seen) -> None:
    seen = {door: doors[door]["status"]["prefill"]["since_start"] for door in DOORS}
    hook = seen["hook"]
    for door in ("directory", "url"):
        assert figures(seen[door]) == figures(hook)
        assert [figures(g) for g in seen[door]["dp_groups"]] == [figures(g) for g in hook["dp_groups"]]
        assert host_cost(seen[door]) == host_cost(hook)
        # The released collectors count no storage (L3) bytes (storage_prefetch_bytes_total is beyond upstream).
        assert seen[door]["cost"]["storage"] == hook["cost"]["storage"]
    rollups = {door: sorted((s.labels["mode"], s.value) for s in doors[door]["scrape"].find(
        "sglang_rollup_prefill_effective_tokens_total")) for door in DOORS}
    assert rollups["directory"] == rollups["url"] == rollups["hook"]
