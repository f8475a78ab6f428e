"""Long label values: a real sidecar's peak RSS with the series budget full of series whose labels are as
long as the limits allow, against the same budget full of short ones.

    python -m bench.label_memory [--ranks 1024] [--only edge,replicas,...] [--json FILE]

Each case starts a fresh `serve` process (the default limits, `ranks.max_series_total` when given), then
`ranks` raw-protocol connections each say hello with static labels of its own (every rank a replica group
of its own, with rollups of its own, but in `replicas`) and push `rounds` snapshots of moving values, the
window's history filled as in bench.memory; the ranks stay connected. Then `/metrics` is read plain and
gzipped, `/api/v1/status` and the page (`/`), and the sidecar's VmHWM (peak RSS) is read from /proc.
The budget weighs each series by the label characters its lines write (exporter/sidecar/core/keys.py,
`series_cost`): the cases fill it with series whose labels are as long as that weight lets them be, or
as the label limits let them be. Cases:

  short       the anchor: 12 counter series a rank (hicache_dropped_tokens_total by reason and pool) with
              short labels; 1,024 such ranks and their rollups fill the default budget (24,576)
  edge        the same counters made per_shard (an operator's catalog may: one line a series), each line
              writing LABEL_CHARS_PER_UNIT characters of labels, the most a series weighing 1 may write
  replicas    the replicated counter, two replicas a group (each group also writes a spread line a series),
              16 series a rank, each line writing LABEL_CHARS_PER_UNIT / 2 (a series of two lines)
  gauges      24 gauge series a rank (hicache_host_pool_*_tokens by pool), each line writing
              LABEL_CHARS_PER_UNIT / 2 (the rank's line and the rollup line made of it)
  long        the 12 counters, every label at its limit: 8 static values sharing max_static_label_chars
              (288 characters each), the family's own values at max_family_label_value_length (128)
  wide        as long, each value with a character outside the BMP (an emoji) in it: every string
              holding such a line takes 4 bytes a character
  histograms  the catalog's 9 histograms a rank, the static labels as in `long`

In the long cases the budget fills with fewer series: ranks past it keep their identity, their series
refused (`series_limit`). The anchor is the short case's peak in the same run; the goal is the
deployment's memory limit (`SIDECAR_MEMORY_LIMIT`, 320 Mi). MB here is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exporter.catalog import MetricType, default_catalog
from exporter.config import RanksConfig
from exporter.protocol.framing import encode_frame, encode_payload
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Hello,
    HistogramSample,
    RankId,
    Sample,
    ScalarSample,
    Snapshot,
    Welcome,
)
from exporter.sidecar.core.keys import LABEL_CHARS_PER_UNIT, label_chars
from exporter.sidecar.core.ranks import WINDOW_HISTORY_ENTRIES

from bench.common import Sidecar, chosen_cases, progress_printer, read_reply
from bench.proxy_memory import memory_limit_bytes
from bench.report import report, row

MB = 1e6
CASES = ("short", "edge", "replicas", "gauges", "long", "wide", "histograms")
COUNTER = "hicache_dropped_tokens_total"  # a counter with two labels of its own (reason, pool)
COUNTERS_PER_RANK = 12  # with their rollups, 1,024 ranks fill the default budget at one unit a series
GAUGES = ("hicache_host_pool_used_tokens", "hicache_host_pool_total_tokens")  # a label of their own (pool)
AXES = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}  # every rank's: its static labels tell ranks apart
# What is read once filled, in order: (name, path, request headers).
VIEWS = (("/metrics", "/metrics", {}), ("/metrics gzip", "/metrics", {"Accept-Encoding": "gzip"}),
         ("/api/v1/status", "/api/v1/status", {}), ("/", "/", {}))
WIDE = "\U0001f600"  # a character outside the BMP


def _value(tag: str, index: int, length: int) -> str:
    """A label value of exactly `length` characters, its rank's `index` at the end (unique per rank)."""
    suffix = f"{index:05d}"
    return (tag + "x" * length)[: max(0, length - len(suffix))] + suffix[max(0, len(suffix) - length):]


def _static(index: int, values: list[int]) -> dict[str, str]:
    """Static labels l0, l1, ... with values of the given lengths."""
    return {f"l{i}": _value(chr(97 + i), index, length) for i, length in enumerate(values)}


def _own(j: int, length: int, wide: bool = False) -> dict[str, str]:
    first = WIDE if wide else ""
    return {"reason": first + _value("r", j, length - len(first)), "pool": first + _value("p", j, length - len(first))}


