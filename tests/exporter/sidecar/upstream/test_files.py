"""The multiprocess directory reader (exporter.sidecar.upstream.files) against what a hostile or
half-written directory holds: each bad file is skipped and reported by kind, the rest is read.

Files are written by prometheus_client's own writer (MmapedDict), then cut, overwritten or
replaced; FIFOs, links and sparse files are real.
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector

from exporter.config import UpstreamConfig
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.upstream import files as upstream_files
from exporter.sidecar.upstream.feed import UpstreamFeed
from exporter.sidecar.upstream.files import MERGED
from tests.exporter.sidecar.harness import Harness
from tests.exporter.sidecar.upstream.support import directory_exposition

LABELS = ["cache_type", "tp_rank", "pp_rank", "dp_rank"]
FAMILY = "sglang:load_back_bytes"


def write_db(path: Path, entries: list[tuple[str, float]]) -> None:
    """A .db file as prometheus_client's writer leaves it."""
    values = MmapedDict(str(path))
    for key, value in entries:
        values.write_value(key, value, 0.0)
    values.close()


def radix_key(tp: str) -> str:
    return mmap_key(FAMILY, FAMILY + "_total", LABELS, ["c", tp, "0", "0"], "bytes")


def good_process(directory: Path, pid: str = "101", tp: str = "0", value: float = 100.0) -> None:
    write_db(directory / f"counter_{pid}.db", [(radix_key(tp), value)])


def raw_db(used: int, body: bytes = b"", size: int | None = None) -> bytes:
    data = struct.pack("i", used) + b"\0\0\0\0" + body
    return data + b"\0" * max(0, (size or len(data)) - len(data))


def entry(key: bytes, value: float = 1.0) -> bytes:
    """One entry as prometheus_client's writer lays it out: length, key padded to 8, value, timestamp."""
    padded = key + b" " * (8 - (len(key) + 4) % 8)
    return struct.pack(f"i{len(padded)}sdd", len(key), padded, value, 0.0)


def with_entries(*keys: bytes) -> bytes:
    body = b"".join(entry(key) for key in keys)
    return raw_db(8 + len(body), body)


def sparse(path: Path, used: int, size: int) -> None:
    with open(path, "wb") as file:
        file.write(struct.pack("i", used))
        file.truncate(size)


def fifo(path: Path) -> None:
    os.mkfifo(path)


def link(path: Path) -> None:
    good_process(path.parent, "777", "7")
    (path.parent / "counter_777.db").rename(path.parent / "elsewhere")
    path.symlink_to(path.parent / "elsewhere")


def directory(path: Path) -> None:
    path.mkdir()


def writes(data: bytes) -> Callable[[Path], object]:
    return lambda path: path.write_bytes(data)


def written(entries: list[tuple[str, float]]) -> Callable[[Path], None]:
    return lambda path: write_db(path, entries)


HOSTILE: dict[str, tuple[str, Callable[[Path], object], str]] = {  # name: (file name, how it is made, the kind it is skipped as)
    "0 bytes (a writer between open and truncate)": ("counter_9.db", writes(b""), "truncated"),
    "6 bytes": ("counter_9.db", writes(b"\x10\0\0\0\0\0"), "truncated"),
    "a header claiming more than the file": ("counter_9.db", writes(raw_db(1 << 20, size=64)), "corrupt"),
    "a header below its own size": ("counter_9.db", writes(raw_db(5, size=64)), "corrupt"),
    "sparse 1 GiB claiming 2 GiB": ("counter_9.db", lambda p: sparse(p, (1 << 31) - 1, 1 << 30), "corrupt"),
    "sparse 1 GiB claiming 40 MiB": ("counter_9.db", lambda p: sparse(p, 40 << 20, 1 << 30), "too_large"),
    "an entry past the used bytes": ("counter_9.db", writes(raw_db(64, struct.pack("i", 400), size=64)), "corrupt"),
    "a key that is not UTF-8": ("counter_9.db", writes(with_entries(b"\xff\xfe[")), "corrupt"),
    "a key that is not JSON": ("counter_9.db", writes(with_entries(b"not json")), "corrupt"),
    "a key that is a JSON object": ("counter_9.db", written([('{"a": 1, "b": 2, "c": 3, "d": 4}', 1.0)]), "corrupt"),
    "a key of 3 items": ("counter_9.db", written([('["a", "b", {}]', 1.0)]), "corrupt"),
    "a label value that is a number": ("counter_9.db", written([('["a", "a", {"x": 1}, "h"]', 1.0)]), "corrupt"),
    "deeply nested JSON": ("counter_9.db", writes(with_entries(b"[" * 100000)), "corrupt"),
    "a bucket bound that is no number": (
        "histogram_9.db", written([(mmap_key("h", "h_bucket", ["le"], ["abc"], "x"), 1.0)]), "corrupt"),
    "a histogram read before its writer added its +Inf bucket": ("histogram_9.db", written(
        [(mmap_key("h", "h_sum", [], [], "x"), 1.0), (mmap_key("h", "h_bucket", ["le"], ["0.1"], "x"), 1.0)]), "truncated"),
    "a gauge with no mode in its name": ("gauge_9.db", written([(radix_key("9"), 1.0)]), "bad_name"),
    "an unknown kind": ("info_9.db", written([(radix_key("9"), 1.0)]), "bad_name"),
    "a FIFO": ("counter_9.db", fifo, "not_regular"),
    "a symbolic link": ("counter_9.db", link, "not_regular"),
    "a directory": ("counter_9.db", directory, "not_regular"),
}


