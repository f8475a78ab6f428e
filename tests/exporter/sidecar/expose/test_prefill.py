"""The status document's `prefill` (issue 32, DESIGN section 18): each tier's share of prefill tokens and
what a hit cost, since start (rollups) and over the window (positions), whole, per server and per dp group.

Exact values at settled points on the harness's fake clocks: a replicated family counts one replica per
group (never TP times), a per_shard one every shard.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from pydantic import ValidationError

from exporter.api import view
from exporter.api.v1 import PREFILL_SCOPES_LISTED
from exporter.catalog import (
    SGLANG_PREFILL,
    SGLANG_PROFILE,
    Catalog,
    PrefillSpec,
    TokenCount,
    default_catalog,
    load_profiles,
)
from exporter.protocol.messages import Sample, ScalarSample
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.core.saved import SavedCore, dump, restore
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.page import render_page
from exporter.sidecar.expose.render import TextRenderer
from exporter.top.render import render_frame, share_bar
from tests.exporter.sidecar.expose.test_status import assert_valid, doc_of, typed, view_of
from tests.exporter.sidecar.harness import Harness, hist, one_hot
from tests.exporter.test_top import NOW, screen_text
from tests.exporter.test_top import view_of as top_view

PREFILL = SGLANG_PREFILL.device.family
MODES = {kind: count.value for kind, count in SGLANG_PREFILL.counts().items()}  # kind -> the engine's mode
KINDS = ("computed", "device", "host", "storage")
# Per dp group: the tokens its scheduler counted (every replica counts the same: replicated).
GROUP_TOKENS = {0: {"computed": 100, "device": 610, "host": 220, "storage": 70},
                1: {"computed": 300, "device": 100, "host": 80, "storage": 20}}
# Per rank (each tp shard moves its own bytes): load-back, backup, prefetch, storage backup bytes; seconds.
SHARD = {"load_back_bytes_total": 1000, "hicache_backup_bytes_total": 4000, "storage_prefetch_bytes_total": 300,
         "storage_backup_bytes_total": 9000}
LOAD_BACK_SECONDS, PREFETCH_SECONDS = 0.25, 0.5


def prefill(tokens: dict[str, float]) -> list[Sample]:
    return [ScalarSample(family=PREFILL, labels={"mode": MODES[kind]}, value=value) for kind, value in tokens.items()]


def shard(scale: int = 1) -> list[Sample]:
    return [*(ScalarSample(family=name, labels={}, value=value * scale) for name, value in SHARD.items()),
            hist("load_back_duration_seconds", one_hot("load_back_duration_seconds", 3, scale), LOAD_BACK_SECONDS * scale),
            hist("storage_prefetch_duration_seconds", one_hot("storage_prefetch_duration_seconds", 3, scale),
                 PREFETCH_SECONDS * scale)]


def two_by_two(h: Harness) -> dict[tuple[int, int], tuple[object, RankState]]:
    """2 dp groups x 2 tp replicas, each pushing its group's prefill tokens and its own shard's bytes."""
    ranks = {}
    for dp in (0, 1):
        for tp in (0, 1):
            conn, rank = h.hello(tp=tp, dp=dp)
            h.push(rank, *prefill(GROUP_TOKENS[dp]), *shard())
            ranks[(dp, tp)] = (conn, rank)
    return ranks


def shares(tokens: dict[str, float]) -> tuple[dict[str, float], float]:
    total = sum(tokens.values())
    hit_ratio = {kind: tokens[kind] / total for kind in ("device", "host", "storage")}
    return {**hit_ratio, "offload": (tokens["host"] + tokens["storage"]) / total}, tokens["computed"] / total


def check_figures(figures: dict[str, Any], tokens: dict[str, float], shards: int, scale: float = 1) -> None:
    """A scope's tokens and shares exactly; its costs from `shards` ranks' bytes and seconds (times `scale`)."""
    total = sum(tokens.values())
    assert figures["tokens"] == {**tokens, "offload": tokens["host"] + tokens["storage"], "total": total}
    hit_ratio, computed = shares(tokens)
    assert figures["hit_ratio"] == hit_ratio and figures["computed_ratio"] == computed
    host, storage = figures["cost"]["host"], figures["cost"]["storage"]
    assert figures["cost"]["offload"] is None  # the profile tells host from storage
    # A storage hit is loaded back from host memory too: the host tier is paid per host and storage hit token.
    host_read = tokens["host"] + tokens["storage"]
    assert host["read_bytes"] == shards * SHARD["load_back_bytes_total"] * scale
    assert host["bytes_per_hit_token"] == shards * SHARD["load_back_bytes_total"] * scale / host_read
    assert host["read_seconds"] == shards * LOAD_BACK_SECONDS * scale
    assert host["seconds_per_hit_token"] == shards * LOAD_BACK_SECONDS * scale / host_read
    assert host["fill_bytes_per_hit_token"] == shards * SHARD["hicache_backup_bytes_total"] * scale / host_read
    assert storage["bytes_per_hit_token"] == shards * SHARD["storage_prefetch_bytes_total"] * scale / tokens["storage"]
    assert storage["seconds_per_hit_token"] == shards * PREFETCH_SECONDS * scale / tokens["storage"]
    assert storage["fill_bytes"] == shards * SHARD["storage_backup_bytes_total"] * scale
    assert storage["fill_bytes_per_hit_token"] == (
        shards * SHARD["storage_backup_bytes_total"] * scale / tokens["storage"])


def summed(*groups: dict[str, float]) -> dict[str, float]:
    return {kind: float(sum(g[kind] for g in groups)) for kind in KINDS}


def test_two_dp_groups_of_two_replicas_give_exact_shares_not_tp_times() -> None:
    h = Harness()
    two_by_two(h)
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    report = doc["prefill"]
    assert report["profile"] == "sglang"
    assert report["counts"] == {kind: {"family": PREFILL, "exported": "sglang_rollup_prefill_effective_tokens",
                                       "label": "mode", "value": value} for kind, value in MODES.items()}
    # The costs' transfers, from the profile's tiers: L2 hits are read back L2->L1 and filled L1->L2, L3 hits
    # are read L3->L2 and filled L2->L3.
    assert report["tiers"] == {
        "host": {"level": "L2", "read_transfer": "load_back", "fill_transfer": "backup"},
        "storage": {"level": "L3", "read_transfer": "prefetch", "fill_transfer": "storage_backup"}, "offload": None}
    whole = summed(GROUP_TOKENS[0], GROUP_TOKENS[1])
    assert whole == {"computed": 400, "device": 710, "host": 300, "storage": 90}  # one replica per group, not 2x
    for period in ("since_start", "window"):  # everything happened inside the window
        figures = report[period]
        check_figures(figures, whole, shards=4)
        (server,) = figures["servers"]
        assert server["server"] == "v0" and figures["servers_count"] == 1 and figures["dp_groups_count"] == 2
        check_figures(server, whole, shards=4)
        groups = {(g["server"], g["dp_rank"]): g for g in figures["dp_groups"]}
        assert list(groups) == [("v0", 0), ("v0", 1)]
        for dp in (0, 1):
            check_figures(groups[("v0", dp)], summed(GROUP_TOKENS[dp]), shards=2)
    assert report["since_start"]["hit_ratio"] == {"device": 710 / 1500, "host": 300 / 1500, "storage": 90 / 1500,
                                                  "offload": 390 / 1500}


def test_a_lagging_replica_leaves_its_group_at_the_furthest_one() -> None:
    h = Harness()
    ranks = two_by_two(h)
    ahead = {kind: 2 * value for kind, value in GROUP_TOKENS[0].items()}
    h.push(ranks[(0, 1)][1], *prefill(ahead), *shard())  # tp 1 of group 0 counted a second batch, tp 0 not yet
    doc = doc_of(view_of(h))
    for period in ("since_start", "window"):
        groups = {g["dp_rank"]: g for g in doc["prefill"][period]["dp_groups"]}
        assert groups[0]["tokens"] == {**summed(ahead), "offload": float(ahead["host"] + ahead["storage"]),
                                       "total": float(sum(ahead.values()))}
        assert doc["prefill"][period]["tokens"]["total"] == sum(ahead.values()) + sum(GROUP_TOKENS[1].values())


def test_since_start_continues_through_a_rank_restart() -> None:
    h = Harness()
    ranks = two_by_two(h)
    for (dp, tp), (conn, rank) in ranks.items():  # every rank restarts: its counters start over from zero
        h.state.disconnect(conn, rank)
        _, again = h.hello(tp=tp, dp=dp, epoch="epoch-b")
        assert again is rank
        h.push(again, *prefill(GROUP_TOKENS[dp]), *shard())
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    twice = {kind: 2 * value for kind, value in summed(GROUP_TOKENS[0], GROUP_TOKENS[1]).items()}
    check_figures(doc["prefill"]["since_start"], twice, shards=4, scale=2)
    check_figures(doc["prefill"]["window"], twice, shards=4, scale=2)
    for group in doc["prefill"]["since_start"]["dp_groups"]:
        assert group["tokens"]["total"] == 2 * sum(GROUP_TOKENS[group["dp_rank"]].values())


def test_the_window_is_the_increase_of_the_positions_and_since_start_everything() -> None:
    h = Harness(window_seconds=60.0)
    ranks = two_by_two(h)
    h.clock.advance(61.0)  # the first pushes fall before the window
    more = {0: {"computed": 10, "device": 30, "host": 0, "storage": 0},
            1: {"computed": 5, "device": 5, "host": 5, "storage": 5}}
    for (dp, _), (_, rank) in ranks.items():
        h.push(rank, *prefill({kind: GROUP_TOKENS[dp][kind] + more[dp][kind] for kind in KINDS}), *shard(2))
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    window = doc["prefill"]["window"]
    check_figures(window, summed(more[0], more[1]), shards=4)  # the bytes and seconds moved once more
    groups = {g["dp_rank"]: g for g in window["dp_groups"]}
    assert groups[0]["hit_ratio"] == {"device": 0.75, "host": 0.0, "storage": 0.0, "offload": 0.0}
    assert groups[0]["computed_ratio"] == 0.25
    assert groups[0]["cost"]["host"]["bytes_per_hit_token"] is None  # no host hit in the window: no quotient
    assert groups[0]["cost"]["host"]["read_bytes"] == 2 * SHARD["load_back_bytes_total"]
    assert groups[1]["hit_ratio"] == {"device": 0.25, "host": 0.25, "storage": 0.25, "offload": 0.5}
    since = doc["prefill"]["since_start"]
    check_figures(since, summed(*(GROUP_TOKENS[dp] for dp in (0, 1)), *more.values()), shards=4, scale=2)


def test_a_tier_that_fills_and_never_hits_shows_its_bytes_and_no_quotient() -> None:
    h = Harness()
    _, rank = h.hello()
    h.push(rank, *prefill({"computed": 50, "device": 50, "host": 0, "storage": 0}), *shard())
    storage = doc_of(view_of(h))["prefill"]["since_start"]["cost"]["storage"]
    assert storage["fill_bytes"] == SHARD["storage_backup_bytes_total"]
    assert storage["fill_bytes_per_hit_token"] is None and storage["bytes_per_hit_token"] is None


def test_no_prefill_token_yet_gives_null_shares_and_lists_no_group() -> None:
    h = Harness()
    h.hello()
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    since = doc["prefill"]["since_start"]
    assert since["hit_ratio"] == {"device": None, "host": None, "storage": None, "offload": None}
    assert since["computed_ratio"] is None
    assert since["tokens"]["total"] == 0 and since["servers"] == since["dp_groups"] == []


def untold_catalog() -> Catalog:
    """The default catalog with a profile that does not say where its prefill tokens are counted."""
    untold = SGLANG_PROFILE.model_copy(update={"prefill": None})
    return Catalog(families=default_catalog().families, profiles={"sglang": untold})


def test_a_sidecar_of_a_profile_without_tier_counts_has_no_prefill() -> None:
    doc = doc_of(view_of(Harness(catalog=untold_catalog())))
    assert doc["prefill"] is None
    assert_valid("status", doc)


def test_the_shares_are_the_rollups_on_metrics_which_gains_no_ratio_gauges() -> None:
    """Each tier's since-start share is its share of the rollup counter /metrics shows; ratios belong in
    PromQL, so /metrics has no share and no cost per hit token."""
    h = Harness()
    two_by_two(h)
    text = TextRenderer(SidecarCollector(h.state, SidecarHealth(), "sglang_")).render().decode()
    rolled = {}
    for line in text.splitlines():
        if line.startswith("sglang_rollup_prefill_effective_tokens_total{"):
            mode = re.search(r'mode="([a-z_]+)"', line)
            assert mode is not None
            rolled[mode.group(1)] = float(line.rsplit(" ", 1)[1])
    total = sum(rolled.values())
    report = doc_of(view_of(h))["prefill"]["since_start"]
    assert report["hit_ratio"] == {
        **{kind: rolled[MODES[kind]] / total for kind in ("device", "host", "storage")},
        "offload": (rolled[MODES["host"]] + rolled[MODES["storage"]]) / total}
    assert report["computed_ratio"] == rolled[MODES["computed"]] / total
    assert not any(word in text for word in ("hit_ratio", "per_hit", "prefill_share", "computed_ratio"))


def test_the_breakdowns_list_the_scopes_with_the_most_tokens_and_count_them_all() -> None:
    """One server per rank (a static label of its own), more than the listing holds: the largest are listed,
    in document order, and the whole and the counts stay exact."""
    h = Harness()
    servers = PREFILL_SCOPES_LISTED + 6
    for n in range(servers):
        _, rank = h.hello(labels={"cache_type": "UnifiedRadixCache", "model": f"m{n:03d}"})
        h.push(rank, *prefill({"computed": n, "device": 1, "host": 0, "storage": 0}))
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    for period in ("since_start", "window"):
        figures = doc["prefill"][period]
        assert figures["servers_count"] == figures["dp_groups_count"] == servers
        assert len(figures["servers"]) == len(figures["dp_groups"]) == PREFILL_SCOPES_LISTED
        assert [s["tokens"]["computed"] for s in figures["servers"]] == list(range(6, servers))
        assert [g["server"] for g in figures["dp_groups"]] == [s["server"] for s in figures["servers"]]
        assert figures["tokens"]["total"] == sum(n + 1 for n in range(servers))


def test_the_page_opens_with_the_shares_as_text_and_a_stacked_bar_with_the_cost_beside_each_tier() -> None:
    h = Harness()
    two_by_two(h)
    body = render_page(typed(doc_of(view_of(h))))
    first = body.index("<section")
    assert body.index('<section id="prefill">') == first  # the page's first section
    section = body[first:body.index("</section>", first)]
    assert "<h2>Where prefill tokens come from</h2>" in section
    assert '<p class="shares-text">device 47 % · host 20 % · storage 6 % · computed 27 %</p>' in section
    # The bar: one rect per kind, widths in proportion to the shares (360 wide), the nearest tier first.
    assert re.findall(r'<rect class="tier-(\w+)" x="([\d.]+)" y="0" width="([\d.]+)"', section) == [
        ("device", "0.0", "170.4"), ("host", "170.4", "72.0"), ("storage", "242.4", "21.6"), ("computed", "264.0", "96.0")]
    assert ("<tr><td><span class=\"swatch tier-host\">host</span></td><td>20 %</td><td>300</td>"
            "<td>load back 10.3 B · 2.56 ms; backup writes 41.0 B per hit token</td></tr>") in section
    assert "<td>prefetch 13.3 B · 22.2 ms; storage backup writes 400 B per hit token</td>" in section
    # Each dp group's shares, which differ.
    assert "<td>0</td><td>device 61 % · host 22 % · storage 7 % · computed 10 %</td><td>1,000</td>" in section
    assert "<td>1</td><td>device 20 % · host 16 % · storage 4 % · computed 60 %</td><td>500</td>" in section


def test_the_page_says_when_there_is_no_prefill_token_or_no_profile_counts_them() -> None:
    h = Harness()
    h.hello()
    assert '<p class="empty">no prefill token counted yet.</p>' in render_page(typed(doc_of(view_of(h))))
    body = render_page(typed(doc_of(view_of(Harness(catalog=untold_catalog())))))
    assert "No profile in use counts prefill tokens by tier." in body


def test_a_tier_written_and_never_hit_says_so() -> None:
    h = Harness()
    _, rank = h.hello()
    h.push(rank, *prefill({"computed": 500, "device": 500, "host": 1, "storage": 0}), *shard())
    doc = typed(doc_of(view_of(h)))
    assert doc.prefill is not None
    storage = view.prefill_segments(doc.prefill.since_start, doc.prefill.tiers)[2]
    assert (storage.kind, storage.percent, storage.cost) == ("storage", "0 %", "storage backup wrote 8.79 KiB, no hit")
    host = view.prefill_segments(doc.prefill.since_start, doc.prefill.tiers)[1]
    assert host.percent == "<1 %"


def test_top_opens_with_the_shares_a_bar_and_the_cost_beside_each_tier() -> None:
    h = Harness()
    two_by_two(h)
    lines = screen_text(render_frame(top_view(doc_of(view_of(h))), now=NOW)).splitlines()
    assert lines[2] == "Where prefill tokens come from   since the sidecar started: 1,500 tokens"
    bar, shares = lines[3].split("  ", 1)
    assert bar == "█" * 40 and shares == "device 47 % · host 20 % · storage 6 % · computed 27 %"
    rows = [line.split() for line in lines[4:8]]
    assert [row[:4] for row in rows] == [["device", "47", "%", "710"], ["host", "20", "%", "300"],
                                         ["storage", "6", "%", "90"], ["computed", "27", "%", "400"]]
    assert lines[5].rstrip().endswith("tokens    load back 10.3 B · 2.56 ms; backup writes 41.0 B per hit token")
    assert lines[6].rstrip().endswith("tokens    prefetch 13.3 B · 22.2 ms; storage backup writes 400 B per hit token")
    assert lines[8] == "over 1m00s: device 47 % · host 20 % · storage 6 % · computed 27 %"
    assert lines[9:11] == ["dp0: device 61 % · host 22 % · storage 7 % · computed 10 %",
                           "dp1: device 20 % · host 16 % · storage 4 % · computed 60 %"]
    assert lines[12].startswith("Ranks ")


def test_the_bar_gives_each_tier_its_rounded_cells() -> None:
    segments = [view.ShareSegment(kind, share, view.percent(share), 0.0, "")
                for kind, share in (("device", 0.61), ("host", 0.22), ("storage", 0.07), ("computed", 0.10))]
    bar = share_bar(segments, width=40)
    assert bar.plain == "█" * 40
    assert [(span.end - span.start, span.style) for span in bar.spans] == [
        (24, "blue"), (9, "green"), (3, "yellow"), (4, "bright_black")]
    assert view.shares_text(segments) == "device 61 % · host 22 % · storage 7 % · computed 10 %"


def test_since_start_continues_through_a_sidecar_restart_and_the_window_starts_from_what_it_loaded() -> None:
    h = Harness()
    for conn, rank in two_by_two(h).values():
        h.state.disconnect(conn, rank)
    restarted = Harness()
    restore(restarted.state, msgspec.msgpack.decode(msgspec.msgpack.encode(dump(h.state)), type=SavedCore))
    for dp in (0, 1):
        for tp in (0, 1):  # the engine restarted too: its counters start over
            _, rank = restarted.hello(tp=tp, dp=dp, epoch="epoch-b")
            restarted.push(rank, *prefill(GROUP_TOKENS[dp]), *shard())
    doc = doc_of(view_of(restarted))
    assert_valid("status", doc)
    once = summed(GROUP_TOKENS[0], GROUP_TOKENS[1])
    check_figures(doc["prefill"]["since_start"], {kind: 2 * value for kind, value in once.items()}, shards=4, scale=2)
    check_figures(doc["prefill"]["window"], once, shards=4)
    groups = {g["dp_rank"]: g for g in doc["prefill"]["since_start"]["dp_groups"]}
    check_figures(groups[1], {kind: 2.0 * value for kind, value in GROUP_TOKENS[1].items()}, shards=2, scale=2)


def test_the_profile_says_which_transfers_serve_and_fill_each_tier_and_its_prefill_family_is_checked() -> None:
    lmcache = load_profiles(None, ["lmcache"]).profiles["lmcache"]
    read, fill = lmcache.tier_transfers("L2")
    assert (read and read.name, fill and fill.name) == ("retrieve", "store")
    read, fill = lmcache.tier_transfers("L3")
    assert (read and read.name, fill and fill.name) == ("remote_read", "remote_write")
    assert lmcache.tier_transfers("L1") == (None, None)
    catalog = default_catalog()
    with pytest.raises(ValidationError, match="counts several kinds"):  # the same series counted as two kinds
        PrefillSpec(prompt=TokenCount(family="num_prompt_tokens_total"),
                    device=TokenCount(family="num_hit_tokens_total"), offload=TokenCount(family="num_hit_tokens_total"))
    with pytest.raises(ValidationError, match="counts several kinds"):  # two kinds with one mode's value
        PrefillSpec.model_validate({**SGLANG_PREFILL.model_dump(), "host": SGLANG_PREFILL.device.model_dump()})
    device = SGLANG_PREFILL.device.model_copy(update={"family": "load_back_bytes_total"})  # no `mode` label
    bad = SGLANG_PREFILL.model_copy(update={"device": device})
    with pytest.raises(ValidationError, match="must be a counter labelled 'mode'"):
        Catalog(families=catalog.families, profiles={"sglang": SGLANG_PROFILE.model_copy(update={"prefill": bad})})


def test_a_transfer_no_rank_reports_is_unknown_not_free() -> None:
    """The released collectors count no L3 bytes: a storage hit's cost is then null, never 0 B per hit token."""
    h = Harness()
    _, rank = h.hello()
    h.push(rank, *prefill({"computed": 50, "device": 30, "host": 10, "storage": 10}))  # hits, no transfer series
    cost = doc_of(view_of(h))["prefill"]["since_start"]["cost"]
    for tier in ("host", "storage"):
        assert cost[tier]["read_bytes"] is None and cost[tier]["bytes_per_hit_token"] is None
        assert cost[tier]["fill_bytes"] is None and cost[tier]["fill_bytes_per_hit_token"] is None


