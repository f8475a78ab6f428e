"""L3 storage: a file backend keyed by SGLang's chained page hash, written atomically, with a
capacity past which the least recently used pages are evicted (a later prefetch of one misses)."""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path


def page_hash(token_ids: Sequence[int], prior_hash: bytes | None = None) -> bytes:
    """SHA-256 over the previous page's hash bytes, then each token id as 4 little-endian bytes."""
    hasher = hashlib.sha256()
    if prior_hash is not None:
        hasher.update(prior_hash)
    for token in token_ids:
        hasher.update(int(token).to_bytes(4, byteorder="little", signed=False))
    return hasher.digest()


def chained_hashes(pages: Sequence[Sequence[int]], prior_hash: bytes | None = None) -> list[bytes]:
    """The hash of each page of a token sequence, each chained on the one before."""
    hashes = []
    for page in pages:
        prior_hash = page_hash(page, prior_hash)
        hashes.append(prior_hash)
    return hashes


class StorageError(Exception):
    """A storage read or write failed; the page is treated as not transferred."""


class FileStorage:
    """One rank shard's pages as files under `root`, named by the hex of their chained hash.

    With `capacity_pages`, a put past that many pages evicts the least recently used ones (put,
    found by a query, or read), as a storage backend does: the store never holds more than
    `capacity_pages * page_bytes` bytes of pages (room is made before a page is renamed into place;
    the page being written is a `.tmp-` file until then). The capacity is in pages, so that replicas with
    shards of different sizes keep the same pages and make the same decisions. Pages already under
    `root` are counted, oldest first.
    """

    def __init__(self, root: Path | str, page_bytes: int, capacity_pages: int | None = None) -> None:
        if capacity_pages is not None and capacity_pages < 1:
            raise ValueError("capacity_pages must be at least 1")
        self.root = Path(root)
        self.page_bytes = page_bytes
        self.capacity_pages = capacity_pages
        self.evicted_pages = 0
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # the scheduler thread queries while the storage worker writes
        self._pages: OrderedDict[str, None] = OrderedDict()  # page names, least recently used first
        if capacity_pages is not None:
            found = sorted((f.stat().st_mtime_ns, f.name) for f in self.root.glob("??/*") if not f.name.startswith("."))
            self._pages.update((name, None) for _, name in found)
            with self._lock:
                self._evict()

    @property
    def capacity_bytes(self) -> int | None:
        return None if self.capacity_pages is None else self.capacity_pages * self.page_bytes

    def stored_pages(self) -> int:
        """How many pages the store holds now (counted on disk)."""
        return sum(1 for f in self.root.glob("??/*") if not f.name.startswith("."))

    def _touch(self, key: bytes) -> None:
        if self.capacity_pages is not None:
            with self._lock:
                name = key.hex()
                if name in self._pages:
                    self._pages.move_to_end(name)

    def _evict(self, keep: int | None = None) -> None:
        """Called with the lock held: remove the least recently used pages past `keep` (the capacity)."""
        assert self.capacity_pages is not None
        keep = self.capacity_pages if keep is None else keep
        while len(self._pages) > keep:
            name, _ = self._pages.popitem(last=False)
            try:
                (self.root / name[:2] / name).unlink()
            except FileNotFoundError:
                pass
            self.evicted_pages += 1

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Batched existence query: one answer per key, in order."""
        found = [self.path(key).is_file() for key in keys]
        for key, hit in zip(keys, found):
            if hit:
                self._touch(key)
        return found

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """How many leading keys exist (a prefix is only usable up to its first gap)."""
        for count, key in enumerate(keys):
            if not self.path(key).is_file():
                return count
            self._touch(key)
        return len(keys)

    def put(self, key: bytes, data: bytes) -> None:
        """Write one page atomically: a temporary file in the same directory, then rename."""
        if len(data) != self.page_bytes:
            raise StorageError(f"page of {len(data)} bytes, expected {self.page_bytes}")
        target = self.path(key)
        if self.capacity_pages is not None:
            with self._lock:  # make room first, so that the store never holds more than its capacity
                name = key.hex()
                if name not in self._pages:
                    self._evict(self.capacity_pages - 1)
                self._pages[name] = None
                self._pages.move_to_end(name)
        target.parent.mkdir(exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(data)
            os.replace(tmp, target)
        except OSError as err:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if self.capacity_pages is not None and not target.exists():
                with self._lock:
                    self._pages.pop(key.hex(), None)
            raise StorageError(f"cannot write {target}: {err}") from err

    def get(self, key: bytes) -> bytes:
        """Read one page; a missing or truncated file is a StorageError."""
        target = self.path(key)
        try:
            data = target.read_bytes()
        except OSError as err:
            raise StorageError(f"cannot read {target}: {err.strerror}") from err
        if len(data) != self.page_bytes:
            raise StorageError(f"{target} holds {len(data)} bytes, expected {self.page_bytes}")
        self._touch(key)
        return data

    def delete(self, key: bytes) -> None:
        if self.capacity_pages is not None:
            with self._lock:
                self._pages.pop(key.hex(), None)
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
