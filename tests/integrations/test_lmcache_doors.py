"""The two proxy doors for LMCache 0.5.6, against its released logger: a multiprocess directory, and a /metrics URL.

vLLM gives every process of a deployment one PROMETHEUS_MULTIPROC_DIR, its DP replicas' workers
included. Here two DP replicas of a TP-4 engine, 8 spawned processes, each build the released
`PrometheusLogger` (tests.upstream_lmcache) with that directory set before they start (LMCache's own
multiprocess mode), count their replica's requests (each replica its own, so that sums show) and
their own shard's bytes (each worker its own), and make the logger's one step,
`log_prometheus(monitor.get_stats_and_clear())`. A frontend process writes two `vllm:` families
into the same directory, as vLLM's own metrics are.

* The directory door: a real `hicache-exporter serve --upstream-multiprocess-dir DIR --upstream-profile
  lmcache --upstream-world tp=4,dp=1` reads it.
* The URL door: prometheus_client's HTTP server over `CollectorRegistry` + `MultiProcessCollector(DIR)`,
  as vLLM's /metrics (vllm/v1/metrics/prometheus.py:38-51), read by `serve --upstream URL ...`.
* Side by side: the directory read as that /metrics reads it, summed over worker_id (what a
  dashboard's `sum()` shows): TP times the truth.

LMCache labels no DP replica, so the replicas' workers with one worker_id share a label set, and
multiprocess mode sums them: one rank per worker_id whose value is the sum over the replicas. A
replicated rollup (max over the workers) is then the sum of the replicas' counts: the truth, each
engine's tokens once, summed over engines. Per-shard rollups are the sum over all 8 workers.

In multiprocess mode `reset_counters()` changes nothing in the files (docs/lmcache-0.5.6.md
section 5): the rollups read the same after it. Where LMCache serves its in-process REGISTRY
(PROMETHEUS_MULTIPROC_DIR unset at import: prometheus_client's in-process values) from its internal
API server (v1/internal_api_server/common/metrics_api.py:14-20, and `POST /metrics/reset`, 23-29), a
reset drops the counters to 0: the proxy takes the drop as a reset of each series, so the rollup
holds and counts on.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

from tests.helpers import Scrape, free_port, http_get, wait_until
from tests.integrations.support import SPAWN, ServeProcess, run_processes, samples
from tests.integrations.test_proxy import DIRECTORY_PACE, HTTP_PACE, EngineServer

pytestmark = pytest.mark.usefixtures("released_wheel")  # the wheel checked once, before any process starts

TP = 4
REPLICAS = 2
WORLD = "tp=4,dp=1"  # replicas read as one engine: their sum
MODEL = "Qwen/Qwen3-8B"
SERVED = "qwen3-8b"
SYNC_TIMEOUT = 60  # a barrier a process never reaches breaks after this, failing the test
SETTLE = 30  # how long a sidecar may take to show what the files hold: a bound on a wait
RESET_REPLICA, RESET_WORKER = 0, 2

# The retrieves each replica's workers all see alike, per interval: (tokens asked, tokens loaded).
RETRIEVES = {0: (((768, 768), (2048, 1792)), ((1024, 1024),)), 1: (((512, 512),), ((256, 256),))}
HIT_TOKENS = {replica: tuple(sum(loaded for _, loaded in step) for step in steps) for replica, steps in RETRIEVES.items()}
# Each worker's own shard bytes read from the remote backend, per interval: distinct for every process.
READ_BYTES = {(replica, worker_id): ((replica * TP + worker_id + 1) * 1_048_576, (replica * TP + worker_id + 1) * 4_096)
              for replica in range(REPLICAS) for worker_id in range(TP)}
EVICTIONS = {(replica, worker_id): (replica * TP + worker_id + 1, 10 * (replica * TP + worker_id + 1))
             for replica in range(REPLICAS) for worker_id in range(TP)}
# vLLM's own families, as its frontend writes them into the same directory (one per DP engine).
PROMPT_TOKENS = {"0": 9_000, "1": 1_500}
RUNNING = {"0": 3.0, "1": 1.0}


def metadata(lmcache: Any, worker_id: int) -> Any:
    """A vLLM worker's metadata, as create_lmcache_metadata fills it in (integration/vllm/utils.py:429-442)."""
    return lmcache.LMCacheMetadata(
        model_name=MODEL, world_size=TP, local_world_size=TP, worker_id=worker_id, local_worker_id=worker_id,
        kv_dtype=None, kv_shape=(36, 2, 256, 8 // TP, 128), role="worker", served_model_name=SERVED,
    )


def count(monitor: Any, logger: Any, retrieves: tuple[tuple[int, int], ...], read_bytes: int,
          evictions: int) -> None:
    """One interval of a worker through the released monitor, then the logger's one step."""
    for tokens, loaded in retrieves:
        # num_requested_tokens, num_retrieve_requests (observability.py:391-392); num_hit_tokens (409).
        monitor.on_retrieve_finished(monitor.on_retrieve_request(tokens), loaded)
    monitor.update_interval_remote_read_metrics(read_bytes)  # num_remote_read_{requests,bytes} (531-533)
    monitor.update_local_cpu_evict_metrics(evictions)  # local_cpu_evict_count += 1, _keys_count += keys (566-568)
    logger.log_prometheus(monitor.get_stats_and_clear())


def worker(replica: int, worker_id: int, barrier: Any, conn: Any) -> None:
    """One LMCache worker of one replica: interval 1, the reset (one worker), interval 2, with the parent reading between."""
    from tests.upstream_lmcache import install

    lmcache = install()
    logger = lmcache.PrometheusLogger.GetOrCreate(metadata(lmcache, worker_id))  # as the vLLM adapter does
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()
    key = (replica, worker_id)
    count(monitor, logger, RETRIEVES[replica][0], READ_BYTES[key][0], EVICTIONS[key][0])
    barrier.wait(SYNC_TIMEOUT)  # interval 1 is in the files
    barrier.wait(SYNC_TIMEOUT)  # the parent has read them
    if key == (RESET_REPLICA, RESET_WORKER):
        logger.reset_counters()
    barrier.wait(SYNC_TIMEOUT)  # the reset is done
    barrier.wait(SYNC_TIMEOUT)  # the parent has read the files again
    count(monitor, logger, RETRIEVES[replica][1], READ_BYTES[key][1], EVICTIONS[key][1])
    conn.send(key)


def frontend() -> None:
    """vLLM's own families, one series per DP engine, written into the directory as vLLM writes them."""
    from prometheus_client import Counter, Gauge

    prompt = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", ["model_name", "engine"])
    running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.",
                    ["model_name", "engine"], multiprocess_mode="mostrecent")
    for engine, tokens in PROMPT_TOKENS.items():
        prompt.labels(SERVED, engine).inc(tokens)
        running.labels(SERVED, engine).set(RUNNING[engine])


