"""Every rejection path of DESIGN §5 over a real Unix socket: the code, the count, the bystanders."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.errors import ErrorCode
from exporter.protocol.framing import encode_frame
from exporter.protocol.messages import ErrorMessage, Welcome
from tests.helpers import (
    LOOP_WAIT_SECONDS,
    RawClient,
    Scrape,
    SidecarThread,
    counter,
    hello,
    http_get,
    sidecar_config,
    snapshot,
    wait_until,
)

GOOD_TOKENS = 4096.0
GOOD_BYTES = 8388608.0


@pytest.fixture
def tight_sidecar(socket_dir: Path) -> Iterator[SidecarThread]:
    config = sidecar_config(
        socket_dir / "metrics.sock",
        ingest={"hello_timeout_seconds": 0.5, "idle_timeout_seconds": 1.0, "max_frame_bytes": 16384},
        ranks={"max_series_per_rank": 40},
    )
    running = SidecarThread(config).start()
    try:
        yield running
    finally:
        running.stop()


def _good_rank(sidecar: SidecarThread) -> RawClient:
    """A well-behaved rank whose values must survive every bad client."""
    client = RawClient(sidecar.socket_path)
    client.send(hello(tp=0, dp=0, epoch="good", cache_type="UnifiedRadixCache"))
    assert isinstance(client.recv(), Welcome)
    client.send(snapshot(1, counter("load_back_tokens_total", GOOD_TOKENS, pool="kv"),
                         counter("load_back_bytes_total", GOOD_BYTES)))
    wait_until(lambda: sidecar.scrape().find("sglang_load_back_bytes_total", tp_rank="0", dp_rank="0") != [])
    return client


def _assert_good_rank_intact(sidecar: SidecarThread) -> None:
    scrape = sidecar.scrape()
    assert scrape.value("sglang_load_back_tokens_total", tp_rank="0", dp_rank="0", pool="kv") == GOOD_TOKENS
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0", dp_rank="0") == GOOD_BYTES


def _rejections(sidecar: SidecarThread, code: ErrorCode) -> float:
    return sidecar.scrape().value("hicache_exporter_rejections_total", reason=code.value)


def _hello_then(client: RawClient, tp: int = 1) -> None:
    client.send(hello(tp=tp, dp=0, epoch=f"bad{tp}"))
    assert isinstance(client.recv(), Welcome)


CONNECTION_CASES: dict[ErrorCode, Callable[[RawClient], None]] = {
    ErrorCode.MALFORMED_FRAME: lambda c: (_hello_then(c), c.send_raw(encode_frame(b"{not json"))),
    ErrorCode.FRAME_TOO_LARGE: lambda c: c.send_raw(struct.pack(">I", 1 << 30)),
    ErrorCode.HELLO_REQUIRED: lambda c: c.send(snapshot(1, counter("load_back_bytes_total", 1))),
    ErrorCode.HELLO_TIMEOUT: lambda c: c.send_raw(b"\x00\x00"),  # half a header, then silence
    ErrorCode.INVALID_HELLO: lambda c: c.send(hello(tp=1, epoch="x", le="0.5")),
    ErrorCode.UNSUPPORTED_PROTOCOL: lambda c: c.send({**hello(tp=1), "protocol": 2}),
}


@pytest.mark.parametrize("code", list(CONNECTION_CASES), ids=lambda c: c.value)
def test_connection_level_rejection_closes_only_that_connection(tight_sidecar: SidecarThread, code: ErrorCode) -> None:
    good = _good_rank(tight_sidecar)
    before = _rejections(tight_sidecar, code)
    bad = RawClient(tight_sidecar.socket_path)
    CONNECTION_CASES[code](bad)
    reply = bad.recv()
    assert isinstance(reply, ErrorMessage), reply
    assert reply.code == code.value
    assert reply.message
    assert bad.closed_by_peer()
    bad.close()
    assert _rejections(tight_sidecar, code) == before + 1
    _assert_good_rank_intact(tight_sidecar)
    good.close()


def test_idle_connection_times_out_and_may_reconnect(tight_sidecar: SidecarThread) -> None:
    client = RawClient(tight_sidecar.socket_path)
    client.send(hello(tp=1, epoch="idle"))
    assert isinstance(client.recv(), Welcome)
    client.send(snapshot(1, counter("load_back_bytes_total", 5)))
    reply = client.recv()  # nothing more is sent: idle_timeout_seconds=1 runs out
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.IDLE_TIMEOUT.value
    assert client.closed_by_peer()
    assert _rejections(tight_sidecar, ErrorCode.IDLE_TIMEOUT) == 1
    again = RawClient(tight_sidecar.socket_path)
    again.send(hello(tp=1, epoch="idle"))
    welcome = again.recv()
    assert isinstance(welcome, Welcome) and welcome.reconnect
    again.send(snapshot(2, counter("load_back_bytes_total", 9)))
    wait_until(lambda: tight_sidecar.scrape().value("sglang_rollup_load_back_bytes_total") == 9)


def test_duplicate_rank_is_refused_while_the_identity_is_connected(sidecar: SidecarThread) -> None:
    first = RawClient(sidecar.socket_path)
    first.send(hello(tp=0, epoch="a"))
    assert isinstance(first.recv(), Welcome)
    second = RawClient(sidecar.socket_path)
    second.send(hello(tp=0, epoch="b"))
    reply = second.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.DUPLICATE_RANK.value
    assert second.closed_by_peer()
    assert sidecar.scrape().value("hicache_exporter_rejections_total", reason="duplicate_rank") == 1
    first.send({"type": "bye"})
    assert first.closed_by_peer()
    # Once the holder is gone, the same identity may connect (a restart with epoch b).
    wait_until(lambda: sidecar.scrape().value("hicache_exporter_connections") == 0)
    third = RawClient(sidecar.socket_path)
    third.send(hello(tp=0, epoch="b"))
    welcome = third.recv()
    assert isinstance(welcome, Welcome) and welcome.restart


def test_replaced_epoch_never_comes_back(sidecar: SidecarThread) -> None:
    for epoch in ("old", "new"):
        client = RawClient(sidecar.socket_path)
        client.send(hello(tp=0, epoch=epoch))
        assert isinstance(client.recv(), Welcome)
        client.send({"type": "bye"})
        assert client.closed_by_peer()
    ghost = RawClient(sidecar.socket_path)
    ghost.send(hello(tp=0, epoch="old"))
    reply = ghost.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.STALE_EPOCH.value
    assert sidecar.scrape().value("hicache_exporter_rejections_total", reason="stale_epoch") == 1


def test_too_many_connections(socket_dir: Path) -> None:
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", ingest={"max_connections": 1})).start()
    try:
        good = _good_rank(running)
        extra = RawClient(running.socket_path)
        reply = extra.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.TOO_MANY_CONNECTIONS.value
        assert _rejections(running, ErrorCode.TOO_MANY_CONNECTIONS) == 1
        _assert_good_rank_intact(running)
        good.close()
    finally:
        running.stop()


def test_peer_uid_not_allowed_is_refused(socket_dir: Path) -> None:
    other_uid = os.getuid() + 4242
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", ingest={"allowed_uids": [other_uid]})).start()
    try:
        client = RawClient(running.socket_path)
        reply = client.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.PEER_REFUSED.value
        assert str(os.getuid()) in reply.message
        assert _rejections(running, ErrorCode.PEER_REFUSED) == 1
    finally:
        running.stop()


def _histogram(buckets: list[list[Any]], total: float, count: int) -> dict[str, Any]:
    return {"family": "load_back_duration_seconds", "labels": {}, "buckets": buckets, "sum": total, "count": count}


GOOD_BOUNDS = [0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009, 0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0]
SAMPLE_CASES: dict[ErrorCode, dict[str, Any]] = {
    ErrorCode.UNKNOWN_FAMILY: counter("no_such_family_total", 1),
    ErrorCode.WRONG_LABELS: counter("load_back_tokens_total", 1, pool="kv", extra="x"),
    ErrorCode.TYPE_MISMATCH: counter("load_back_duration_seconds", 1),
    ErrorCode.INVALID_VALUE: counter("evicted_tokens_total", -5),
    ErrorCode.BUCKET_MISMATCH: _histogram([[0.5, 2], ["+Inf", 1]], 0.1, 1),  # not cumulative
}


@pytest.mark.parametrize("code", list(SAMPLE_CASES), ids=lambda c: c.value)
def test_bad_sample_is_dropped_and_the_rest_applies(tight_sidecar: SidecarThread, code: ErrorCode) -> None:
    good = _good_rank(tight_sidecar)
    client = RawClient(tight_sidecar.socket_path)
    _hello_then(client)
    client.send(snapshot(1, SAMPLE_CASES[code], counter("hicache_backup_bytes_total", 77)))
    reply = client.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == code.value
    scrape = tight_sidecar.scrape()
    assert scrape.value("sglang_hicache_backup_bytes_total", tp_rank="1") == 77
    assert scrape.value("hicache_exporter_rejections_total", reason=code.value) == 1
    # The connection stays open: a later good snapshot applies.
    client.send(snapshot(2, counter("hicache_backup_bytes_total", 99)))
    wait_until(lambda: tight_sidecar.scrape().value("sglang_hicache_backup_bytes_total", tp_rank="1") == 99)
    _assert_good_rank_intact(tight_sidecar)
    good.close()


def test_counter_going_down_within_an_epoch_is_dropped(tight_sidecar: SidecarThread) -> None:
    client = RawClient(tight_sidecar.socket_path)
    _hello_then(client)
    client.send(snapshot(1, counter("load_back_bytes_total", 100)))
    client.send(snapshot(2, counter("load_back_bytes_total", 60), counter("evicted_tokens_total", 5)))
    reply = client.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.COUNTER_DECREASED.value
    scrape = tight_sidecar.scrape()
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="1") == 100
    assert scrape.value("sglang_evicted_tokens_total", tp_rank="1") == 5
    assert scrape.value("sglang_rollup_load_back_bytes_total") == 100


def test_series_limit(tight_sidecar: SidecarThread) -> None:
    client = RawClient(tight_sidecar.socket_path)
    _hello_then(client)
    samples = [counter("hicache_dropped_tokens_total", 1, reason="host_pressure", pool=f"p{i}") for i in range(50)]
    client.send(snapshot(1, *samples))
    reply = client.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.SERIES_LIMIT.value
    assert "and 9 more" in reply.message
    scrape = tight_sidecar.scrape()
    assert len(scrape.find("sglang_hicache_dropped_tokens_total", tp_rank="1")) == 40
    assert scrape.value("hicache_exporter_rejections_total", reason="series_limit") == 10


def test_series_limit_weighs_the_labels_a_series_writes(socket_dir: Path) -> None:
    """The longest static labels the limits allow (8 values of 288) and own values of 128: each series of
    hicache_dropped_tokens_total weighs 11 of max_series_total and its rollup 6 (keys.series_cost), so a
    budget of 100 takes 5 of 12, where it takes every one of short labels; the 7 refused are counted."""
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", ranks={"max_series_total": 100})).start()
    try:
        client = RawClient(running.socket_path)
        client.send(hello(tp=0, epoch="long", **{f"l{i}": chr(97 + i) * 288 for i in range(8)}))
        assert isinstance(client.recv(), Welcome)
        client.send(snapshot(1, *(counter("hicache_dropped_tokens_total", 1, reason=f"{j:03d}" + "r" * 125, pool="p" * 128)
                                  for j in range(12))))
        reply = client.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.SERIES_LIMIT.value
        assert "counts 11" in reply.message and "and 6 more" in reply.message
        scrape = running.scrape()
        assert len(scrape.find("sglang_hicache_dropped_tokens_total", tp_rank="0")) == 5
        assert scrape.value("hicache_exporter_rejections_total", reason="series_limit") == 7
        client.close()
    finally:
        running.stop()


def test_old_seq_is_ignored_and_counted(sidecar: SidecarThread) -> None:
    client = RawClient(sidecar.socket_path)
    client.send(hello(tp=0, epoch="e"))
    assert isinstance(client.recv(), Welcome)
    client.send(snapshot(5, counter("load_back_bytes_total", 50)))
    client.send(snapshot(4, counter("load_back_bytes_total", 40)))
    client.send(snapshot(5, counter("load_back_bytes_total", 45)))
    wait_until(lambda: sidecar.scrape().value("hicache_exporter_rejections_total", reason="old_seq") == 2)
    assert sidecar.scrape().value("sglang_load_back_bytes_total", tp_rank="0") == 50


def test_second_hello_on_a_connection_is_malformed(sidecar: SidecarThread) -> None:
    client = RawClient(sidecar.socket_path)
    client.send(hello(tp=0, epoch="e"))
    assert isinstance(client.recv(), Welcome)
    client.send(hello(tp=1, epoch="e"))
    reply = client.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.MALFORMED_FRAME.value
    assert client.closed_by_peer()


def test_a_count_no_float_can_hold_is_dropped_and_metrics_keeps_answering(tight_sidecar: SidecarThread) -> None:
    """10**400 in a per_shard histogram once turned every later scrape into a 500, for good."""
    good = _good_rank(tight_sidecar)
    client = RawClient(tight_sidecar.socket_path)
    _hello_then(client)
    huge = 10**400
    frame = {"type": "snapshot", "seq": 1, "time": 1.0, "samples": [
        _histogram([*([b, huge] for b in GOOD_BOUNDS), ["+Inf", huge]], 1.0, huge),
        {"family": "hicache_backup_bytes_total", "labels": {}, "value": 77},
    ]}
    client.send_raw(encode_frame(json.dumps(frame).encode()))
    reply = client.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.INVALID_VALUE.value
    status, body, _ = http_get(tight_sidecar.url + "/metrics")
    assert status == 200 and str(huge)[:30] not in body.decode()
    scrape = Scrape(body.decode())
    assert scrape.value("sglang_hicache_backup_bytes_total", tp_rank="1") == 77
    client.close()
    assert http_get(tight_sidecar.url + "/metrics")[0] == 200  # and still after the rank left
    _assert_good_rank_intact(tight_sidecar)
    good.close()


def test_partial_frames_of_all_connections_together_are_bounded(socket_dir: Path) -> None:
    """400 connections each holding most of a 1 MiB frame once took the sidecar to about 470 MB."""
    config = sidecar_config(socket_dir / "m.sock", ingest={"max_buffered_bytes": 4 << 20})
    running = SidecarThread(config).start()
    peers: list[RawClient] = []
    try:
        good = _good_rank(running)
        # Before a hello nobody may start a large frame.
        early = RawClient(running.socket_path)
        early.send_raw(struct.pack(">I", 1 << 20) + b"{" * 1000)
        reply = early.recv()
        assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.FRAME_TOO_LARGE.value
        early.close()
        # After one, half frames add up only to ingest.max_buffered_bytes.
        refused = 0
        for tp in range(1, 13):
            peer = RawClient(running.socket_path)
            peer.send(hello(tp=tp, epoch=f"half{tp}"))
            assert isinstance(peer.recv(), Welcome)
            try:
                peer.send_raw(struct.pack(">I", 1 << 20) + b" " * (600 << 10))  # 600 KiB of a 1 MiB frame
            except (BrokenPipeError, ConnectionResetError):
                pass
            peers.append(peer)
        def settled() -> bool:  # every half frame is either held whole or refused
            buffered = running.call(lambda: running.sidecar.ingest.buffered)  # type: ignore[union-attr]
            return (_rejections(running, ErrorCode.FRAME_TOO_LARGE) - 1) + buffered // (600 << 10) == 12

        wait_until(settled, timeout=LOOP_WAIT_SECONDS)
        held = running.call(lambda: running.sidecar.ingest.buffered)  # type: ignore[union-attr]
        assert held <= 4 << 20
        refused = _rejections(running, ErrorCode.FRAME_TOO_LARGE) - 1
        assert refused >= 12 - (4 << 20) // (600 << 10)  # those past the budget were closed
        # A well-behaved rank's next snapshot still goes through.
        good.send(snapshot(2, counter("load_back_tokens_total", GOOD_TOKENS + 1, pool="kv"),
                           counter("load_back_bytes_total", GOOD_BYTES)))
        wait_until(lambda: running.scrape().value("sglang_load_back_tokens_total", tp_rank="0", pool="kv") == GOOD_TOKENS + 1)
        for peer in peers:
            peer.close()
        wait_until(lambda: running.call(lambda: running.sidecar.ingest.buffered) == 0)  # type: ignore[union-attr]
        good.close()
    finally:
        running.stop()


def test_an_impostor_with_a_ranks_epoch_cannot_freeze_it(sidecar: SidecarThread) -> None:
    """Issue 19, finding 10, over the socket: after a sidecar restart an impostor says hello first
    with the real rank's (public) epoch and seq 2**64-1; the real rank's reconnect must flow."""
    impostor = RawClient(sidecar.socket_path)
    impostor.send(hello(tp=0, epoch="real"))
    assert isinstance(impostor.recv(), Welcome)
    impostor.send(snapshot(2**64 - 1, counter("load_back_bytes_total", 5_000_000)))
    impostor.send({"type": "bye"})
    assert impostor.closed_by_peer()
    real = RawClient(sidecar.socket_path)
    real.send(hello(tp=0, epoch="real"))
    welcome = real.recv()
    assert isinstance(welcome, Welcome) and welcome.reconnect
    real.send(snapshot(50, counter("load_back_bytes_total", 400)))
    reply = real.recv()  # the rank hears why its numbers restarted
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.EPOCH_CONFLICT.value
    scrape = sidecar.scrape()
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 400
    assert scrape.value("sglang_rollup_load_back_bytes_total") == 5_000_400  # never falls
    assert scrape.value("hicache_exporter_rejections_total", reason="epoch_conflict") == 1
    assert scrape.value("hicache_exporter_rejections_total", reason="old_seq") == 0
    real.send(snapshot(51, counter("load_back_bytes_total", 450)))
    wait_until(lambda: sidecar.scrape().value("sglang_load_back_bytes_total", tp_rank="0") == 450)
    # While the rank is away again, a forged seq on its epoch is refused and answered.
    real.send({"type": "bye"})
    assert real.closed_by_peer()
    forger = RawClient(sidecar.socket_path)
    forger.send(hello(tp=0, epoch="real"))
    assert isinstance(forger.recv(), Welcome)
    forger.send(snapshot(2**64 - 1, counter("load_back_bytes_total", 9_000_000)))
    reply = forger.recv()
    assert isinstance(reply, ErrorMessage) and reply.code == ErrorCode.SEQ_JUMP.value
    scrape = sidecar.scrape()
    assert scrape.value("hicache_exporter_rejections_total", reason="seq_jump") == 1
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 450
