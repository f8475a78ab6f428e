"""The JSON API v1 (exporter.sidecar.expose.status) and the status page's HTML (exporter.sidecar.expose.page).

Live responses of a real sidecar (ranks pushing over its socket, an engine read as an upstream)
are validated against docs/api/v1.schema.json with jsonschema, and their numbers checked against
the same sidecar's /metrics as prometheus_client's parser reads it. The state-level tests run on
the harness's fake clocks.
"""

from __future__ import annotations

import gzip
import html
import io
import json
import re
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from exporter.api import v1
from exporter.api.view import escaped, identity_text
from exporter.catalog import (
    SGLANG_TRANSFERS,
    SPREAD_THRESHOLD,
    MetricType,
    default_catalog,
    load_profile,
    load_profiles,
)
from exporter.client import RankClient
from exporter.config import RanksConfig, SidecarConfig, config_from_data
from exporter.protocol.messages import Hello, RankId, ScalarSample, World
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.expose import page
from exporter.sidecar.expose import status as api
from exporter.sidecar.expose.collector import window_increases
from exporter.sidecar.expose.page import render_page, sparkline_path
from exporter.sidecar.expose.status import BandwidthHistory, StatusView
from exporter.sidecar.http import app as app_module
from exporter.top.render import transfers_section
from tests.exporter.sidecar.harness import STATIC, Harness, bytes_, dropped, hist, one_hot, tokens
from tests.exporter.sidecar.upstream.test_feed import Engine, EngineHTTP
from tests.helpers import RawClient, Scrape, SidecarThread, counter, hello, http_get, snapshot, wait_until

REPO = Path(__file__).resolve().parents[4]
SCHEMA = json.loads((REPO / "docs" / "api" / "v1.schema.json").read_text())
HOSTILE = "<script>alert(1)</script>\"'&amp;\u2028\n\t\\"
PUSHED_LABELS = {"cache_type": "UnifiedRadixCache", "model": HOSTILE}
STALE_AFTER = 2.0  # four upstream reads: a slow read on a loaded machine never makes a proxied rank stale


def validator(definition: str) -> jsonschema.Draft202012Validator:
    """A validator of one of the schema's documents (`status`, `ranks_response`)."""
    jsonschema.Draft202012Validator.check_schema(SCHEMA)
    return jsonschema.Draft202012Validator({**SCHEMA, "$ref": f"#/$defs/{definition}"})


def typed(doc: dict[str, Any]) -> v1.StatusDocument:
    """A status document read as JSON, as the model (what the page renders)."""
    return msgspec.convert(doc, v1.StatusDocument)


def doc_of(view: StatusView) -> dict[str, Any]:
    """The view's document as a client reads it: its JSON."""
    return json.loads(view.encode())


def label_set(doc: dict[str, Any], set_id: str) -> dict[str, str]:
    return next(s["labels"] for s in doc["label_sets"] if s["id"] == set_id)


def group_labels(doc: dict[str, Any], group: dict[str, Any]) -> dict[str, str]:
    return label_set(doc, group["label_set"])


def rank_labels(doc: dict[str, Any], stream: dict[str, Any]) -> dict[str, str]:
    """A stream's static labels, read back from its group's label set and its own labels."""
    group = next(g for g in doc["groups"] if g["id"] == stream["group"])
    return {**group_labels(doc, group), **stream["own_labels"]}


def identity_of(doc: dict[str, Any], stream: dict[str, Any]) -> str:
    """A stream's identity as /metrics quotes it (view.identity_text)."""
    static = tuple(sorted(rank_labels(doc, stream).items()))
    return identity_text(stream["tp_rank"], stream["pp_rank"], stream["dp_rank"], stream["attn_cp_rank"], static)


def assert_valid(definition: str, document: Any) -> None:
    errors = sorted(validator(definition).iter_errors(document), key=lambda e: list(e.path))
    assert not errors, "\n".join(f"{list(e.path)}: {e.message}" for e in errors[:10])


def get_json(url: str) -> Any:
    status, body, headers = http_get(url)
    assert status == 200, body
    assert headers["Content-Type"] == "application/json; charset=utf-8"
    return json.loads(body)


def full_catalog_client(socket_path: str, tp: int, scale: int) -> RankClient:
    """A replica pushing a value for every catalog family (scaled so replicas differ)."""
    client = RankClient(socket_path, rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0}, labels=PUSHED_LABELS,
                        interval=0.1)
    for spec in default_catalog():
        labels = {name: "kv" if name == "pool" else "host_capacity" if name == "reason" else "input"
                  for name in spec.labels}
        if spec.type is MetricType.COUNTER:
            client.counter(spec.name, **labels).inc(1000 * scale)
        elif spec.type is MetricType.GAUGE:
            client.gauge(spec.name, **labels).set(512)
        else:
            client.histogram(spec.name, **labels).observe(0.004 * scale)
    return client.start()


@pytest.fixture
def proxied(socket_dir: Path) -> Iterator[tuple[SidecarThread, EngineHTTP]]:
    """A sidecar with an engine upstream (two ranks) and a short stale timeout."""
    engine = Engine()
    engine.rank(0, tokens=10, moved=100, seconds=0.01)
    engine.rank(1, tokens=10, moved=200, seconds=0.01)
    http = EngineHTTP(engine)
    config = config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "m.sock")},
        "ranks": {"stale_after_seconds": STALE_AFTER},
        "upstreams": [{"name": "engine-0", "url": http.url, "interval_seconds": 0.5, "timeout_seconds": 0.5}],
    }, "test")
    sidecar = SidecarThread(config).start()
    try:
        yield sidecar, http
    finally:
        sidecar.stop()
        http.stop()