def test_one_document_reads_one_moment_while_metrics_shows_the_last_save() -> None:
    """With a state file /metrics shows the rollups as last saved; the document's whole and servers once read
    them too while its dp groups and window read live values, so the groups added up to more than their server."""
    h = Harness()
    ranks = two_by_two(h)
    h.state.show_rollups(h.state.rollup_snapshot())  # what the keeper does after a save
    more = {kind: 2 * GROUP_TOKENS[0][kind] for kind in KINDS}
    for tp in (0, 1):
        h.push(ranks[(0, tp)][1], *prefill(more), *shard())
    since, window = (doc_of(view_of(h))["prefill"][period] for period in ("since_start", "window"))
    (server,) = since["servers"]
    both = summed(more, GROUP_TOKENS[1])
    assert server["tokens"] == since["tokens"] == {
        **both, "offload": both["host"] + both["storage"], "total": sum(both.values())}
    assert sum(g["tokens"]["total"] for g in since["dp_groups"]) == server["tokens"]["total"]
    assert window["tokens"]["total"] <= since["tokens"]["total"]


# --- the lmcache profile: its prompt counted apart, vLLM's own hits and LMCache's (one offload tier) ---

LMCACHE_LABELS = {"model_name": "m", "served_model_name": "m", "role": "worker"}
# Per dp group (each vLLM engine), what every worker of it counts: prompt, vLLM's hits, LMCache's hits.
LMCACHE_TOKENS = {0: (2000, 900, 700), 1: (1000, 100, 300)}
RETRIEVE_SECONDS = 0.125  # each worker's own time retrieving


