"""A merged multiprocess directory (exporter.sidecar.upstream.merged) under what containers do: pids reused after a
restart, some processes replaced while others go on, files removed while the sidecar is down. The rollups are
the sum of what every process counted, each once.

Files are written by prometheus_client's own writer (tests.exporter.sidecar.upstream.test_profiles.write_process)
and read as the directory source reads them: merged, held, then fed.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule
from prometheus_client.metrics_core import Metric
from prometheus_client.mmap_dict import MmapedDict, mmap_key

from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.files import MERGED, Exposition, Skipped, read_directory
from exporter.sidecar.upstream.merged import HeldProcesses, _key
from tests.exporter.sidecar.durable.test_relocate import LM_HITS, Sidecar, lm_rollup
from tests.exporter.sidecar.upstream.test_profiles import LABELS, catalog, write_process


def read(feed: UpstreamFeed, directory: Path) -> None:
    """One read as the directory source makes it: merged, held steady, then fed."""
    reading = read_directory(directory)
    feed.apply(feed.held.hold(reading.exposition, reading.skipped))


def directory_upstream(directory: Path) -> list[dict[str, object]]:
    return [{"multiprocess_dir": str(directory), "profile": "lmcache"}]


def two_processes_read(tmp_path: Path) -> tuple[Path, Sidecar]:
    """A sidecar that has read pids 10 and 11, each 1,000 hit tokens of worker 0."""
    processes = tmp_path / "multiproc"
    processes.mkdir()
    sidecar = Sidecar(tmp_path / "state", directory_upstream(processes), catalog())
    write_process(processes, "10", {"0": 1000})
    write_process(processes, "11", {"0": 1000})
    read(sidecar.feed, processes)
    return processes, sidecar


def test_a_wiped_restart_that_reuses_some_pids_is_a_restart(tmp_path: Path) -> None:
    processes, sidecar = two_processes_read(tmp_path)
    assert lm_rollup(sidecar, LM_HITS) == 2000
    for old in processes.iterdir():
        old.unlink()
    write_process(processes, "10", {"0": 5})  # a new process under a reused pid
    write_process(processes, "12", {"0": 5})
    read(sidecar.feed, processes)
    assert lm_rollup(sidecar, LM_HITS) == 2010  # 3010 before: pid 11 was kept as if its process had exited


def test_a_process_replaced_under_its_pid_while_others_go_on_counts_both(tmp_path: Path) -> None:
    processes, sidecar = two_processes_read(tmp_path)
    (processes / "counter_10.db").unlink()
    write_process(processes, "10", {"0": 5})  # pid 10 is another process now; 11 goes on
    write_process(processes, "11", {"0": 1010})
    read(sidecar.feed, processes)
    assert lm_rollup(sidecar, LM_HITS) == 2015
    assert sidecar.feed.health.series_resets == 0


def test_files_removed_while_the_sidecar_is_down_stay_counted(tmp_path: Path) -> None:
    processes, sidecar = two_processes_read(tmp_path)
    sidecar.save()
    (processes / "counter_11.db").unlink()  # while no sidecar runs
    write_process(processes, "10", {"0": 1005})
    again = Sidecar(tmp_path / "state", directory_upstream(processes), catalog(), clock_at=9000.0)
    read(again.feed, processes)
    assert lm_rollup(again, LM_HITS) == 2005  # 3005 before: the held values were not in the state file


def test_held_values_are_keyed_the_same_in_every_process() -> None:
    # The state file keeps held values by key: a key must not depend on the process's string hash seed.
    assert _key("lmcache:num_hit_tokens_total", {"worker_id": "0", "model_name": "m"}) == 0x1D0A8B642C640D19


def test_a_holder_takes_back_only_finite_values_of_zero_or_more() -> None:
    held = HeldProcesses(lambda name: True)
    held.restore(({"10": [(1, 5.0), (2, float("nan")), (3, -1.0)], "11": [(1, 1.0)]},
                  [(4, float("inf")), (5, 2.0)]), max_processes=1)
    assert held.dump() == ({"10": [(1, 5.0)]}, [(5, 2.0)])


# --- files skipped for a read (caught between their creation and their first write, or cut) ---


def held_hits(held: HeldProcesses, directory: Path) -> dict[str, float]:
    """One read's merged hit tokens per worker_id, as held."""
    reading = read_directory(directory)
    exposition = held.hold(reading.exposition, reading.skipped)
    (families,) = [families for source, _, families in exposition if source == MERGED]
    return {s.labels["worker_id"]: s.value for family in families for s in family.samples
            if s.name == "lmcache:num_hit_tokens_total"}


def cut(path: Path) -> None:
    """A file as a reader finds it between its writer's open() and truncate(): shorter than its header."""
    path.write_bytes(b"\0" * 4)