def test_status_is_valid_against_the_schema_and_names_every_source(proxied: tuple[SidecarThread, EngineHTTP]) -> None:
    sidecar, http = proxied
    clients = [full_catalog_client(sidecar.socket_path, tp, tp + 1) for tp in range(2)]
    try:
        wait_until(lambda: sum(r["snapshots"] > 0 for r in get_json(sidecar.url + "/api/v1/status")["streams"]) == 4)
        doc = get_json(sidecar.url + "/api/v1/status")
        assert_valid("status", doc)
        sources = {(r["tp_rank"], rank_labels(doc, r).get("model")): r["source"] for r in doc["streams"]}
        assert sources == {(0, HOSTILE): "push", (1, HOSTILE): "push",
                           (0, None): "upstream:engine-0", (1, None): "upstream:engine-0"}
        assert {r["state"] for r in doc["streams"]} == {"live"}
        assert doc["sidecar"]["streams_by_state"] == {"live": 4, "stale": 0, "departed": 0, "expired": 0}
        assert doc["sidecar"]["ready"] is True and doc["sidecar"]["connections"]["open"] == 2
        (upstream,) = doc["upstreams"]
        assert upstream["name"] == "engine-0" and upstream["source"] == http.url and upstream["up"]
        # Replica groups: the pushed pair and the proxied pair, each rank naming its group by id.
        groups = {g["id"]: g for g in doc["groups"]}
        (pushed,) = (g for g in groups.values() if group_labels(doc, g) == PUSHED_LABELS)
        assert [r["id"] for r in doc["streams"] if r["group"] == pushed["id"]] == [
            f'{pushed["id"]}/tp=0,pp=0', f'{pushed["id"]}/tp=1,pp=0']
        assert [s["labels"] for s in doc["label_sets"]].count(PUSHED_LABELS) == 1  # written once
        assert (pushed["size"], pushed["live"], pushed["tp_ranks"], pushed["pp_ranks"]) == (2, 2, [0, 1], [0])
        assert {r["group"] for r in doc["streams"]} == set(groups)
        # No stream here said hello with a world (the upstream configures none): nothing is expected, nothing missing.
        assert all(r["world"] is None for r in doc["streams"])
        assert all(v["expected"] is None and v["missing"] == 0 and not v["world_conflict"] for v in doc["servers"])
        assert doc["totals"] == {"servers": 2, "ranks": 4, "live_ranks": 4, "streams": 4, "missing": 0}
        assert {s["kind"] for s in doc["streams"]} == {"radix"}
        # Hostile label values come back exactly, as JSON strings.
        assert all(rank_labels(doc, r)["model"] == HOSTILE for r in doc["streams"] if r["source"] == "push")
        assert_valid("ranks_response", get_json(sidecar.url + "/api/v1/ranks"))
    finally:
        for client in clients:
            client.close()


def test_every_number_equals_the_metrics_rollups(proxied: tuple[SidecarThread, EngineHTTP]) -> None:
    sidecar, _ = proxied
    clients = [full_catalog_client(sidecar.socket_path, tp, tp + 1) for tp in range(2)]
    wait_until(lambda: sum(r["snapshots"] > 0 for r in get_json(sidecar.url + "/api/v1/status")["streams"]) == 4)
    for client in clients:
        client.close()  # departed: the rollups keep their contribution and stop moving
    wait_until(lambda: get_json(sidecar.url + "/api/v1/status")["sidecar"]["streams_by_state"]["departed"] == 2)
    doc = get_json(sidecar.url + "/api/v1/status")
    scrape = Scrape(sidecar.metrics_text())
    assert_valid("status", doc)
    compared = 0
    for family in doc["rollups"]:
        name = family["exported"]
        suffix = "_total" if family["type"] == "counter" else "_count" if family["type"] == "histogram" else ""
        on_metrics = {tuple(sorted(s.labels.items())): s.value for s in scrape.find(name + suffix)}
        assert family["series_count"] == len(on_metrics), name  # the series themselves are on /metrics only
        assert family["total"] == pytest.approx(sum(on_metrics.values())), name
        compared += len(on_metrics)
    assert compared > 40  # the full catalog of the pushed replicas, and the proxied ranks' families
    by_family = {f["family"]: f for f in doc["rollups"]}
    # Tokens: the furthest replica of each group (2000 pushed + 10 proxied); bytes: every shard.
    transfers = {t["name"]: t for t in doc["transfers"]}
    assert transfers["load_back"]["tokens"] == 2000 + 10 and transfers["load_back"]["bytes"] == 3000 + 300
    assert transfers["prefetch"]["tokens"] == 2000 and transfers["prefetch"]["bytes"] == 3000
    for transfer in SGLANG_TRANSFERS:
        assert transfers[transfer.name]["tokens"] == by_family[transfer.tokens]["total"]
        assert transfers[transfer.name]["bytes"] == by_family[transfer.bytes]["total"]
    for bw in doc["bandwidth"]["families"]:
        on_metrics = {tuple(sorted(s.labels.items())): s.value for s in scrape.find(bw["exported"])}
        assert {tuple(sorted(s["labels"].items())): s["bytes_per_second"] for s in bw["series"]} == on_metrics
        assert bw["bytes_per_second"] == pytest.approx(bw["bytes_delta"] / bw["seconds_delta"])
        assert transfers[bw["transfer"]]["bytes_per_second"] == bw["bytes_per_second"]
    assert doc["bandwidth"]["families"][0]["bytes_per_second"] == pytest.approx((3000 + 300) / (0.004 * 3 + 0.02))
    for state, count in doc["sidecar"]["streams_by_state"].items():
        assert scrape.value("hicache_exporter_ranks", state=state) == count
    for reason, count in doc["sidecar"]["rejections"].items():
        assert scrape.value("hicache_exporter_rejections_total", reason=reason) == count
    unfulfilled = next(r for r in doc["reasons"] if r["family"] == "storage_prefetch_unfulfilled_tokens_total")
    assert unfulfilled["attempt_level"] and unfulfilled["total"] == 2000
    preset = default_catalog().get("storage_prefetch_unfulfilled_tokens_total").preset["reason"]
    assert [r["reason"] for r in unfulfilled["by_reason"]] == list(preset)  # catalog order, zeros included
    assert {r["reason"]: r["value"] for r in unfulfilled["by_reason"]}["host_capacity"] == 2000
    # The shares' tokens: the rollup of the prefill family, mode by mode, as /metrics shows it.
    prefill = doc["prefill"]
    for kind, count in prefill["counts"].items():
        on_metrics = sum(s.value for s in scrape.find(count["exported"] + "_total", **{count["label"]: count["value"]}))
        assert prefill["since_start"]["tokens"][kind] == on_metrics, kind
    assert prefill["since_start"]["tokens"]["computed"] == 2000  # the pushed replicas' `input`: the furthest one
    assert prefill["since_start"]["computed_ratio"] == 1.0


