"""Each rank's position history: its positions as they were, far enough back to read an increase over the window."""

from __future__ import annotations

from collections import deque

from exporter.sidecar.core.keys import SeriesKey

Positions = dict[SeriesKey, float]
Increases = dict[SeriesKey, float]


class WindowHistory:
    """Entries (time, positions) at least `resolution` apart, pruned to one entry before the window.

    An increase over the window is the current position minus the last entry at or before the
    window's start; a rank first seen inside the window counts from zero (its epoch did).
    """

    __slots__ = ("window", "resolution", "_entries")

    def __init__(self, window: float, resolution: float) -> None:
        self.window = window
        self.resolution = resolution
        self._entries: deque[tuple[float, Positions]] = deque()

    def record(self, now: float, positions: Positions) -> None:
        """Remember the positions as of `now` (replacing the last entry if it is very recent)."""
        entry = (now, dict(positions))
        if len(self._entries) >= 2 and now - self._entries[-2][0] < self.resolution:
            self._entries[-1] = entry
        else:
            self._entries.append(entry)
        self._prune(now)

    def _prune(self, now: float) -> None:
        start = now - self.window
        entries = self._entries
        while len(entries) >= 2 and entries[1][0] <= start:
            entries.popleft()

    def base(self, now: float) -> Positions | None:
        """Positions at the window's start (the last entry at or before it), or None when everything
        seen lies inside the window. A read: it prunes nothing (`record` does, so a silent rank's
        history does not grow)."""
        start = now - self.window
        found = None
        for at, positions in self._entries:
            if at > start:
                break
            found = positions
        return found

    def increases(self, now: float, current: Positions) -> Increases:
        """Increase of every series over the window ending at `now`."""
        base = self.base(now)
        if base is None:
            return dict(current)
        return {key: value - base.get(key, 0.0) for key, value in current.items()}

    def __len__(self) -> int:
        return len(self._entries)
