"""The error hierarchy: every error names what went wrong and what to do about it."""

from __future__ import annotations

from enum import Enum


def quoted(text: str) -> str:
    """A value someone sent, for a one-line message: quoted as repr() quotes it, and cut past 40 characters (a
    value thousands of characters long would be the whole line)."""
    return repr(text) if len(text) <= 40 else repr(text[:40]) + f"... ({len(text)} characters)"


class ErrorCode(str, Enum):
    """Codes sent to ranks in `error` frames and used as the `reason` of rejection counters."""

    # Connection-level: the sidecar answers with an error frame and closes the connection.
    MALFORMED_FRAME = "malformed_frame"
    FRAME_TOO_LARGE = "frame_too_large"
    HELLO_REQUIRED = "hello_required"
    HELLO_TIMEOUT = "hello_timeout"
    INVALID_HELLO = "invalid_hello"
    UNSUPPORTED_PROTOCOL = "unsupported_protocol"
    DUPLICATE_RANK = "duplicate_rank"
    STALE_EPOCH = "stale_epoch"
    IDENTITY_OWNED = "identity_owned"  # another source (pushed ranks, or one upstream) holds the identity
    PEER_REFUSED = "peer_refused"
    TOO_MANY_CONNECTIONS = "too_many_connections"
    TOO_MANY_RANKS = "too_many_ranks"
    IDLE_TIMEOUT = "idle_timeout"
    # Sample-level: the sample is dropped and counted; the rest of the snapshot applies.
    UNKNOWN_FAMILY = "unknown_family"
    WRONG_LABELS = "wrong_labels"
    TYPE_MISMATCH = "type_mismatch"
    INVALID_VALUE = "invalid_value"
    COUNTER_DECREASED = "counter_decreased"
    BUCKET_MISMATCH = "bucket_mismatch"
    SERIES_LIMIT = "series_limit"
    # Snapshot-level: ignored, the connection stays open.
    OLD_SEQ = "old_seq"
    SEQ_JUMP = "seq_jump"  # a reconnect's first seq far past what the epoch could have pushed since
    # Snapshot-level, applied: a reconnect's values went down within its epoch (two writers of
    # one epoch). Below both writers' the identity restarts in place, so the newer writer's values
    # flow on; at or above the set-aside writer's, that writer's values continue.
    EPOCH_CONFLICT = "epoch_conflict"


class HicacheExporterError(Exception):
    """Base class of every error this project raises on purpose."""


class ConfigError(HicacheExporterError):
    """The sidecar config or the metric catalog is invalid; the message names the field."""


class SocketInUseError(HicacheExporterError):
    """Another live sidecar already listens on the ingest socket path."""


class StartupError(HicacheExporterError):
    """The sidecar cannot listen where its settings say; `setting` is the config key that says it
    (`http.port`, `http.host`, `ingest.socket_path`), so that the message can name who set it."""

    def __init__(self, message: str, setting: str) -> None:
        super().__init__(message)
        self.setting = setting


class ProtocolError(HicacheExporterError):
    """A peer broke wire protocol v1; `code` is what the sidecar reports back."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class SampleRejected(HicacheExporterError):
    """One sample of a snapshot is invalid; it is dropped and the rest of the snapshot applies."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class LabelError(HicacheExporterError, ValueError):
    """Labels given to a family or a rank break a label rule (exporter.labels); the message names the label."""


class UnknownFamilyError(HicacheExporterError, KeyError):
    """Client code asked for a family that the metric catalog does not define."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class StateFileError(HicacheExporterError):
    """The durable state file cannot be used; `reason` is the counter's label (corrupt, truncated,
    version, unreadable, too_large, over_limits), the message says what was found."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class StateFileLocked(HicacheExporterError):
    """Another process writes the durable state file (it holds `FILE.lock`): this sidecar does not start."""
