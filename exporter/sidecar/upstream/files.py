"""A prometheus_client multiprocess directory, read as the engine's /metrics would, each process apart.

The directory is written by the engine, so nothing in it is trusted: each `.db` file is opened
without following links or blocking (a FIFO or a device is refused after `fstat`, never read), its
size is checked against the file and a cap before a byte is read, and its entries are decoded by
prometheus_client's own decoder and merged by its own accumulate step. A file that fails any of
this is skipped and reported (`Skipped`); the rest of the directory is read.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import _read_all_values
from prometheus_client.multiprocess import MultiProcessCollector

_DB_FILE = re.compile(r"^(?P<kind>[a-z]+)(?:_(?P<mode>[a-z]+))?_(?P<pid>[^_]+)\.db$")
_KINDS = frozenset({"counter", "gauge", "histogram", "summary"})  # the files prometheus_client writes

# One read's families, per process: (pid or None, its files' mtime, families), oldest first. A text
# upstream's is one entry (None, 0.0, families); a directory's has one per process.
Exposition = list[tuple[str | None, float, list[Metric]]]
# In a directory's exposition, the entry of every process's files merged as the engine's /metrics
# merges them: the families passed through come from it (one series per label set, summed).
MERGED = "*"

# One file's used bytes are read up to this size (an engine's file starts at 64 KiB and doubles as
# it fills: a rank process writes well under 1 MiB), and one read's files up to the total below.
MAX_FILE_BYTES = 32 << 20
MAX_READ_BYTES = 64 << 20
MAX_FILES = 16384  # .db files in one directory; an engine has a few per process
MAX_KEY_BYTES = 64 << 10  # one entry's key (a JSON list of names, labels and help text)
_HEADER = 8  # the `used` int and its padding


class TooLarge(ValueError):
    """A read holds more than one read may take (files, entries or samples): it is refused as a whole."""


@dataclass
class Skipped:
    """A file left out of a read: its name (for the log only) and why, as a kind."""

    name: str
    kind: str  # bad_name, not_regular, too_large, truncated, corrupt
    message: str

    @property
    def pid(self) -> str | None:
        """The process whose file it is, by prometheus_client's file name; None for a name it does not give."""
        match = _DB_FILE.match(self.name)
        return match.group("pid") if match else None


@dataclass
class DirectoryRead:
    """One read of a directory: its exposition, the files left out, and how many entries it held."""

    exposition: Exposition
    skipped: list[Skipped] = field(default_factory=list)
    entries: int = 0


