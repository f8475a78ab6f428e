"""Scrape: /metrics latency of the sidecar against prometheus_client's MultiProcessCollector.

    python -m bench.scrape [--ranks 16,64,128,256] [--repeats 100] [--budget 6] [--json FILE] [--plot FILE]

Sidecar: a real `serve` process fed over its Unix socket by raw-protocol ranks, each holding the
full catalog (every family and label set with a value: 39 series, 156 sample lines per rank).
Before each timed GET every rank pushes a new snapshot with every value moved, and the bench
waits (on /api/v1/ranks, untimed) until the sidecar has applied them all: as between two real
scrapes, whose interval (15 s or more) exceeds the 1 s push interval, so nothing rendered for the
previous scrape can be reused. Latency is client-side: HTTP request to the last byte of the body,
over a kept-alive connection. The JSON rows also carry `unchanged_p50_ms`: scrapes with no push
in between (the best case, when the sidecar can reuse what it rendered).

Anchor: in a subprocess with PROMETHEUS_MULTIPROC_DIR set before prometheus_client is imported,
one forked process per rank creates the same series (Counter, Gauge with
multiprocess_mode="livesum", Histogram with the catalog's buckets; labels tp_rank, pp_rank,
dp_rank, cache_type plus the family's own), gives every one a value and exits, leaving its .db
files. `generate_latest(registry)` with a MultiProcessCollector over a directory holding the first
N processes' files is timed in a long-lived worker interpreter (in-process, no HTTP, which favours
the anchor). For each rank count the two contenders' scrapes alternate, one each in turn, so that
the machine's noise at any moment hits both alike.

The scrape as Prometheus asks for it: Prometheus sends `Accept-Encoding: gzip`, and the sidecar then
gzips its body at GZIP_LEVEL. The "gzip" rows time that GET (the gzipped body to its last byte, not
inflated) against `generate_latest` plus `gzip.compress` at the same level in the anchor's worker.
The four scrapes (plain and gzip, each contender) take turns in the same loop.

Each rank count gets `repeats` timed scrapes per contender, fewer when scrapes are slow, so that
the four take about 4 x `budget` seconds together (never fewer than 7 each). p99 is nearest-rank: with fewer than
100 samples it is the slowest scrape.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exporter.catalog import MetricType, default_catalog

from bench.common import (
    NAMESPACE,
    REPO_ROOT,
    STATIC_LABELS,
    RawRank,
    Sidecar,
    advance,
    child_env,
    label_sets,
    percentile,
    progress_printer,
    rank_id,
    series_count,
)
from bench.report import print_table, row

GOAL_SPEEDUP = 20.0
GOAL_RANKS = (64, 256)
GZIP_GOAL_RANKS = (64,)
MIN_REPEATS = 7
# The sidecar's level for gzipped responses (`_negotiated` in exporter/sidecar/http/app.py);
# tests/bench/test_bench_smoke.py recompresses a sidecar body at this level and compares.
GZIP_LEVEL = 1
GZIP_HEADERS = {"Accept-Encoding": "gzip"}  # what a Prometheus server sends on every scrape


def gzip_body(body: bytes) -> bytes:
    """`body` gzipped as the sidecar gzips a /metrics body."""
    return gzip.compress(body, compresslevel=GZIP_LEVEL)


def _reps(first_s: float, repeats: int, budget_s: float) -> int:
    return max(min(repeats, MIN_REPEATS), min(repeats, int(budget_s / max(first_s, 1e-6))))


# --- the anchor: MultiProcessCollector over real processes' files ---

def _mp_rank_process(index: int) -> None:
    """Runs in a forked child: create the full catalog as prometheus_client metrics, give values, exit."""
    from prometheus_client import Counter, Gauge, Histogram

    rng = random.Random(index)
    rank = {k: str(v) for k, v in rank_id(index).items()}
    base = {**rank, **STATIC_LABELS}
    for spec in default_catalog():
        names = [*base, *spec.labels]
        name = NAMESPACE + spec.name
        if spec.type is MetricType.COUNTER:
            metric: Any = Counter(name, spec.help, names, registry=None)
        elif spec.type is MetricType.GAUGE:
            metric = Gauge(name, spec.help, names, registry=None, multiprocess_mode="livesum")
        else:
            metric = Histogram(name, spec.help, names, registry=None, buckets=spec.buckets)
        for labels in label_sets(spec):
            advance(spec, metric.labels(**base, **labels), rng)  # prometheus_client children share the API


def _mp_prepare(root: str, counts: list[int], progress: bool) -> None:
    """Runs in a subprocess whose PROMETHEUS_MULTIPROC_DIR is `root`/all: fork the rank processes,
    then give each rank count N a directory `root`/ranks_N holding (hard links to) the first N's files."""
    say = progress_printer(progress, "scrape/multiprocess")
    import prometheus_client

    all_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    assert prometheus_client.values.ValueClass.__name__ != "MutexValue", "not in multiprocess mode"
    total = max(counts)
    say(f"forking {total} rank processes that write their .db files ...")
    pids: list[int] = []
    running: set[int] = set()
    for index in range(total):
        while len(running) >= 8:
            pid, status = os.wait()
            running.discard(pid)
            if status:
                raise RuntimeError(f"a rank process failed with status {status}")
        pid = os.fork()
        if pid == 0:  # the rank process
            code = 0
            try:
                _mp_rank_process(index)
            except BaseException:  # noqa: BLE001 - report and exit, never return into the parent's code
                import traceback
                traceback.print_exc()
                code = 1
            os._exit(code)
        pids.append(pid)
        running.add(pid)
    for pid in running:
        _, status = os.waitpid(pid, 0)
        if status:
            raise RuntimeError(f"a rank process failed with status {status}")
    files = {pid: sorted(all_dir.glob(f"*_{pid}.db")) for pid in pids}
    if any(len(found) != 3 for found in files.values()):
        raise RuntimeError("each rank process should leave counter, gauge_livesum and histogram files")
    for count in counts:
        sub = Path(root) / f"ranks_{count}"
        sub.mkdir()
        for pid in pids[:count]:
            for path in files[pid]:
                os.link(path, sub / path.name)


