"""Memory under a hostile upstream: a real sidecar's peak RSS while it reads the worst answers its caps allow.

    python -m bench.proxy_memory [--reads 3] [--only floods,ranks,buckets,rotating] [--json FILE]

Each case starts a fresh `serve` process whose one upstream is a local HTTP server (in this process)
that answers with a body just under the proxy's caps (32 MiB, and one sample line fewer than a read
may have), shaped to hit one cost:

  floods    one pass-through family of short distinct lines (the parser's and pass-through's cost)
  ranks     one catalog counter with a new `tp_rank` per line (identities and their plans)
  buckets   ranks x 9 histograms x 1,024 buckets, as many as the caps let through (the series budget)
  rotating  every read lists new identities (what the feed and registry must forget)

The sidecar reads `reads` answers, then /metrics, /api/v1/status and the page are asked for once
each, and its VmHWM (peak RSS) is read from /proc. The anchor is the same sidecar idle, with no
upstream answer read yet. The goal is the deployment's memory limit (`SIDECAR_MEMORY_LIMIT` in
config/generator/manifests.py). MB here is 10^6 bytes.
"""

from __future__ import annotations

import argparse
import http.server
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from exporter.config import RanksConfig
from exporter.sidecar.upstream.feed import READ_LINES_PER_SERIES
from exporter.sidecar.upstream.plan import MAX_PASS_THROUGH_SAMPLES
from exporter.sidecar.upstream.scrape import MAX_BODY_BYTES

from bench.common import Sidecar, chosen_cases, progress_printer
from bench.report import report, row

MB = 1e6
CASES = ("floods", "ranks", "buckets", "rotating")
SLACK = 1 << 16  # stay this far under the body cap, so the answer is read, not refused as too large


def memory_limit_bytes() -> int:
    """The sidecar container's memory limit in the generated manifests (e.g. 320Mi)."""
    from config.generator.manifests import SIDECAR_MEMORY_LIMIT

    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, factor in units.items():
        if SIDECAR_MEMORY_LIMIT.endswith(suffix):
            return int(SIDECAR_MEMORY_LIMIT[: -len(suffix)]) * factor
    return int(SIDECAR_MEMORY_LIMIT)


def _fill(line: Callable[[int], str], limit: int, lines: int, head: str = "") -> bytes:
    """`head` and then line(0), line(1), ... while the body stays under `limit` bytes and `lines` lines."""
    parts, size = [head], len(head)
    for index in range(lines):
        text = line(index)
        if size + len(text) > limit:
            break
        parts.append(text)
        size += len(text)
    return "".join(parts).encode()