class Serve(ServeProcess):
    """The sidecar reading one LMCache upstream (a URL or a directory)."""

    def __init__(self, directory: Path, flag: str, source: str, pace: dict[str, float], world: str = WORLD,
                 pass_through: bool = True) -> None:
        key = "url" if flag == "--upstream" else "multiprocess_dir"
        # The file gives the upstream its pace; the flags name it again, with its profile and world.
        super().__init__(directory, {"upstreams": [{"name": "engine", key: source, "pass_through": pass_through, **pace}]},
                         [flag, source, "--upstream-profile", "lmcache", "--upstream-world", world])

    def last_read(self) -> float:
        """When the upstream was last read successfully (0 before the first read)."""
        found = self.scrape().find("hicache_exporter_upstream_last_scrape_timestamp_seconds")
        return float(found[0].value) if found else 0.0

    def read_again(self) -> None:
        """Wait for a read that began after now: the second successful read from now on."""
        for _ in range(2):
            before = self.last_read()
            wait_until(lambda before=before: self.last_read() > before, timeout=SETTLE)



Series = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def read(directory: Path) -> Series:
    """The directory as vLLM's /metrics serves it (prometheus.py:38-51): (sample name, labels) -> value."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in registry.collect() for s in family.samples}


def summed(series: Series, name: str) -> float:
    """The sum over worker_id of one family's series: what a dashboard's `sum(...)` of vLLM's /metrics shows."""
    return sum(value for (sample, _), value in series.items() if sample == name)


