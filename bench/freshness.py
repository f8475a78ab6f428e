"""Freshness: time from an increment in a rank to its new value on /metrics, at the push interval.

    python -m bench.freshness [--samples 30] [--interval 1.0] [--background-ranks 7] [--json FILE]

A real `serve` process and a real rank: a separate process running `RankClient` with the given
push interval (default 1 s, the library's default), plus optional background ranks in another
process. For each sample the bench waits a random phase (uniform in one interval), has the rank
increment `evicted_tokens_total` (the rank reports the monotonic time of the increment), then
polls /metrics every ~5 ms until the rank's series shows the new value; the latency runs to the
end of the response that first shows it (what a scraper sees, so it includes up to one scrape
duration of polling granularity). CLOCK_MONOTONIC is shared by the processes.

Anchor: the push period measured from the rank's own `stats.snapshots_sent` over the run.
The info row times the same pipeline with `client.push_now()` right after the increment (no
interval wait): what is left is ingest + polling granularity.
"""

from __future__ import annotations

import argparse
import multiprocessing
import random
import statistics
import sys
import time
from typing import Any

from bench.common import Sidecar, percentile, progress_printer, rank_id
from bench.report import report, row

GOAL_SLACK_S = 0.020
POLL_PERIOD_S = 0.005
FAMILY = b"sglang_evicted_tokens_total{"


def _rank_process(socket_path: str, interval: float, conn: Any) -> None:
    """The measured rank: a RankClient driven over a pipe."""
    from exporter.client import RankClient

    client = RankClient(socket_path, rank=rank_id(0), labels={"cache_type": "HiRadixCache"}, interval=interval)
    counter = client.counter("evicted_tokens_total")
    client.start()
    try:
        while True:
            command = conn.recv()
            if command == "inc":
                counter.inc(1)
                conn.send((time.monotonic(), counter.value))
            elif command == "inc_push_now":
                counter.inc(1)
                client.push_now()
                conn.send((time.monotonic(), counter.value))
            elif command == "stats":
                conn.send((time.monotonic(), client.stats.snapshots_sent, client.stats.failures))
            elif command == "close":
                break
    finally:
        client.close()
        conn.send("closed")


def _background(socket_path: str, count: int, interval: float, conn: Any) -> None:
    """Other ranks of the pod, pushing the full catalog at the same interval until told to stop."""
    from exporter.client import RankClient

    from bench.common import STATIC_LABELS, advance_all, fill_metric_set

    rng = random.Random(0)
    clients = []
    for index in range(1, count + 1):
        client = RankClient(socket_path, rank=rank_id(index), labels=STATIC_LABELS, interval=interval)
        fill_metric_set(client.metrics, rng)  # every series of the full catalog
        clients.append(client)
    for client in clients:
        client.start()
    while not conn.poll(0.2):
        for client in clients:
            advance_all(client.metrics, rng)
    for client in clients:
        client.close()
    conn.send("closed")


def _value(body: bytes) -> float | None:
    """The measured rank's evicted_tokens_total on /metrics (tp, pp and dp rank 0), or None."""
    start = 0
    while True:
        at = body.find(FAMILY, start)
        if at < 0:
            return None
        end = body.find(b"\n", at)
        line = body[at:end if end >= 0 else len(body)]
        if b'tp_rank="0"' in line and b'pp_rank="0"' in line and b'dp_rank="0"' in line:
            return float(line.rsplit(b" ", 1)[1])
        start = at + 1


def _wait_visible(sidecar: Sidecar, expected: float, timeout: float, scrape_times: list[float]) -> float:
    """Poll every ~5 ms until the value reaches `expected`; the monotonic time of that response's end."""
    deadline = time.monotonic() + timeout
    next_poll = time.monotonic()
    while True:
        started = time.monotonic()
        body = sidecar.get()
        done = time.monotonic()
        scrape_times.append(done - started)
        value = _value(body)
        if value is not None and value >= expected:
            return done
        if done > deadline:
            raise RuntimeError(f"the increment did not show on /metrics within {timeout:.1f} s (last value {value})")
        next_poll += POLL_PERIOD_S
        pause = next_poll - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            next_poll = time.monotonic()


