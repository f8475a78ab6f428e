"""One throttle for log lines: a problem is logged once, then again only after an interval.

Imports nothing but the standard library, so that the engine-side client can use it as the sidecar does.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable

Clock = Callable[[], float]


class LogThrottle:
    """When each problem (by key) was last logged: `due` says whether to log it now."""

    def __init__(self, interval_s: float, max_keys: int = 10_000, clock: Clock = time.monotonic) -> None:
        self.interval_s = interval_s
        # Past this many keys the oldest are forgotten, so that a flood of new problems cannot grow
        # the memory or mute later ones for good (a forgotten key is logged again, once).
        self.max_keys = max_keys
        self.clock = clock
        self._last: dict[Hashable, float] = {}  # key -> when it was last logged, oldest first

    def quiet(self, key: Hashable) -> bool:
        """Whether `key` was logged within the interval (nothing is noted)."""
        last = self._last.get(key)
        return last is not None and self.clock() - last < self.interval_s

    def due(self, key: Hashable) -> bool:
        """Whether to log `key` now; if so it is noted as logged now."""
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last < self.interval_s:
            return False
        self._last.pop(key, None)  # re-inserted last: the dict stays oldest first
        self._last[key] = now
        while len(self._last) > self.max_keys:
            del self._last[next(iter(self._last))]
        return True

    def __len__(self) -> int:
        """How many keys are remembered."""
        return len(self._last)