def _pad(limit: int, lines: int, fixed: int, most: int = 128) -> str:
    """Padding that makes `lines` lines of `fixed` other bytes fill `limit` (a rank's static label values stay <= 128)."""
    return "x" * max(0, min(most, limit // lines - fixed))


def floods(read: int, limit: int, lines: int) -> bytes:
    pad = _pad(limit, lines, 30, most=limit)
    return _fill(lambda i: f'f{{i="{i}",p="{pad}"}} 1\n', limit, lines, "# TYPE f gauge\n")


def ranks(read: int, limit: int, lines: int, base: int = 0) -> bytes:
    pad = _pad(limit, lines, 110)

    def line(i: int) -> str:
        tp, dp = (base + i) % 65536, (base + i) // 65536 % 65536  # every one a new identity
        return f'sglang:evicted_tokens_total{{tp_rank="{tp}",pp_rank="0",dp_rank="{dp}",model_name="{pad}"}} {read + 1}\n'

    return _fill(line, limit, lines, "# TYPE sglang:evicted_tokens_total counter\n")


def rotating(read: int, limit: int, lines: int) -> bytes:
    return ranks(read, limit, lines, base=read * 100_000)


HISTOGRAMS = ("eviction_duration_seconds", "load_back_duration_seconds", "hicache_backup_duration_seconds",
              "prefetch_pgs", "backup_pgs", "prefetch_bandwidth", "backup_bandwidth",
              "storage_prefetch_duration_seconds", "storage_backup_duration_seconds")
BUCKETS = 1024


def buckets(read: int, limit: int, lines: int) -> bytes:
    """As many ranks x 9 histograms x 1,024 buckets as the line and byte caps let through."""
    out: list[str] = []
    size = count = 0
    tp = 0
    while True:
        block: list[str] = []
        labels = f'tp_rank="{tp}",pp_rank="0",dp_rank="0"'
        for name in HISTOGRAMS:
            block.append(f"# TYPE sglang:{name} histogram\n" if tp == 0 else "")
            block.extend(f'sglang:{name}_bucket{{{labels},le="{(b + 1) / BUCKETS:g}"}} {b + read}\n' for b in range(BUCKETS))
            block.append(f'sglang:{name}_bucket{{{labels},le="+Inf"}} {BUCKETS + read}\n')
            block.append(f"sglang:{name}_count{{{labels}}} {BUCKETS + read}\nsglang:{name}_sum{{{labels}}} 1.5\n")
        text = "".join(block)
        added = len(HISTOGRAMS) * (BUCKETS + 3)
        if count + added > lines or size + len(text) > limit:
            return "".join(out).encode()
        out.append(text)
        size += len(text)
        count += added
        tp += 1


BODIES: dict[str, Callable[[int, int, int], bytes]] = {"floods": floods, "ranks": ranks, "buckets": buckets,
                                                  "rotating": rotating}


class _Upstream:
    """An HTTP server on 127.0.0.1 answering read N with body(N); counts the requests it was sent.

    The proxy reads one upstream at a time, so request N+1 arriving means read N has ended."""

    def __init__(self, body: Callable[[int], bytes], changes: bool) -> None:
        self.served = 0
        self.lock = threading.Lock()
        cache: dict[int, bytes] = {}  # two bodies alternate, so values move, unless every read is new
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                with outer.lock:
                    number = outer.served
                    outer.served += 1
                payload = None if changes else cache.get(number % 2)
                if payload is None:
                    payload = body(number)
                    if not changes:
                        cache[number % 2] = payload
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                try:
                    self.wfile.write(payload)
                except OSError:  # the sidecar gave up on this answer (its timeout, or a refusal): it is counted
                    pass

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/metrics"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) * 1024 for line in handle if line.startswith(field + ":"))


def measure(case: str, reads: int, body_bytes: int | None = None, progress: bool = True,
            interval: float = 10.0) -> dict[str, Any]:
    """One case: the sidecar's idle RSS, its peak after `reads` answers and one request of each view,
    the upstream read every `interval` seconds (its timeout the same)."""
    say = progress_printer(progress, "proxy_memory")
    limit = MAX_BODY_BYTES - SLACK if body_bytes is None else body_bytes
    # The most sample lines a read may have (the feed refuses more before parsing), less one.
    lines = READ_LINES_PER_SERIES * RanksConfig().max_series_total + MAX_PASS_THROUGH_SAMPLES - 1
    make = BODIES[case]
    def body(number: int) -> bytes:
        # The read at start-up gets an empty answer, so that the anchor is the sidecar before any hostile one.
        return make(number, limit, lines) if number else b""

    upstream = _Upstream(body, changes=case == "rotating")
    sample = body(1)
    lines = sample.count(b"\n")
    say(f"{case}: answers of {len(sample) / MB:.1f} MB ({lines} lines); starting the sidecar ...")
    config = (f"upstreams:\n  - url: {upstream.url}\n    name: hostile\n    interval_seconds: {interval:g}\n"
              f"    timeout_seconds: {interval:g}\n")
    try:
        with Sidecar(config_yaml=config) as sidecar:
            idle = _status_bytes(sidecar.pid, "VmRSS")
            deadline = time.monotonic() + 60 + 30 * reads
            while upstream.served < reads + 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            views = {}
            for path in ("/metrics", "/api/v1/status", "/"):
                with urllib.request.urlopen(f"http://127.0.0.1:{sidecar.port}{path}", timeout=60) as response:
                    views[path] = len(response.read())
            peak = _status_bytes(sidecar.pid, "VmHWM")
            alive = sidecar.proc.poll() is None
            say(f"{case}: {upstream.served - 2} hostile reads ended, peak RSS {peak / MB:.1f} MB (idle {idle / MB:.1f} MB); "
                f"/metrics {views['/metrics'] / MB:.2f} MB, status {views['/api/v1/status'] / MB:.2f} MB, "
                f"page {views['/'] / MB:.2f} MB")
    finally:
        upstream.close()
    return {"case": case, "idle_rss": idle, "peak_rss": peak, "answers": upstream.served - 2, "answer_bytes": len(sample),
            "views": views, "alive": alive}


def run(reads: int = 3, cases: tuple[str, ...] = CASES, body_bytes: int | None = None,
        progress: bool = True, interval: float = 10.0) -> list[dict[str, Any]]:
    """One row per case; `body_bytes` smaller than the cap, and a shorter `interval`, only for a quick pass."""
    limit = memory_limit_bytes()
    rows = []
    for case in cases:
        m = measure(case, reads, body_bytes, progress, interval)
        peak = m["peak_rss"] / MB
        rows.append(row(f"proxy memory: peak RSS, hostile upstream ({case})", peak, "MB",
                        "the same sidecar idle", m["idle_rss"] / MB, peak / (m["idle_rss"] / MB),
                        f"value < the pod's limit {limit / MB:.0f}", m["alive"] and m["peak_rss"] < limit,
                        ratio_means="value / anchor", answers=m["answers"], answer_bytes=m["answer_bytes"],
                        view_bytes=m["views"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=3, help="answers the sidecar reads before the views are asked for")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(CASES)}")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    cases = chosen_cases(parser, args.only, CASES)
    report(run(args.reads, cases), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
