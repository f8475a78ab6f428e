"""Wire protocol v1 messages (DESIGN §5): valid messages parse, invalid ones give the right code."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from exporter.errors import ErrorCode, ProtocolError
from exporter.protocol.framing import FrameDecoder, encode_message
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    ErrorMessage,
    Hello,
    Snapshot,
    World,
    is_histogram,
    parse_client_message,
    parse_server_message,
)

PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# The examples exactly as DESIGN §5 shows them.
DESIGN_HELLO = """{"type": "hello", "protocol": 1, "epoch": "3f2a…", "pid": 4242,
 "rank": {"tp_rank": 1, "pp_rank": 0, "dp_rank": 0},
 "labels": {"cache_type": "UnifiedRadixCache"},
 "world": {"tp_size": 2, "pp_size": 1, "dp_size": 1}}""".encode()

DESIGN_SNAPSHOT = b"""{"type": "snapshot", "seq": 17, "time": 1764400000.25, "samples": [
  {"family": "load_back_tokens_total", "labels": {"pool": "kv"}, "value": 4096},
  {"family": "load_back_bytes_total", "labels": {}, "value": 8388608},
  {"family": "load_back_duration_seconds", "labels": {},
   "buckets": [[0.001, 3], [0.01, 9], ["+Inf", 12]], "sum": 0.08, "count": 12},
  {"family": "hicache_host_used_tokens", "labels": {}, "value": 512}]}"""

DESIGN_BYE = b'{"type": "bye"}'


def hello(**overrides):
    base = {
        "type": "hello",
        "protocol": 1,
        "epoch": "3f2a",
        "pid": 4242,
        "rank": {"tp_rank": 1, "pp_rank": 0, "dp_rank": 0},
        "labels": {"cache_type": "UnifiedRadixCache"},
    }
    base.update(overrides)
    return base


def snapshot(*samples, **overrides):
    base = {"type": "snapshot", "seq": 17, "time": 1764400000.25, "samples": list(samples)}
    base.update(overrides)
    return base


def scalar(value=1, **overrides):
    base = {"family": "load_back_bytes_total", "labels": {}, "value": value}
    base.update(overrides)
    return base


def histogram(buckets=None, **overrides):
    base = {
        "family": "load_back_duration_seconds",
        "labels": {},
        "buckets": buckets if buckets is not None else [[0.001, 3], [0.01, 9], ["+Inf", 12]],
        "sum": 0.08,
        "count": 12,
    }
    base.update(overrides)
    return base


def dumps(obj) -> bytes:
    return json.dumps(obj).encode()


def code_of(payload: bytes) -> ErrorCode:
    with pytest.raises(ProtocolError) as info:
        parse_client_message(payload)
    assert info.value.message
    return info.value.code


# --- valid messages ---------------------------------------------------------------------------


def test_design_hello_parses():
    message = parse_client_message(DESIGN_HELLO)
    assert isinstance(message, Hello)
    assert message.protocol == PROTOCOL_VERSION == 1
    assert message.epoch == "3f2a…"
    assert message.pid == 4242
    assert (message.rank.tp_rank, message.rank.pp_rank, message.rank.dp_rank) == (1, 0, 0)
    assert message.labels == {"cache_type": "UnifiedRadixCache"}
    assert message.world is not None
    assert (message.world.tp_size, message.world.pp_size, message.world.dp_size) == (2, 1, 1)


def test_hello_world_and_labels_are_optional():
    payload = hello()
    del payload["labels"]
    message = parse_client_message(dumps(payload))
    assert isinstance(message, Hello)
    assert message.world is None
    assert message.labels == {}


def test_design_snapshot_parses():
    message = parse_client_message(DESIGN_SNAPSHOT)
    assert isinstance(message, Snapshot)
    assert message.seq == 17
    assert message.time == 1764400000.25
    tokens, nbytes, duration, used = message.samples
    assert not is_histogram(tokens)
    assert (tokens.family, tokens.labels, tokens.value) == ("load_back_tokens_total", {"pool": "kv"}, 4096)
    assert not is_histogram(nbytes) and nbytes.value == 8388608 and nbytes.labels == {}
    assert is_histogram(duration)
    assert duration.family == "load_back_duration_seconds"
    assert [tuple(b) for b in duration.buckets] == [(0.001, 3), (0.01, 9), ("+Inf", 12)]
    assert duration.sum == 0.08 and duration.count == 12
    assert not is_histogram(used) and used.family == "hicache_host_used_tokens" and used.value == 512


def test_design_bye_parses():
    assert parse_client_message(DESIGN_BYE) == Bye()


def test_snapshot_with_no_samples_parses():
    message = parse_client_message(dumps(snapshot()))
    assert isinstance(message, Snapshot) and message.samples == []


@pytest.mark.parametrize("epoch", ["a", "x" * 64, "3f2a…"])
def test_epoch_of_1_to_64_chars_is_accepted(epoch):
    message = parse_client_message(dumps(hello(epoch=epoch)))
    assert isinstance(message, Hello) and message.epoch == epoch


def test_integer_bucket_bound_is_a_number():
    message = parse_client_message(dumps(snapshot(histogram([[1, 1], [5, 2], ["+Inf", 3]], count=3))))
    assert [tuple(b) for b in message.samples[0].buckets] == [(1.0, 1), (5.0, 2), ("+Inf", 3)]
    assert all(type(b) is float for b, _ in message.samples[0].buckets[:-1])


def test_design_error_and_welcome_parse_on_the_rank_side():
    err = parse_server_message(b'{"type": "error", "code": "duplicate_rank", "message": "taken"}')
    assert isinstance(err, ErrorMessage) and err.code == "duplicate_rank" and err.message == "taken"
    with pytest.raises(ProtocolError) as info:
        parse_server_message(b'{"type": "hello"}')
    assert info.value.code is ErrorCode.MALFORMED_FRAME


# --- property: generated valid snapshots round-trip unchanged -------------------------------

_names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,15}", fullmatch=True)
_label_sets = st.dictionaries(_names, st.text(max_size=20), max_size=4)
_finite = st.floats(allow_nan=False, allow_infinity=False)
_number = st.one_of(_finite, st.integers(min_value=-(2**53), max_value=2**53))


@st.composite
def _histogram_samples(draw):
    bounds = sorted(set(draw(st.lists(_finite, min_size=0, max_size=8))))
    increments = draw(st.lists(st.integers(0, 10**6), min_size=len(bounds) + 1, max_size=len(bounds) + 1))
    running, buckets = 0, []
    for bound, inc in zip([*bounds, "+Inf"], increments):
        running += inc
        buckets.append([bound, running])
    return {
        "family": draw(_names),
        "labels": draw(_label_sets),
        "buckets": buckets,
        "sum": draw(_finite),
        "count": running,
    }


_scalar_samples = st.fixed_dictionaries(
    {"family": _names, "labels": _label_sets, "value": _number}
)


_snapshots = st.fixed_dictionaries(
    {
        "type": st.just("snapshot"),
        "seq": st.integers(min_value=0, max_value=2**63 - 1),
        "time": _finite,
        "samples": st.lists(st.one_of(_scalar_samples, _histogram_samples()), max_size=6),
    }
)


def _dump(message: Snapshot) -> dict:
    """The parsed snapshot as plain data, every sample field spelled out."""
    samples = []
    for sample in message.samples:
        out = {"family": sample.family, "labels": sample.labels}
        if is_histogram(sample):
            out.update(buckets=sample.buckets, sum=sample.sum, count=sample.count)
        else:
            out["value"] = sample.value
        samples.append(out)
    return {"type": "snapshot", "seq": message.seq, "time": message.time, "samples": samples}


def _expected(snap: dict) -> dict:
    """The dict as `_dump` gives it: numbers as floats, bucket pairs as tuples."""
    samples = []
    for sample in snap["samples"]:
        out = {"family": sample["family"], "labels": sample["labels"]}
        if "value" in sample:
            out["value"] = float(sample["value"])
        else:
            out["buckets"] = [(b if b == "+Inf" else float(b), c) for b, c in sample["buckets"]]
            out["sum"] = float(sample["sum"])
            out["count"] = sample["count"]
        samples.append(out)
    return {"type": "snapshot", "seq": snap["seq"], "time": float(snap["time"]), "samples": samples}


def _decode_one(frame: bytes, chunk: int):
    decoder = FrameDecoder()
    payloads = []
    for i in range(0, len(frame), chunk):
        payloads.extend(decoder.feed(frame[i : i + chunk]))
    assert len(payloads) == 1 and decoder.buffered == 0
    return parse_client_message(payloads[0])


@PROPERTY
@given(_snapshots, st.integers(1, 64))
def test_valid_snapshots_roundtrip_unchanged(snap, chunk):
    parsed = _decode_one(encode_message(snap), chunk)
    assert isinstance(parsed, Snapshot)
    assert _dump(parsed) == _expected(snap)
    assert all(type(s.value) is float for s in parsed.samples if not is_histogram(s))
    # And the parsed model encodes to a frame that parses to an equal model.
    again = _decode_one(encode_message(parsed), chunk)
    assert again == parsed


# --- invalid messages -------------------------------------------------------------------------

MALFORMED = ErrorCode.MALFORMED_FRAME


@pytest.mark.parametrize(
    "payload",
    [
        b"\xff\xfe\xfd",
        dumps(hello()).replace(b'"3f2a"', b'"3f\xc3"'),  # truncated 2-byte sequence
        dumps(hello()).replace(b'"3f2a"', b'"\xed\xa0\x80"'),  # encoded surrogate
        dumps(hello()).replace(b'"UnifiedRadixCache"', b'"Unified\xffCache"'),
        dumps(snapshot(scalar())).replace(b'"load_back_bytes_total"', b'"load_back\x80"'),
        dumps(hello()).replace(b'"3f2a"', b'"\xc0\xaf"'),  # overlong encoding of "/"
        dumps(hello()).replace(b'"UnifiedRadixCache"', b'"a\\ud800b"'),  # a lone surrogate, escaped
    ],
    ids=["garbage", "truncated-seq", "surrogate", "label-value", "lone-continuation", "overlong", "escaped-surrogate"],
)
def test_invalid_utf8_is_malformed(payload):
    assert code_of(payload) is MALFORMED


@pytest.mark.parametrize(
    "payload",
    [b"", b"hello", b"{", b'{"type": "bye"', b"{'type': 'bye'}", b'{"type": "bye"} x',
     b'{"type": "bye"}{"type": "bye"}', b'{type: "bye"}', b'{"type": "bye",}'],
)
def test_non_json_is_malformed(payload):
    assert code_of(payload) is MALFORMED


@pytest.mark.parametrize(
    "payload", [b"[]", b"42", b'"bye"', b"null", b"true", b'[{"type": "bye"}]', b"1.5"]
)
def test_json_that_is_not_an_object_is_malformed(payload):
    assert code_of(payload) is MALFORMED


@pytest.mark.parametrize("depth", [1_000, 100_000])
def test_deeply_nested_json_is_malformed(depth):
    nested = b"[" * depth + b"]" * depth
    assert code_of(nested) is MALFORMED
    assert code_of(b'{"type": "bye", "x": ' + nested + b"}") is MALFORMED
    snap = dumps(snapshot(scalar(value=0))).replace(b'"value": 0', b'"value": ' + nested)
    assert code_of(snap) is MALFORMED
    objects = b'{"a": ' * depth + b"1" + b"}" * depth
    assert code_of(objects) is MALFORMED


def test_deep_nesting_inside_a_protocol1_hello_is_malformed():
    depth = 100_000
    payload = dumps(hello()).replace(b'"pid": 4242', b'"pid": ' + b"[" * depth + b"]" * depth)
    assert code_of(payload) is MALFORMED


def _with(obj, old: bytes, new: bytes) -> bytes:
    raw = dumps(obj)
    assert old in raw
    return raw.replace(old, new, 1)


@pytest.mark.parametrize(
    "payload",
    [
        _with(snapshot(scalar(value=1)), b'"value": 1', b'"value": NaN'),
        _with(snapshot(scalar(value=1)), b'"value": 1', b'"value": Infinity'),
        _with(snapshot(scalar(value=1)), b'"value": 1', b'"value": -Infinity'),
        _with(snapshot(scalar(value=1)), b'"value": 1', b'"value": 1e400'),
        _with(snapshot(), b'"time": 1764400000.25', b'"time": NaN'),
        _with(snapshot(), b'"time": 1764400000.25', b'"time": Infinity'),
        _with(snapshot(histogram()), b'"sum": 0.08', b'"sum": NaN'),
        _with(snapshot(histogram()), b'"sum": 0.08', b'"sum": Infinity'),
        _with(snapshot(histogram()), b"[0.01, 9]", b"[NaN, 9]"),
        _with(snapshot(histogram()), b"[0.01, 9]", b"[Infinity, 9]"),
        _with(snapshot(histogram()), b"[0.01, 9]", b"[-Infinity, 9]"),
    ],
    ids=["value-nan", "value-inf", "value-neg-inf", "value-overflow", "time-nan", "time-inf",
         "sum-nan", "sum-inf", "bound-nan", "bound-inf", "bound-neg-inf"],
)
def test_nan_and_infinity_are_malformed(payload):
    assert code_of(payload) is MALFORMED


@pytest.mark.parametrize(
    "obj",
    [
        snapshot(scalar(value="1")),
        snapshot(scalar(value=True)),
        snapshot(scalar(value=None)),
        snapshot(scalar(value=[1])),
        snapshot(seq=-1),
        snapshot(seq="17"),
        snapshot(seq=1.5),
        snapshot(time="now"),
        snapshot(samples={"a": 1}),
        snapshot(scalar(labels={"pool": 1})),
        snapshot(scalar(labels=["pool"])),
        snapshot(scalar(family="")),
        snapshot(scalar(family=7)),
        snapshot(histogram(count=-1, buckets=[["+Inf", 0]])),
        snapshot(histogram(count=1.5)),
        snapshot(histogram(buckets=[[0.001, 1.5], ["+Inf", 2]])),
        snapshot(histogram(buckets=[])),
        hello(pid=-1),
        hello(pid="4242"),
        hello(pid=4242.0),
        hello(protocol="1"),
        hello(epoch=17),
        hello(rank={"tp_rank": -1, "pp_rank": 0, "dp_rank": 0}),
        hello(rank={"tp_rank": "1", "pp_rank": 0, "dp_rank": 0}),
        hello(rank={"tp_rank": 1, "pp_rank": 0}),
        hello(labels={"cache_type": 5}),
        hello(world={"tp_size": 0, "pp_size": 1, "dp_size": 1}),
    ],
    ids=lambda obj: json.dumps(obj)[:60],
)
def test_wrong_types_are_malformed(obj):
    assert code_of(dumps(obj)) is MALFORMED


@pytest.mark.parametrize("epoch", ["", "x" * 65, "…" * 65])
def test_epoch_of_0_or_65_chars_is_malformed(epoch):
    assert code_of(dumps(hello(epoch=epoch))) is MALFORMED


@pytest.mark.parametrize(
    "obj",
    [{"type": "goodbye"}, {"type": "welcome", "protocol": 1, "server": "x"},
     {"type": "error", "code": "x", "message": "y"}, {"type": ""}, {"type": None}, {}, {"seq": 1}],
)
def test_unknown_message_type_is_malformed(obj):
    assert code_of(dumps(obj)) is MALFORMED


@pytest.mark.parametrize(
    "obj",
    [
        {"type": "bye", "reason": "done"},
        hello(extra=1),
        hello(rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "ep_rank": 0}),
        hello(world={"tp_size": 2, "pp_size": 1, "dp_size": 1, "ep_size": 1}),
        snapshot(rank=1),
        snapshot(scalar(unit="bytes")),
    ],
    ids=["bye", "hello", "rank", "world", "snapshot", "scalar"],
)
def test_extra_fields_are_malformed(obj):
    assert code_of(dumps(obj)) is MALFORMED


@pytest.mark.parametrize(
    "sample",
    [histogram(value=1), {"family": "x", "labels": {}, "value": 1, "buckets": [["+Inf", 1]], "sum": 1, "count": 1},
     {"family": "x", "labels": {}}, {"family": "x", "labels": {}, "buckets": [["+Inf", 1]], "count": 1}],
    ids=["histogram+value", "both-shapes", "neither", "histogram-without-sum"],
)
def test_which_fields_a_sample_needs_is_left_to_the_catalog(sample):
    """The shape depends on the family's type: the sidecar rejects a wrong one per sample."""
    (parsed,) = parse_client_message(dumps(snapshot(sample))).samples
    assert parsed.family == sample["family"]
    assert (parsed.value is UNSET) == ("value" not in sample) and (parsed.sum is UNSET) == ("sum" not in sample)


