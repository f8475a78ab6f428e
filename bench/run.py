"""Run every benchmark, print one table of results and ratios against anchors measured in the same
run, and write them as JSON (plus a PNG of scrape latency against rank count).

    python -m bench.run [--quick] [--only hotpath,scrape,...] [--json FILE] [--plot FILE]
    make bench

Benchmarks, in order (each module also runs alone: `python -m bench.<name> --help`):
  hotpath    ns per increment through the client library vs prometheus_client (plain, multiprocess)
  scrape     /metrics latency of the sidecar vs MultiProcessCollector, 16..256 ranks, plain and
             with Accept-Encoding: gzip (vs the anchor's body gzipped at the sidecar's level)
  ingest     full-catalog snapshots per second the sidecar state applies, on one core
  proxy      CPU per upstream read against prometheus_client's parser (SGLang 16..256 ranks, and LMCache
             8 engines x TP 8 as vLLM's /metrics serves it)
  status_api /api/v1/status and the status page at 256 ranks, against the /metrics render (<= 50 ms)
  memory     sidecar RSS holding 256 ranks x the full catalog
  proxy_memory  sidecar peak RSS under the worst upstream answers the proxy's caps allow
  label_memory  sidecar peak RSS with the series budget full of labels as long as their weight, or the
             label limits, allow (vs the same budget full of short labels; goal: within the pod's 320 Mi)
  freshness  increment-to-/metrics latency at the 1 s push interval
  persistence  CPU per save of the durable state, its file's bytes per series, and start-to-ready on a
             file, at 64 and 256 ranks (vs pickle of the same state; vs the same start without a file)
  state_load peak RSS of a process loading the worst state files the limits allow, and files past them
             (vs the same process with no file; goal: within the pod's 320 Mi)
  transfer   cache_core page copies vs a plain torch copy (bench/transfer.py)

Bounded: about 5 minutes on 2 cores (well under a minute with --quick). Progress goes to stderr.
Goals not met are reported, not fatal; the exit status is 1 only when a benchmark failed to run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import REPO_ROOT
from bench.report import markdown_table, print_table, row

RESULTS = REPO_ROOT / "bench" / "results"
ORDER = ("hotpath", "scrape", "ingest", "proxy", "status_api", "memory", "proxy_memory", "label_memory", "freshness",
         "persistence", "state_load", "transfer")

# Parameters per profile: the full run fits in about 5 minutes on 2 cores; quick is a sanity pass;
# smoke is what the test suite runs (tiny, seconds).
PROFILES: dict[str, dict[str, dict[str, Any]]] = {
    "full": {
        "hotpath": {"number": 100_000, "repeat": 5, "rounds": 2},
        "scrape": {"ranks": (16, 64, 128, 256), "repeats": 100, "budget_s": 6.0},
        "ingest": {"ranks": (64, 256), "snapshots": 3000},
        "proxy": {"ranks": (16, 64, 256), "repeats": 10, "goal_ranks": 64, "lmcache": (8, 8)},
        "status_api": {"ranks": 256, "repeats": 30, "http_repeats": 20},
        "memory": {"ranks": 256, "rounds": 62, "period": 0.25, "scrapes": 2},
        "proxy_memory": {"reads": 3},
        "label_memory": {"ranks": 1024},
        "freshness": {"samples": 30, "interval": 1.0, "background_ranks": 7, "pipeline_samples": 10},
        "persistence": {"ranks": (64, 256), "saves": 20, "starts": 3},
        "state_load": {"quick": False},
        "transfer": {"pages": 64, "repeats": 20},
    },
    "quick": {
        "hotpath": {"number": 20_000, "repeat": 3, "rounds": 1},
        "scrape": {"ranks": (16, 64), "repeats": 10, "budget_s": 1.5},
        "ingest": {"ranks": (64,), "snapshots": 500},
        "proxy": {"ranks": (16, 64), "repeats": 3, "goal_ranks": 64, "lmcache": (8, 8)},
        "status_api": {"ranks": 256, "repeats": 5, "http_repeats": 3},
        "memory": {"ranks": 256, "rounds": 8, "period": 0.1, "scrapes": 1},
        "proxy_memory": {"reads": 2},
        "label_memory": {"ranks": 256, "series_total": 256 * 24, "rounds": 4, "period": 0.1},
        "freshness": {"samples": 8, "interval": 1.0, "background_ranks": 0, "pipeline_samples": 3},
        "persistence": {"ranks": (256,), "saves": 5, "starts": 1},
        "state_load": {"quick": False},
        "transfer": {"pages": 16, "repeats": 5},
    },
    "smoke": {
        "hotpath": {"number": 2_000, "repeat": 1, "rounds": 1},
        "scrape": {"ranks": (2, 4), "repeats": 3, "budget_s": 0.1, "goal_ranks": (4,), "gzip_goal_ranks": (4,)},
        "ingest": {"ranks": (4,), "snapshots": 16},
        "proxy": {"ranks": (2, 4), "repeats": 2, "goal_ranks": 4, "lmcache": (2, 2)},
        "status_api": {"ranks": 16, "repeats": 2, "http_repeats": 2},
        "memory": {"ranks": 4, "rounds": 3, "period": 0.05, "scrapes": 1},
        "proxy_memory": {"reads": 1, "cases": ("floods", "ranks"), "body_bytes": 100_000, "interval": 0.5},
        "label_memory": {"ranks": 8, "series_total": 8 * 24, "rounds": 2, "period": 0.05},
        "freshness": {"samples": 2, "interval": 0.2, "background_ranks": 1, "pipeline_samples": 2},
        "persistence": {"ranks": (4,), "saves": 2, "starts": 1, "goal_ranks": 4},
        "state_load": {"quick": True},
        "transfer": {"pages": 4, "repeats": 2},
    },
}


def transfer_run(pages: int = 64, repeats: int = 20, progress: bool = True) -> list[dict[str, Any]]:
    """bench/transfer.py's rows in the common row shape (torch with one intra-op thread, as a rank runs)."""
    import torch

    from bench import transfer

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        measured = transfer.run(pages, repeats, device, progress)
    finally:
        torch.set_num_threads(threads)
    rows = []
    for r in measured:
        goal = r["goal"]
        rows.append(row(
            f"transfer: {r['op']} {r['layout']} ({r['device']}, {r['bytes'] / 2**20:.0f} MiB)", r["hicache_gb_s"], "GB/s",
            "plain contiguous torch copy", r["anchor_gb_s"], r["ratio"], None if goal is None else f"ratio >= {goal:g}",
            None if goal is None else r["ratio"] >= goal, ratio_means="value / anchor", bit_identical=r["bit_identical"]))
        if not r["bit_identical"]:
            raise RuntimeError(f"transfer {r['op']} {r['layout']}: the copied page differs from its source")
    return rows


