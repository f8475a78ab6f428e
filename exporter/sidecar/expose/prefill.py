"""The status document's `prefill` (DESIGN section 18): each tier's share of prefill tokens and what a hit
cost, since the sidecar started and over the window, for the whole sidecar, per server and per dp group.

The profile says where (the catalog: `ProfileSpec.prefill`, its tier transfers); nothing here names a
family. The rules are the rollups' (core/rollups.py): a replicated family is one replica per replica group
(its watermark since start; over the window its furthest replica's increase), a per_shard family the sum of
its ranks. Since start, the whole sidecar and each server read the rollups as counted now (with a state
file /metrics shows them as last saved, at most persistence.interval behind); a dp group reads its replica
groups' watermarks and its ranks' positions (the rollups keep no dp rank). The window reads the ranks'
positions as the bandwidth does. Ratios are computed here, never exported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TypedDict, TypeVar

from exporter.api import v1
from exporter.api.view import server_id
from exporter.catalog import Catalog, MetricType, PrefillSpec, ProfileSpec, Tier
from exporter.sidecar.core.history import Increases
from exporter.sidecar.core.keys import GroupKey, HistAccumulator, RollupCounter, StaticKey
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.servers import Server
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.families import ExposedFamilies

ScopeT = TypeVar("ScopeT")
Scope = tuple[str, int]  # (server id, dp rank): one dp group of one server
Totals = dict[str, float]  # by what it counts: a kind of prefill token (catalog.PrefillKind) or a cost family's name


class Figures(TypedDict):
    """The fields of v1.PrefillFigures, typed for `**` into it or the scopes that extend it."""

    tokens: v1.PrefillTokens
    hit_ratio: v1.HitRatio
    computed_ratio: float | None
    cost: v1.TierCosts


@dataclass(frozen=True, slots=True)
class TierFamilies:
    """A hit tier's cost families, as far as its profile's transfers name them and the catalog holds them."""

    tier: str
    level: Tier
    read: str | None  # the transfer's name
    read_bytes: str | None
    read_seconds: str | None
    fill: str | None
    fill_bytes: str | None


class PrefillView:
    """Builds `prefill` from the state: of the profiles in use that count prefill tokens by tier, the first
    with a series of its counts (the default profile's while none has one). A sidecar serving LMCache alone
    still has the default profile, whose counts no rank sends."""

    def __init__(self, catalog: Catalog, families: ExposedFamilies) -> None:
        self.profiles = [ProfilePrefill(catalog, families, profile, spec) for profile, spec in catalog.prefills()]

    def report(self, state: SidecarState, increases: dict[int, Increases], servers: list[Server],
               groups: dict[GroupKey, list[RankState]]) -> v1.Prefill | None:
        """`prefill` as of now; None when no profile in use counts prefill tokens by tier."""
        first = None
        for profile in self.profiles:
            found = profile.report(state, increases, servers, groups)
            if found.since_start.servers_count or found.since_start.dp_groups_count:
                return found
            first = first or found
        return first


class ProfilePrefill:
    """One profile's `prefill`; what depends only on the catalog is worked out once."""

    def __init__(self, catalog: Catalog, families: ExposedFamilies, profile: ProfileSpec, spec: PrefillSpec) -> None:
        self.profile, self.spec = profile.name, spec
        # family -> (the index of its label, the label's value, the kind it counts) of each kind it counts
        self.kinds: dict[str, list[tuple[int | None, str | None, str]]] = {}
        for kind, count in spec.counts().items():
            at = None if count.label is None else catalog.get(count.family).labels.index(count.label)
            self.kinds.setdefault(count.family, []).append((at, count.value, kind))
        self.counts: dict[str, v1.PrefillCount] = {
            kind: v1.PrefillCount(family=count.family, exported=families.rollup[count.family].name,
                                  label=count.label, value=count.value)
            for kind, count in spec.counts().items()}

        tiers = []
        for tier, level in spec.tiers():
            if level == "L1":
                continue
            read, fill = profile.tier_transfers(level)
            tiers.append(TierFamilies(
                tier=tier, level=level, read=None if read is None else read.name,
                read_bytes=None if read is None else catalog.held(read.bytes),
                read_seconds=None if read is None else catalog.held(read.seconds),
                fill=None if fill is None else fill.name, fill_bytes=None if fill is None else catalog.held(fill.bytes)))
        self.tiers = tiers
        described = {t.tier: v1.TierTransfers(level=t.level, read_transfer=t.read, fill_transfer=t.fill) for t in tiers}
        self.transfers = v1.TiersTransfers(host=described.get("host"), storage=described.get("storage"),
                                           offload=described.get("offload"))
        self.cost_families = frozenset(name for t in tiers for name in (t.read_bytes, t.read_seconds, t.fill_bytes)
                                       if name)
        self.wanted = self.cost_families | self.kinds.keys()
        self.replicated = {name: catalog.get(name).replicated for name in self.wanted}
        self.histograms = frozenset(name for name in self.wanted if catalog.get(name).type is MetricType.HISTOGRAM)

    def _add(self, into: Totals, family: str, values: tuple[str, ...], amount: float) -> None:
        for at, value, kind in self.kinds.get(family, ()):
            if at is None or values[at] == value:  # a value the profile gives no kind counts nowhere
                into[kind] = into.get(kind, 0.0) + amount
        if family in self.cost_families:
            into[family] = into.get(family, 0.0) + amount

    def report(self, state: SidecarState, increases: dict[int, Increases], servers: list[Server],
               groups: dict[GroupKey, list[RankState]]) -> v1.Prefill:
        """This profile's `prefill` as of now."""
        server_ids = [server_id(n) for n in range(len(servers))]  # as the document numbers them
        scope_of: dict[int, Scope] = {}  # id(rank) -> its dp group
        server_of_shared: dict[StaticKey, str] = {}
        for sid, server in zip(server_ids, servers):
            for cell in server.cells.values():
                for stream in cell.streams:
                    scope_of[id(stream.rank)] = (sid, cell.position[0])
                    server_of_shared[stream.rank.shared] = sid
        group_scope = {key: scope_of[id(members[0])] for key, members in groups.items()
                       if members and id(members[0]) in scope_of}
        listed: set[Scope] = set()  # dp groups with a series of the prefill family
        started_whole, started_servers = self._rollups(state, server_of_shared)
        started_groups = self._started_groups(state, groups, group_scope, listed)
        window_groups = self._window_groups(groups, group_scope, increases)
        window_whole: Totals = {}
        window_servers: dict[str, Totals] = {}
        for scope, totals in window_groups.items():
            for into in (window_whole, window_servers.setdefault(scope[0], {})):
                for name, amount in totals.items():
                    into[name] = into.get(name, 0.0) + amount
        order = {sid: n for n, sid in enumerate(server_ids)}
        with_tokens = [sid for sid in server_ids if any(scope[0] == sid for scope in listed)
                       or self.family_in(started_servers.get(sid, {}))]
        shown_servers = sorted(_largest(with_tokens, lambda sid: self.tokens(started_servers.get(sid, {}))),
                               key=order.__getitem__)
        in_order = sorted(listed, key=lambda scope: (order[scope[0]], scope[1]))
        shown_groups = sorted(_largest(in_order, lambda scope: self.tokens(started_groups.get(scope, {}))),
                              key=lambda scope: (order[scope[0]], scope[1]))
        counts = len(with_tokens), len(listed)
        return v1.Prefill(
            profile=self.profile, counts=self.counts, tiers=self.transfers, window_seconds=state.window_seconds,
            since_start=self._period(started_whole, started_servers, started_groups, shown_servers, shown_groups,
                                     counts),
            window=self._period(window_whole, window_servers, window_groups, shown_servers, shown_groups, counts),
        )

    def tokens(self, totals: Totals) -> float:
        """All prefill tokens of a scope: the sum of every kind; where the prompt is counted apart, the prompt
        or the hits, whichever is more (LMCache counts a prompt cut to whole chunks, fewer than its hits where
        prompts are short: exporter/defaults/lmcache.yaml), as the recording rules reckon it."""
        if self.spec.prompt is None:
            return sum(totals.get(kind, 0.0) for kind in self.spec.counts())
        return max(totals.get("prompt", 0.0), sum(totals.get(kind, 0.0) for kind, _ in self.spec.tiers()))

    def family_in(self, totals: Totals) -> bool:
        return any(kind in totals for kind in self.spec.counts())

    def _rollups(self, state: SidecarState, server_of_shared: dict[StaticKey, str]) -> tuple[Totals, dict[str, Totals]]:
        """Since start, from the rollups as counted now: the whole sidecar and each server. With a state file
        /metrics shows them as last saved (persistence.interval behind at most); here they agree with the dp
        groups' live watermarks and the window. A rollup no known rank's server stands for any longer counts
        in the whole only."""
        whole: Totals = {}
        by_server: dict[str, Totals] = {}
        wanted = self.wanted
        counters, histograms = state.live_rollups()
        cells: list[tuple[tuple[str, StaticKey, tuple[str, ...]], float]] = [
            (key, value) for key, value in counters.items() if key[0] in wanted]
        cells += [(key, acc.sum) for key, acc in histograms.items() if key[0] in self.histograms]
        for (family, shared, values), amount in cells:
            self._add(whole, family, values, amount)
            sid = server_of_shared.get(shared)
            if sid is not None:
                self._add(by_server.setdefault(sid, {}), family, values, amount)
        return whole, by_server

    def _started_groups(self, state: SidecarState, groups: dict[GroupKey, list[RankState]],
                        group_scope: dict[GroupKey, Scope], listed: set[Scope]) -> dict[Scope, Totals]:
        """Since start, per dp group: each replica group's watermark of a replicated family (its part of the
        rollup), the sum of its ranks' positions of a per_shard one."""
        out: dict[Scope, Totals] = {}
        wanted, replicated = self.wanted, self.replicated
        for key, scope, members in _scoped(groups, group_scope):
            into = out.setdefault(scope, {})
            mark: RollupCounter | HistAccumulator
            for (family, values), mark in state.group_watermarks(key).items():
                if family in wanted and replicated[family]:
                    self._add(into, family, values, mark.value if isinstance(mark, RollupCounter) else mark.sum)
                    if family in self.kinds:
                        listed.add(scope)
            for rank in members:
                for (family, values), position in rank.positions.items():
                    if family in wanted and not replicated[family]:
                        self._add(into, family, values, position)
                        if family in self.kinds:
                            listed.add(scope)
        return out

    def _window_groups(self, groups: dict[GroupKey, list[RankState]], group_scope: dict[GroupKey, Scope],
                       increases: dict[int, Increases]) -> dict[Scope, Totals]:
        """Over the window, per dp group: a replicated series' furthest replica, a per_shard one's sum."""
        out: dict[Scope, Totals] = {}
        wanted, replicated = self.wanted, self.replicated
        for _, scope, members in _scoped(groups, group_scope):
            furthest: dict[tuple[str, tuple[str, ...]], float] = {}
            into = out.setdefault(scope, {})
            for rank in members:
                for (family, values), amount in increases.get(id(rank), {}).items():
                    if family not in wanted:
                        continue
                    amount = max(amount, 0.0)
                    if replicated[family]:
                        series = (family, values)
                        furthest[series] = max(furthest.get(series, 0.0), amount)
                    else:
                        self._add(into, family, values, amount)
            for (family, values), amount in furthest.items():
                self._add(into, family, values, amount)
        return out

    def _period(self, whole: Totals, servers: dict[str, Totals], groups: dict[Scope, Totals],
                shown_servers: Iterable[str], shown_groups: Iterable[Scope], counts: tuple[int, int]
                ) -> v1.PrefillPeriod:
        return v1.PrefillPeriod(
            **self._figures(whole),
            servers=[v1.PrefillServer(server=sid, **self._figures(servers.get(sid, {}))) for sid in shown_servers],
            servers_count=counts[0],
            dp_groups=[v1.PrefillGroup(server=sid, dp_rank=dp, **self._figures(groups.get((sid, dp), {})))
                       for sid, dp in shown_groups],
            dp_groups_count=counts[1],
        )

    def _figures(self, totals: Totals) -> Figures:
        """One scope's tokens, shares and costs, as the fields of v1.PrefillFigures."""
        device = totals.get("device", 0.0)
        host = storage = None
        if self.spec.apart:
            host, storage = totals.get("host", 0.0), totals.get("storage", 0.0)
            offload = host + storage
        else:
            offload = totals.get("offload", 0.0)
        if self.spec.prompt is not None:
            total = self.tokens(totals)
            computed = total - device - offload  # what the hits leave: a lower bound (lmcache.yaml's note)
        else:
            computed = totals.get("computed", 0.0)
            total = computed + device + offload

        def share(part: float) -> float | None:
            return min(part / total, 1.0) if total > 0 else None

        costs = {}
        for tier in self.tiers:
            # Paid per hit token the tier returned (PrefillSpec.returned), as the recording rules divide them.
            hit = sum(totals.get(kind, 0.0) for kind in self.spec.returned(tier.tier))

            def amount(family: str | None) -> float | None:
                # None where no rank reports the family (the released collectors count no L3 bytes): a cost
                # nobody measured is unknown, not zero.
                return None if family is None else totals.get(family)

            def per_hit(value: float | None, hit: float = hit) -> float | None:
                return None if value is None or hit <= 0 else value / hit

            read_bytes, read_seconds, fill_bytes = amount(tier.read_bytes), amount(tier.read_seconds), amount(tier.fill_bytes)
            costs[tier.tier] = v1.TierCost(
                read_bytes=read_bytes, read_seconds=read_seconds, fill_bytes=fill_bytes,
                bytes_per_hit_token=per_hit(read_bytes), seconds_per_hit_token=per_hit(read_seconds),
                fill_bytes_per_hit_token=per_hit(fill_bytes))
        return {
            "tokens": v1.PrefillTokens(computed=computed, device=device, host=host, storage=storage, offload=offload,
                                       total=total),
            "hit_ratio": v1.HitRatio(device=share(device), host=None if host is None else share(host),
                                     storage=None if storage is None else share(storage), offload=share(offload)),
            "computed_ratio": share(computed),
            "cost": v1.TierCosts(host=costs.get("host"), storage=costs.get("storage"), offload=costs.get("offload")),
        }


def _largest(scopes: Iterable[ScopeT], tokens: Callable[[ScopeT], float]) -> list[ScopeT]:
    """The scopes with the most prefill tokens, at most v1.PREFILL_SCOPES_LISTED (ties: the first listed)."""
    ranked = sorted(enumerate(scopes), key=lambda item: (-tokens(item[1]), item[0]))
    return [scope for _, scope in ranked[:v1.PREFILL_SCOPES_LISTED]]


def _scoped(groups: dict[GroupKey, list[RankState]], group_scope: dict[GroupKey, Scope]
            ) -> Iterator[tuple[GroupKey, Scope, list[RankState]]]:
    """The replica groups that have a scope (a server's dp group), with it."""
    for key, members in groups.items():
        scope = group_scope.get(key)
        if scope is not None:
            yield key, scope, members