class _FileProblem(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def read_db_file(dir_fd: int, name: str, budget: int) -> tuple[float, bytes, int]:
    """One `.db` file's (mtime, used bytes, their count), opened relative to `dir_fd` without following
    a link or blocking, refused (`_FileProblem`) unless it is a regular file whose `used` header fits
    the file and MAX_FILE_BYTES (`TooLarge`: past `budget`). FileNotFoundError: removed since the listing."""
    fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NOCTTY, dir_fd=dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise _FileProblem("not_regular", "not a regular file")
        if info.st_size < _HEADER:
            # A writer between its open() and truncate(), or a cut file: nothing to read yet.
            raise _FileProblem("truncated", f"{info.st_size} bytes, shorter than the 8-byte header")
        header = os.pread(fd, _HEADER, 0)
        if len(header) < _HEADER:
            raise _FileProblem("truncated", "shorter than the 8-byte header")
        used = struct.unpack_from("i", header, 0)[0]
        if used == 0:  # a new file whose header is not written yet: no entries
            return info.st_mtime, header, 0
        if used < _HEADER:
            raise _FileProblem("corrupt", f"its header says {used} bytes are used")
        if used > info.st_size:
            raise _FileProblem("corrupt", f"its header says {used} bytes are used, the file has {info.st_size}")
        if used > MAX_FILE_BYTES:
            raise _FileProblem("too_large", f"{used} bytes used, past the cap of {MAX_FILE_BYTES}")
        if used > budget:
            raise TooLarge(f"the directory's files hold more than {MAX_READ_BYTES} bytes")
        data = _read_exactly(fd, used)
    finally:
        os.close(fd)
    return info.st_mtime, data, used


def _read_exactly(fd: int, size: int) -> bytes:
    chunks: list[bytes] = []
    got = 0
    while got < size:
        chunk = os.pread(fd, min(size - got, 1 << 20), got)
        if not chunk:
            raise _FileProblem("truncated", f"cut to {got} bytes while it was read")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _entries(data: bytes, used: int) -> Iterator[tuple[str, float, float]]:
    """The file's (key, value, timestamp), by prometheus_client's decoder; `_FileProblem` where the
    bytes are not what its writer writes (its decoder can step backwards on a negative length)."""
    last = 0
    try:
        for key, value, timestamp, pos in _read_all_values(data, used):
            if pos <= last or pos + 16 > used:
                raise _FileProblem("corrupt", f"an entry at byte {pos} is out of order or past the used bytes")
            if len(key) > MAX_KEY_BYTES:
                raise _FileProblem("corrupt", f"a key of {len(key)} characters at byte {pos}")
            last = pos
            yield key, value, timestamp
    except (struct.error, RuntimeError, UnicodeDecodeError) as err:
        raise _FileProblem("corrupt", f"{type(err).__name__}: {err}") from None


def _parse_key(key: str, kind: str) -> tuple[str, str, dict[str, str], tuple[tuple[str, str], ...], str]:
    """A key as prometheus_client's reader takes it apart, checked to be the list of strings its writer writes."""
    try:
        parsed = json.loads(key)
    except (ValueError, RecursionError) as err:
        raise _FileProblem("corrupt", f"a key is not JSON: {type(err).__name__}") from None
    if not (isinstance(parsed, list) and len(parsed) == 4):
        raise _FileProblem("corrupt", "a key is not a list of 4 items")
    metric_name, name, labels, help_text = parsed
    if not (isinstance(metric_name, str) and isinstance(name, str) and isinstance(help_text, str)
            and isinstance(labels, dict) and all(isinstance(v, str) for v in labels.values())):
        raise _FileProblem("corrupt", "a key's names, labels or help are not strings")
    if kind == "histogram" and "le" in labels:
        try:
            float(labels["le"])  # the accumulate step sorts buckets by it
        except ValueError:
            raise _FileProblem("corrupt", "a bucket bound is not a number") from None
    return metric_name, name, labels, tuple(sorted(labels.items())), help_text


def _whole_histograms(entries: list[Any]) -> None:
    """`_FileProblem` where a histogram's series has no +Inf bucket: its writer adds a series' _sum, then its
    buckets in order, +Inf last, one entry at a time (prometheus_client's Histogram._metric_init), so a file
    read between two of them holds fewer buckets, a bucket layout that would read as a new one."""
    series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    whole: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for (metric_name, name, labels, labels_key, _), _, _ in entries:
        of = (metric_name, tuple(pair for pair in labels_key if pair[0] != "le"))
        series.add(of)
        if name == metric_name + "_bucket" and labels.get("le") == "+Inf":
            whole.add(of)
    if series - whole:
        raise _FileProblem("truncated", "a histogram without its +Inf bucket (read while its writer adds its buckets)")


@dataclass
class _File:
    name: str
    kind: str
    mode: str | None
    pid: str
    mtime: float
    entries: list[tuple[tuple[str, str, dict[str, str], tuple[tuple[str, str], ...], str], float, float]]


def _metrics(files: list[_File]) -> list[Metric]:
    """prometheus_client's `MultiProcessCollector._read_metrics` over entries already read and
    checked, then its own `_accumulate_metrics`: the families the engine's /metrics would show."""
    metrics: dict[str, Metric] = {}
    for file in files:
        for (metric_name, name, _labels, labels_key, help_text), value, timestamp in file.entries:
            metric = metrics.get(metric_name)
            if metric is None:
                metric = metrics[metric_name] = Metric(metric_name, help_text, file.kind)
            if file.kind == "gauge":
                metric._multiprocess_mode = file.mode  # type: ignore[attr-defined]
                metric.add_sample(name, labels_key + (("pid", file.pid),), value, timestamp)  # type: ignore[arg-type]
            else:
                metric.add_sample(name, labels_key, value)  # type: ignore[arg-type]
    return list(MultiProcessCollector._accumulate_metrics(metrics, True))


def read_directory(directory: Path, merged: bool = True, max_entries: int | None = None) -> DirectoryRead:
    """Each process's families from a prometheus_client multiprocess directory, read apart, oldest
    first, then (with `merged`) every process's merged, for the families passed through; the files
    left out, and why. `TooLarge` past MAX_FILES, MAX_READ_BYTES or `max_entries` entries.

    Each process's files are merged by prometheus_client's own accumulate step (the code the
    engine's /metrics runs), one process at a time, so one process's values are never summed with
    another's. A process's age is its files' latest modification time.
    """
    out = DirectoryRead([])
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        names = _listing(dir_fd)
        by_pid: dict[str, list[_File]] = {}
        budget = MAX_READ_BYTES
        for name in names:
            match = _DB_FILE.match(name)
            if match is None or match.group("kind") not in _KINDS or (match.group("kind") == "gauge" and not match.group("mode")):
                # prometheus_client names its files kind_pid.db, and gauges gauge_mode_pid.db: its
                # reader fails on a gauge without a mode or an unknown kind, as the engine's /metrics would.
                out.skipped.append(Skipped(name, "bad_name", "not a name prometheus_client gives its files"))
                continue
            try:
                mtime, data, size = read_db_file(dir_fd, name, budget)
                kind = match.group("kind")
                entries: list[Any] = []
                for key, value, timestamp in _entries(data, size):
                    if max_entries is not None and out.entries + len(entries) >= max_entries:
                        # Refused as the entries come, before they are taken apart: a file within
                        # the byte caps can hold 10 times an engine's samples in short keys.
                        raise TooLarge(f"the directory's files hold more than {max_entries} samples")
                    entries.append((_parse_key(key, kind), value, timestamp))
                if kind == "histogram":
                    _whole_histograms(entries)
            except FileNotFoundError:  # removed since the listing (a live gauge's process died)
                continue
            except _FileProblem as err:
                out.skipped.append(Skipped(name, err.kind, str(err)))
                continue
            except OSError as err:  # a link (ELOOP), no permission, an I/O error: that file only
                out.skipped.append(Skipped(name, "not_regular" if err.errno == errno.ELOOP else "unreadable",
                                           f"{err.strerror or type(err).__name__}"))
                continue
            budget -= size
            out.entries += len(entries)
            by_pid.setdefault(match.group("pid"), []).append(
                _File(name, kind, match.group("mode"), match.group("pid"), mtime, entries))
    finally:
        os.close(dir_fd)
    processes: Exposition = []
    for pid, files in by_pid.items():
        families = _accumulated(files, out, pid)
        if families is not None:
            processes.append((pid, max(f.mtime for f in files), families))
    processes.sort(key=lambda process: (process[1], process[0] or ""))
    if merged:
        every = sorted((f for files in by_pid.values() for f in files), key=lambda f: f.name)
        families = _accumulated(every, out, MERGED)
        processes.append((MERGED, 0.0, families if families is not None else []))
    out.exposition = processes
    return out


def _listing(dir_fd: int) -> list[str]:
    names: list[str] = []
    with os.scandir(dir_fd) as entries:
        for entry in entries:
            if entry.name.endswith(".db"):
                names.append(entry.name)
                if len(names) > MAX_FILES:
                    raise TooLarge(f"the directory holds more than {MAX_FILES} .db files")
    return sorted(names)


def _accumulated(files: list[_File], out: DirectoryRead, pid: str) -> list[Metric] | None:
    """The files' families, or None (each file reported) where the library's accumulate step fails on them."""
    try:
        return _metrics(files)
    except Exception as err:  # what checked entries could still make the library raise: that process only
        for file in files:
            out.skipped.append(Skipped(file.name, "corrupt", f"process {pid}: {type(err).__name__}: {err}"))
        return None

