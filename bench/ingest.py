"""Ingest: full-catalog snapshots per second the sidecar's state applies, in-process, on one core.

    python -m bench.ingest [--ranks 64,256] [--snapshots 3000] [--json FILE]

For each rank count: every rank says hello (`parse_client_message` + `SidecarState.hello`) and
pushes a first snapshot (untimed warm-up: it creates the series). Then rounds over all ranks, in
rank order with a rising seq, each rank's client MetricSet advanced between its pushes (every
counter, gauge and histogram moves, as on a busy rank). The payloads are the client library's
exact bytes, encoded before the clock starts. Timed per snapshot: `parse_client_message(payload)`
then `SidecarState.snapshot(rank, message)`; the rate is per CPU-second of the applying thread
(`time.thread_time`), i.e. on one core, with the wall-clock rate alongside.

Anchor: `json.loads` of the same payloads, the least any Python reader of the protocol must do.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from typing import Any

from exporter.catalog import default_catalog
from exporter.protocol.messages import parse_client_message
from exporter.sidecar.state import SidecarState

from bench.common import report, advance_all, full_metric_set, hello_payload, progress_printer, rank_id, row, snapshot_payload

GOAL_PER_SECOND = 5000.0


def _timed(fn: Any) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) spent in fn()."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def measure(ranks: int, snapshots: int, progress: bool = True) -> dict[str, Any]:
    say = progress_printer(progress, f"ingest/{ranks}")
    catalog = default_catalog()
    state = SidecarState(catalog)
    sets = [full_metric_set(catalog, seed=i) for i in range(ranks)]
    rngs = [random.Random(1000 + i) for i in range(ranks)]
    rank_states = []
    for index in range(ranks):
        hello = parse_client_message(hello_payload(rank_id(index)))
        rank_states.append(state.hello(object(), hello).rank)  # one connection token per rank
    for index in range(ranks):  # warm-up: first snapshots create every series
        result = state.snapshot(rank_states[index], parse_client_message(snapshot_payload(sets[index], 1)))
        if result.rejections:
            raise RuntimeError(f"the sidecar rejected warm-up samples: {result.rejections[:3]}")
    rounds = max(2, math.ceil(snapshots / ranks))
    say(f"encoding {rounds} rounds x {ranks} full-catalog snapshots ...")
    work: list[tuple[Any, bytes]] = []
    for round_ in range(rounds):
        for index in range(ranks):
            advance_all(sets[index], rngs[index])
            work.append((rank_states[index], snapshot_payload(sets[index], round_ + 2)))
    payload_bytes = sum(len(p) for _, p in work) / len(work)
    say(f"applying {len(work)} snapshots ...")
    bad: list[Any] = []

    def apply() -> None:  # results are checked and dropped: keeping them would only feed the GC
        parse, snapshot = parse_client_message, state.snapshot
        for rank, payload in work:
            result = snapshot(rank, parse(payload))
            if result.ignored or result.rejections:
                bad.append(result)

    cpu_s, wall_s = _timed(apply)
    if bad:
        raise RuntimeError(f"{len(bad)} snapshots were ignored or had rejections, e.g. {bad[0]}")
    payloads = [p for _, p in work]

    def anchor() -> None:
        loads = json.loads
        for payload in payloads:
            loads(payload)

    anchor_cpu_s, anchor_wall_s = _timed(anchor)
    n = len(work)
    return {"ranks": ranks, "snapshots": n, "cpu_s": cpu_s, "wall_s": wall_s, "anchor_cpu_s": anchor_cpu_s,
            "anchor_wall_s": anchor_wall_s, "payload_bytes": payload_bytes,
            "samples_per_snapshot": len(json.loads(payloads[0])["samples"])}


def run(ranks: tuple[int, ...] = (64, 256), snapshots: int = 3000, progress: bool = True) -> list[dict[str, Any]]:
    rows = []
    for count in ranks:
        m = measure(count, snapshots, progress)
        n = m["snapshots"]
        rate, anchor_rate = n / m["cpu_s"], n / m["anchor_cpu_s"]
        extra = {"ranks": count, "snapshots": n, "wall_rate_per_s": n / m["wall_s"],
                 "payload_bytes": round(m["payload_bytes"]), "samples_per_snapshot": m["samples_per_snapshot"]}
        rows.append(row(f"ingest: snapshots/s on one core, {count} ranks", rate, "snapshots/s",
                        "json.loads of the same payloads", anchor_rate, rate / anchor_rate,
                        f"value >= {GOAL_PER_SECOND:g}", rate >= GOAL_PER_SECOND, ratio_means="value / anchor", **extra))
        per_k, anchor_per_k = m["cpu_s"] / n * 1000, m["anchor_cpu_s"] / n * 1000
        rows.append(row(f"ingest: CPU s per 1000 snapshots, {count} ranks", per_k, "CPU s",
                        "json.loads of the same payloads", anchor_per_k, per_k / anchor_per_k,
                        f"value <= {1000 / GOAL_PER_SECOND:g}", per_k <= 1000 / GOAL_PER_SECOND,
                        ratio_means="value / anchor", **extra))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="64,256", help="comma-separated rank counts")
    parser.add_argument("--snapshots", type=int, default=3000, help="timed snapshots per rank count (about)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    rows = run(tuple(int(c) for c in args.ranks.split(",") if c), args.snapshots)
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
