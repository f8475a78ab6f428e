"""The storage worker: page bytes without numpy, and failing jobs said in the log."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cache_core.io_worker import StorageJob, StorageWorker, page_bytes
from cache_core.pools import PagePool
from cache_core.storage import FileStorage, StorageError
from tests.cache_core.support import SHARD

WITHOUT_NUMPY = r"""
import sys
sys.modules["numpy"] = None  # as on a machine with torch but not numpy
import torch
from pathlib import Path
from cache_core.geometry import ModelGeometry
from cache_core.io_worker import StorageJob, StorageWorker
from cache_core.pools import PagePool
from cache_core.storage import FileStorage
shard = ModelGeometry(layers=2).shard(0, 1, 0, 1)
host = PagePool("host", shard, 4, "cpu")
host.data.copy_(torch.randn(host.data.shape).to(host.data.dtype))
worker = StorageWorker(FileStorage(Path(sys.argv[1]), shard.page_bytes), host)
keys = [b"a" * 32, b"b" * 32]
write = worker.submit(StorageJob("backup", keys, [0, 1])); write.finished.wait(10)
read = worker.submit(StorageJob("prefetch", keys, [2, 3])); read.finished.wait(10)
worker.close()
print(write.error, read.error, torch.equal(host.data[0], host.data[2]) and torch.equal(host.data[1], host.data[3]))
"""


def test_pages_reach_l3_and_come_back_without_numpy(tmp_path: Path) -> None:
    """With torch but not numpy, every L3 write once failed (`Numpy is not available`), silently."""
    out = subprocess.run([sys.executable, "-c", WITHOUT_NUMPY, str(tmp_path)], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["None", "None", "True"]


def test_page_bytes_are_the_pages_own(tmp_path: Path) -> None:
    pool = PagePool("host", SHARD, 3, "cpu")
    pool.data.copy_(torch.randn(pool.data.shape).to(pool.data.dtype))
    assert page_bytes(pool.data[1]) == pool.data[1].contiguous().view(torch.uint8).numpy().tobytes()
    assert len(page_bytes(pool.data[1])) == SHARD.page_bytes


class BrokenStorage(FileStorage):
    def put(self, key: bytes, data: bytes) -> None:
        raise StorageError("disk full")


def test_jobs_that_keep_failing_are_said_in_the_log_once_a_minute(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    host = PagePool("host", SHARD, 2, "cpu")
    worker = StorageWorker(BrokenStorage(tmp_path, SHARD.page_bytes), host)
    with caplog.at_level(logging.WARNING, logger="cache_core.storage"):
        jobs = [worker.submit(StorageJob("backup", [bytes([i]) * 32], [0])) for i in range(5)]
        for job in jobs:
            assert job.finished.wait(10) and job.error == "disk full"
        worker.close()
    said = [r.getMessage() for r in caplog.records if r.name == "cache_core.storage"]
    assert len(said) == 1 and "disk full" in said[0] and "backup" in said[0]