def bounded(fn: Callable[[], object]) -> object:
    """`fn()` on a daemon thread, failed (not hung) where it blocks, as a FIFO's open() did."""
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    thread.start()
    thread.join(30)
    assert out, "the read blocked"
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _outcome(fn: Callable[[], object]) -> object:
    try:
        return fn()
    except BaseException as err:  # handed back to the test's thread
        return err


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_file_is_skipped_by_kind_and_the_rest_is_read(tmp_path: Path, case: str) -> None:
    name, make, kind = HOSTILE[case]
    good_process(tmp_path)
    make(tmp_path / name)
    reading = bounded(lambda: directory_exposition(tmp_path))
    assert [pid for pid, _, _ in reading] == ["101", MERGED]  # type: ignore[attr-defined]
    out = upstream_files.read_directory(tmp_path)
    assert [(s.name, s.kind) for s in out.skipped] == [(name, kind)]
    assert [(pid, [s.value for f in families for s in f.samples]) for pid, _, families in out.exposition] == [
        ("101", [100.0]), (MERGED, [100.0])]


def test_entries_whose_lengths_step_backwards_are_corrupt_not_a_loop(tmp_path: Path) -> None:
    # prometheus_client's decoder moves by a length the file gives: a negative one steps back.
    body = struct.pack("i", -100) + b"\0" * 244
    (tmp_path / "counter_9.db").write_bytes(raw_db(256, body))
    out = upstream_files.read_directory(tmp_path)
    assert [(s.name, s.kind) for s in out.skipped] == [("counter_9.db", "corrupt")] and out.exposition == [(MERGED, 0.0, [])]


def test_a_file_removed_since_the_listing_is_left_out_quietly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good_process(tmp_path)
    good_process(tmp_path, "102", "1")
    listing = upstream_files._listing
    monkeypatch.setattr(upstream_files, "_listing", lambda fd: [*listing(fd), "gauge_livesum_103.db"])
    out = upstream_files.read_directory(tmp_path)
    assert not out.skipped and [pid for pid, _, _ in out.exposition] == ["101", "102", MERGED]


def test_reads_past_the_caps_are_refused_as_a_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for pid in range(3):
        good_process(tmp_path, str(100 + pid), str(pid))
    assert upstream_files.read_directory(tmp_path, max_entries=3).entries == 3
    with pytest.raises(upstream_files.TooLarge, match="more than 2 samples"):
        upstream_files.read_directory(tmp_path, max_entries=2)
    monkeypatch.setattr(upstream_files, "MAX_FILES", 2)
    with pytest.raises(upstream_files.TooLarge, match="more than 2 .db files"):
        upstream_files.read_directory(tmp_path)
    monkeypatch.setattr(upstream_files, "MAX_FILES", 100)
    used = (tmp_path / "counter_100.db").read_bytes()[:4]
    monkeypatch.setattr(upstream_files, "MAX_READ_BYTES", 2 * struct.unpack("i", used)[0])
    with pytest.raises(upstream_files.TooLarge, match="hold more than"):
        upstream_files.read_directory(tmp_path)