def _mp_serve() -> None:
    """Runs in a subprocess whose PROMETHEUS_MULTIPROC_DIR is one ranks_N directory: one timed scrape
    per "scrape" line on stdin (render, then gzip at the sidecar's level for "scrape-gzip"), its seconds
    on stdout; "info" prints the body's size, plain and gzipped, as JSON."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # reads PROMETHEUS_MULTIPROC_DIR, as an engine's /metrics handler does
    for line in sys.stdin:
        command = line.strip()
        if command == "info":
            body = generate_latest(registry)
            print(json.dumps({"series": series_count(body.decode()), "bytes": len(body),
                              "gzip_bytes": len(gzip_body(body)),
                              "files": len(os.listdir(os.environ["PROMETHEUS_MULTIPROC_DIR"]))}), flush=True)
        elif command == "scrape-gzip":
            started = time.perf_counter()
            gzip_body(generate_latest(registry))
            print(time.perf_counter() - started, flush=True)
        else:
            started = time.perf_counter()
            generate_latest(registry)
            print(time.perf_counter() - started, flush=True)


class AnchorWorker:
    """A `_mp_serve` subprocess: scrapes on request, so that its scrapes interleave with the sidecar's."""

    def __init__(self, multiproc_dir: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.scrape", "--mp-serve"],
                                     env=child_env(PROMETHEUS_MULTIPROC_DIR=str(multiproc_dir)), cwd=REPO_ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def _ask(self, command: str) -> str:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"the multiprocess anchor exited (code {self.proc.wait()})")
        return answer

    def scrape(self, gzipped: bool = False) -> float:
        return float(self._ask("scrape-gzip" if gzipped else "scrape"))

    def info(self) -> dict[str, Any]:
        return json.loads(self._ask("info"))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _mp_subprocess(args: list[str], multiproc_dir: Path, progress: bool) -> str:
    proc = subprocess.run([sys.executable, "-m", "bench.scrape", *args] + ([] if progress else ["--quiet"]),
                          env=child_env(PROMETHEUS_MULTIPROC_DIR=str(multiproc_dir)), cwd=REPO_ROOT,
                          stdout=subprocess.PIPE, text=True, timeout=900)
    if proc.returncode:
        raise RuntimeError(f"the multiprocess anchor failed (exit {proc.returncode}): {args}")
    return proc.stdout


