"""The Prometheus recording and alerting rules for one metric namespace, derived from the catalog.

Which rules exist follows from the catalog alone: every per_shard (and per_engine) counter gets a
cluster-wide rate, every replicated counter a one-replica-per-dp-group rate and its sum over
groups, and every bytes counter paired with a duration histogram an active-bandwidth ratio. A
family added to the catalog therefore gets its rules at the next `python config/generate.py`.
Every profile in use gets its own groups, in the same shape, under its own namespace (the default
profile's is the `namespace` given); a profile's hit ratios (HIT_RATIOS) follow its counters, and
where its catalog says where its prefill tokens are counted (exporter.catalog's PrefillSpec: one
family by label, or a family per kind with the prompt apart), its prefill-tiers group: each tier's
share per server and per dp group, the computed share, and what a hit costs where its transfers
count it.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from exporter.catalog import (
    Catalog,
    FamilySpec,
    MetricType,
    PrefillKind,
    PrefillSpec,
    ProfileSpec,
    Semantics,
    TokenCount,
    TransferSpec,
)

from .yamltext import Folded, Key

# Per-pod target labels that the cross-pod rules drop, then the rank axes. Everything else
# (job, namespace, server, cache_type, static labels, the family's own labels) is kept.
TARGET_LABELS = ("instance", "pod")
REPLICA_AXES = ("tp_rank", "pp_rank", "attn_cp_rank")
# Static labels that are a function of a rank axis go with it: a profile's `derived_labels`. The
# sglang scheduler collector's moe_ep_rank is derived from the global tp_rank (sglang 0.5.23
# data_parallel_controller.py 754-762). Kept, it splits the cluster: sum per EP rank (one series
# per dp group under DP attention), and where several ranks of one dp group log scheduler metrics
# (--enable-metrics-for-all-schedulers) it keeps their replicas apart, so a group counts once per
# EP rank. LMCache's worker_id is vLLM's replica-local rank: kept, no two workers would ever meet.
RATE_WINDOW = "5m"

GROUP_PER_SHARD = "hicache-per-shard"
GROUP_REPLICATED = "hicache-replicated"
GROUP_PREFILL = "hicache-prefill-tiers"
GROUP_ALERTS = "hicache-exporter"

# A profile's hit ratios, each named after the engine's own ratio gauge and computed from the two
# replicated counters it is the ratio of: (gauge, hits counter, asked counter). The engine's gauge
# is one process's last interval (LMCache's livemostrecent retrieve_hit_rate, 1 when idle), which
# no sum or average over workers, engines or pods can turn into the fleet's ratio; a ratio of the
# cluster rates can (LMCache 0.5.6 observability.py:683-701: hit/requested, lookup hits/lookup tokens).
HIT_RATIOS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "lmcache": (("retrieve_hit_rate", "num_hit_tokens_total", "num_requested_tokens_total"),
                ("lookup_hit_rate", "num_lookup_hits_total", "num_lookup_tokens_total")),
}
# HiCacheTierNotPaying: below this share of prefill tokens, a tier that keeps writing does not pay.
NOT_PAYING_SHARE = 0.01
NOT_PAYING_FOR = "1h"


@dataclass(frozen=True)
class TierCost:
    """One offload tier's cost: `returned`, the kinds of hits it returned toward the device (its own and those
    of every tier below, which are staged through it); `read`, the transfer that brings them up; `write`, the
    transfer that fills it from the tier above."""

    tier: str
    returned: tuple[PrefillKind, ...]
    read: TransferSpec | None
    write: TransferSpec | None


def prefill_of(catalog: Catalog) -> tuple[ProfileSpec, PrefillSpec] | None:
    """The profile of `catalog` that counts its prefill tokens by tier (its catalog's PrefillSpec), with the
    spec; None where none does, or a count's family is missing (a trimmed catalog) or no replicated counter."""
    found = catalog.prefill()
    if found is None:
        return None
    for count in found[1].counts().values():
        fam = catalog.get(count.family)
        if not fam.replicated_counter:
            return None
        if count.label is not None and count.value not in fam.preset.get(count.label, ()):
            raise ValueError(f"{count.family}: its {count.label} preset lacks {count.value!r}")
    return found


def tier_costs(profile: ProfileSpec, spec: PrefillSpec) -> list[TierCost]:
    """Every tier past the device's, with the transfers the profile declares to and from it."""
    return [TierCost(tier, spec.returned(tier), *profile.tier_transfers(level))
            for tier, level in spec.tiers() if level != "L1"]


def prefill_hit_ratio(ns: str, level: str = "cluster") -> str:
    """`<level>:<ns>prefill_hit_ratio:ratio_rate5m{tier}`: each tier's share of prefill tokens, per server
    (level cluster) or per dp group of a server (dp_group)."""
    return f"{level}:{ns}prefill_hit_ratio:ratio_rate{RATE_WINDOW}"


def prefill_computed_ratio(ns: str) -> str:
    """`cluster:<ns>prefill_computed_ratio:ratio_rate5m`: the share of prefill tokens computed."""
    return f"cluster:{ns}prefill_computed_ratio:ratio_rate{RATE_WINDOW}"


def cost_ratio(ns: str, tier: str, what: str) -> str:
    """`cluster:<ns><tier>_<what>_per_hit_token:ratio_rate5m` (what: bytes, seconds, backup_bytes)."""
    return f"cluster:{ns}{tier}_{what}_per_hit_token:ratio_rate{RATE_WINDOW}"


def stream_labels(catalog: Catalog) -> tuple[str, ...]:
    """The labels only one collector's streams carry: left out where two collectors' rates are divided, so
    that what remains is the server's labels (job, namespace, server and the operator's static labels)."""
    seen: list[str] = []
    for stream in catalog.streams.values():
        seen += [label for label in stream.labels if label not in seen]
    return tuple(seen)


def per_server(catalog: Catalog, expr: str, *own: str) -> str:
    """`expr` summed to the server's labels."""
    return f"sum {without(*stream_labels(catalog), *own)} ({expr})"


def shared_label(spec: PrefillSpec) -> str | None:
    """The label that tells the kinds apart where one family counts every kind (SGLang's `mode`), else None."""
    counts = list(spec.counts().values())
    first = counts[0]
    return first.label if all(c.family == first.family and c.label == first.label for c in counts) else None


RateOf = Callable[[str, FamilySpec], str]


def _selections(ns: str, catalog: Catalog, spec: PrefillSpec, kinds: tuple[PrefillKind, ...] | None,
                rate_of: RateOf) -> list[tuple[str, tuple[str, ...]]]:
    """(selector, the family's own labels) of each family that counts prefill tokens of `kinds` (None: every
    prefill token, the prompt or the sum of every kind counted), each its `rate_of` (cluster: or dp_group:)."""
    counts = spec.counts()
    if kinds is None:
        label = shared_label(spec)
        if spec.prompt is None and label is not None:  # the family's every value: all kinds
            fam = catalog.get(counts["device"].family)
            return [(rate_of(ns, fam), fam.labels)]
        kinds = ("prompt",) if spec.prompt is not None else tuple(counts)
    by_family: dict[str, list[TokenCount]] = {}
    for kind in kinds:
        by_family.setdefault(counts[kind].family, []).append(counts[kind])
    found = []
    for name, selected in by_family.items():
        fam = catalog.get(name)
        rate = rate_of(ns, fam)
        labels = {count.label for count in selected}
        if None not in labels:
            if len(labels) > 1:
                raise ValueError(f"prefill: {name!r} counts kinds by two labels, {sorted(map(str, labels))}")
            values = [str(count.value) for count in selected]
            rate += f'{{{selected[0].label}{"=" if len(values) == 1 else "=~"}"{"|".join(values)}"}}'
        found.append((rate, fam.labels))
    return found


def tokens_of(ns: str, catalog: Catalog, spec: PrefillSpec, kinds: tuple[PrefillKind, ...] | None = None,
              rate_of: RateOf | None = None) -> str:
    """The rate (cluster: unless `rate_of` says) of prefill tokens of `kinds` (None: every prefill token),
    summed to the server's labels: each family's own and the streams' labels go, so that rates of different
    families and collectors meet."""
    return " + ".join(per_server(catalog, selector, *labels)
                      for selector, labels in _selections(ns, catalog, spec, kinds, rate_of or cluster_rate))


def share_tokens(ns: str, catalog: Catalog, spec: PrefillSpec, kinds: tuple[PrefillKind, ...] | None = None,
                 rate_of: RateOf | None = None) -> str:
    """tokens_of, for the two sides of a share: where one family counts every kind, only the label that tells
    them apart goes (both sides are the same family's: every other label is kept, the stream's among them)."""
    label = shared_label(spec)
    if label is None:
        return tokens_of(ns, catalog, spec, kinds, rate_of)
    return " + ".join(f"sum without ({label}) ({selector})"
                      for selector, _ in _selections(ns, catalog, spec, kinds, rate_of or cluster_rate))


Tokens = Callable[[tuple[PrefillKind, ...] | None], str]


def every_token_expr(spec: PrefillSpec, tokens: Tokens) -> str:
    """Every prefill token (`tokens` as in hit_ratio_expr): the sum of every kind; where the prompt is counted
    apart, the prompt or the hits, whichever is more (LMCache counts a prompt cut to whole chunks, fewer than
    its hits where prompts are short: exporter/defaults/lmcache.yaml), as the status document reckons it."""
    if spec.prompt is None:
        return tokens(None)
    hits = tokens(tuple(kind for kind, _ in spec.tiers()))
    return f"({tokens(None)} >= ({hits}) or ({hits}))"


def hit_ratio_expr(spec: PrefillSpec, tokens: Tokens) -> str:
    """Each tier's tokens as `tier="<kind>"`, over every prefill token; `tokens(kinds)` sums them (None: the
    prompt, or every kind counted) to the scope of the ratio (share_tokens, or the fleet's sum)."""
    tiers = "\n  or\n  ".join(f'label_replace({tokens((kind,))}, "tier", "{kind}", "", "")' for kind, _ in spec.tiers())
    return f"(\n  {tiers}\n)\n/ ignoring (tier) group_left ()\n({every_token_expr(spec, tokens)} > 0)\n"


def computed_ratio_expr(spec: PrefillSpec, tokens: Tokens) -> str:
    """The computed tokens over every prefill token; where the prompt is counted apart, what the hits leave of
    every prefill token (`tokens` as in hit_ratio_expr)."""
    everything = f"({every_token_expr(spec, tokens)} > 0)"
    if spec.computed is not None:
        return f"{tokens(('computed',))} / {everything}"
    return f"1 - ({tokens(tuple(kind for kind, _ in spec.tiers()))}) / {everything}"


def fleet_tokens(ns: str, catalog: Catalog, spec: PrefillSpec) -> Tokens:
    """`tokens` for a ratio over every server: each family's cluster rate summed whole."""
    return lambda kinds: " + ".join(f"sum({selector})" for selector, _ in _selections(ns, catalog, spec, kinds, cluster_rate))


def timed_histograms(catalog: Catalog) -> list[FamilySpec]:
    """The duration histograms whose `_sum` gets a cluster rate: each one the catalog pairs with a bytes
    counter (active bandwidth's denominator), then each that times the transfer reading a prefill tier back
    and pairs with none (the numerator of that tier's seconds per hit token: LMCache's time_to_retrieve)."""
    hists = [hist for _, hist in catalog.bandwidth_pairs()]
    found = prefill_of(catalog)
    for cost in tier_costs(*found) if found is not None else ():
        hist = catalog.find(cost.read.seconds) if cost.read is not None and cost.read.seconds is not None else None
        if (hist is not None and hist.type is MetricType.HISTOGRAM and hist.per_shard
                and hist.name not in {h.name for h in hists}):
            hists.append(hist)
    return hists


def cost_rules(ns: str, catalog: Catalog, profile: ProfileSpec, spec: PrefillSpec) -> list[tuple[str, str, str]]:
    """(record, numerator, denominator) of every cost ratio the catalog's transfers allow, each side summed
    to the server's labels."""
    summed = {f.name for f in summed_counters(catalog)}
    timed = {hist.name for hist in timed_histograms(catalog)}
    found = []
    for cost in tier_costs(profile, spec):
        hits = tokens_of(ns, catalog, spec, cost.returned)
        read, write = cost.read, cost.write
        if read is not None and read.bytes in summed:
            fam = catalog.get(read.bytes)
            found.append((cost_ratio(ns, cost.tier, "bytes"), per_server(catalog, bytes_rate(ns, fam), *fam.labels), hits))
        if read is not None and read.seconds in timed:
            hist = catalog.get(read.seconds)
            found.append((cost_ratio(ns, cost.tier, "seconds"),
                          per_server(catalog, duration_sum_rate(ns, hist), *hist.labels), hits))
        if write is not None and write.bytes in summed:
            fam = catalog.get(write.bytes)
            found.append((cost_ratio(ns, cost.tier, "backup_bytes"),
                          per_server(catalog, bytes_rate(ns, fam), *fam.labels), hits))
    return found


def not_paying(ns: str, catalog: Catalog) -> list[tuple[TierCost, str]]:
    """(tier, alert expression) of each tier that a transfer fills: its share of prefill tokens below
    NOT_PAYING_SHARE while that transfer writes."""
    found = prefill_of(catalog)
    if found is None:
        return []
    profile, spec = found
    summed = {f.name for f in summed_counters(catalog)}
    alerts = []
    for cost in tier_costs(profile, spec):
        if cost.write is None or cost.write.bytes not in summed:
            continue
        fam = catalog.get(cost.write.bytes)
        alerts.append((cost, (
            f"(\n  {tokens_of(ns, catalog, spec, cost.returned)}\n  /\n"
            f"  ({every_token_expr(spec, lambda kinds: tokens_of(ns, catalog, spec, kinds))} > 0)\n"
            f") < {NOT_PAYING_SHARE:g}\nand\n{per_server(catalog, bytes_rate(ns, fam), *fam.labels)} > 0\n")))
    return alerts


def _prose(text: str) -> str:
    """`text` as one paragraph (a comment reflows it)."""
    return " ".join(text.split())


# What a profile's prefill rules add to their comments, by profile: (on the shares, on what a hit costs).
PREFILL_NOTES: dict[str, tuple[str, str]] = {
    "sglang": ("""
        SGLang 0.5.23's final per-tier count (prefill_effective_tokens_total, metrics_collector.py:1040-1053;
        `input` the computed extend tokens, <tier>_hit the cached prefix by tier, schedule_policy.py:975-983),
        retracted re-counts excluded (metrics_reporter.py:826-847). The engine's own help: a tier's share is
        rate(<tier>_hit) over the rate of all modes.
        """, """
        A storage hit is prefetched into host memory and loaded back from there (sglang 0.5.23
        schedule_batch.py:231-265, the materialized host hit holds the storage hit), so host_* divides by
        host_hit and storage_hit tokens, storage_* by storage_hit tokens.
        """),
    "lmcache": ("""
        LMCache 0.5.6 under vLLM (exporter/defaults/lmcache.yaml, `prefill:`): for every request LMCache
        looks up, each worker counts the prefix vLLM's own GPU prefix cache held (num_vllm_hit_tokens,
        tier="device") and, as its prompt, the tokens of the request's first scheduling step cut to whole
        chunks (num_prompt_tokens: a prompt under chunk_size counts 0, and a long one split by chunked
        prefill only its first step); a retrieve counts the tokens LMCache brought back (num_hit_tokens,
        tier="offload"), from its CPU backend or, staged through it, its remote one: no family tells those
        two apart, so there is no host or storage tier here. Every prefill token is that prompt or the two
        hits, whichever is more, and computed is what the hits leave of it: a lower bound of what was
        computed, and the shares are of what LMCache saw. vLLM's own vllm:prompt_tokens_total and
        vllm:prefix_cache_hits_total (passed through) count the whole prompt.
        """, """
        LMCache counts no bytes of a retrieve (L2→L1) or a store (L1→L2): the offload tier's one cost is the
        seconds its retrieves took (time_to_retrieve, each worker's own wall time, every worker summed) per
        offload hit token, and it has no backup_bytes. Its remote reads and writes (L3↔L2, bytes) serve only
        the remote part of the offload hits, which no family tells from the CPU backend's: over every offload
        hit they would misstate a remote hit's cost, so they get no rule.
        """),
}


def prefill_group(ns: str, catalog: Catalog, other: ProfileSpec | None = None) -> list[dict[str, Any]]:
    """The group of where prefill tokens come from and what a hit costs (none where the profile's counters are
    missing); `other`: a profile besides the default, whose group is named as its own."""
    found = prefill_of(catalog)
    if found is None:
        return []
    profile, spec = found
    shares_note, cost_note = (_prose(note) for note in PREFILL_NOTES.get(profile.name, ("", "")))
    counts = spec.counts()
    tiers = [kind for kind, _ in spec.tiers()]
    label = shared_label(spec)
    if label is not None:
        rate = cluster_rate(ns, catalog.get(counts["device"].family))
        computed = counts.get("computed")
        adds_up = ("" if computed is None else f', computed ({label}="{computed.value}") included, so the shares '
                   "and the computed ratio add up to 1")
        scope = (f'{label}={"|".join(str(counts[tier].value) for tier in tiers)} as tier={"|".join(tiers)}: the '
                 f"tier's cluster rate (one replica per dp group, groups summed) over the rate of all {label}s"
                 f"{adds_up}. Every label of {rate} but {label} is kept (server among them).")
    else:
        prompt = counts.get("prompt")
        whole = "all kinds'" if prompt is None else f"the prompt's ({ns}{prompt.family})"
        scope = (", ".join(f'tier="{tier}" {ns}{counts[tier].family}' for tier in tiers)
                 + f": the tier's cluster rate (one replica per dp group, groups summed) over {whole}, both summed "
                 f"to the server's labels (the streams' own, {', '.join(stream_labels(catalog))}, and the families' "
                 "own go) so that they meet.")
    rules = [
        _rule(prefill_hit_ratio(ns), hit_ratio_expr(spec, lambda kinds: share_tokens(ns, catalog, spec, kinds)),
              f"Each tier's share of prefill tokens per server, {scope} `> 0` drops idle windows."
              + (f"\n\n{shares_note}" if shares_note else "")),
        _rule(prefill_hit_ratio(ns, "dp_group"),
              hit_ratio_expr(spec, lambda kinds: share_tokens(ns, catalog, spec, kinds, dp_group_rate)), """
            The same per dp group of a server, from the dp_group: rates (one replica per group), keeping
            dp_rank: a group whose requests hit less than its server's others shows here.
            """),
        _rule(prefill_computed_ratio(ns), computed_ratio_expr(spec, lambda kinds: share_tokens(ns, catalog, spec, kinds)), """
            What remained computed: the share of prefill tokens no cache tier served.
            """ if spec.computed is not None else """
            What remained computed: 1 - the tiers' hits over every prefill token (the prompt as counted, or
            the hits where they are more).
            """),
    ]
    costs = tier_costs(profile, spec)
    reads = ", ".join(f"{c.read.tiers} {c.read.title}" for c in costs if c.read is not None)
    fills = ", ".join(f"{c.write.tiers} {c.write.title}" for c in costs if c.write is not None)
    cost_comment = " ".join(part for part in (
        "What a hit costs, per server: a tier's transfer bytes (or seconds) per prefill token it returned. Bytes and "
        "seconds are per_shard (every rank summed), tokens replicated (one replica per dp group), each from its own "
        "cluster: rule; both are summed to the server's labels (the streams' own labels, "
        f"{', '.join(stream_labels(catalog))}, and the families' own go) so that they meet.",
        "A tier returns its own hits and those of the tiers below it, which are staged through it." if len(costs) > 1
        else "",
        cost_note,
        f"<tier>_bytes and <tier>_seconds: the transfer that reads the tier back ({reads}); <tier>_backup_bytes: the "
        f"one that fills it ({fills}), bytes written per token read back. No sample while the tier returns nothing "
        f"(`> 0`){'' if other else ': HiCacheTierNotPaying watches that case'}.") if part)
    for i, (record, numerator, hits) in enumerate(cost_rules(ns, catalog, profile, spec)):
        rules.append(_rule(record, f"{numerator}\n/\n({hits} > 0)\n", "" if i else cost_comment))
    if other is None:
        return [{Key("name", """
            ---- prefill tiers: where prefill tokens come from, and what a hit costs (per server) --
            """): GROUP_PREFILL, "rules": rules}]
    return [{Key("name", f"""
        ---- {other.name} prefill tiers: where prefill tokens come from, and what a hit costs (per server) --
        """): f"{other.name}-prefill-tiers", "rules": rules}]


# What a profile besides the default one adds to its groups' comments: (per_shard, replicated).
PROFILE_NOTES: dict[str, tuple[str, str]] = {
    "lmcache": (textwrap.dedent("""
        The lmcache profile (LMCache 0.5.6 under vLLM, exporter/defaults/lmcache.yaml), from the
        per-rank series the sidecar serves: worker_id mapped to tp_rank and pp_rank with the engine's
        world, dp_rank the data-parallel replica. Each vLLM worker moves its own KV slice, so remote
        read and write bytes and requests, evictions and pings are the SUM over every worker of every
        engine, across pods; rate() per series before the sum, as above. A per_engine counter (only
        the role="scheduler" process counts it) is summed the same way, so each engine counts once.
        """).strip(), textwrap.dedent("""
        Every worker of one vLLM engine (its TP and PP ranks) counts the same requests, lookups and
        tokens, so a sum over worker_id reports TP x PP times the tokens. dp_group: keeps the furthest
        worker of each engine (max over tp_rank, pp_rank and worker_id wherever they run, so an engine
        spanning pods counts once), keeping dp_rank; cluster: sums the engines. The push door labels
        each DP replica's dp_rank; read through vLLM's /metrics or its multiprocess directory the
        replicas all read dp_rank 0 and each worker's series is already the replicas' sum. `role` is
        kept: a scheduler's lookups (scheduler bypass) are not its workers'.
        """).strip()),
}


def without(*labels: str) -> str:
    return f"without ({', '.join(labels)})"


def bytes_rate(ns: str, fam: FamilySpec) -> str:
    """`cluster:<ns><x>:rate5m`: a per_shard counter summed over every rank."""
    return f"cluster:{ns}{fam.base_name}:rate{RATE_WINDOW}"


def duration_sum_rate(ns: str, hist: FamilySpec) -> str:
    return f"cluster:{ns}{hist.name}_sum:rate{RATE_WINDOW}"


def bandwidth_ratio(ns: str, bytes_fam: FamilySpec) -> str:
    return f"cluster:{ns}{bytes_fam.bandwidth_name}:ratio_rate{RATE_WINDOW}"


def dp_group_rate(ns: str, fam: FamilySpec) -> str:
    """`dp_group:<ns><x>:rate5m`: one replica per data-parallel group."""
    return f"dp_group:{ns}{fam.base_name}:rate{RATE_WINDOW}"


def cluster_rate(ns: str, fam: FamilySpec) -> str:
    """`cluster:<ns><x>:rate5m`: a replicated counter, the dp groups summed."""
    return f"cluster:{ns}{fam.base_name}:rate{RATE_WINDOW}"


def hit_ratio(ns: str, gauge: str) -> str:
    """`cluster:<ns><gauge>:ratio_rate5m`: a hit ratio from the cluster rates of its two counters."""
    return f"cluster:{ns}{gauge}:ratio_rate{RATE_WINDOW}"


def counters(catalog: Catalog, semantics: Semantics) -> list[FamilySpec]:
    return [f for f in catalog if f.type is MetricType.COUNTER and f.semantics is semantics]


def summed_counters(catalog: Catalog) -> list[FamilySpec]:
    """The counters whose cluster rate is the sum over every rank: per_shard, then per_engine (only the
    engine's own process counts one, so the sum counts each engine once)."""
    return counters(catalog, Semantics.PER_SHARD) + counters(catalog, Semantics.PER_ENGINE)


def hit_ratios(profile: str, catalog: Catalog) -> list[tuple[str, FamilySpec, FamilySpec]]:
    """(gauge name, hits, asked) for each of `profile`'s hit ratios whose two counters are replicated
    counters of `catalog`; a ratio whose counters are missing (a trimmed profile file) has no rule."""
    found = []
    for gauge, hits_name, asked_name in HIT_RATIOS.get(profile, ()):
        hits, asked = catalog.find(hits_name), catalog.find(asked_name)
        if hits is not None and asked is not None and hits.replicated_counter and asked.replicated_counter:
            found.append((gauge, hits, asked))
    return found


def record_names(ns: str, catalog: Catalog) -> list[str]:
    """Every recording rule name, in the order the rules are written."""
    return [rule["record"] for group in recording_groups(ns, catalog) for rule in group["rules"]]


def _rule(record: str, expr: str, comment: str = "") -> dict[str, Any]:
    return {Key("record", comment): record, "expr": expr}


def recording_groups(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """The recording-rule groups: the default profile's under namespace `ns`, then every other profile's
    in use under its own namespace, in the same shape."""
    default = catalog.default_profile.name
    groups = profile_groups(ns, catalog.of_profile(default) if len(catalog.profiles) > 1 else catalog)
    for name, profile in catalog.profiles.items():
        if name != default:
            groups += profile_groups(profile.namespace, catalog.of_profile(name), other=profile)
    return groups


def profile_groups(ns: str, catalog: Catalog, other: ProfileSpec | None = None) -> list[dict[str, Any]]:
    """One profile's two recording-rule groups for namespace `ns` (`other`: a profile besides the default,
    whose groups are named and explained as its own)."""
    rank_derived = catalog.default_profile.derived_labels
    sum_ranks = "sum " + without(*TARGET_LABELS, *REPLICA_AXES, *rank_derived, "dp_rank")
    per_shard: list[dict[str, Any]] = []
    for i, fam in enumerate(summed_counters(catalog)):
        first = not i and other is None  # another profile's group says it in its own comment
        per_shard.append(_rule(bytes_rate(ns, fam), f"{sum_ranks} (rate({ns}{fam.name}[{RATE_WINDOW}]))", "" if not first else """
            Bytes and seconds are per_shard: every rank moves its own slice of the KV cache (its kv
            heads of its layers), so the physical total is the SUM over all ranks, across pods, tp, pp
            and dp. rate() runs per rank series before the sum, so a rank restart (its counter starting
            again from a low value) is handled as a counter reset of that one series and never shows
            up as a negative or huge spike in the rollup; sum(rate()), never rate(sum()).
            """))
    pairs = catalog.bandwidth_pairs()
    for i, (_, hist) in enumerate(pairs):
        per_shard.append(_rule(duration_sum_rate(ns, hist), f"{sum_ranks} (rate({ns}{hist.name}_sum[{RATE_WINDOW}]))",
                               "" if i else """
            The `_sum` of each per_shard duration histogram that the catalog pairs with a bytes
            counter (`duration_histogram`): seconds spent transferring per second of wall time,
            summed over ranks. The denominator of active bandwidth below.
            """))
    for i, hist in enumerate(timed_histograms(catalog)[len(pairs):]):
        per_shard.append(_rule(duration_sum_rate(ns, hist), f"{sum_ranks} (rate({ns}{hist.name}_sum[{RATE_WINDOW}]))",
                               "" if i else """
            The `_sum` of each per_shard duration histogram that times the transfer reading a prefill
            tier back and pairs with no bytes counter: seconds spent per second of wall time, summed
            over ranks, the numerator of that tier's seconds per hit token (its prefill-tiers group).
            """))
    for i, (bytes_fam, hist) in enumerate(pairs):
        per_shard.append(_rule(bandwidth_ratio(ns, bytes_fam),
                               f"{bytes_rate(ns, bytes_fam)} / ({duration_sum_rate(ns, hist)} > 0)", "" if i else """
            Active bandwidth: bytes per second of *transfer* time, not of wall time. A plain rate() of
            bytes divides by the whole 5m window, idle time included, so a link that copies at 20 GB/s
            for 1% of the time reads 200 MB/s. Dividing the window's byte rate by the same window's
            rate of the paired duration histogram's `_sum` cancels the window length and leaves (byte
            increase) / (seconds spent copying). Summed over ranks it is the byte-weighted mean speed
            of one rank's transfers while they run (the aggregate throughput is
            cluster:..._bytes:rate5m). `> 0` drops idle windows: 0/0 (NaN) and x/0 (+Inf) give no
            sample at all. Kept in this group, after its inputs, so both come from the same evaluation.
            """))

    one_replica = "max " + without(*TARGET_LABELS, *REPLICA_AXES, *rank_derived)
    replicated: list[dict[str, Any]] = []
    for fam in counters(catalog, Semantics.REPLICATED):
        replicated.append(_rule(dp_group_rate(ns, fam), f"{one_replica} (rate({ns}{fam.name}[{RATE_WINDOW}]))"))
        replicated.append(_rule(cluster_rate(ns, fam), f"sum without (dp_rank) ({dp_group_rate(ns, fam)})"))
    if other is not None:
        for i, (gauge, hits, asked) in enumerate(hit_ratios(other.name, catalog)):
            replicated.append(_rule(hit_ratio(ns, gauge), f"{cluster_rate(ns, hits)} / ({cluster_rate(ns, asked)} > 0)",
                                    "" if i else f"""
                Hit ratios, named after the engine's own ratio gauges ({ns}<gauge>) and computed from the
                cluster rates above: hits over what was asked, over the same 5m window. The engine's gauge
                is one process's last interval, which no sum or average over workers or pods turns into
                the fleet's ratio. `> 0` drops idle windows (no sample rather than 0/0).
                """))
        shard_note, replica_note = PROFILE_NOTES.get(other.name, ("", ""))
        return [
            {Key("name", f"---- {other.name} per_shard and per_engine (sum the ranks) ----\n\n{shard_note}"):
             f"{other.name}-per-shard", "rules": per_shard},
            {Key("name", f"---- {other.name} replicated (one replica per dp group, then sum the groups) ----\n\n"
                         f"{replica_note}"):
             f"{other.name}-replicated", "rules": replicated},
        ] + prefill_group(ns, catalog, other)

    return [
        {Key("name", """
            ---- per_shard: bytes and seconds (sum the ranks) -------------------------------------
            """): GROUP_PER_SHARD, "rules": per_shard},
        {Key("name", """
            ---- replicated: tokens (one replica per dp group, then sum the groups) ---------------
            Tokens are replicated: every tp, cp and pp rank of a data-parallel group sees the same
            requests and counts the same logical tokens, so summing over tp_rank would report a TP=8
            group's tokens 8 times. Step 1 (dp_group:) keeps ONE replica per group: max over the
            group's ranks wherever they run (a TP group may span pods, so instance and pod go too),
            keeping dp_rank. max rather than an arbitrary rank because a replica that is restarting,
            lagging or briefly unscraped reads low, while the healthy replicas all read the group's
            rate. Step 2 (cluster:) sums the independent dp groups, which each serve different
            requests. storage_prefetch_unfulfilled_tokens_total is an attempt-level diagnostic (by
            reason), not a final prefill cache-miss count.
            """): GROUP_REPLICATED, "rules": replicated},
    ] + prefill_group(ns, catalog)


def recording_header(ns: str, others: tuple[ProfileSpec, ...] = ()) -> str:
    """The file's header; `others`: the profiles in use besides the default one, whose groups follow."""
    return _header_text(ns) + "".join(f"""
        Profile {p.name!r} (namespace {p.namespace!r}) follows in the groups {p.name}-per-shard and
        {p.name}-replicated, in the same shape, from its own per-rank series (its derived labels,
        {", ".join(p.derived_labels) or "none"}, go with the rank axes){_ratios_note(p)}{_prefill_note(p)}.
        """ for p in others)


def _prefill_note(profile: ProfileSpec) -> str:
    if profile.prefill is None:
        return ""
    tiers = "|".join(kind for kind, _ in profile.prefill.tiers())
    return (f"; and where its prefill tokens come from, group {profile.name}-prefill-tiers "
            f"(tier={tiers}, in the same names)")


def _ratios_note(profile: ProfileSpec) -> str:
    names = [gauge for gauge, _, _ in HIT_RATIOS.get(profile.name, ())]
    if not names:
        return ""
    return (", plus its hit ratios " + ", ".join(f"cluster:{profile.namespace}{g}:ratio_rate{RATE_WINDOW}" for g in names)
            + " (hits over requests, from the counters' cluster rates)")


def _header_text(ns: str) -> str:
    return f"""
        Prometheus recording rules: cluster-wide (cross-pod) HiCache rollups built from the per-rank
        series that every hicache-exporter sidecar serves on :9400/metrics (metric namespace {ns!r}).

        Why here and not in the sidecar: one sidecar only sees the ranks of its own pod, and a
        tensor-parallel group may span pods (tp_rank 0-7 on the leader pod, 8-15 on the worker pod
        of a LeaderWorkerSet, same dp_rank). Each pod's `{ns}rollup_*` series is right for that pod,
        but adding them across pods would count a group's tokens once per pod. So, for dashboards
        and alerts: one pod, read its sidecar's rollups; more than one pod, read these rules. These
        rules start from the per-rank series (`{ns}<family>`, labels tp_rank, pp_rank, dp_rank,
        cache_type and any static labels, plus target labels such as job, namespace, pod, instance,
        server) and apply the catalog's semantics (config/catalog.yaml) across every pod.

        Naming follows `level:metric:operations`; dashboards and tests rely on these names:
          cluster:{ns}<x>_bytes:rate5m                      per_shard bytes, all ranks summed
          cluster:{ns}<h>_sum:rate5m                        per_shard transfer seconds per second
          cluster:{ns}<x>_active_bandwidth_bytes_per_second:ratio_rate5m
          dp_group:{ns}<x>_tokens:rate5m                    one replica per data-parallel group
          cluster:{ns}<x>_tokens:rate5m                     the dp groups summed
          cluster:{ns}prefill_hit_ratio:ratio_rate5m{{tier}}  each tier's share of prefill tokens
          dp_group:{ns}prefill_hit_ratio:ratio_rate5m{{tier}} the same per dp group
          cluster:{ns}prefill_computed_ratio:ratio_rate5m   the share computed
          cluster:{ns}<tier>_<bytes|seconds|backup_bytes>_per_hit_token:ratio_rate5m
                                                            what a hit costs (group {GROUP_PREFILL})
        The set is derived from the catalog by config/generate.py, which wrote this file.

        Every `without` clause removes only the per-pod target labels `instance` and `pod` (plus
        rank labels, and `moe_ep_rank`, which the scheduler derives from its tp rank). Everything
        else is kept: job, namespace, server, cache_type, static labels and
        the family's own labels (pool, reason). If your scrape config attaches other per-pod target
        labels (node, pod_template_hash, ...), drop them at relabel time, or the rollups stay split
        per pod.

        Independent servers (several LLM servers in one namespace and job) must differ in some kept
        label: with DP attention off every rank reports dp_rank="0", and the token rules below would
        otherwise take the max across two servers instead of adding them. config/k8s/podmonitor.yaml
        sets the target label `server`: the pod's name, or for a LeaderWorkerSet pod its set's name
        and group index, so that the pods of one multi-node server share it. Without the Prometheus
        Operator, give your scrape job the same relabeling (docs/kubernetes.md), or give each server
        a distinguishing static label.

        Checked with `promtool check rules` and unit-tested with `promtool test rules`
        (config/prometheus/tests/recording_rules_test.yml for the default namespace; every family is
        checked for each namespace by tests/config/test_prometheus_rules.py).
        """


def alerting_groups(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """The alerting-rule group for namespace `ns` (only the spread alert names catalog series, above its default
    profile's spread threshold)."""
    spread = re.escape(ns)
    threshold = catalog.default_profile.spread_threshold
    return [{
        "name": GROUP_ALERTS,
        "rules": [
            {
                Key("alert", """
                    A rank the sidecar knows is not live: connected but silent for
                    ranks.stale_after_seconds (default 10 s), or disconnected. The sidecar keeps a
                    departed rank's per-rank series, rank_up included, until the rank has been silent for
                    ranks.expire_after_seconds (default 300 s), so a rank that left gracefully
                    (scale-down, rollout, a finished job) also reads 0 until then. With the defaults the
                    series expires just as `for: 5m` runs out, so a clean departure stays pending and does
                    not fire; raise `for` along with expire_after_seconds, or every clean shutdown pages.
                    """): "HiCacheRankDown",
                "expr": "hicache_exporter_rank_up == 0",
                "for": "5m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "HiCache rank tp={{ $labels.tp_rank }} pp={{ $labels.pp_rank }} "
                               "dp={{ $labels.dp_rank }} on {{ $labels.pod }} is not pushing",
                    "description": Folded(
                        "The sidecar at {{ $labels.instance }} (pod {{ $labels.namespace }}/{{ $labels.pod }}) has "
                        "not received a snapshot from rank tp_rank={{ $labels.tp_rank }} pp_rank={{ $labels.pp_rank }} "
                        "dp_rank={{ $labels.dp_rank }} for 5 minutes (stale or disconnected). Its cache metrics "
                        "are frozen and replicated rollups follow another replica of its dp group. A rank "
                        "that departed gracefully also reads 0 until it expires (ranks.expire_after_seconds, "
                        "default 300 s); if the rank was meant to leave, this resolves when it expires."),
                },
            },
            {
                Key("alert", """
                    Ranks the server's world expects that no stream reports for: never seen, or seen and
                    expired (silent for ranks.expire_after_seconds, default 300 s). One series per expected
                    dp group of a server whose world the sidecar knows: from its streams' hello (the pushed
                    client, the stat-logger hook) or an upstream's `world:`; a sidecar with no expected world
                    serves none, so this never fires there. A rank that stops is HiCacheRankDown until it
                    expires, then this. `for: 5m` lets a starting server bring all its ranks up (model load,
                    CUDA graph capture) before a slow one counts.
                    """): "HiCacheRankMissing",
                "expr": "hicache_exporter_ranks_missing > 0",
                "for": "5m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "{{ $value }} rank(s) of dp group {{ $labels.dp_rank }} missing on {{ $labels.pod }}",
                    "description": Folded(
                        "The sidecar at {{ $labels.instance }} (pod {{ $labels.namespace }}/{{ $labels.pod }}) "
                        "has counted ranks of dp group {{ $labels.dp_rank }} missing for 5 minutes, {{ $value }} "
                        "now: the server's world expects them, and they never reported or went silent for longer "
                        "than ranks.expire_after_seconds. "
                        "Rollups cover only the ranks that report. The status page (or /api/v1/status, "
                        "servers[].dp_groups) shows which cells are missing. The expected world is the one the "
                        "ranks sent in their hello, or the upstream's `world:` config; if it is wrong, fix it "
                        "there. On a multi-node server, check the sidecar's ranks.nodes and ranks.node_rank: "
                        "wrong values make it expect ranks of other nodes."),
                },
            },
            {
                Key("alert", f"""
                    Replicas of one data-parallel group see the same requests in lock-step, so their token
                    counters should rise alike. The sidecar's spread ratio is (max - min) / max of the
                    replicas' increases over its window: a few percent of push-timing offset under load,
                    large when one replica really counts differently (a diverged rank, a bug in its
                    instrumentation, or ranks of different servers sharing one identity). Every replicated
                    counter has its own `{ns}<family>_replica_spread_ratio` gauge with the same labels, so
                    the metric name is copied into a `family` label first: without it, two families firing
                    for the same group would collide as one alert.
                    """): "HiCacheReplicaSpreadHigh",
                "expr": (
                    "label_replace(\n"
                    f'  {{__name__=~"{spread}.*_replica_spread_ratio"}},\n'
                    f'  "family", "${{1}}_total", "__name__", "{spread}(.+)_replica_spread_ratio"\n'
                    f") > {threshold:g}\n"
                ),
                "for": "10m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "Replicas of dp group {{ $labels.dp_rank }} disagree on {{ $labels.family }} "
                               "({{ $value | humanizePercentage }})",
                    "description": Folded(
                        "On {{ $labels.namespace }}/{{ $labels.pod }}, the live replicas (tp/pp ranks) of "
                        "dp_rank={{ $labels.dp_rank }} have increased {{ $labels.family }} by amounts that "
                        "differ by {{ $value | humanizePercentage }} of the largest, for 10 minutes "
                        f"(threshold {threshold:.0%}). Replicas of a group should count the same logical tokens; check "
                        "for a diverged rank, or two servers sharing one rank identity. Token rollups take "
                        "the largest replica, so they may be overstated while this fires."),
                },
            },
            {
                Key("alert", """
                    The sidecar refuses frames, hellos or samples: unknown families or labels (a rank built
                    against another catalog), counters going down within an epoch, bucket mismatches,
                    duplicate rank identities, stale epochs, series limits... `old_seq` is excluded: an older
                    snapshot arriving after a newer one is expected and harmless.
                    """): "HiCacheExporterRejecting",
                "expr": 'sum by (namespace, pod, instance, reason) '
                        '(rate(hicache_exporter_rejections_total{reason!="old_seq"}[5m])) > 0',
                "for": "10m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "hicache-exporter on {{ $labels.pod }} is rejecting input ({{ $labels.reason }})",
                    "description": Folded(
                        "The sidecar at {{ $labels.instance }} (pod {{ $labels.namespace }}/{{ $labels.pod }}) "
                        "has been rejecting rank input with reason {{ $labels.reason }} for 10 minutes, at "
                        '{{ $value | printf "%.3g" }} per second. Rejected samples are missing from /metrics and from the '
                        "rollups. The sidecar logs name the rank and the sample."),
                },
            },
            {
                Key("alert", """
                    A scrape target that was a hicache-exporter sidecar (it served
                    hicache_exporter_build_info within the last hour) is down. `absent()` cannot say which
                    sidecar is gone, and scoping `up` needs the job name; joining `up` to the recent
                    build_info series finds the sidecars without it. A target that stays down for longer
                    than that hour drops out of this alert, and a pod that is deleted (its target gone from
                    service discovery) has no `up` series at all.
                    """): "HiCacheExporterDown",
                "expr": "up == 0\n  and on (job, instance)\nmax_over_time(hicache_exporter_build_info[1h])\n",
                "for": "5m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "hicache-exporter at {{ $labels.instance }} cannot be scraped",
                    "description": Folded(
                        "Prometheus job {{ $labels.job }} has failed to scrape the hicache-exporter sidecar "
                        "at {{ $labels.instance }} (pod {{ $labels.namespace }}/{{ $labels.pod }}) for 5 "
                        "minutes. HiCache metrics of the ranks in that pod are missing meanwhile: cluster "
                        "byte rollups undercount, and so do token rollups unless another pod holds "
                        "replicas of the same dp groups."),
                },
            },
            {
                Key("alert", """
                    The sidecar cannot write its state file (--persistence.file): a full or read-only disk,
                    a directory it may not write, a volume that stalls (a write past its deadline is a
                    timeout, each save while it stays stuck is hung). Serving goes on, but its rollups are durable only up to
                    its last successful write: a restart from here on goes back to it. A write is tried
                    every persistence.interval (5 s) while the state changes, so a lasting failure keeps
                    the counter rising; a sidecar whose ranks are idle tries nothing and stays quiet.
                    """): "HiCacheExporterStateNotSaved",
                "expr": 'sum by (namespace, pod, instance, reason) '
                        '(increase(hicache_exporter_persistence_write_failures_total[10m])) > 0',
                "for": "10m",
                "labels": {"severity": "warning"},
                "annotations": {
                    "summary": "hicache-exporter on {{ $labels.pod }} cannot write its state file ({{ $labels.reason }})",
                    "description": Folded(
                        "The sidecar at {{ $labels.instance }} (pod {{ $labels.namespace }}/{{ $labels.pod }}) "
                        "has failed to write its state file ({{ $labels.reason }}) for 10 minutes. It serves on, "
                        "but a restart of it would take back only its last successful write "
                        "(hicache_exporter_persistence_last_write_timestamp_seconds). The sidecar logs name "
                        "the file and the error, once a minute."),
                },
            },
        ] + tier_alerts(ns, catalog),
    }]


