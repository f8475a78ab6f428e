"""`hicache-exporter top` without a terminal: rendering schema-valid status documents, fetching over
real HTTP (refused, silent, 401, not JSON, a real sidecar with basic auth) and the command's flags.

The documents are built here from a rank layout and validated against docs/api/v1.schema.json
before they are rendered, so a test can only pass on a document the sidecar may really send; top
reads them as it reads a poll's body, decoded into the model (exporter.top.fetch.received).
The pseudo-terminal test against a live sidecar is tests/exporter/test_top_pty.py.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import gzip
import io
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import bcrypt
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator
from rich.cells import cell_len
from rich.console import Console, RenderableType

from exporter.api.v1 import StatusDocument
from exporter.api.view import GRID_CELLS, GRID_CELLS_PER_GROUP
from exporter.catalog import default_catalog
from exporter.errors import ErrorCode, HicacheExporterError
from exporter.sidecar.core.servers import Cell, Layout, NodeShare
from exporter.sidecar.expose.status import grid_model
from exporter.top.fetch import (
    ENV_PASSWORD,
    MAX_DOCUMENT_BYTES,
    FailureKind,
    Fetched,
    FetchFailed,
    Target,
    build_target,
    fetch_status,
    received,
)
from exporter.top.render import (
    BLOCKS,
    MISSING_STYLE,
    STATE_STYLE,
    Names,
    group_block,
    integer,
    render_frame,
    sparkline,
)
from exporter.top.screen import Frame, Scroll
from exporter.top.view import View
from tests.helpers import SidecarThread, free_port, self_signed_cert, sidecar_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "docs" / "api" / "v1.schema.json"
CLI = [sys.executable, "-m", "exporter.cli"]
NOW = 1_764_400_000.0
SERVER: dict[str, str] = {}  # the labels of the one server, as under `make demo`: every label is a stream's own
SINCE_PUSH = {"live": 0.4, "stale": 14.0, "departed": 31.0, "expired": 420.0}
GiB = 1024 ** 3


def validate_status(document: Mapping[str, Any]) -> None:
    """Fail unless `document` is a valid body of GET /api/v1/status."""
    schema = json.loads(SCHEMA.read_text())
    Draft202012Validator({"$defs": schema["$defs"], "$ref": "#/$defs/status"}).validate(document)


def _static(labels: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(labels.items()))


def kind_labels(kind: str, pp: int) -> dict[str, str]:
    """The static labels a stream's collector adds (the catalog's `streams` table); a client adds none."""
    return {"radix": {"cache_type": "UnifiedRadixCache"},
            "storage": {"storage_backend": "file", "pp_size": str(pp), "attn_cp_size": "1"},
            "scheduler": {"model_name": "m", "engine_type": "unified"}, "client": {}}[kind]


def world_sizes(tp: int, pp: int, dp: int, global_tp: bool) -> dict[str, int]:
    """dp groups of pp x tp ranks; with `global_tp` under DP attention (the engine's tp spans the dp groups)."""
    return {"tp_size": tp * dp if global_tp else tp, "pp_size": pp, "dp_size": dp, "attn_tp_size": tp,
            "attn_cp_size": 1}


def status_document(
    dp: int = 2, pp: int = 2, tp: int = 2, states: Mapping[tuple[Any, ...], str] | None = None,
    labels: Mapping[str, str] = SERVER, kinds: Sequence[str] = ("radix",), diverging: Mapping[int, float] | None = None,
    unfulfilled: Mapping[str, float] | None = None, rejections: Mapping[str, int] | None = None,
    upstreams: list[dict[str, Any]] | None = None, history: int = 40,
    world: bool = False, missing: Iterable[tuple[int, int, int]] = (), absent_groups: Iterable[int] = (),
    conflict: bool = False, implausible: bool = False, node: tuple[int, int] | None = None,
    servers: Sequence[Mapping[str, str]] | None = None,
) -> dict[str, Any]:
    """A schema-valid status of servers of dp × pp × tp ranks, each rank reporting through one stream per kind.

    A radix, storage or client stream reports for its rank; a scheduler stream only on attention tp 0,
    labelled with the global tp rank (dp × tp) and its moe_ep_rank, as SGLang's scheduler under DP
    attention is (a world is then needed to place it).
    """
    # states: by (dp, pp, tp) for every stream of a rank, or (dp, pp, tp, kind) for one; live otherwise.
    # world: every stream said hello with its server's world; missing: (dp, pp, tp) of ranks no stream
    # reports for; absent_groups: dp groups no stream reports for; conflict: the last stream said another
    # tp size; implausible: every stream said a world of more positions than ranks.max_ranks; node:
    # (node_rank, nodes), the share of the world this sidecar expects; servers: each server's labels
    # (default: one, `labels`); diverging: a spread ratio by dp group; unfulfilled: tokens by reason;
    # history: bandwidth points.
    states = dict(states or {})
    missing, absent = set(missing), set(absent_groups)
    server_labels = sorted((dict(s) for s in (servers or [labels])), key=_static)
    sizes = world_sizes(tp, pp, dp, "scheduler" in kinds)
    said = sizes if world or missing or absent or conflict or node else None
    if implausible:
        said = world_sizes(64, 64, 1, False)  # 4,096 positions, more than the 1,024 this sidecar keeps
    layout = Layout(**sizes) if said == sizes and not conflict else None
    share = NodeShare.of(layout, *node) if node is not None and layout is not None else None

    def static(n: int, kind: str) -> tuple[tuple[str, str], ...]:
        return _static({**server_labels[n], **kind_labels(kind, pp)})

    # The streams: (server, kind, dp, pp, tp as labelled, attention tp, cp, own labels, state).
    made: list[tuple[int, str, int, int, int, int, int | None, dict[str, str], str]] = []
    for n in range(len(server_labels)):
        for d, p, t in itertools.product(range(dp), range(pp), range(tp)):
            if d in absent or (d, p, t) in missing or (
                    share is not None and layout is not None and not share.holds(layout, (d, p, 0, t))):
                continue  # no stream reports for it (and another node's sidecar sees those of its own)
            for kind in kinds:
                if kind == "scheduler" and t:
                    continue
                labelled = d * tp if kind == "scheduler" else t
                own = {"moe_ep_rank": str(labelled)} if kind == "scheduler" else {}
                state = states.get((d, p, t, kind), states.get((d, p, t), "live"))
                made.append((n, kind, d, p, labelled, t, 0 if kind == "storage" else None, own, state))
    label_set_of = {key: f"s{i}" for i, key in enumerate(sorted(
        {_static(s) for s in server_labels} | {static(n, kind) for n, kind, *_ in made}))}
    group_of = {key: f"g{i}" for i, key in enumerate(sorted({(static(n, kind), d) for n, kind, d, *_ in made}))}
    streams: list[dict[str, Any]] = []
    cells_of: dict[tuple[int, int, int, int], list[str]] = {}  # (server, dp, pp, tp): its streams' ids
    for i, (n, kind, d, p, labelled, t, cp, own, state) in enumerate(made):
        group = group_of[(static(n, kind), d)]
        since = SINCE_PUSH[state]
        stream_id = (f"{group}/tp={labelled},pp={p}" + ("" if cp is None else f",cp={cp}")
                     + "".join(f' {k}="{v}"' for k, v in own.items()))
        cells_of.setdefault((n, d, p, t), []).append(stream_id)
        streams.append({
            "id": stream_id, "group": group, "server": f"v{n}", "rank": f"v{n}/dp={d},pp={p},cp=0,tp={t}",
            "kind": kind, "tp_rank": labelled, "pp_rank": p, "dp_rank": d, "attn_cp_rank": cp, "own_labels": own,
            "state": state, "source": "push", "seconds_since_push": since,
            "epoch": f"{d:02x}{p:02x}{t:02x}{i:04x}" + "0" * 22, "pid": 4000 + i, "seq": 90, "restarts": 0,
            "reconnects": 0, "snapshots": 90, "series": 40, "seconds_since_activity": since,
            "last_push_time": NOW - since,
            "world": {**sizes, "tp_size": sizes["tp_size"] + 1} if conflict and i == len(made) - 1 else said,
        })
    liveliness = {state: i for i, state in enumerate(SINCE_PUSH)}
    state_of = {stream["id"]: stream["state"] for stream in streams}
    server_docs: list[dict[str, Any]] = []
    cells: list[dict[str, Any]] = []
    room = GRID_CELLS
    for n in range(len(server_labels)):
        expected = set()
        if layout is not None:
            expected = {(d, p, 0, t) for d, p, t in itertools.product(range(dp), range(pp), range(tp))
                        if share is None or share.holds(layout, (d, p, 0, t))}
        positions = {(d, p, 0, t) for (m, d, p, t) in cells_of if m == n} | expected
        groups = []
        for d in sorted({position[0] for position in positions}):
            here = sorted(position for position in positions if position[0] == d)
            grid, drawn = grid_model((Cell(position) for position in here), min(GRID_CELLS_PER_GROUP, room))
            room -= len(grid.rows) * len(grid.tp_ranks)
            cell_state, known, live, lacking = {}, 0, 0, 0
            for position in here:
                ids = cells_of.get((n, d, position[1], position[3]), [])
                best = min((state_of[i] for i in ids), key=liveliness.__getitem__, default="missing")
                held = best not in ("missing", "expired")
                cell_state[position] = "missing" if position in expected and not held else best
                known += bool(ids)
                live += best == "live"
                lacking += position in expected and not held
            groups.append({"dp_rank": d, "ranks": known, "live": live, "missing": lacking,
                           "expected": any(position[0] == d for position in expected),
                           "grid": msgspec.to_builtins(grid)})
            cells.extend({
                "id": f"v{n}/dp={d},pp={c.position[1]},cp=0,tp={c.position[3]}", "server": f"v{n}", "dp_rank": d,
                "pp_rank": c.position[1], "attn_cp_rank": 0, "tp_rank": c.position[3],
                "state": cell_state[c.position], "expected": c.position in expected,
                "streams": cells_of.get((n, d, c.position[1], c.position[3]), []),
            } for c in drawn)
        mine = [s for s in streams if s["server"] == f"v{n}"]
        worlds = [json.loads(w) for w in sorted({json.dumps(s["world"]) for s in mine if s["world"] is not None})]
        server_docs.append({
            "id": f"v{n}", "label_set": label_set_of[_static(server_labels[n])],
            "expected": dict(sizes) if layout is not None else None,
            "world_conflict": conflict or implausible, "world_implausible": implausible, "worlds": worlds,
            "node": None if share is None else {"node_rank": share.node_rank, "nodes": share.nodes,
                                                "tp_ranks": [share.tp.start, share.tp.stop],
                                                "pp_ranks": [share.pp.start, share.pp.stop]},
            "ranks": sum(g["ranks"] for g in groups), "live_ranks": sum(g["live"] for g in groups),
            "streams": len(mine), "missing": sum(g["missing"] for g in groups), "dp_groups": groups,
        })
    replica_groups = []
    for (key, d), gid in group_of.items():
        members = [s for s in streams if s["group"] == gid]
        replica_groups.append({
            "id": gid, "label_set": label_set_of[key], "server": members[0]["server"], "dp_rank": d,
            "size": len(members), "live": sum(1 for s in members if s["state"] == "live"),
            "pp_ranks": sorted({s["pp_rank"] for s in members}), "tp_ranks": sorted({s["tp_rank"] for s in members}),
            "attn_cp_ranks": sorted({s["attn_cp_rank"] for s in members if s["attn_cp_rank"] is not None}),
        })
    by_state = {state: sum(1 for s in streams if s["state"] == state) for state in SINCE_PUSH}
    totals = {"servers": len(server_docs), "ranks": sum(s["ranks"] for s in server_docs),
              "live_ranks": sum(s["live_ranks"] for s in server_docs), "streams": len(streams),
              "missing": sum(s["missing"] for s in server_docs)}
    series_labels = dict(static(0, kinds[0]))
    catalog = default_catalog()
    reason_families = [spec for spec in catalog.families if "reason" in spec.labels]
    unfulfilled = dict(unfulfilled or {})
    reasons = []
    for spec in reason_families:
        preset = list(spec.preset.get("reason", ()))
        values = {r: float(unfulfilled.get(r, 0)) if spec.name == "storage_prefetch_unfulfilled_tokens_total" else 0.0
                  for r in preset}
        reasons.append({"family": spec.name, "semantics": spec.semantics.value,
                        "attempt_level": spec.name == "storage_prefetch_unfulfilled_tokens_total",
                        "total": sum(values.values()), "by_reason": [{"reason": r, "value": v} for r, v in values.items()],
                        "other_reasons": 0, "other_value": 0.0})
    load_back_rate = 1.5 * GiB
    curve = [None if i % 7 == 6 else load_back_rate * (i + 1) / history for i in range(history)]
    bandwidth_families = []
    transfers = []
    for name, source, to, tokens_family, bytes_family, tokens, moved, rate, points in (
        ("load_back", "L2", "L1", "load_back_tokens_total", "load_back_bytes_total", 12080, 123_699_200,
         load_back_rate, curve),
        ("backup", "L1", "L2", "hicache_backup_tokens_total", "hicache_backup_bytes_total", 4096, 8_388_608,
         None, [None] * history),
        ("prefetch", "L3", "L2", "prefetched_tokens_total", "storage_prefetch_bytes_total", 2048, 4_194_304,
         250e6, [250e6] * history),
        ("storage_backup", "L2", "L3", "backuped_tokens_total", "storage_backup_bytes_total", 1024, 2_097_152,
         None, [None] * history),
    ):
        transfers.append({"name": name, "from": source, "to": to, "tokens_family": tokens_family, "tokens": tokens,
                          "bytes_family": bytes_family, "bytes": moved, "bytes_per_second": rate})
        duration_family = bytes_family.replace("_bytes_total", "_duration_seconds")
        bandwidth_families.append({
            "family": bytes_family, "exported": "sglang_rollup_" + bytes_family.replace("_bytes_total",
                                                                                        "_active_bandwidth_bytes_per_second"),
            "duration_family": duration_family, "transfer": name, "bytes_per_second": rate,
            "bytes_delta": rate * 6 if rate else 0, "seconds_delta": 6.0 if rate else 0,
            "series": [{"labels": series_labels, "bytes_per_second": rate}] if rate else [], "series_count": 1 if rate else 0,
            "history": [[NOW - 5 * (history - i), v] for i, v in enumerate(points)],
        })
    rollups = [
        {"family": "hicache_host_used_tokens", "exported": "sglang_rollup_hicache_host_used_tokens", "type": "gauge",
         "semantics": "replicated", "attempt_level": False, "unit": "tokens", "total": 3000.0 * dp,
         "series_count": 1},
        {"family": "hicache_host_total_tokens", "exported": "sglang_rollup_hicache_host_total_tokens", "type": "gauge",
         "semantics": "replicated", "attempt_level": False, "unit": "tokens", "total": 12000.0 * dp,
         "series_count": 1},
    ]
    spread_groups = []
    for d in range(dp):
        ratio = (diverging or {}).get(d, 0.01)
        if (static(0, kinds[0]), d) not in group_of:
            continue
        spread_groups.append({"group": group_of[(static(0, kinds[0]), d)], "max_ratio": ratio, "diverging": ratio > 0.2,
                              "series": [{"family": "load_back_tokens_total", "labels": {"pool": "kv"}, "ratio": ratio}],
                              "series_count": 1})
    all_rejections = {code.value: 0 for code in ErrorCode} | dict(rejections or {})
    document = {
        "api_version": 1, "generated_at": NOW,
        "sidecar": {
            "version": "0.1.0", "revision": "0123456789abcdef0123456789abcdef01234567", "python_version": "3.11.7",
            "namespace": "sglang_", "profiles": [{"name": "sglang", "namespace": "sglang_", "families": 32}],
            "started_at": NOW - 192, "uptime_seconds": 192.0, "ready": True,
            "ingest": {"listening": True, "socket_path": "/run/hicache/metrics.sock"},
            "connections": {"open": by_state["live"] + by_state["stale"], "accepted": len(streams), "allowed": 512},
            "frames_received": 1234, "snapshots_received": 1200, "snapshots_applied": 1190, "samples_applied": 48000,
            "streams_by_state": by_state, "rejections": all_rejections, "rejections_total": sum(all_rejections.values()),
            "rollup_layout_conflicts": {},
            "limits": {"series_used": 40 * len(streams) + 100, "series_rank": 40 * len(streams), "series_rollup": 100,
                       "series_allowed": 100_000, "series_per_rank_allowed": 2000, "ranks_known": len(streams),
                       "ranks_allowed": 1024, "stale_after_seconds": 10.0, "expire_after_seconds": 300.0,
                       "window_seconds": 60.0},
        },
        "label_sets": [{"id": sid, "labels": dict(key)} for key, sid in label_set_of.items()],
        "totals": totals, "servers": server_docs, "ranks": cells, "streams": streams, "groups": replica_groups,
        "rollups": rollups, "transfers": transfers,
        "bandwidth": {"window_seconds": 60.0, "history_interval_seconds": 5.0, "history_points": history,
                      "families": bandwidth_families},
        "reasons": reasons, "spread": {"threshold": 0.2, "groups": spread_groups}, "upstreams": upstreams or [],
    }
    validate_status(document)
    return document


def typed(doc: Mapping[str, Any]) -> StatusDocument:
    """A document as top reads it: its JSON decoded into the model."""
    return msgspec.json.decode(json.dumps(doc), type=StatusDocument)


TARGET = Target(url="http://sidecar:9400", status_url="http://sidecar:9400/api/v1/status")


def view_of(document: dict[str, Any], failure: FetchFailed | None = None) -> View:
    """A View that polled `document` (as JSON: a value JSON cannot carry, or of the wrong type, fails the
    poll as it would over HTTP), then `failure`."""
    view = View(TARGET, interval=2.0)
    view.update(received(json.dumps(document).encode(), TARGET.status_url, at=NOW, seconds=0.01))
    if failure is not None:
        view.update(failure)
    return view


def console(width: int = 160, height: int = 50) -> Console:
    return Console(file=io.StringIO(), width=width, height=height, color_system="standard", force_terminal=True,
                   legacy_windows=False, record=True)


def screen_text(renderable: RenderableType, width: int = 160) -> str:
    out = console(width)
    out.print(renderable)
    return out.export_text()


def styled_cells(renderable: RenderableType, width: int = 160) -> list[list[tuple[str, str]]]:
    """Each rendered line as its (text, style) segments, blank styles left out."""
    out = console(width)
    lines = out.render_lines(renderable, out.options, pad=False)
    return [[(seg.text, str(seg.style)) for seg in line if seg.text.strip() and seg.style] for line in lines]


# --- rendering ------------------------------------------------------------------------------


def grids(doc: Mapping[str, Any], server: int = 0, width: int = 60) -> dict[int, dict[str, list[tuple[str, str, str]]]]:
    """Each dp group's grid of a server as top draws it: by dp rank, then row label ("pp0"), the cells tp 0 first,
    each (its tp rank and mark, the rank's colour, its letters each followed by its colour's first word)."""
    read = typed(doc)
    names = Names(read)
    shown = read.servers[server]
    out: dict[int, dict[str, list[tuple[str, str, str]]]] = {}
    for group in shown.dp_groups:
        cells = [cell for cell in read.ranks if cell.server == shown.id and cell.dp_rank == group.dp_rank]
        lines = styled_cells(group_block(shown, group, cells, names), width=width)
        rows: dict[str, list[tuple[str, str, str]]] = {}
        for line in lines[1:]:
            if not line or not re.fullmatch(r"pp[0-9]+( cp[0-9]+)?", line[0][0]):
                continue
            row = rows.setdefault(line[0][0], [])
            for text, style in line[1:]:
                if text[0].isdigit():
                    row.append((text.strip(), style, ""))
                else:  # a letter: its stream's state, as the background colour's name
                    tp, rank_style, letters = row[-1]
                    row[-1] = (tp, rank_style, letters + text + STYLE_STATE[style][0])
        out[integer(group.dp_rank)] = rows
    return out


STYLE_STATE = {style: state for state, style in STATE_STYLE.items()}


def test_a_cell_is_a_rank_and_lists_its_streams_on_their_states_colours() -> None:
    # make demo's shape: per rank a radix and a storage stream, and a scheduler one on attention tp 0.
    states = {(0, 0, 1): "stale", (1, 0, 0, "scheduler"): "expired", (1, 1, 1, "storage"): "departed"}
    doc = status_document(dp=2, pp=2, tp=2, kinds=("radix", "storage", "scheduler"), world=True, states=states)
    live, stale = STATE_STYLE["live"], STATE_STYLE["stale"]
    # Each letter is followed by its stream's state (l live, s stale, d departed, e expired).
    assert grids(doc) == {
        0: {"pp0": [("0", live, "RlSlEl"), ("1", stale, "RsSs")], "pp1": [("0", live, "RlSlEl"), ("1", live, "RlSl")]},
        1: {"pp0": [("0", live, "RlSlEe"), ("1", live, "RlSl")], "pp1": [("0", live, "RlSlEl"), ("1", live, "RlSd")]},
    }
    text = screen_text(render_frame(view_of(doc), now=NOW + 3))
    lines = text.splitlines()
    assert lines[2] == "Ranks   8 ranks, 20 streams"
    assert lines[3] == " ranks    7 live    1 not live    0 missing "
    assert lines[4] == " streams  16 live    2 stale    1 departed    1 expired    20 known, at most 1,024"
    assert lines[5].startswith(" a cell is a rank: its attention tp rank, then one letter per stream")
    assert "R radix, S storage, E scheduler, C client); N? missing" in lines[5]
    assert lines[7] == "server (no labels of its own)  expects dp 2 × pp 2 × tp 2  8 ranks, 20 streams  7/8 live"
    assert lines[8].split() == ["dp0", "3/4", "live", "dp1", "4/4", "live"]
    assert lines[9].split() == ["pp0", "0", "RSE", "1", "RS", "pp0", "0", "RSE", "1", "RS"]
    # Every stream that is not live is named: its kind, identity, the rank it reports for when its tp rank is
    # the engine's global one, its source, sequence, restarts and how long it has been silent.
    assert ('   stale  radix  tp=1 pp=0 dp=0 cache_type="UnifiedRadixCache"  push  seq 90  restarts 0  '
            '14s since a push\n') in text
    assert ('   stale  storage  tp=1 pp=0 dp=0 cp=0 attn_cp_size="1" pp_size="2" storage_backend="file"  push  seq 90  '
            'restarts 0  14s since a push\n') in text
    assert ('   expired  scheduler  tp=2 pp=0 dp=1 engine_type="unified" model_name="m" moe_ep_rank="2"  (rank tp=0)  '
            'push  seq 90  restarts 0  7m00s since a push\n') in text
    assert ('   departed  storage  tp=1 pp=1 dp=1 cp=0 attn_cp_size="1" pp_size="2" storage_backend="file"  push  '
            'seq 90  restarts 0  31s since a push\n') in text
    assert lines[0] == ("hicache-exporter top  http://sidecar:9400  sidecar 0.1.0 (0123456789ab)  up 3m12s  ready  "
                        "8 ranks, 20 streams  read 3s ago   q quits")
    # A server of pushed clients, one stream a rank: the cell is the rank's tp number alone.
    plain = status_document(dp=1, pp=1, tp=2, kinds=("client",), states={(0, 0, 1): "departed"})
    assert grids(plain) == {0: {"pp0": [("0", live, ""), ("1", STATE_STYLE["departed"], "")]}}
    assert "a cell is a rank" not in screen_text(render_frame(view_of(plain), now=NOW))


def test_missing_ranks_and_whole_dp_groups_are_marked_in_the_grid_and_counted() -> None:
    doc = status_document(dp=3, pp=2, tp=2, kinds=("radix", "storage"), missing={(0, 1, 1), (1, 0, 0)},
                          absent_groups={2}, states={(0, 0, 1): "stale", (1, 1, 1): "expired"})
    live, stale, gone = STATE_STYLE["live"], STATE_STYLE["stale"], MISSING_STYLE
    assert grids(doc) == {
        0: {"pp0": [("0", live, "RlSl"), ("1", stale, "RsSs")], "pp1": [("0", live, "RlSl"), ("1?", gone, "")]},
        # A rank whose streams all expired is missing too, and still lists them.
        1: {"pp0": [("0?", gone, ""), ("1", live, "RlSl")], "pp1": [("0", live, "RlSl"), ("1?", gone, "ReSe")]},
        2: {"pp0": [("0?", gone, ""), ("1?", gone, "")], "pp1": [("0?", gone, ""), ("1?", gone, "")]},
    }
    text = screen_text(render_frame(view_of(doc), now=NOW))
    assert " ranks    4 live    2 not live    7 missing " in text  # one in dp 0, two in dp 1, and dp 2's four
    assert "  ready  6 ranks, 12 streams  7 missing  read 0s ago" in text.splitlines()[0]
    assert "expects dp 3 × pp 2 × tp 2  6 ranks, 12 streams  4/6 live   7 missing " in text
    assert "dp0  2/3 live  1 missing" in text and "dp1  2/3 live  2 missing" in text
    assert "dp2  0/0 live  4 missing" in text
    assert "   missing  dp0: pp1 tp1\n" in text and "   missing  dp1: pp0 tp0, pp1 tp1\n" in text
    assert "   missing  dp2: the whole dp group (pp 2 × tp 2), no stream has reported\n" in text
    lines = [line for line in styled_cells(render_frame(view_of(doc), now=NOW))
             if not any(text.startswith(" a cell is a rank") for text, _ in line)]  # the legend names the mark
    assert {style for line in lines for text, style in line if "?" in text} == {MISSING_STYLE}
    # Without a world nothing is expected: no count, no mark.
    plain = screen_text(render_frame(view_of(status_document(dp=1, pp=1, tp=2)), now=NOW))
    assert "missing" not in plain.replace("N? missing", "") and "?" not in plain.split("Transfers")[0].replace("N?", "")
    assert "no world reported: only the ranks seen are drawn" in plain


def test_a_world_conflict_or_an_implausible_world_is_a_warning_and_expects_nothing() -> None:
    doc = status_document(dp=1, pp=1, tp=2, conflict=True)
    text = screen_text(render_frame(view_of(doc), now=NOW), width=200)
    assert ("world conflict: its streams report different worlds: dp 1 × pp 1 × tp 2, dp 1 × pp 1 × tp 2 "
            "(engine tp 3); no missing rank can be worked out\n" in text)
    assert " 0 missing " not in text and "?" not in text.split("Transfers")[0].replace("N?", "")
    assert "server (no labels of its own)  2 ranks, 2 streams  2/2 live\n" in text  # no world expected
    big = screen_text(render_frame(view_of(status_document(dp=1, pp=1, tp=2, implausible=True)), now=NOW), width=200)
    assert ("world conflict: its streams report dp 1 × pp 64 × tp 64, more positions than the 1,024 rank identities "
            "this sidecar keeps (ranks.max_ranks); no missing rank can be worked out\n" in big)


def test_each_server_is_a_block_of_its_own_and_a_node_says_its_share() -> None:
    doc = status_document(dp=1, pp=1, tp=2, world=True, servers=[{"model": "b"}, {"model": "a"}],
                          missing={(0, 0, 1)})
    text = screen_text(render_frame(view_of(doc), now=NOW))
    assert "Ranks   2 ranks, 2 streams of 2 servers\n" in text
    first = text.index("server model=a  expects dp 1 × pp 1 × tp 2  1 rank, 1 stream  1/1 live   1 missing ")
    second = text.index("server model=b  expects dp 1 × pp 1 × tp 2  1 rank, 1 stream  1/1 live   1 missing ")
    assert first < second
    assert "   missing  model=a dp0: pp0 tp1\n" in text and "   missing  model=b dp0: pp0 tp1\n" in text
    assert grids(doc, 1) == {0: {"pp0": [("0", STATE_STYLE["live"], "Rl"), ("1?", MISSING_STYLE, "")]}}
    # The second node of two of a pp 2 server: its sidecar expects pp stage 1 only.
    node = status_document(dp=1, pp=2, tp=4, world=True, node=(1, 2), missing={(0, 1, 3)})
    text = screen_text(render_frame(view_of(node), now=NOW))
    assert "node 1 of 2: this sidecar expects global tp ranks 0-3 of pp stage 1\n" in text
    assert grids(node) == {0: {"pp1": [("0", STATE_STYLE["live"], "Rl"), ("1", STATE_STYLE["live"], "Rl"),
                                       ("2", STATE_STYLE["live"], "Rl"), ("3?", MISSING_STYLE, "")]}}


def test_a_grid_past_its_cap_says_what_it_leaves_out_and_missing_ranks_there_are_counted() -> None:
    # 2 x 1,024 ranks in one dp group: the 1,024 cells a grid may draw hold the first row only.
    doc = status_document(dp=1, pp=2, tp=1024, world=True, missing={(0, 1, 5)})
    text = screen_text(render_frame(view_of(doc), now=NOW), width=200)
    assert "drawn 1 of 2 rows, 1,024 of 1,024 tp columns; 1,024 ranks not drawn" in text
    assert "   missing  dp0: 1 not drawn\n" in text
    assert "dp0  2047/2047 live  1 missing" in text and "pp1" not in text.split("Transfers")[0]


def test_totals_bandwidth_history_occupancy_and_reasons_are_shown() -> None:
    doc = status_document(unfulfilled={"below_threshold": 512, "deadline": 4096, "storage_transfer": 64})
    text = screen_text(render_frame(view_of(doc), now=NOW))
    lines = text.splitlines()
    load_back = next(line for line in lines if line.lstrip().startswith("load_back"))
    assert "L2→L1" in load_back and "12,080" in load_back and "118.0 MiB" in load_back and "1.5 GiB/s" in load_back
    backup = next(line for line in lines if line.lstrip().startswith("backup"))
    assert "L1→L2" in backup and "4,096" in backup and "8.0 MiB" in backup and "idle" in backup
    assert "238.4 MiB/s" in next(line for line in lines if line.lstrip().startswith("prefetch"))
    assert "L2 host pool: 6,000 of 24,000 tokens in use (25%)" in text
    unfulfilled = next(line for line in lines if line.startswith("storage_prefetch_unfulfilled_tokens_total"))
    assert "(attempt-level)" in unfulfilled and "4,672:" in unfulfilled
    # Largest first; the presets still at 0 are counted, not listed.
    assert unfulfilled.index("deadline 4,096") < unfulfilled.index("below_threshold 512") < unfulfilled.index(
        "storage_transfer 64")
    presets = len(default_catalog().get("storage_prefetch_unfulfilled_tokens_total").preset["reason"])
    assert f"({presets - 3} more at 0)" in unfulfilled
    deferred = len(default_catalog().get("storage_prefetch_deferred_tokens_total").preset["reason"])
    assert f"storage_prefetch_deferred_tokens_total  0  ({deferred} reasons, all at 0)" in lines


def test_the_sparkline_scales_to_its_peak_and_leaves_gaps_where_nothing_moved() -> None:
    assert sparkline([1.0, 2.0, None, 4.0, 8.0]).plain == "▁▂ ▄█"
    assert sparkline([None, None]).plain == "  "
    assert sparkline([5.0] * 50, width=30).plain == "█" * 30
    assert sparkline(list(range(1, 101)), width=8).plain == BLOCKS[-1] * 8  # the last 8 of 100: all near the peak
    doc = status_document(history=40)
    history = next(line for line in screen_text(render_frame(view_of(doc), now=NOW)).splitlines()
                   if line.lstrip().startswith("load_back"))
    assert history.rstrip().endswith("█") and " " in history.rstrip()[-30:], history  # rising, with idle windows


def test_replica_spread_puts_diverging_groups_first() -> None:
    doc = status_document(dp=3, diverging={2: 0.45})
    text = screen_text(render_frame(view_of(doc), now=NOW))
    lines = [line for line in text.splitlines() if line.startswith("dp") and ("agree" in line or "DIVERGING" in line)]
    assert lines[0].startswith("dp2 cache_type=UnifiedRadixCache  DIVERGING 0.45  load_back_tokens_total{pool=kv} 0.45")
    assert all("agree (0.01)" in line for line in lines[1:]) and len(lines) == 3
    styles = [style for line in styled_cells(render_frame(view_of(doc), now=NOW)) for text, style in line
              if "DIVERGING" in text]
    assert styles == ["bold white on red"]


def test_upstreams_health_worlds_and_rejections_by_reason() -> None:
    base = {"source": "http://127.0.0.1:30000/metrics", "last_scrape_time": None, "last_scrape_duration_seconds": 0.012,
            "samples": 0, "scrapes": 4, "ranks": 2, "pass_through_families": 0, "errors": {"connect": 4},
            "last_error": "connect: connection refused", "unranked_families": [], "cp_colliding_families": []}
    upstreams = [
        {**base, "name": "engine", "up": False, "world": world_sizes(2, 2, 2, True), "world_problems": []},
        {**base, "name": "other", "up": True, "errors": {}, "last_error": None, "world": world_sizes(4, 1, 1, False),
         "world_problems": ['pp_size="2" on 4 ranks, the world says 1', 'attn_cp_size="2" on 4 ranks, the world says 1']},
        {**base, "name": "bare", "up": True, "errors": {}, "last_error": None, "world": None, "world_problems": []},
    ]
    doc = status_document(rejections={"duplicate_rank": 2, "unknown_family": 5}, upstreams=upstreams)
    text = screen_text(render_frame(view_of(doc), now=NOW), width=200)
    rows = {line.split()[0]: line for line in text.splitlines() if line.lstrip().startswith(("engine", "other", "bare"))}
    for part in ("http://127.0.0.1:30000/metrics", "DOWN", "dp 2 × pp 2 × tp 2", "12 ms", "connect: connection refused"):
        assert part in rows["engine"]
    assert "dp 1 × pp 1 × tp 4" in rows["other"] and " up " in rows["other"]
    assert rows["bare"].split()[2:5] == ["up", "2", "–"]  # no world configured
    assert "other: world not trusted: pp_size=\"2\" on 4 ranks, the world says 1\n" in text
    assert "other: world not trusted: attn_cp_size=\"2\" on 4 ranks, the world says 1\n" in text
    assert {style for line in styled_cells(render_frame(view_of(doc), now=NOW), width=200) for t, style in line
            if t == "dp 1 × pp 1 × tp 4"} == {"bold yellow"}  # the world its labels contradict
    assert "rejections 7  unknown_family 5  duplicate_rank 2" in text
    assert "ingest listening on /run/hicache/metrics.sock · connections 8 open of 512" in text
    assert "series 420 of 100,000" in text and "stale after 10s, expired after 5m00s" in text


def test_label_values_are_shown_literally_never_as_markup_or_terminal_codes() -> None:
    labels = {"pod": "[bold]x[/bold]", "model": "<b>m</b>", "evil": "\x1b[2J\x1b]0;pwned\x07"}
    doc = status_document(dp=1, pp=1, tp=2, labels=labels, states={(0, 0, 1): "stale"}, missing={(0, 0, 0)})
    out = console(200)
    out.print(render_frame(view_of(doc), now=NOW))
    text = out.export_text()
    assert "server evil=\\x1b[2J\\x1b]0;pwned\\x07, model=<b>m</b>, pod=[bold]x[/bold]  expects" in text
    assert ('tp=1 pp=0 dp=0 cache_type="UnifiedRadixCache" evil="\\x1b[2J\\x1b]0;pwned\\x07" model="<b>m</b>" '
            'pod="[bold]x[/bold]"  push') in text
    assert "   missing  evil=\\x1b[2J\\x1b]0;pwned\\x07, model=<b>m</b>, pod=[bold]x[/bold] dp0: pp0 tp0\n" in text
    raw = out.export_text(styles=True)
    assert "\x1b[2J" not in raw and "\x07" not in raw and "\x1b]0;" not in raw


def grid_lines(lines: list[str], title: str) -> list[str]:
    """The lines of the grid under the first line starting with `title`: its row, then those wrapped under it."""
    start = next(i for i, line in enumerate(lines) if line.startswith(title))
    return list(itertools.takewhile(lambda line: line.startswith(("pp0 ", "    ")), lines[start + 1:]))


@pytest.mark.parametrize("kinds, per_line", [(("client",), 24), (("radix",), 16)])
def test_256_ranks_in_one_group_wrap_within_the_terminal(kinds: tuple[str], per_line: int) -> None:
    # 96 columns beside "pp0 ": cells of 3 characters and a space (a client's rank alone), or 5 ("255 R").
    doc = status_document(dp=1, pp=1, tp=256, kinds=kinds)
    text = screen_text(render_frame(view_of(doc), now=NOW), width=100)
    lines = text.splitlines()
    assert all(cell_len(line) <= 100 for line in lines)
    grid = grid_lines(lines, "dp0 ")
    numbers = [int(word) for line in grid for word in line.split() if word.isdigit()]
    assert numbers == list(range(256)), "every tp rank is on screen, in order"
    assert [word for line in grid for word in line.split()[1:] if not word.isdigit()] == (
        [] if kinds == ("client",) else ["R"] * 256)
    assert len(grid) == -(-256 // per_line) and grid[0].startswith("pp0 "), "wrapped under its row"


def test_256_ranks_in_eight_groups_sit_side_by_side() -> None:
    doc = status_document(dp=8, pp=4, tp=8, states={(5, 3, 7): "stale"})
    text = screen_text(render_frame(view_of(doc), now=NOW), width=160)
    lines = text.splitlines()
    assert all(cell_len(line) <= 160 for line in lines)
    titles = [line.count("/32 live") for line in lines]
    assert sum(titles) == 8 and max(titles) >= 3, "several groups per line"
    first = titles.index(max(titles))
    last = len(titles) - 1 - titles[::-1].index(next(t for t in titles[::-1] if t))
    assert last - first <= 15, "the grid of 256 ranks takes at most 16 lines"
    assert "dp5  31/32 live" in text and "256 ranks, 256 streams  255/256 live" in text
    assert "tp=7 pp=3 dp=5" in text


def test_a_frame_taller_than_the_screen_scrolls_under_a_fixed_header() -> None:
    view = view_of(status_document(dp=8, pp=4, tp=8))
    scroll = Scroll()
    out = console(width=140, height=20)  # the header on one line
    lines = out.render_lines(Frame(view, scroll), out.options, pad=False)
    text = ["".join(seg.text for seg in line).rstrip() for line in lines]
    assert len(text) == 20 and text[0].startswith("hicache-exporter top  http://sidecar:9400")
    assert text[-1].startswith(f"lines 1-18 of {scroll.lines}: j/k")  # 20 rows less the header's and its own
    assert scroll.key(b" ") and scroll.offset == 18
    assert scroll.key(b"G") and scroll.offset == scroll.lines - scroll.room
    again = ["".join(seg.text for seg in line).rstrip() for line in out.render_lines(Frame(view, scroll), out.options)]
    assert again[0] == text[0] and again[-1].startswith(f"lines {scroll.lines - 17}-{scroll.lines} of {scroll.lines}")
    assert scroll.key(b"\x1b[A") and scroll.offset == scroll.lines - scroll.room - 1
    assert scroll.key(b"g") and scroll.offset == 0 and not scroll.key(b"x")


def test_a_failed_poll_is_shown_over_the_last_document() -> None:
    failure = FetchFailed(FailureKind.UNREACHABLE, "http://sidecar:9400: connection refused", at=NOW + 5)
    text = screen_text(render_frame(view_of(status_document(), failure), now=NOW + 6))
    first, second = text.splitlines()[:2]
    assert "read 6s ago" in first
    assert second.startswith("unreachable: http://sidecar:9400: connection refused  (retrying every 2 s; below: the "
                             "status read at ")
    assert "Ranks   8 ranks, 8 streams\n" in text
    fresh = View(TARGET, interval=2.0)
    assert "connecting to http://sidecar:9400/api/v1/status" in screen_text(render_frame(fresh, now=NOW))
    fresh.update(failure)
    lines = screen_text(render_frame(fresh, now=NOW)).splitlines()
    assert lines[1] == "unreachable: http://sidecar:9400: connection refused  (retrying every 2 s)" and len(lines) == 2


def test_a_document_it_cannot_read_is_one_line_not_a_traceback() -> None:
    doc = status_document()
    del doc["spread"]
    view = view_of(doc)
    lines = screen_text(render_frame(view, now=NOW)).splitlines()
    assert not view.ok and lines[1] == ("invalid: http://sidecar:9400/api/v1/status sent a status document this top "
                                        "cannot read: Object missing required field `spread`  (retrying every 2 s)")
    shown = view_of(status_document(), FetchFailed(FailureKind.INVALID, "x", at=NOW))
    shown.update(received(json.dumps(doc).encode(), TARGET.status_url, at=NOW))  # the last good document stays up
    assert "Ranks   8 ranks, 8 streams\n" in screen_text(render_frame(shown, now=NOW))
    other = View(TARGET, interval=2.0)
    other.update(received(b'{"api_version": 2, "ranks": "another shape"}', TARGET.status_url, at=NOW))
    assert not other.ok and "speaks api_version 2; this top reads 1" in screen_text(render_frame(other, now=NOW))
    newer = status_document()
    newer["api_version"] = 2  # the same shape, another version
    assert "speaks api_version 2; this top reads 1" in screen_text(render_frame(view_of(newer), now=NOW))
    later = status_document()
    later["sidecar"]["added_in_a_later_v1"] = {"any": "thing"}  # v1 may grow: top reads past what it does not know
    assert view_of(later).ok


# --- fetching -------------------------------------------------------------------------------


def test_build_target_takes_credentials_from_flags_environment_or_the_url(tmp_path: Path) -> None:
    password_file = tmp_path / "password"
    password_file.write_text("from-file\n")

    def credentials(target: Target) -> str:
        assert target.authorization is not None
        return base64.b64decode(target.authorization.removeprefix("Basic ")).decode()

    from_url = build_target("http://prom:p%40ss@host:9400/prefix/", env={})
    assert from_url.url == "http://host:9400/prefix" and from_url.status_url == "http://host:9400/prefix/api/v1/status"
    assert credentials(from_url) == "prom:p@ss" and "p@ss" not in from_url.url
    assert credentials(build_target("http://prom:url@host", env={ENV_PASSWORD: "env"})) == "prom:env"
    assert credentials(build_target("http://prom:url@host", "ops", password_file, env={ENV_PASSWORD: "env"})) == \
        "ops:from-file"
    assert build_target("host:9400", env={}).status_url == "http://host:9400/api/v1/status"
    assert build_target("http://[::1]:9400", env={}).url == "http://[::1]:9400"
    assert build_target("http://127.0.0.1:9400", env={}).authorization is None
    for url, user, said in (("ftp://host", None, "only http:// and https://"),
                            ("http://host:99999", None, "out of range"),
                            ("http://host", "prom", "needs a password"),
                            ("http://:pw@host", None, "no user")):
        with pytest.raises(HicacheExporterError, match=said):
            build_target(url, user, env={})
    with pytest.raises(HicacheExporterError, match="for https:// URLs"):
        build_target("http://host", insecure=True, env={})
    with pytest.raises(HicacheExporterError, match="cannot read it"):
        build_target("http://host", "prom", tmp_path / "absent", env={})


def test_a_refused_connection_and_a_silent_server_are_unreachable() -> None:
    refused = fetch_status(build_target(f"http://127.0.0.1:{free_port()}", env={}), timeout=2)
    assert isinstance(refused, FetchFailed) and refused.kind is FailureKind.UNREACHABLE
    assert refused.line.endswith(": connection refused")
    with socket.socket() as silent:  # accepts (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        hung = fetch_status(build_target(f"http://127.0.0.1:{silent.getsockname()[1]}", env={}), timeout=0.3)
    assert isinstance(hung, FetchFailed) and hung.kind is FailureKind.UNREACHABLE
    assert hung.line.endswith("no answer within 0.3 s")


@pytest.fixture
def answering() -> Iterator[tuple[str, list[bytes]]]:
    """A one-route HTTP server that sends whatever raw response the test queues (and keeps the requests)."""
    responses: list[bytes] = []
    REQUESTS.clear()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                REQUESTS.append(conn.recv(65536))
                conn.sendall(responses.pop(0))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}", responses
    with contextlib.suppress(OSError):
        server.shutdown(socket.SHUT_RDWR)  # wakes the accept (close alone leaves it blocked until the join's timeout)
    server.close()
    thread.join(5)


REQUESTS: list[bytes] = []


def _response(status: str, body: bytes, *headers: str) -> bytes:
    head = "\r\n".join([f"HTTP/1.1 {status}", f"Content-Length: {len(body)}", "Connection: close", *headers])
    return head.encode() + b"\r\n\r\n" + body


def test_answers_that_are_not_a_status_say_what_they_are(answering: tuple[str, list[bytes]]) -> None:
    url, responses = answering
    target = build_target(url, env={})
    responses.append(_response("200 OK", b"<html>a proxy's page</html>"))
    result = fetch_status(target, timeout=5)
    assert isinstance(result, FetchFailed) and result.kind is FailureKind.INVALID and "did not send JSON" in result.line
    responses.append(_response("302 Found", b"", "Location: http://elsewhere/login"))
    result = fetch_status(build_target(url, "prom", env={ENV_PASSWORD: "pw"}), timeout=5)
    assert isinstance(result, FetchFailed) and "redirects (HTTP 302) to http://elsewhere/login; not followed" in result.line
    responses.append(_response("503 Service Unavailable", b""))
    result = fetch_status(target, timeout=5)
    assert isinstance(result, FetchFailed) and result.line.endswith("answered HTTP 503")
    responses.append(_response("200 OK", json.dumps(status_document()).encode()))
    assert isinstance(fetch_status(target, timeout=5), Fetched)


def test_gzip_is_asked_for_and_inflated_within_the_size_limit(answering: tuple[str, list[bytes]]) -> None:
    url, responses = answering
    target = build_target(url, env={})
    document = status_document()
    responses.append(_response("200 OK", gzip.compress(json.dumps(document).encode()), "Content-Encoding: gzip"))
    result = fetch_status(target, timeout=5)
    assert isinstance(result, Fetched) and result.document == typed(document)
    assert b"\r\nAccept-Encoding: gzip\r\n" in REQUESTS[-1]
    bomb = gzip.compress(b" " * (MAX_DOCUMENT_BYTES + 1024))  # about 33 KB that inflate past the limit
    responses.append(_response("200 OK", bomb, "Content-Encoding: gzip"))
    result = fetch_status(target, timeout=5)
    assert isinstance(result, FetchFailed) and f"sent more than {MAX_DOCUMENT_BYTES} bytes" in result.line
    responses.append(_response("200 OK", gzip.compress(b'{"api_version": 1}')[:-12], "Content-Encoding: gzip"))
    result = fetch_status(target, timeout=5)
    assert isinstance(result, FetchFailed) and "sent broken gzip" in result.line


def test_basic_auth_against_a_real_sidecar(socket_dir: Path) -> None:
    hashed = bcrypt.hashpw(b"s3cret", bcrypt.gensalt(4)).decode()
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", http={"basic_auth_users": {"prom": hashed}})).start()
    try:
        bare = fetch_status(build_target(running.url, env={}), timeout=5)
        assert isinstance(bare, FetchFailed) and bare.kind is FailureKind.UNAUTHORIZED
        assert "needs credentials (HTTP 401): pass --web.user" in bare.line
        wrong = fetch_status(build_target(running.url, "prom", env={ENV_PASSWORD: "wrong"}), timeout=5)
        assert isinstance(wrong, FetchFailed) and wrong.kind is FailureKind.UNAUTHORIZED
        assert "refused user 'prom' (HTTP 401): check the password" in wrong.line
        url = running.url.replace("http://", "http://prom:s3cret@")
        good = fetch_status(build_target(url, env={}), timeout=5)
        assert isinstance(good, Fetched), good
        validate_status(msgspec.to_builtins(good.document))
    finally:
        running.stop()


def test_tls_is_verified_against_the_ca_file_or_skipped_with_insecure(tmp_path: Path, socket_dir: Path) -> None:
    cert, key = self_signed_cert(tmp_path)
    tls = {"tls_server_config": {"cert_file": str(cert), "key_file": str(key)}}
    running = SidecarThread(sidecar_config(socket_dir / "m.sock", http=tls)).start()
    try:
        url = running.url.replace("http://", "https://")
        unverified = fetch_status(build_target(url, env={}), timeout=5)
        assert isinstance(unverified, FetchFailed) and unverified.kind is FailureKind.UNREACHABLE
        assert "TLS: self-signed certificate" in unverified.line and "(pass --ca-file, or --insecure)" in unverified.line
        verified = fetch_status(build_target(url, ca_file=cert, env={}), timeout=5)
        assert isinstance(verified, Fetched), verified
        validate_status(msgspec.to_builtins(verified.document))
        assert isinstance(fetch_status(build_target(url, insecure=True, env={}), timeout=5), Fetched)
        plain = fetch_status(build_target(running.url, env={}), timeout=5)  # http:// to a TLS port
        assert isinstance(plain, FetchFailed) and plain.kind is FailureKind.UNREACHABLE
        assert plain.line.endswith("(does it serve https://?)"), plain.line
    finally:
        running.stop()
    bare = SidecarThread(sidecar_config(socket_dir / "n.sock")).start()
    try:
        mistaken = fetch_status(build_target(bare.url.replace("http://", "https://"), insecure=True, env={}), timeout=5)
        assert isinstance(mistaken, FetchFailed) and mistaken.line.endswith("(does it serve plain http://?)")
    finally:
        bare.stop()


# --- the command ------------------------------------------------------------------------------


def test_once_against_a_down_sidecar_prints_unreachable_and_exits_1() -> None:
    port = free_port()
    result = subprocess.run([*CLI, "top", "--once", "--url", f"http://127.0.0.1:{port}", "--interval", "1"],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 1, result.stderr
    assert f"unreachable: http://127.0.0.1:{port}: connection refused" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr


@pytest.mark.parametrize("args, said", [
    (["--url", "ftp://host"], "only http:// and https://"),
    (["--web.user", "prom"], "needs a password"),
    (["--interval", "0"], "must be positive"),
    (["--ca-file", "/x.pem"], "for https:// URLs"),
])
def test_bad_flags_are_one_line_and_exit_2(args: list[str], said: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != ENV_PASSWORD}
    result = subprocess.run([*CLI, "top", "--once", *args], capture_output=True, text=True, timeout=30, env=env)
    assert result.returncode == 2 and said in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and result.stdout == ""


def test_without_rich_it_says_what_to_install_and_the_sidecar_never_imports_it() -> None:
    hide_rich = ("import sys; sys.modules['rich'] = None\n"  # as if the `top` extra were not installed
                 "from exporter.cli import main\n"
                 "sys.exit(main(['top', '--once']))")
    result = subprocess.run([sys.executable, "-c", hide_rich], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2
    assert result.stderr.strip() == "hicache-exporter: error: top needs the rich library: pip install 'hicache-exporter[top]'"
    imports = ("import sys, exporter.cli, exporter.sidecar.runner, exporter.sidecar.http.app, exporter.top.fetch\n"
               "print(sorted(m for m in sys.modules if m == 'rich' or m.startswith('rich.')))")
    loaded = subprocess.run([sys.executable, "-c", imports], capture_output=True, text=True, timeout=30, check=True)
    assert loaded.stdout.strip() == "[]"


def test_help_lists_top_and_its_flags() -> None:
    result = subprocess.run([*CLI, "top", "--help"], capture_output=True, text=True, timeout=30)
    for flag in ("--url", "--interval", "--once", "--web.user", "--web.password-file", ENV_PASSWORD, "--ca-file",
                 "--insecure", "http://127.0.0.1:9400"):
        assert flag in result.stdout
    assert "top" in subprocess.run([*CLI, "--help"], capture_output=True, text=True, timeout=30).stdout


# --- a hostile or broken sidecar --------------------------------------------------------------

SGR = re.compile(r"\x1b\[[0-9;]*m")  # the only escape sequences rich itself sends for a frame: colours
# What a hostile string may try: an OSC title, CSI screen clearing, their C1 forms, lone controls,
# a bidi override; and values of the wrong type or out of range where the schema says a number.
CONTROLS = ("\x1b]0;PWNED\x07", "\x1b[2J", "\x1b[31mRED", "\x9b2J", "\x9d0;x\x9c", "\x1b", "\x07", "\r", "\x08",
            "\x00", "\x7f", "\x85", "\u202e", "\t", "[bold]x[/bold]")
WRONG = (None, True, False, [], {}, ["\x1b[2J"], {"\x1b]0;k\x07": "\x1b[2J"}, 10 ** 400, -(10 ** 30), float("inf"),
         float("-inf"), float("nan"), -1, 1e308, 0.5, "", "12", "\x1b[2J")
HOSTILE = st.one_of(st.lists(st.one_of(st.sampled_from(CONTROLS), st.text(max_size=3)), min_size=1, max_size=4)
                    .map("".join), st.sampled_from(WRONG))


def assert_terminal_safe(raw: str) -> None:
    """Nothing in `raw` but text, newlines and rich's own colour sequences: no OSC, no other CSI, no lone control."""
    rest = SGR.sub("", raw)
    bad = sorted({ch for ch in rest if (ord(ch) < 0x20 and ch != "\n") or 0x7F <= ord(ch) <= 0x9F})
    assert not bad, f"control characters {bad!r} reach the terminal:\n{raw!r}"


def frame_bytes(view: View, width: int = 160) -> str:
    """A frame as the terminal receives it, printed (as --once does) and drawn (as the screen does)."""
    out = console(width)
    out.print(render_frame(view, now=NOW + 1))
    out.print(Frame(view, Scroll()))
    file = out.file
    assert isinstance(file, io.StringIO)
    return file.getvalue()


def hostile_base() -> dict[str, Any]:
    upstream = {"name": "engine", "source": "http://127.0.0.1:30000/metrics", "up": True, "last_scrape_time": NOW,
                "last_scrape_duration_seconds": 0.012, "samples": 10, "scrapes": 4, "ranks": 2,
                "pass_through_families": 0, "errors": {"connect": 1}, "last_error": "connect: refused",
                "unranked_families": [], "cp_colliding_families": [],
                "world": world_sizes(2, 2, 3, True), "world_problems": ["pp_size=\"4\" on 2 ranks, the world says 2"]}
    doc = status_document(dp=3, pp=2, tp=2, history=3, states={(0, 0, 1): "stale", (1, 0, 0, "storage"): "expired"},
                          missing={(1, 1, 1)}, absent_groups={2}, diverging={0: 0.5}, unfulfilled={"deadline": 64},
                          rejections={"duplicate_rank": 2}, upstreams=[upstream], kinds=("radix", "storage", "scheduler"))
    doc["sidecar"]["rollup_layout_conflicts"] = {"load_back_duration_seconds": 2}
    validate_status(doc)
    return doc


def places(node: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], str]]:
    """Every leaf (`value`) and every object key (`key`) of a document, by path."""
    if isinstance(node, dict):
        for key, child in node.items():
            yield (*path, key), "key"
            yield from places(child, (*path, key))
    elif isinstance(node, list):
        for i, child in enumerate(node):
            yield from places(child, (*path, i))
    else:
        yield path, "value"


HOSTILE_BASE = hostile_base()
HOSTILE_PLACES = [place for place in places(HOSTILE_BASE) if place[0] != ("api_version",)]


def replaced(doc: dict[str, Any], path: tuple[Any, ...], how: str, value: Any) -> None:
    parent = doc
    for step in path[:-1]:
        parent = parent[step]
    if how == "value":
        parent[path[-1]] = value
    else:  # the key itself: `value` in its place when it is a string, the entry gone otherwise
        child = parent.pop(path[-1])
        if isinstance(value, str):
            parent[value] = child


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(HOSTILE_PLACES), HOSTILE), min_size=1, max_size=3))
def test_hostile_values_anywhere_in_the_document_never_reach_the_terminal(
        changes: list[tuple[tuple[tuple[Any, ...], str], Any]]) -> None:
    doc = copy.deepcopy(HOSTILE_BASE)
    for (path, how), value in changes:
        with contextlib.suppress(KeyError, IndexError, TypeError):  # an earlier change took its parent away
            replaced(doc, path, how, value)
    raw = frame_bytes(view_of(doc))
    assert_terminal_safe(raw)
    assert SGR.sub("", raw).startswith("hicache-exporter top  http://sidecar:9400")
    assert "Traceback" not in raw