# --- the sidecar ---

class SidecarStages:
    """One sidecar, fed rank by rank: `connect(count)` brings it to `count` ranks, `scrape_changed()`
    times a scrape after every rank has pushed (asking for gzip if told), `scrape_unchanged()` one
    with nothing pushed since."""

    def __init__(self, sidecar: Sidecar, say: Any) -> None:
        self.sidecar = sidecar
        self.say = say
        self.ranks: list[RawRank] = []
        self.pushed = 0

    def _push_all(self) -> None:
        for rank in self.ranks:
            rank.push()
        self.pushed += len(self.ranks)

    def connect(self, count: int) -> dict[str, Any]:
        """Connect ranks up to `count`, push once, scrape; the body's size (plain and gzipped), and how
        long a round takes."""
        self.say(f"sidecar: connecting ranks {len(self.ranks)}..{count - 1} and pushing full snapshots ...")
        while len(self.ranks) < count:
            self.ranks.append(RawRank(self.sidecar.socket_path, len(self.ranks)))
        started = time.perf_counter()
        latency = self.scrape_changed()
        text = self.sidecar.get().decode()
        return {"series": series_count(text), "bytes": len(text), "round_s": time.perf_counter() - started - latency,
                "gzip_bytes": len(self.sidecar.get(headers=GZIP_HEADERS))}

    def scrape_changed(self, gzipped: bool = False) -> float:
        # Between two scrapes every rank has pushed (a scrape interval >= the push interval), and the
        # sidecar has applied it all (untimed): the timed scrape renders every rank's changed values.
        self._push_all()
        self.sidecar.wait_applied(self.pushed)
        started = time.perf_counter()
        body = self.sidecar.get(headers=GZIP_HEADERS if gzipped else None)
        elapsed = time.perf_counter() - started
        if gzipped and body[:2] != b"\x1f\x8b":  # a plain body here would time the wrong thing
            raise RuntimeError("the sidecar answered a scrape that accepts gzip with a body that is not gzip")
        return elapsed

    def scrape_unchanged(self) -> float:
        started = time.perf_counter()
        self.sidecar.get()
        return time.perf_counter() - started

    def close(self) -> None:
        for rank in self.ranks:
            rank.close()


