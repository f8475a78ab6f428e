"""Faults: a rank killed mid-frame, the sidecar killed and restarted under load, a rank restarted 50 times."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from exporter.client import RankClient
from tests.helpers import Scrape, SidecarThread, free_port, http_get, wait_ready, wait_until

RANK = {"tp_rank": 0, "pp_rank": 0, "dp_rank": 0}

KILLED_MID_FRAME = r"""
import json, os, signal, socket, struct, sys
sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
sock.connect(sys.argv[1])
def frame(obj):
    body = json.dumps(obj).encode()
    return struct.pack(">I", len(body)) + body
sock.sendall(frame({"type": "hello", "protocol": 1, "epoch": "doomed", "pid": os.getpid(),
                    "rank": {"tp_rank": 1, "pp_rank": 0, "dp_rank": 0}, "labels": {}}))
sock.recv(4096)
sock.sendall(frame({"type": "snapshot", "seq": 1, "time": 0, "samples": [
    {"family": "load_back_bytes_total", "labels": {}, "value": 777}]}))
half = frame({"type": "snapshot", "seq": 2, "time": 0, "samples": [
    {"family": "load_back_bytes_total", "labels": {}, "value": 999}]})
sock.sendall(half[: len(half) // 2])
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_rank_killed_mid_frame(sidecar: SidecarThread) -> None:
    steady = RankClient(sidecar.socket_path, rank=RANK, interval=0.05)
    steady.counter("load_back_bytes_total").inc(100)
    steady.start()
    proc = subprocess.run([sys.executable, "-c", KILLED_MID_FRAME, sidecar.socket_path], timeout=30)
    assert proc.returncode == -signal.SIGKILL
    wait_until(lambda: sidecar.scrape().value("hicache_exporter_rejections_total", reason="malformed_frame") == 1)
    scrape = sidecar.scrape()
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="1") == 777  # the half frame applied nothing
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 100
    ranks = json.loads(http_get(sidecar.url + "/api/v1/ranks")[1])["ranks"]
    assert {(r["tp_rank"], r["status"]) for r in ranks} == {(0, "live"), (1, "departed")}
    # The rank comes back as a new process: its new epoch counts from zero, the rollup keeps 777.
    again = RankClient(sidecar.socket_path, rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0}, interval=0.05)
    again.counter("load_back_bytes_total").inc(5)
    again.start()
    wait_until(lambda: sidecar.scrape().value("sglang_rollup_load_back_bytes_total") == 100 + 777 + 5)
    again.close()
    steady.close()


RANK_PROCESS = r"""
import sys, time
from exporter.client import RankClient
path, tp, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])  # one rank per dp group
client = RankClient(path, rank={"tp_rank": 0, "pp_rank": 0, "dp_rank": tp}, interval=0.1, max_backoff=1.0)
moved = client.counter("load_back_bytes_total")
tokens = client.counter("load_back_tokens_total", pool="kv")
client.start()
for _ in range(total):
    moved.inc(1000 * (tp + 1))
    tokens.inc(16)
    time.sleep(0.01)
print("done", flush=True)
sys.stdin.readline()   # stay connected until told to finish
client.close()
print("closed", client.stats.connects, flush=True)
"""