def test_every_number_shown_is_checked_as_a_number_and_every_string_escaped() -> None:
    # The fields a review found shown without escaping, each holding an OSC title and a screen clear: where
    # a number belongs the poll is refused in one line naming the field; a string is shown, escaped.
    evil = "\x1b]0;PWNED\x07\x1b[2J\x1b[31mRED"
    for path in (("servers", 0, "dp_groups", 0, "dp_rank"), ("servers", 0, "dp_groups", 0, "live"),
                 ("servers", 0, "dp_groups", 0, "grid", "tp_ranks", 0), ("servers", 0, "expected", "attn_tp_size"),
                 ("ranks", 0, "tp_rank"), ("streams", 0, "seq"), ("upstreams", 0, "world", "pp_size"),
                 ("sidecar", "limits", "ranks_known"), ("sidecar", "streams_by_state", "live"),
                 ("totals", "missing"), ("spread", "threshold"), ("sidecar", "namespace")):
        doc = copy.deepcopy(HOSTILE_BASE)
        replaced(doc, path, "value", evil)
        raw = frame_bytes(view_of(doc), width=220)  # the failure line on one line
        assert_terminal_safe(raw)
        text = SGR.sub("", raw)
        if path[-1] == "namespace":
            assert "Transfers" in text and "namespace '\\x1b]0;PWNED\\x07" in text, text
        else:
            where = "$" + "".join(f"[{step}]" if isinstance(step, int) else f".{step}" for step in path)
            assert f"cannot read: Expected `{'float' if path[-1] == 'threshold' else 'int'}`, got `str` - at `{where}`" \
                in text and "Transfers" not in text, (path, text)


