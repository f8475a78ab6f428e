"""Durable state: what saving the sidecar's state costs, how big its file is, and how fast a sidecar
starts on one.

    python -m bench.persistence [--ranks 64,256] [--saves 20] [--starts 3] [--json FILE]

For each rank count, an in-process SidecarState holds that many full-catalog ranks (the same ranks
as bench/ingest.py: tp=8, pp=4, dp=N, every family and label set of the catalog, two pushes each so
every series has moved). Then:

* CPU per save: `StateKeeper.encode` (the dump and msgspec encoding the keeper runs on the event
  loop) plus `durable.file.write_atomic` of its bytes into a temporary directory (temp file, fsync,
  rename, directory fsync), `saves` times, on this thread's CPU clock (`time.thread_time`: the
  fsyncs' waiting is not CPU). Anchor: the same dumped state pickled (protocol 5) and written the
  same way, taking turns save by save. Goal, at 256 ranks: a save every 5 s (the default
  `persistence.interval`) takes at most 1 % of one core, i.e. at most 50 ms of CPU per save.
* File bytes per series (rank and rollup series, weighted as `ranks.max_series_total` counts
  them). Anchor: the pickle's bytes per series. Goal: within the keeper's MAX_BYTES_PER_SERIES, so
  a file of a full series budget always loads.
* Start to ready: a real `hicache-exporter serve --config` whose config names the file (written by
  the same `encode`), timed from the process start until `/-/ready` answers 200, then checked to
  list every rank of the file on `/api/v1/ranks`. Anchor: the same start with no file, the two
  taking turns. Goal, at 256 ranks: ready within 1 s of the same start without a file (the Python
  interpreter's own start and imports are the anchor's, whatever this machine makes them).
"""

from __future__ import annotations

import argparse
import json
import pickle
import random
import shutil
import statistics
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from exporter.catalog import default_catalog
from exporter.config import PersistenceConfig
from exporter.protocol.messages import parse_client_message
from exporter.sidecar.core import saved as core_saved
from exporter.sidecar.core.health import PersistenceHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.durable.file import write_atomic
from exporter.sidecar.durable.keeper import MAX_BYTES_PER_SERIES, StateKeeper

from bench.common import (
    NAMESPACE,
    Sidecar,
    advance_all,
    full_metric_set,
    hello_payload,
    progress_printer,
    rank_id,
    snapshot_payload,
)
from bench.report import report, row

GOAL_SAVE_SECONDS = 0.050  # 1 % of one core at the default 5 s interval
GOAL_READY_SECONDS = 1.0
LOAD_DURATION_METRIC = "hicache_exporter_persistence_load_duration_seconds"


def build_state(ranks: int) -> SidecarState:
    """A sidecar state holding `ranks` full-catalog ranks, each pushed twice (every series moved)."""
    catalog = default_catalog()
    state = SidecarState(catalog)
    for index in range(ranks):
        metrics = full_metric_set(catalog, seed=index)
        rank = state.hello(object(), parse_client_message(hello_payload(rank_id(index)))).rank
        for seq in (1, 2):
            if seq > 1:
                advance_all(metrics, random.Random(1000 + index))
            result = state.snapshot(rank, parse_client_message(snapshot_payload(metrics, seq)))
            if result.ignored or result.rejections:
                raise RuntimeError(f"rank {index}: the state refused a push: {result.refused or result.rejections[:3]}")
    return state


def keeper_for(state: SidecarState, path: Path) -> StateKeeper:
    """The keeper `serve` builds for this state (no upstream), writing `path`."""
    return StateKeeper(PersistenceConfig(file=path), state, {}, PersistenceHealth(), NAMESPACE)


def _cpu(fn: Any) -> tuple[float, Any]:
    started = time.thread_time()
    out = fn()
    return time.thread_time() - started, out


def measure_saves(state: SidecarState, saves: int, directory: Path) -> dict[str, Any]:
    """CPU per save (encode + atomic write) against pickling the same dump, the two taking turns."""
    keeper = keeper_for(state, directory / "state")
    anchor_path = directory / "anchor"
    encode_cpu, write_cpu, anchor_cpu, loop_wall = [], [], [], []
    data = b""
    anchor = b""
    for _ in range(saves):
        wall = time.perf_counter()
        cpu, data = _cpu(keeper.encode)
        loop_wall.append(time.perf_counter() - wall)
        encode_cpu.append(cpu)
        write_cpu.append(_cpu(lambda data=data: write_atomic(keeper.path, data))[0])
        cpu, anchor = _cpu(lambda: pickle.dumps(core_saved.dump(state), protocol=5))
        anchor_cpu.append(cpu + _cpu(lambda anchor=anchor: write_atomic(anchor_path, anchor))[0])
    per_save = [a + b for a, b in zip(encode_cpu, write_cpu)]
    budget = state.series_budget()
    series = budget.per_rank + budget.rollup
    load_cpu, loaded = _cpu(lambda: _load(state, keeper.path))
    if loaded.rank_count() != state.rank_count():
        raise RuntimeError(f"the file of {state.rank_count()} ranks loaded {loaded.rank_count()}")
    # What encoding and loading hold for a moment on top of the state (tracemalloc's peak; untimed).
    tracemalloc.start()
    keeper.encode()
    encode_peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    scratch = _load(state, keeper.path)
    load_peak = tracemalloc.get_traced_memory()[1] - base
    load_kept = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    del scratch
    return {
        "save_cpu": statistics.median(per_save), "encode_cpu": statistics.median(encode_cpu),
        "write_cpu": statistics.median(write_cpu), "loop_wall": statistics.median(loop_wall),
        "anchor_cpu": statistics.median(anchor_cpu), "file_bytes": len(data), "anchor_bytes": len(anchor),
        "series": series, "file": data, "load_cpu": load_cpu, "encode_peak": encode_peak,
        "load_peak": load_peak, "load_kept": load_kept,
    }