Snapshot = dict[str, Any]  # what the test saw at one settled point


def lmcache_samples(scrape: Scrape) -> list[tuple[str, tuple[tuple[str, str], ...], float]]:
    """The sidecar's lmcache_ series (per rank and rollups), sorted."""
    return sorted((s.name, tuple(sorted(s.labels.items())), float(s.value))
                  for s in scrape.samples if s.name.startswith("lmcache_"))


def expected_hit_tokens(steps: int) -> float:
    """The truth after `steps` intervals: each replica's tokens once, summed over the replicas."""
    return float(sum(sum(HIT_TOKENS[replica][:steps]) for replica in range(REPLICAS)))


def expected_bytes(steps: int, worker_id: int | None = None) -> float:
    """Remote read bytes after `steps` intervals: of one worker_id over the replicas, or of all 8 workers."""
    return float(sum(sum(READ_BYTES[(replica, w)][:steps]) for replica in range(REPLICAS) for w in range(TP)
                     if worker_id is None or w == worker_id))


def settled(sidecar: Serve, steps: int) -> bool:
    """The sidecar shows both rollups of `steps` intervals, and every worker's own bytes of them (a read that
    began while a worker's file was still being written may lack its part: the next one has it)."""
    scrape = sidecar.scrape()
    found = scrape.find("lmcache_rollup_num_hit_tokens_total")
    return (len(found) == 1 and found[0].value == expected_hit_tokens(steps)
            and scrape.total("lmcache_rollup_num_remote_read_bytes_total") == expected_bytes(steps)
            and per_rank(scrape, "lmcache_num_remote_read_bytes_total")
            == {(str(w), str(w), "0", "0"): expected_bytes(steps, w) for w in range(TP)}
            and set(per_rank(scrape, "lmcache_num_hit_tokens_total").values()) == {expected_hit_tokens(steps)})


def snapshot(directory: Path, sidecars: dict[str, Serve], engine: EngineServer, steps: int) -> Snapshot:
    """Both doors once they show `steps` intervals, the directory as vLLM reads it, and the engine's /metrics."""
    for sidecar in sidecars.values():
        sidecar.read_again()  # a read that began after the workers wrote (one that began before may have seen a part)
        wait_until(lambda sidecar=sidecar: settled(sidecar, steps), timeout=SETTLE)
    return {"files": read(directory), "engine": http_get(engine.url)[1].decode(),
            **{door: sidecar.scrape() for door, sidecar in sidecars.items()},
            "status": {door: json.loads(http_get(f"http://127.0.0.1:{sidecar.port}/api/v1/status")[1])
                       for door, sidecar in sidecars.items()}}



@pytest.fixture(scope="module")
def doors(released_wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Snapshot]]:
    """The 8 workers and the frontend in one directory, both doors reading it: snapshots after interval 1,
    after the reset (each door read again since), and after interval 2."""
    root = tmp_path_factory.mktemp("doors")
    directory = root / "multiproc"
    directory.mkdir()
    started: list[Any] = []
    try:
        engine = EngineServer(directory, free_port()).start()
        started.append(engine)
        sidecars = {"directory": Serve(root / "dir", "--upstream-multiprocess-dir", str(directory), DIRECTORY_PACE)}
        started.append(sidecars["directory"])
        sidecars["url"] = Serve(root / "url", "--upstream", engine.url, HTTP_PACE)
        started.append(sidecars["url"])
        with pytest.MonkeyPatch.context() as monkeypatch:
            # Set before the workers import prometheus_client, which picks file-backed values on import.
            monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
            run_processes(frontend, [()])
            barrier = SPAWN.Barrier(REPLICAS * TP + 1)
            snapshots: list[Snapshot] = []
            with ThreadPoolExecutor(1) as pool:
                running = pool.submit(run_processes, worker, [
                    (replica, worker_id, barrier) for replica in range(REPLICAS) for worker_id in range(TP)],
                    receive=True)
                try:
                    barrier.wait(SYNC_TIMEOUT)
                    snapshots.append(snapshot(directory, sidecars, engine, 1))
                    barrier.wait(SYNC_TIMEOUT)
                    barrier.wait(SYNC_TIMEOUT)
                    snapshots.append(snapshot(directory, sidecars, engine, 1))
                    barrier.wait(SYNC_TIMEOUT)
                except BaseException:
                    barrier.abort()  # the workers stop waiting (their tracebacks are in the captured stderr)
                    running.exception()
                    raise
                assert sorted(running.result()) == sorted(READ_BYTES)
            snapshots.append(snapshot(directory, sidecars, engine, 2))
        yield snapshots
    finally:
        for thing in reversed(started):
            thing.stop()