# Bodies as a hostile or broken sidecar would send them, from the review's fake sidecar.
def _hostile_body(mode: str) -> bytes:
    doc = copy.deepcopy(HOSTILE_BASE)
    text = json.dumps(doc)
    if mode == "inf_uptime":
        return text.replace('"uptime_seconds": 192.0', '"uptime_seconds": 1e999').encode()
    if mode == "nan_uptime":
        doc["sidecar"]["uptime_seconds"] = float("nan")
    elif mode == "bigint":  # 400 digits: json reads it; float() of it overflows
        return text.replace('"frames_received": 1234', '"frames_received": ' + "9" * 400).encode()
    elif mode == "hugeint":  # 5,000 digits: past Python's int conversion limit, json.loads raises ValueError
        return text.replace('"frames_received": 1234', '"frames_received": ' + "9" * 5000).encode()
    elif mode == "deep":
        return b"[" * 200_000 + b"]" * 200_000
    elif mode == "deepobj":
        return b'{"api_version": 1, "a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    elif mode == "inf_total":
        doc["rollups"][0]["total"] = float("inf")
    elif mode == "wrongtype":
        doc["ranks"] = "abc"
    elif mode == "sidecar_list":
        doc["sidecar"] = []
    elif mode == "toplist":
        return b"[1, 2]"
    return json.dumps(doc).encode()