def _load(state: SidecarState, path: Path) -> SidecarState:
    """A fresh state of the same catalog and limits, with the file at `path` loaded into it by a keeper."""
    fresh = state.fresh()
    keeper = keeper_for(fresh, path)
    keeper.load()
    if keeper.health.load_failures:
        raise RuntimeError(f"the file did not load: {keeper.health.load_failures}")
    return fresh


def _ready_seconds(config_yaml: str) -> tuple[float, Sidecar]:
    started = time.perf_counter()
    sidecar = Sidecar(config_yaml=config_yaml)
    return time.perf_counter() - started, sidecar


def measure_starts(data: bytes, ranks: int, starts: int, directory: Path) -> dict[str, Any]:
    """Start-to-ready of `serve` on a file holding `data`, against the same start with no file."""
    path = directory / "start-state"
    with_file, without, load = [], [], []
    for _ in range(starts):
        elapsed, sidecar = _ready_seconds("persistence:\n  interval: 5s\n")
        sidecar.stop()
        without.append(elapsed)
        path.write_bytes(data)  # the file as the in-process keeper wrote it (the last stop rewrote it)
        elapsed, sidecar = _ready_seconds(f"persistence:\n  file: {path}\n  interval: 5s\n")
        try:
            listed = len(json.loads(sidecar.get("/api/v1/ranks"))["ranks"])
            if listed != ranks:
                raise RuntimeError(f"the sidecar started on a {ranks}-rank file lists {listed} ranks")
            for line in sidecar.get().decode().splitlines():
                if line.startswith(LOAD_DURATION_METRIC + " "):
                    load.append(float(line.rsplit(" ", 1)[1]))
        finally:
            sidecar.stop()
        with_file.append(elapsed)
    return {"ready": statistics.median(with_file), "anchor_ready": statistics.median(without),
            "load": statistics.median(load) if load else None}


def run(ranks: tuple[int, ...] = (64, 256), saves: int = 20, starts: int = 3, goal_ranks: int = 256,
        progress: bool = True) -> list[dict[str, Any]]:
    say = progress_printer(progress, "persistence")
    rows = []
    directory = Path(tempfile.mkdtemp(prefix="hcb-state-", dir="/tmp"))
    try:
        for count in ranks:
            say(f"{count} ranks: building the state ...")
            state = build_state(count)
            say(f"{count} ranks: {saves} saves (encode + atomic write) against pickle ...")
            m = measure_saves(state, saves, directory)
            say(f"{count} ranks: {m['save_cpu'] * 1000:.1f} ms CPU per save ({m['encode_cpu'] * 1000:.1f} encoding), "
                f"{m['file_bytes']:,} bytes for {m['series']:,} series; loaded in {m['load_cpu'] * 1000:.1f} ms CPU; "
                f"peaks: encode {m['encode_peak'] / 1e6:.1f} MB, load {m['load_peak'] / 1e6:.1f} MB "
                f"(the loaded state keeps {m['load_kept'] / 1e6:.1f} MB); {starts} starts with and without the file ...")
            s = measure_starts(m["file"], count, starts, directory)
            say(f"{count} ranks: ready in {s['ready']:.2f} s on the file, {s['anchor_ready']:.2f} s without")
            goal = count == goal_ranks
            extra = {"ranks": count, "series": m["series"], "file_bytes": m["file_bytes"]}
            rows.append(row(
                f"persistence: CPU per save (encode + atomic write), {count} ranks", m["save_cpu"] * 1000, "ms",
                "pickle of the same dump + the same write", m["anchor_cpu"] * 1000, m["save_cpu"] / m["anchor_cpu"],
                f"value <= {GOAL_SAVE_SECONDS * 1000:g} (1 % of a core at 5 s)" if goal else None,
                m["save_cpu"] <= GOAL_SAVE_SECONDS if goal else None, ratio_means="value / anchor",
                encode_cpu_ms=m["encode_cpu"] * 1000, write_cpu_ms=m["write_cpu"] * 1000,
                encode_wall_ms=m["loop_wall"] * 1000, load_cpu_ms=m["load_cpu"] * 1000,
                encode_peak_bytes=m["encode_peak"], load_peak_bytes=m["load_peak"], load_kept_bytes=m["load_kept"],
                saves=saves, **extra))
            per_series = m["file_bytes"] / m["series"]
            rows.append(row(
                f"persistence: file bytes per series, {count} ranks", per_series, "B",
                "pickle of the same dump", m["anchor_bytes"] / m["series"], m["file_bytes"] / m["anchor_bytes"],
                f"value <= {MAX_BYTES_PER_SERIES} (a full budget's file loads)",
                per_series <= MAX_BYTES_PER_SERIES, ratio_means="value / anchor", anchor_bytes=m["anchor_bytes"], **extra))
            added = s["ready"] - s["anchor_ready"]
            rows.append(row(
                f"persistence: start to ready on a {count}-rank file", s["ready"], "s",
                "the same start with no file", s["anchor_ready"], s["ready"] / s["anchor_ready"],
                f"value - anchor <= {GOAL_READY_SECONDS:g} s" if goal else None,
                added <= GOAL_READY_SECONDS if goal else None, ratio_means="value / anchor",
                added_s=added, load_s=s["load"], starts=starts, **extra))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="64,256", help="comma-separated rank counts")
    parser.add_argument("--saves", type=int, default=20, help="saves timed per rank count")
    parser.add_argument("--starts", type=int, default=3, help="starts with and without the file per rank count")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    ranks = tuple(int(n) for n in args.ranks.split(","))
    rows = run(ranks, args.saves, args.starts, goal_ranks=max(ranks))
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
