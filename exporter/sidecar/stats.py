"""The sidecar's own counters: connections, frames, snapshots, rejections and durations."""

from __future__ import annotations

from exporter.client.metrics import HistogramChild
from exporter.errors import ErrorCode

DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class SidecarStats:
    """Plain in-memory counters, written by the event loop and read by the collector."""

    def __init__(self) -> None:
        self.connections_accepted = 0
        self.connections_open = 0
        self.frames_received = 0
        self.bytes_received = 0
        self.snapshots_received = 0
        self.snapshots_applied = 0
        self.samples_applied = 0
        self.hellos_accepted = 0
        self.rejections: dict[str, int] = {code.value: 0 for code in ErrorCode}
        self.scrape_duration = HistogramChild(DURATION_BUCKETS)
        self.ingest_duration = HistogramChild(DURATION_BUCKETS)
        self.ingest_listening = False

    def reject(self, code: ErrorCode, count: int = 1) -> None:
        self.rejections[code.value] = self.rejections.get(code.value, 0) + count
