"""An upstream feed's durable state: per rank its epoch, process and series made continuous, so that a
restarted sidecar tells an engine that went on (each series reads at least its saved raw value) from
one that restarted (lower), and a directory rank's new process from the one it read before.

The expected world is not kept: the feed judges it from its config and its first read (world.py),
and gives it to every rank it took back then.

Times on the state's monotonic clock (a series' drops, when it was last listed) are saved as ages and
taken back relative to the load. No I/O here: the file is the durable layer's.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import msgspec

from exporter.sidecar.core.ranks import RankIdentity
from exporter.sidecar.upstream.feed import FLAP_RESETS, REPLACED_PIDS_KEPT, UpstreamFeed, _Continuity, _UpstreamRank

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


class SavedFeed(msgspec.Struct, array_like=True, frozen=True):
    """One upstream's durable state."""

    ranks: list[SavedUpstreamRank]
    generations: list[SavedGeneration]


def dump(feed: UpstreamFeed) -> tuple[Any, ...]:
    """The feed's durable state as plain tuples, shaped as `SavedFeed` (on the event loop, between reads)."""
    now = feed.state.clock()
    ranks = []
    for identity, entry in feed.ranks.items():
        series = [
            (key[0], key[1], key[2], kept.bounds, list(kept.last), list(kept.offset), list(kept.high),
             None if kept.base is None else list(kept.base), [now - t for t in kept.resets], kept.flapping,
             now - kept.seen, feed._flapping.get(kept, ""))
            for key, kept in entry.series.items()
        ]
        ranks.append((*identity, entry.epoch, entry.pid, entry.generation, entry.seq, list(entry.replaced_pids), series))
    generations = [(*identity, generation) for identity, generation in feed._generations.items()]
    return (ranks, generations)


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
                    or (series.base is not None and len(series.base) != parts):
                continue
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
    return taken


def forget(feed: UpstreamFeed) -> None:
    """Forget what `restore` took back: the feed as if it had read nothing (the state it fed starts fresh too)."""
    feed.ranks.clear()
    feed._generations.clear()
    feed._flapping.clear()
    feed.health.flapping = 0
