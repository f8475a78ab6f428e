"""Framing (DESIGN §5): a 4-byte big-endian length N, 1 <= N <= max_frame_bytes, then N bytes."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.framing import (
    DEFAULT_MAX_FRAME_BYTES,
    FrameDecoder,
    encode_frame,
    encode_message,
)
from exporter.protocol.messages import Bye, Hello, RankId, Snapshot, parse_client_message

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def header(length: int) -> bytes:
    return struct.pack(">I", length)


def split_at(stream: bytes, cuts: list[int]) -> list[bytes]:
    points = [0, *sorted(cuts), len(stream)]
    return [stream[a:b] for a, b in zip(points, points[1:])]


# --- encoding ---------------------------------------------------------------------------------


def test_encode_frame_prefixes_a_big_endian_length():
    assert encode_frame(b"{}") == b"\x00\x00\x00\x02{}"
    payload = b"x" * 300
    assert encode_frame(payload) == b"\x00\x00\x01\x2c" + payload
    big = b"y" * 70000  # needs the third length byte
    assert encode_frame(big)[:4] == b"\x00\x01\x11\x70"


def test_encode_frame_refuses_an_empty_payload():
    with pytest.raises(ValueError):
        encode_frame(b"")


def test_encode_message_dict_is_compact_json():
    frame = encode_message({"type": "bye"})
    assert frame == header(14) + b'{"type":"bye"}'
    assert parse_client_message(frame[4:]) == Bye()


def test_encode_message_model_roundtrips():
    hello = Hello(
        protocol=1,
        epoch="e1",
        pid=7,
        rank=RankId(tp_rank=1, pp_rank=0, dp_rank=2),
        labels={"cache_type": "UnifiedRadixCache"},
    )
    frame = encode_message(hello)
    (length,) = struct.unpack(">I", frame[:4])
    assert length == len(frame) - 4
    assert b"world" not in frame  # exclude_none: an absent optional field is not sent as null
    assert parse_client_message(frame[4:]) == hello


def test_encode_message_refuses_nan_and_infinity():
    for bad in (float("nan"), float("inf"), float("-inf")):
        with pytest.raises(ValueError):
            encode_message({"type": "snapshot", "seq": 0, "time": bad, "samples": []})


def test_default_max_frame_bytes_is_one_mib():
    assert DEFAULT_MAX_FRAME_BYTES == 1 << 20
    assert FrameDecoder().max_frame_bytes == 1 << 20


# --- decoding ---------------------------------------------------------------------------------


@PROPERTY
@given(st.binary(min_size=1, max_size=4096))
def test_encode_decode_roundtrip(payload):
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(payload)) == [payload]
    assert decoder.buffered == 0


@PROPERTY
@given(
    payloads=st.lists(st.binary(min_size=1, max_size=300), max_size=20),
    data=st.data(),
)
def test_any_chunking_yields_the_same_frames(payloads, data):
    stream = b"".join(encode_frame(p) for p in payloads)
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=40), label="cuts")
    decoder = FrameDecoder(max_frame_bytes=300)
    frames: list[bytes] = []
    for chunk in split_at(stream, cuts):
        frames.extend(decoder.feed(chunk))
    assert frames == payloads
    assert decoder.buffered == 0


def test_one_byte_at_a_time_emits_each_frame_on_its_last_byte():
    payloads = [b"a", b"bc" * 10, b"{}"]
    stream = b"".join(encode_frame(p) for p in payloads)
    ends = set()
    pos = 0
    for p in payloads:
        pos += 4 + len(p)
        ends.add(pos)
    decoder = FrameDecoder()
    got = []
    for i in range(len(stream)):
        out = decoder.feed(stream[i : i + 1])
        if i + 1 in ends:
            assert len(out) == 1
            got.extend(out)
        else:
            assert out == []
    assert got == payloads


def test_partial_frame_is_held_until_complete():
    decoder = FrameDecoder()
    frame = encode_frame(b"hello world")
    assert decoder.feed(frame[:2]) == []
    assert decoder.feed(frame[2:9]) == []
    assert decoder.buffered > 0
    assert decoder.feed(frame[9:] + frame[:5]) == [b"hello world"]
    assert decoder.feed(frame[5:]) == [b"hello world"]
    assert decoder.buffered == 0


def test_several_frames_in_one_chunk():
    decoder = FrameDecoder()
    stream = encode_frame(b"1") + encode_frame(b"22") + encode_frame(b"333")
    assert decoder.feed(stream) == [b"1", b"22", b"333"]


def test_zero_length_frame_is_malformed():
    with pytest.raises(ProtocolError) as info:
        FrameDecoder().feed(header(0))
    assert info.value.code is ErrorCode.MALFORMED_FRAME


def test_zero_length_frame_after_a_good_frame_is_malformed():
    decoder = FrameDecoder()
    assert decoder.feed(encode_frame(b"ok")) == [b"ok"]
    with pytest.raises(ProtocolError) as info:
        decoder.feed(header(0) + b"junk")
    assert info.value.code is ErrorCode.MALFORMED_FRAME


def test_frame_at_the_limit_is_accepted():
    decoder = FrameDecoder(max_frame_bytes=100)
    assert decoder.feed(encode_frame(b"z" * 100)) == [b"z" * 100]


def test_too_large_frame_is_refused_as_soon_as_the_header_arrives():
    decoder = FrameDecoder(max_frame_bytes=100)
    head = header(101)
    assert decoder.feed(head[:3]) == []  # not a whole header yet: nothing to judge
    with pytest.raises(ProtocolError) as info:
        decoder.feed(head[3:])  # no body byte has been sent
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE
    assert "101" in info.value.message


@pytest.mark.parametrize("length", [(1 << 20) + 1, 0xFFFFFFFF])
def test_default_limit_refuses_larger_frames_from_the_header(length):
    with pytest.raises(ProtocolError) as info:
        FrameDecoder().feed(header(length))
    assert info.value.code is ErrorCode.FRAME_TOO_LARGE


def test_default_limit_accepts_one_mib_header():
    decoder = FrameDecoder()
    assert decoder.feed(header(1 << 20)) == []  # waits for the body


# --- robustness -------------------------------------------------------------------------------

_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["+Inf", "hello", "snapshot", "bye"]),
)
_json_values = st.recursive(
    _json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(max_size=10), children, max_size=4),
    ),
    max_leaves=20,
)
_keys = st.sampled_from(
    ["type", "protocol", "epoch", "pid", "rank", "labels", "world", "seq", "time", "samples",
     "family", "value", "buckets", "sum", "count", "tp_rank", "pp_rank", "dp_rank"]
)


@st.composite
def _messageish(draw):
    """JSON objects shaped enough like protocol messages to reach deep validation paths."""
    obj = draw(st.dictionaries(_keys, _json_values, max_size=8))
    if draw(st.booleans()):
        obj["type"] = draw(st.sampled_from(["hello", "snapshot", "bye", "welcome", "error", ""]))
    if obj.get("type") == "hello" and draw(st.booleans()):
        obj["protocol"] = draw(st.one_of(st.integers(-3, 3), _json_scalars))
    return json.dumps(obj).encode()


_payloads = st.one_of(
    st.binary(min_size=1, max_size=200),
    st.text(min_size=1, max_size=100).map(lambda s: s.encode("utf-8", "surrogatepass")),
    _messageish(),
    _json_values.map(lambda v: json.dumps(v).encode()),
)


@st.composite
def _streams(draw):
    parts = []
    for _ in range(draw(st.integers(0, 6))):
        if draw(st.integers(0, 9)) == 0:
            parts.append(draw(st.binary(max_size=12)))  # raw garbage, often a bad header
        else:
            parts.append(encode_frame(draw(_payloads)))
    return b"".join(parts)


@PROPERTY
@given(stream=_streams(), data=st.data())
def test_arbitrary_bytes_only_ever_raise_protocol_error(stream, data):
    cuts = data.draw(st.lists(st.integers(0, len(stream)), max_size=10), label="cuts")
    decoder = FrameDecoder(max_frame_bytes=4096)
    try:
        for chunk in split_at(stream, cuts):
            for payload in decoder.feed(chunk):
                try:
                    message = parse_client_message(payload)
                except ProtocolError as err:
                    assert isinstance(err.code, ErrorCode)
                    assert err.message
                else:
                    assert isinstance(message, (Hello, Snapshot, Bye))
    except ProtocolError as err:
        assert err.code in (ErrorCode.MALFORMED_FRAME, ErrorCode.FRAME_TOO_LARGE)


@PROPERTY
@given(st.binary(max_size=300))
def test_parse_client_message_on_raw_bytes_only_raises_protocol_error(payload):
    try:
        parse_client_message(payload)
    except ProtocolError as err:
        assert isinstance(err.code, ErrorCode)
