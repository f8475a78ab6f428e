"""An upstream feed's durable state: per rank its epoch, process and series made continuous, so that a
restarted sidecar tells an engine that went on (each series reads at least its saved raw value) from
one that restarted (lower), and a directory rank's new process from the one it read before.

The expected world is not kept: the feed judges it from its config and its first read (world.py),
and gives it to every rank it took back then.

Times on the state's monotonic clock (a series' drops, when it was last listed) are saved as ages and
taken back relative to the load. A merged directory's held processes (merged.py) are saved with the feed.

What is saved belongs to the physical series (DESIGN 16), never to what an operator may rename or
reconfigure: `relocate` takes a file's state to the upstreams configured now before anything is restored.
An upstream is known by what it reads (`UpstreamFeed.physical`: its URL or directory), so a renamed one
continues its state; a linear-rank profile's ranks (LMCache's worker_id) are placed by the `world`
configured now, so a world added or changed moves each worker's history to its new rank instead of
counting it again; identities of an upstream no longer configured are released (`RELEASED_SOURCE`), and
the first source to report one continues it. No I/O here: the file is the durable layer's.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from exporter.labels import rank_axis
from exporter.sidecar.core.ranks import PUSH_SOURCE, RELEASED_SOURCE, RankIdentity
from exporter.sidecar.core.saved import SavedCore, valid_count, valid_sum
from exporter.sidecar.upstream.feed import FLAP_RESETS, REPLACED_PIDS_KEPT, UpstreamFeed, _Continuity, _UpstreamRank

log = logging.getLogger("hicache_exporter.durable")
SAVED_NAME_CHARS = 256  # a flapping series' name is kept for the line that says it calmed: its start is enough

Pairs = tuple[tuple[str, str], ...]


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


class SavedHeld(msgspec.Struct, array_like=True, frozen=True):
    """A merged directory's held processes (merged.py): per pid its last values, and the retired sums, by key."""

    last: dict[str, list[tuple[int, float]]]
    retired: list[tuple[int, float]]


class SavedFeed(msgspec.Struct, array_like=True, frozen=True):
    """One upstream's durable state."""

    ranks: list[SavedUpstreamRank]
    generations: list[SavedGeneration]
    held: SavedHeld | None = None  # a merged directory's (files written before it was saved have none)


def dump(feed: UpstreamFeed) -> tuple[Any, ...]:
    """The feed's durable state as plain tuples, shaped as `SavedFeed` (on the event loop, between reads)."""
    now = feed.state.clock()
    ranks = []
    for identity, entry in feed.ranks.items():
        series = [
            (key[0], key[1], key[2], kept.bounds, list(kept.last), list(kept.offset), list(kept.high),
             None if kept.base is None else list(kept.base), [now - t for t in kept.resets], kept.flapping,
             now - kept.seen, feed._flapping.get(kept, "")[:SAVED_NAME_CHARS])
            for key, kept in entry.series.items()
        ]
        ranks.append((*identity, entry.epoch, entry.pid, entry.generation, entry.seq, list(entry.replaced_pids), series))
    generations = [(*identity, generation) for identity, generation in feed._generations.items()]
    return (ranks, generations, feed.held.dump() if feed.merges_processes else None)