def per_rank(scrape: Scrape, name: str) -> dict[tuple[str, str, str, str], float]:
    """A per-rank family of the sidecar by (worker_id, tp_rank, pp_rank, dp_rank)."""
    return {(s.labels["worker_id"], s.labels["tp_rank"], s.labels["pp_rank"], s.labels["dp_rank"]): s.value
            for s in scrape.find(name)}


@pytest.mark.parametrize("door", ["directory", "url"])
def test_each_worker_is_a_rank_holding_the_sum_over_the_replicas(doors: list[Snapshot], door: str) -> None:
    for steps, seen in ((1, doors[0]), (2, doors[2])):
        scrape: Scrape = seen[door]
        replicas_summed = expected_hit_tokens(steps)  # every worker of a replica counts its tokens alike
        assert replicas_summed == (3072.0, 4352.0)[steps - 1]
        assert per_rank(scrape, "lmcache_num_hit_tokens_total") == {
            (str(w), str(w), "0", "0"): replicas_summed for w in range(TP)}
        assert per_rank(scrape, "lmcache_num_remote_read_bytes_total") == {
            (str(w), str(w), "0", "0"): expected_bytes(steps, w) for w in range(TP)}
        # The world tp=4 is trusted: the four ranks it expects are there, none missing.
        (upstream,) = seen["status"][door]["upstreams"]
        assert upstream["world_problems"] == [] and upstream["world"]["tp_size"] == TP
        assert seen["status"][door]["totals"]["missing"] == 0
        assert scrape.find("hicache_exporter_upstream_unranked_families") == []
        (sample,) = scrape.find("lmcache_num_hit_tokens_total", worker_id="1")
        assert sample.labels == {"worker_id": "1", "tp_rank": "1", "pp_rank": "0", "dp_rank": "0",
                                 "model_name": MODEL, "role": "worker", "served_model_name": SERVED}


@pytest.mark.parametrize("door", ["directory", "url"])
def test_the_rollups_are_the_truth_once_per_engine_and_every_shard_summed(doors: list[Snapshot], door: str) -> None:
    final: Scrape = doors[2][door]
    (hit,) = final.find("lmcache_rollup_num_hit_tokens_total")
    assert "worker_id" not in hit.labels and "tp_rank" not in hit.labels
    # Replica A loaded 2560 + 1024 tokens, replica B 512 + 256: 4352, once each.
    assert hit.value == 3584 + 768 == 4352
    assert final.value("lmcache_rollup_num_retrieve_requests_total") == 3 + 2
    assert final.value("lmcache_rollup_num_requested_tokens_total") == (768 + 2048 + 1024) + (512 + 256)
    # Per shard: the sum over all 8 workers of their own bytes and evictions.
    assert final.value("lmcache_rollup_num_remote_read_bytes_total") == expected_bytes(2) == 36 * (1_048_576 + 4_096)
    assert final.value("lmcache_rollup_num_remote_read_requests_total") == 2 * REPLICAS * TP
    assert final.value("lmcache_rollup_local_cpu_evict_count_total") == 2 * REPLICAS * TP
    assert final.value("lmcache_rollup_local_cpu_evict_keys_count_total") == 36 * 11
    assert doors[0][door].value("lmcache_rollup_local_cpu_evict_keys_count_total") == 36


