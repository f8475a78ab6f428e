"""Wire protocol v1 between ranks and the sidecar: length-prefixed JSON frames."""

from exporter.protocol.framing import FrameDecoder, encode_frame, encode_message, encode_payload
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    ErrorMessage,
    Hello,
    HistogramSample,
    RankId,
    Sample,
    ScalarSample,
    Snapshot,
    Welcome,
    World,
    is_histogram,
    parse_client_message,
    parse_server_message,
)

__all__ = [
    "PROTOCOL_VERSION",
    "Bye",
    "ErrorMessage",
    "FrameDecoder",
    "Hello",
    "HistogramSample",
    "RankId",
    "Sample",
    "ScalarSample",
    "Snapshot",
    "Welcome",
    "World",
    "is_histogram",
    "encode_frame",
    "encode_message",
    "encode_payload",
    "parse_client_message",
    "parse_server_message",
]