def test_a_silent_rank_is_stale_in_the_api_and_on_the_page(proxied: tuple[SidecarThread, EngineHTTP]) -> None:
    sidecar, _ = proxied
    raw = RawClient(sidecar.socket_path)
    try:
        raw.send(hello(tp=5, dp=7, epoch="quiet", cache_type="UnifiedRadixCache"))
        raw.recv()
        raw.send(snapshot(1, counter("load_back_bytes_total", 10)))
        identity = 'tp=5 pp=0 dp=7 cache_type="UnifiedRadixCache"'

        def state() -> str | None:
            doc = get_json(sidecar.url + "/api/v1/status")
            return next((r["state"] for r in doc["streams"] if identity_of(doc, r) == identity), None)

        wait_until(lambda: state() == "live")
        wait_until(lambda: state() == "stale", timeout=STALE_AFTER + 5)
        doc = get_json(sidecar.url + "/api/v1/status")
        assert_valid("status", doc)
        rank = next(r for r in doc["streams"] if identity_of(doc, r) == identity)
        assert rank["seconds_since_push"] >= STALE_AFTER and rank["seq"] == 1 and rank["epoch"] == "quiet"
        assert doc["sidecar"]["streams_by_state"]["stale"] >= 1
        assert next(c["state"] for c in doc["ranks"] if c["id"] == rank["rank"]) == "stale"
        assert html.escape(identity) in http_get(sidecar.url + "/")[1].decode()
        assert sidecar.scrape().value("hicache_exporter_rank_up", tp_rank="5", dp_rank="7") == 0
    finally:
        raw.close()


def test_every_response_carries_the_security_headers(sidecar: SidecarThread) -> None:
    for path, content_type in (("/", "text/html; charset=utf-8"), ("/api/v1/status", "application/json; charset=utf-8"),
                               ("/static/status.js", "text/javascript; charset=utf-8"),
                               ("/static/status.css", "text/css; charset=utf-8")):
        status, body, headers = http_get(sidecar.url + path)
        assert status == 200 and headers["Content-Type"] == content_type, path
        policy = headers["Content-Security-Policy"]
        assert policy == app_module.CONTENT_SECURITY_POLICY
        assert "default-src 'none'" in policy and "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert headers["X-Content-Type-Options"] == "nosniff"
        assert body
    for path in ("/static/app.py", "/static/..%2Fapp.py", "/static/", "/static/status.js.map"):
        status, _, headers = http_get(sidecar.url + path)
        assert status == 404 and headers["X-Content-Type-Options"] == "nosniff", path
    page = http_get(sidecar.url + "/")[1].decode()
    assert "<script>" not in page and "style=" not in page and "<style" not in page  # nothing inline the CSP would block
    assert 'src="static/status.js"' in page and 'href="static/status.css"' in page


