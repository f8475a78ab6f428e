"""Load memory: the peak RSS of a sidecar process loading the worst state files the limits allow, and files
past them, against the pod's memory limit.

    python -m bench.state_load [--quick] [--json FILE]

Each file is loaded by a fresh process (`python -m bench.state_load --load FILE`) that imports what a sidecar
imports, builds the state of the default limits and runs `StateKeeper.load` on it; it reports its peak
RSS (`VmHWM` in /proc/self/status) and what the load did. Anchor: the same process with no file. Files:

* worst: what the limits allow at their worst for a load: the series budget (`ranks.max_series_total`)
  full, every label value at its limit and non-ASCII (4 bytes a character in memory: a family's own at
  `max_family_label_value_length`, the static ones sharing `max_static_label_chars`), each rank a replica
  group of its own with `max_static_labels` such labels, a watermark per series;
* tiny-tuples: a valid file of 5.6 million one-letter label tuples (16.8 MB): past the limits, set aside;
* items-bound: a valid file of as many values as the limits let a decode build (`max_file_items`), each
  of the costliest kind (a one-element tuple of a string of its own), in the bytes the limits allow.

Goal: each load's peak RSS within the pod's memory limit (320 Mi, config/k8s/deployment.yaml), with the
room the running sidecar's own budget needs left to it: a load happens once, at start, before any
source is read, so its peak is the process's peak only if it is above what serving takes.
"""

from __future__ import annotations

import argparse
import json
import struct
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from exporter.catalog import default_catalog
from exporter.config import PersistenceConfig, RanksConfig
from exporter.protocol.messages import Hello, RankId, ScalarSample, Snapshot
from exporter.sidecar.core.health import PersistenceHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.durable.file import frame
from exporter.sidecar.durable.keeper import StateKeeper, max_file_bytes, max_file_items

from bench.common import REPO_ROOT
from bench.report import report, row

POD_LIMIT_BYTES = 320 * 2**20  # config/k8s/deployment.yaml: the sidecar container's memory limit
FAMILY = "hicache_dropped_tokens_total"  # replicated, labels (reason, pool): a rollup cell and a watermark per series
NAMESPACE = "sglang_"
TINY_TUPLES = 5_600_000


