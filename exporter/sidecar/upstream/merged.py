"""A multiprocess directory read merged (every process's files summed, as vLLM's /metrics sums them), held
steady where the sum alone would fall because some processes' files are gone or unreadable for a read.

A profile whose series label no data-parallel replica (LMCache) is read merged: one rank per label set,
its value the sum over the processes that wrote it. Counters and histograms of a process that exited stay
in its files, so the sum goes on. If some processes' files are removed while others remain (a replica's
processes cleaned up), or one file cannot be read this time, the sum falls by their part, and a fall is a
reset: the survivors would be counted again from there. So a process's last counter and histogram values
are kept: a process whose files are gone keeps adding them (retired), and one with a file skipped this
read adds them for that file's values (its files read count as read, and are kept as its last values). A
pid whose counters fell (of a pid with a file skipped: the values read) is a new process under a reused
pid (a container restarted with the same pids): the old process is retired, the new one counts from its
own values. A pid whose files were listed but none read is a process of that read, with nothing counted
yet. When no process of the last read goes on (every one gone or replaced: the engine restarted in a
wiped directory, whether or not its pids were reused), nothing is kept: the fall is a restart, and the
rollups continue past it. Gauges are left as read: they are current values, not sums to continue.

What is held is part of the durable state (`dump`, `restore`): a process whose files are removed while the
sidecar is down is retired at its first read, as it would have been had the sidecar run on.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterable

from prometheus_client.metrics_core import Metric

from exporter.sidecar.upstream.files import MERGED, Exposition, Skipped

# A sample by a 64-bit hash of its name and sorted labels: a whole key per sample cost 700 bytes, and a
# directory may hold 98,304 entries (70 MB kept between reads); a hash costs a tenth of that. Two
# samples of one read share a hash with a chance of about 1 in 10^9 (64-bit hashes, 10^5 samples).
# The hash is blake2b, not hash(): held values are saved in the state file, and Python's string hashes
# change with every process (about 2 us a sample, on the source's thread).
Key = int
# Retired values are one float per merged sample key (a few hundred per engine process); past this many
# keys a retired value is dropped, and its series falls as it would without this module.
MAX_RETIRED_KEYS = 65536
_CONTINUED = frozenset({"counter", "histogram"})


def _key(name: str, labels: dict[str, str]) -> Key:
    text = repr((name, sorted(labels.items()))).encode("utf-8", "surrogatepass")
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big")


def _values(families: Iterable[Metric], wanted: Callable[[str], bool]) -> dict[Key, float]:
    """A process's counter and histogram samples (buckets, _count, _sum) of the families `wanted`, by key."""
    return {_key(s.name, s.labels): float(s.value)
            for family in families if family.type in _CONTINUED and wanted(family.name) for s in family.samples}


# The held state as the state file keeps it: per pid its last values, and the retired sums, as (key, value) pairs.
HeldState = tuple[dict[str, list[tuple[int, float]]], list[tuple[int, float]]]


class HeldProcesses:
    """The processes of one directory upstream as its last reads saw them (held by its reading thread; `dump`
    may be called from another)."""

    def __init__(self, wanted: Callable[[str], bool], max_keys: int = MAX_RETIRED_KEYS) -> None:
        self.wanted = wanted  # the families held: the upstream's catalog families (others pass through as read)
        self.last: dict[str, dict[Key, float]] = {}  # pid -> its last values read whole
        self.retired: dict[Key, float] = {}  # the last values of processes whose files are gone, summed
        self.max_keys = max_keys
        self._lock = threading.Lock()  # a save (on the event loop) sees one read's state whole

    def hold(self, exposition: Exposition, skipped: Iterable[Skipped]) -> Exposition:
        """`exposition` with its merged entry's counters and histograms held steady (module docstring)."""
        current = {pid: _values(families, self.wanted) for pid, _, families in exposition
                   if pid is not None and pid != MERGED}
        with self._lock:
            return self._hold(exposition, current, {s.pid for s in skipped if s.pid is not None})

    def _hold(self, exposition: Exposition, current: dict[str, dict[Key, float]], skipped: set[str]) -> Exposition:
        # A pid whose values fell is another process under a reused pid: the one read before is retired (of a
        # pid with a file skipped, only the values read are compared: the skipped file's are not in `current`).
        replaced = {pid for pid, values in current.items()
                    if pid in self.last and _fell(self.last[pid], values, partly=pid in skipped)}
        held = (skipped & self.last.keys()) - replaced
        going_on = (current.keys() - replaced) | held
        if self.last and not self.last.keys() & going_on:
            self.last.clear()  # every process is new: the engine restarted; its counters start again
            self.retired.clear()
        for pid in [pid for pid in self.last if pid not in going_on]:
            self._retire(self.last.pop(pid))
        extra = dict(self.retired)
        for pid in held:  # its files read this time are its values now; its last values stand for the others
            now = current.get(pid, {})
            self.last[pid].update(now)
            for key, value in self.last[pid].items():
                extra[key] = extra.get(key, 0.0) + value - now.get(key, 0.0)
        for pid, values in current.items():
            if pid not in held:
                self.last[pid] = values
        for pid in skipped - self.last.keys():  # listed but none of its files read: a process of this read all the same
            self.last[pid] = {}
        if extra:
            for source, _, families in exposition:
                if source == MERGED:
                    for family in families:
                        if family.type in _CONTINUED and self.wanted(family.name):
                            family.samples = [s._replace(value=s.value + extra.get(_key(s.name, s.labels), 0.0))
                                              for s in family.samples]
        return exposition

    def _retire(self, values: dict[Key, float]) -> None:
        for key, value in values.items():
            if key in self.retired or len(self.retired) < self.max_keys:
                self.retired[key] = self.retired.get(key, 0.0) + value

    def dump(self) -> HeldState:
        """What is held now, as plain data for the state file (from any thread)."""
        with self._lock:
            return ({pid: list(values.items()) for pid, values in self.last.items()}, list(self.retired.items()))

    def restore(self, saved: HeldState, max_processes: int) -> None:
        """Take back what `dump` gave (into a holder that has read nothing): at most `max_processes` pids and
        max_keys retired values; a value that is no finite number of zero or more is left out."""
        last, retired = saved
        with self._lock:
            self.last = {pid: {key: value for key, value in values if _counted(value)}
                         for pid, values in list(last.items())[:max_processes]}
            self.retired = {key: value for key, value in retired[:self.max_keys] if _counted(value)}


def _fell(last: dict[Key, float], now: dict[Key, float], partly: bool = False) -> bool:
    """Whether any value a process had is lower now (its counters never fall: another process wrote these);
    `partly`: some of its files were skipped, and only the values read are compared."""
    return any(now.get(key, 0.0) < value for key, value in last.items() if not partly or key in now)


def _counted(value: float) -> bool:
    return math.isfinite(value) and value >= 0.0
