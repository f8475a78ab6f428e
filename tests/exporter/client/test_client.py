"""RankClient against a real sidecar: pushes, survives the sidecar's absence, closes cleanly."""

from __future__ import annotations

import json
import logging
import re
import time
from pathlib import Path

import pytest

from exporter.catalog import catalog_from_data, default_catalog
from exporter.client import LabelError, RankClient
from exporter.protocol.framing import encode_payload
from exporter.protocol.messages import Hello, Snapshot, Welcome, World, parse_client_message
from tests.helpers import RawClient, SidecarThread, counter, hello, http_get, sidecar_config, snapshot, wait_until

RANK = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}


def _ranks(sidecar: SidecarThread) -> list[dict]:
    return json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]


def test_push_reaches_metrics_and_close_says_bye(sidecar: SidecarThread) -> None:
    client = RankClient(sidecar.socket_path, rank=RANK, labels={"cache_type": "HiRadixCache"}, interval=0.05)
    tokens = client.counter("load_back_tokens_total", pool="kv")
    client.start()
    for _ in range(1000):
        tokens.inc(2)
    wait_until(lambda: sidecar.scrape().find("sglang_load_back_tokens_total", pool="kv") != []
               and sidecar.scrape().value("sglang_load_back_tokens_total", pool="kv") == 2000)
    scrape = sidecar.scrape()
    # Presets arrive with the first snapshot: every documented reason at 0.
    reasons = {s.labels["reason"] for s in scrape.find("sglang_storage_prefetch_unfulfilled_tokens_total")}
    assert len(reasons) == 11 and "anchor_lost" in reasons and "deadline" in reasons
    client.close()
    assert _ranks(sidecar)[0]["status"] == "departed"
    assert client.stats.failures == 0 and client.stats.connects == 1


def test_client_works_while_the_sidecar_is_absent_then_delivers_everything(socket_dir: Path) -> None:
    path = socket_dir / "late" / "metrics.sock"
    client = RankClient(str(path), rank=RANK, interval=0.05, max_backoff=0.2).start()
    moved = client.counter("load_back_bytes_total")
    started = time.perf_counter()
    for _ in range(10_000):
        moved.inc(4096)
    assert time.perf_counter() - started < 5  # increments never wait on the missing sidecar
    wait_until(lambda: client.stats.failures >= 3)
    sidecar = SidecarThread(sidecar_config(path)).start()
    try:
        wait_until(lambda: sidecar.scrape().find("sglang_load_back_bytes_total") != []
                   and sidecar.scrape().value("sglang_load_back_bytes_total") == 10_000 * 4096)
        assert sidecar.scrape().value("sglang_rollup_load_back_bytes_total") == 10_000 * 4096
        client.close()
    finally:
        sidecar.stop()


def test_sidecar_restart_loses_nothing(socket_dir: Path) -> None:
    path = socket_dir / "metrics.sock"
    first = SidecarThread(sidecar_config(path)).start()
    client = RankClient(str(path), rank=RANK, interval=0.05, max_backoff=0.2).start()
    tokens = client.counter("evicted_tokens_total")
    tokens.inc(100)
    wait_until(lambda: first.scrape().find("sglang_evicted_tokens_total") != []
               and first.scrape().value("sglang_evicted_tokens_total") == 100)
    first.stop()
    tokens.inc(23)  # counted while no sidecar runs
    second = SidecarThread(sidecar_config(path)).start()
    try:
        wait_until(lambda: second.scrape().find("sglang_evicted_tokens_total") != []
                   and second.scrape().value("sglang_evicted_tokens_total") == 123)
        assert client.stats.connects >= 2
        client.close()
    finally:
        second.stop()


def test_close_without_a_sidecar_returns_promptly(socket_dir: Path) -> None:
    client = RankClient(str(socket_dir / "nobody.sock"), rank=RANK, interval=0.05).start()
    started = time.perf_counter()
    client.close()
    client.close()  # twice is harmless
    assert time.perf_counter() - started < 6
    assert client.stats.failures >= 1 and client.stats.snapshots_sent == 0


