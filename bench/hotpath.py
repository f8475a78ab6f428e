"""Hot path: nanoseconds per increment through the client library, against prometheus_client.

    python -m bench.hotpath [--number 100000] [--repeat 5] [--rounds 2] [--json FILE]

Each contender runs in its own fresh interpreter, so that prometheus_client's multiprocess mode
(chosen when it is imported, from PROMETHEUS_MULTIPROC_DIR) is set up exactly as an engine does:
* client library: a counter child bound once with its labels (`client.counter(family, **labels)`),
  then `.inc(1)`; a histogram child's `.observe(x)`;
* prometheus_client plain: `Counter(...).labels(...)` resolved once, then `.inc(1)`; same for
  `Histogram.observe`;
* prometheus_client multiprocess mode: the same, with PROMETHEUS_MULTIPROC_DIR set before the import.
Figures are the best of `rounds` x `repeat` timeit runs of `number` calls, in ns per call (timeit's
loop overhead, about 10-15 ns, is included in every contender alike). The goal applies like for
like: a counter increment against multiprocess `Counter.inc()`, a histogram observation against
multiprocess `Histogram.observe()`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import timeit
from typing import Any

from bench.common import REPO_ROOT, child_env, progress_printer
from bench.report import report, row

GOAL_MULTIPROC_RATIO = 0.15
RANK_LABELS = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0", "cache_type": "HiRadixCache"}


def _best_ns(fn: Any, arg: Any, number: int, repeat: int) -> float:
    timer = timeit.Timer("fn(arg)", globals={"fn": fn, "arg": arg})
    timer.timeit(min(number, 10_000))  # warm-up
    return min(timer.repeat(repeat=repeat, number=number)) / number * 1e9


def _worker(mode: str, number: int, repeat: int) -> dict[str, float]:
    """Runs in a fresh interpreter: times one contender and returns ns per call."""
    if mode == "client":
        from exporter.client import RankClient

        client = RankClient("/nonexistent/never-started.sock", rank={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0},
                            labels={"cache_type": "HiRadixCache"})  # never started: no I/O at all
        counter = client.counter("load_back_tokens_total", pool="kv")
        histogram = client.histogram("load_back_duration_seconds")
        result = {"counter_inc_ns": _best_ns(counter.inc, 1, number, repeat),
                  "histogram_observe_ns": _best_ns(histogram.observe, 0.004, number, repeat)}
        assert counter.value > 0 and sum(histogram.counts) > 0
        return result
    if mode in ("plain", "multiprocess"):
        if mode == "multiprocess" and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
            raise RuntimeError("multiprocess mode needs PROMETHEUS_MULTIPROC_DIR set before the import")
        from prometheus_client import CollectorRegistry, Counter, Histogram, values

        registry = CollectorRegistry()
        counter = Counter("sglang_load_back_tokens", "tokens", [*RANK_LABELS, "pool"], registry=registry)
        histogram = Histogram("sglang_load_back_duration_seconds", "seconds", list(RANK_LABELS), registry=registry,
                              buckets=[0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009,
                                       0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0])
        child_c = counter.labels(**RANK_LABELS, pool="kv")
        child_h = histogram.labels(**RANK_LABELS)
        return {"counter_inc_ns": _best_ns(child_c.inc, 1, number, repeat),
                "histogram_observe_ns": _best_ns(child_h.observe, 0.004, number, repeat),
                "value_class": values.ValueClass.__name__}  # type: ignore[attr-defined]
    raise ValueError(mode)


def _measure(mode: str, number: int, repeat: int) -> dict[str, Any]:
    env = child_env()
    tmp = None
    if mode == "multiprocess":
        tmp = tempfile.mkdtemp(prefix="hicache-bench-mp-")
        env["PROMETHEUS_MULTIPROC_DIR"] = tmp
    try:
        out = subprocess.run([sys.executable, "-m", "bench.hotpath", "--worker", mode, "--number", str(number),
                              "--repeat", str(repeat)], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
        if out.returncode:
            raise RuntimeError(f"hotpath worker {mode} failed:\n{out.stderr}")
        result = json.loads(out.stdout)
        if mode == "multiprocess" and result.get("value_class") == "MutexValue":
            raise RuntimeError("prometheus_client did not enter multiprocess mode")
        return result
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


def run(number: int = 100_000, repeat: int = 5, rounds: int = 2, progress: bool = True) -> list[dict[str, Any]]:
    """`rounds` alternating passes over the three contenders; each keeps its best figure (noise only adds)."""
    say = progress_printer(progress, "hotpath")
    measured: dict[str, dict[str, Any]] = {}
    for round_ in range(rounds):
        for mode in ("client", "plain", "multiprocess"):
            say(f"round {round_ + 1}/{rounds}: timing {mode} ({repeat} x {number} calls per figure) ...")
            result = _measure(mode, number, repeat)
            best = measured.setdefault(mode, result)
            for key in ("counter_inc_ns", "histogram_observe_ns"):
                best[key] = min(best[key], result[key])
    client, plain, mp = measured["client"], measured["plain"], measured["multiprocess"]
    c_inc, c_obs = client["counter_inc_ns"], client["histogram_observe_ns"]
    goal = f"ratio <= {GOAL_MULTIPROC_RATIO}"
    rows = []
    for name, value, anchor, anchor_value, has_goal in (
        ("hotpath: client counter .inc()", c_inc, "prometheus_client Counter.inc() multiprocess",
         mp["counter_inc_ns"], True),
        ("hotpath: client histogram .observe()", c_obs, "prometheus_client Histogram.observe() multiprocess",
         mp["histogram_observe_ns"], True),
        ("hotpath: client counter .inc()", c_inc, "prometheus_client Counter.inc() plain",
         plain["counter_inc_ns"], False),
        ("hotpath: client histogram .observe()", c_obs, "prometheus_client Histogram.observe() plain",
         plain["histogram_observe_ns"], False),
        ("hotpath: client histogram .observe()", c_obs, "prometheus_client Counter.inc() multiprocess",
         mp["counter_inc_ns"], False),
    ):
        ratio = value / anchor_value
        rows.append(row(name, value, "ns/call", anchor, anchor_value, ratio, goal if has_goal else None,
                        (ratio <= GOAL_MULTIPROC_RATIO) if has_goal else None, ratio_means="value / anchor"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=100_000, help="calls per timeit run")
    parser.add_argument("--repeat", type=int, default=5, help="timeit runs (the best is kept)")
    parser.add_argument("--rounds", type=int, default=2, help="alternating passes over the contenders")
    parser.add_argument("--worker", choices=["client", "plain", "multiprocess"], help=argparse.SUPPRESS)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(_worker(args.worker, args.number, args.repeat)))
        return 0
    rows = run(args.number, args.repeat, args.rounds)
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
