"""An upstream's memory per rank identity: each counter's and histogram's raw values made continuous across its
resets, which series flap, and the generations of identities dropped; saved and taken back whole.

The rules (feed.py's docstring states them for people): a counter or histogram (one unit) read lower
than its last read restarted that series alone, and counts on from what it had counted (offset + raw,
never lower); a series that goes down more than FLAP_RESETS times within FLAP_WINDOW_SECONDS flaps and
counts only above its highest value until a whole window passes without a drop; a histogram with new
bucket bounds is one more restart of that series and starts a new epoch for its rank; a rank holds at
most max_series_per_rank series, and one unlisted for FORGET_SERIES_SECONDS may give its place.

Times on the state's monotonic clock (a series' drops, when it was last listed) are saved as ages and
taken back relative to the load (`dump`, `restore`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import accumulate
from operator import add, ge, sub
from typing import Any

import msgspec

from exporter.config import RanksConfig
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.ranks import RankIdentity, RankState, rank_identity
from exporter.sidecar.core.saved import valid_count, valid_sum
from exporter.sidecar.upstream.plan import FeedResult, MonotoneKey, SeriesPlan, SeriesValues
from exporter.sidecar.upstream.problems import ReadLog

# A series that goes down more than FLAP_RESETS times within FLAP_WINDOW_SECONDS flaps. An engine
# that restarts (a crash, a redeploy) does so a few times at most in minutes, each start taking
# longer than a scrape interval; a series that falls and rises again and again is two writers
# taking turns (two engines behind one Service URL) or a broken engine. Counting every rise would
# add a whole value per read; a flapping series counts only above its highest value, until it
# holds for a whole window.
FLAP_RESETS = 2
FLAP_WINDOW_SECONDS = 300
# A series of a rank that no read has listed for this long may lose its continuity to a new series
# when the rank holds max_series_per_rank of them: an hour is far past any engine restart or
# redeploy, so only series the engine stopped writing are forgotten (one that comes back after
# that counts from its value then, as a new series).
FORGET_SERIES_SECONDS = 3600.0
# Processes of one rank whose files are known to be replaced by a newer process's, as the registry
# keeps replaced epochs: enough for files that linger, bounded whatever pids a directory shows.
REPLACED_PIDS_KEPT = 64
SAVED_NAME_CHARS = 256  # a flapping series' name is kept for the line that says it calmed: its start is enough

Pairs = tuple[tuple[str, str], ...]


def _drop_times() -> deque[float]:
    """A series' recent drop times: the flapping rule needs only the last FLAP_RESETS + 1."""
    return deque(maxlen=FLAP_RESETS + 1)


@dataclass(slots=True, eq=False)
class SeriesContinuity:
    """One counter or histogram (one unit) of a rank: its raw values as the engine reports them, made continuous."""

    bounds: tuple[float, ...]  # a histogram's finite bucket bounds (its layout); () for a counter
    last: list[float]  # the last raw values taken: a counter's value; a histogram's count, finite buckets, then sum
    offset: list[float]  # added to the raw values: what the series counted before its resets
    high: list[float]  # the continuous values so far (offset + raw at their highest): they never decrease
    base: list[float] | None = None  # `high` when the rank's current epoch began (None: zeros): it reports high - base
    resets: deque[float] = field(default_factory=_drop_times)  # state-clock times of its recent drops
    flapping: bool = False
    seen: float = 0.0  # state-clock time of the last read that listed it


@dataclass(eq=False)
class UpstreamRank:
    """One rank identity this upstream feeds: its connection token, epoch and series made continuous."""

    token: object = field(default_factory=object)  # stands for the rank's "connection"
    rank: RankState | None = None
    epoch: str = ""
    pid: str | None = None
    generation: int = 0
    seq: int = 0
    series: dict[MonotoneKey, SeriesContinuity] = field(default_factory=dict)  # at most max_series_per_rank
    replaced_pids: dict[str, None] = field(default_factory=dict)  # oldest first, at most REPLACED_PIDS_KEPT
    room: list[MonotoneKey] | None = None  # this read's series that may be forgotten for new ones, longest unlisted last


# --- as the state file keeps it (upstream/saved.py's SavedFeed holds these) ---


class SavedSeries(msgspec.Struct, array_like=True, frozen=True):
    """One counter or histogram of an upstream rank: its raw values and how they are made continuous."""

    family: str
    labels: Pairs
    part: str
    bounds: tuple[float, ...]
    last: list[float]
    offset: list[float]
    high: list[float]
    base: list[float] | None
    drops_ago: list[float]  # seconds before the save of its recent drops
    flapping: bool
    seen_ago: float
    name: str  # as log lines name it


