"""The HTTP side: content negotiation, gzip, health, readiness, the JSON and HTML views, promtool."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics

from exporter.catalog import MetricType, default_catalog
from exporter.client import RankClient
from tests.helpers import Scrape, SidecarThread, http_get, sidecar_config, wait_until


def _full_catalog_ranks(sidecar: SidecarThread) -> list[RankClient]:
    """Two replicas pushing a value for every catalog family, with transfers in the window."""
    clients = []
    for tp in range(2):
        client = RankClient(sidecar.socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0},
                            labels={"cache_type": "UnifiedRadixCache"}, interval=0.1)
        for spec in default_catalog():
            labels = {name: "kv" if name == "pool" else "host_pressure" for name in spec.labels}
            if spec.type is MetricType.COUNTER:
                client.counter(spec.name, **labels).inc(1000 * (tp + 1))
            elif spec.type is MetricType.GAUGE:
                client.gauge(spec.name, **labels).set(512)
            else:
                client.histogram(spec.name, **labels).observe(0.004)
        clients.append(client.start())
    wait_until(lambda: sidecar.scrape().find("sglang_rollup_load_back_active_bandwidth_bytes_per_second") != []
               and len(sidecar.scrape().find("hicache_exporter_rank_up")) == 2
               and sidecar.scrape().total("hicache_exporter_rank_up") == 2)
    return clients


def test_metrics_is_prometheus_text_by_default(sidecar: SidecarThread) -> None:
    status, body, headers = http_get(sidecar.url + "/metrics")
    assert status == 200
    assert headers["Content-Type"].startswith("text/plain; version=0.0.4")
    assert "hicache_exporter_build_info" in body.decode()


def test_metrics_speaks_openmetrics_when_asked(sidecar: SidecarThread) -> None:
    clients = _full_catalog_ranks(sidecar)
    status, body, headers = http_get(sidecar.url + "/metrics",
                                     {"Accept": "application/openmetrics-text; version=1.0.0; charset=utf-8"})
    assert status == 200
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    text = body.decode()
    assert text.endswith("# EOF\n")
    names = {family.name for family in parse_openmetrics(text)}
    assert "sglang_rollup_load_back_bytes" in names
    for client in clients:
        client.close()


def test_metrics_gzip_when_accepted(sidecar: SidecarThread) -> None:
    status, body, headers = http_get(sidecar.url + "/metrics", {"Accept-Encoding": "gzip"})
    assert status == 200 and headers.get("Content-Encoding") == "gzip"
    assert b"hicache_exporter_build_info" in gzip.decompress(body)
    assert headers.get("Vary") == "Accept-Encoding"  # caches must not hand gzip to a client that did not ask


@pytest.mark.parametrize(("accept", "gzipped"), [
    ("gzip;q=0", False), ("GZIP", True), ("deflate, gzip;q=0.5", True), ("identity", False), ("*", True),
    ("*;q=0", False), ("gzip;q=0, *", False), ("br;q=1, *;q=0.1", True), ("gzip; q=0.000", False), ("gzip;q=x", False),
    ("", False),
])
def test_gzip_follows_the_q_values(sidecar: SidecarThread, accept: str, gzipped: bool) -> None:
    status, body, headers = http_get(sidecar.url + "/metrics", {"Accept-Encoding": accept})
    assert status == 200 and (headers.get("Content-Encoding") == "gzip") is gzipped, headers
    assert headers.get("Vary") == "Accept-Encoding"
    assert b"hicache_exporter_build_info" in (gzip.decompress(body) if gzipped else body)


def test_health_and_readiness(sidecar: SidecarThread) -> None:
    assert http_get(sidecar.url + "/-/healthy")[0] == 200
    assert http_get(sidecar.url + "/-/ready")[0] == 200
    assert sidecar.sidecar is not None
    sidecar.call(lambda: setattr(sidecar.sidecar.health, "ingest_listening", False))
    assert http_get(sidecar.url + "/-/ready")[0] == 503


def test_rank_json_and_status_page(sidecar: SidecarThread) -> None:
    client = RankClient(sidecar.socket_path, rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 3},
                        labels={"cache_type": "UnifiedRadixCache"}, interval=0.1).start()
    wait_until(lambda: json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"] != [])
    wait_until(lambda: json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"][0]["snapshots"] > 0)
    row = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"][0]
    assert (row["tp_rank"], row["pp_rank"], row["dp_rank"]) == (1, 0, 3)
    assert row["labels"] == {"cache_type": "UnifiedRadixCache"}
    assert row["status"] == "live" and row["epoch"] == client.epoch
    page = http_get(sidecar.url + "/")[1].decode()
    assert "<table>" in page and "UnifiedRadixCache" in page and "live" in page
    client.close()
    wait_until(lambda: json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"][0]["status"] == "departed")


def test_promtool_finds_nothing_to_lint_in_a_full_exposition(sidecar: SidecarThread) -> None:
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (Debian package `prometheus`; `make test` installs it)"
    clients = _full_catalog_ranks(sidecar)
    time.sleep(0.3)  # a spread window with both replicas pushing
    text = sidecar.metrics_text()
    scrape = Scrape(text)
    # The body really is full: per-rank, rollup, bandwidth, spread and self series are all there.
    for name in ("sglang_prefetch_pgs_bucket", "sglang_rollup_hicache_host_pool_used_tokens",
                 "sglang_storage_backup_active_bandwidth_bytes_per_second",
                 "sglang_load_back_tokens_replica_spread_ratio", "hicache_exporter_scrape_duration_seconds_count"):
        assert scrape.find(name), name
    result = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "" and result.stderr.strip() == ""
    for client in clients:
        client.close()


def test_a_ranks_help_texts_replace_the_catalogs_and_follow_a_reconnect(sidecar: SidecarThread) -> None:
    """An engine's own HELP wording travels with its series: sent on each connection, exposed escaped."""
    client = RankClient(sidecar.socket_path, rank={"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}, interval=0.05)
    client.describe("load_back_tokens_total", 'Tokens loaded back.\nRead one rank, not "all".')
    client.counter("load_back_tokens_total", pool="kv").inc(5)
    client.start()
    wanted = '# HELP sglang_load_back_tokens_total Tokens loaded back.\\nRead one rank, not "all".'
    wait_until(lambda: wanted in sidecar.metrics_text())
    assert "# HELP sglang_load_back_bytes_total Bytes loaded back" in sidecar.metrics_text()  # others keep the catalog's
    client.describe("load_back_tokens_total", "Changed wording.")
    wait_until(lambda: "# HELP sglang_load_back_tokens_total Changed wording." in sidecar.metrics_text())
    client.close()
    try:
        client.describe("no_such_family", "x")
    except KeyError:
        pass
    else:
        raise AssertionError("an unknown family must be refused by the client")


def test_a_malformed_request_is_logged_in_one_line_without_its_bytes(
    sidecar: SidecarThread, caplog: pytest.LogCaptureFixture,
) -> None:
    """An over-long Authorization header once went to the log inside a traceback, quoting the secret."""
    import socket

    assert sidecar.sidecar is not None
    with caplog.at_level(logging.ERROR, logger="aiohttp.server"):
        peer = socket.create_connection(("127.0.0.1", sidecar.sidecar.http_port), timeout=5)
        peer.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic " + b"c2VjcmV0" * 2000 + b"\r\n\r\n")
        assert peer.recv(64).startswith(b"HTTP/1.0 400")
        peer.close()
        wait_until(lambda: any("malformed HTTP request" in r.getMessage() for r in caplog.records))
    records = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert records and all(r.exc_info is None and "c2VjcmV0" not in r.getMessage() for r in records)
    assert "LineTooLong" in records[0].getMessage()


def test_http_connections_are_capped_and_idle_ones_closed(socket_dir: Path) -> None:
    """Idle TCP connections were held with no deadline; past the fd limit they stalled ingest and scrapes."""
    import socket

    running = SidecarThread(sidecar_config(socket_dir / "m.sock",
                                           http={"max_connections": 4, "idle_timeout_seconds": 0.5})).start()
    peers: list[socket.socket] = []
    try:
        assert running.sidecar is not None
        port = running.sidecar.http_port
        for _ in range(4):
            peers.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        peers[0].sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # a request that never completes
        time.sleep(0.1)
        extra = socket.create_connection(("127.0.0.1", port), timeout=5)
        assert extra.recv(64).startswith(b"HTTP/1.1 503")  # refused at once, nothing read
        extra.close()
        for peer in peers:  # the idle ones, and the dribbling one, are closed at the deadline
            peer.settimeout(5)
            assert peer.recv(64) == b""
        assert http_get(running.url + "/-/healthy")[0] == 200  # and their slots are free again
    finally:
        for peer in peers:
            peer.close()
        running.stop()
