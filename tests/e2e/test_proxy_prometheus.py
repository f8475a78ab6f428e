"""End to end, the proxy: a real Prometheus scrapes `hicache-exporter serve --upstream URL`, whose
upstream is the released SGLang collectors' multiprocess directory served over HTTP as the
engine serves it. Asserted through the Prometheus HTTP API."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_prometheus import Prometheus, _up
from tests.helpers import free_port, wait_ready, wait_until
from tests.integrations.support import run_processes
from tests.integrations.test_proxy import EngineServer
from tests.upstream_sglang import WheelUnavailable


def test_prometheus_scrapes_the_proxy_of_an_unmodified_engine(socket_dir: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    try:
        from tests.integrations import ranks
    except WheelUnavailable as err:
        pytest.fail(f"the released SGLang collectors are needed: {err}", pytrace=False)
    world = ranks.ranks(tp=2, dp=2)
    directory = tmp_path / "multiproc"
    directory.mkdir()
    with monkeypatch.context() as env:
        env.setenv("PROMETHEUS_MULTIPROC_DIR", str(directory))
        run_processes(ranks.run_released_rank, [(rank,) for rank in world], receive=True)
    engine = EngineServer(directory, free_port()).start()
    port = free_port()
    sidecar = subprocess.Popen(
        [sys.executable, "-m", "exporter.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
         "--socket", str(socket_dir / "metrics.sock"), "--upstream", engine.url],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    prometheus = None
    try:
        wait_ready(sidecar, lambda: _up(f"http://127.0.0.1:{port}/-/ready"))
        prometheus = Prometheus(tmp_path, f"127.0.0.1:{port}", [])
        wait_until(lambda: bool(prometheus.query("sglang_rollup_load_back_bytes_total")), timeout=30)
        assert prometheus.scalar(f'hicache_exporter_upstream_up{{upstream="{engine.url}"}}') == 1
        assert prometheus.scalar("sglang_rollup_load_back_bytes_total") == sum(
            ranks.total(rank, "increment_load_back_num_bytes") for rank in world)
        assert prometheus.scalar('sglang_rollup_load_back_tokens_total{pool="kv"}') == sum(
            ranks.total(rank, "increment_load_back_num_tokens", "kv") for rank in world if rank.tp_rank == 0)
        assert len(prometheus.query("sglang_load_back_bytes_total")) == len(world)
        # Prometheus's own scrape of the proxy reports no problem with the exposition.
        assert prometheus.scalar('up{job="hicache"}') == 1
    finally:
        if prometheus is not None:
            prometheus.stop()
        sidecar.send_signal(signal.SIGTERM)
        sidecar.wait(20)
        engine.stop()