def fill(state: SidecarState, series_per_rank: int = 200) -> int:
    """Fill the series budget with the longest non-ASCII labels the limits allow, each rank a group of its own."""
    limits = state.config
    # The static label values share max_static_label_chars; a family's own are each at their own limit.
    length = min(limits.max_label_value_length, limits.max_static_label_chars // max(1, limits.max_static_labels))
    own = limits.max_family_label_value_length
    ranks = 0
    while True:
        static = {f"l{i}": "\U0001f600" + chr(97 + i) * (length - 9) + f"{ranks:08d}"
                  for i in range(limits.max_static_labels)}
        rank = state.hello(object(), Hello(protocol=1, epoch=f"e{ranks}", pid=1, labels=static,
                                           rank=RankId(tp_rank=0, pp_rank=0, dp_rank=0))).rank
        samples = [ScalarSample(FAMILY, 1.0, {"reason": "\U0001f600" + "r" * (own - 9) + f"{j:08d}",
                                              "pool": "\U0001f600" + "p" * (own - 1)})
                   for j in range(series_per_rank)]
        result = state.snapshot(rank, Snapshot(seq=1, time=0.0, samples=samples))
        ranks += 1
        if result.rejections or ranks >= limits.max_ranks:  # the budget is full
            return ranks


def _core_prefix() -> bytes:
    """SavedFile up to its core's label_sets: saved_at, namespace, then families, ranks, cells, marks,
    layout_conflicts, forgotten and statics, all empty."""
    return b"\x95" + b"\xcb" + struct.pack(">d", 0.0) + bytes([0xA0 + len(NAMESPACE)]) + NAMESPACE.encode() \
        + b"\x98" + b"\x80\x90\x90\x90\x80\x90\x90"


def label_sets_file(count: int, entry: bytes) -> bytes:
    """A valid, framed state file whose only content is `count` label tuples, each encoded as `entry`."""
    payload = _core_prefix() + b"\xdd" + struct.pack(">I", count) + entry * count + b"\x80\x80"
    return frame(payload)


def build_files(directory: Path, limits: RanksConfig) -> dict[str, Path]:
    """The files this benchmark loads, written into `directory`."""
    files: dict[str, Path] = {}
    state = SidecarState(default_catalog(), limits)
    fill(state)
    worst = directory / "worst"
    worst.write_bytes(StateKeeper(PersistenceConfig(file=worst), state, {}, PersistenceHealth(), NAMESPACE).encode())
    files["worst"] = worst
    tiny = directory / "tiny-tuples"
    tiny.write_bytes(label_sets_file(TINY_TUPLES, b"\x91\xa1a"))  # ("a",): 3 bytes
    files["tiny-tuples"] = tiny
    # As many one-string tuples as the item bound allows (2 values each), each string as long as the byte
    # bound then allows, of 2-byte characters (a str of its own each, never a cached one-letter one).
    entries = (max_file_items(limits, 0) - 16) // 2
    family_labels = max(len(f.labels) for f in default_catalog())
    room = max_file_bytes(limits, family_labels, 0) - 64 - entries * 2
    chars = max(1, min(limits.max_label_value_length, room // entries // 2))
    text = ("\u0100" * chars).encode()
    head = bytes([0xA0 + len(text)]) if len(text) < 32 else b"\xd9" + bytes([len(text)]) if len(text) < 256 \
        else b"\xda" + struct.pack(">H", len(text))
    bound = directory / "items-bound"
    bound.write_bytes(label_sets_file(entries, b"\x91" + head + text))
    files["items-bound"] = bound
    return files


def load_in_child(path: Path | None) -> dict[str, Any]:
    """Peak RSS (bytes) of a fresh process loading `path` (None: the same process with no file), and what it did."""
    argv = [sys.executable, "-m", "bench.state_load", "--load", str(path) if path is not None else "-"]
    done = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, timeout=300, check=True)
    result: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return result


def _vm_hwm() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def _load(arg: str) -> None:
    """In the child: build a sidecar's state of the default limits, load the file, print what it cost."""
    state = SidecarState(default_catalog(), RanksConfig())
    health = PersistenceHealth()
    if arg != "-":
        path = Path(arg)
        StateKeeper(PersistenceConfig(file=path), state, {}, health, NAMESPACE).load()
    budget = state.series_budget()
    print(json.dumps({"peak_bytes": _vm_hwm(), "load_failures": health.load_failures, "dropped": health.dropped,
                      "identities": health.loaded_identities, "series": budget.per_rank + budget.rollup}))


def run(quick: bool = False, progress: bool = True) -> list[dict[str, Any]]:
    """Peak RSS of each load against the anchor (no file) and against the pod's limit."""
    limits = RanksConfig() if not quick else RanksConfig(max_series_total=2048, max_ranks=64)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        files = build_files(Path(tmp), limits)
        if quick:  # the limits are the defaults' in the child: only the costs of reading them are measured
            files.pop("tiny-tuples")
        anchor = load_in_child(None)
        for name, path in files.items():
            size = path.stat().st_size  # before the load: a file past the limits is set aside
            measured = load_in_child(path)
            if progress:
                print(f"  {name}: {size:,} bytes, peak {measured['peak_bytes'] / 2**20:.0f} MiB, "
                      f"{measured['load_failures'] or 'loaded'}", file=sys.stderr)
            peak = float(measured["peak_bytes"])
            rows.append(row(
                f"load peak RSS, {name} file ({size / 1e6:.1f} MB)", peak / 2**20, "MiB",
                "the same process with no file", anchor["peak_bytes"] / 2**20, peak / anchor["peak_bytes"],
                f"value <= {POD_LIMIT_BYTES // 2**20} MiB (the pod's limit)", peak <= POD_LIMIT_BYTES,
                ratio_means="value / anchor", file_bytes=size, outcome=measured["load_failures"] or "loaded",
                series=measured["series"], identities=measured["identities"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smaller files (a sanity pass)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON")
    parser.add_argument("--load", help=argparse.SUPPRESS)  # the child's side
    args = parser.parse_args(argv)
    if args.load is not None:
        _load(args.load)
        return 0
    report(run(quick=args.quick), str(args.json) if args.json else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
