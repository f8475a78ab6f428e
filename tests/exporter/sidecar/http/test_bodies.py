"""Response bodies in flight are bounded (exporter/sidecar/http/bodies.py), over real sockets."""

from __future__ import annotations

import socket
import time
from pathlib import Path

from exporter.catalog import MetricType, default_catalog
from exporter.client import RankClient
from exporter.sidecar.http.app import BODIES
from tests.helpers import SidecarThread, http_get, sidecar_config, wait_until

SLOW = b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"


def _slow_reader(port: int) -> socket.socket:
    """A client that asks for /metrics and never reads; its tiny receive window keeps the body on the server."""
    peer = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    peer.connect(("127.0.0.1", port))
    peer.sendall(SLOW)
    return peer


def _ranks(running: SidecarThread) -> list[RankClient]:
    """Ranks with enough labelled gauge series that /metrics is over 1 MB."""
    spec = next(s for s in default_catalog() if s.type is MetricType.GAUGE and s.labels)
    clients = []
    for tp in range(4):
        client = RankClient(running.socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0}, interval=0.1)
        for i in range(2000):
            client.gauge(spec.name, **{name: f"value-{i:05d}-{'x' * 60}" for name in spec.labels}).set(i)
        clients.append(client.start())
    # Every rank pushed (each snapshot holds all its series): the body's size is settled. Waiting for
    # "over 1 MB" alone let three ranks pass, and the fourth then made each body a quarter larger
    # than the one the budget was sized on, so the second slow reader was refused.
    pushed = b"hicache_exporter_rank_last_push_timestamp_seconds{"
    wait_until(lambda: http_get(running.url + "/metrics")[1].count(pushed) == len(clients), timeout=60)
    assert len(http_get(running.url + "/metrics")[1]) > 1_000_000
    return clients


def test_slow_readers_hold_at_most_the_budget_then_release_it(socket_dir: Path) -> None:
    """Before, every slow reader kept a whole /metrics body in the transport: 512 of them, gigabytes."""
    config = sidecar_config(socket_dir / "m.sock", ranks={"max_series_per_rank": 4096})
    running = SidecarThread(config).start()
    clients: list[RankClient] = []
    peers: list[socket.socket] = []
    try:
        assert running.sidecar is not None
        port = running.sidecar.http_port
        clients = _ranks(running)
        status, body, headers = http_get(running.url + "/metrics")
        assert status == 200 and headers["Content-Length"] == str(len(body))
        assert {"Content-Type", "Vary", "Content-Security-Policy", "X-Content-Type-Options"} <= set(headers)
        # A budget of 2.5 bodies: two slow readers fill it, a third request is refused.
        assert running.sidecar._runner is not None
        bodies = running.sidecar._runner.app[BODIES]
        bodies.limit = len(body) * 5 // 2
        bodies.write_timeout = 3600.0  # the slow readers stay until they leave, however loaded the machine
        # Accepted sockets inherit the listener's send buffer: fixed small, the kernel cannot take
        # the whole body off the process (autotuned, loopback takes up to tcp_wmem's 4 MB).
        for site in running.sidecar._runner.sites:
            for listening in site._server.sockets:  # type: ignore[union-attr]
                listening.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)

        for _ in range(2):
            peers.append(_slow_reader(port))
        wait_until(lambda: bodies.in_flight >= 2 * len(body) * 9 // 10)
        status, said, headers = http_get(running.url + "/metrics")
        assert status == 503 and headers["Retry-After"] == "1" and said.startswith(b"too many response bytes")
        assert http_get(running.url + "/-/healthy")[0] == 200  # small bodies are not counted

        for peer in peers:  # the slow readers leave: their bodies are freed at once
            peer.close()
        peers.clear()
        wait_until(lambda: bodies.in_flight == 0, timeout=30)  # freed when they close (the deadline is an hour)
        assert http_get(running.url + "/metrics")[0] == 200

        # One that stays is cut at the write deadline, never before it.
        bodies.write_timeout = 2.0
        asked = time.monotonic()
        peers.append(peer := _slow_reader(port))
        peer.settimeout(30)
        assert peer.recv(1) == b"H"  # its answer is being sent
        wait_until(lambda: bodies.in_flight == 0, timeout=60)
        assert time.monotonic() - asked >= bodies.write_timeout
        assert http_get(running.url + "/metrics")[0] == 200
        try:
            while peer.recv(1 << 16):
                pass  # what the server had sent before it aborted, then EOF or a reset
        except ConnectionResetError:
            pass
    finally:
        for peer in peers:
            peer.close()
        for client in clients:
            client.close()
        running.stop()