def test_side_by_side_vllms_metrics_summed_over_worker_id_is_tp_times_the_truth(doors: list[Snapshot]) -> None:
    final = doors[2]
    files: Series = final["files"]
    # vLLM's /metrics over the one directory: one series per worker_id, the replicas summed (both doors read that).
    for worker_id in range(TP):
        labels = (("model_name", MODEL), ("role", "worker"), ("served_model_name", SERVED), ("worker_id", str(worker_id)))
        assert files[("lmcache:num_hit_tokens_total", labels)] == 4352
    over_counted = summed(files, "lmcache:num_hit_tokens_total")
    truth = final["directory"].value("lmcache_rollup_num_hit_tokens_total")
    assert over_counted == 17_408 == TP * truth
    assert truth == final["url"].value("lmcache_rollup_num_hit_tokens_total") == 4352
    # Bytes do add up: there the sum over worker_id is the per-shard rollup.
    assert summed(files, "lmcache:num_remote_read_bytes_total") == final["directory"].value(
        "lmcache_rollup_num_remote_read_bytes_total")


def test_reset_counters_in_multiprocess_mode_leaves_the_rollups_as_they_were(doors: list[Snapshot]) -> None:
    before, after_reset, final = doors
    assert after_reset["files"] == before["files"]  # the reset worker's files did not change
    for door in ("directory", "url"):
        assert lmcache_samples(after_reset[door]) == lmcache_samples(before[door])
        assert after_reset[door].value("lmcache_rollup_num_hit_tokens_total") == 3072
        assert after_reset[door].value("lmcache_num_hit_tokens_total", worker_id=str(RESET_WORKER)) == 3072
        assert final[door].value("lmcache_num_hit_tokens_total", worker_id=str(RESET_WORKER)) == 4352
        assert final[door].value("hicache_exporter_upstream_series_resets_total") == 0


def test_vllms_own_families_pass_through_both_doors_unchanged(doors: list[Snapshot]) -> None:
    final = doors[2]
    families = {"vllm:prompt_tokens", "vllm:num_requests_running"}
    upstream = samples(final["engine"], families)
    assert upstream == [
        ("vllm:num_requests_running", (("engine", "0"), ("model_name", SERVED)), 3.0),
        ("vllm:num_requests_running", (("engine", "1"), ("model_name", SERVED)), 1.0),
        ("vllm:prompt_tokens_total", (("engine", "0"), ("model_name", SERVED)), 9000.0),
        ("vllm:prompt_tokens_total", (("engine", "1"), ("model_name", SERVED)), 1500.0),
    ]
    for door in ("directory", "url"):
        assert samples(final[door].text, families) == upstream


# --- LMCache's internal API server: its in-process REGISTRY, where a reset does drop the counters ---