def _edge(index: int, limits: RanksConfig, lines: int, own_names: tuple[str, ...]) -> tuple[dict[str, str], int]:
    """Static labels, and the length of the family's own values, with which each line of a series of
    `lines` lines (keys.scalar_lines) writes LABEL_CHARS_PER_UNIT // lines characters of labels: the most
    a series weighing one unit may write. The family's own values take what the static ones leave."""
    target = LABEL_CHARS_PER_UNIT // lines
    count = limits.max_static_labels
    axes = label_chars(AXES.items())
    least = label_chars(_static(index, [5] * count).items())  # five characters a value: the rank's number
    own = min(limits.max_family_label_value_length,
              (target - axes - least - sum(len(name) + 4 for name in own_names)) // len(own_names))
    room = target - axes - label_chars({name: "x" * own for name in own_names}.items()) \
        - label_chars(_static(index, [0] * count).items())
    return _static(index, [room // count + (1 if i < room % count else 0) for i in range(count)]), own


def case_labels(case: str, index: int, limits: RanksConfig) -> tuple[dict[str, str], int]:
    """A rank's static labels in `case`, and the length of each of the family's own values."""
    if case == "short":
        return {"cache_type": "HiRadixCache", "instance": f"{index:05d}"}, 6
    if case == "edge":  # a per_shard counter (its own catalog): one line
        return _edge(index, limits, 1, ("reason", "pool"))
    if case == "replicas":  # a replicated counter, two replicas a group: its line and its group's spread line
        return _edge(index // 2, limits, 2, ("reason", "pool"))
    if case == "gauges":  # its line and the rollup line made of it
        return _edge(index, limits, 2, ("pool",))
    count = limits.max_static_labels
    each = min(limits.max_label_value_length, limits.max_static_label_chars // max(1, count))
    static = _static(index, [each] * count)
    if case == "wide":
        static = {name: value[0] + WIDE + value[2:] for name, value in static.items()}
    return static, limits.max_family_label_value_length


def edge_catalog(directory: Path) -> Path:
    """The packaged catalog with COUNTER per_shard: a family an operator's catalog may define, whose
    series write one line each (no replica spread)."""
    from exporter import defaults

    text = (Path(defaults.__file__).parent / "catalog.yaml").read_text()
    block = f"  - name: {COUNTER}\n    type: counter\n    semantics: replicated\n"
    if block not in text:
        raise RuntimeError(f"the packaged catalog no longer spells {COUNTER} as this benchmark expects")
    path = directory / "catalog.yaml"
    path.write_text(text.replace(block, block.replace("replicated", "per_shard")))
    return path


def case_samples(case: str, own: int, round_: int) -> list[Sample]:
    """A rank's snapshot in round `round_` (from 1): every value moves between rounds."""
    if case == "gauges":
        return [ScalarSample(family, float(round_ * (j + 1)), {"pool": _value("p", j, own)})
                for family in GAUGES for j in range(COUNTERS_PER_RANK)]
    if case != "histograms":
        # Two replicas share a group's rollups: 16 series each fill the budget as 12 do for a group of one.
        count = COUNTERS_PER_RANK * 4 // 3 if case == "replicas" else COUNTERS_PER_RANK
        return [ScalarSample(COUNTER, float(round_ * (j + 1)), _own(j, own, case == "wide")) for j in range(count)]
    samples = []
    for spec in default_catalog():
        if spec.type is MetricType.HISTOGRAM and not spec.labels:
            bounds = [*(spec.buckets or ()), "+Inf"]
            counts = [round_ * (i + 1) for i in range(len(bounds))]  # cumulative: `round_` observations a bucket
            samples.append(HistogramSample(spec.name, list(zip(bounds, counts)), float(counts[-1]), counts[-1]))
    return samples


class _Rank:
    """One rank connection: hello with the case's labels, then one snapshot; kept open until closed."""

    def __init__(self, socket_path: str, index: int, labels: dict[str, str], tp_rank: int = 0) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(socket_path)
        hello = Hello(protocol=PROTOCOL_VERSION, epoch=os.urandom(8).hex(), pid=os.getpid(),
                      rank=RankId(tp_rank=tp_rank, pp_rank=0, dp_rank=0), labels=labels)
        self.sock.sendall(encode_frame(encode_payload(hello)))
        reply = read_reply(self.sock)
        if not isinstance(reply, Welcome):
            raise RuntimeError(f"rank {index}: the sidecar refused hello: {reply}")

    def push(self, seq: int, samples: list[Sample]) -> None:
        self.sock.sendall(encode_frame(encode_payload(Snapshot(seq=seq, time=time.time(), samples=samples))))
        try:  # a reply names the series the budget had no room for (`series_limit`): read, and let go
            self.sock.setblocking(False)
            while self.sock.recv(65536):
                pass
        except (BlockingIOError, InterruptedError):
            pass
        finally:
            self.sock.setblocking(True)

    def close(self) -> None:
        self.sock.close()


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))


def measure(case: str, ranks: int, series_total: int | None, rounds: int, period: float,
            progress: bool = True) -> dict[str, Any]:
    """One case in a fresh sidecar: its idle RSS, and its peak once filled and every view read once."""
    say = progress_printer(progress, "label_memory")
    limits = RanksConfig() if series_total is None else RanksConfig(max_series_total=series_total)
    # As bench.memory: a window of WINDOW_HISTORY_ENTRIES periods fills its history in `rounds` rounds.
    config = f"rollup:\n  window_seconds: {WINDOW_HISTORY_ENTRIES * period:g}\n"
    if series_total is not None:
        config += f"ranks:\n  max_series_total: {series_total}\n"
    conns: list[_Rank] = []
    with tempfile.TemporaryDirectory() as tmp, Sidecar(config_yaml=config + (
            f"metrics:\n  catalog: {edge_catalog(Path(tmp))}\n" if case == "edge" else "")) as sidecar:
        try:
            idle = _status_bytes(sidecar.pid, "VmRSS")
            owns = []
            for index in range(ranks):
                labels, own = case_labels(case, index, limits)
                conns.append(_Rank(sidecar.socket_path, index, labels, index % 2 if case == "replicas" else 0))
                owns.append(own)
            next_round = time.monotonic()
            for round_ in range(1, rounds + 1):
                for conn, own in zip(conns, owns):
                    conn.push(round_, case_samples(case, own, round_))
                next_round += period
                time.sleep(max(0.0, next_round - time.monotonic()))
            deadline = time.monotonic() + 120
            while True:  # the status document is made at most once a second: poll it no faster
                status = json.loads(sidecar.get("/api/v1/status"))["sidecar"]
                if status["snapshots_applied"] >= ranks * rounds or time.monotonic() > deadline:
                    break
                time.sleep(1.0)
            if status["snapshots_applied"] < ranks * rounds:
                raise RuntimeError(f"{case}: the sidecar applied {status['snapshots_applied']} of {ranks * rounds} snapshots")
            filled = _status_bytes(sidecar.pid, "VmRSS")
            views, peaks = {}, {"filled": _status_bytes(sidecar.pid, "VmHWM")}
            for view, path, headers in VIEWS:
                views[view] = len(sidecar.get(path, headers))
                peaks[view] = _status_bytes(sidecar.pid, "VmHWM")
            peak = peaks["/"]
            after = _status_bytes(sidecar.pid, "VmRSS")
            limits_used = status["limits"]
            refused = status["rejections"].get("series_limit", 0)
            say(f"{case}: {ranks} ranks, {limits_used['series_used']} of {limits_used['series_allowed']} budget units "
                f"({refused // rounds} series refused a round); RSS idle {idle / MB:.0f} MB, filled {filled / MB:.0f} MB, "
                f"after the views "
                f"{after / MB:.0f} MB, peak {peak / MB:.0f} MB; "
                f"/metrics {views['/metrics'] / MB:.1f} MB ({views['/metrics gzip'] / MB:.2f} MB gzipped), "
                f"status {views['/api/v1/status'] / MB:.1f} MB, page {views['/'] / MB:.1f} MB; peak after each: "
                + ", ".join(f"{view} {value / MB:.0f} MB" for view, value in peaks.items()))
            alive = sidecar.proc.poll() is None
        finally:
            for conn in conns:
                conn.close()
    return {"case": case, "idle_rss": idle, "filled_rss": filled, "after_rss": after, "peak_rss": peak, "views": views,
            "peaks": peaks,
            "alive": alive, "series_used": limits_used["series_used"], "series_allowed": limits_used["series_allowed"],
            "series_refused": refused // rounds}


def run(ranks: int = 1024, cases: tuple[str, ...] = CASES, series_total: int | None = None, rounds: int = 14,
        period: float = 0.25, progress: bool = True) -> list[dict[str, Any]]:
    """One row per case; the short case first, the others against its peak. `series_total`: the budget
    (a smaller one with fewer ranks for a quick pass: 24 a rank fills it as 1,024 ranks fill the default)."""
    limit = memory_limit_bytes()
    anchor = measure("short", ranks, series_total, rounds, period, progress)
    rows = []
    for case in ("short", *(c for c in cases if c != "short")):
        m = anchor if case == "short" else measure(case, ranks, series_total, rounds, period, progress)
        peak = m["peak_rss"] / MB
        base, base_name = ((m["idle_rss"] / MB, "the same sidecar idle") if case == "short"
                           else (anchor["peak_rss"] / MB, "short labels, the same budget full"))
        rows.append(row(f"label memory: peak RSS, {ranks} ranks, {case} labels", peak, "MB", base_name, base, peak / base,
                        f"value < the pod's limit {limit / MB:.0f}", m["alive"] and m["peak_rss"] < limit,
                        ratio_means="value / anchor", label_chars_per_unit=LABEL_CHARS_PER_UNIT,
                        **{k: m[k] for k in ("series_used", "series_allowed", "series_refused", "views")},
                        filled_rss_mb=m["filled_rss"] / MB, after_views_rss_mb=m["after_rss"] / MB))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--series-total", type=int, help="ranks.max_series_total (default: the sidecar's)")
    parser.add_argument("--rounds", type=int, default=14, help="snapshots pushed per rank")
    parser.add_argument("--period", type=float, default=0.25, help="seconds between rounds")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(CASES)} (short, the anchor, always runs)")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    cases = chosen_cases(parser, args.only, CASES)
    report(run(args.ranks, cases, args.series_total, args.rounds, args.period), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
