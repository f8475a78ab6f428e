"""Protocol v1 messages as strict pydantic models, and the parsers for each direction."""

from __future__ import annotations

import json
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator
from typing_extensions import NotRequired, TypedDict

from exporter.errors import ErrorCode, ProtocolError

PROTOCOL_VERSION = 1
MAX_RANK = 1 << 16
# A bucket bound is a finite number, or the string "+Inf" for the last bucket.
BucketBound = Union[float, Literal["+Inf"]]


_SAMPLE_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True, strict=True)


class RankId(_Message):
    """The rank keys that, with the static labels, identify one rank."""

    tp_rank: int = Field(ge=0, lt=MAX_RANK)
    pp_rank: int = Field(ge=0, lt=MAX_RANK)
    dp_rank: int = Field(ge=0, lt=MAX_RANK)


class World(_Message):
    """Parallel sizes the rank was launched with (informational)."""

    tp_size: int = Field(ge=1, le=MAX_RANK)
    pp_size: int = Field(ge=1, le=MAX_RANK)
    dp_size: int = Field(ge=1, le=MAX_RANK)


class Hello(_Message):
    """First frame of every connection: who the rank is and which process start (epoch)."""

    type: Literal["hello"] = "hello"
    protocol: int
    epoch: str = Field(min_length=1, max_length=64)
    pid: int = Field(ge=0)
    rank: RankId
    labels: dict[str, str] = Field(default_factory=dict)
    world: World | None = None


class Sample(TypedDict):
    """One sample as sent: a `value` (counter or gauge), or `buckets`, `sum` and `count` (histogram).

    A TypedDict rather than a model: a snapshot carries dozens of samples, and validating plain
    dicts in pydantic-core costs a third of building model instances.
    """

    __pydantic_config__ = _SAMPLE_CONFIG  # type: ignore[misc]
    family: Annotated[str, Field(min_length=1, max_length=256)]
    labels: NotRequired[dict[str, str]]
    value: NotRequired[float]
    buckets: NotRequired[Annotated[list[tuple[BucketBound, int]], Field(min_length=1, max_length=1024)]]
    sum: NotRequired[float]
    count: NotRequired[Annotated[int, Field(ge=0)]]


def ScalarSample(family: str, value: float, labels: dict[str, str] | None = None) -> Sample:  # noqa: N802
    """A counter (cumulative since the epoch began) or gauge sample."""
    return {"family": family, "labels": labels or {}, "value": value}


def HistogramSample(  # noqa: N802
    family: str, buckets: list[tuple[BucketBound, int]], sum: float, count: int, labels: dict[str, str] | None = None
) -> Sample:
    """A histogram sample: cumulative [upper_bound, count] pairs ending in "+Inf", with sum and count."""
    return {"family": family, "labels": labels or {}, "buckets": buckets, "sum": sum, "count": count}


def is_histogram(sample: Sample) -> bool:
    return "buckets" in sample


class Snapshot(_Message):
    """Cumulative values of the samples it names; `seq` rises within an epoch."""

    type: Literal["snapshot"] = "snapshot"
    seq: int = Field(ge=0)
    time: float
    samples: list[Sample] = Field(default_factory=list, max_length=1 << 16)

    @model_validator(mode="after")
    def _one_shape_per_sample(self) -> "Snapshot":
        for index, sample in enumerate(self.samples):
            if "value" in sample:
                if "buckets" in sample or "sum" in sample or "count" in sample:
                    raise ValueError(f"sample {index} ({sample['family']!r}) has both a value and histogram fields")
            elif "buckets" not in sample or "sum" not in sample or "count" not in sample:
                raise ValueError(f"sample {index} ({sample['family']!r}) needs a value, or buckets, sum and count")
        return self


class Bye(_Message):
    """Ends a connection cleanly."""

    type: Literal["bye"] = "bye"


class Welcome(_Message):
    """The sidecar's answer to an accepted hello."""

    type: Literal["welcome"] = "welcome"
    protocol: int = PROTOCOL_VERSION
    server: str
    restart: bool = False
    reconnect: bool = False


class ErrorMessage(_Message):
    """A rejection; connection-level codes are followed by the sidecar closing the connection."""

    type: Literal["error"] = "error"
    code: str
    message: str


ClientMessage = Annotated[Union[Hello, Snapshot, Bye], Field(discriminator="type")]
ServerMessage = Annotated[Union[Welcome, ErrorMessage], Field(discriminator="type")]
_client_adapter: TypeAdapter[Hello | Snapshot | Bye] = TypeAdapter(ClientMessage)
_server_adapter: TypeAdapter[Welcome | ErrorMessage] = TypeAdapter(ServerMessage)


def _summarise(err: ValidationError, limit: int = 3) -> str:
    problems = []
    for problem in err.errors()[:limit]:
        loc = ".".join(str(p) for p in problem["loc"]) or "(frame)"
        problems.append(f"{loc}: {problem['msg']}")
    more = err.error_count() - limit
    return "; ".join(problems) + (f"; and {more} more" if more > 0 else "")


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
        message = _client_adapter.validate_json(payload)
    except ValidationError as err:
        version = _unsupported_protocol(payload)
        if version is not None:
            raise ProtocolError(
                ErrorCode.UNSUPPORTED_PROTOCOL,
                f"protocol {version} is not supported; this sidecar speaks protocol {PROTOCOL_VERSION}",
            ) from None
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"invalid message: {_summarise(err)}") from None
    if isinstance(message, Hello) and message.protocol != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.UNSUPPORTED_PROTOCOL,
            f"protocol {message.protocol} is not supported; this sidecar speaks protocol {PROTOCOL_VERSION}",
        )
    return message


def parse_server_message(payload: bytes) -> Welcome | ErrorMessage:
    """Decode one sidecar-to-rank frame payload (raises ProtocolError on garbage)."""
    try:
        return _server_adapter.validate_json(payload)
    except ValidationError as err:
        raise ProtocolError(ErrorCode.MALFORMED_FRAME, f"invalid server message: {_summarise(err)}") from None