@pytest.mark.parametrize(
    "obj",
    [
        hello(protocol=2),
        hello(protocol=0),
        hello(protocol=3, capabilities=["gzip"], rank={"tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "cp_rank": 1}),
        hello(protocol=2, compression="zstd"),
        {"type": "hello", "protocol": 2},
        {"type": "hello", "protocol": 2, "identity": {"rank": "r0"}},
    ],
    ids=["v2", "v0", "v3-new-fields", "v2-new-field", "v2-bare", "v2-new-shape"],
)
def test_other_protocol_versions_are_unsupported(obj):
    with pytest.raises(ProtocolError) as info:
        parse_client_message(dumps(obj))
    assert info.value.code is ErrorCode.UNSUPPORTED_PROTOCOL
    assert str(obj["protocol"]) in info.value.message


def test_protocol1_hello_with_unknown_field_is_malformed_not_unsupported():
    assert code_of(dumps(hello(compression="zstd"))) is MALFORMED


@pytest.mark.parametrize("bound", [None, True, [0.5], {"le": 0.5}, "x" * 17])
def test_bucket_bound_must_be_a_number_or_a_short_string(bound):
    obj = snapshot(histogram([[0.001, 3], [bound, 9], ["+Inf", 12]]))
    assert code_of(dumps(obj)) is MALFORMED


@pytest.mark.parametrize("bound", ["0.5", "inf", "+inf", "Inf", "Infinity", "-Inf", ""])
def test_a_string_bound_other_than_plus_inf_decodes_for_the_sidecar_to_drop_that_sample(bound):
    """One bad sample must not cost the rest of the frame: the reader refuses it (bucket_mismatch)."""
    message = parse_client_message(dumps(snapshot(histogram([[0.001, 3], [bound, 9], ["+Inf", 12]]))))
    assert isinstance(message, Snapshot) and message.samples[0].buckets[1][0] == bound


def test_bucket_pair_must_be_a_pair():
    for bad in ([[0.001], ["+Inf", 12]], [[0.001, 3, 4], ["+Inf", 12]], [0.001, "+Inf"]):
        assert code_of(dumps(snapshot(histogram(bad)))) is MALFORMED


def test_error_message_summarises_the_problem_location():
    with pytest.raises(ProtocolError) as info:
        parse_client_message(dumps(hello(pid=-1)))
    assert "pid" in info.value.message



def test_a_world_without_attention_sizes_encodes_as_before_and_the_attention_sizes_decode() -> None:
    """A client that sends no attention sizes writes the three keys an older sidecar accepts (omit_defaults);
    a world with them decodes, and a key outside World is refused."""
    plain = World(tp_size=2, pp_size=1, dp_size=1)
    assert json.loads(msgspec.json.encode(plain)) == {"tp_size": 2, "pp_size": 1, "dp_size": 1}
    sizes = {"tp_size": 8, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 2}
    assert msgspec.json.decode(json.dumps(sizes), type=World) == World(**sizes)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps({**sizes, "cp_size": 2}), type=World)
    with pytest.raises(msgspec.ValidationError):
        msgspec.json.decode(json.dumps({**sizes, "attn_cp_size": 0}), type=World)
