"""L3 file storage: the chained page hash, atomic writes, reads that fail loudly, and the worker."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import pytest
import torch

from cache_core import storage as storage_module
from cache_core.io_worker import StorageJob, StorageWorker
from cache_core.pools import PagePool
from cache_core.storage import FileStorage, StorageError, chained_hashes, page_hash
from tests.cache_core.support import SHARD

PAGE = 64


def expected_hash(tokens: list[int], prior: bytes | None) -> bytes:
    data = (prior or b"") + b"".join(struct.pack("<I", t) for t in tokens)
    return hashlib.sha256(data).digest()


def test_page_hash_is_sha256_of_prior_then_le_u32_tokens() -> None:
    tokens = [1, 2, 0x01020304, 31999, 0xFFFFFFFF]
    assert page_hash(tokens) == expected_hash(tokens, None)
    assert page_hash(tokens) == hashlib.sha256(
        bytes([1, 0, 0, 0, 2, 0, 0, 0, 4, 3, 2, 1, 0xFF, 0x7C, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF])).digest()
    prior = hashlib.sha256(b"parent").digest()
    assert page_hash(tokens, prior) == expected_hash(tokens, prior)
    assert page_hash(tokens, prior) != page_hash(tokens)
    assert len(page_hash([])) == 32 and page_hash([]) == hashlib.sha256(b"").digest()


def test_page_hash_accepts_tensor_like_ints_and_order_matters() -> None:
    assert page_hash(torch.tensor([5, 6, 7])) == expected_hash([5, 6, 7], None)  # type: ignore[arg-type]
    assert page_hash([5, 6, 7]) != page_hash([7, 6, 5])


def test_chained_hashes_chain_each_page_on_the_one_before() -> None:
    pages = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 2, 3, 4]]
    h0 = expected_hash(pages[0], None)
    h1 = expected_hash(pages[1], h0)
    h2 = expected_hash(pages[2], h1)
    assert chained_hashes(pages) == [h0, h1, h2]
    assert h2 != h0, "the same tokens at another position hash differently"
    assert chained_hashes(pages[1:], prior_hash=h0) == [h1, h2]
    assert chained_hashes([]) == []


def test_put_get_round_trip_and_layout(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "l3", PAGE)
    key = page_hash([1, 2, 3])
    data = os.urandom(PAGE)
    store.put(key, data)
    assert store.get(key) == data
    assert store.path(key) == tmp_path / "l3" / key.hex()[:2] / key.hex()
    assert store.exists([key, page_hash([9])]) == [True, False]
    store.put(key, bytes(PAGE))  # overwrite
    assert store.get(key) == bytes(PAGE)
    store.delete(key)
    store.delete(key)  # deleting twice is fine
    assert store.exists([key]) == [False]


def test_put_refuses_wrong_size(tmp_path: Path) -> None:
    store = FileStorage(tmp_path, PAGE)
    with pytest.raises(StorageError):
        store.put(page_hash([1]), bytes(PAGE - 1))
    assert not store.path(page_hash([1])).exists()


def test_put_is_atomic_no_partial_file_visible(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStorage(tmp_path, PAGE)
    key = page_hash([4, 2])
    data = os.urandom(PAGE)
    seen: list[tuple[bool, bytes]] = []
    real_replace = os.replace

    def spying_replace(src, dst):  # the moment before the rename: the target is not there yet
        seen.append((Path(dst).exists(), Path(src).read_bytes()))
        assert Path(src).parent == Path(dst).parent, "the temporary file is in the target's directory"
        return real_replace(src, dst)

    monkeypatch.setattr(storage_module.os, "replace", spying_replace)
    store.put(key, data)
    assert seen == [(False, data)], "the whole page is written before it becomes visible under its name"
    assert [p.name for p in store.path(key).parent.iterdir()] == [key.hex()], "no temporary file is left"


def test_failed_put_leaves_no_file_and_no_temp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = FileStorage(tmp_path, PAGE)
    key = page_hash([7])

    def failing_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(storage_module.os, "replace", failing_replace)
    with pytest.raises(StorageError):
        store.put(key, os.urandom(PAGE))
    assert not store.path(key).exists()
    assert list(store.path(key).parent.iterdir()) == [], "the temporary file was cleaned up"


def test_get_missing_or_truncated_raises(tmp_path: Path) -> None:
    store = FileStorage(tmp_path, PAGE)
    missing = page_hash([1])
    with pytest.raises(StorageError):
        store.get(missing)
    key = page_hash([2])
    store.put(key, os.urandom(PAGE))
    store.path(key).write_bytes(b"short")
    with pytest.raises(StorageError, match="5 bytes"):
        store.get(key)
    store.path(key).write_bytes(os.urandom(PAGE + 1))
    with pytest.raises(StorageError):
        store.get(key)


def test_prefix_hits_stop_at_the_first_gap(tmp_path: Path) -> None:
    store = FileStorage(tmp_path, PAGE)
    keys = chained_hashes([[i] for i in range(5)])
    for i in (0, 1, 3, 4):
        store.put(keys[i], bytes(PAGE))
    assert store.prefix_hits(keys) == 2
    assert store.prefix_hits(keys[3:]) == 2
    assert store.prefix_hits(keys[2:]) == 0
    assert store.prefix_hits([]) == 0
    store.put(keys[2], bytes(PAGE))
    assert store.prefix_hits(keys) == 5
    assert store.exists(keys) == [True] * 5


# --- the storage worker ---

@pytest.fixture
def worker_setup(tmp_path: Path):
    store = FileStorage(tmp_path, SHARD.page_bytes)
    host = PagePool("host", SHARD, 8, "cpu")
    worker = StorageWorker(store, host)
    yield store, host, worker
    worker.close()
    assert not worker._thread.is_alive()


def test_worker_writes_then_reads_pages_bit_identically(worker_setup) -> None:
    store, host, worker = worker_setup
    host.data[:4].copy_(torch.randn(host.data[:4].shape).to(host.data.dtype))
    keys = chained_hashes([[i] for i in range(4)])
    job = worker.submit(StorageJob("backup", keys, [0, 1, 2, 3]))
    assert job.finished.wait(10)
    assert (job.done_pages, job.error) == (4, None)
    assert all(len(store.get(k)) == SHARD.page_bytes for k in keys)
    read = worker.submit(StorageJob("prefetch", keys, [4, 5, 6, 7]))
    assert read.finished.wait(10)
    assert (read.done_pages, read.error) == (4, None)
    assert torch.equal(host.data[4:8], host.data[0:4])


def test_worker_read_stops_at_a_truncated_page(worker_setup) -> None:
    store, host, worker = worker_setup
    keys = chained_hashes([[i] for i in range(4)])
    for key in keys:
        store.put(key, bytes(SHARD.page_bytes))
    store.path(keys[2]).write_bytes(b"x" * 10)
    job = worker.submit(StorageJob("prefetch", keys, [0, 1, 2, 3]))
    assert job.finished.wait(10)
    assert job.done_pages == 2
    assert job.error is not None and "10 bytes" in job.error


def test_capacity_evicts_the_least_recently_used_pages(tmp_path: Path) -> None:
    store = FileStorage(tmp_path / "l3", PAGE, capacity_pages=3)
    assert store.capacity_bytes == 3 * PAGE
    keys = chained_hashes([[i] for i in range(5)])
    for key in keys[:3]:
        store.put(key, os.urandom(PAGE))
    assert store.prefix_hits(keys[:1]) == 1  # keys[0] is used again: keys[1] is now the oldest
    store.put(keys[3], os.urandom(PAGE))
    assert store.exists(keys[:4]) == [True, False, True, True]
    assert store.prefix_hits(keys[:4]) == 1, "a prefetch of an evicted page misses"
    with pytest.raises(StorageError):
        store.get(keys[1])
    store.put(keys[4], os.urandom(PAGE))
    assert store.stored_pages() == 3 and store.evicted_pages == 2
    assert sum(f.stat().st_size for f in (tmp_path / "l3").glob("??/*")) <= store.capacity_bytes


def test_capacity_counts_the_pages_already_stored(tmp_path: Path) -> None:
    first = FileStorage(tmp_path / "l3", PAGE)
    keys = chained_hashes([[i] for i in range(4)])
    for key in keys:
        first.put(key, os.urandom(PAGE))
    reopened = FileStorage(tmp_path / "l3", PAGE, capacity_pages=2)
    assert reopened.stored_pages() == 2
    with pytest.raises(ValueError):
        FileStorage(tmp_path / "x", PAGE, capacity_pages=0)
