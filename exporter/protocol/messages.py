"""Protocol v1 messages as strict msgspec structs, and the parsers for each direction.

msgspec decodes and validates a frame in one pass in C: a full-catalog snapshot costs about a
third of `json.loads` of the same bytes, which is what lets one core ingest thousands a second.
"""

from __future__ import annotations

import json
import sys
from typing import Annotated

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from exporter.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1
MAX_RANK = 1 << 16
MAX_SAMPLES = 1 << 16
# JSON has no NaN or Infinity; these bounds also refuse numbers that overflow to infinity (1e400).
Finite = Annotated[float, Meta(ge=-sys.float_info.max, le=sys.float_info.max)]
Count = Annotated[int, Meta(ge=0)]
RankNumber = Annotated[int, Meta(ge=0, lt=MAX_RANK)]
WorldSize = Annotated[int, Meta(ge=1, le=MAX_RANK)]
# A bucket bound is a finite number, or the string "+Inf" for the last bucket.
# A bucket bound is a finite number, or "+Inf" for the last bucket. Other strings decode too, so
# that the sidecar drops the one sample that has them (bucket_mismatch), not the whole frame.
BucketBound = Finite | Annotated[str, Meta(max_length=16)]
MAX_HELP_TEXTS = 1024
MAX_HELP_LENGTH = 4096
HelpText = Annotated[str, Meta(min_length=1, max_length=MAX_HELP_LENGTH)]
Buckets = Annotated[list[tuple[BucketBound, Count]], Meta(min_length=1, max_length=1024)]


class _Message(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, tag_field="type"):
    """A frame's top-level object; its "type" member names the struct (the tag)."""
    # Subclasses inherit these options; each repeats frozen=True so type checkers see it too.


class RankId(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The rank keys that, with the static labels, identify one rank."""

    tp_rank: RankNumber
    pp_rank: RankNumber
    dp_rank: RankNumber
    attn_cp_rank: RankNumber | None = None  # context-parallel rank; absent is 0, and not exposed


class World(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The parallel layout of the server the rank belongs to: the sidecar expects every rank of it.

    Its ranks are dp_size groups, each pp_size stages x attn_cp_size context-parallel ranks x
    attn_tp_size attention tp ranks. `attn_tp_size` absent is `tp_size` (a world without attention
    sizes: every tp rank of a stage in each dp group). Under DP attention the engine's tp_size is
    dp_size x attn_cp_size x attn_tp_size, and its scheduler labels the global tp rank.
    """

    tp_size: WorldSize
    pp_size: WorldSize
    dp_size: WorldSize
    attn_tp_size: WorldSize | None = None
    attn_cp_size: WorldSize = 1


class Hello(_Message, frozen=True, tag="hello"):
    """First frame of every connection: who the rank is and which process start (epoch)."""

    protocol: int
    epoch: Annotated[str, Meta(min_length=1, max_length=64)]
    pid: Count
    rank: RankId
    labels: dict[str, str] = {}
    world: World | None = None


class Sample(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True, gc=False):
    """One sample as sent: a `value` (counter or gauge), or `buckets`, `sum` and `count` (histogram).

    Which shape a sample must have depends on its family, so the sidecar checks it per sample
    against the catalog (a wrong one is `type_mismatch`), not here: a Python hook run per
    decoded sample would cost a fifth of the decode.
    """

    family: Annotated[str, Meta(min_length=1, max_length=256)]
    labels: dict[str, str] = {}
    value: Finite | UnsetType = UNSET
    buckets: Buckets | UnsetType = UNSET
    sum: Finite | UnsetType = UNSET
    count: Count | UnsetType = UNSET


def ScalarSample(family: str, value: float, labels: dict[str, str] | None = None) -> Sample:  # noqa: N802
    """A counter (cumulative since the epoch began) or gauge sample."""
    return Sample(family, labels or {}, value=value)


def HistogramSample(  # noqa: N802
    family: str, buckets: list[tuple[BucketBound, int]], sum: float, count: int, labels: dict[str, str] | None = None
) -> Sample:
    """A histogram sample: cumulative [upper_bound, count] pairs ending in "+Inf", with sum and count."""
    return Sample(family, labels or {}, buckets=buckets, sum=sum, count=count)


def is_histogram(sample: Sample) -> bool:
    return sample.buckets is not UNSET


class Snapshot(_Message, frozen=True, tag="snapshot"):
    """Cumulative values of the samples it names; `seq` rises within an epoch.

    `help` gives HELP texts of families (the engine's own wording), sent once per connection
    and again when new ones appear; the sidecar exposes the latest one it got per family.
    """

    seq: Count
    time: Finite
    samples: Annotated[list[Sample], Meta(max_length=MAX_SAMPLES)] = []
    help: Annotated[dict[str, HelpText], Meta(max_length=MAX_HELP_TEXTS)] = {}


class Bye(_Message, frozen=True, tag="bye"):
    """Ends a connection cleanly."""


class Welcome(_Message, frozen=True, tag="welcome"):
    """The sidecar's answer to an accepted hello."""

    server: str
    protocol: int = PROTOCOL_VERSION
    restart: bool = False
    reconnect: bool = False


class ErrorMessage(_Message, frozen=True, tag="error"):
    """A rejection; connection-level codes are followed by the sidecar closing the connection."""

    code: str
    message: str


ClientMessage = Hello | Snapshot | Bye
ServerMessage = Welcome | ErrorMessage
_client_decoder = msgspec.json.Decoder(ClientMessage)
_server_decoder = msgspec.json.Decoder(ServerMessage)


def message_type(message: _Message) -> str:
    """The message's "type" on the wire."""
    return str(message.__struct_config__.tag)


def _unsupported_protocol(payload: bytes) -> int | None:
    """The protocol a hello asks for, when it is a hello for another version."""
    try:
        obj = json.loads(payload.decode("utf-8"))  # the wire is UTF-8 only, whatever json.loads could sniff
    except (ValueError, RecursionError):
        return None
    if isinstance(obj, dict) and obj.get("type") == "hello":
        version = obj.get("protocol")
        if type(version) is int and version != PROTOCOL_VERSION:  # bool is not a version
            return version
    return None


def parse_client_message(payload: bytes) -> Hello | Snapshot | Bye:
    """Decode one rank-to-sidecar frame payload; raise ProtocolError with the code to send back."""
    try:
        message = _client_decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError) as err:  # bad JSON, bad UTF-8, too deep, invalid
        version = _unsupported_protocol(payload)
        if version is not None:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_PROTOCOL,
                f"protocol {version} is not supported; this sidecar speaks protocol {PROTOCOL_VERSION}",
            ) from None
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"invalid message: {err}") from None
    if isinstance(message, Hello) and message.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_PROTOCOL,
            f"protocol {message.protocol} is not supported; this sidecar speaks protocol {PROTOCOL_VERSION}",
        )
    return message


def parse_server_message(payload: bytes) -> Welcome | ErrorMessage:
    """Decode one sidecar-to-rank frame payload (raises ProtocolError on garbage)."""
    try:
        return _server_decoder.decode(payload)
    except msgspec.DecodeError as err:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"invalid server message: {err}") from None