def test_a_process_with_a_file_skipped_counts_what_its_other_files_hold_and_is_retired_at_that(tmp_path: Path) -> None:
    held = HeldProcesses(lambda name: True)
    MmapedDict(str(tmp_path / "histogram_10.db")).close()  # pid 10's second file, no entries yet
    write_process(tmp_path, "10", {"0": 1000})
    write_process(tmp_path, "11", {"0": 1000})  # a replica of the same worker
    assert held_hits(held, tmp_path) == {"0": 2000}
    write_process(tmp_path, "10", {"0": 1500})
    cut(tmp_path / "histogram_10.db")  # skipped this read; its counter file is read whole
    assert held_hits(held, tmp_path) == {"0": 2500}  # 2000 before: pid 10's counters stood at its last read
    for old in tmp_path.glob("*_10.db"):  # pid 10 exited and its files were cleaned up
        old.unlink()
    assert held_hits(held, tmp_path) == {"0": 2500}  # 2000 before: it was retired at 1000, for good


def test_a_process_skipped_at_its_first_read_goes_on_when_the_others_are_gone(tmp_path: Path) -> None:
    held = HeldProcesses(lambda name: True)
    write_process(tmp_path, "10", {"0": 1000})
    assert held_hits(held, tmp_path) == {"0": 1000}
    write_process(tmp_path, "10", {"0": 1200})
    cut(tmp_path / "counter_11.db")  # a new process's file, not written yet
    assert held_hits(held, tmp_path) == {"0": 1200}
    (tmp_path / "counter_10.db").unlink()  # pid 10 exited and was cleaned up; pid 11 counts
    (tmp_path / "counter_11.db").unlink()
    write_process(tmp_path, "11", {"0": 300})
    assert held_hits(held, tmp_path) == {"0": 1500}  # 300 before: read as a restart, pid 10's 1200 dropped


def test_a_pid_reused_while_one_of_its_files_is_skipped_is_a_new_process(tmp_path: Path) -> None:
    held = HeldProcesses(lambda name: True)
    MmapedDict(str(tmp_path / "histogram_10.db")).close()
    write_process(tmp_path, "10", {"0": 1000})
    write_process(tmp_path, "11", {"0": 1000})
    assert held_hits(held, tmp_path) == {"0": 2000}
    (tmp_path / "counter_10.db").unlink()
    write_process(tmp_path, "10", {"0": 5})  # another process under pid 10; its histogram file not written yet
    cut(tmp_path / "histogram_10.db")
    assert held_hits(held, tmp_path) == {"0": 2005}  # 2000 before: the new process's 5 stood for the old 1000
    (tmp_path / "histogram_10.db").unlink()
    MmapedDict(str(tmp_path / "histogram_10.db")).close()
    write_process(tmp_path, "10", {"0": 10})
    assert held_hits(held, tmp_path) == {"0": 2010}


def histogram(directory: Path, pid: str, worker: str, entries: int) -> None:
    """A process's histogram file as prometheus_client's writer fills it when a series is made: its _sum, then
    its buckets in order, +Inf last (the first `entries` of them)."""
    name, labels = "lmcache:time_to_retrieve", ["m", worker, "worker", "s"]
    bounds = ["0.001", "0.005", "0.01", "0.02", "0.04", "0.06", "0.08", "0.1", "0.25", "0.5", "0.75", "1.0", "2.5",
              "5.0", "7.5", "10.0", "+Inf"]
    keys = [mmap_key(name, name + "_sum", list(LABELS), labels, "t"),
            *(mmap_key(name, name + "_bucket", [*LABELS, "le"], [*labels, le], "t") for le in bounds)]
    values = MmapedDict(str(directory / f"histogram_{pid}.db"))
    for key in keys[:entries]:
        values.write_value(key, 0.0, 0.0)
    values.close()


def test_a_histogram_read_while_its_buckets_are_added_is_no_new_layout_that_starts_its_rank_again(tmp_path: Path) -> None:
    processes = tmp_path / "multiproc"
    processes.mkdir()
    sidecar = Sidecar(tmp_path / "state", directory_upstream(processes), catalog())
    write_process(processes, "10", {"0": 1000})  # replica A's worker 0 has logged its counters,
    histogram(processes, "10", "0", 5)  # and is making its first histogram series: its _sum and 4 buckets so far
    read(sidecar.feed, processes)
    histogram(processes, "10", "0", 18)
    write_process(processes, "11", {"0": 500})  # replica B's worker 0
    histogram(processes, "11", "0", 18)
    read(sidecar.feed, processes)
    (rank,) = sidecar.h.state.ranks.values()
    # 500 before (replica B's part alone), rollups at 1500: the 4 buckets and then 17 read as a new bucket
    # layout, which started the rank's epoch again from what it had counted.
    assert rank.values[(LM_HITS, ())] == 1500 and rank.restarts == 0
    assert lm_rollup(sidecar, LM_HITS) == 1500