def restore(feed: UpstreamFeed, saved: SavedFeed) -> int:
    """Take `saved` back into a feed that has read nothing yet, after the core's state was restored; the
    number of identities taken back. A rank whose identity the registry did not take back is left out."""
    now = feed.state.clock()
    limits = feed.state.config
    taken = 0
    for item in saved.ranks:
        if len(feed.ranks) >= limits.max_ranks:
            break
        identity: RankIdentity = (item.tp_rank, item.pp_rank, item.dp_rank, item.attn_cp_rank, item.static)
        rank = feed.state.rank(identity)
        if rank is None or rank.source != feed.source or rank.epoch != item.epoch:
            continue
        entry = _UpstreamRank(rank=rank, epoch=item.epoch, pid=item.pid, generation=item.generation, seq=item.seq)
        entry.replaced_pids = dict.fromkeys(item.replaced_pids[-REPLACED_PIDS_KEPT:])
        for series in item.series[:limits.max_series_per_rank]:
            parts = len(series.last)
            if not parts or len(series.offset) != parts or len(series.high) != parts \
                    or (series.base is not None and len(series.base) != parts) or not _valid(series):
                continue  # what no read could have made: the series starts over from its next read
            drops: deque[float] = deque(maxlen=FLAP_RESETS + 1)
            drops.extend(now - ago for ago in series.drops_ago[-(FLAP_RESETS + 1):])
            kept = _Continuity(series.bounds, list(series.last), list(series.offset), list(series.high),
                               None if series.base is None else list(series.base), drops, series.flapping,
                               now - series.seen_ago)
            entry.series[(series.family, series.labels, series.part)] = kept
            if series.flapping:
                feed._flapping[kept] = series.name
        feed.ranks[identity] = entry
        taken += 1
    for generation in saved.generations[-limits.max_ranks:]:
        forgotten: RankIdentity = (generation.tp_rank, generation.pp_rank, generation.dp_rank,
                                   generation.attn_cp_rank, generation.static)
        if forgotten not in feed.ranks:
            feed._generations[forgotten] = generation.generation
    feed.health.flapping = len(feed._flapping)
    if saved.held is not None and feed.merges_processes:
        feed.held.restore((saved.held.last, saved.held.retired), max_processes=limits.max_ranks)
    return taken


def _valid(series: SavedSeries) -> bool:
    """Whether a saved series holds what reads make: counts as the core's saved values are (core.saved.valid_count),
    and a histogram's sum (its last part: a negative observation lowers it) as its sums are; finite ages."""
    counts = len(series.last) - 1 if series.bounds or len(series.last) > 1 else len(series.last)
    for values in (series.last, series.offset, series.high, series.base or ()):
        if not all(map(valid_count, values[:counts])) or not all(map(valid_sum, values[counts:])):
            return False
    return all(math.isfinite(t) for t in (*series.drops_ago, series.seen_ago))


def forget(feed: UpstreamFeed) -> None:
    """Forget what `restore` took back: the feed as if it had read nothing (the state it fed starts fresh too)."""
    feed.ranks.clear()
    feed._generations.clear()
    feed._flapping.clear()
    feed.health.flapping = 0
    feed.held.restore(({}, []), max_processes=0)


# --- a file's state, taken to the upstreams configured now ---


@dataclass
class Relocation:
    """What `relocate` did: sources renamed (old -> new), sources released, identities moved or dropped by a world."""

    renamed: dict[str, str] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=dict)  # source -> identities released
    moved: dict[str, int] = field(default_factory=dict)  # source -> identities placed at another rank
    collided: dict[str, int] = field(default_factory=dict)  # source -> series dropped: another identity took their place

    def log(self, path: object) -> None:
        """One line per change, so that a start after a configuration change says what it continued."""
        for old, new in self.renamed.items():
            log.info("state file %s: %s is now %s (the same URL or directory): its state continues", path,
                     old.replace(":", " ", 1), new.replace(":", " ", 1))
        for source, count in self.released.items():
            log.warning("state file %s: %s is no longer configured: its %d rank identities are released, and the "
                        "first source that reports one continues it (their rollups stay)", path,
                        source.replace(":", " ", 1), count)
        for source, count in self.moved.items():
            log.warning("state file %s: %s's world places %d of its workers at other ranks than when it was saved: "
                        "each worker's history moves with it (nothing is counted again)", path,
                        source.replace(":", " ", 1), count)
        for source, count in self.collided.items():
            log.warning("state file %s: %s: %d series of saved rank identities map to a rank another one already "
                        "took under the world configured now; their positions start over (their rollups stay, "
                        "nothing is counted twice)", path, source.replace(":", " ", 1), count)