def test_sidecar_rejections_are_recorded_not_raised(sidecar: SidecarThread) -> None:
    # A rank built against a catalog with a family this sidecar does not know.
    extended = catalog_from_data({"families": [f.model_dump() for f in default_catalog()] + [
        {"name": "made_up_tokens_total", "type": "counter", "semantics": "replicated", "help": "x"}]})
    client = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, catalog=extended).start()
    client.counter("made_up_tokens_total").inc(5)
    wait_until(lambda: client.stats.errors_by_code.get("unknown_family", 0) >= 1)
    assert client.stats.refused is None
    client.close()


def test_a_refused_process_keeps_asking_and_says_why(sidecar: SidecarThread, caplog: pytest.LogCaptureFixture) -> None:
    """stale_epoch once stopped a client for good: a rank whose identity an impostor had taken was locked out."""
    old = RankClient(sidecar.socket_path, rank=RANK, interval=0.05).start()
    wait_until(lambda: old.stats.snapshots_sent > 0)
    old.close()
    new = RankClient(sidecar.socket_path, rank=RANK, interval=0.05).start()
    wait_until(lambda: new.stats.snapshots_sent > 0)
    new.close()
    ghost = RankClient(sidecar.socket_path, rank=RANK, interval=0.05, max_backoff=0.05)
    ghost.epoch = old.epoch  # the same process start coming back after being replaced
    with caplog.at_level(logging.ERROR, logger="hicache_exporter.client"):
        ghost.start()
        wait_until(lambda: ghost.stats.refused is not None and ghost.stats.errors_by_code.get("stale_epoch", 0) >= 3)
    assert "stale_epoch" in ghost.stats.refused  # type: ignore[operator]
    assert ghost._pusher._thread is not None and ghost._pusher._thread.is_alive()  # still trying
    assert [r for r in caplog.records if "refuses this rank's hello" in r.getMessage()]
    assert len([r for r in caplog.records if "refuses" in r.getMessage()]) == 1  # said once, not per retry
    ghost.close()


def test_binding_errors_are_raised_at_bind_time() -> None:
    client = RankClient("/nonexistent.sock", rank=RANK)
    with pytest.raises(LabelError, match="pool"):
        client.counter("load_back_tokens_total")
    with pytest.raises(LabelError, match="histogram"):
        client.counter("load_back_duration_seconds")
    with pytest.raises(KeyError, match="not in the metric catalog"):
        client.counter("nope_total")
    with pytest.raises(LabelError):
        RankClient("/x.sock", rank={"tp_rank": 0})
    with pytest.raises(LabelError, match="reserved"):
        RankClient("/x.sock", rank=RANK, labels={"le": "1"})
    with pytest.raises(LabelError, match="world"):
        RankClient("/x.sock", rank=RANK, world={"tp_size": 2, "pp_size": 1})
    with pytest.raises(LabelError, match="world"):
        RankClient("/x.sock", rank=RANK, world={"tp_size": 2, "pp_size": 1, "dp_size": 1, "cp_size": 2})
    with pytest.raises(LabelError, match="world: Expected `int` >= 1"):
        RankClient("/x.sock", rank=RANK, world={"tp_size": 2, "pp_size": 1, "dp_size": 1, "attn_cp_size": 0})