# --- any reads: the merged values are what the reads saw of each process, each once ---

# A process's files and the family each holds: its values by (file, worker_id).
FILES = {"counter": ("lmcache:num_hit_tokens", "counter", "_total"),
         "histogram": ("lmcache:retrieve_time", "histogram", "_sum")}
Values = dict[tuple[str, str], float]
PIDS = st.sampled_from(["10", "11", "12"])


def exposition(read: dict[str, Values]) -> Exposition:
    """A directory read as read_directory gives it: per pid the files read (pid -> its values read), then merged."""
    def families(values: list[Values]) -> list[Metric]:
        out = []
        for file, (name, kind, suffix) in FILES.items():
            family = Metric(name, "", kind)
            for worker in sorted({w for v in values for f, w in v if f == file}):
                family.add_sample(name + suffix, {"worker_id": worker},
                                  sum(v.get((file, worker), 0.0) for v in values))
            out.append(family)
        return out
    return [*((pid, 0.0, families([values])) for pid, values in read.items()), (MERGED, 0.0, families(list(read.values())))]


class ReadsMachine(RuleBasedStateMachine):
    """Processes start, count (their values only rise), exit with their files removed, or are replaced under
    their pid; each read skips any of their files. After every read, each merged value is the sum of what the
    reads saw of the processes that go on (each value at its latest read) and of those gone: never a process
    twice, never one's part left out, so never lower than the read before."""

    def __init__(self) -> None:
        super().__init__()
        self.held = HeldProcesses(lambda name: True)
        self.live: dict[str, Values] = {}  # pid -> its process's values now
        self.known: dict[str, Values] = {}  # pid -> what reads saw of its process
        self.gone: Values = {}  # what reads saw of the processes gone
        self.listed: set[str] = set()  # the pids whose files the last read listed
        self.new: set[str] = set()  # pids whose process was replaced, and not read whole since

    def _goes_on(self, pid: str) -> bool:
        """Whether a process of the last read other than `pid` goes on (else the next read is an engine restart)."""
        return any(other != pid and other not in self.new for other in self.listed & self.live.keys())

    @rule(pid=PIDS)
    def start(self, pid: str) -> None:
        if pid not in self.live:
            self.live[pid], self.known[pid] = {}, {}
            if pid in self.listed:  # its process of the last read exited since: another one under its pid
                self.new.add(pid)

    @precondition(lambda self: self.live.keys() - self.new)
    @rule(data=st.data(), file=st.sampled_from(sorted(FILES)), worker=st.sampled_from(["0", "1"]),
          amount=st.integers(1, 3))
    def count(self, data: st.DataObject, file: str, worker: str, amount: int) -> None:
        # A new process under a reused pid counts once read whole, so that its pid's fall shows.
        pid = data.draw(st.sampled_from(sorted(self.live.keys() - self.new)))
        self.live[pid][(file, worker)] = self.live[pid].get((file, worker), 0.0) + amount

    @precondition(lambda self: self.live)
    @rule(data=st.data(), again=st.booleans())
    def end(self, data: st.DataObject, again: bool) -> None:
        """A process exits and its files are removed, or (`again`) another process starts under its pid."""
        pid = data.draw(st.sampled_from(sorted(self.live)))
        if self._goes_on(pid):
            for key, value in self.known.pop(pid).items():
                self.gone[key] = self.gone.get(key, 0.0) + value
            del self.live[pid]
            if again:
                self.live[pid], self.known[pid] = {}, {}
                self.new.add(pid)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def read(self, data: st.DataObject) -> None:
        read: dict[str, Values] = {}
        skipped: list[Skipped] = []
        for pid in sorted(self.live):
            unread = data.draw(st.sampled_from([(), (), ("counter",), ("histogram",), ("counter", "histogram")]))
            skipped += [Skipped(f"{file}_{pid}.db", "truncated", "") for file in unread]
            seen = {key: value for key, value in self.live[pid].items() if key[0] not in unread}
            self.known[pid].update(seen)
            if len(unread) < len(FILES):
                read[pid] = seen
            if not unread:
                self.new.discard(pid)
        self.listed = set(self.live)
        (families,) = [f for source, _, f in self.held.hold(exposition(read), skipped) if source == MERGED]
        for family in families:
            file = next(file for file, (name, _, _) in FILES.items() if name == family.name)
            for sample in family.samples:
                key = (file, sample.labels["worker_id"])
                assert sample.value == self.gone.get(key, 0.0) + sum(v.get(key, 0.0) for v in self.known.values())


TestReads = ReadsMachine.TestCase
TestReads.settings = settings(max_examples=300, stateful_step_count=40, deadline=None, derandomize=True,
                              database=None, suppress_health_check=[HealthCheck.too_slow])
