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
The work is cut into slices, and each slice's payloads go through the anchor just before the
sidecar applies them, so that both see the same minutes of a machine whose speed drifts. Both
run under the garbage-collector settings `serve` uses (`exporter.sidecar.process`).
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
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.process import serving_gc

from bench.common import advance_all, full_metric_set, hello_payload, progress_printer, rank_id, snapshot_payload
from bench.report import report, row

GOAL_PER_SECOND = 5000.0
SLICES = 8  # anchor and sidecar take turns slice by slice


def _timed(fn: Any) -> tuple[float, float]:
    """(CPU seconds of this thread, wall seconds) spent in fn()."""
    cpu, wall = time.thread_time(), time.perf_counter()
    fn()
    return time.thread_time() - cpu, time.perf_counter() - wall


def _loads_all(payloads: list[bytes]) -> None:
    loads = json.loads
    for payload in payloads:
        loads(payload)


def _apply_all(state: SidecarState, work: list[tuple[Any, bytes]], bad: list[Any]) -> None:
    """Parse and apply every payload; results are checked and dropped (keeping them would only feed the GC)."""
    parse, snapshot = parse_client_message, state.snapshot
    for rank, payload in work:
        result = snapshot(rank, parse(payload))
        if result.ignored or result.rejections:
            bad.append(result)


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
    say(f"applying {len(work)} snapshots, each slice after json.loads of its payloads ...")
    bad: list[Any] = []
    cpu_s = wall_s = anchor_cpu_s = anchor_wall_s = 0.0
    step = math.ceil(len(work) / SLICES)
    with serving_gc():  # as `serve` runs, for both the anchor and the sidecar
        for start in range(0, len(work), step):
            piece = work[start:start + step]
            cpu, wall = _timed(lambda piece=piece: _loads_all([payload for _, payload in piece]))
            anchor_cpu_s, anchor_wall_s = anchor_cpu_s + cpu, anchor_wall_s + wall
            cpu, wall = _timed(lambda piece=piece: _apply_all(state, piece, bad))
            cpu_s, wall_s = cpu_s + cpu, wall_s + wall
    if bad:
        raise RuntimeError(f"{len(bad)} snapshots were ignored or had rejections, e.g. {bad[0]}")
    n = len(work)
    return {"ranks": ranks, "snapshots": n, "cpu_s": cpu_s, "wall_s": wall_s, "anchor_cpu_s": anchor_cpu_s,
            "anchor_wall_s": anchor_wall_s, "payload_bytes": payload_bytes,
            "samples_per_snapshot": len(json.loads(work[0][1])["samples"])}


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