def test_the_packaged_script_builds_the_dom_without_markup() -> None:
    """No markup of the script's own: it moves the nodes of the server's page (parsed inert, every value
    escaped by page.esc) and writes its own line as text."""
    script = (REPO / "exporter" / "sidecar" / "http" / "static" / "status.js").read_text()
    for forbidden in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(", "new Function"):
        assert forbidden not in script, forbidden
    assert "textContent" in script and "DOMParser" in script and "adoptNode" in script


# --- state level: the harness's fake clocks ---


def view_of(h: Harness, history: BandwidthHistory | None = None) -> StatusView:
    return StatusView(SidecarConfig(), h.state, SidecarHealth(), history=history)


def test_spread_marks_a_diverging_group() -> None:
    h = Harness()
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    _, c = h.hello(tp=0, dp=1)
    _, d = h.hello(tp=1, dp=1)
    h.push(a, tokens(1000))
    h.push(b, tokens(500))  # this replica counts half: a real divergence
    h.push(c, tokens(1000))
    h.push(d, tokens(990))
    doc = doc_of(view_of(h))
    spread = doc["spread"]
    by_dp = {g["id"]: g["dp_rank"] for g in doc["groups"]}
    groups = {by_dp[g["group"]]: g for g in spread["groups"]}
    assert spread["threshold"] == SPREAD_THRESHOLD
    diverging = groups[0]
    assert diverging["diverging"] and diverging["max_ratio"] == pytest.approx(0.5)
    assert diverging["series"] == [{"family": "load_back_tokens_total", "labels": {"pool": "kv"}, "ratio": 0.5}]
    agreeing = groups[1]
    assert not agreeing["diverging"] and agreeing["max_ratio"] == pytest.approx(0.01)
    page = render_page(view_of(h).document())
    assert page.count('<tr class="diverging">') == 1


def test_bandwidth_history_is_bounded_and_sampled_on_its_interval() -> None:
    h = Harness()
    history = BandwidthHistory(["load_back_bytes_total"], interval=5.0, points=3)
    assert history.due(0.0) and not history.due(4.9) and history.due(5.0)
    history.sample(h.state, 1.0)  # nothing moved yet: idle
    _, rank = h.hello()
    h.push(rank, bytes_(4096), hist("load_back_duration_seconds", one_hot("load_back_duration_seconds", 0), 0.002))
    for wall in (2.0, 3.0, 4.0, 5.0):
        history.sample(h.state, wall)
    assert history.history("load_back_bytes_total") == [(3.0, 2048000.0), (4.0, 2048000.0), (5.0, 2048000.0)]
    doc = doc_of(view_of(h, history))
    (load_back, *_) = doc["bandwidth"]["families"]
    assert load_back["history"] == [list(point) for point in history.history("load_back_bytes_total")]
    assert doc["bandwidth"]["history_points"] == 3 and doc["bandwidth"]["history_interval_seconds"] == 5.0
    idle = BandwidthHistory(["load_back_bytes_total"], points=2)
    idle.sample(Harness().state, 1.0)
    assert idle.history("load_back_bytes_total") == [(1.0, None)]
    assert_valid("status", json.loads(view_of(h, history).encode()))


def test_an_empty_sidecar_is_valid_too() -> None:
    doc = json.loads(view_of(Harness()).encode())
    assert_valid("status", doc)
    assert doc["ranks"] == doc["streams"] == doc["servers"] == doc["groups"] == doc["spread"]["groups"] == []
    assert doc["totals"] == {"servers": 0, "ranks": 0, "live_ranks": 0, "streams": 0, "missing": 0}
    assert all(t["tokens"] == 0 and t["bytes_per_second"] is None for t in doc["transfers"])
    assert "No rank has connected yet." in render_page(typed(doc))


class _Page(HTMLParser):
    """The tags a page has, and the rank ids its grid cells carry (attribute values unescaped)."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.tags: set[str] = set()
        self.rank_ids: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.add(tag)
        found = dict(attrs)
        if found.get("data-rank") is not None:
            self.rank_ids.append(found["data-rank"] or "")


PAGE_TAGS = {"html", "head", "meta", "title", "link", "script", "noscript", "body", "header", "h1", "h2", "h3", "p",
             "span", "nav", "a", "main", "section", "div", "table", "caption", "thead", "tbody", "tr", "th", "td",
             "svg", "path", "rect", "meter"}
LABEL_VALUES = st.text(st.characters(exclude_categories=("Cs",)), min_size=1, max_size=128)


@settings(max_examples=60, deadline=None)
@given(value=LABEL_VALUES)
def test_any_label_value_round_trips_through_json_and_is_text_on_the_page(value: str) -> None:
    h = Harness(ranks_config=RanksConfig(max_label_value_length=128))
    _, rank = h.hello(labels={**STATIC, "model": value})
    h.push(rank, tokens(64))
    view = view_of(h)
    doc = json.loads(view.encode())  # valid JSON whatever the value holds
    (row,) = doc["streams"]
    assert rank_labels(doc, row) == {**STATIC, "model": value} and row["own_labels"] == {}
    identity = identity_of(doc, row)
    assert identity.endswith(f'model="{escaped(value)}"') and row["id"] == "g0/tp=0,pp=0"
    (server,) = doc["servers"]
    assert label_set(doc, server["label_set"]) == {"model": value}  # the radix stream's cache_type is its own
    parsed = _Page()
    parsed.feed(render_page(view.document()))
    parsed.close()
    assert parsed.tags <= PAGE_TAGS  # the value made no element of its own
    assert html.escape(identity) in render_page(view.document())  # the value, quoted as in /metrics


def test_status_and_page_are_gzipped_when_accepted(sidecar: SidecarThread) -> None:
    for path in ("/api/v1/status", "/"):
        plain = http_get(sidecar.url + path)
        zipped = http_get(sidecar.url + path, {"Accept-Encoding": "gzip"})
        assert "Content-Encoding" not in plain[2] and zipped[2]["Content-Encoding"] == "gzip", path
        assert zipped[2]["Vary"] == "Accept-Encoding" and zipped[2]["Content-Type"] == plain[2]["Content-Type"]
        body = gzip.decompress(zipped[1])
        assert json.loads(body)["api_version"] == 1 if path != "/" else body.startswith(b"<!doctype html>")


# --- servers, ranks and streams; the ranks that should be there but are not ---

GAP_LABELS = {"cache_type": "UnifiedRadixCache"}
STORAGE_LABELS = {"storage_backend": "file", "pp_size": "2", "attn_cp_size": "1"}
SCHEDULER_LABELS = {"model_name": "m", "engine_type": "unified"}


def world_client(socket_path: str, tp: int, pp: int, dp: int, world: dict[str, int] | None,
                 labels: dict[str, str] = GAP_LABELS, cp: int | None = None) -> RankClient:
    """A stream that says hello with `world` and pushes one counter."""
    rank = {"tp_rank": tp, "pp_rank": pp, "dp_rank": dp, **({} if cp is None else {"attn_cp_rank": cp})}
    client = RankClient(socket_path, rank=rank, labels=labels, interval=0.1, world=world, preset=False)
    client.counter("load_back_tokens_total", pool="kv").inc(64)
    return client.start()


def cell(doc: dict[str, Any], dp: int, pp: int, tp: int, cp: int = 0, server: str = "v0") -> dict[str, Any]:
    return next(c for c in doc["ranks"] if c["id"] == f"{server}/dp={dp},pp={pp},cp={cp},tp={tp}")


DEMO_WORLD = {"tp_size": 4, "pp_size": 2, "dp_size": 2, "attn_tp_size": 2}  # tp2 (attention) pp2 dp2 under DP attention


def demo_streams(socket_path: str, left_out: tuple[int, int, int] | None = None) -> list[RankClient]:
    """The demo's server: per rank (dp, pp, attention tp) a radix and a storage stream, and a scheduler stream
    at the global tp rank on attention tp 0, each with the server's world; `left_out` never starts."""
    clients = []
    for dp in range(2):
        for pp in range(2):
            for tp in range(2):
                if (dp, pp, tp) == left_out:
                    continue
                clients.append(world_client(socket_path, tp, pp, dp, DEMO_WORLD))
                clients.append(world_client(socket_path, tp, pp, dp, DEMO_WORLD, labels=STORAGE_LABELS, cp=0))
                if tp == 0:
                    clients.append(world_client(socket_path, 2 * dp, pp, dp, DEMO_WORLD,
                                                labels={**SCHEDULER_LABELS, "moe_ep_rank": str(2 * dp)}))
    return clients


def test_the_demos_server_is_eight_ranks_of_twenty_streams_and_a_rank_that_never_started_is_missing(
        sidecar: SidecarThread) -> None:
    clients = demo_streams(sidecar.socket_path, left_out=(1, 0, 1))
    try:
        wait_until(lambda: sum(r["snapshots"] > 0 for r in get_json(sidecar.url + "/api/v1/status")["streams"]) == 18)
        doc = get_json(sidecar.url + "/api/v1/status")
        assert_valid("status", doc)
        assert doc["totals"] == {"servers": 1, "ranks": 7, "live_ranks": 7, "streams": 18, "missing": 1}
        (server,) = doc["servers"]
        assert label_set(doc, server["label_set"]) == {} and not server["world_conflict"]
        assert server["expected"] == {**DEMO_WORLD, "attn_cp_size": 1}
        assert [(g["dp_rank"], g["ranks"], g["missing"], g["expected"]) for g in server["dp_groups"]] == [
            (0, 4, 0, True), (1, 3, 1, True)]
        missing = cell(doc, 1, 0, 1)
        assert missing["state"] == "missing" and missing["streams"] == [] and missing["expected"]
        # Every stream of a rank is listed in its one cell: the scheduler's global tp 2 is dp 1's attention tp 0.
        kinds = {s["id"]: s["kind"] for s in doc["streams"]}
        assert sorted(kinds[i] for i in cell(doc, 1, 1, 0)["streams"]) == ["radix", "scheduler", "storage"]
        assert sorted(kinds[i] for i in cell(doc, 1, 1, 1)["streams"]) == ["radix", "storage"]
        assert {s["rank"] for s in doc["streams"] if s["kind"] == "scheduler" and s["tp_rank"] == 2} == {
            "v0/dp=1,pp=0,cp=0,tp=0", "v0/dp=1,pp=1,cp=0,tp=0"}
        scrape = sidecar.scrape()
        assert scrape.value("hicache_exporter_ranks_missing", dp_rank="1") == 1
        assert scrape.value("hicache_exporter_ranks_missing", dp_rank="0") == 0
        # The rank starts after all: its cell holds its streams, nothing is missing any more.
        clients += [world_client(sidecar.socket_path, 1, 0, 1, DEMO_WORLD),
                    world_client(sidecar.socket_path, 1, 0, 1, DEMO_WORLD, labels=STORAGE_LABELS, cp=0)]
        wait_until(lambda: get_json(sidecar.url + "/api/v1/status")["totals"]["streams"] == 20
                   and get_json(sidecar.url + "/api/v1/status")["totals"]["missing"] == 0)
        doc = get_json(sidecar.url + "/api/v1/status")
        assert_valid("status", doc)
        assert doc["totals"] == {"servers": 1, "ranks": 8, "live_ranks": 8, "streams": 20, "missing": 0}
        assert len(doc["ranks"]) == 8 and cell(doc, 1, 0, 1)["state"] == "live"
        assert sidecar.scrape().value("hicache_exporter_ranks_missing", dp_rank="1") == 0
    finally:
        for client in clients:
            client.close()


def world_hello(h: Harness, tp: int, world: World | None, pp: int = 0, dp: int = 0, cp: int | None = None,
                labels: dict[str, str] = STATIC) -> tuple[object, Any]:
    """A hello with `world` on a fresh connection token; (connection, rank)."""
    conn = object()
    msg = Hello(protocol=1, epoch=f"e-{tp}-{pp}-{dp}-{cp}-{len(labels)}", pid=1, labels=dict(labels), world=world,
                rank=RankId(tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_cp_rank=cp))
    return conn, h.state.hello(conn, msg).rank


def test_a_dp_group_with_no_stream_is_all_missing_and_a_server_without_a_world_expects_nothing() -> None:
    h = Harness()
    world = World(tp_size=1, pp_size=2, dp_size=4)
    for dp in (0, 1, 3):
        for pp in range(2):
            world_hello(h, 0, world, pp=pp, dp=dp)
    world_hello(h, 0, None, labels={"cache_type": "HiRadixCache", "model": "other"})  # no world: nothing expected
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    with_world, without = sorted(doc["servers"], key=lambda v: v["expected"] is None)
    assert [(g["dp_rank"], g["ranks"], g["missing"]) for g in with_world["dp_groups"]] == [
        (0, 2, 0), (1, 2, 0), (2, 0, 2), (3, 2, 0)]
    assert [cell(doc, 2, pp, 0, server=with_world["id"])["state"] for pp in range(2)] == ["missing", "missing"]
    assert without["expected"] is None and without["missing"] == 0 and not without["world_conflict"]
    assert [g["expected"] for g in without["dp_groups"]] == [False]
    assert doc["totals"]["missing"] == 2 and doc["totals"]["servers"] == 2


def test_streams_that_disagree_on_the_world_expect_nothing_and_list_the_worlds() -> None:
    h = Harness()
    world_hello(h, 0, World(tp_size=2, pp_size=1, dp_size=1))
    world_hello(h, 1, World(tp_size=4, pp_size=1, dp_size=1))
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    (server,) = doc["servers"]
    assert server["world_conflict"] and not server["world_implausible"] and server["expected"] is None
    assert [v1.world_name(msgspec.convert(w, v1.WorldSizes)) for w in server["worlds"]] == [
        "dp 1 × pp 1 × tp 2", "dp 1 × pp 1 × tp 4"]
    assert server["missing"] == 0 and all(not c["expected"] for c in doc["ranks"])


def test_a_position_is_missing_only_when_no_stream_holds_it_and_cp_ranks_are_positions() -> None:
    h = Harness()
    world = World(tp_size=3, pp_size=1, dp_size=1, attn_cp_size=2)
    for tp, cp in ((0, 0), (0, 1), (1, 0)):
        world_hello(h, tp, world, cp=cp)
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    (server,) = doc["servers"]
    assert server["missing"] == 3  # (cp 1, tp 1), (cp 0, tp 2), (cp 1, tp 2)
    assert {c["id"] for c in doc["ranks"] if c["state"] == "missing"} == {
        "v0/dp=0,pp=0,cp=1,tp=1", "v0/dp=0,pp=0,cp=0,tp=2", "v0/dp=0,pp=0,cp=1,tp=2"}
    (group,) = server["dp_groups"]
    assert group["grid"]["rows"] == [{"pp_rank": 0, "attn_cp_rank": 0}, {"pp_rank": 0, "attn_cp_rank": 1}]
    assert group["grid"]["tp_ranks"] == [0, 1, 2]


def test_an_expired_stream_leaves_its_position_missing() -> None:
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=1.0, expire_after_seconds=2.0))
    world = World(tp_size=2, pp_size=1, dp_size=1)
    _, kept = world_hello(h, 0, world)
    conn, gone = world_hello(h, 1, world)
    h.state.disconnect(conn, gone)
    h.push(kept, tokens(64))
    assert cell(doc_of(view_of(h)), 0, 0, 1)["state"] == "departed"
    h.clock.advance(3.0)
    h.push(kept, tokens(64))
    doc = doc_of(view_of(h))
    expired = cell(doc, 0, 0, 1)
    assert expired["state"] == "missing" and len(expired["streams"]) == 1  # still known, listed, and missing
    assert doc["servers"][0]["missing"] == 1


