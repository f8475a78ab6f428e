"""The prefill shares of the lmcache profile through every door, with the released LMCache 0.5.6 monitor and
logger counting known requests.

Two vLLM DP replicas of a TP-2 engine: 4 spawned processes, one per worker, each with LMCache's metadata as
vLLM fills it (worker_id 0-1 in each replica, world_size 2, engine_id `<uuid>_dp0` / `_dp1`). Every worker
of a replica counts that replica's requests alike (the replicas serve different traffic) through the released
`LMCStatsMonitor`, as the connector's start_load_kv does (vllm_v1_adapter.py:799-806, 816-822,
cache_engine.py:846-859, 966-970): for every request LMCache looked up, its prompt as LMCache counts it
(`update_interval_prompt_tokens` of its ReqMeta's token ids: the first scheduling step's tokens cut to whole
chunks, 348-357) and the prefix vLLM's own GPU cache held (`update_interval_vllm_hit_tokens`); where LMCache
holds more than vLLM, a retrieve from the LMCache chunk boundary below vLLM's hit
(`on_retrieve_finished(on_retrieve_request(requested), loaded)`). Then `LMCacheStatsLogger`'s one step,
`log_prometheus(monitor.get_stats_and_clear())`. One request's vLLM hit (288 tokens) is not on a chunk
boundary: LMCache loads from 256, so 32 of its tokens count both as vLLM's hits and as LMCache's; one prompt
is under a chunk and counts as 0. The shares' `computed` is a lower bound of what the engine really computed
(what LMCache's counts give, as documented).

The same processes run twice, each time to real `hicache-exporter serve` sidecars:

* the hook door: `exporter.integrations.lmcache` (`install()` in replica 0, `register()`, vLLM's plugin, in
  replica 1), pushing to `serve --profile lmcache`: each replica is its own dp group (the engine_id's `_dp<N>`);
* the proxy doors: LMCache's own multiprocess mode, one PROMETHEUS_MULTIPROC_DIR for both replicas, read by
  `serve --upstream-multiprocess-dir DIR --upstream-profile lmcache --upstream-world tp=2,dp=1`, and served
  as vLLM's /metrics (tests/integrations/engine_server.py) read by `serve --upstream URL ...`. LMCache labels
  no DP replica, so multiprocess mode sums the replicas' workers with one worker_id
  (tests/integrations/test_lmcache_doors.py): one dp group (dp_rank 0) holding both replicas' sum. Per dp
  group there is nothing to tell apart: only the whole sidecar and the server are checked there.

Through each door `/api/v1/status`'s `prefill.since_start` (and `window`: everything counted inside it) gives
the hand-computed tokens and shares exactly: one replica per engine, summed over the engines, never TP times.
They equal the shares computed from the sidecar's own rollups of the three families, while the sum of the
per-rank series is TP times the truth.

The sidecars run with the documented flags alone (`--profile lmcache`, `--upstream-profile lmcache`), which
keep sglang, the default profile, beside lmcache: `prefill` is the profile whose ranks count (before, it was
sglang's, all zeros, whatever LMCache counted).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import Scrape, free_port, http_get, wait_until
from tests.integrations.support import ServeProcess, run_processes
from tests.integrations.test_proxy import DIRECTORY_PACE, HTTP_PACE, EngineServer

pytestmark = pytest.mark.usefixtures("released_wheel")  # the wheel checked once, before any process starts

TP = 2
REPLICAS = 2
WORLD = "tp=2,dp=1"  # the proxy doors: the replicas read as one engine (their sum)
MODEL = "Qwen/Qwen3-8B"
SERVED = "qwen3-8b"
CHUNK = 256  # LMCache's chunk_size
SETTLE = 30.0  # a bound on how long a sidecar may take to show what the workers counted
DOORS = ("hook", "directory", "url")
# The kinds the lmcache profile counts, by the family that counts each (exporter/defaults/lmcache.yaml).
FAMILIES = {"prompt": "num_prompt_tokens_total", "device": "num_vllm_hit_tokens_total",
            "offload": "num_hit_tokens_total"}

# Each replica's requests, as every one of its workers sees them: (prompt tokens, tokens vLLM's GPU prefix
# cache held, tokens LMCache's lookup found, tokens its retrieve loaded).
Request = tuple[int, int, int, int]
REQUESTS: dict[int, tuple[Request, ...]] = {
    0: ((1000, 0, 768, 768),  # LMCache only: 3 chunks
        (2100, 288, 1792, 1536),  # both; the retrieve starts at 256, below vLLM's 288: 32 tokens in both
        (600, 512, 0, 0)),  # vLLM only: LMCache found nothing, no retrieve
    1: ((3000, 1024, 2560, 1280),  # both, on a chunk boundary; the last of 6 chunks asked for is not loaded
        (400, 0, 256, 256),  # LMCache only: 1 chunk
        (700, 256, 256, 0),  # LMCache holds no more than vLLM: no retrieve
        (200, 192, 0, 0)),  # a prompt under a chunk: LMCache counts it as 0 tokens, vLLM's hit as 192
}


def retrieve(request: Request) -> tuple[int, int] | None:
    """(tokens requested, tokens loaded) of a request's retrieve; None where it makes none.

    The scheduler lets a request load only what LMCache holds past vLLM's hit (need_to_allocate > 0,
    vllm_v1_adapter.py:1451); the worker masks vLLM's hit down to the chunk boundary below it (816-822) and
    retrieves tokens[:lmcache_cached] under that mask: the mask's sum is the retrieve's requested tokens
    (cache_engine.py:846-859), what it loaded its hit tokens (966-970)."""
    _, vllm_cached, lmcache_cached, loaded = request
    if lmcache_cached <= vllm_cached:
        assert loaded == 0
        return None
    requested = lmcache_cached - vllm_cached // CHUNK * CHUNK
    assert loaded <= requested and loaded % CHUNK == 0
    return requested, loaded


def counted_prompt(request: Request) -> int:
    """What a worker counts as a request's prompt: the token ids of its ReqMeta (vllm_v1_adapter.py:804-806),
    the tokens of its first scheduling step (here the whole prompt: the token budget holds it) cut to whole
    chunks (348-357, discard_partial_chunks by default)."""
    return request[0] // CHUNK * CHUNK


def replica_tokens(replica: int) -> dict[str, int]:
    """What every worker of `replica` counts, by kind."""
    requests = REQUESTS[replica]
    return {"prompt": sum(counted_prompt(r) for r in requests), "device": sum(r[1] for r in requests),
            "offload": sum(hit[1] for r in requests if (hit := retrieve(r)) is not None)}


def shares(prompt: float, device: float, offload: float) -> dict[str, Any]:
    """The figures of `prefill` from the three counts, by hand (docs/api.md, section prefill): every prefill
    token is the prompt as counted or the hits, whichever is more."""
    total = max(prompt, device + offload)
    computed = total - device - offload
    return {"tokens": {"computed": computed, "device": device, "host": None, "storage": None, "offload": offload,
                       "total": total},
            "hit_ratio": {"device": device / total, "host": None, "storage": None, "offload": offload / total},
            "computed_ratio": computed / total}


def expected(replicas: tuple[int, ...] = tuple(range(REPLICAS))) -> dict[str, Any]:
    """The hand-computed figures of `replicas`: each engine's tokens once (one worker), summed over the engines."""
    return shares(*(float(sum(replica_tokens(r)[kind] for r in replicas)) for kind in FAMILIES))


