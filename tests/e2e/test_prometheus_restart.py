"""End to end with a real Prometheus: it scrapes a sidecar (`--persistence.file`) that is killed with
SIGKILL and started again on its state file mid-run, and `increase()` of a rollup over a window
holding the restart equals the truth, with no restart guard in the query.

The window also holds a restart of a whole dp group (new epochs) before the kill, whose ended
epochs only the file brings back, and a scrape of the new sidecar before any rank is back (the
ranks reach it only once Prometheus has scraped it).

How the truth is made exact: increase() extrapolates from the first and last samples in the range to
the range's edges, so over an arbitrary window it is the samples' rise times a factor a little above
one. Here the window is chosen from the samples themselves: it ends at a sample's timestamp (the
evaluation time) and starts at an earlier sample's timestamp (the range is closed at both ends in
Prometheus 2.x), so there is nothing to extrapolate and increase() is exactly the last sample less
the first, plus whatever it reads as counter resets. The ranks' values stand still around both
samples, so those samples' values are known from what the ranks pushed, and the truth is the
rise of those values.

With a state file the sidecar shows the rollups as of its last save (a SIGKILL then never brings
back lower than a scrape saw), so they lag the ranks by up to the persistence interval (200 ms
here) plus a write: each settled point is found by polling until the sidecar shows, and then
Prometheus holds, the true values, never by waiting a fixed time. Scrapes in between read lagging
values, which only rise: the window's endpoints stay exact.

A sidecar that came back lower (absent rollups, or rollups started over) would add a reset:
increase() would read more than the truth, and resets() would not be 0; one that came back
without them would leave successful scrapes without the rollup (count_over_time).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.e2e.test_prometheus import Prometheus
from tests.exporter.sidecar.durable.restart_support import (
    WAIT,
    Key,
    PushedRank,
    SidecarProcess,
    close_all,
    per_rank,
    ranks_by_state,
    reroute,
    rollups,
    truth,
    wait_saved_values,
)
from tests.helpers import free_port, http_get, wait_until

TOKENS = "sglang_rollup_load_back_tokens_total"
BYTES = "sglang_rollup_load_back_bytes_total"
COUNT = "sglang_rollup_load_back_duration_seconds_count"
SERIES = (TOKENS, BYTES, COUNT)
# (tp, dp) -> tokens per step, bytes per step, seconds per observation: skewed replicas.
RESTARTED_DP0 = {(0, 0): (2, 1024, 0.0625), (1, 0): (9, 512, 0.25)}  # the skew turned round
STEPS = {(0, 0): (7, 4096, 0.25), (1, 0): (5, 2048, 0.0625), (0, 1): (3, 4097, 0.25), (1, 1): (11, 2049, 0.0625)}


def by_name(values: dict[Key, float]) -> dict[str, float]:
    return {name: sum(v for (n, _), v in values.items() if n == name) for name in SERIES}


def step(ranks: dict[tuple[int, int], PushedRank], times: int) -> None:
    for rank in ranks.values():
        for _ in range(times):
            rank.step()


def last_sample(prom: Prometheus, name: str) -> tuple[int, float] | None:
    """The newest sample Prometheus holds of the rollup `name`: (its timestamp in ms, its value)."""
    result = prom.query(f"{name}[5s]")
    if not result:
        return None
    assert len(result) == 1, result
    stamp, value = result[0]["values"][-1]
    return round(float(stamp) * 1000), float(value)


def scraped(prom: Prometheus, sidecar: SidecarProcess, ranks: dict[tuple[int, int], PushedRank]) -> dict[str, int]:
    """Once the sidecar serves every rank's values, wait until Prometheus holds a sample of each rollup at its
    true value; those samples' timestamps (ms)."""
    want = by_name(truth(ranks.values()))
    # The ranks' own series are live; the rollups are the last save's (every 200 ms): polled until a save has them.
    wait_until(lambda: per_rank(sidecar.scrape() or "", "sglang_load_back_tokens_total") == {
        k: float(r.current.tokens) for k, r in ranks.items()} and by_name(rollups(sidecar.scrape() or "")) == want, WAIT)
    found: dict[str, int] = {}

    def holds() -> bool:
        for name in SERIES:
            sample = last_sample(prom, name)
            if sample is None or sample[1] != want[name]:
                return False
            found[name] = sample[0]
        return True

    wait_until(holds, WAIT)
    return found