class SavedUpstreamRank(msgspec.Struct, array_like=True, frozen=True):
    """One rank identity an upstream feeds."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    attn_cp_rank: int
    static: Pairs
    epoch: str
    pid: str | None
    generation: int
    seq: int
    replaced_pids: list[str]
    series: list[SavedSeries]


class SavedGeneration(msgspec.Struct, array_like=True, frozen=True):
    """An identity dropped after the registry forgot it, with its generation (its epoch's number)."""

    tp_rank: int
    pp_rank: int
    dp_rank: int
    attn_cp_rank: int
    static: Pairs
    generation: int


class Continuity:
    """One upstream's identities as the feed keeps them, their series made continuous, the flapping series and
    the generations of identities dropped; it counts drops on the upstream's health and logs through its ReadLog."""

    def __init__(self, health: UpstreamHealth, problems: ReadLog, limits: RanksConfig) -> None:
        self.health = health
        self.problems = problems
        self.limits = limits  # the state's: max_series_per_rank and max_ranks bound what is kept
        self.ranks: dict[RankIdentity, UpstreamRank] = {}
        # The generation of identities dropped after the registry forgot them (text upstreams'
        # epochs count restarts): one listed again says hello with the epoch it had. Bounded like
        # the registry's memory of forgotten identities.
        self._generations: dict[RankIdentity, int] = {}
        # The series flapping now, and their names (for the line that says they calmed down): the
        # flapping gauge is their number as of the last read.
        self._flapping: dict[SeriesContinuity, str] = {}

    # --- identities ---

    def entry(self, identity: RankIdentity) -> UpstreamRank:
        """The entry of `identity`, made (in its first epoch) if it has none."""
        entry = self.ranks.get(identity)
        if entry is None:
            entry = self.ranks[identity] = UpstreamRank()
        return entry

    def listed_again(self, identity: RankIdentity) -> None:
        """An identity with no entry is listed: one dropped after the registry forgot it comes back in the epoch it had."""
        generation = self._generations.pop(identity, 0)
        if generation:
            self.ranks[identity] = UpstreamRank(generation=generation)

    def drop(self, identity: RankIdentity) -> None:
        """Drop an identity the registry no longer holds, remembering its generation (bounded by max_ranks)."""
        entry = self.ranks.pop(identity)
        self.forget(entry, list(entry.series))
        if entry.generation:
            self._generations[identity] = entry.generation
            if len(self._generations) > self.limits.max_ranks:
                del self._generations[next(iter(self._generations))]

    def new_epoch(self, entry: UpstreamRank) -> None:
        """The rank's epoch ended: a new one begins at the next hello, its series continuing from where they are."""
        entry.rank = None
        entry.token = object()
        entry.generation += 1
        for kept in entry.series.values():
            kept.base = list(kept.high)  # the new epoch counts from zero; the state carries the positions on

    # --- series ---

    def relayouts(
        self, entry: UpstreamRank, reads: list[SeriesValues], now: float, result: FeedResult,
    ) -> tuple[list[SeriesValues], bool]:
        """The series values a rank may take, and whether a histogram among them has new bucket bounds (a new epoch).

        A new layout is one more restart of its series, so it counts as a drop in the flapping rule,
        and the series keeps its drop history across it. A flapping series keeps its layout: a read
        with another is refused (and is a drop), so two engines with different buckets behind one
        URL add at most FLAP_RESETS whole values per window, as drops do."""
        out: list[SeriesValues] = []
        relaid = False
        for read in reads:
            series = read[0]
            kept = entry.series.get(series.keys[0]) if series.histogram else None
            if kept is not None and kept.bounds != series.bounds:
                if not self._reset(kept, series, now, result):
                    kept.seen = now  # listed: a live series, whatever its layout
                    result.rejected += 1
                    self.problems.refused(series.name, f"bucket bounds {list(series.bounds)} while it flaps with "
                                                       f"bounds {list(kept.bounds)}: a flapping series keeps its layout")
                    continue
                relaid = True
            out.append(read)
        return out, relaid

    def engine_restarted(self, entry: UpstreamRank, reads: list[SeriesValues], now: float) -> bool:
        """Whether every counter and histogram of the rank that had counted anything went down at once
        (and none of them flaps): the engine restarted, and its rank can start a new epoch that counts
        no series twice."""
        dropped = False
        for series, raw in reads:
            kept = entry.series.get(series.keys[0]) if series.keys else None
            if kept is None or kept.bounds != series.bounds or kept.last[0] <= 0:
                continue  # a gauge, a new series, or one that has counted nothing: it tells nothing
            parts = len(raw) - 1 if series.histogram else 1
            if all(map(ge, raw[:parts], kept.last[:parts])):
                return False  # this one went on: the engine did not restart
            if kept.flapping or sum(t > now - FLAP_WINDOW_SECONDS for t in kept.resets) >= FLAP_RESETS:
                return False  # a drop that will not count as a restart
            dropped = True
        return dropped

    def continued(
        self, entry: UpstreamRank, series: SeriesPlan, raw: list[float], now: float, result: FeedResult,
    ) -> list[float] | None:
        """Take a series' raw values and give the values its epoch reports: continuous across its resets, never lower
        (None: a new series past max_series_per_rank, refused).

        A histogram is one unit: a drop of its count or of any bucket resets all its parts, sum too."""
        key = series.keys[0]
        kept = entry.series.get(key)
        if kept is None or kept.bounds != series.bounds:  # a new series (or a new layout, in a new epoch)
            if kept is None and len(entry.series) >= self.limits.max_series_per_rank \
                    and not self._make_room(entry, now):
                return None  # past the bound, as the state would refuse it: not remembered either
            high = [max(v, 0.0) for v in raw]  # only a sum may be below zero: it starts at zero
            new = SeriesContinuity(series.bounds, raw, [h - v for h, v in zip(high, raw)], high)
            if kept is not None:
                new.resets = kept.resets  # a new layout is one more drop of the same series (`relayouts`)
            kept = entry.series[key] = new
        elif not series.histogram and not kept.flapping and raw[0] >= kept.last[0]:  # a counter that rose or held
            went = kept.offset[0] + raw[0]
            if went > kept.high[0]:
                kept.high[0] = went
            kept.last = raw
        else:
            last, offset, high = kept.last, kept.offset, kept.high
            counted, summed = high[0], high[-1]
            if kept.flapping or not all(map(ge, raw, last)):
                parts = len(raw) - 1 if series.histogram else 1  # the sum is no count: a negative observation lowers it
                if not all(map(ge, raw[:parts], last[:parts])):
                    if self._reset(kept, series, now, result):  # counts again from zero, on top of what it had counted
                        offset[:] = high
                elif series.histogram and raw[-1] < last[-1]:
                    offset[-1] += last[-1] - raw[-1]  # a negative observation: the sum holds, later ones add
            high = kept.high = list(map(max, high, map(add, offset, raw)))
            kept.last = raw
            if kept.flapping:
                self._calm(kept, series.name, now)
            if series.histogram:
                if len(high) > 2:  # parts that rose apart (after a flap) must stay cumulative, the count last
                    high[1:-1] = accumulate(high[1:-1], max)
                    high[0] = max(high[0], high[-2])
                if high[0] == counted:
                    high[-1] = summed  # no new observation, no new sum (the state's rule: it refuses one)
        kept.seen = now
        return kept.high if kept.base is None else list(map(sub, kept.high, kept.base))

    def _make_room(self, entry: UpstreamRank, now: float) -> bool:
        """Forget the series of the rank unlisted longest, if for FORGET_SERIES_SECONDS: whether one was."""
        cutoff = now - FORGET_SERIES_SECONDS
        if entry.room is None:  # once per read and rank, only when full: a scan of at most max_series_per_rank
            old = [(kept.seen, key) for key, kept in entry.series.items() if kept.seen < cutoff]
            old.sort(key=lambda pair: pair[0], reverse=True)
            entry.room = [key for _, key in old]
        while entry.room:
            key = entry.room.pop()
            kept = entry.series.get(key)
            if kept is not None and kept.seen < cutoff:
                self.forget(entry, [key])
                return True
        return False

    def forget(self, entry: UpstreamRank, keys: Iterable[MonotoneKey]) -> None:
        """Drop series' continuity (and their part in the flapping gauge)."""
        for key in keys:
            kept = entry.series.pop(key, None)
            if kept is not None:
                self._flapping.pop(kept, None)

    def calm_unlisted(self, now: float) -> None:
        """Calm the flapping series that have not gone down for a whole window, listed or not, and set the gauge."""
        for kept, name in list(self._flapping.items()):
            self._calm(kept, name, now)
        self.health.flapping = len(self._flapping)

    def _reset(self, kept: SeriesContinuity, series: SeriesPlan, now: float, result: FeedResult) -> bool:
        """Note one drop of a series; whether it counts as a restart (False: the series flaps)."""
        resets = kept.resets
        while resets and resets[0] <= now - FLAP_WINDOW_SECONDS:
            resets.popleft()
        resets.append(now)
        result.series_resets += 1
        self.health.series_resets += 1
        if not kept.flapping and len(resets) > FLAP_RESETS:
            kept.flapping = True
            self._flapping[kept] = series.name
            self.health.flapping = len(self._flapping)
            self.problems.problem(
                "flapping", series.name, logging.WARNING,
                "upstream %s: %s went down %d times within %d s: two processes write it (two engines "
                "behind one URL?) or the engine is broken. Its drops are no longer counted as restarts: "
                "it counts only above its highest value until it holds for %d s. Give each engine its "
                "own upstream", self.health.name, series.name, len(resets), FLAP_WINDOW_SECONDS, FLAP_WINDOW_SECONDS)
        return not kept.flapping

    def _calm(self, kept: SeriesContinuity, name: str, now: float) -> None:
        """A flapping series that has not gone down for a whole window is a series again."""
        if kept.resets and kept.resets[-1] > now - FLAP_WINDOW_SECONDS:
            return
        kept.resets.clear()
        kept.flapping = False
        kept.offset = [h - v for h, v in zip(kept.high, kept.last)]  # rises count again from its highest value
        self._flapping.pop(kept, None)
        self.problems.problem("calm", name, logging.INFO,
                              "upstream %s: %s has not gone down for %d s: its drops count as restarts again",
                              self.health.name, name, FLAP_WINDOW_SECONDS)

    # --- the durable state ---

    def dump(self, now: float) -> tuple[list[tuple[Any, ...]], list[tuple[Any, ...]]]:
        """Every identity and generation as plain tuples, shaped as SavedUpstreamRank and SavedGeneration."""
        ranks = []
        for identity, entry in self.ranks.items():
            series = [
                (key[0], key[1], key[2], kept.bounds, list(kept.last), list(kept.offset), list(kept.high),
                 None if kept.base is None else list(kept.base), [now - t for t in kept.resets], kept.flapping,
                 now - kept.seen, self._flapping.get(kept, "")[:SAVED_NAME_CHARS])
                for key, kept in entry.series.items()
            ]
            ranks.append((*identity, entry.epoch, entry.pid, entry.generation, entry.seq, list(entry.replaced_pids),
                          series))
        return ranks, [(*identity, generation) for identity, generation in self._generations.items()]

    def restore(
        self, ranks: Iterable[SavedUpstreamRank], generations: list[SavedGeneration], now: float,
        taken_back: Callable[[RankIdentity, str], RankState | None],
    ) -> int:
        """Take saved identities back into a continuity that holds none yet: those `taken_back` gives the
        registry's rank of (by identity and epoch); the number taken back."""
        limits = self.limits
        taken = 0
        for item in ranks:
            if len(self.ranks) >= limits.max_ranks:
                break
            identity = rank_identity(item.tp_rank, item.pp_rank, item.dp_rank, item.attn_cp_rank, item.static)
            rank = taken_back(identity, item.epoch)
            if rank is None:
                continue
            entry = UpstreamRank(rank=rank, epoch=item.epoch, pid=item.pid, generation=item.generation, seq=item.seq)
            entry.replaced_pids = dict.fromkeys(item.replaced_pids[-REPLACED_PIDS_KEPT:])
            for series in item.series[:limits.max_series_per_rank]:
                self._restore_series(entry, series, now)
            self.ranks[identity] = entry
            taken += 1
        for generation in generations[-limits.max_ranks:]:
            forgotten = rank_identity(generation.tp_rank, generation.pp_rank, generation.dp_rank,
                                      generation.attn_cp_rank, generation.static)
            if forgotten not in self.ranks:
                self._generations[forgotten] = generation.generation
        self.health.flapping = len(self._flapping)
        return taken

    def _restore_series(self, entry: UpstreamRank, series: SavedSeries, now: float) -> None:
        """One saved series into `entry`, unless no read could have made it (then it starts over from its next read)."""
        parts = len(series.last)
        if not parts or len(series.offset) != parts or len(series.high) != parts \
                or (series.base is not None and len(series.base) != parts) or not _valid(series):
            return
        drops = _drop_times()
        drops.extend(now - ago for ago in series.drops_ago[-(FLAP_RESETS + 1):])
        kept = SeriesContinuity(series.bounds, list(series.last), list(series.offset), list(series.high),
                                None if series.base is None else list(series.base), drops, series.flapping,
                                now - series.seen_ago)
        entry.series[(series.family, series.labels, series.part)] = kept
        if series.flapping:
            self._flapping[kept] = series.name

    def clear(self) -> None:
        """Forget everything: the feed as if it had read nothing."""
        self.ranks.clear()
        self._generations.clear()
        self._flapping.clear()
        self.health.flapping = 0


def _valid(series: SavedSeries) -> bool:
    """Whether a saved series holds what reads make: counts as the core's saved values are (core.saved.valid_count),
    and a histogram's sum (its last part: a negative observation lowers it) as its sums are; finite ages."""
    counts = len(series.last) - 1 if series.bounds or len(series.last) > 1 else len(series.last)
    for values in (series.last, series.offset, series.high, series.base or ()):
        if not all(map(valid_count, values[:counts])) or not all(map(valid_sum, values[counts:])):
            return False
    return all(math.isfinite(t) for t in (*series.drops_ago, series.seen_ago))