@pytest.mark.parametrize("mode, said", [
    ("deep", "JSON that is not an object"), ("deepobj", "nested too deeply"), ("toplist", "JSON that is not an object"),
    ("nan_uptime", "did not send JSON"), ("inf_total", "did not send JSON"),  # NaN, Infinity: not JSON
    ("inf_uptime", "cannot read: Number out of range - at `$.sidecar.uptime_seconds`"),
    ("hugeint", "cannot read: Integer value out of range - at `$.sidecar.frames_received`"),
    ("wrongtype", "cannot read: Expected `array`, got `str` - at `$.ranks`"),
    ("sidecar_list", "cannot read: Expected `object`, got `array` - at `$.sidecar`"),
])
def test_a_body_that_is_not_a_status_document_is_one_failure_line(answering: tuple[str, list[bytes]], mode: str,
                                                                   said: str) -> None:
    url, responses = answering
    responses.append(_response("200 OK", _hostile_body(mode)))
    result = fetch_status(build_target(url, env={}), timeout=5)
    assert isinstance(result, FetchFailed) and result.kind is FailureKind.INVALID, result
    assert said in result.line and "\n" not in result.line and len(result.line) < 400, result.line


def test_a_value_the_model_takes_and_the_screen_cannot_show_breaks_one_section_in_one_red_line(
        answering: tuple[str, list[bytes]]) -> None:
    url, responses = answering
    responses.append(_response("200 OK", _hostile_body("bigint")))  # 400 digits: an int; float() of it overflows
    result = fetch_status(build_target(url, env={}), timeout=5)
    assert isinstance(result, Fetched), result
    view = View(build_target(url, env={}), interval=2.0)
    view.update(result)
    raw = frame_bytes(view)
    assert_terminal_safe(raw)
    lines = SGR.sub("", raw).splitlines()
    assert lines[0].startswith("hicache-exporter top  http://127.0.0.1:") and "read " in lines[0]
    cannot = {line.split(" section")[0].removeprefix("cannot show the ") for line in lines
              if line.startswith("cannot show")}
    assert cannot == {"Sidecar"}, lines  # once by each of the two prints
    for section in ("Ranks", "Transfers", "Reasons", "Replica spread", "Upstreams"):
        assert any(line.startswith(section) for line in lines), (section, lines)