def test_increase_over_a_window_holding_a_sidecar_sigkill_equals_the_truth_with_no_guard(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any]) -> None:
    sidecar = SidecarProcess(free_port(), str(socket_dir / "metrics.sock"), tmp_path / "state.bin",
                             tmp_path / "sidecar.log").start()
    cleanup.append(sidecar.stop)
    sidecar.wait_ready()
    prom = Prometheus(tmp_path, f"127.0.0.1:{sidecar.port}", [])
    cleanup.append(prom.stop)
    ranks = {key: PushedRank(sidecar.socket_path, *key).begin(*steps) for key, steps in STEPS.items()}
    cleanup.append(lambda: close_all(ranks.values()))

    step(ranks, 10)
    first = scraped(prom, sidecar, ranks)  # the window starts at these samples
    start = by_name(truth(ranks.values()))

    # dp group 0 restarts as a whole (new epochs): from now on the rollups hold counts of ended epochs,
    # which only the file brings back (a sidecar without it would start lower: a reset).
    for tp in (0, 1):
        ranks[(tp, 0)].current.client.close()
    wait_until(lambda: ranks_by_state(sidecar.scrape() or "").get("departed") == 2, WAIT)
    for key, steps in RESTARTED_DP0.items():
        ranks[key].begin(*steps)
    # Counting goes on; the values stand still once the file holds them, and the sidecar is killed.
    step(ranks, 5)
    scraped(prom, sidecar, ranks)
    wait_saved_values(sidecar.state_file, ranks)
    sidecar.kill()
    wait_until(lambda: prom.scalar('up{job="hicache"}') == 0, WAIT)  # Prometheus saw it down
    step(ranks, 3)  # the ranks count while it is down (each keeps its epoch: it reconnects)
    # The new sidecar listens on another socket, which the ranks reach only once Prometheus has scraped
    # it: its rollups as taken back from the file, before any rank is back, are in the window.
    ranks_socket = sidecar.socket_path
    sidecar.socket_path = str(socket_dir / "after.sock")
    sidecar.start()
    sidecar.wait_ready()
    wait_until(lambda: prom.scalar('up{job="hicache"}') == 1, WAIT)
    assert prom.scalar('hicache_exporter_ranks{state="live"}') == 0
    reroute(ranks_socket, sidecar.socket_path)
    step(ranks, 4)
    last = scraped(prom, sidecar, ranks)  # the window ends at these samples
    end = by_name(truth(ranks.values()))

    version = json.loads(http_get(prom.url + "/api/v1/status/buildinfo")[1])["data"]["version"]
    assert version.startswith("2."), f"Prometheus {version}: the window below relies on 2.x's ranges, closed at both ends"
    for name in SERIES:
        window = f"{last[name] - first[name]}ms"
        at = last[name] / 1000
        # Every scrape that succeeded in the window has the rollup: it was never absent.
        assert prom.scalar(f"count_over_time({name}[{window}])", at) == prom.scalar(f"sum_over_time(up[{window}])", at)
        # The restart is inside the window, and so is a scrape of the new sidecar before any rank was back.
        assert prom.scalar(f'min_over_time(up{{job="hicache"}}[{window}])', at) == 0
        assert prom.scalar(f'min_over_time(hicache_exporter_ranks{{state="live"}}[{window}])', at) == 0
        assert prom.scalar(f"resets({name}[{window}])", at) == 0
        assert prom.scalar(f"increase({name}[{window}])", at) == end[name] - start[name], name
