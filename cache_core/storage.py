"""L3 storage: a file backend keyed by SGLang's chained page hash, written atomically."""

from __future__ import annotations

import hashlib
import os
import tempfile
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
    """One rank shard's pages as files under `root`, named by the hex of their chained hash."""

    def __init__(self, root: Path | str, page_bytes: int) -> None:
        self.root = Path(root)
        self.page_bytes = page_bytes
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.root / name[:2] / name

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Batched existence query: one answer per key, in order."""
        return [self.path(key).is_file() for key in keys]

    def prefix_hits(self, keys: Sequence[bytes]) -> int:
        """How many leading keys exist (a prefix is only usable up to its first gap)."""
        for count, key in enumerate(keys):
            if not self.path(key).is_file():
                return count
        return len(keys)

    def put(self, key: bytes, data: bytes) -> None:
        """Write one page atomically: a temporary file in the same directory, then rename."""
        if len(data) != self.page_bytes:
            raise StorageError(f"page of {len(data)} bytes, expected {self.page_bytes}")
        target = self.path(key)
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
        return data

    def delete(self, key: bytes) -> None:
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