def measure(counts: list[int], repeats: int, budget_s: float, progress: bool
            ) -> tuple[dict[int, dict[str, Any]], dict[int, dict[str, Any]]]:
    """(sidecar, multiprocess) results per rank count. The two contenders' scrapes alternate, one
    each in turn, so that the machine's noise at any moment hits a figure and its anchor alike."""
    say = progress_printer(progress, "scrape")
    counts = sorted(counts)
    root = Path(tempfile.mkdtemp(prefix="hcb-mpdir-", dir="/tmp" if os.path.isdir("/tmp") else None))
    side: dict[int, dict[str, Any]] = {}
    mp: dict[int, dict[str, Any]] = {}
    try:
        (root / "all").mkdir()
        _mp_subprocess(["--mp-prepare", str(root), "--ranks", ",".join(map(str, counts))], root / "all", progress)
        with Sidecar() as sidecar:
            stages = SidecarStages(sidecar, say)
            try:
                for count in counts:
                    anchor = AnchorWorker(root / f"ranks_{count}")
                    try:
                        shape = stages.connect(count)
                        info = anchor.info()
                        first = (anchor.scrape() + stages.scrape_changed() + anchor.scrape(gzipped=True)
                                 + stages.scrape_changed(gzipped=True) + 2 * shape["round_s"])
                        reps = _reps(first, repeats, 4 * budget_s)
                        say(f"{count} ranks: timing {reps} scrapes each, plain and gzip, alternating the "
                            f"multiprocess anchor ({info['files']} files) and the sidecar (every rank pushing "
                            f"before each) ...")
                        anchor_latencies, latencies, anchor_gzip, side_gzip = [], [], [], []
                        for _ in range(reps):
                            anchor_latencies.append(anchor.scrape())
                            latencies.append(stages.scrape_changed())
                            anchor_gzip.append(anchor.scrape(gzipped=True))
                            side_gzip.append(stages.scrape_changed(gzipped=True))
                        unchanged = [stages.scrape_unchanged() for _ in range(min(10, reps))]
                    finally:
                        anchor.close()
                    mp[count] = {"latencies": anchor_latencies, "gzip_latencies": anchor_gzip, **info}
                    side[count] = {"latencies": latencies, "gzip_latencies": side_gzip, "unchanged": unchanged,
                                   "series": shape["series"], "bytes": shape["bytes"],
                                   "gzip_bytes": shape["gzip_bytes"]}
                    say(f"{count} ranks: median multiprocess {statistics.median(anchor_latencies) * 1000:.1f} ms, "
                        f"sidecar {statistics.median(latencies) * 1000:.1f} ms; with gzip "
                        f"{statistics.median(anchor_gzip) * 1000:.1f} ms and {statistics.median(side_gzip) * 1000:.1f} ms")
            finally:
                stages.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return side, mp