def _runners() -> dict[str, Callable[..., list[dict[str, Any]]]]:
    from bench import (
        freshness,
        hotpath,
        ingest,
        label_memory,
        memory,
        persistence,
        proxy,
        proxy_memory,
        scrape,
        state_load,
        status_api,
    )

    return {"hotpath": hotpath.run, "scrape": scrape.run, "ingest": ingest.run, "proxy": proxy.run,
            "status_api": status_api.run, "memory": memory.run, "proxy_memory": proxy_memory.run,
            "label_memory": label_memory.run, "freshness": freshness.run, "persistence": persistence.run,
            "state_load": state_load.run, "transfer": transfer_run}


def run_benchmarks(profile: str = "full", only: tuple[str, ...] = ORDER, progress: bool = True
                   ) -> tuple[dict[str, list[dict[str, Any]]], dict[str, str], dict[str, float]]:
    """Run the chosen benchmarks in order: (rows per benchmark, errors per benchmark, seconds per benchmark)."""
    runners = _runners()
    chosen = [name for name in ORDER if name in only]
    results: dict[str, list[dict[str, Any]]] = {}
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    started = time.monotonic()
    for number, name in enumerate(chosen, 1):
        if progress:
            print(f"[{number}/{len(chosen)}] {name} (t={time.monotonic() - started:.0f}s) ...", file=sys.stderr, flush=True)
        began = time.monotonic()
        try:
            rows = runners[name](**PROFILES[profile][name], progress=progress)
            for r in rows:
                r["benchmark"] = name
            results[name] = rows
        except Exception as err:  # noqa: BLE001 - one failing benchmark must not hide the others
            errors[name] = "".join(traceback.format_exception_only(type(err), err)).strip()
            if progress:
                traceback.print_exc()
                print(f"[{number}/{len(chosen)}] {name} FAILED: {errors[name]}", file=sys.stderr, flush=True)
        seconds[name] = round(time.monotonic() - began, 1)
        if progress and name not in errors:
            print(f"[{number}/{len(chosen)}] {name} done in {seconds[name]:.0f}s", file=sys.stderr, flush=True)
    return results, errors, seconds


