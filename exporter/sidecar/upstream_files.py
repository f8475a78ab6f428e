"""A prometheus_client multiprocess directory, read as the engine's /metrics would, each process apart."""

from __future__ import annotations

import glob
import os
import re
from pathlib import Path

from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

_DB_FILE = re.compile(r"^(?P<kind>[a-z]+)(?:_[a-z]+)?_(?P<pid>[^_]+)\.db$")

Reading = list[tuple[str | None, float, list[Metric]]]  # (pid or None, its files' mtime, families), oldest first
# In a directory's reading, the entry of every process's files merged as the engine's /metrics
# merges them: the families passed through come from it (one series per label set, summed).
MERGED = "*"


def read_multiprocess_dir(directory: Path, merged: bool = True) -> Reading:
    """Each process's families from a prometheus_client multiprocess directory, read apart, oldest
    first, then (with `merged`) every process's merged, for the families passed through.

    prometheus_client's own reader (`MultiProcessCollector.merge`, the code the engine's /metrics
    runs) is given one process's files at a time, so one process's values are never summed with
    another's. A process's age is its files' latest modification time. The merged reading is
    about half the work, and only families passed through come from it.
    """
    by_pid: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(directory, "*.db")):
        match = _DB_FILE.match(os.path.basename(path))
        if match:
            by_pid.setdefault(match.group("pid"), []).append(path)
    processes: Reading = []
    for pid, files in by_pid.items():
        try:
            mtime = max(os.stat(path).st_mtime for path in files)
        except FileNotFoundError:  # a live gauge's file removed between the glob and now
            continue
        processes.append((pid, mtime, list(MultiProcessCollector.merge(sorted(files), accumulate=True))))
    processes.sort(key=lambda process: (process[1], process[0]))
    if merged:
        every = sorted(path for _, files in by_pid.items() for path in files if os.path.exists(path))
        processes.append((MERGED, 0.0, list(MultiProcessCollector.merge(every, accumulate=True))))
    return processes