def measure(samples: int, interval: float, background_ranks: int, pipeline_samples: int,
            progress: bool = True) -> dict[str, Any]:
    say = progress_printer(progress, "freshness")
    ctx = multiprocessing.get_context("spawn")
    rng = random.Random()  # unseeded: a fixed seed would replay the same phases, and the same p99, every run
    with Sidecar() as sidecar:
        bg_proc = bg_conn = None
        if background_ranks:
            bg_conn, child_end = ctx.Pipe()
            bg_proc = ctx.Process(target=_background, args=(sidecar.socket_path, background_ranks, interval, child_end),
                                  daemon=True)
            bg_proc.start()
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rank_process, args=(sidecar.socket_path, interval, child), daemon=True)
        proc.start()
        scrape_times: list[float] = []
        try:
            _wait_visible(sidecar, 0.0, 30.0, [])
            t_start, sent_start, _ = _call(parent, "stats")
            latencies = []
            for i in range(samples):
                time.sleep(rng.uniform(0, interval))  # a random phase against the push schedule
                t0, expected = _call(parent, "inc")
                latencies.append(_wait_visible(sidecar, expected, 5 * interval + 5, scrape_times) - t0)
                if progress and ((i + 1) % 5 == 0 or i + 1 == samples):
                    say(f"{i + 1}/{samples} samples, latest {latencies[-1] * 1000:.0f} ms")
            t_end, sent_end, failures = _call(parent, "stats")
            pipeline = []
            for _ in range(pipeline_samples):
                time.sleep(rng.uniform(0.05, 0.15))
                t0, expected = _call(parent, "inc_push_now")
                pipeline.append(_wait_visible(sidecar, expected, 5 * interval + 5, []) - t0)
            say(f"push_now pipeline: {len(pipeline)} samples, median {statistics.median(pipeline) * 1000:.1f} ms")
        finally:
            _stop(parent, proc)
            if bg_conn is not None and bg_proc is not None:
                _stop(bg_conn, bg_proc)
    if sent_end <= sent_start:
        raise RuntimeError("the rank did not push during the run")
    return {"latencies": latencies, "pipeline": pipeline, "push_period": (t_end - t_start) / (sent_end - sent_start),
            "push_failures": failures, "scrape_times": scrape_times}


def _call(conn: Any, command: str) -> Any:
    conn.send(command)
    if not conn.poll(30):
        raise RuntimeError(f"the rank process did not answer {command!r}")
    return conn.recv()


def _stop(conn: Any, proc: Any) -> None:
    try:
        conn.send("close")
        if conn.poll(15):
            conn.recv()
    except (OSError, EOFError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


def run(samples: int = 30, interval: float = 1.0, background_ranks: int = 7, pipeline_samples: int = 10,
        progress: bool = True) -> list[dict[str, Any]]:
    m = measure(samples, interval, background_ranks, pipeline_samples, progress)
    period_ms = m["push_period"] * 1000
    goal_ms = (interval + GOAL_SLACK_S) * 1000
    scrape_p50 = statistics.median(m["scrape_times"]) * 1000
    extra = {"samples": len(m["latencies"]), "push_interval_s": interval, "background_ranks": background_ranks,
             "push_failures": m["push_failures"], "poll_scrape_p50_ms": scrape_p50,
             "latencies_ms": [round(x * 1000, 1) for x in m["latencies"]]}
    rows = []
    for label, q in (("p50", 50.0), ("p99", 99.0)):
        value = percentile(m["latencies"], q) * 1000
        has_goal = label == "p99"
        rows.append(row(f"freshness {label}: inc -> /metrics, {interval:g} s push", value, "ms",
                        "measured push period", period_ms, value / period_ms,
                        f"value <= {goal_ms:g}" if has_goal else None, (value <= goal_ms) if has_goal else None,
                        ratio_means="value / anchor", **extra))
    pipe = percentile(m["pipeline"], 99.0) * 1000
    rows.append(row("freshness p99: inc + push_now -> /metrics", pipe, "ms",
                    "median /metrics scrape while polling", scrape_p50, pipe / scrape_p50, None, None,
                    ratio_means="value / anchor", samples=len(m["pipeline"]),
                    pipeline_p50_ms=statistics.median(m["pipeline"]) * 1000))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--interval", type=float, default=1.0, help="the rank's push interval in seconds")
    parser.add_argument("--background-ranks", type=int, default=7, help="other ranks pushing the full catalog")
    parser.add_argument("--pipeline-samples", type=int, default=10)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    rows = run(args.samples, args.interval, args.background_ranks, args.pipeline_samples)
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