def test_the_poller_reports_whatever_a_poll_raises_and_keeps_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    from exporter.top import screen

    calls: list[int] = []

    def fetch(target: Target, timeout: float) -> Fetched:
        calls.append(1)
        if len(calls) == 1:
            raise RecursionError("maximum recursion depth exceeded")
        return Fetched(typed(HOSTILE_BASE), at=NOW, seconds=0.0)

    monkeypatch.setattr(screen, "fetch_status", fetch)
    wake_read, wake_write = os.pipe()
    poller = screen.Poller(TARGET, 0.01, 1.0, wake_write)
    seen: list[Any] = []
    try:
        poller.start()
        deadline = time.monotonic() + 5
        while len(seen) < 2 and time.monotonic() < deadline:
            result = poller.take()
            if result is not None:
                seen.append(result)
            time.sleep(0.005)
    finally:
        poller.stop()
        poller.join(2)
        os.close(wake_read)
        os.close(wake_write)
    assert isinstance(seen[0], FetchFailed) and "RecursionError" in seen[0].line, seen
    assert isinstance(seen[1], Fetched), "it polls on after a poll that raised"


def test_a_password_in_the_url_is_warned_about_on_stderr() -> None:
    port = free_port()
    said = subprocess.run([*CLI, "top", "--once", "--url", f"http://prom:s3cret@127.0.0.1:{port}"],
                          capture_output=True, text=True, timeout=30)
    warnings = [line for line in said.stderr.splitlines() if "process list" in line]
    assert len(warnings) == 1 and "s3cret" not in said.stderr and ENV_PASSWORD in warnings[0], said.stderr
    quiet = subprocess.run([*CLI, "top", "--once", "--url", f"http://127.0.0.1:{port}"],
                           capture_output=True, text=True, timeout=30)
    assert "process list" not in quiet.stderr


def test_profiles_besides_the_default_are_shown_with_their_namespaces_escaped() -> None:
    doc = copy.deepcopy(HOSTILE_BASE)
    doc["sidecar"]["profiles"] = [{"name": "sglang", "namespace": "sglang_", "families": 32},
                                  {"name": "lmcache", "namespace": "lmcache_", "families": 94},
                                  {"name": "x\x1b]0;PWNED\x07", "namespace": "\x1b[2J", "families": 1}]
    raw = frame_bytes(view_of(doc), width=260)
    assert_terminal_safe(raw)
    text = SGR.sub("", raw)
    assert "namespace 'sglang_' · lmcache 'lmcache_' · x\\x1b]0;PWNED\\x07 '\\x1b[2J'" in text, text
