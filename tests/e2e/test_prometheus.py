"""End to end with a real Prometheus: it scrapes a running sidecar fed by rank processes, with the
shipped recording rules loaded; one rank is killed and restarted mid-run.

Asserted through the Prometheus HTTP API: the sidecar's rollups and the recording rules agree
with the per-rank series, rollups never reset, and tokens are read once per dp group. A sidecar
with the engine's namespace (`sglang:`) runs with the rules and dashboard generated for it, and
the dashboard's fleet panels (recording rules) and pod panels (the sidecar's rollups) read the
same numbers for a server that fits in one pod.
"""

from __future__ import annotations

import json
import multiprocessing
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from config.generator import outputs
from tests.helpers import free_port, http_get, wait_ready, wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = REPO / "config" / "prometheus" / "recording_rules.yml"
TOKENS_PER_TICK = 64
TICK_SECONDS = 0.05
BYTES_PER_TOKEN = {0: 3072, 1: 2048}  # by tp_rank: the shards differ in size
# Prometheus scrapes and evaluates every SCRAPE_SECONDS, and the ranks push twice as often. Every
# span below is counted in those intervals: with 1 s ones they took 60 s and 70 s of waiting.
SCRAPE_SECONDS = 0.5
WINDOW = f"{40 * SCRAPE_SECONDS:g}s"  # within SETTLED_SECONDS: the series' samples cover the window from its start
# rate() and increase() extrapolate each series from its first and last samples in the range, and
# a rule runs before the samples of a scrape in flight are in: two sides of a comparison differ by
# up to about three scrape intervals of counting, whatever the instant. Compared once the series
# hold 60 intervals of samples, that is under 5 %, inside the 10 % the tests allow; the issue's
# flake compared them after 6 intervals (35.99 against 32.62).
SETTLED_SECONDS = 60 * SCRAPE_SECONDS


def rank_process(socket_path: str, tp: int, dp: int) -> None:
    """A rank counting tokens at a steady rate, its replica doing the same; killed from outside."""
    from exporter.client import RankClient

    client = RankClient(socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": dp},
                        labels={"cache_type": "HiRadixCache"}, interval=SCRAPE_SECONDS / 2, max_backoff=0.5)
    tokens = client.counter("load_back_tokens_total", pool="kv")
    moved = client.counter("load_back_bytes_total")
    duration = client.histogram("load_back_duration_seconds")
    client.start()
    while True:
        tokens.inc(TOKENS_PER_TICK)
        moved.inc(TOKENS_PER_TICK * BYTES_PER_TOKEN[tp])
        duration.observe(0.002)
        time.sleep(TICK_SECONDS)


