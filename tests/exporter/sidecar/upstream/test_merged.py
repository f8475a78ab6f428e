"""A merged multiprocess directory (exporter.sidecar.upstream.merged) under what containers do: pids reused after a
restart, some processes replaced while others go on, files removed while the sidecar is down. The rollups are
the sum of what every process counted, each once.

Files are written by prometheus_client's own writer (tests.exporter.sidecar.upstream.test_profiles.write_process)
and read as the directory source reads them: merged, held, then fed.
"""

from __future__ import annotations

from pathlib import Path

from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.files import read_directory
from exporter.sidecar.upstream.merged import HeldProcesses, _key
from tests.exporter.sidecar.durable.test_relocate import LM_HITS, Sidecar, lm_rollup
from tests.exporter.sidecar.upstream.test_profiles import catalog, write_process


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