def tier_alerts(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """HiCacheTierNotPaying, once per tier that a transfer fills (the default profile's)."""
    own = catalog.of_profile(catalog.default_profile.name) if len(catalog.profiles) > 1 else catalog
    alerts = []
    for i, (cost, expr) in enumerate(not_paying(ns, own)):
        write = cost.write
        assert write is not None
        alerts.append({
            Key("alert", "" if i else f"""
                A cache tier that does not pay: for {NOT_PAYING_FOR} it kept being written (its backup bytes
                rising) while the prefill tokens it returned stayed below {NOT_PAYING_SHARE:.0%} of the server's
                prefill tokens. A tier returns its own hits and those of the tiers below it, which are staged
                through it (a storage hit is loaded back from host memory), so tier="host" fires only when
                neither host nor storage hits come back. Read per server from the recording rules (load both
                files): the share from cluster:{ns}prefill_effective_tokens:rate5m, the bytes from the
                tier's backup transfer; a server with no prefill in the window (idle, or its scheduler's
                series not scraped) has no share and stays quiet. Severity info: a cost finding, not an
                outage. The value is the tier's share.
                """): "HiCacheTierNotPaying",
            "expr": expr,
            "for": NOT_PAYING_FOR,
            "labels": {"severity": "info", "tier": cost.tier},
            "annotations": {
                "summary": f"The {cost.tier} tier of {{{{ $labels.server }}}} writes but returns "
                           "{{ $value | humanizePercentage }} of prefill tokens",
                "description": Folded(
                    f"For {NOT_PAYING_FOR}, server {{{{ $labels.server }}}} (namespace {{{{ $labels.namespace }}}}) "
                    f"has written to its {cost.tier} tier ({write.tiers} {write.title}, "
                    f"{ns}{write.bytes}) while the tier returned {{{{ $value | humanizePercentage }}}} of its "
                    f"prefill tokens (below {NOT_PAYING_SHARE:.0%}). The tier costs bandwidth and capacity and "
                    "saves almost no prefill compute: check that requests share prefixes long enough to hit, "
                    "that the tier is large enough to keep them until they come back, or turn the tier off. "
                    f"The dashboard's first row shows each tier's share and its cost per hit token "
                    f"({cost_ratio(ns, cost.tier, 'backup_bytes')})."),
            },
        })
    return alerts


ALERTING_HEADER = """
    Prometheus alerting rules for hicache-exporter sidecars and the ranks that push to them. None of
    them needs to know the scrape job's name: they select on metric names only. Unit tests:
    config/prometheus/tests/alerting_rules_test.yml (`promtool test rules`, default namespace).
    """
