"""The sidecar's own counters: connections, frames, snapshots, rejections and durations."""

from __future__ import annotations

from bisect import bisect_left

from exporter.errors import ErrorCode

DURATION_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class DurationHistogram:
    """Observations counted into fixed upper bounds (the last bucket is +Inf), and their sum."""

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...] = DURATION_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(self.bounds, seconds)] += 1  # `le` buckets: a value on a bound counts in it
        self.sum += seconds

    def cumulative(self) -> list[int]:
        total, out = 0, []
        for count in self.counts:
            total += count
            out.append(total)
        return out


class SidecarStats:
    """Plain in-memory counters, written by the event loop and read by the collector."""

    def __init__(self) -> None:
        self.connections_accepted = 0
        self.connections_open = 0
        self.frames_received = 0
        self.snapshots_received = 0
        self.snapshots_applied = 0
        self.samples_applied = 0
        self.rejections: dict[str, int] = {code.value: 0 for code in ErrorCode}
        self.scrape_duration = DurationHistogram()
        self.ingest_duration = DurationHistogram()
        self.ingest_listening = False

    def reject(self, code: ErrorCode, count: int = 1) -> None:
        self.rejections[code.value] = self.rejections.get(code.value, 0) + count