def lmcache_two_by_two(tokens: dict[int, tuple[int, int, int]] = LMCACHE_TOKENS, alone: bool = True) -> Harness:
    """2 vLLM engines (dp groups) x 2 workers (tp), each worker counting its engine's tokens; the catalog
    holds the lmcache profile `alone`, or beside the default one (as `serve --profile lmcache` has it)."""
    catalog = load_profiles(None, ["lmcache"])
    if alone:
        catalog = catalog.of_profile("lmcache")
    h = Harness(catalog=catalog)
    bounds = catalog.get("time_to_retrieve").buckets
    assert bounds is not None
    for dp, (prompt, vllm_hit, hit) in tokens.items():
        for worker in (0, 1):
            _, rank = h.hello(tp=worker, dp=dp, labels={**LMCACHE_LABELS, "worker_id": str(worker)})
            h.push(rank, ScalarSample(family="num_prompt_tokens_total", labels={}, value=prompt),
                   ScalarSample(family="num_vllm_hit_tokens_total", labels={}, value=vllm_hit),
                   ScalarSample(family="num_hit_tokens_total", labels={}, value=hit),
                   hist("time_to_retrieve", one_hot("time_to_retrieve", 2, finite=bounds), RETRIEVE_SECONDS,
                        finite=bounds))
    return h


