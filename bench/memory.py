"""Memory: resident set size of a real sidecar process holding 256 ranks x the full catalog.

    python -m bench.memory [--ranks 256] [--rounds 62] [--period 0.25] [--scrapes 2] [--json FILE]

A `serve` process is started; its RSS once ready, with no rank connected, is the anchor. Then
`ranks` raw-protocol connections each say hello and push `rounds` full-catalog snapshots with
moving values (every counter, gauge and histogram changes between pushes), one round every
`period` seconds, /metrics is scraped `scrapes` times, and the sidecar's VmRSS and VmHWM (peak
RSS) are read from /proc. MB here is 10^6 bytes.

Steady state needs full window histories: the sidecar keeps WINDOW_HISTORY_ENTRIES (12) entries per rank
per rollup window, one per window/12 (5 s at the default 60 s, so a real deployment reaches that
after a minute). To get there in seconds, the sidecar runs with `rollup.window_seconds` =
WINDOW_HISTORY_ENTRIES x `period`, and the ranks push 62 rounds: the same number of entries, the same
memory, in a fraction of the time.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from exporter.sidecar.core.ranks import WINDOW_HISTORY_ENTRIES

from bench.common import RawRank, Sidecar, progress_printer
from bench.report import report, row

GOAL_MB = 150.0
MB = 1e6


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))




def measure(ranks: int, rounds: int, period: float, scrapes: int, progress: bool = True) -> dict[str, Any]:
    say = progress_printer(progress, "memory")
    window = WINDOW_HISTORY_ENTRIES * period
    with Sidecar(config_yaml=f"rollup:\n  window_seconds: {window:g}\n") as sidecar:
        time.sleep(0.5)
        idle_rss = _status_bytes(sidecar.pid, "VmRSS")
        say(f"idle sidecar RSS {idle_rss / MB:.1f} MB; connecting {ranks} ranks ...")
        conns: list[RawRank] = []
        try:
            for index in range(ranks):
                conns.append(RawRank(sidecar.socket_path, index))
            pushed, late = 0, 0
            say(f"pushing {rounds} rounds of {ranks} full snapshots, one round every {period:g} s "
                f"(sidecar window {window:g} s) ...")
            next_round = time.monotonic()
            for round_ in range(rounds):
                for conn in conns:
                    conn.push()
                pushed += len(conns)
                if (round_ + 1) % 10 == 0 or round_ + 1 == rounds:
                    say(f"round {round_ + 1}/{rounds}: {pushed} snapshots pushed, "
                        f"RSS {_status_bytes(sidecar.pid, 'VmRSS') / MB:.1f} MB")
                next_round += period
                pause = next_round - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                else:
                    late += 1
                    next_round = time.monotonic()
            if late > rounds // 4:
                say(f"note: {late} rounds took longer than {period:g} s, so the window histories hold fewer "
                    "entries than in steady state; raise --period")
            sidecar.wait_applied(pushed)
            series = 0
            for _ in range(scrapes):
                text = sidecar.get().decode()
                series = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
            time.sleep(0.5)
            rss, peak = _status_bytes(sidecar.pid, "VmRSS"), _status_bytes(sidecar.pid, "VmHWM")
            say(f"{ranks} ranks: RSS {rss / MB:.1f} MB, peak {peak / MB:.1f} MB, {series} samples on /metrics")
        finally:
            for conn in conns:
                conn.close()
    return {"idle_rss": idle_rss, "rss": rss, "peak_rss": peak, "ranks": ranks, "snapshots": pushed,
            "exposed_samples": series, "late_rounds": late, "window_s": window}


def run(ranks: int = 256, rounds: int = 62, period: float = 0.25, scrapes: int = 2,
        progress: bool = True) -> list[dict[str, Any]]:
    m = measure(ranks, rounds, period, scrapes, progress)
    idle = m["idle_rss"] / MB
    extra = {"ranks": ranks, "snapshots": m["snapshots"], "exposed_samples": m["exposed_samples"],
             "rounds": rounds, "late_rounds": m["late_rounds"], "window_s": m["window_s"]}
    rows = []
    for name, value in ((f"memory: sidecar RSS, {ranks} ranks", m["rss"] / MB),
                        (f"memory: sidecar peak RSS (VmHWM), {ranks} ranks", m["peak_rss"] / MB)):
        rows.append(row(name, value, "MB", "the same sidecar idle, no rank", idle, value / idle,
                        f"value < {GOAL_MB:g}", value < GOAL_MB, ratio_means="value / anchor", **extra))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=62, help="full snapshots pushed per rank")
    parser.add_argument("--period", type=float, default=0.25, help="seconds between rounds")
    parser.add_argument("--scrapes", type=int, default=2)
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    rows = run(args.ranks, args.rounds, args.period, args.scrapes)
    report(rows, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
