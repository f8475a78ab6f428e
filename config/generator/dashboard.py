"""The Grafana dashboard for one metric namespace, following the one rule for which series to read.

The rule (README, "Which series to read"): one pod, its sidecar's rollups; a fleet, or a TP group
spanning pods, the `cluster:` recording rules. So the dashboard has exactly two kinds of rows:
fleet rows, whose cache panels read only recording rules (never a sidecar rollup, never a
per-rank series), and pod rows, whose every series is selected by `instance="$instance"`, a
single-valued variable, so nothing there is ever summed over pods.

A pod row's rate of a rollup reads straight through a restart of a sidecar that went on from its
state file (`--persistence.file`; every generated pod has one), and leaves out the windows that
span a restart of one that did not (`RESTART_GUARD`): a sidecar without a state file, or one whose
file could not be used, starts its rollups over. Which of the two it was, the sidecar says itself
(`hicache_exporter_persistence_loaded_identities` above 0), so one dashboard serves both kinds of
deployment, with no variable to set (docs/kubernetes.md, "Rules, alerts and the dashboard").

The first row answers where prefill tokens come from (PREFILL_ROW): each tier's share of prefill tokens
over the fleet and per server, and what a hit costs, per server, from the `cluster:` recording rules only,
as a fleet row reads. Another profile's fleet row draws its own shares per server (LMCache's: device,
offload, computed), each profile's servers in a variable of their own (SERVER_VARIABLES).

Every profile in use gets its rows: the default profile's (HiCache tiers) first, then a fleet row and
a pod row for each other profile that has a row builder here (PROFILE_ROWS: lmcache), under the
same rule and each under its own namespace.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exporter.catalog import Catalog, PrefillSpec, ProfileSpec, TransferSpec

from . import rules

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
POD = 'instance="$instance"'
RANKS = 'instance="$instance", dp_rank=~"$dp_rank"'
RATE = "$__rate_interval"

# A sidecar restart without its state (no --persistence.file, or a file that could not be used)
# starts its rollups again from the sum of the ranks' current epochs, which is lower than its last
# value if a rank restarted before: Prometheus reads a counter reset and counts the whole new value,
# a phantom spike. The sidecar's own process collector (prometheus_client, same /metrics, so the
# same job and instance) gives its start time; a rate window in which that start time changed
# holds samples of both processes, and is left out. Same range as the rate, so exactly the
# windows that span a restart go: no gap after a first start, and no rollup rate at all if
# process_start_time_seconds is not scraped (a metric_relabel_configs dropping process_*).
# A sidecar that took its ranks back from its state file goes on where it was: no reset, so the
# guard lets every window through (`or` its loaded identities, above 0 only after such a load;
# tests/config/test_restart_guard.py holds both cases).
SIDECAR_START = "process_start_time_seconds"
STATE_LOADED = f"hicache_exporter_persistence_loaded_identities{{{POD}}} > 0"
RESTART_NOTE = ("A restart of a sidecar without its state file (or whose file could not be used) may drop its "
                "rollups once (a false counter reset): the rollup line is then left out for one rate window. "
                "A sidecar that went on from its state file reads through its restarts. The per-rank lines and "
                "the fleet rows are exact across both.")
RESTART_GUARD = (f"and on (job, instance) (changes({SIDECAR_START}{{{POD}}}[{RATE}]) == 0 "
                 f"or on (job, instance) {STATE_LOADED})")



def transfers(catalog: Catalog) -> list[TransferSpec]:
    """The tier transfers its profiles declare (exporter.catalog), in order."""
    return [transfer for _, transfer in catalog.transfers()]


def tier_label(transfer: TransferSpec) -> str:
    """`L2→L1 load-back`: a transfer as the dashboard names it."""
    return f"{transfer.tiers} {transfer.title}"


def tiers(catalog: Catalog) -> list[tuple[str, str, str]]:
    """(bytes family, tokens family, label) of each transfer that counts both."""
    return [(t.bytes, t.tokens, tier_label(t)) for t in transfers(catalog)
            if t.bytes is not None and t.tokens is not None and t.bytes in catalog and t.tokens in catalog]

FLEET_ROW_PREFIX = "Fleet"
POD_ROW_PREFIX = "Pod"


def pod_rollup_rate(ns: str, family: str, function: str = "rate") -> str:
    """`rate()` (or `increase()`) of one pod's rollup, blank in every window that spans a restart of a
    sidecar that did not go on from its state file."""
    return f"{function}({ns}rollup_{family}{{{POD}}}[{RATE}]) {RESTART_GUARD}"


def _target(ref: str, expr: str, legend: str) -> dict[str, Any]:
    return {"datasource": DATASOURCE, "refId": ref, "editorMode": "code", "range": True,
            "expr": expr, "legendFormat": legend}


def _timeseries(title: str, description: str, targets: list[tuple[str, str]], unit: str = "short",
                stacked: bool = False, width: int = 12, minimum: float | None = 0) -> dict[str, Any]:
    defaults: dict[str, Any] = {
        "unit": unit,
        "custom": {
            "drawStyle": "line", "lineInterpolation": "linear", "lineWidth": 1,
            "fillOpacity": 30 if stacked else 0, "gradientMode": "none", "showPoints": "never",
            "pointSize": 4, "spanNulls": False, "axisPlacement": "auto", "axisLabel": "",
            "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
            "thresholdsStyle": {"mode": "off"},
        },
        "color": {"mode": "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": [{"color": "green", "value": None}]},
    }
    if minimum is not None:
        defaults["min"] = minimum
    return {
        "type": "timeseries", "title": title, "description": description, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": width},
        "fieldConfig": {"defaults": defaults, "overrides": [
            # The one-line answer of a panel is drawn thick, so it stands out from per-rank lines.
            {"matcher": {"id": "byRegexp", "options": "^(rollup|cluster|fleet).*"},
             "properties": [{"id": "custom.lineWidth", "value": 3}]},
        ]},
        "options": {
            "legend": {"showLegend": True, "displayMode": "table", "placement": "bottom", "calcs": ["lastNotNull", "max"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
        "targets": [_target(chr(ord("A") + i), expr, legend) for i, (expr, legend) in enumerate(targets)],
    }


def _row(title: str) -> dict[str, Any]:
    return {"type": "row", "title": title, "collapsed": False, "gridPos": {"h": 1, "w": 24}, "panels": []}


def fleet_rows(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """Rows over every pod: recording rules only, so a TP group spanning pods is counted once."""
    spec = catalog.get
    panels: list[dict[str, Any]] = [_row(
        f"{FLEET_ROW_PREFIX}: every pod, from the cluster: recording rules (the rule for more than one pod)")]
    panels.append(_timeseries(
        "Logical tokens/s by tier (one replica per dp group)",
        "cluster:<x>_tokens:rate5m: per dp group the furthest replica's rate, wherever its ranks run, then "
        "the groups summed; one line per tier, summed over servers. Never a sum of the sidecars' rollups, "
        "which counts a TP group spanning pods once per pod.",
        [(f"sum({rules.cluster_rate(ns, spec(tokens))})", f"fleet {label}") for _, tokens, label in tiers(catalog)]))
    panels.append(_timeseries(
        "Physical bytes/s by tier (every rank summed)",
        "cluster:<x>_bytes:rate5m: every rank's byte rate summed (each rank moves its own shard).",
        [(f"sum({rules.bytes_rate(ns, spec(b))})", f"fleet {label}") for b, _, label in tiers(catalog)], unit="Bps"))
    pairs = {b.name: (b, h) for b, h in catalog.bandwidth_pairs()}
    for bytes_name, _, label in tiers(catalog):
        bytes_fam, hist = pairs[bytes_name]
        panels.append(_timeseries(
            f"{label} active bandwidth",
            "Bytes per second of transfer time, idle excluded: per server the recording rule "
            f"{rules.bandwidth_ratio(ns, bytes_fam)}, and over the fleet the summed byte rate over the "
            "summed transfer seconds.",
            [(rules.bandwidth_ratio(ns, bytes_fam), "{{server}} {{cache_type}}"),
             (f"sum({rules.bytes_rate(ns, bytes_fam)}) / (sum({rules.duration_sum_rate(ns, hist)}) > 0)", "fleet")],
            unit="Bps", width=6))
    for family, title, unit_note in (
        ("storage_prefetch_unfulfilled_tokens_total", "L3 prefetch unfulfilled tokens/s by reason",
         "Attempt-level: the part of an L3 hit that never became device prefix, by reason. Not a prefill "
         "cache-miss count (the final per-tier count is the prefill panel)."),
        ("storage_prefetch_deferred_tokens_total", "L3 prefetch deferred tokens/s by reason",
         "Prefetch attempts put off for lack of host or device room."),
        ("hicache_dropped_tokens_total", "Device tokens dropped with no host copy by reason",
         "Device pages destroyed with no host copy (host_pressure, write_through_unbacked_eviction)."),
        ("prefill_effective_tokens_total", "Prefill tokens/s by tier (final)",
         "The scheduler's final per-tier prefill count: computed tokens (input) and prefix hits by tier."),
    ):
        by = "mode" if family == "prefill_effective_tokens_total" else "reason"
        panels.append(_timeseries(title, unit_note, [
            (f"sum by ({by}) ({rules.cluster_rate(ns, spec(family))})", f"{{{{{by}}}}}")], stacked=True))
    panels.append(_timeseries(
        "L3 hit tokens vs prefetched tokens/s",
        "Storage query hits before allocation and transfer, and the tokens that were moved L3→L2.",
        [(f"sum({rules.cluster_rate(ns, spec('storage_prefetch_hit_tokens_total'))})", "fleet L3 hit tokens"),
         (f"sum({rules.cluster_rate(ns, spec('prefetched_tokens_total'))})", "fleet prefetched tokens")]))
    panels.append(_timeseries(
        "Sidecars and ranks",
        "Sidecar targets up, the streams (rank identities) of every sidecar by state, and the ranks their "
        "servers' worlds expect that no stream reports for (HiCacheRankMissing fires after 5 minutes of them). "
        "The sidecars' own health, which adds up across pods: it is no cache quantity.",
        [("count(up == 1 and on (job, instance) hicache_exporter_build_info)", "sidecars up"),
         ("count(up == 0 and on (job, instance) max_over_time(hicache_exporter_build_info[1h]))", "sidecars down"),
         ("sum by (state) (hicache_exporter_ranks)", "streams {{state}}"),
         ("sum(hicache_exporter_ranks_missing)", "ranks missing")]))
    return panels


PREFILL_ROW = "Where prefill tokens come from"
# Each profile's variable of the servers whose prefill shares are drawn, one panel each (the default
# profile's is `server`).
SERVER_VARIABLES = {"lmcache": "lmcache_server"}


def server_variable(profile: str, default: bool = False) -> str:
    """The name of the variable that lists `profile`'s servers (the `default` profile's: `server`)."""
    return "server" if default else SERVER_VARIABLES.get(profile, f"{profile}_server")


def shares_panel(ns: str, catalog: Catalog, variable: str, title: str, description: str) -> dict[str, Any]:
    """Each tier's share of prefill tokens and the computed share, stacked to 100 %, one panel per server of
    `$variable` (repeated); from the cluster: recording rules."""
    selected = f'server=~"${variable}"'
    shares = _timeseries(
        title, description,
        [(f"{rules.prefill_hit_ratio(ns)}{{{selected}}}", "{{tier}}"),
         (f"{rules.prefill_computed_ratio(ns)}{{{selected}}}", "computed")],
        unit="percentunit", stacked=True, width=24)
    shares["fieldConfig"]["defaults"]["max"] = 1
    shares.update({"repeat": variable, "repeatDirection": "h", "maxPerRow": 4})
    return shares


COST_TITLES = ("Bytes moved per hit token, by tier", "Transfer seconds per hit token, by tier")


def cost_panels(ns: str, catalog: Catalog, profile: ProfileSpec, spec: PrefillSpec, variable: str = "server",
                titles: tuple[str, str] = COST_TITLES, width: int = 12, alerted: bool = True) -> list[dict[str, Any]]:
    """What a hit costs per tier, per server of `$variable`: the bytes and the seconds panels, each where the
    recording rules hold a cost of its kind (`alerted`: HiCacheTierNotPaying watches the profile's tiers)."""
    selected = f'server=~"${variable}"'
    recorded = set(rules.record_names(ns, catalog))
    counts = spec.counts()
    costs = rules.tier_costs(profile, spec)
    moved: list[tuple[str, str]] = []
    timed: list[tuple[str, str]] = []
    for cost in costs:
        hits = "+".join(str(counts[kind].value or kind) for kind in cost.returned)
        for what, transfer, into in (("bytes", cost.read, moved), ("seconds", cost.read, timed),
                                     ("backup_bytes", cost.write, moved)):
            record = rules.cost_ratio(ns, cost.tier, what)
            if transfer is not None and record in recorded:
                into.append((f"{record}{{{selected}}}", f"{{{{server}}}} {cost.tier}: {tier_label(transfer)} per {hits} token"))
    reads = ", ".join(tier_label(cost.read) for cost in costs if cost.read is not None)
    fills = ", ".join(tier_label(cost.write) for cost in costs if cost.write is not None)
    note = ("A tier returns its own hits and those of the tiers below it, staged through it (a storage hit is "
            "loaded back from host memory), so the host tier's costs are per host_hit+storage_hit token. "
            if len(costs) > 1 else "")
    panels = []
    if moved:
        panels.append(_timeseries(
            titles[0],
            f"What a hit costs: the bytes of the transfer that reads a tier back ({reads}), and of the one that fills "
            f"it ({fills}), per prefill token the tier returned; bytes every rank summed, tokens one replica per dp "
            "group. " + note + "A tier that writes gigabytes per token it returns does not pay"
            + (" (HiCacheTierNotPaying)." if alerted else "."), moved, unit="bytes",
            width=width))
    if timed:
        panels.append(_timeseries(
            titles[1],
            f"Seconds spent in the transfer that reads a tier back ({reads}), every rank summed, per prefill token the "
            "tier returned. " + note, timed, unit="s", width=width))
    return panels


def prefill_rows(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """The first row: each tier's share of prefill tokens over the whole fleet, then over time, stacked, one
    panel per server (`$server`, repeated), and what a hit costs per tier, per server; recording rules only,
    like the fleet rows. None where the profile has no per-tier prefill counter."""
    found = rules.prefill_of(catalog)
    if found is None:
        return []
    profile, spec = found
    fleet = rules.fleet_tokens(ns, catalog, spec)
    everyone = _timeseries(
        "Share of prefill tokens by tier: all servers",
        "Each tier's prefill hits over all prefill tokens of every server, and what was computed, stacked to "
        f"100 %: the summed cluster: rates of {rules.cluster_rate(ns, catalog.get(spec.counts()['device'].family))} "
        "(one replica per dp group, groups summed), so a busy server weighs as its tokens do. No line while no "
        "server has prefill.",
        [(rules.hit_ratio_expr(spec, fleet), "fleet {{tier}}"), (rules.computed_ratio_expr(spec, fleet), "fleet computed")],
        unit="percentunit", stacked=True, width=24)
    everyone["fieldConfig"]["defaults"]["max"] = 1
    shares = shares_panel(
        ns, catalog, "server", "Share of prefill tokens by tier: $server",
        f"{rules.prefill_hit_ratio(ns)} by tier and {rules.prefill_computed_ratio(ns)}: each tier's prefill "
        "hits over all prefill tokens of the server in the rate window (one replica per dp group, groups summed; "
        "the engine's final per-tier count, retracted re-counts excluded), stacked so the tiers and what was "
        "computed fill 100 %. One panel per server ($server); no line while the server has no prefill.")
    return [_row(f"{PREFILL_ROW}, and what a hit costs: per server, from the cluster: recording rules"), everyone,
            shares, *cost_panels(ns, catalog, profile, spec)]


def pod_rows(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """Rows for the one pod `$instance`: its sidecar's rollups beside its ranks, and its health."""
    panels: list[dict[str, Any]] = [_row(
        f"{POD_ROW_PREFIX} $instance: its sidecar's rollups and its ranks (the rule for one pod)")]
    for _, tokens, label in tiers(catalog):
        panels.append(_timeseries(
            f"{label} tokens/s in this pod",
            f"Rollup: {ns}rollup_{tokens} of this pod's sidecar (the furthest replica of each dp group, groups "
            "summed). Per rank: the replicas of one dp group count the same tokens, so their lines lie on top "
            "of each other. If this pod holds only part of a TP group, use the fleet rows. " + RESTART_NOTE,
            [(f"sum without (pool) (rate({ns}{tokens}{{{RANKS}}}[{RATE}]))", "tp{{tp_rank}} pp{{pp_rank}} dp{{dp_rank}}"),
             (f"sum without (pool) ({pod_rollup_rate(ns, tokens)})", "rollup {{cache_type}}")], width=6))
    for bytes_name, _, label in tiers(catalog):
        panels.append(_timeseries(
            f"{label} bytes/s in this pod",
            f"Rollup: {ns}rollup_{bytes_name}, every rank of this pod summed. Per rank: each rank's own shard. "
            + RESTART_NOTE,
            [(f"rate({ns}{bytes_name}{{{RANKS}}}[{RATE}])", "tp{{tp_rank}} pp{{pp_rank}} dp{{dp_rank}}"),
             (pod_rollup_rate(ns, bytes_name), "rollup {{cache_type}}")], unit="Bps", width=6))
    for bytes_fam, _ in catalog.bandwidth_pairs():
        label = next(label for b, _, label in tiers(catalog) if b == bytes_fam.name)
        panels.append(_timeseries(
            f"{label} active bandwidth in this pod",
            "The sidecar's window (rollup.window_seconds, default 60 s): byte increase over transfer-time "
            "increase, per rank and rolled up; no line while nothing moved.",
            [(f"{ns}{bytes_fam.bandwidth_name}{{{RANKS}}}", "tp{{tp_rank}} pp{{pp_rank}} dp{{dp_rank}}"),
             (f"{ns}rollup_{bytes_fam.bandwidth_name}{{{POD}}}", "rollup {{cache_type}}")], unit="Bps", width=6))
    spread = [f for f in catalog if f.replicated_counter]
    panels.append(_timeseries(
        "Replica spread ratio by dp group",
        "(max - min) / max of the live replicas' increases over the sidecar's window: 0 when the replicas "
        f"of a dp group agree; HiCacheReplicaSpreadHigh fires above {catalog.default_profile.spread_threshold:g} "
        "for 10 minutes.",
        [(f"max by (dp_rank) ({ns}{f.base_name}_replica_spread_ratio{{{RANKS}}})", f"dp{{{{dp_rank}}}} {f.base_name}")
         for f in spread], unit="percentunit", width=24))
    panels.append(_timeseries(
        "Ranks up", "1 while a rank pushes (or its upstream is read), 0 when stale or disconnected.",
        [(f"hicache_exporter_rank_up{{{RANKS}}}",
          "tp{{tp_rank}} pp{{pp_rank}} dp{{dp_rank}} {{cache_type}}{{storage_backend}}")]))
    panels.append(_timeseries(
        "Streams by state, missing ranks", "The sidecar's streams (rank identities) by state (live, stale, "
        "departed, expired), and per dp group the ranks its server's world expects that no stream reports for "
        "(HiCacheRankMissing fires after 5 minutes above 0; no such line without an expected world).",
        [(f"sum by (state) (hicache_exporter_ranks{{{POD}}})", "{{state}}"),
         (f"hicache_exporter_ranks_missing{{{POD}}}", "missing dp{{dp_rank}}")]))
    panels.append(_timeseries(
        "Rejections/s by reason", "Frames, hellos and samples the sidecar refused (docs/protocol.md lists the reasons).",
        [(f"sum by (reason) (rate(hicache_exporter_rejections_total{{{POD}}}[{RATE}])) > 0", "{{reason}}")]))
    panels.append(_timeseries(
        "Scrape and ingest duration", "Time to render /metrics and to apply one snapshot.",
        [(f"histogram_quantile(0.99, sum by (le) (rate(hicache_exporter_scrape_duration_seconds_bucket{{{POD}}}[{RATE}])))",
          "scrape p99"),
         (f"sum(rate(hicache_exporter_scrape_duration_seconds_sum{{{POD}}}[{RATE}])) / "
          f"sum(rate(hicache_exporter_scrape_duration_seconds_count{{{POD}}}[{RATE}]))", "scrape mean"),
         (f"histogram_quantile(0.99, sum by (le) (rate(hicache_exporter_ingest_duration_seconds_bucket{{{POD}}}[{RATE}])))",
          "ingest p99")], unit="s"))
    panels.append(_timeseries(
        "Connections, snapshots and restarts", "Open rank connections, snapshots applied per second, rank restarts.",
        [(f"hicache_exporter_connections{{{POD}}}", "open connections"),
         (f"rate(hicache_exporter_snapshots_applied_total{{{POD}}}[{RATE}])", "snapshots applied/s"),
         (f"sum(increase(hicache_exporter_rank_restarts_total{{{RANKS}}}[{RATE}]))", "rank restarts")]))
    panels.append(_timeseries(
        "Upstreams (proxy)", "For a sidecar that reads an engine's /metrics or multiprocess directory: 1 while "
        "the last read succeeded, and failed reads per second by kind. Empty for push-only sidecars.",
        [(f"hicache_exporter_upstream_up{{{POD}}}", "up {{upstream}}"),
         (f"sum by (upstream, kind) (rate(hicache_exporter_upstream_scrape_errors_total{{{POD}}}[{RATE}]))",
          "errors/s {{upstream}} {{kind}}")]))
    panels.append(_timeseries(
        "State file", "For a sidecar with --persistence.file: successful writes per second (one every "
        "persistence.interval while the state changes), failed writes per second by reason "
        "(HiCacheExporterStateNotSaved fires on them), and the rank identities its process took back from the "
        "file at start (above 0: its restarts need no guard). Empty for a sidecar without a state file.",
        [(f"rate(hicache_exporter_persistence_writes_total{{{POD}}}[{RATE}])", "writes/s"),
         (f"sum by (reason) (rate(hicache_exporter_persistence_write_failures_total{{{POD}}}[{RATE}]))",
          "write failures/s {{reason}}"),
         (f"hicache_exporter_persistence_loaded_identities{{{POD}}}", "identities loaded at start")]))
    return panels


def _layout(panels: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Ids in order and grid positions filled left to right, a row starting a new line."""
    x = y = height = 0
    for number, panel in enumerate(panels, start=1):
        pos = panel["gridPos"]
        if panel["type"] == "row" or x + pos["w"] > 24:
            y += height
            x = height = 0
        pos.update({"x": x, "y": y})
        x += pos["w"]
        height = max(height, pos["h"])
        if panel["type"] == "row":
            y += pos["h"]
            x = height = 0
        panel["id"] = number
        panel["gridPos"] = {"h": pos["h"], "w": pos["w"], "x": pos["x"], "y": pos["y"]}
    return panels


def _query_variable(name: str, label: str, query: str, multi: bool) -> dict[str, Any]:
    current: dict[str, Any] = {"selected": True, "text": ["All"], "value": ["$__all"]} if multi else {}
    return {
        "type": "query", "name": name, "label": label, "datasource": DATASOURCE, "definition": query,
        "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery", "qryType": 1},
        "refresh": 2, "regex": "", "sort": 3 if multi else 1, "includeAll": multi, "multi": multi,
        **({"allValue": ".*"} if multi else {}), "current": current, "options": [], "hide": 0, "skipUrlSync": False,
    }


def lmcache_prefill_panels(ns: str, catalog: Catalog) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Where LMCache's prefill tokens come from, one panel per server (`$lmcache_server`), and what an offload
    hit costs; none where its prefill counters are missing (a trimmed profile file)."""
    found = rules.prefill_of(catalog)
    if found is None:
        return [], []
    profile, spec = found
    variable = server_variable(profile.name)
    shares = shares_panel(
        ns, catalog, variable, f"Where LMCache's prefill tokens come from: ${variable}",
        f"{rules.prefill_hit_ratio(ns)} by tier and {rules.prefill_computed_ratio(ns)}, over the server's prefill "
        "tokens in the rate window (one worker per engine, engines summed), stacked: device, the prefix vLLM's own "
        "GPU prefix cache held; offload, what LMCache retrieved, from its CPU backend or its remote one (no family "
        "tells those apart); computed, what the hits leave. LMCache counts a prompt only up to its first scheduling "
        "step, cut to whole chunks (a short prompt as 0), so every prefill token is that prompt or the hits, "
        "whichever is more, and computed is a lower bound (vLLM's own vllm:prompt_tokens_total counts whole "
        "prompts). One panel per server; no line while the server has no prefill tokens.")
    return [shares], cost_panels(ns, catalog, profile, spec, variable, width=16, alerted=False, titles=(
        "LMCache bytes moved per hit token, by tier", "LMCache retrieve seconds per offload hit token"))


def lmcache_fleet_rows(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """LMCache over every pod: its cluster: recording rules only (one worker per engine for tokens)."""
    spec = catalog.get
    hit, asked = rules.cluster_rate(ns, spec("num_hit_tokens_total")), rules.cluster_rate(ns, spec("num_requested_tokens_total"))
    lookup_hits, lookups = (rules.cluster_rate(ns, spec("num_lookup_hits_total")),
                            rules.cluster_rate(ns, spec("num_lookup_tokens_total")))
    shares, costs = lmcache_prefill_panels(ns, catalog)
    return [
        _row(f"{FLEET_ROW_PREFIX}, LMCache (vLLM): every pod, from the cluster:{ns} recording rules"),
        *shares,
        _timeseries(
            "LMCache hit tokens vs requested tokens/s (once per engine)",
            "Tokens vLLM asked LMCache to retrieve and the tokens LMCache had: per engine its furthest worker "
            "(every TP and PP worker counts the same tokens), engines summed. Never a sum over worker_id, "
            "which reports TP x PP times the tokens.",
            [(f"sum({asked})", "fleet requested tokens"), (f"sum({hit})", "fleet hit tokens")], width=8),
        _timeseries(
            "LMCache retrieve and lookup hit ratio",
            f"From the counters, over the rate window: {rules.hit_ratio(ns, 'retrieve_hit_rate')} per server, "
            "and over the fleet the summed hit rate over the summed requested rate. LMCache's own "
            f"{ns}retrieve_hit_rate gauge is one process's last 10 s (1 when idle) and cannot be summed.",
            [(rules.hit_ratio(ns, "retrieve_hit_rate"), "retrieve {{server}} {{model_name}}"),
             (f"sum({hit}) / (sum({asked}) > 0)", "fleet retrieve"),
             (f"sum({lookup_hits}) / (sum({lookups}) > 0)", "fleet lookup")], unit="percentunit", width=8),
        _timeseries(
            "LMCache stored, lookup and prompt tokens/s",
            "Tokens stored into LMCache (evicted ones included), looked up, and the prompts' tokens, once per engine.",
            [(f"sum({rules.cluster_rate(ns, spec(name))})", f"fleet {label}") for name, label in (
                ("num_stored_tokens_total", "stored"), ("num_lookup_tokens_total", "lookup"),
                ("num_prompt_tokens_total", "prompt"), ("num_vllm_hit_tokens_total", "vLLM prefix hit"))], width=8),
        _timeseries(
            "LMCache tokens/s by transfer between tiers (once per engine)",
            "The profile's transfers (exporter/defaults/lmcache.yaml) that count tokens: per engine its furthest "
            "worker, engines summed.",
            [(f"sum({rules.cluster_rate(ns, spec(t.tokens))})", f"fleet {tier_label(t)}")
             for t in transfers(catalog) if t.tokens is not None], width=8),
        _timeseries(
            "LMCache bytes/s by transfer between tiers (every worker summed)",
            "The profile's transfers that count bytes: each worker moves its own KV slice, so every worker of every "
            "engine is summed.",
            [(f"sum({rules.bytes_rate(ns, spec(t.bytes))})", f"fleet {tier_label(t)}")
             for t in transfers(catalog) if t.bytes is not None], unit="Bps", width=8),
        _timeseries(
            "LMCache requests/s (once per engine)",
            "Retrieve, store and lookup requests, per engine its furthest worker, engines summed; lookups by role "
            "(a scheduler's with scheduler bypass).",
            [(f"sum({rules.cluster_rate(ns, spec('num_retrieve_requests_total'))})", "fleet retrieve"),
             (f"sum({rules.cluster_rate(ns, spec('num_store_requests_total'))})", "fleet store"),
             (f"sum by (role) ({rules.cluster_rate(ns, spec('num_lookup_requests_total'))})", "fleet lookup {{role}}")],
            width=8),
        _timeseries(
            "LMCache local CPU evictions/s (every worker summed)",
            "Each worker's own LocalCPUBackend: evictions, evicted keys and failed evictions, summed.",
            [(f"sum({rules.bytes_rate(ns, spec(name))})", f"fleet {label}") for name, label in (
                ("local_cpu_evict_count_total", "evictions"), ("local_cpu_evict_keys_count_total", "evicted keys"),
                ("local_cpu_evict_failed_count_total", "failed evictions"))], width=8),
        *costs,
    ]


def lmcache_pod_rows(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """LMCache in the one pod `$instance`: its sidecar's rollups beside its workers."""
    for name in ("num_hit_tokens_total", "num_requested_tokens_total", "num_stored_tokens_total",
                 "local_cache_usage", "retrieve_hit_rate"):
        catalog.get(name)  # a profile file without them fails here, not in Grafana
    worker = "worker {{worker_id}} dp{{dp_rank}}"
    moved = [(t.bytes, tier_label(t)) for t in transfers(catalog) if t.bytes is not None]
    return [
        _row(f"{POD_ROW_PREFIX} $instance, LMCache (vLLM): its sidecar's rollups and its workers"),
        _timeseries(
            "LMCache hit vs requested tokens/s in this pod",
            f"Rollups: {ns}rollup_num_hit_tokens_total and ..._requested_tokens_total of this pod's sidecar (each "
            "engine's furthest worker, engines summed). Per worker: every worker of an engine counts the same "
            "tokens, so their lines lie on top of each other. " + RESTART_NOTE,
            [(pod_rollup_rate(ns, "num_requested_tokens_total"), "rollup requested"),
             (pod_rollup_rate(ns, "num_hit_tokens_total"), "rollup hit"),
             (f"rate({ns}num_hit_tokens_total{{{RANKS}}}[{RATE}])", f"{worker} hit")], width=8),
        _timeseries(
            "LMCache retrieve hit ratio in this pod",
            "The rollups' hit rate over their requested rate, and per worker LMCache's own gauge (its last 10 s "
            "interval, 1 when idle).",
            [(f"({pod_rollup_rate(ns, 'num_hit_tokens_total')}) / (({pod_rollup_rate(ns, 'num_requested_tokens_total')}) > 0)",
              "rollup"),
             (f"{ns}retrieve_hit_rate{{{RANKS}}}", f"{worker} gauge")], unit="percentunit", width=8),
        _timeseries(
            "LMCache stored tokens/s in this pod",
            f"Rollup: {ns}rollup_num_stored_tokens_total (each engine once). Per worker: the same tokens on every "
            "worker of an engine. " + RESTART_NOTE,
            [(pod_rollup_rate(ns, "num_stored_tokens_total"), "rollup stored"),
             (f"rate({ns}num_stored_tokens_total{{{RANKS}}}[{RATE}])", worker)], width=8),
        _timeseries(
            "LMCache bytes/s by transfer between tiers in this pod",
            "The profile's transfers that count bytes. Per worker its own shard's bytes; the rollups sum the workers. "
            + RESTART_NOTE,
            [(pod_rollup_rate(ns, family), f"rollup {label}") for family, label in moved]
            + [(f"rate({ns}{family}{{{RANKS}}}[{RATE}])", f"{worker} {label}") for family, label in moved],
            unit="Bps", width=12),
        _timeseries(
            "LMCache local CPU cache usage in this pod",
            "Bytes in each worker's LocalCPUBackend allocator, and the rollup: their sum.",
            [(f"{ns}rollup_local_cache_usage{{{POD}}}", "rollup"),
             (f"{ns}local_cache_usage{{{RANKS}}}", worker)], unit="bytes", width=12),
    ]


# Row builders of the profiles besides the default one: (fleet rows, pod rows), by profile name.
PROFILE_ROWS: dict[str, tuple[Callable[[str, Catalog], list[dict[str, Any]]], Callable[[str, Catalog], list[dict[str, Any]]]]] = {
    "lmcache": (lmcache_fleet_rows, lmcache_pod_rows),
}


def profile_rows(catalog: Catalog) -> list[dict[str, Any]]:
    """The fleet and pod rows of every profile in use besides the default one, each under its namespace."""
    panels: list[dict[str, Any]] = []
    for name, profile in catalog.profiles.items():
        if name != catalog.default_profile.name and name in PROFILE_ROWS:
            fleet, pod = PROFILE_ROWS[name]
            own = catalog.of_profile(name)
            panels += fleet(profile.namespace, own) + pod(profile.namespace, own)
    return panels


def server_variables(ns: str, catalog: Catalog) -> list[dict[str, Any]]:
    """For each profile in use whose rows draw prefill shares, the variable of its servers: those that count
    prefill tokens (the default profile's under `ns`, every other's under its own namespace)."""
    variables = []
    for name, profile in catalog.profiles.items():
        default = name == catalog.default_profile.name
        if not default and name not in PROFILE_ROWS:
            continue
        own = catalog.of_profile(name) if len(catalog.profiles) > 1 else catalog
        found = rules.prefill_of(own)
        if found is None:
            continue
        counted = found[1].prompt or found[1].device
        rate = rules.cluster_rate(ns if default else profile.namespace, own.get(counted.family))
        variables.append(_query_variable(server_variable(name, default),
                                         "Server (prefill shares)" if default else f"{name} server (prefill shares)",
                                         f"label_values({rate}, server)", multi=True))
    return variables


def build(ns: str, catalog: Catalog, uid: str, title: str) -> dict[str, Any]:
    """The dashboard for namespace `ns` (the default profile's) and every other profile in use."""
    others = [name for name in catalog.profiles if name != catalog.default_profile.name and name in PROFILE_ROWS]
    default = catalog.of_profile(catalog.default_profile.name) if len(catalog.profiles) > 1 else catalog
    return {
        "annotations": {"list": [{
            "builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
            "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"}]},
        "description": (
            f"hicache-exporter (metric namespace {ns!r}): HiCache (hierarchical KV cache) metrics of sharded LLM "
            "servers. Fleet rows read the cluster: recording rules (right across pods); pod rows read one "
            "sidecar's rollups and ranks. Never sum sidecar rollups across pods."
            + "".join(f" Rows for the {name} profile ({catalog.profiles[name].namespace}) follow." for name in others)),
        "editable": True, "fiscalYearStartMonth": 0, "graphTooltip": 1, "id": None, "links": [],
        "panels": _layout(prefill_rows(ns, default) + fleet_rows(ns, default) + pod_rows(ns, default)
                          + profile_rows(catalog)),
        "refresh": "30s", "schemaVersion": 39,
        "tags": ["hicache", "sglang", *others, "kv-cache", "llm-inference"],
        "templating": {"list": [
            {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
             "current": {}, "hide": 0, "includeAll": False, "multi": False, "options": [], "refresh": 1,
             "regex": "", "skipUrlSync": False},
            # One sidecar: the pod rows are that pod's numbers, never a sum over pods.
            _query_variable("instance", "Pod (sidecar instance)", "label_values(hicache_exporter_build_info, instance)",
                            multi=False),
            _query_variable("dp_rank", "dp_rank", 'label_values(hicache_exporter_rank_up{instance="$instance"}, dp_rank)',
                            multi=True),
            # The first row's servers (and each other profile's): one panel of tier shares each.
            *server_variables(ns, catalog),
        ]},
        "time": {"from": "now-1h", "to": "now"}, "timepicker": {}, "timezone": "browser",
        "title": title,
        "uid": uid, "version": 1, "weekStart": "",
    }
