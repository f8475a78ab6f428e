"""A short run of the loopback load test: nothing a rank pushes under load is lost.

The full run (256 ranks, 60 s, 10 scrapes/s) is `python -m bench.load`; its figures are in
docs/reliability.md. Timings are reported, not asserted: this machine is shared and noisy.
"""

from __future__ import annotations

from bench.load import run


def test_no_snapshot_is_lost_under_load() -> None:
    result = run(ranks=48, seconds=6, scrapes_per_second=4, progress=False)
    print(f"\nload: {result}")
    assert result["snapshots_sent"] >= 48 * 5
    assert result["lost_snapshots"] == 0
    assert result["client_push_failures"] == 0
    assert result["scrape_failures"] == 0