def test_an_lmcache_sidecar_gives_vllms_hits_lmcaches_and_what_the_prompt_leaves_one_replica_per_engine() -> None:
    doc = doc_of(view_of(lmcache_two_by_two()))
    assert_valid("status", doc)
    report = doc["prefill"]
    assert report["profile"] == "lmcache"
    assert {kind: count["family"] for kind, count in report["counts"].items()} == {
        "prompt": "num_prompt_tokens_total", "device": "num_vllm_hit_tokens_total", "offload": "num_hit_tokens_total"}
    assert report["counts"]["offload"]["exported"].endswith("_rollup_num_hit_tokens")  # its profile's namespace
    # Its families cannot tell LMCache's CPU hits from its remote ones: one offload tier, read back L2->L1.
    assert report["tiers"] == {"host": None, "storage": None,
                               "offload": {"level": "L2", "read_transfer": "retrieve", "fill_transfer": "store"}}
    since = report["since_start"]
    # One worker per engine, the engines summed: never the 2x a sum over workers gives.
    assert since["tokens"] == {"computed": 1000.0, "device": 1000.0, "host": None, "storage": None,
                               "offload": 1000.0, "total": 3000.0}
    assert since["hit_ratio"] == {"device": 1000 / 3000, "host": None, "storage": None, "offload": 1000 / 3000}
    assert since["computed_ratio"] == 1000 / 3000
    assert since["cost"]["host"] is None and since["cost"]["storage"] is None
    offload = since["cost"]["offload"]
    # LMCache times a retrieve (every worker its own: 4 x 0.125 s) and counts no bytes of it or of a store.
    assert offload["read_seconds"] == 4 * RETRIEVE_SECONDS and offload["seconds_per_hit_token"] == 0.5 / 1000
    assert offload["read_bytes"] is None and offload["bytes_per_hit_token"] is None
    assert offload["fill_bytes"] is None and offload["fill_bytes_per_hit_token"] is None
    groups = {g["dp_rank"]: g for g in since["dp_groups"]}
    assert groups[0]["hit_ratio"]["device"] == 900 / 2000 and groups[0]["hit_ratio"]["offload"] == 700 / 2000
    assert groups[1]["tokens"]["computed"] == 600 and groups[1]["computed_ratio"] == 0.6
    assert report["window"]["tokens"] == since["tokens"]  # everything happened inside the window


