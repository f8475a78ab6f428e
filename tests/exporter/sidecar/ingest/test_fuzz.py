"""Fuzzing the decoder and the ingest server with 100,000 generated frames against a live sidecar.

Every bad frame is built to cost exactly one rejection, so the sidecar's rejection counters must
account for all of them; /metrics must answer 200 with parseable output throughout; and four
well-behaved ranks pushing alongside must end with exact values.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.client import RankClient
from exporter.protocol.framing import FrameDecoder, encode_frame
from exporter.protocol.messages import ErrorMessage, Welcome, parse_server_message
from tests.helpers import Scrape, SidecarThread, http_get, sidecar_config, wait_until

FRAMES = int(os.environ.get("HICACHE_FUZZ_FRAMES", "100000"))
MAX_FRAME = 64 * 1024
SCRAPE_EVERY = 5000
BOUNDS = [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0]
INJECTIONS = ['a"b', "line\nbreak", "back\\slash", "}{", "é\u2028\u0000x", '"} 1\nfake_metric 2']


class FuzzConnection:
    """One raw connection under a fuzz identity; reconnects after the sidecar closes it."""

    def __init__(self, path: str, tp: int) -> None:
        self.path, self.tp = path, tp
        self.seq = 0
        self.counter_value = 1000.0  # the last value of evicted_tokens_total the sidecar applied
        self.applied = False  # a snapshot was applied on the open connection
        self.sock: socket.socket | None = None
        self.decoder = FrameDecoder()
        self.replies: list[Any] = []

    def ensure(self) -> None:
        if self.sock is not None:
            return
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(self.path)
        self.decoder = FrameDecoder()
        self.replies = []
        # Applied on this connection: a value going down in a reconnect's first snapshot is an
        # epoch_conflict, not counter_decreased (test_state's epoch conflict tests cover it).
        self.applied = False
        self.send(json.dumps({"type": "hello", "protocol": 1, "epoch": f"fuzz-{self.tp}", "pid": 1,
                              "rank": {"tp_rank": self.tp, "pp_rank": 0, "dp_rank": 9}, "labels": {"fuzz": "1"}}).encode())
        reply = self.recv()
        assert isinstance(reply, Welcome), reply

    def send(self, payload: bytes, raw: bool = False) -> None:
        assert self.sock is not None
        self.sock.sendall(payload if raw else encode_frame(payload))

    def recv(self) -> Any:
        assert self.sock is not None
        while not self.replies:
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self.replies.extend(parse_server_message(f) for f in self.decoder.feed(chunk))
        return self.replies.pop(0)

    def expect_reply(self, code: str) -> None:
        reply = self.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == code, reply

    def expect_close(self, code: str) -> None:
        """The sidecar answers `code`, then closes; the identity is free again once we see EOF."""
        reply = self.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == code, reply
        while self.recv() is not None:
            pass
        self.drop()

    def drop(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def snapshot(self, *samples: dict[str, Any], raw_samples: str | None = None) -> bytes:
        self.seq += 1
        body = raw_samples if raw_samples is not None else json.dumps(list(samples))
        return f'{{"type":"snapshot","seq":{self.seq},"time":1.5,"samples":{body}}}'.encode()


def good_counter(conn: FuzzConnection) -> dict[str, Any]:
    conn.counter_value += 1
    return {"family": "evicted_tokens_total", "labels": {}, "value": conn.counter_value}


# --- generators: each returns the rejection reason it must cause (None: accepted) ---

def sample_level(rng: random.Random, conn: FuzzConnection) -> str:
    kind = rng.randrange(10)
    if kind == 0:
        bad, reason = {"family": f"no_such_{rng.randrange(10**6)}_total", "labels": {}, "value": 1}, "unknown_family"
    elif kind == 1:
        name = rng.choice(["po\nol", 'p"l', "tp_rank", "pool2"])
        bad, reason = {"family": "load_back_tokens_total", "labels": {name: "kv"}, "value": 1}, "wrong_labels"
    elif kind == 2:
        bad, reason = {"family": "load_back_duration_seconds", "labels": {}, "value": 3}, "type_mismatch"
    elif kind == 3:
        bad = {"family": "hicache_backup_dropped_tokens_total", "labels": {}, "value": -rng.random() - 0.1}
        reason = "invalid_value"
    elif kind == 4 and conn.applied:
        bad = {"family": "evicted_tokens_total", "labels": {}, "value": conn.counter_value - 1 - rng.randrange(100)}
        reason = "counter_decreased"
        conn.send(conn.snapshot(bad))
        conn.expect_reply(reason)
        return reason
    elif kind == 5:
        bounds = list(BOUNDS)
        rng.shuffle(bounds)
        buckets = [[b, 0] for b in bounds] + [["+Inf", 0]]
        bad = {"family": "eviction_duration_seconds", "labels": {}, "buckets": buckets, "sum": 0, "count": 0}
        reason = "bucket_mismatch"
    elif kind == 6:
        buckets = [[b, 5 - i % 3] for i, b in enumerate(BOUNDS)] + [["+Inf", 5]]
        bad = {"family": "eviction_duration_seconds", "labels": {}, "buckets": buckets, "sum": 0, "count": 5}
        reason = "bucket_mismatch"
    elif kind == 7:  # counts no float holds: they once broke /metrics for everyone, for good
        huge = 10 ** rng.randrange(20, 400)
        buckets = [[b, huge] for b in BOUNDS] + [["+Inf", huge]]
        bad = {"family": "eviction_duration_seconds", "labels": {}, "buckets": buckets, "sum": 1.0, "count": huge}
        reason = "invalid_value"
    elif kind == 8:
        bound = rng.choice(["+inf", "NaN", "Inf", "-Inf", "0.5", ""])
        bad = {"family": "prefetch_pgs", "labels": {}, "buckets": [[bound, 0], ["+Inf", 0]], "sum": 0, "count": 0}
        reason = "bucket_mismatch"
    elif kind == 9:
        bad = {"family": "load_back_bytes_total", "labels": {}, "value": rng.choice([1e300, 2.0**63 * 2, 1.7e308])}
        reason = "invalid_value"
    else:
        bad, reason = {"family": "no_such_family_total", "labels": {}, "value": 1}, "unknown_family"
    samples = [good_counter(conn), bad]
    rng.shuffle(samples)
    conn.send(conn.snapshot(*samples))
    conn.expect_reply(reason)  # the connection stays open and the good sample applied
    conn.applied = True
    return reason


def connection_level(rng: random.Random, conn: FuzzConnection) -> str:
    kind = rng.randrange(8)
    if kind == 0:
        payload, reason = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))), "malformed_frame"
        if payload[:1] in (b"{", b"["):
            payload = b"\x00" + payload
    elif kind == 1:
        payload, reason = b'{"type":"snapshot","seq":1,"time":1,"samples":[{"family":"\xff\xfe"}]}', "malformed_frame"
    elif kind == 2:
        depth = rng.randrange(300, 5000)
        payload, reason = b"[" * depth + b"]" * depth, "malformed_frame"
    elif kind == 3:
        payload = conn.snapshot(raw_samples='[{"family":"evicted_tokens_total","labels":{},"value":NaN}]')
        reason = "malformed_frame"
    elif kind == 4:
        value = rng.choice(["7", None, [], {}])
        payload = conn.snapshot(raw_samples=json.dumps([{"family": "evicted_tokens_total", "labels": {}, "value": value}]))
        reason = "malformed_frame"
    elif kind == 5:
        conn.send(struct.pack(">I", rng.randrange(MAX_FRAME + 1, 1 << 32)), raw=True)
        conn.expect_close("frame_too_large")
        return "frame_too_large"
    elif kind == 6:
        payload = json.dumps({"type": "hello", "protocol": 1, "epoch": "x", "pid": 1,
                              "rank": {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}}).encode()
        reason = "malformed_frame"  # a second hello on a connection
    else:
        huge = json.dumps([{"family": "evicted_tokens_total", "labels": {}, "value": 1}] * (MAX_FRAME // 40))
        payload, reason = conn.snapshot(raw_samples=huge), "frame_too_large"
    conn.send(payload)
    conn.expect_close(reason)
    return reason


def truncated(rng: random.Random, conn: FuzzConnection) -> str:
    frame = encode_frame(conn.snapshot(good_counter(conn)))
    conn.counter_value -= 1  # this increment never reaches the sidecar
    conn.send(frame[: rng.randrange(1, len(frame) - 1)], raw=True)
    assert conn.sock is not None
    conn.sock.shutdown(socket.SHUT_WR)
    while conn.recv() is not None:
        pass
    conn.drop()
    return "malformed_frame"


def accepted_injection(rng: random.Random, conn: FuzzConnection) -> None:
    value = rng.choice(INJECTIONS) + str(rng.randrange(20))
    sample = {"family": "storage_prefetch_unfulfilled_tokens_total", "labels": {"reason": value}, "value": 1}
    conn.send(conn.snapshot(good_counter(conn), sample))
    conn.applied = True
    return None


@pytest.fixture
def fuzz_sidecar(socket_dir: Path) -> Iterator[SidecarThread]:
    config = sidecar_config(socket_dir / "m.sock", ingest={"max_frame_bytes": MAX_FRAME},
                            ranks={"max_series_per_rank": 100_000})
    running = SidecarThread(config).start()
    try:
        yield running
    finally:
        running.stop()


def test_fuzzed_frames_never_break_the_sidecar(fuzz_sidecar: SidecarThread) -> None:
    rng = random.Random(20261129)
    good = []
    for tp in range(4):
        client = RankClient(fuzz_sidecar.socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0},
                            labels={"cache_type": "HiRadixCache"}, interval=0.2)
        client.counter("load_back_bytes_total").inc(1000 * (tp + 1))
        good.append(client.start())
    conns = [FuzzConnection(fuzz_sidecar.socket_path, tp) for tp in range(8)]
    expected: Counter[str] = Counter()
    generators: list[tuple[float, Callable[[random.Random, FuzzConnection], str | None]]] = [
        (0.55, sample_level), (0.25, connection_level), (0.05, truncated), (0.15, accepted_injection)]
    weights = [w for w, _ in generators]
    started = time.monotonic()
    for i in range(FRAMES):
        conn = conns[i % len(conns)]
        conn.ensure()
        generate = rng.choices([g for _, g in generators], weights)[0]
        reason = generate(rng, conn)
        if reason is not None:
            expected[reason] += 1
        if i % SCRAPE_EVERY == SCRAPE_EVERY - 1:
            status, body, _ = http_get(fuzz_sidecar.url + "/metrics")
            assert status == 200
            Scrape(body.decode())  # parseable, whatever the label values held
    for conn in conns:
        if conn.sock is not None:
            conn.send(b'{"type":"bye"}')
            while conn.recv() is not None:
                pass
            conn.drop()
    elapsed = time.monotonic() - started

    def counted() -> Counter[str]:
        scrape = fuzz_sidecar.scrape()
        return Counter({s.labels["reason"]: int(s.value) for s in scrape.find("hicache_exporter_rejections_total") if s.value})

    wait_until(lambda: counted() == expected, timeout=30)
    for client in good:
        client.close()
        assert client.stats.failures == 0
    scrape = fuzz_sidecar.scrape()
    for tp in range(4):
        got = scrape.value("sglang_load_back_bytes_total", tp_rank=str(tp), dp_rank="0", cache_type="HiRadixCache")
        assert got == 1000 * (tp + 1)
    assert sum(expected.values()) > FRAMES * 0.8
    print(f"\nfuzz: {FRAMES} frames in {elapsed:.1f} s, rejections {dict(expected)}")