def run(ranks: tuple[int, ...] = (16, 64, 128, 256), repeats: int = 100, budget_s: float = 6.0,
        goal_ranks: tuple[int, ...] = GOAL_RANKS, gzip_goal_ranks: tuple[int, ...] = GZIP_GOAL_RANKS,
        progress: bool = True) -> list[dict[str, Any]]:
    """Rows for every rank count; the goal is judged at `goal_ranks` (64 and 256), for the gzipped
    scrape at `gzip_goal_ranks` (64); the rest are info."""
    counts = sorted(set(ranks))
    side, mp = measure(counts, repeats, budget_s, progress)
    rows = []
    for count in counts:
        for label, q in (("p50", 50.0), ("p99", 99.0)):
            value = percentile(side[count]["latencies"], q) * 1000
            anchor = percentile(mp[count]["latencies"], q) * 1000
            speedup = anchor / value
            has_goal = count in goal_ranks
            rows.append(row(
                f"scrape {label}: sidecar, {count} ranks", value, "ms",
                f"MultiProcessCollector, {count} processes", anchor, speedup,
                f"ratio >= {GOAL_SPEEDUP:g}" if has_goal else None, (speedup >= GOAL_SPEEDUP) if has_goal else None,
                ratio_means="anchor / value (speed-up)", ranks=count, percentile=label,
                samples=len(side[count]["latencies"]), anchor_samples=len(mp[count]["latencies"]),
                series=side[count]["series"], anchor_series=mp[count]["series"],
                body_bytes=side[count]["bytes"], anchor_body_bytes=mp[count]["bytes"],
                mean_ms=statistics.fmean(side[count]["latencies"]) * 1000,
                unchanged_p50_ms=statistics.median(side[count]["unchanged"]) * 1000,
                anchor_mean_ms=statistics.fmean(mp[count]["latencies"]) * 1000,
            ))
        for label, q in (("p50", 50.0), ("p99", 99.0)):
            value = percentile(side[count]["gzip_latencies"], q) * 1000
            anchor = percentile(mp[count]["gzip_latencies"], q) * 1000
            speedup = anchor / value
            has_goal = count in gzip_goal_ranks
            rows.append(row(
                f"scrape {label}, gzip: sidecar, {count} ranks", value, "ms",
                f"MultiProcessCollector + gzip level {GZIP_LEVEL}, {count} processes", anchor, speedup,
                f"ratio >= {GOAL_SPEEDUP:g}" if has_goal else None, (speedup >= GOAL_SPEEDUP) if has_goal else None,
                ratio_means="anchor / value (speed-up)", ranks=count, percentile=f"{label}-gzip",
                gzip_level=GZIP_LEVEL, samples=len(side[count]["gzip_latencies"]),
                anchor_samples=len(mp[count]["gzip_latencies"]),
                body_bytes=side[count]["gzip_bytes"], anchor_body_bytes=mp[count]["gzip_bytes"],
                mean_ms=statistics.fmean(side[count]["gzip_latencies"]) * 1000,
                anchor_mean_ms=statistics.fmean(mp[count]["gzip_latencies"]) * 1000,
            ))
        if count in goal_ranks:  # the best case, for comparison: nothing pushed since the last scrape
            value = statistics.median(side[count]["unchanged"]) * 1000
            anchor = percentile(mp[count]["latencies"], 50.0) * 1000
            rows.append(row(f"scrape p50: sidecar, {count} ranks, nothing pushed since", value, "ms",
                            f"MultiProcessCollector, {count} processes", anchor, anchor / value, None, None,
                            ratio_means="anchor / value (speed-up)", ranks=count, percentile="p50-unchanged",
                            samples=len(side[count]["unchanged"])))
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> str:
    """Scrape latency (p50, with p99 as a dashed line) against rank count, both contenders, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, dict[int, float]] = {}
    for r in rows:
        if r.get("percentile") not in ("p50", "p99") or "ranks" not in r:
            continue
        series.setdefault(f"sidecar {r['percentile']}", {})[r["ranks"]] = r["value"]
        series.setdefault(f"multiprocess {r['percentile']}", {})[r["ranks"]] = r["anchor_value"]
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=110)
    styles = {"sidecar": ("tab:blue", "o"), "multiprocess": ("tab:red", "s")}
    for name, points in sorted(series.items()):
        who, pct = name.split()
        color, marker = styles[who]
        xs = sorted(points)
        label = ("hicache-exporter sidecar" if who == "sidecar" else "prometheus_client MultiProcessCollector") + f" ({pct})"
        ax.plot(xs, [points[x] for x in xs], color=color, marker=marker, linestyle="-" if pct == "p50" else "--",
                alpha=1.0 if pct == "p50" else 0.6, label=label)
    side_p50, mp_p50 = series.get("sidecar p50", {}), series.get("multiprocess p50", {})
    for x in sorted(side_p50):
        if x in mp_p50:
            ax.annotate(f"{mp_p50[x] / side_p50[x]:.0f}x", (x, side_p50[x]), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=8, color="tab:blue")
    ax.set_xlabel("ranks (full catalog each: 39 series, 156 sample lines)")
    ax.set_ylabel("/metrics latency (ms, log scale)")
    ax.set_yscale("log")
    lowest = min((v for points in series.values() for v in points.values()), default=1.0)
    ax.set_ylim(bottom=lowest / 2)  # room for the speed-up labels under the sidecar's points
    counts = sorted({x for points in series.values() for x in points})
    ax.set_xticks(counts)
    ax.grid(True, which="both", alpha=0.3)
    ax.set_title("Scrape latency vs rank count (labels: p50 speed-up of the sidecar)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="16,64,128,256", help="comma-separated rank counts")
    parser.add_argument("--repeats", type=int, default=100, help="timed scrapes per contender and rank count (at most)")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of scraping per contender and rank count")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    parser.add_argument("--plot", help="also plot latency against rank count to this PNG")
    parser.add_argument("--mp-prepare", help=argparse.SUPPRESS)
    parser.add_argument("--mp-serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quiet", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    counts = [int(c) for c in args.ranks.split(",") if c]
    if args.mp_prepare:
        _mp_prepare(args.mp_prepare, counts, not args.quiet)
        return 0
    if args.mp_serve:
        _mp_serve()
        return 0
    rows = run(tuple(counts), args.repeats, args.budget)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    if args.plot:
        plot(rows, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
