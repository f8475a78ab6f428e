"""Status API: time to answer GET /api/v1/status and GET / (the status page) at 256 ranks.

    python -m bench.status_api [--ranks 256] [--repeats 30] [--http-repeats 20] [--json FILE]

Ranks are laid out tp 8 x pp 2 x dp 16 (16 replica groups of 16) and say so in their hello's world,
so the document works out every group's expected layout and missing positions (none missing: the
work is the same, the listing empty). Each holds the full catalog as the scrape bench builds it
(every family and label set with a value). Before each timed round every rank pushes a snapshot
with every value moved, so nothing a previous round computed or rendered can be reused, as
between two refreshes of a page that 256 busy ranks push to.

In-process (handler time, one core): the sidecar's state fed the client library's exact
snapshot bytes; timed are `StatusView.encode()` (the whole /api/v1/status body) and
`render_page(StatusView.document())` (the whole / body). The bandwidth history is full (60 points),
and one housekeeping sample of it (`BandwidthHistory.sample`) is timed too.

Over HTTP: a real `serve` process fed over its Unix socket by raw-protocol ranks in the same
layout; latency is client-side, request to the last byte of the body, on a kept-alive connection.

Anchor: the /metrics render of the same state in the same round (`TextRenderer.render()` in
process, GET /metrics over HTTP), so the ratio says what the page costs next to a scrape.
Contenders alternate round by round so that the machine's noise hits them alike.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import time
from typing import Any

from exporter.catalog import default_catalog
from exporter.client.metrics import MetricSet
from exporter.config import SidecarConfig
from exporter.protocol.framing import encode_frame, encode_message, encode_payload
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    Hello,
    RankId,
    Welcome,
    World,
    parse_client_message,
)
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.page import render_page
from exporter.sidecar.expose.render import TextRenderer
from exporter.sidecar.expose.status import BandwidthHistory, StatusView
from exporter.sidecar.process import serving_gc

from bench.common import (
    NAMESPACE,
    STATIC_LABELS,
    Sidecar,
    advance_all,
    full_metric_set,
    percentile,
    progress_printer,
    read_reply,
    snapshot_payload,
)
from bench.report import report, row

GOAL_MS = 50.0
TP, PP = 8, 2  # dp follows from the rank count: 256 ranks are dp 16


def layout(index: int) -> dict[str, int]:
    """Rank keys of the index-th rank of a tp 8 x pp 2 x dp N layout."""
    return {"tp_rank": index % TP, "pp_rank": (index // TP) % PP, "dp_rank": index // (TP * PP)}


def hello_payload(index: int, ranks: int) -> bytes:
    """The hello of the index-th of `ranks` ranks, with a fresh epoch and the layout's world."""
    world = World(tp_size=TP, pp_size=PP, dp_size=max(1, -(-ranks // (TP * PP))))
    return encode_payload(Hello(protocol=PROTOCOL_VERSION, epoch=os.urandom(8).hex(), pid=os.getpid(),
                                rank=RankId(**layout(index)), labels=dict(STATIC_LABELS), world=world))


class FeedRanks:
    """Ranks whose full-catalog MetricSets move between pushes, as busy ranks' do."""

    def __init__(self, count: int) -> None:
        catalog = default_catalog()
        self.sets: list[MetricSet] = [full_metric_set(catalog, seed=i) for i in range(count)]
        self.rngs = [random.Random(1000 + i) for i in range(count)]
        self.seq = 0

    def payloads(self) -> list[bytes]:
        """One snapshot per rank, every value moved since the last ones."""
        self.seq += 1
        if self.seq > 1:
            for metrics, rng in zip(self.sets, self.rngs):
                advance_all(metrics, rng)
        return [snapshot_payload(metrics, self.seq) for metrics in self.sets]


def _ms(fn: Any) -> tuple[float, Any]:
    started = time.perf_counter()
    out = fn()
    return (time.perf_counter() - started) * 1000, out


def measure_in_process(ranks: int, repeats: int, progress: bool) -> dict[str, Any]:
    """Per round: push every rank, then time the /metrics render, /api/v1/status and / (in turn)."""
    say = progress_printer(progress, "status_api/in-process")
    catalog = default_catalog()
    state = SidecarState(catalog)
    stats = SidecarHealth()
    feed = FeedRanks(ranks)
    rank_states: list[RankState] = [state.hello(object(), parse_client_message(hello_payload(i, ranks))).rank
                                    for i in range(ranks)]

    def push_all() -> None:
        for rank, payload in zip(rank_states, feed.payloads()):
            result = state.snapshot(rank, parse_client_message(payload))
            if result.rejections or result.ignored:
                raise RuntimeError(f"the state refused a snapshot: {result.rejections[:3]}")

    push_all()
    history = BandwidthHistory(b.name for b, _ in catalog.bandwidth_pairs())
    view = StatusView(SidecarConfig(), state, stats, history=history)
    renderer = TextRenderer(SidecarCollector(state, stats, NAMESPACE))
    say(f"{ranks} ranks: filling the bandwidth history ({history.points} samples) ...")
    sample_ms = []
    for point in range(history.points):
        elapsed, _ = _ms(lambda point=point: history.sample(state, 1_764_400_000.0 + point))
        sample_ms.append(elapsed)
    say(f"{ranks} ranks: {repeats} rounds, each pushing every rank, then timing /metrics, /api/v1/status and / ...")
    metrics_ms, status_ms, page_ms = [], [], []
    sizes: dict[str, int] = {}
    with serving_gc():
        for _ in range(repeats):
            push_all()
            elapsed, body = _ms(renderer.render)
            metrics_ms.append(elapsed)
            sizes["metrics"] = len(body)
            elapsed, body = _ms(view.encode)
            status_ms.append(elapsed)
            sizes["status"] = len(body)
            elapsed, text = _ms(lambda: render_page(view.document()))
            page_ms.append(elapsed)
            sizes["page"] = len(text.encode())
            sample, _ = _ms(lambda: history.sample(state, time.time()))
            sample_ms.append(sample)
    check = json.loads(view.encode())
    if len(check["streams"]) != ranks or {r["state"] for r in check["streams"]} != {"live"}:
        raise RuntimeError("the status document does not list every rank as live")
    unfilled = max(1, -(-ranks // (TP * PP))) * TP * PP - ranks  # the last dp group's, when ranks are not whole groups
    if any(v["expected"] is None for v in check["servers"]) or check["totals"]["missing"] != unfilled:
        raise RuntimeError(f"the status document's layout is not the bench's: {check['totals']}")
    return {"metrics_ms": metrics_ms, "status_ms": status_ms, "page_ms": page_ms, "sample_ms": sample_ms,
            "groups": len(check["groups"]), "sizes": sizes}


class _Rank:
    """One raw-protocol rank connection in the bench's layout (hello, then full snapshots)."""

    def __init__(self, socket_path: str, index: int, ranks: int) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(socket_path)
        self.sock.sendall(encode_frame(hello_payload(index, ranks)))
        reply = read_reply(self.sock)
        if not isinstance(reply, Welcome):
            raise RuntimeError(f"rank {index}: the sidecar refused hello: {reply}")

    def send(self, payload: bytes) -> None:
        self.sock.sendall(encode_frame(payload))

    def close(self) -> None:
        try:
            self.sock.sendall(encode_message(Bye()))
        except OSError:
            pass
        self.sock.close()


def measure_http(ranks: int, repeats: int, progress: bool) -> dict[str, Any]:
    """Per round: every rank pushes, the sidecar applies it all (untimed), then GET /metrics, /api/v1/status, /."""
    say = progress_printer(progress, "status_api/http")
    feed = FeedRanks(ranks)
    with Sidecar() as sidecar:
        say(f"{ranks} ranks: connecting to a `serve` process ...")
        conns = [_Rank(sidecar.socket_path, i, ranks) for i in range(ranks)]
        try:
            pushed = 0
            latencies: dict[str, list[float]] = {"/metrics": [], "/api/v1/status": [], "/": []}
            say(f"{ranks} ranks: {repeats} rounds of GET /metrics, /api/v1/status and / after every rank pushed ...")
            for round_ in range(repeats + 1):
                for conn, payload in zip(conns, feed.payloads()):
                    conn.send(payload)
                pushed += ranks
                sidecar.wait_applied(pushed)
                for path, times in latencies.items():
                    elapsed, _ = _ms(lambda path=path: sidecar.get(path))
                    if round_:  # the first round warms the connection and the sidecar's caches of names
                        times.append(elapsed)
            status = json.loads(sidecar.get("/api/v1/status"))
            if len(status["streams"]) != ranks:
                raise RuntimeError(f"the sidecar lists {len(status['streams'])} streams, not {ranks}")
        finally:
            for conn in conns:
                conn.close()
    return latencies


def run(ranks: int = 256, repeats: int = 30, http_repeats: int = 20, progress: bool = True) -> list[dict[str, Any]]:
    """Rows: p50 and p99 of /api/v1/status and / in process and over HTTP, and the history sample."""
    inproc = measure_in_process(ranks, repeats, progress)
    http = measure_http(ranks, http_repeats, progress)
    rows = []
    extra = {"ranks": ranks, "layout": f"tp {TP} x pp {PP} x dp {max(1, ranks // (TP * PP))}"}
    for label, q in (("p50", 50.0), ("p99", 99.0)):
        anchor = percentile(inproc["metrics_ms"], q)
        for what, key in (("/api/v1/status", "status_ms"), ("/ (page)", "page_ms")):
            value = percentile(inproc[key], q)
            rows.append(row(f"status {label}: {what} handler, {ranks} ranks", value, "ms",
                            "/metrics render of the same state", anchor, value / anchor,
                            f"value <= {GOAL_MS:g}", value <= GOAL_MS, ratio_means="value / anchor",
                            bytes=inproc["sizes"]["status" if key == "status_ms" else "page"], **extra))
        http_anchor = percentile(http["/metrics"], q)
        for path in ("/api/v1/status", "/"):
            value = percentile(http[path], q)
            rows.append(row(f"status {label}: GET {path} over HTTP, {ranks} ranks", value, "ms",
                            "GET /metrics, same sidecar and round", http_anchor, value / http_anchor,
                            f"value <= {GOAL_MS:g}", value <= GOAL_MS, ratio_means="value / anchor", **extra))
    sample = statistics.median(inproc["sample_ms"])
    anchor = statistics.median(inproc["metrics_ms"])
    rows.append(row(f"status: bandwidth history sample (every 5 s), {ranks} ranks", sample, "ms",
                    "/metrics render of the same state", anchor, sample / anchor, None, None,
                    ratio_means="value / anchor", **extra))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=256, help="rank count (tp 8 x pp 2 x dp ranks/16)")
    parser.add_argument("--repeats", type=int, default=30, help="in-process rounds")
    parser.add_argument("--http-repeats", type=int, default=20, help="rounds over HTTP")
    parser.add_argument("--json", help="also write the rows as JSON to this file")
    args = parser.parse_args(argv)
    report(run(args.ranks, args.repeats, args.http_repeats), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