@pytest.mark.parametrize("rank, labels, message", [
    # What the sidecar's hello would refuse, so that the rank would push nothing at all, refused here.
    ({"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, {"zone": ""}, "static label: label 'zone' has an empty value"),
    ({"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, {"pool": "kv"}, "static label: label name 'pool' is a family label"),
    ({"tp_rank": "03", "pp_rank": 0, "dp_rank": 0}, {}, "rank label tp_rank='03' must be a whole number"),
    ({"tp_rank": -1, "pp_rank": 0, "dp_rank": 0}, {}, "rank label tp_rank=-1 must be a whole number"),
    ({"tp_rank": 1.5, "pp_rank": 0, "dp_rank": 0}, {}, "rank label tp_rank=1.5 must be a whole number"),
])
def test_a_rank_and_its_static_labels_follow_the_sidecars_rules(rank, labels, message) -> None:
    with pytest.raises(LabelError, match=re.escape(message)):
        RankClient("/x.sock", rank=rank, labels=labels)
    assert RankClient("/x.sock", rank={"tp_rank": "3", "pp_rank": 0, "dp_rank": 0}).rank["tp_rank"] == 3


def test_hello_and_snapshot_are_the_protocol_structs() -> None:
    world = {"tp_size": 2, "pp_size": 1, "dp_size": 1}
    client = RankClient("/nonexistent.sock", rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0},
                        labels={"cache_type": "HiRadixCache"}, world=world)
    client.counter("load_back_tokens_total", pool="kv").inc(7)
    hello = client._hello()
    assert isinstance(hello, Hello) and parse_client_message(encode_payload(hello)) == hello
    assert hello.epoch == client.epoch and hello.rank.tp_rank == 1 and hello.world == World(**world)
    assert hello.labels == {"cache_type": "HiRadixCache"}
    snapshot = client._snapshot(3)
    assert isinstance(snapshot, Snapshot) and parse_client_message(encode_payload(snapshot)) == snapshot
    assert snapshot.seq == 3 and ("load_back_tokens_total", {"pool": "kv"}, 7) in [
        (s.family, s.labels, s.value) for s in snapshot.samples]
    assert parse_client_message(encode_payload(RankClient("/x.sock", rank=RANK)._hello())).world is None
    attention = {"tp_size": 8, "pp_size": 1, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 2}
    sent = RankClient("/x.sock", rank=RANK, world=attention)._hello()
    assert parse_client_message(encode_payload(sent)).world == World(**attention)


def test_a_rank_may_name_its_context_parallel_rank_and_nothing_else() -> None:
    from exporter.protocol.messages import Hello

    client = RankClient("/nonexistent.sock", rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 2})
    hello = client._hello()
    assert isinstance(hello, Hello) and hello.rank.attn_cp_rank == 2
    assert RankClient("/nonexistent.sock")._hello().rank.attn_cp_rank is None
    with pytest.raises(LabelError):
        RankClient("/nonexistent.sock", rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "moe_ep_rank": 2})


def test_help_texts_are_cut_to_what_the_protocol_carries_and_empty_ones_ignored() -> None:
    from exporter.protocol.framing import encode_payload
    from exporter.protocol.messages import MAX_HELP_LENGTH, parse_client_message

    client = RankClient("/nonexistent.sock", rank=RANK)
    client.describe("load_back_tokens_total", "x" * (MAX_HELP_LENGTH + 10))
    client.describe("load_back_bytes_total", "")
    snapshot = client._snapshot(1)
    assert snapshot.help == {"load_back_tokens_total": "x" * MAX_HELP_LENGTH}
    parse_client_message(encode_payload(snapshot))  # the sidecar decodes it: not malformed
    assert client._snapshot(2).help == {}  # sent once per connection


def test_a_rank_whose_epoch_an_impostor_used_hears_of_it_and_keeps_pushing(
    sidecar: SidecarThread, caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 19, finding 10: the impostor's seq 2**64-1 once had every snapshot of the real rank
    dropped as old_seq, and the client reported nothing."""
    real = RankClient(sidecar.socket_path, rank=RANK, interval=0.05)
    impostor = RawClient(sidecar.socket_path)
    impostor.send(hello(tp=0, epoch=real.epoch))
    assert isinstance(impostor.recv(), Welcome)
    impostor.send(snapshot(2**64 - 1, counter("load_back_bytes_total", 5_000_000)))
    impostor.send({"type": "bye"})
    assert impostor.closed_by_peer()
    real.counter("load_back_bytes_total").inc(400)
    with caplog.at_level(logging.WARNING, logger="hicache_exporter.client"):
        real.start()
        wait_until(lambda: real.stats.errors_by_code.get("epoch_conflict", 0) >= 1)
    assert [r for r in caplog.records if "epoch_conflict" in r.getMessage()]
    wait_until(lambda: sidecar.scrape().value("sglang_load_back_bytes_total", tp_rank="0") == 400)
    real.counter("load_back_bytes_total").inc(50)
    wait_until(lambda: sidecar.scrape().value("sglang_load_back_bytes_total", tp_rank="0") == 450)
    assert real.stats.errors_by_code == {"epoch_conflict": 1}
    real.close()