def test_a_world_at_the_protocol_bounds_is_a_conflict_and_expects_nothing() -> None:
    """65,536 x 65,536 x 65,536 is within the protocol's bounds and more than any sidecar keeps identities
    for: its missing count (2**48) would only measure the claim; it is a world conflict (world_implausible)."""
    h = Harness(ranks_config=RanksConfig(max_ranks=64))
    most = 1 << 16  # the protocol's largest world size
    world_hello(h, 5, World(tp_size=most, pp_size=most, dp_size=most), dp=3)
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    (server,) = doc["servers"]
    assert server["world_conflict"] and server["world_implausible"] and server["expected"] is None
    assert server["missing"] == 0 and doc["totals"]["missing"] == 0 and len(doc["ranks"]) == 1


def test_worlds_count_exactly_while_they_fit_what_the_sidecar_can_hold() -> None:
    """Three servers, each a world of 8 x 8 = ranks.max_ranks positions with one stream: the first one's
    63 missing are counted exactly and drawn; the others' worlds would take the sidecar past the identities
    it keeps, so they are implausible and expect nothing."""
    h = Harness(ranks_config=RanksConfig(max_ranks=64))
    for n in range(3):
        world_hello(h, 5, World(tp_size=8, pp_size=8, dp_size=1), labels={"cache_type": "c", "model": f"m{n}"})
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    assert [(v["missing"], v["world_implausible"]) for v in doc["servers"]] == [(63, False), (0, True), (0, True)]
    assert doc["totals"]["missing"] == 63 and len(doc["ranks"]) == 64 + 2