# --- fuzz: random names, bytes, truncations, sizes and gauge modes ---


def _valid_bytes(kind: str) -> bytes:
    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "f.db"
        if kind == "histogram":
            rank = ["c", "0", "0", "0"]
            bucket = [*LABELS, "le"]
            buckets = [(mmap_key("sglang:d", "sglang:d_bucket", bucket, [*rank, le], "s"), 1.0) for le in ("0.1", "+Inf")]
            write_db(path, [*buckets, (mmap_key("sglang:d", "sglang:d_sum", LABELS, rank, "s"), 2.0)])
        else:
            write_db(path, [(radix_key("0"), 5.0), (mmap_key("sglang:x", "sglang:x", ["m"], ["y"], "x"), 1.0)])
        data = path.read_bytes()
    return data[:struct.unpack("i", data[:4])[0]]  # the used bytes (the rest is the writer's zeroed reserve)


VALID = {kind: _valid_bytes(kind) for kind in ("counter", "histogram")}
NAMES = st.one_of(
    st.builds(lambda kind, mode, pid: f"{kind}{'_' + mode if mode else ''}_{pid}.db",
              st.sampled_from(["counter", "gauge", "histogram", "summary", "info", "x"]),
              st.sampled_from(["", "all", "liveall", "livesum", "max", "min", "mostrecent", "sum", "bogus"]),
              st.sampled_from(["1", "2", "3", "a_b"])),
    st.text(st.characters(codec="ascii", exclude_characters="/\0"), min_size=1, max_size=12).map(lambda s: s + ".db"),
)


@st.composite
def file_contents(draw: st.DrawFn) -> bytes | str:
    how = draw(st.sampled_from(["valid", "truncated", "flipped", "random", "header", "fifo", "link"]))
    valid = VALID[draw(st.sampled_from(sorted(VALID)))]
    if how in ("fifo", "link"):
        return how
    if how == "valid":
        return valid
    if how == "truncated":
        return valid[:draw(st.integers(0, len(valid)))]
    if how == "flipped":
        at = draw(st.integers(0, len(valid) - 1))
        return valid[:at] + bytes([draw(st.integers(0, 255))]) + valid[at + 1:]
    if how == "header":  # a valid body under a header that claims any size
        return struct.pack("i", draw(st.integers(-(1 << 31), (1 << 31) - 1))) + valid[4:]
    return draw(st.binary(max_size=300))


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(files=st.dictionaries(NAMES, file_contents(), max_size=6), merged=st.booleans())
def test_any_directory_is_read_or_its_bad_files_are_skipped_never_raised(files: dict[str, bytes | str], merged: bool) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for name, content in files.items():
            if content == "fifo":
                os.mkfifo(root / name)
            elif content == "link":
                (root / name).symlink_to("/dev/zero")
            else:
                assert isinstance(content, bytes)
                (root / name).write_bytes(content)
        out = bounded(lambda: upstream_files.read_directory(root, merged))
        assert isinstance(out, upstream_files.DirectoryRead)
        read = {name for name in files if any(name.endswith(f"_{pid}.db") for pid, _, _ in out.exposition if pid != MERGED)}
        skipped = {s.name for s in out.skipped}
        assert read | skipped == set(files)
        for name, content in files.items():  # an untouched file reads as prometheus_client reads it
            if content in VALID.values() and name.startswith("counter_") and name.count("_") == 1:
                (pid,) = [p for p, _, _ in out.exposition if p == name[len("counter_"):-3]]
                mine = next(f for p, _, f in out.exposition if p == pid)
                if len([n for n in files if n.endswith(f"_{pid}.db")]) == 1:
                    assert _samples(mine) == _samples(MultiProcessCollector.merge([str(root / name)]))
        h = Harness()  # and the feed takes whatever was read
        config = UpstreamConfig.model_validate({"multiprocess_dir": scratch})
        UpstreamFeed(config, h.state, UpstreamHealth("u", scratch)).apply(out.exposition)


def _samples(families: object) -> list[tuple[str, str, float]]:
    return sorted((s.name, json.dumps(s.labels, sort_keys=True), s.value) for f in families for s in f.samples)  # type: ignore[attr-defined]
