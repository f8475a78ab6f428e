"""The state file on disk (exporter.sidecar.durable.file): framing, bounded reads, atomic writes, failure reasons.

Real files under tmp_path; write failures are injected OSErrors (the tests run as root, so modes do not refuse).
"""

from __future__ import annotations

import errno
import os
import struct
import threading
import zlib
from pathlib import Path

import msgspec
import pytest

from exporter.errors import StateFileError
from exporter.sidecar.durable import file as file_module
from exporter.sidecar.durable.file import (
    FORMAT_VERSION,
    HEADER,
    MAGIC,
    count_items,
    frame,
    read_file,
    set_aside,
    unframe,
    write_atomic,
    write_failure_reason,
)

PAYLOAD = bytes(range(256)) * 3 + b"\x00\xff"


def reason_of(data: bytes) -> StateFileError:
    with pytest.raises(StateFileError) as info:
        unframe(data)
    return info.value


# --- framing ---


@pytest.mark.parametrize("payload", [b"", b"x", PAYLOAD])
def test_frame_and_unframe_round_trip(payload: bytes) -> None:
    data = frame(payload)
    assert data[:8] == MAGIC and len(data) == HEADER.size + len(payload)
    assert HEADER.unpack_from(data) == (MAGIC, FORMAT_VERSION, zlib.crc32(payload), len(payload))
    assert unframe(data) == payload


@pytest.mark.parametrize("cut", [0, 1, HEADER.size - 1])
def test_a_file_cut_inside_the_header_is_truncated(cut: int) -> None:
    err = reason_of(frame(PAYLOAD)[:cut])
    assert err.reason == "truncated" and f"{cut} bytes" in err.message


