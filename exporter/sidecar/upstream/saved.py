"""An upstream feed's durable state: per rank its epoch, process and series made continuous, so that a
restarted sidecar tells an engine that went on (each series reads at least its saved raw value) from
one that restarted (lower), and a directory rank's new process from the one it read before.

The expected world is not kept: the feed judges it from its config and its first read (world.py),
and gives it to every rank it took back then.

What each identity keeps, and how its times are saved (as ages), is the continuity's (continuity.py: its
`dump` and `restore`); a merged directory's held processes (merged.py) are saved with it.

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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from exporter.labels import rank_axis
from exporter.sidecar.core.ranks import PUSH_SOURCE, RELEASED_SOURCE, RankIdentity, RankState, rank_identity
from exporter.sidecar.core.saved import SavedCore
from exporter.sidecar.upstream.continuity import SavedGeneration, SavedUpstreamRank
from exporter.sidecar.upstream.feed import UpstreamFeed

log = logging.getLogger("hicache_exporter.durable")


class SavedHeld(msgspec.Struct, array_like=True, frozen=True):
    """A merged directory's held processes (merged.py): per pid its last values, and the retired sums, by key."""

    last: dict[str, list[tuple[int, float]]]
    retired: list[tuple[int, float]]


class SavedFeed(msgspec.Struct, array_like=True, frozen=True):
    """One upstream's durable state: its identities and generations (continuity.py's), and a directory's held processes."""

    ranks: list[SavedUpstreamRank]
    generations: list[SavedGeneration]
    held: SavedHeld | None = None  # a merged directory's (files written before it was saved have none)


def dump(feed: UpstreamFeed) -> tuple[Any, ...]:
    """The feed's durable state as plain tuples, shaped as `SavedFeed` (on the event loop, between reads)."""
    ranks, generations = feed.continuity.dump(feed.state.clock())
    return (ranks, generations, feed.held.dump() if feed.merges_processes else None)


def restore(feed: UpstreamFeed, saved: SavedFeed) -> int:
    """Take `saved` back into a feed that has read nothing yet, after the core's state was restored; the
    number of identities taken back. A rank whose identity the registry did not take back is left out."""

    def taken_back(identity: RankIdentity, epoch: str) -> RankState | None:
        rank = feed.state.rank(identity)
        return rank if rank is not None and rank.source == feed.source and rank.epoch == epoch else None

    taken = feed.continuity.restore(saved.ranks, saved.generations, feed.state.clock(), taken_back)
    if saved.held is not None and feed.merges_processes:
        feed.held.restore((saved.held.last, saved.held.retired), max_processes=feed.state.config.max_ranks)
    return taken


def forget(feed: UpstreamFeed) -> None:
    """Forget what `restore` took back: the feed as if it had read nothing (the state it fed starts fresh too)."""
    feed.continuity.clear()
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
        axes = feed.planner.place(worker)
        return axes["tp_rank"], axes["pp_rank"], axes.get("attn_cp_rank")

    statics = core.statics
    ranks = []
    # Each identity now -> the saved one that took it (its rank axes as saved): a feed's entry goes with it.
    taken: dict[RankIdentity, tuple[int, int, int]] = {}
    for rank in core.ranks:
        source = owner[rank.source]
        tp, pp, cp = placed(source, rank.tp_rank, rank.pp_rank, rank.attn_cp_rank, statics[rank.static])
        identity = rank_identity(tp, pp, rank.dp_rank, cp, statics[rank.static])
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
            if taken.get(rank_identity(tp, pp, item.dp_rank, cp, item.static)) != (item.tp_rank, item.pp_rank,
                                                                                  item.attn_cp_rank):
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