def test_lmcache_hits_beyond_the_prompt_it_counted_are_every_prefill_token_and_the_shares_still_add_up() -> None:
    """LMCache counts a prompt cut to whole chunks (a short one as 0), and a retrieve starts at the chunk
    boundary below vLLM's hit: the hits can come to more than the prompt it counted. Every prefill token is
    then the hits, nothing was computed, and the shares add up to 1 (before: 0.6 + 0.5)."""
    since = doc_of(view_of(lmcache_two_by_two({0: (1000, 600, 500)})))["prefill"]["since_start"]
    assert since["tokens"] == {"computed": 0.0, "device": 600.0, "host": None, "storage": None, "offload": 500.0,
                               "total": 1100.0}
    assert since["hit_ratio"]["device"] == 600 / 1100 and since["hit_ratio"]["offload"] == 500 / 1100
    assert since["computed_ratio"] == 0


def test_the_page_and_top_show_lmcaches_shares_with_offload_beside_its_name() -> None:
    doc = doc_of(view_of(lmcache_two_by_two()))
    body = render_page(typed(doc))
    section = body[body.index('id="prefill"'):body.index("</section>", body.index('id="prefill"'))]
    assert '<p class="shares-text">device 33 % · offload 33 % · computed 33 %</p>' in section
    assert '<rect class="tier-offload"' in section and "tier-host" not in section
    assert "<td>retrieve 500 µs per hit token</td>" in section
    lines = screen_text(render_frame(top_view(doc), now=NOW)).splitlines()
    assert lines[3].split("  ", 1)[1] == "device 33 % · offload 33 % · computed 33 %"
    assert [line.split()[:4] for line in lines[4:7]] == [
        ["device", "33", "%", "1,000"], ["offload", "33", "%", "1,000"], ["computed", "33", "%", "1,000"]]


def test_a_sidecar_of_both_profiles_shows_the_one_whose_ranks_count_prefill_tokens() -> None:
    """`serve --profile lmcache` keeps the default profile, whose counts no LMCache rank sends: the document
    shows LMCache's shares, not the default profile's empty ones. Before: profile sglang, every token 0."""
    report = doc_of(view_of(lmcache_two_by_two(alone=False)))["prefill"]
    assert report["profile"] == "lmcache" and report["since_start"]["tokens"]["total"] == 3000
    quiet = doc_of(view_of(Harness(catalog=load_profiles(None, ["lmcache"]))))["prefill"]
    assert quiet["profile"] == "sglang" and quiet["since_start"]["tokens"]["total"] == 0  # none counted yet
    h = Harness(catalog=load_profiles(None, ["lmcache"]))
    two_by_two(h)
    assert doc_of(view_of(h))["prefill"]["since_start"]["tokens"]["total"] == 1500  # SGLang's ranks count