def test_the_scheduler_global_tp_rank_maps_through_the_world_with_context_parallel() -> None:
    """tp_size 8 = dp 2 x cp 2 x attention tp 2 (sglang's layout: attention tp fastest, then cp, then dp):
    global tp 6 is dp 1, cp 1, attention tp 0."""
    h = Harness()
    world = World(tp_size=8, pp_size=1, dp_size=2, attn_tp_size=2, attn_cp_size=2)
    world_hello(h, 0, world, dp=1, cp=1)
    world_hello(h, 6, world, dp=1, labels={**SCHEDULER_LABELS, "moe_ep_rank": "6"})
    doc = doc_of(view_of(h))
    cells = {c["id"]: c for c in doc["ranks"] if c["streams"]}
    assert list(cells) == ["v0/dp=1,pp=0,cp=1,tp=0"] and len(cells["v0/dp=1,pp=0,cp=1,tp=0"]["streams"]) == 2
    assert doc["totals"] == {"servers": 1, "ranks": 1, "live_ranks": 1, "streams": 2, "missing": 7}


def test_two_servers_behind_one_sidecar_get_two_servers() -> None:
    h = Harness()
    world = World(tp_size=1, pp_size=1, dp_size=1)
    for model in ("a", "b"):
        world_hello(h, 0, world, labels={"cache_type": "UnifiedRadixCache", "model": model})
        world_hello(h, 0, world, labels={"storage_backend": "file", "model": model})
    doc = doc_of(view_of(h))
    assert [label_set(doc, v["label_set"]) for v in doc["servers"]] == [{"model": "a"}, {"model": "b"}]
    assert [v["ranks"] for v in doc["servers"]] == [1, 1] and doc["totals"]["streams"] == 4


def test_a_node_expects_only_its_share_of_a_multi_node_server() -> None:
    """tp 8 over 2 nodes (sglang engine.py placement): node 1 holds global tp 4-7, here dp 1 (DP attention,
    dp 2 x attention tp 4); a rank of node 0 is not counted missing on node 1."""
    h = Harness(ranks_config=RanksConfig(nodes=2, node_rank=1))
    world = World(tp_size=8, pp_size=1, dp_size=2, attn_tp_size=4)
    world_hello(h, 0, world, dp=1)
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    (server,) = doc["servers"]
    assert server["node"] == {"node_rank": 1, "nodes": 2, "tp_ranks": [4, 8], "pp_ranks": [0, 1]}
    assert [(g["dp_rank"], g["missing"]) for g in server["dp_groups"]] == [(1, 3)]
    assert server["missing"] == 3


# --- bounds, ids, non-finite bandwidth (review findings) ---

ESCAPED = "\x01"  # JSON writes it as \u0001: six bytes for one character, the dearest a label value can be


def escape_heavy(prefix: str, length: int = 128) -> str:
    return prefix + ESCAPED * (length - len(prefix))


def test_hostile_labels_filling_the_series_limit_keep_the_document_small() -> None:
    """3 ranks x 4096 series of a reason family, every label value 128 characters of \\x01, fill the
    series limit; the document was 98 MB, now its listings are bounded and it stays under 1 MB (0.14 MB
    measured) while its counts and sums stay exact. They filled the default limit (24,576) before the
    budget weighed labels; each now weighs 6 and its rollup 3 (keys.series_cost: 1,382 characters on its
    line and its group's spread line, 1,346 on the rollup's), so the limits are raised to hold them all."""
    h = Harness(ranks_config=RanksConfig(max_series_total=3 * 4096 * (6 + 3), max_series_per_rank=4096 * 6))
    for tp in range(3):
        _, rank = h.hello(tp=tp, labels={f"l{i}": escape_heavy(str(tp)) for i in range(8)})
        for chunk in range(0, 4096, 512):
            h.push(rank, *(dropped(1.5, reason=escape_heavy(f"{i:06d}"), pool=ESCAPED * 128)
                           for i in range(chunk, chunk + 512)))
    budget = h.state.registry.budget
    assert budget.per_rank + budget.rollup == 3 * 4096 * (6 + 3) == h.state.config.max_series_total  # the limit is full
    body = view_of(h).encode()
    assert len(body) < 1_000_000, len(body)
    doc = json.loads(body)
    assert_valid("status", doc)
    dropped_family = next(r for r in doc["reasons"] if r["family"] == "hicache_dropped_tokens_total")
    preset = default_catalog().get("hicache_dropped_tokens_total").preset.get("reason", ())
    assert len(dropped_family["by_reason"]) == len(preset) + api.REASONS_LISTED
    assert dropped_family["other_reasons"] == 4096 - api.REASONS_LISTED
    assert dropped_family["total"] == 3 * 4096 * 1.5
    assert dropped_family["other_value"] == 3 * (4096 - api.REASONS_LISTED) * 1.5
    rollup = next(r for r in doc["rollups"] if r["family"] == "hicache_dropped_tokens_total")
    assert rollup["series_count"] == 3 * 4096 and rollup["total"] == 3 * 4096 * 1.5 and "series" not in rollup


STATUS_WORST_CASE_BYTES = 7_500_000  # docs/reliability.md's budget counts the document at this size (6.74 MB measured)


def test_the_worst_case_document_fits_the_memory_budget() -> None:
    """The document's worst case is ranks, not series: ranks.max_ranks = 1,024 ranks, each a group
    of its own, with 8 static labels of 128 x \\x01 (the defaults' most, six bytes each in JSON).
    Each label set is written once (`label_sets`), everything else names it by id: 6.74 MB, where
    quoting the labels in every rank id, rank, group id, group and member list made 37.7 MB."""
    h = Harness()
    ranks = h.state.config.max_ranks
    for n in range(ranks):
        h.hello(tp=0, labels={f"l{i}": escape_heavy(f"{n:04d}") for i in range(8)})
    body = view_of(h).encode()
    assert len(body) < STATUS_WORST_CASE_BYTES, len(body)
    doc = json.loads(body)
    assert len(doc["streams"]) == len(doc["groups"]) == len(doc["label_sets"]) == len(doc["servers"]) == ranks
    assert len(doc["ranks"]) == ranks
    assert body.count(b"\\u0001" * 124) == 8 * ranks  # every label value once