def relocate(
    core: SavedCore, upstreams: dict[str, SavedFeed], sources: dict[str, str], feeds: Iterable[UpstreamFeed],
) -> tuple[SavedCore, dict[str, SavedFeed], Relocation]:
    """A file's core and upstream states as the upstreams configured now own them (module docstring).

    `sources` maps each saved upstream source to the physical key it read (files written before keys were
    saved have none: their upstreams are matched by name, as they were saved). Raises IndexError or
    KeyError for a file whose indices point nowhere (a corrupt file)."""
    feeds = list(feeds)
    by_physical = {feed.physical: feed for feed in feeds}
    by_source = {feed.source: feed for feed in feeds}
    done = Relocation()

    def feed_of(source: str) -> UpstreamFeed | None:
        physical = sources.get(source)
        return by_physical.get(physical) if physical is not None else by_source.get(source)

    owner: dict[str, str] = {}  # saved source -> the source that owns its identities now
    for source in {r.source for r in core.ranks} | {f.source for f in core.forgotten} \
            | {f"upstream:{name}" for name in upstreams}:
        if source in (PUSH_SOURCE, RELEASED_SOURCE):
            owner[source] = source
            continue
        feed = feed_of(source)
        owner[source] = feed.source if feed is not None else RELEASED_SOURCE
        if feed is not None and feed.source != source:
            done.renamed[source] = feed.source

    def placed(source: str, tp: int, pp: int, cp: int | None, static: tuple[tuple[str, str], ...]) \
            -> tuple[int, int, int | None]:
        """(tp, pp, cp) of a saved identity of `source` (as owned now) under the world configured now."""
        feed = by_source.get(source)
        if feed is None or feed.linear is None:
            return tp, pp, cp
        worker = rank_axis(dict(static).get(feed.linear, ""))
        if worker is None:
            return tp, pp, cp
        axes = feed.place(worker)
        return axes["tp_rank"], axes["pp_rank"], axes.get("attn_cp_rank")

    statics = core.statics
    ranks = []
    # Each identity now -> the saved one that took it (its rank axes as saved): a feed's entry goes with it.
    taken: dict[RankIdentity, tuple[int, int, int]] = {}
    for rank in core.ranks:
        source = owner[rank.source]
        tp, pp, cp = placed(source, rank.tp_rank, rank.pp_rank, rank.attn_cp_rank, statics[rank.static])
        identity = (tp, pp, rank.dp_rank, cp or 0, statics[rank.static])
        if identity in taken:
            series = len({(v.family, v.labels) for v in rank.values} | {(p.family, p.labels) for p in rank.positions})
            done.collided[source] = done.collided.get(source, 0) + series
            continue
        taken[identity] = (rank.tp_rank, rank.pp_rank, rank.attn_cp_rank or 0)
        if source == RELEASED_SOURCE and rank.source != RELEASED_SOURCE:
            done.released[rank.source] = done.released.get(rank.source, 0) + 1
        if (tp, pp, cp or 0) != (rank.tp_rank, rank.pp_rank, rank.attn_cp_rank or 0):
            done.moved[source] = done.moved.get(source, 0) + 1
        ranks.append(msgspec.structs.replace(rank, source=source, tp_rank=tp, pp_rank=pp, attn_cp_rank=cp))
    forgotten = []
    for entry in core.forgotten:
        source = owner[entry.source]
        if source == RELEASED_SOURCE:
            continue  # no source of its own will come back with its epoch
        tp, pp, cp = placed(source, entry.tp_rank, entry.pp_rank, entry.attn_cp_rank, statics[entry.static])
        forgotten.append(msgspec.structs.replace(entry, source=source, tp_rank=tp, pp_rank=pp, attn_cp_rank=cp or 0))
    moved_upstreams: dict[str, SavedFeed] = {}
    for name, saved_feed in upstreams.items():
        source = owner[f"upstream:{name}"]
        feed = by_source.get(source)
        if feed is None or feed.health.name in moved_upstreams:
            continue
        feed_ranks = []
        for item in saved_feed.ranks:
            tp, pp, cp = placed(source, item.tp_rank, item.pp_rank, item.attn_cp_rank, item.static)
            if taken.get((tp, pp, item.dp_rank, cp or 0, item.static)) != (item.tp_rank, item.pp_rank, item.attn_cp_rank):
                continue  # its identity is not taken back, or another saved identity took its place
            feed_ranks.append(msgspec.structs.replace(item, tp_rank=tp, pp_rank=pp, attn_cp_rank=cp or 0))
        generations = []
        for generation in saved_feed.generations:
            tp, pp, cp = placed(source, generation.tp_rank, generation.pp_rank, generation.attn_cp_rank,
                                generation.static)
            generations.append(msgspec.structs.replace(generation, tp_rank=tp, pp_rank=pp, attn_cp_rank=cp or 0))
        moved_upstreams[feed.health.name] = msgspec.structs.replace(saved_feed, ranks=feed_ranks,
                                                                    generations=generations)
    return msgspec.structs.replace(core, ranks=ranks, forgotten=forgotten), moved_upstreams, done
