"""An upstream's problem log: each problem logged once, again after LOG_AGAIN_SECONDS, and a read's share bounded.

The counters count every problem; the log is for people, so a read of thousands of bad series writes a
screenful (MAX_LOG_LINES_PER_READ lines and one line for the rest), not thousands of lines.
"""

from __future__ import annotations

import logging

from exporter.log_throttle import Clock, LogThrottle

log = logging.getLogger("hicache_exporter.upstream")
# Distinct problems remembered as logged (about 200 bytes each); past it the oldest are forgotten,
# so a read full of new problems cannot mute later ones.
MAX_LOGGED = 10_000
# A problem still there is logged again after an hour: often enough to be seen in a day's logs,
# rarely enough not to flood them at one read every few seconds.
LOG_AGAIN_SECONDS = 3600.0
# One read logs at most this many lines (then one summary line): a read of thousands of bad
# series writes a screenful, not thousands of lines; the counters stay exact.
MAX_LOG_LINES_PER_READ = 20


class ReadLog:
    """One upstream's log lines: by (kind, name) once per LOG_AGAIN_SECONDS, at most MAX_LOG_LINES_PER_READ a read."""

    def __init__(self, upstream: str, clock: Clock, max_logged: int | None = None) -> None:
        self.upstream = upstream  # the name log lines give it
        self.throttle = LogThrottle(LOG_AGAIN_SECONDS, max_keys=MAX_LOGGED if max_logged is None else max_logged, clock=clock)
        self.lines = 0  # log lines this read has written (at most MAX_LOG_LINES_PER_READ)
        self.unlogged = 0  # problems this read did not log past that

    def start_read(self) -> None:
        """A fresh share for a read (a read that raised may have left its own unsummed)."""
        self.lines = self.unlogged = 0

    def problem(self, kind: str, name: str, level: int, message: str, *args: object) -> None:
        """Log a problem unless it was logged within LOG_AGAIN_SECONDS or this read has logged its share."""
        key = (kind, name)
        if self.lines >= MAX_LOG_LINES_PER_READ:
            if not self.throttle.quiet(key):
                self.unlogged += 1  # not remembered: a later read logs it
            return
        if self.throttle.due(key):
            self.lines += 1
            log.log(level, message, *args)

    def refused(self, series: str, why: str) -> None:
        """Log one series' value that no rule allows (keyed by the series alone: `why` may quote a moving value)."""
        self.problem("value", series, logging.WARNING, "upstream %s: %s refused this read: %s", self.upstream, series, why)

    def end_read(self) -> None:
        """End a read's logging: one line for the problems it did not log, and a fresh share for the next read."""
        if self.unlogged:
            log.warning("upstream %s: %d more problems this read, not logged; see "
                        "hicache_exporter_upstream_scrape_errors_total", self.upstream, self.unlogged)
        self.lines = self.unlogged = 0
