"""The sidecar's own counters: connections, frames, snapshots, rejections and durations."""

from __future__ import annotations

import time

from prometheus_client import Histogram

from exporter.errors import ErrorCode
from exporter.protocol.messages import World

DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def duration_histogram(name: str) -> Histogram:
    """prometheus_client's histogram over DURATION_BUCKETS, in no registry: the collector exposes it
    under its family's name and HELP text (expose/families.py)."""
    return Histogram(name, name, buckets=DURATION_BUCKETS, registry=None)


class UpstreamHealth:
    """One upstream's scrape health, as the proxy last saw it."""

    def __init__(self, name: str, source: str) -> None:
        self.name = name  # the `upstream` label
        self.source = source  # its URL or directory
        self.up = False
        self.last_scrape_wall: float | None = None  # wall-clock time of the last successful read
        self.last_duration: float | None = None  # seconds the last read took, success or not
        self.samples = 0  # samples in the last successful read
        self.scrapes = 0
        self.errors: dict[str, int] = {}  # by kind
        self.last_error: str | None = None  # its kind and line number only: shown on unauthenticated views
        self.ranks = 0  # rank identities this upstream feeds
        self.unranked: set[str] = set()  # catalog families whose series carry no rank axes
        self.cp_colliding: set[str] = set()  # catalog families whose context-parallel peers share labels
        self.pass_through = 0  # families passed through in the last read
        self.series_resets = 0  # counters and histograms read lower than the last read (each one's own restart)
        self.flapping = 0  # series that went down too often to be restarts (upstream.FLAP_RESETS), as last read
        self.world: World | None = None  # the world its ranks are expected in (configured, completed by labels)
        self.world_problems: list[str] = []  # where the engine's labels contradict the configured world

    def error(self, kind: str, line: int | None = None) -> None:
        """Count an error by kind. Its message goes to the log only (where it is said, throttled): it may quote
        the upstream's text (a secret behind a redirect, say), so `last_error` keeps its kind and line only."""
        self.errors[kind] = self.errors.get(kind, 0) + 1
        self.last_error = kind if line is None else f"{kind} at line {line}"


class PersistenceHealth:
    """The durable state's file: loads, writes and what they cost (all None or zero without a file)."""

    def __init__(self) -> None:
        self.enabled = False
        # by reason: corrupt, truncated, version, unreadable, too_large (bytes), over_limits (values a decode builds)
        self.load_failures: dict[str, int] = {}
        # by reason: no_space, read_only, permission, no_directory, too_large, io, timeout (past the write's
        # deadline), hung (a save while a write past its deadline is still stuck in the disk)
        self.write_failures: dict[str, int] = {}
        # series left out at load, by reason: unknown_family, changed_family, limit, invalid, namespace, world_changed
        self.dropped: dict[str, int] = {}
        self.writes = 0
        self.last_write_wall: float | None = None  # wall-clock time of the last successful write
        self.last_write_duration: float | None = None  # seconds it took (encode on the loop, write in a thread)
        self.file_bytes: int | None = None  # size of the last file written or loaded
        self.load_duration: float | None = None  # seconds the load at start took (read, check, decode, restore)
        self.loaded_identities = 0  # rank identities taken back at start (the registry's and upstreams')

    @staticmethod
    def count(table: dict[str, int], reason: str, amount: int = 1) -> None:
        table[reason] = table.get(reason, 0) + amount


class SidecarHealth:
    """The sidecar's own counters, durations and upstream health, written by the event loop and read by the views."""

    def __init__(self) -> None:
        self.started_at = time.time()  # wall clock, for people
        self.started_monotonic = time.monotonic()  # uptime is measured on this one, immune to clock steps
        self.connections_accepted = 0
        self.connections_open = 0
        self.frames_received = 0
        self.snapshots_received = 0
        self.snapshots_applied = 0
        self.samples_applied = 0
        self.rejections: dict[str, int] = {code.value: 0 for code in ErrorCode}
        self.scrape_duration = duration_histogram("scrape_duration_seconds")  # one /metrics render
        self.ingest_duration = duration_histogram("ingest_duration_seconds")  # one applied snapshot
        self.ingest_listening = False
        self.upstreams: dict[str, UpstreamHealth] = {}  # by name, in config order
        self.persistence = PersistenceHealth()

    def reject(self, code: ErrorCode) -> None:
        self.rejections[code.value] = self.rejections.get(code.value, 0) + 1