class Prometheus:
    """A real Prometheus server on loopback with its own TSDB directory."""

    def __init__(self, workdir: Path, target: str, rules: list[Path]) -> None:
        binary = shutil.which("prometheus")
        assert binary, "the prometheus server is required (Debian package `prometheus`; `make test` installs it)"
        self.port = free_port()
        config = {
            "global": {"scrape_interval": f"{SCRAPE_SECONDS * 1000:g}ms",
                       "evaluation_interval": f"{SCRAPE_SECONDS * 1000:g}ms"},
            "rule_files": [str(p) for p in rules],
            "scrape_configs": [{"job_name": "hicache", "static_configs": [{"targets": [target], "labels": {"pod": "pod-a"}}]}],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.proc = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}"],
            stdout=subprocess.DEVNULL, stderr=open(workdir / "prometheus.log", "w"),
        )
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(self._ready, timeout=60)

    def _ready(self) -> bool:
        try:
            return http_get(self.url + "/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """An instant query, evaluated now or at the instant `at` (seconds since the epoch)."""
        params = {"query": expr} if at is None else {"query": expr, "time": f"{at:.3f}"}
        status, body, _ = http_get(self.url + "/api/v1/query?" + urllib.parse.urlencode(params))
        payload = json.loads(body)
        assert status == 200 and payload["status"] == "success", payload
        return payload["data"]["result"]

    def scalar(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, f"{expr}: expected one series, got {result}"
        return float(result[0]["value"][1])

    def evaluated_at(self, recorded: str) -> float:
        """When the recording rule `recorded` last ran: the rule's value and a raw query at that
        instant read the same samples, so they can be compared whatever the ranks do meanwhile."""
        return self.scalar(f"max(timestamp({recorded}))")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@pytest.fixture
def stack(socket_dir: Path, tmp_path: Path) -> Iterator[tuple[Prometheus, str, int]]:
    assert RULES.exists(), f"{RULES} must ship with the repository"
    port = free_port()
    sock = str(socket_dir / "metrics.sock")
    sidecar = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1",
                                "--port", str(port), "--socket", sock], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    prometheus = None
    try:
        wait_ready(sidecar, lambda: _up(f"http://127.0.0.1:{port}/-/ready"))
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{port}", [RULES])
        yield prometheus, sock, port
    finally:
        if prometheus is not None:
            prometheus.stop()
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(20)


def _up(url: str) -> bool:
    try:
        return http_get(url)[0] == 200
    except OSError:
        return False


def test_rollups_and_rules_agree_with_per_rank_series_across_a_rank_restart(stack: tuple[Prometheus, str, int]) -> None:
    prom, sock, _ = stack
    ctx = multiprocessing.get_context("spawn")
    ranks = {(tp, dp): ctx.Process(target=rank_process, args=(sock, tp, dp), daemon=True) for tp in range(2) for dp in range(2)}
    for proc in ranks.values():
        proc.start()
    try:
        # Conditions, not sleeps (a loaded machine scrapes late): every rank scraped 8 times ...
        wait_until(lambda: len(prom.query("sglang_load_back_tokens_total")) == 4, timeout=60)
        first_seen = time.time()
        wait_until(lambda: prom.scalar("min(count_over_time(sglang_load_back_tokens_total[1m]))") >= 8, timeout=60)
        # Kill the leader of dp group 0 mid-frame if it happens to be sending, then start it again (new epoch).
        ranks[(0, 0)].kill()
        ranks[(0, 0)].join(10)
        # ... its departure scraped before it comes back ...
        wait_until(lambda: prom.scalar('max(hicache_exporter_ranks{state="departed"})') == 1, timeout=30)
        ranks[(0, 0)] = ctx.Process(target=rank_process, args=(sock, 0, 0), daemon=True)
        ranks[(0, 0)].start()
        wait_until(lambda: prom.scalar('sum(hicache_exporter_rank_restarts_total{tp_rank="0",dp_rank="0"})') >= 1, timeout=30)
        # ... its reset scraped, and then the rules evaluated over 15 intervals of Prometheus' own clock past
        # it, with every series older than the increase() window (its start covered by samples).
        restarted = 'sglang_load_back_tokens_total{tp_rank="0",dp_rank="0"}'
        wait_until(lambda: prom.scalar(f"resets({restarted}[2m])") >= 1, timeout=30)
        settled = max(time.time() + 15 * SCRAPE_SECONDS, first_seen + SETTLED_SECONDS)
        wait_until(lambda: prom.evaluated_at("cluster:sglang_load_back_tokens:rate5m") >= settled, timeout=120)
        # Every query below is read at one instant, the rules' evaluation: what the ranks count
        # meanwhile cannot move one side of a comparison and not the other.
        at = prom.evaluated_at("cluster:sglang_load_back_tokens:rate5m")

        # The restart is visible as a reset of the per-rank series, never of a rollup.
        assert prom.scalar(f"resets({restarted}[2m])", at) >= 1
        for family in ("load_back_tokens_total", "load_back_bytes_total", "load_back_duration_seconds_count"):
            rollups = prom.query(f"resets(sglang_rollup_{family}[2m])", at)
            assert rollups, f"sglang_rollup_{family} is missing"
            for series in rollups:
                assert float(series["value"][1]) == 0, f"sglang_rollup_{family} went backwards"

        # Bytes: the sidecar's rollup increase equals the sum of per-rank increases. Not exactly:
        # increase() extrapolates each series from its own first sample in the window, and the
        # ranks' series began at different scrapes from the rollup's.
        per_rank_bytes = prom.scalar(f"sum(increase(sglang_load_back_bytes_total[{WINDOW}]))", at)
        rollup_bytes = prom.scalar(f"sum(increase(sglang_rollup_load_back_bytes_total[{WINDOW}]))", at)
        assert per_rank_bytes > 0
        assert rollup_bytes == pytest.approx(per_rank_bytes, rel=0.1)

        # Tokens: one replica per dp group, not the sum of both replicas.
        all_replicas = prom.scalar(f"sum(increase(sglang_load_back_tokens_total[{WINDOW}]))", at)
        one_per_group = prom.scalar(f"sum(max by (dp_rank) (increase(sglang_load_back_tokens_total[{WINDOW}])))", at)
        rollup_tokens = prom.scalar(f"sum(increase(sglang_rollup_load_back_tokens_total[{WINDOW}]))", at)
        assert rollup_tokens == pytest.approx(one_per_group, rel=0.1)
        assert rollup_tokens == pytest.approx(all_replicas / 2, rel=0.1)

        # The shipped recording rules agree with the sidecar's own rollups, read at each rule's
        # instant (a scrape stamped before that instant may land after the rule ran: not exact).
        bytes_at = prom.evaluated_at("cluster:sglang_load_back_bytes:rate5m")
        assert prom.scalar("sum(cluster:sglang_load_back_bytes:rate5m)", bytes_at) == pytest.approx(
            prom.scalar("sum(rate(sglang_rollup_load_back_bytes_total[5m]))", bytes_at), rel=0.1)
        assert prom.scalar("sum(cluster:sglang_load_back_tokens:rate5m)", at) == pytest.approx(
            prom.scalar("sum(rate(sglang_rollup_load_back_tokens_total[5m]))", at), rel=0.1)
        # Bandwidth: a snapshot can fall between a tick's bytes and its duration, hence the 5 %.
        bandwidth = "cluster:sglang_load_back_active_bandwidth_bytes_per_second:ratio_rate5m"
        rule_bw = prom.scalar(f"sum({bandwidth})", prom.evaluated_at(bandwidth))
        expected_bw = sum(BYTES_PER_TOKEN.values()) * TOKENS_PER_TICK / (2 * 0.002)  # bytes per observed second
        assert rule_bw == pytest.approx(expected_bw, rel=0.05)
        sidecar_bw = prom.scalar("sglang_rollup_load_back_active_bandwidth_bytes_per_second", at)
        assert sidecar_bw == pytest.approx(expected_bw, rel=0.05)
    finally:
        for proc in ranks.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def generated_rules(namespace: str, directory: Path) -> list[Path]:
    """The recording and alerting rules generated for `namespace`, written to `directory`."""
    paths = []
    for name in ("recording_rules.yml", "alerting_rules.yml"):
        path = directory / f"{name}"
        path.write_text(outputs(namespace)[f"prometheus/{name}"], encoding="utf-8")
        paths.append(path)
    return paths


@pytest.mark.parametrize("namespace", ["sglang_", "sglang:"])
def test_every_dashboard_expression_parses_in_a_real_prometheus(namespace: str, tmp_path: Path) -> None:
    from tests.deploy.test_grafana import dashboard_expressions

    if namespace == "sglang_":
        rules_files = [RULES, REPO / "config" / "prometheus" / "alerting_rules.yml"]
    else:
        rules_files = generated_rules(namespace, tmp_path)
    prom = Prometheus(tmp_path, "127.0.0.1:9", rules_files)  # the target need not exist to parse
    try:
        expressions = dashboard_expressions(namespace)
        assert len(expressions) >= 10
        for expr in expressions:
            status, body, _ = http_get(prom.url + "/api/v1/query?" + urllib.parse.urlencode({"query": expr}))
            payload = json.loads(body)
            assert status == 200 and payload["status"] == "success", f"{expr}: {payload.get('error')}"
        rules = json.loads(http_get(prom.url + "/api/v1/rules")[1])["data"]["groups"]
        assert {g["name"] for g in rules} >= {"hicache-per-shard", "hicache-replicated", "hicache-exporter"}
        assert all(rule["health"] != "err" for g in rules for rule in g["rules"])
    finally:
        prom.stop()


def test_engine_namespace_rules_and_dashboard_read_the_same_numbers(socket_dir: Path, tmp_path: Path) -> None:
    """Namespace `sglang:`: the generated rules evaluate, and the dashboard's fleet and pod views agree."""
    from tests.deploy.test_grafana import sections, substitute

    namespace = "sglang:"
    port = free_port()
    sock = str(socket_dir / "metrics.sock")
    config = tmp_path / "sidecar.yaml"
    config.write_text(yaml.safe_dump({"metrics": {"namespace": namespace}}), encoding="utf-8")
    sidecar = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(config), "--host",
                                "127.0.0.1", "--port", str(port), "--socket", sock],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    ctx = multiprocessing.get_context("spawn")
    ranks = [ctx.Process(target=rank_process, args=(sock, tp, 0), daemon=True) for tp in range(2)]
    prom = None
    try:
        wait_ready(sidecar, lambda: _up(f"http://127.0.0.1:{port}/-/ready"))
        target = f"127.0.0.1:{port}"
        prom = Prometheus(tmp_path, target, generated_rules(namespace, tmp_path))
        for proc in ranks:
            proc.start()
        wait_until(lambda: bool(prom.query("cluster:sglang:load_back_tokens:rate5m")) and
                   bool(prom.query("cluster:sglang:load_back_active_bandwidth_bytes_per_second:ratio_rate5m")),
                   timeout=60)
        first_seen = time.time()
        wait_until(lambda: prom.evaluated_at("cluster:sglang:load_back_tokens:rate5m") >= first_seen + SETTLED_SECONDS,
                   timeout=SETTLED_SECONDS + 60)
        # Every number below is read at one instant, the tokens rule's last evaluation: two rates read
        # at different instants differ by what the ranks counted between them.
        at = prom.evaluated_at("cluster:sglang:load_back_tokens:rate5m")
        # Tokens: one replica of the dp group, by the rule and by the sidecar.
        assert prom.scalar("sum(cluster:sglang:load_back_tokens:rate5m)", at) == pytest.approx(
            prom.scalar("sum(rate(sglang:rollup_load_back_tokens_total[5m]))", at), rel=0.1)
        assert prom.scalar("sum(cluster:sglang:load_back_tokens:rate5m)", at) == pytest.approx(
            prom.scalar("sum(rate(sglang:load_back_tokens_total[5m]))", at) / 2, rel=0.1)
        # The dashboard, fleet row against pod row, tier by tier, for this one pod.
        panels = {panel["title"]: (row, panel) for row, panel in sections(namespace)}
        _, fleet = panels["Logical tokens/s by tier (one replica per dp group)"]
        _, pod = panels["L2→L1 load-back tokens/s in this pod"]
        fleet_expr = substitute(fleet["targets"][0]["expr"])
        pod_expr = substitute(next(t["expr"] for t in pod["targets"] if "rollup_" in t["expr"]).replace("$instance", target))
        fleet_value = prom.scalar(fleet_expr, at)
        assert fleet_value > 0
        assert prom.scalar(f"sum({pod_expr})", at) == pytest.approx(fleet_value, rel=0.1)
    finally:
        for proc in ranks:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        if prom is not None:
            prom.stop()
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(20)