def _serve(port: int, sock: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--socket", sock], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _scrape(port: int) -> Scrape | None:
    try:
        status, body, _ = http_get(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return None
    return Scrape(body.decode()) if status == 200 else None


def test_sidecar_killed_and_restarted_while_ranks_push(socket_dir: Path) -> None:
    port, sock = free_port(), str(socket_dir / "metrics.sock")
    sidecar = _serve(port, sock)
    ranks: list[subprocess.Popen[str]] = []
    try:
        wait_ready(sidecar, lambda: _scrape(port) is not None)
        ranks = [subprocess.Popen([sys.executable, "-c", RANK_PROCESS, sock, str(tp), "400"], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True) for tp in range(4)]
        wait_until(lambda: (s := _scrape(port)) is not None and len(s.find("sglang_load_back_bytes_total")) == 4)
        sidecar.kill()  # no clean-up: the socket file stays behind
        sidecar.wait(10)
        time.sleep(1.0)
        sidecar = _serve(port, sock)  # replaces the dead socket; ranks reconnect within their 1 s backoff cap
        for rank in ranks:
            assert rank.stdout is not None and rank.stdout.readline().strip() == "done"
        expected = {str(tp): 400 * 1000 * (tp + 1) for tp in range(4)}

        def complete() -> bool:
            scrape = _scrape(port)
            return scrape is not None and all(
                scrape.find("sglang_load_back_bytes_total", dp_rank=tp) != []
                and scrape.value("sglang_load_back_bytes_total", dp_rank=tp) == value for tp, value in expected.items())

        wait_ready(sidecar, complete)  # the restarted serve imports, binds, and the ranks reconnect
        scrape = _scrape(port)
        assert scrape is not None
        # The new sidecar saw every rank's whole epoch: the rollups are complete too.
        assert scrape.value("sglang_rollup_load_back_bytes_total") == sum(expected.values())
        assert scrape.value("sglang_rollup_load_back_tokens_total", pool="kv") == 4 * 400 * 16
        for rank in ranks:
            assert rank.stdin is not None
            rank.stdin.write("\n")
            rank.stdin.flush()
            closing = rank.stdout.readline().split() if rank.stdout else []
            assert closing[0] == "closed" and int(closing[1]) >= 2, closing  # it reconnected
            rank.wait(10)
    finally:
        for rank in ranks:
            if rank.poll() is None:
                rank.kill()
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(10)


def test_rank_restarted_fifty_times(sidecar: SidecarThread) -> None:
    previous = {"bytes": 0.0, "tokens": 0.0}
    for restart in range(50):
        client = RankClient(sidecar.socket_path, rank=RANK, labels={"cache_type": "HiRadixCache"}, interval=10)
        client.counter("load_back_bytes_total").inc(4096)
        client.counter("load_back_tokens_total", pool="kv").inc(16)
        client.start()
        client.close()  # a new process each time: a new epoch, pushed and gone
        assert client.stats.failures == 0
        if restart % 10 == 9:
            scrape = sidecar.scrape()
            now = {"bytes": scrape.value("sglang_rollup_load_back_bytes_total", cache_type="HiRadixCache"),
                   "tokens": scrape.value("sglang_rollup_load_back_tokens_total", pool="kv", cache_type="HiRadixCache")}
            assert now["bytes"] >= previous["bytes"] and now["tokens"] >= previous["tokens"]
            previous = now
    scrape = sidecar.scrape()
    assert scrape.value("sglang_rollup_load_back_bytes_total", cache_type="HiRadixCache") == 50 * 4096
    assert scrape.value("sglang_rollup_load_back_tokens_total", pool="kv", cache_type="HiRadixCache") == 50 * 16
    assert scrape.value("hicache_exporter_rank_restarts_total", tp_rank="0") == 49
    assert scrape.value("sglang_load_back_bytes_total", tp_rank="0") == 4096  # the last epoch's own value


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_flood_of_rejected_samples_does_not_pin_memory(tmp_path: Path) -> None:
    """Each rejected sample once kept an exception whose traceback held the snapshot: four 1 MiB
    frames of unknown families grew the sidecar by over 400 MB, past the pod's 256 Mi limit."""
    from exporter.protocol.framing import encode_frame
    from tests.helpers import RawClient, hello

    sock, port = tmp_path / "m.sock", free_port()
    proc = _serve(port, str(sock))
    try:
        wait_until(lambda: sock.exists() and http_get(f"http://127.0.0.1:{port}/-/ready")[0] == 200, timeout=20)
        client = RawClient(str(sock), timeout=30)
        client.send(hello(tp=0))
        client.recv()
        before = _rss_bytes(proc.pid)
        samples = ",".join(['{"family":"a"}'] * 65_000)  # just under 1 MiB
        for seq in range(1, 5):
            client.send_raw(encode_frame(f'{{"type":"snapshot","seq":{seq},"time":0,"samples":[{samples}]}}'.encode()))
        scrape = lambda: Scrape(http_get(f"http://127.0.0.1:{port}/metrics")[1].decode())  # noqa: E731
        wait_until(lambda: scrape().value("hicache_exporter_rejections_total", reason="unknown_family") == 4 * 65_000,
                   timeout=60)
        grown = _rss_bytes(proc.pid) - before
        assert grown < 60 * 2**20, f"RSS grew by {grown / 2**20:.0f} MiB"
        print(f"RSS growth after 4 x 65,000 rejected samples: {grown / 2**20:.1f} MiB")
        client.close()
    finally:
        proc.terminate()
        proc.wait(15)


def test_epoch_churn_with_new_label_values_keeps_memory_and_body_bounded(tmp_path: Path) -> None:
    """A rank restarting with 4,000 new series per epoch once grew RSS by about 180 MB over 40
    epochs and /metrics to 13 MB, with nothing counted as a rejection: rollup series outlived
    their epochs without counting against max_series_total."""
    config = tmp_path / "c.yaml"
    config.write_text("ranks:\n  max_series_total: 5000\n")
    sock, port = tmp_path / "m.sock", free_port()
    proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(config), "--host", "127.0.0.1",
                             "--port", str(port), "--socket", str(sock)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: sock.exists() and http_get(f"http://127.0.0.1:{port}/-/ready")[0] == 200, timeout=20)
        before = _rss_bytes(proc.pid)
        for epoch in range(40):
            client = RankClient(str(sock), rank=RANK, interval=60)
            for i in range(4000):
                client.counter("load_back_tokens_total", pool=f"e{epoch}-{i}").inc(1)
            client.start()
            client.close()  # a last snapshot, then bye: the next epoch is a restart
        body = http_get(f"http://127.0.0.1:{port}/metrics")[1]
        grown = _rss_bytes(proc.pid) - before
        scrape = Scrape(body.decode())
        print(f"40 epochs x 4,000 new series: RSS +{grown / 2**20:.1f} MiB, /metrics {len(body) / 2**20:.2f} MiB")
        assert scrape.value("hicache_exporter_rejections_total", reason="series_limit") > 0
        assert len(body) < 2 * 2**20
        assert grown < 60 * 2**20
    finally:
        proc.terminate()
        proc.wait(15)