@pytest.mark.parametrize("cut", [1, len(PAYLOAD) // 2, len(PAYLOAD)])
def test_a_file_cut_inside_the_payload_is_truncated(cut: int) -> None:
    err = reason_of(frame(PAYLOAD)[:-cut])
    assert err.reason == "truncated"
    assert err.message == f"{len(PAYLOAD) - cut} payload bytes of the {len(PAYLOAD)} its header announces"


@pytest.mark.parametrize("where", [HEADER.size, HEADER.size + 100, -1])
def test_a_flipped_payload_byte_fails_the_checksum(where: int) -> None:
    data = bytearray(frame(PAYLOAD))
    data[where] ^= 0x01
    err = reason_of(bytes(data))
    assert (err.reason, err.message) == ("corrupt", "its checksum does not match its contents")


def test_a_flipped_checksum_byte_fails_the_checksum() -> None:
    data = bytearray(frame(PAYLOAD))
    data[12] ^= 0x80  # inside the CRC field (magic 8 bytes, version 4)
    assert reason_of(bytes(data)).reason == "corrupt"


def test_another_magic_is_not_a_state_file() -> None:
    data = b"NOTSTATE" + frame(PAYLOAD)[8:]
    err = reason_of(data)
    assert err.reason == "corrupt" and "not a hicache-exporter state file" in err.message


def test_another_format_version_is_refused_by_its_number() -> None:
    data = struct.pack(">8sIIQ", MAGIC, FORMAT_VERSION + 1, zlib.crc32(PAYLOAD), len(PAYLOAD)) + PAYLOAD
    err = reason_of(data)
    assert err.reason == "version"
    assert err.message == f"format version {FORMAT_VERSION + 1}; this sidecar reads version {FORMAT_VERSION}"


def test_bytes_past_the_announced_length_are_corrupt() -> None:
    err = reason_of(frame(PAYLOAD) + b"\x00\x00\x00")
    assert (err.reason, err.message) == ("corrupt", f"3 bytes past the {len(PAYLOAD)} its header announces")


# --- reads ---


def test_a_missing_file_reads_as_none(tmp_path: Path) -> None:
    assert read_file(tmp_path / "absent", 1 << 20) is None


def test_a_whole_file_reads_back_exactly(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(frame(PAYLOAD))
    data = read_file(path, len(frame(PAYLOAD)))  # exactly at the bound: read
    assert data is not None and unframe(data) == PAYLOAD


def test_a_directory_in_place_of_the_file_is_unreadable(tmp_path: Path) -> None:
    (tmp_path / "state").mkdir()
    with pytest.raises(StateFileError) as info:
        read_file(tmp_path / "state", 1 << 20)
    assert (info.value.reason, info.value.message) == ("unreadable", "not a regular file")


def test_a_fifo_in_place_of_the_file_is_unreadable_without_blocking(tmp_path: Path) -> None:
    """A FIFO with no writer would block a plain open forever: the read runs in a thread so that a hang fails the test."""
    path = tmp_path / "state"
    os.mkfifo(path)
    outcome: list[BaseException | bytes | None] = []

    def read() -> None:
        try:
            outcome.append(read_file(path, 1 << 20))
        except BaseException as err:  # handed to the test's thread
            outcome.append(err)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(30)
    assert not reader.is_alive(), "read_file blocked on a FIFO"
    (err,) = outcome
    assert isinstance(err, StateFileError) and (err.reason, err.message) == ("unreadable", "not a regular file")


def test_a_file_over_the_bound_is_refused_before_it_is_read(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(b"\x00" * 1001)
    with pytest.raises(StateFileError) as info:
        read_file(path, 1000)
    assert info.value.reason == "too_large" and info.value.message.startswith("1001 bytes, more than the 1000")


def test_an_open_that_fails_is_unreadable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state"
    path.write_bytes(frame(PAYLOAD))

    def refuse(*_: object, **__: object) -> int:
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(file_module.os, "open", refuse)
    with pytest.raises(StateFileError) as info:
        read_file(path, 1 << 20)
    assert (info.value.reason, info.value.message) == ("unreadable", "cannot open it: Permission denied")


def test_a_read_that_fails_is_unreadable_and_closes_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state"
    path.write_bytes(frame(PAYLOAD))
    closed: list[int] = []
    real_close = os.close

    def fail(_fd: int, _n: int) -> bytes:
        raise OSError(errno.EIO, "Input/output error")

    def close(fd: int) -> None:
        closed.append(fd)
        real_close(fd)

    monkeypatch.setattr(file_module.os, "read", fail)
    monkeypatch.setattr(file_module.os, "close", close)
    with pytest.raises(StateFileError) as info:
        read_file(path, 1 << 20)
    assert (info.value.reason, info.value.message) == ("unreadable", "cannot read it: Input/output error")
    assert len(closed) == 1


# --- writes ---


def test_write_atomic_writes_the_bytes_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state"
    write_atomic(path, b"first")
    write_atomic(path, b"second, longer")
    assert path.read_bytes() == b"second, longer"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]
    assert path.stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize("call", ["fsync", "write"])
def test_a_write_that_fails_leaves_the_old_file_whole_and_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str,
) -> None:
    path = tmp_path / "state"
    old = frame(PAYLOAD)
    write_atomic(path, old)

    def full(*_: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(file_module.os, call, full)
    with pytest.raises(OSError) as info:
        write_atomic(path, frame(b"new"))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert path.read_bytes() == old
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state"]


def test_a_short_write_is_continued_until_every_byte_is_written(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_write = os.write

    def dribble(fd: int, data: bytes | memoryview) -> int:
        return real_write(fd, bytes(data[:7]))  # a disk that takes 7 bytes at a time

    monkeypatch.setattr(file_module.os, "write", dribble)
    write_atomic(tmp_path / "state", frame(PAYLOAD))
    monkeypatch.undo()
    assert unframe((tmp_path / "state").read_bytes()) == PAYLOAD


def test_a_write_into_a_missing_directory_fails_with_no_directory(tmp_path: Path) -> None:
    with pytest.raises(OSError) as info:
        write_atomic(tmp_path / "gone" / "state", b"x")
    assert write_failure_reason(info.value) == "no_directory"


@pytest.mark.parametrize(("code", "reason"), [
    (errno.ENOSPC, "no_space"), (errno.EDQUOT, "no_space"), (errno.EROFS, "read_only"), (errno.EACCES, "permission"),
    (errno.EPERM, "permission"), (errno.ENOENT, "no_directory"), (errno.ENOTDIR, "no_directory"), (errno.EIO, "io"),
    (None, "io"),
])
def test_write_failure_reasons(code: int | None, reason: str) -> None:
    err = OSError("no errno") if code is None else OSError(code, os.strerror(code))
    assert write_failure_reason(err) == reason


def test_set_aside_renames_the_file_with_the_unix_time(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(b"bad")
    aside = set_aside(path, now=1_764_400_123.9)
    assert aside == tmp_path / "state.corrupt-1764400123"
    assert not path.exists() and aside.read_bytes() == b"bad"


def test_two_files_set_aside_in_the_same_second_are_both_kept(tmp_path: Path) -> None:
    """Before: the second rename went over the first file set aside, which was lost."""
    path = tmp_path / "state"
    path.write_bytes(b"first bad")
    first = set_aside(path, now=1_764_400_123.0)
    path.write_bytes(b"second bad")
    second = set_aside(path, now=1_764_400_123.5)
    assert (first.name, second.name) == ("state.corrupt-1764400123", "state.corrupt-1764400123-1")
    assert first.read_bytes() == b"first bad" and second.read_bytes() == b"second bad"


def test_a_foreign_file_is_refused_by_its_first_bytes_without_reading_it_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "state"
    path.write_bytes(b"\x7fELF" + b"\x00" * (4 << 20))  # a binary given as the state file by mistake
    read: list[int] = []
    real_read = os.read

    def counting(fd: int, n: int) -> bytes:
        data = real_read(fd, n)
        read.append(len(data))
        return data

    monkeypatch.setattr(file_module.os, "read", counting)
    with pytest.raises(StateFileError) as info:
        read_file(path, 64 << 20)
    assert info.value.reason == "corrupt" and "not a hicache-exporter state file" in info.value.message
    assert sum(read) == len(MAGIC)


def test_a_file_shorter_than_the_magic_reads_whole_for_unframe_to_call_it_truncated(tmp_path: Path) -> None:
    path = tmp_path / "state"
    path.write_bytes(MAGIC[:5])
    data = read_file(path, 1 << 20)
    assert data == MAGIC[:5]
    assert reason_of(data).reason == "truncated"


@pytest.mark.parametrize("value", [
    0, -1, 2**40, -(2**40), 2**64 - 1, 1.5, None, True, "", "x" * 31, "é" * 200, "y" * 70_000, b"\x00" * 300,
    [], [1, [2, [3]]], {"a": 1, "b": [1.0, None]}, {str(i): i for i in range(20)}, list(range(70_000)),
    (0.0, "sglang_", [{"f": ("a", "b")}], {}, {}),
])
def test_count_items_counts_every_value_as_a_decode_builds_it(value: object) -> None:
    def walk(item: object) -> int:
        if isinstance(item, dict):
            return 1 + sum(walk(k) + walk(v) for k, v in item.items())
        if isinstance(item, list | tuple):
            return 1 + sum(map(walk, item))
        return 1

    assert count_items(msgspec.msgpack.encode(value), 10**9) == walk(value)


def test_count_items_refuses_what_an_array_announces_past_the_limit_before_reading_it() -> None:
    announced = b"\xdd" + (5_000_000).to_bytes(4, "big")  # 5 million entries announced, none there
    with pytest.raises(StateFileError) as refused:
        count_items(announced, 1_000)
    assert refused.value.reason == "over_limits" and "1000 values" in refused.value.message


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\x01", b"\x01\x02", b"\xda\x00\x05ab"])
def test_count_items_calls_what_is_not_whole_messagepack_corrupt(payload: bytes) -> None:
    with pytest.raises(StateFileError) as refused:
        count_items(payload, 1_000)
    assert refused.value.reason == "corrupt"


def test_a_file_read_whole_is_one_buffer_and_a_file_that_grew_is_read_to_its_end(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "state"
    path.write_bytes(frame(PAYLOAD))
    data = read_file(path, 1 << 20)
    assert isinstance(data, memoryview) and unframe(data) == PAYLOAD and unframe(data).obj is data.obj  # no copy
    real_fstat = os.fstat

    def smaller(fd: int) -> os.stat_result:  # the file grew by 10 bytes after its size was read
        info = list(real_fstat(fd))
        info[6] -= 10  # st_size
        return os.stat_result(info)

    monkeypatch.setattr(os, "fstat", smaller)
    data = read_file(path, 1 << 20)
    assert data is not None and bytes(data) == frame(PAYLOAD)
