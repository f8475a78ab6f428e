"""Load test on loopback: N rank connections push the full catalog at 1 Hz while a scraper reads
/metrics S times a second; reports lost snapshots, scrape latency, sidecar CPU and RSS.

    python -m bench.load [--ranks 256] [--seconds 60] [--scrapes-per-second 10] [--json FILE]

Bounded: it stops by itself after --seconds, and talks only to a sidecar it starts on 127.0.0.1.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from exporter.catalog import MetricType, default_catalog

from bench.common import free_port

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _proc_usage(pid: int) -> tuple[float, int]:
    """(CPU seconds used, RSS bytes) of a process, from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    with open(f"/proc/{pid}/status") as handle:
        rss_kb = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
    return cpu, rss_kb * 1024


def _rank_group(socket_path: str, first: int, count: int, seconds: float, interval: float, results: Any) -> None:
    """One process holding `count` rank clients, each incrementing every family, pushing every interval."""
    from exporter.client import RankClient

    catalog = default_catalog()
    clients = []
    for index in range(first, first + count):
        client = RankClient(socket_path, rank={"tp_rank": index % 8, "pp_rank": (index // 8) % 4, "dp_rank": index // 32},
                            labels={"cache_type": "HiRadixCache"}, interval=interval, max_backoff=1.0)
        clients.append(client)
    children = []
    for client in clients:
        for spec in catalog:
            labels = {name: "kv" if name == "pool" else "host_pressure" for name in spec.labels}
            children.append((spec.type, client.metrics.child(spec.name, labels)))
    for client in clients:
        client.start()
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for kind, child in children:
            if kind is MetricType.HISTOGRAM:
                child.observe(0.003)  # type: ignore[union-attr]
            elif kind is MetricType.GAUGE:
                child.set(512)  # type: ignore[union-attr]
            else:
                child.inc(16)  # type: ignore[union-attr]
        time.sleep(0.1)
    for client in clients:
        client.close()
    results.put([(c.stats.snapshots_sent, c.stats.failures) for c in clients])


def _scraper(url: str, per_second: float, stop: threading.Event, latencies: list[float], failures: list[str]) -> None:
    period = 1.0 / per_second
    next_at = time.monotonic()
    while not stop.is_set():
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                response.read()
                if response.status != 200:
                    failures.append(str(response.status))
        except OSError as err:
            failures.append(repr(err))
        latencies.append(time.perf_counter() - started)
        next_at += period
        time.sleep(max(0.0, next_at - time.monotonic()))


def _metric(url: str, name: str) -> float:
    with urllib.request.urlopen(url, timeout=10) as response:
        for line in response.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def run(ranks: int, seconds: float, scrapes_per_second: float, interval: float = 1.0, progress: bool = True) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="hicache-load-"))
    sock, port = str(workdir / "metrics.sock"), free_port()
    sidecar = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                                "--socket", sock, "--log-level", "warning"])
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/-/ready", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the sidecar did not become ready") from None
                time.sleep(0.1)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        groups = max(1, min(4, ranks // 32))
        per_group = [ranks // groups + (1 if i < ranks % groups else 0) for i in range(groups)]
        procs, first = [], 0
        for count in per_group:
            procs.append(ctx.Process(target=_rank_group, args=(sock, first, count, seconds, interval, results)))
            first += count
        cpu_before, _ = _proc_usage(sidecar.pid)
        for proc in procs:
            proc.start()
        stop, latencies, failures = threading.Event(), [], []
        scraper = threading.Thread(target=_scraper, args=(url, scrapes_per_second, stop, latencies, failures), daemon=True)
        scraper.start()
        started, rss_peak = time.monotonic(), 0
        while any(p.is_alive() for p in procs):
            time.sleep(1.0)
            rss_peak = max(rss_peak, _proc_usage(sidecar.pid)[1])
            if progress:
                print(f"  load: {time.monotonic() - started:5.1f}/{seconds:.0f} s, {len(latencies)} scrapes, "
                      f"RSS {rss_peak / 2**20:.0f} MiB", file=sys.stderr, flush=True)
        stop.set()
        scraper.join(15)
        elapsed = time.monotonic() - started
        cpu_after, rss = _proc_usage(sidecar.pid)
        sent = [pair for _ in procs for pair in results.get(timeout=30)]
        for proc in procs:
            proc.join(10)
        snapshots_sent = sum(s for s, _ in sent)
        applied = _metric(url, "hicache_exporter_snapshots_applied_total")
        ordered = sorted(latencies)
        return {
            "ranks": ranks, "seconds": round(elapsed, 1), "push_interval_s": interval,
            "snapshots_sent": snapshots_sent, "snapshots_applied": int(applied),
            "lost_snapshots": snapshots_sent - int(applied),
            "client_push_failures": sum(f for _, f in sent),
            "scrapes": len(latencies), "scrape_failures": len(failures),
            "scrape_p50_ms": round(statistics.median(ordered) * 1000, 2) if ordered else None,
            "scrape_p99_ms": round(ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] * 1000, 2) if ordered else None,
            "sidecar_cpu_percent": round((cpu_after - cpu_before) / elapsed * 100, 1),
            "sidecar_rss_mib": round(max(rss, rss_peak) / 2**20, 1),
        }
    finally:
        sidecar.send_signal(signal.SIGTERM)
        try:
            sidecar.wait(20)
        except subprocess.TimeoutExpired:
            sidecar.kill()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--scrapes-per-second", type=float, default=10)
    parser.add_argument("--json", help="also write the result as JSON to this file")
    args = parser.parse_args(argv)
    result = run(args.ranks, args.seconds, args.scrapes_per_second)
    for key, value in result.items():
        print(f"{key:>22}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["lost_snapshots"] == 0 and result["scrape_failures"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