def test_viewers_share_one_encoded_document_until_a_tick_or_a_frame() -> None:
    h = Harness()
    stats = SidecarHealth()
    encoded = api.EncodedStatus(StatusView(SidecarConfig(), h.state, stats))
    first = encoded.body(gzipped=False)
    assert encoded.body(gzipped=False) is first  # a second viewer within the tick: the same bytes
    assert gzip.decompress(encoded.body(gzipped=True)) == first
    assert encoded.body(gzipped=True) is encoded.body(gzipped=True)
    stats.frames_received += 1  # a hello or a snapshot arrived: rebuilt at once
    _, rank = h.hello()
    second = encoded.body(gzipped=False)
    assert second is not first and len(json.loads(second)["streams"]) == 1
    h.clock.advance(api.ENCODED_MAX_AGE_SECONDS)  # a tick later: rebuilt even without a frame
    assert encoded.body(gzipped=False) is not second


def test_spread_lists_the_widest_series_and_counts_them_all() -> None:
    h = Harness()
    _, a = h.hello(tp=0)
    _, b = h.hello(tp=1)
    pools = [f"p{i}" for i in range(12)]
    h.push(a, *(tokens(1000, pool=p) for p in pools))
    h.push(b, *(tokens(1000 - 10 * (i + 1), pool=p) for i, p in enumerate(pools)))
    (group,) = doc_of(view_of(h))["spread"]["groups"]
    assert group["series_count"] == 12 and len(group["series"]) == api.SPREAD_SERIES_LISTED
    assert [s["labels"]["pool"] for s in group["series"]] == ["p11", "p10", "p9", "p8", "p7"]


def test_an_overflowing_bandwidth_is_null_in_the_api_and_never_inf_or_nan_on_the_page() -> None:
    """2**62 bytes over a duration sum of 1e-300 s divide to +Inf: msgspec wrote it as null inside
    series (which the schema forbids) and the page said "inf GB/s" and drew `M120.0 nan`."""
    h = Harness()
    history = BandwidthHistory(["load_back_bytes_total"], points=3)
    _, rank = h.hello()
    h.push(rank, bytes_(2.0**62), hist("load_back_duration_seconds", one_hot("load_back_duration_seconds", 0), 1e-300))
    history.sample(h.state, 1.0)
    view = view_of(h, history)
    doc = json.loads(view.encode())
    assert_valid("status", doc)
    (load_back, *_) = doc["bandwidth"]["families"]
    assert load_back["bytes_per_second"] is None and load_back["series"] == [] and load_back["series_count"] == 0
    assert load_back["bytes_delta"] == 2.0**62 and load_back["seconds_delta"] == 1e-300  # what it saw, still shown
    assert load_back["history"] == [[1.0, None]]
    assert next(t for t in doc["transfers"] if t["name"] == "load_back")["bytes_per_second"] is None
    page = render_page(view.document())
    assert "inf GB/s" not in page and " nan" not in page
    assert h.state.window.bandwidths(h.state.exposed_ranks(), window_increases(h.state)[1])  # /metrics keeps +Inf
    inf, nan = float("inf"), float("nan")
    assert sparkline_path([[0, 1.0], [1, inf], [2, nan], [3, 2.0]], 4) == "M0.0 12.0 M120.0 1.0"


def test_a_stream_without_a_cp_axis_is_cp_rank_0() -> None:
    h = Harness()
    world = World(tp_size=2, pp_size=1, dp_size=1, attn_cp_size=2)
    world_hello(h, 0, world)  # no cp axis: the radix collector's labels carry none
    world_hello(h, 0, world, cp=0, labels={"storage_backend": "file"})
    world_hello(h, 1, world, cp=1)
    doc = doc_of(view_of(h))
    assert len(cell(doc, 0, 0, 0)["streams"]) == 2 and len(cell(doc, 0, 0, 1, cp=1)["streams"]) == 1
    assert doc["servers"][0]["missing"] == 2


def test_distinct_label_sets_that_read_alike_unquoted_get_distinct_ids() -> None:
    h = Harness()
    h.hello(labels={"a": "1 b=2"})
    h.hello(labels={"a": "1", "b": "2"})
    doc = doc_of(view_of(h))
    assert len({r["id"] for r in doc["streams"]}) == 2 and len({g["id"] for g in doc["groups"]}) == 2


# Few names and characters that a quoting scheme must get right, so that near misses come up often.
LABEL_NAMES = st.sampled_from(["a", "b", "cp", "a_b"])
ID_LABEL_VALUES = st.text(alphabet='ab12 ="\\\n', min_size=1, max_size=6)
IDENTITIES = st.tuples(st.integers(0, 2), st.integers(0, 2), st.integers(0, 2), st.none() | st.integers(0, 2),
                       st.dictionaries(LABEL_NAMES, ID_LABEL_VALUES, max_size=3))


def parse_id(text: str) -> tuple[Any, ...]:
    """An id read back: its axes and its static labels, undoing the quoting; a reader needs nothing
    else, which is what makes two identities' ids differ."""
    axes: dict[str, int] = {}
    labels: list[tuple[str, str]] = []
    at = 0
    while at < len(text):
        name, _, rest = text[at:].partition("=")
        at += len(name) + 1
        if not rest.startswith('"'):
            value, _, _ = rest.partition(" ")
            axes[name] = int(value)
            at += len(value) + 1
            continue
        at += 1
        chars = []
        while text[at] != '"':
            if text[at] == "\\":
                at += 1
                chars.append({"n": "\n"}.get(text[at], text[at]))
            else:
                chars.append(text[at])
            at += 1
        labels.append((name, "".join(chars)))
        at += 2  # the closing quote and the space
    return axes["tp"], axes["pp"], axes["dp"], axes.get("cp"), tuple(labels)


@settings(max_examples=300, deadline=None)
@given(identity=IDENTITIES)
def test_an_id_reads_back_as_its_identity(identity: tuple[Any, ...]) -> None:
    """Ids are injective: each one parses back to the axes and static labels it was made of, so two
    identities never share one (`a="1 b=2"` against `a="1" b="2"`), and no more do two groups."""
    tp, pp, dp, cp, labels = identity
    static = tuple(sorted(labels.items()))
    assert parse_id(identity_text(tp, pp, dp, cp, static)) == (tp, pp, dp, cp, static)