def api_server_worker(port: int, commands: Any, conn: Any) -> None:
    """One worker whose values are in-process (the directory unset at import), served as LMCache's internal
    API server serves them: GET /metrics is generate_latest(REGISTRY), POST /metrics/reset resets."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prometheus_client import REGISTRY, generate_latest

    from tests.upstream_lmcache import install

    assert "PROMETHEUS_MULTIPROC_DIR" not in os.environ
    lmcache = install()
    # _ensure_multiprocess_dir (observability.py:909-915) would set /tmp/lmcache_prometheus: a stand-in, too late to matter.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = commands.recv()
    logger = lmcache.PrometheusLogger.GetOrCreate(metadata(lmcache, 0))
    monitor = lmcache.LMCStatsMonitor.GetOrCreate()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = generate_latest(REGISTRY)  # metrics_api.py:14-20
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while (command := commands.recv()) != "stop":
        if command == "reset":
            lmcache.reset_observability_metrics()  # what POST /metrics/reset calls (metrics_api.py:23-29)
        else:
            count(monitor, logger, RETRIEVES[0][command], READ_BYTES[(0, 0)][command], EVICTIONS[(0, 0)][command])
        conn.send(command)
    server.shutdown()
    conn.send("stopped")


def test_a_counter_that_drops_behind_the_url_is_a_reset_the_rollup_holds_and_counts_on(
        tmp_path: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    port = free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    commands, control = SPAWN.Pipe(duplex=False)
    replies, reply_end = SPAWN.Pipe(duplex=False)
    process = SPAWN.Process(target=api_server_worker, args=(port, commands, reply_end))
    process.start()
    sidecar: Serve | None = None

    def do(command: int | str) -> None:
        control.send(command)
        assert replies.poll(SYNC_TIMEOUT) and replies.recv() == command

    try:
        control.send(str(tmp_path / "unused"))
        do(0)  # interval 0 of replica A: 2560 tokens loaded
        # REGISTRY holds prometheus_client's process_* families too, which the sidecar writes itself: passed
        # through, they stop its start (a clear error); LMCache's families are read either way.
        with pytest.raises(AssertionError, match=(
                r"upstream engine: families \['process_cpu_seconds', .*\] are passed through and are also families "
                r"the sidecar makes \(its rollups, self-metrics and process_\* metrics\); set pass_through: false on "
                r"this upstream\n")):
            Serve(socket_dir / "refused", "--upstream", url, HTTP_PACE, world="tp=1,dp=1")
        sidecar = Serve(socket_dir / "api", "--upstream", url, HTTP_PACE, world="tp=1,dp=1", pass_through=False)
        wait_until(lambda: sidecar.scrape().find("lmcache_rollup_num_hit_tokens_total") != [], timeout=SETTLE)
        first = sidecar.scrape()
        assert first.value("lmcache_rollup_num_hit_tokens_total") == 2560
        assert first.value("lmcache_rollup_num_remote_read_bytes_total") == 1_048_576
        assert http_get(url)[1].decode().count("lmcache:num_hit_tokens_total{") == 1

        do("reset")  # the in-process counters fall to 0
        assert "lmcache:num_hit_tokens_total{" in http_get(url)[1].decode()
        assert samples(http_get(url)[1].decode(), {"lmcache:num_hit_tokens"})[0][2] == 0.0
        wait_until(lambda: sidecar.scrape().total("hicache_exporter_upstream_series_resets_total") > 0, timeout=SETTLE)
        sidecar.read_again()
        held = sidecar.scrape()
        assert held.value("lmcache_rollup_num_hit_tokens_total") == 2560  # not 0: the drop is a reset
        assert held.value("lmcache_rollup_num_remote_read_bytes_total") == 1_048_576
        # Every counter and histogram of the worker fell at once: read as an engine restart, its rank starts a
        # new epoch and its per-rank series start again from the engine's values (feed.py's docstring).
        assert held.value("lmcache_num_hit_tokens_total", worker_id="0") == 0
        assert held.value("hicache_exporter_rank_restarts_total", tp_rank="0") == 1

        do(1)  # interval 1: 1024 more tokens, on top of what the reset left (0)
        wait_until(lambda: sidecar.scrape().value("lmcache_rollup_num_hit_tokens_total") != 2560, timeout=SETTLE)
        final = sidecar.scrape()
        assert samples(http_get(url)[1].decode(), {"lmcache:num_hit_tokens"})[0][2] == 1024.0
        assert final.value("lmcache_rollup_num_hit_tokens_total") == 2560 + 1024
        assert final.value("lmcache_rollup_num_remote_read_bytes_total") == 1_048_576 + 4_096
        assert final.value("lmcache_rollup_num_retrieve_requests_total") == 3
        assert final.value("lmcache_num_hit_tokens_total", worker_id="0") == 1024
        control.send("stop")
        assert replies.poll(SYNC_TIMEOUT) and replies.recv() == "stopped"
    finally:
        if sidecar is not None:
            sidecar.stop()
        process.join(SYNC_TIMEOUT)
        if process.exitcode is None:
            process.kill()
            process.join()
    assert process.exitcode == 0