def figures(scope: dict[str, Any]) -> dict[str, Any]:
    """A scope of `prefill` without its costs and ids: what the doors must agree on."""
    return {key: scope[key] for key in ("tokens", "hit_ratio", "computed_ratio")}


def from_rollups(scrape: Scrape) -> dict[str, Any]:
    """The same figures, computed from the sidecar's own rollups on /metrics."""
    return shares(*(scrape.value(f"lmcache_rollup_{family}") for family in FAMILIES.values()))


BASE = uuid.uuid4().hex  # the engine's id; each DP engine's is BASE_dp<N> (vllm/v1/engine/core.py:1374-1382)
WORKERS = [(r, w, f"{BASE}_dp{r}") for r in range(REPLICAS) for w in range(TP)]


def worker(replica: int, worker_id: int, engine: str, hooked: bool) -> None:
    """One vLLM worker of one DP replica: LMCache's logger (pushing too, when `hooked`), its replica's requests."""
    import os

    from tests.upstream_lmcache import install as install_released

    lmcache = install_released()
    if hooked:
        import exporter.integrations.lmcache as hook

        if replica == 0:
            hook.install(os.environ["HICACHE_EXPORTER_SOCKET"])
        else:
            hook.register()  # vLLM's general plugin
        assert lmcache.PrometheusLogger._counter_cls is hook.PushingCounter
    # As vllm_service_factory.py:145-159 fills it.
    metadata = lmcache.LMCacheMetadata(
        model_name=MODEL, world_size=TP, local_world_size=TP * REPLICAS, worker_id=worker_id,
        local_worker_id=worker_id + replica * TP, kv_dtype=None, kv_shape=(36, 2, CHUNK, 8 // TP, 128),
        role="worker", served_model_name=SERVED, engine_id=engine)
    logger = lmcache.PrometheusLogger.GetOrCreate(metadata)
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    for request in REQUESTS[replica]:
        # start_load_kv: every request with a load spec (vllm_v1_adapter.py:799-806), then its retrieve.
        monitor.update_interval_vllm_hit_tokens(request[1])
        monitor.update_interval_prompt_tokens(counted_prompt(request))
        if (hit := retrieve(request)) is not None:
            monitor.on_retrieve_finished(monitor.on_retrieve_request(hit[0]), hit[1])
        logger.log_prometheus(monitor.get_stats_and_clear())  # observability.py:1975-1982


class Serve(ServeProcess):
    def status(self) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(http_get(f"http://127.0.0.1:{self.port}/api/v1/status")[1])
        return document


def per_rank(scrape: Scrape, family: str) -> dict[tuple[str, str, str], float]:
    """A per-rank family of the sidecar by (worker_id, tp_rank, dp_rank)."""
    return {(s.labels["worker_id"], s.labels["tp_rank"], s.labels["dp_rank"]): s.value
            for s in scrape.find(f"lmcache_{family}")}


def per_rank_expected(door: str, kind: str) -> dict[tuple[str, str, str], float]:
    """Each rank's own series: its replica's count (hook), or the replicas' sum per worker_id (proxy doors)."""
    if door == "hook":
        return {(str(w), str(w), str(r)): float(replica_tokens(r)[kind]) for r in range(REPLICAS) for w in range(TP)}
    return {(str(w), str(w), "0"): float(sum(replica_tokens(r)[kind] for r in range(REPLICAS))) for w in range(TP)}


def settled(sidecar: Serve, door: str) -> bool:
    """The document shows the whole sidecar's tokens, and every worker's own series is there at its full count
    (the rollup is an engine's furthest worker, so it shows before the other worker pushed)."""
    started = (sidecar.status().get("prefill") or {}).get("since_start") or {}
    scrape = sidecar.scrape()
    return (started.get("tokens") == expected()["tokens"]
            and all(per_rank(scrape, family) == per_rank_expected(door, kind) for kind, family in FAMILIES.items()))


Seen = dict[str, dict[str, Any]]  # door -> {"status": ..., "scrape": ...}


@pytest.fixture(scope="module")
def multiproc(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The workers without the hook, in LMCache's own multiprocess mode: one directory for every worker."""
    directory = tmp_path_factory.mktemp("lmcache-multiproc")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        run_processes(worker, [(*args, False) for args in WORKERS])
    return directory


@pytest.fixture(scope="module")
def doors(multiproc: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    """The workers counted through each door, each sidecar settled on them."""
    root = tmp_path_factory.mktemp("lmcache-prefill")
    started: list[Any] = []
    try:
        engine = EngineServer(multiproc, free_port()).start()
        started.append(engine)
        proxy = ["--upstream-profile", "lmcache", "--upstream-world", WORLD]
        sidecars = {
            "hook": Serve(root / "hook", {}, ["--profile", "lmcache"]),
            "directory": Serve(root / "dir", {"upstreams": [
                {"name": "engine", "multiprocess_dir": str(multiproc), **DIRECTORY_PACE}]},
                ["--upstream-multiprocess-dir", str(multiproc), *proxy]),
            "url": Serve(root / "url", {"upstreams": [
                {"name": "engine", "url": engine.url, **HTTP_PACE}]}, ["--upstream", engine.url, *proxy]),
        }
        started.extend(sidecars.values())
        with pytest.MonkeyPatch.context() as env:
            # LMCache with the hook; a directory of its own (not /tmp's, which LMCache would make); a long
            # interval leaves the last push to the exit.
            (root / "hook-multiproc").mkdir()
            env.setenv("PROMETHEUS_MULTIPROC_DIR", str(root / "hook-multiproc"))
            env.setenv("HICACHE_EXPORTER_SOCKET", sidecars["hook"].socket_path)
            env.setenv("HICACHE_EXPORTER_PUSH_INTERVAL", "600")
            run_processes(worker, [(*args, True) for args in WORKERS])
        for door, sidecar in sidecars.items():
            wait_until(partial(settled, sidecar, door), timeout=SETTLE)
        yield {door: {"status": sidecar.status(), "scrape": sidecar.scrape()} for door, sidecar in sidecars.items()}
    finally:
        for thing in reversed(started):
            thing.stop()


def test_the_hand_computed_figures_count_vllms_hits_lmcaches_and_what_the_prompt_leaves() -> None:
    assert [replica_tokens(r) for r in range(REPLICAS)] == [
        {"prompt": 3328, "device": 800, "offload": 2304}, {"prompt": 3584, "device": 1472, "offload": 1536}]
    truth = expected()
    assert truth["tokens"] == {"computed": 800.0, "device": 2272.0, "host": None, "storage": None,
                               "offload": 3840.0, "total": 6912.0}
    assert truth["hit_ratio"]["device"] == 2272 / 6912 and truth["computed_ratio"] == 800 / 6912
    # What the engine really computed: each prompt past the furthest hit. The shares' computed is a lower
    # bound of it: LMCache's prompt leaves out each prompt's last partial chunk (1,920 against 800 here),
    # and the second request's tokens 256-287, loaded by LMCache over vLLM's own hit, count in both hits.
    really = sum(prompt - max(vllm, vllm // CHUNK * CHUNK + loaded)
                 for requests in REQUESTS.values() for prompt, vllm, _, loaded in requests)
    assert really == 1920 and truth["tokens"]["computed"] < really


@pytest.mark.parametrize("door", DOORS)
def test_the_shares_are_the_hand_computed_ones_once_per_engine_not_tp_times(doors: Seen, door: str) -> None:
    prefill = doors[door]["status"]["prefill"]
    assert prefill["profile"] == "lmcache"
    assert {kind: (count["family"], count["exported"]) for kind, count in prefill["counts"].items()} == {
        kind: (family, f"lmcache_rollup_{family.removesuffix('_total')}") for kind, family in FAMILIES.items()}
    started = prefill["since_start"]
    truth = expected()
    assert figures(started) == truth
    # Everything was counted inside the window, so the window's figures (the positions' increases) are the same.
    assert figures(prefill["window"]) == truth
    (server,) = started["servers"]
    assert figures(server) == truth and started["servers_count"] == 1
    # Not TP times: every worker's own series holds its engine's count (through the proxy doors the sum of the
    # replicas, per worker_id), and summing them over the workers doubles the truth.
    scrape: Scrape = doors[door]["scrape"]
    for kind, family in FAMILIES.items():
        assert per_rank(scrape, family) == per_rank_expected(door, kind)
        assert sum(per_rank(scrape, family).values()) == TP * truth["tokens"][kind if kind != "prompt" else "total"]


def test_through_the_hook_door_each_replica_is_its_dp_group(doors: Seen) -> None:
    started = doors["hook"]["status"]["prefill"]["since_start"]
    assert started["dp_groups_count"] == REPLICAS
    groups = {g["dp_rank"]: figures(g) for g in started["dp_groups"]}
    assert groups == {r: expected((r,)) for r in range(REPLICAS)}
    assert groups[0]["tokens"]["computed"] == 224 and groups[1]["tokens"]["computed"] == 576
    for kind in ("device", "offload", "total", "computed"):
        assert groups[0]["tokens"][kind] + groups[1]["tokens"][kind] == figures(started)["tokens"][kind]


@pytest.mark.parametrize("door", ["directory", "url"])
def test_through_the_proxy_doors_the_replicas_are_one_dp_group_their_sum(doors: Seen, door: str) -> None:
    started = doors[door]["status"]["prefill"]["since_start"]
    (group,) = started["dp_groups"]
    assert started["dp_groups_count"] == 1 and group["dp_rank"] == 0
    assert figures(group) == expected()


@pytest.mark.parametrize("door", DOORS)
def test_the_shares_are_those_of_the_sidecars_own_rollups(doors: Seen, door: str) -> None:
    scrape: Scrape = doors[door]["scrape"]
    assert from_rollups(scrape) == figures(doors[door]["status"]["prefill"]["since_start"]) == expected()
    assert scrape.value("lmcache_rollup_num_prompt_tokens_total") == 6912


def test_every_door_gives_the_same_prefill_figures(doors: Seen) -> None:
    seen = {door: doors[door]["status"]["prefill"] for door in DOORS}
    for door in ("directory", "url"):
        for period in ("since_start", "window"):
            assert figures(seen[door][period]) == figures(seen["hook"][period])
        assert seen[door]["counts"] == seen["hook"]["counts"] and seen[door]["tiers"] == seen["hook"]["tiers"]
    rollups = {door: [doors[door]["scrape"].value(f"lmcache_rollup_{family}") for family in FAMILIES.values()]
               for door in DOORS}
    assert rollups["directory"] == rollups["url"] == rollups["hook"] == [6912, 2272, 3840]


def test_the_document_has_one_offload_tier_and_no_bytes_of_it(doors: Seen) -> None:
    for door in DOORS:
        prefill = doors[door]["status"]["prefill"]
        assert prefill["tiers"] == {"host": None, "storage": None,
                                    "offload": {"level": "L2", "read_transfer": "retrieve", "fill_transfer": "store"}}
        cost = prefill["since_start"]["cost"]
        assert cost["host"] is None and cost["storage"] is None
        # LMCache times its retrieves (each worker its own) and counts no bytes of them.
        assert cost["offload"]["read_bytes"] is None and cost["offload"]["read_seconds"] >= 0