def test_the_state_file_line_says_where_how_often_what_was_taken_back_and_what_failed() -> None:
    persistence = v1.Persistence(
        file="/var/lib/hicache-exporter/state", interval_seconds=5.0, loaded_identities=8, load_duration_seconds=0.02,
        load_failures={}, dropped_series={}, writes=1234, last_write_time=1_764_400_000.0,
        last_write_duration_seconds=0.01, write_failures={"no_space": 2, "io": 1}, file_bytes=30_000)
    assert page.state_file(None) == "not kept (--persistence.file)"
    assert page.state_file(persistence) == ("/var/lib/hicache-exporter/state: 1,234 writes, every 5.0 s; "
                                            "8 rank identities taken back at start; 3 writes failed")
    assert page.state_file(msgspec.structs.replace(persistence, write_failures={})).endswith("taken back at start")


def test_a_second_profile_is_served_under_its_own_namespace_and_worker_id_splits_no_replica_group(
        socket_dir: Path) -> None:
    """Two replicas (dp 0, 1) of an LMCache engine with two workers each push as the lmcache profile names them:
    a replicated family's rollup is one worker per replica summed over replicas, a per-shard one every worker's,
    under `lmcache_`, and the document lists both profiles."""
    config = config_from_data({
        "http": {"host": "127.0.0.1", "port": 0}, "ingest": {"socket_path": str(socket_dir / "m.sock")},
        "metrics": {"profiles": ["lmcache"]},
    }, "test")
    lmcache = load_profile("lmcache")
    sidecar = SidecarThread(config).start()
    clients = []
    try:
        for dp, hits in ((0, 700), (1, 40)):
            for worker in (0, 1):
                client = RankClient(sidecar.socket_path, rank={"tp_rank": worker, "pp_rank": 0, "dp_rank": dp},
                                    labels={"model_name": "m", "served_model_name": "s", "role": "worker",
                                            "worker_id": str(worker)}, interval=0.1, catalog=lmcache)
                client.counter("num_hit_tokens_total").inc(hits)
                client.counter("num_remote_read_bytes_total").inc(1000 * (2 * dp + worker + 1))
                clients.append(client.start())

        def rollups() -> dict[str, Any]:
            return {r["family"]: r for r in get_json(sidecar.url + "/api/v1/status")["rollups"]}

        wait_until(lambda: rollups().get("num_remote_read_bytes_total", {}).get("total") == 10_000)
        doc = get_json(sidecar.url + "/api/v1/status")
        assert_valid("status", doc)
        by_family = {r["family"]: r for r in doc["rollups"]}
        hit = by_family["num_hit_tokens_total"]
        assert (hit["exported"], hit["semantics"], hit["total"], hit["series_count"]) == (
            "lmcache_rollup_num_hit_tokens", "replicated", 740, 1)
        assert by_family["num_remote_read_bytes_total"]["exported"] == "lmcache_rollup_num_remote_read_bytes"
        assert doc["sidecar"]["profiles"] == [{"name": "sglang", "namespace": "sglang_", "families": 32},
                                              {"name": "lmcache", "namespace": "lmcache_", "families": 94}]
        assert len(doc["groups"]) == 2  # one per replica: worker_id is left out of a replica group
        transfers = {t["name"]: t for t in doc["transfers"] if t["profile"] == "lmcache"}  # the profile's own
        assert transfers["retrieve"]["tokens"] == 740 and transfers["remote_read"]["bytes"] == 10_000
    finally:
        for client in clients:
            client.close()
        sidecar.stop()


def test_an_lmcache_sidecar_shows_its_tier_transfers_in_the_api_the_page_and_top() -> None:
    """The transfers are the profiles' own (exporter/defaults/lmcache.yaml), not a table of SGLang names: two
    workers of one LMCache engine retrieve, store and read and write their remote backend, and the document,
    the page and `top` list LMCache's transfers beside SGLang's, each with its totals."""
    catalog = load_profiles(None, ["lmcache"])
    lmcache = catalog.of_profile("lmcache")
    h = Harness(catalog=catalog)
    labels = {"model_name": "m", "served_model_name": "s", "role": "worker"}
    retrieve_bounds = lmcache.get("time_to_retrieve").buckets
    assert retrieve_bounds is not None
    for worker in (0, 1):
        _, rank = h.hello(tp=worker, labels={**labels, "worker_id": str(worker)})
        h.push(rank, ScalarSample(family="num_hit_tokens_total", labels={}, value=640),
               ScalarSample(family="num_stored_tokens_total", labels={}, value=256),
               ScalarSample(family="num_remote_read_bytes_total", labels={}, value=4096 * (worker + 1)),
               ScalarSample(family="num_remote_write_bytes_total", labels={}, value=1024),
               hist("time_to_retrieve", one_hot("time_to_retrieve", 2, finite=retrieve_bounds), 0.25,
                    finite=retrieve_bounds))
    doc = doc_of(view_of(h))
    assert_valid("status", doc)
    shown = {t["name"]: t for t in doc["transfers"] if t["profile"] == "lmcache"}
    assert list(shown) == ["retrieve", "store", "remote_read", "remote_write"]
    assert (shown["retrieve"]["from"], shown["retrieve"]["to"]) == ("L2", "L1")
    assert shown["retrieve"]["tokens"] == 640  # replicated: one worker of the engine, not the sum
    assert shown["retrieve"]["seconds_family"] == "time_to_retrieve" and shown["retrieve"]["seconds"] == 0.5
    assert shown["retrieve"]["bytes_family"] is None and shown["retrieve"]["bytes"] is None
    assert shown["remote_read"]["bytes"] == 4096 * 3  # per shard: every worker's
    assert (shown["remote_write"]["from"], shown["remote_write"]["to"], shown["remote_write"]["tokens"]) == (
        "L2", "L3", None)
    assert [t["name"] for t in doc["transfers"] if t["profile"] == "sglang"] == [t.name for t in SGLANG_TRANSFERS]
    # The page: a row per transfer, LMCache's named with their profile.
    body = render_page(typed(doc))
    totals = body[body.index('id="totals-body"'):body.index('id="bandwidth"')]
    assert "<tr><td>lmcache retrieve</td><td>L2 → L1</td><td>640</td><td>–</td><td>idle</td></tr>" in totals
    assert "<tr><td>lmcache remote_read</td><td>L3 → L2</td><td>–</td><td>12.0 KiB</td><td>idle</td></tr>" in totals
    # top: the same rows in its Transfers section.
    out = Console(file=io.StringIO(), width=160, record=True)
    out.print(*transfers_section(typed(doc)))
    text = out.export_text()
    assert re.search(r"lmcache retrieve\s+L2→L1\s+640\s+–", text), text
    assert re.search(r"lmcache remote_write\s+L2→L3\s+–\s+2\.0 KiB", text), text