def machine() -> dict[str, Any]:
    """What the run ran on, for the JSON and BENCHMARKS.md."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    info: dict[str, Any] = {"nproc": os.cpu_count(), "cpu_model": cpu, "python": platform.python_version(),
                            "platform": platform.platform()}
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except AttributeError:
        pass
    from importlib import metadata

    for package in ("prometheus_client", "torch", "pydantic", "msgspec", "aiohttp", "matplotlib"):
        try:
            info[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            info[package] = None
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "exporter", "cache_core"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        info["git_commit"] = commit + ("+uncommitted changes in exporter/ or cache_core/" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        info["git_commit"] = None
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="far fewer repeats and rank counts (under a minute)")
    parser.add_argument("--profile", choices=sorted(PROFILES), help=argparse.SUPPRESS)
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(ORDER)}")
    parser.add_argument("--json", default=str(RESULTS / "latest.json"), help="where to write the results (JSON)")
    parser.add_argument("--plot", default=str(RESULTS / "scrape_vs_ranks.png"),
                        help="where to write the scrape-latency plot (PNG; needs matplotlib, the `bench` extra)")
    parser.add_argument("--markdown", help="also write the table as markdown to this file")
    args = parser.parse_args(argv)
    profile = args.profile or ("quick" if args.quick else "full")
    only = tuple(n.strip() for n in args.only.split(",")) if args.only else ORDER
    unknown = set(only) - set(ORDER)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")

    began = time.monotonic()
    started_at = dt.datetime.now(dt.timezone.utc)
    results, errors, seconds = run_benchmarks(profile, only)
    rows = [r for name in ORDER for r in results.get(name, [])]
    elapsed = time.monotonic() - began

    print()
    print_table(rows)
    goals = [r for r in rows if r.get("met") is not None]
    print(f"\n{sum(r['met'] for r in goals)}/{len(goals)} goals met; profile {profile}; {elapsed:.0f} s")
    for name, message in errors.items():
        print(f"FAILED: {name}: {message}")

    plot_path = None
    if "scrape" in results:
        try:
            from bench.scrape import plot

            plot_path = plot(results["scrape"], args.plot)
            print(f"plot: {plot_path}")
        except ImportError:
            print("plot skipped: matplotlib is missing (pip install -e '.[bench]', or `make bench`)", file=sys.stderr)
    report = {
        "started_at": started_at.isoformat(timespec="seconds"), "profile": profile,
        "seconds": round(elapsed, 1), "seconds_per_benchmark": seconds, "machine": machine(),
        "goals_met": sum(r["met"] for r in goals), "goals": len(goals), "errors": errors,
        "plot": plot_path, "rows": rows,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(f"results: {args.json}")
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows) + "\n")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
