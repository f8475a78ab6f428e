"""Wire protocol v1 between ranks and the sidecar: length-prefixed JSON frames."""

from exporter.protocol.framing import FrameDecoder, encode_frame, encode_message
from exporter.protocol.messages import (
    PROTOCOL_VERSION,
    Bye,
    ErrorMessage,
    Hello,
    HistogramSample,
    RankId,
    ScalarSample,
    Snapshot,
    Welcome,
    World,
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
    "ScalarSample",
    "Snapshot",
    "Welcome",
    "World",
    "encode_frame",
    "encode_message",
    "parse_client_message",
    "parse_server_message",
]
