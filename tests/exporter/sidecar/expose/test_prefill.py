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
from exporter.catalog import SGLANG_PREFILL, SGLANG_PROFILE, Catalog, default_catalog, load_profiles
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

PREFILL = SGLANG_PREFILL.family
MODES = SGLANG_PREFILL.modes()  # computed, device, host, storage -> the engine's mode values
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
    return {kind: tokens[kind] / total for kind in ("device", "host", "storage")}, tokens["computed"] / total


def check_figures(figures: dict[str, Any], tokens: dict[str, float], shards: int, scale: float = 1) -> None:
    """A scope's tokens and shares exactly; its costs from `shards` ranks' bytes and seconds (times `scale`)."""
    total = sum(tokens.values())
    assert figures["tokens"] == {**tokens, "total": total}
    hit_ratio, computed = shares(tokens)
    assert figures["hit_ratio"] == hit_ratio and figures["computed_ratio"] == computed
    host, storage = figures["cost"]["host"], figures["cost"]["storage"]
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
    assert (report["profile"], report["family"], report["label"], report["modes"]) == (
        "sglang", PREFILL, "mode", MODES)
    assert report["exported"] == "sglang_rollup_prefill_effective_tokens"
    # The costs' transfers, from the profile's tiers: L2 hits are read back L2->L1 and filled L1->L2, L3 hits
    # are read L3->L2 and filled L2->L3.
    assert report["tiers"] == {
        "host": {"level": "L2", "read_transfer": "load_back", "fill_transfer": "backup"},
        "storage": {"level": "L3", "read_transfer": "prefetch", "fill_transfer": "storage_backup"}}
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
    assert report["since_start"]["hit_ratio"] == {"device": 710 / 1500, "host": 300 / 1500, "storage": 90 / 1500}


def test_a_lagging_replica_leaves_its_group_at_the_furthest_one() -> None:
    h = Harness()
    ranks = two_by_two(h)
    ahead = {kind: 2 * value for kind, value in GROUP_TOKENS[0].items()}
    h.push(ranks[(0, 1)][1], *prefill(ahead), *shard())  # tp 1 of group 0 counted a second batch, tp 0 not yet
    doc = doc_of(view_of(h))
    for period in ("since_start", "window"):
        groups = {g["dp_rank"]: g for g in doc["prefill"][period]["dp_groups"]}
        assert groups[0]["tokens"] == {**summed(ahead), "total": float(sum(ahead.values()))}
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
    assert groups[0]["hit_ratio"] == {"device": 0.75, "host": 0.0, "storage": 0.0}
    assert groups[0]["computed_ratio"] == 0.25
    assert groups[0]["cost"]["host"]["bytes_per_hit_token"] is None  # no host hit in the window: no quotient
    assert groups[0]["cost"]["host"]["read_bytes"] == 2 * SHARD["load_back_bytes_total"]
    assert groups[1]["hit_ratio"] == {"device": 0.25, "host": 0.25, "storage": 0.25}
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
    assert since["hit_ratio"] == {"device": None, "host": None, "storage": None} and since["computed_ratio"] is None
    assert since["tokens"]["total"] == 0 and since["servers"] == since["dp_groups"] == []


def test_a_sidecar_of_a_profile_without_tier_counts_has_no_prefill() -> None:
    catalog = load_profiles(None, ["lmcache"]).of_profile("lmcache")
    doc = doc_of(view_of(Harness(catalog=catalog)))
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
    assert report["hit_ratio"] == {kind: rolled[MODES[kind]] / total for kind in ("device", "host", "storage")}
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
    catalog = load_profiles(None, ["lmcache"]).of_profile("lmcache")
    body = render_page(typed(doc_of(view_of(Harness(catalog=catalog)))))
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
    assert lmcache.tier_transfers("L1") == (None, None) and lmcache.prefill is None
    catalog = default_catalog()
    bad = SGLANG_PREFILL.model_copy(update={"family": "load_back_bytes_total"})  # a counter without the label
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
    assert server["tokens"] == since["tokens"] == {
        **summed(more, GROUP_TOKENS[1]), "total": sum(summed(more, GROUP_TOKENS[1]).values())}
    assert sum(g["tokens"]["total"] for g in since["dp_groups"]) == server["tokens"]["total"]
    assert window["tokens"]["total"] <= since["tokens"]["total"]
