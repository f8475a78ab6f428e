"""The status document as its views read it, decided once (DESIGN section 17).

The sidecar's page (exporter.sidecar.expose.page) and `hicache-exporter top` (exporter.top.render)
draw the same document; what they show of it is decided here, and each medium only writes it in
its own form: the order of the states, a stream's identity text, what references by id resolve to,
the grid's caps and what a cut grid leaves out, the rejections in order, the tier transfers
with their bandwidth, and the prefill shares with the cost per hit token. The sidecar builds the
document with the same pieces (`cell_id`, the caps, `identity_text`). Only the model
(exporter.api.v1) and the standard library are imported, so `top` reads it without the sidecar's
runtime.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import get_args

from exporter.api import v1

STREAM_STATES: tuple[str, ...] = get_args(v1.RankStateName)  # live, stale, departed, expired: liveliest first
MISSING = "missing"  # a rank (position) its server's world expects and no unexpired stream reports for
CELL_STATES: tuple[str, ...] = get_args(v1.CellState)  # the stream states, then missing
# A cell lists its streams by kind in this order (the sglang profile's collectors), pushed clients and
# other kinds after them, by name.
KIND_ORDER = ("radix", "storage", "scheduler", "client")
# What the grid of a replica group draws is bounded once (the sidecar's status.grid_model, and `top`,
# which bounds a document listing past them alike): at most these many cells per dp group, and over the
# document; 1,024 is ranks.max_ranks's default, so a plausible world's group is drawn whole.
GRID_CELLS_PER_GROUP = 1024
GRID_CELLS = 4096


def escaped(value: str) -> str:
    """A label value as /metrics writes it: backslash, quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def quoted_labels(labels: Iterable[tuple[str, str]]) -> tuple[str, ...]:
    """Labels as Prometheus writes them, `name="value"`: unambiguous, so two label sets never read alike
    (`a="1 b=2"` is not `a="1" b="2"`)."""
    return tuple(f'{name}="{escaped(value)}"' for name, value in labels)


def label_text(labels: Mapping[str, str]) -> str:
    """Labels as /metrics quotes them, space-separated; "" when there are none."""
    return " ".join(quoted_labels(labels.items()))


def identity_text(tp_rank: int, pp_rank: int, dp_rank: int, attn_cp_rank: int | None,
                  static: Iterable[tuple[str, str]]) -> str:
    """A rank identity as people read it: `tp=.. pp=.. dp=.. [cp=..]`, then its static labels, quoted."""
    cp = () if attn_cp_rank is None else (f"cp={attn_cp_rank}",)
    return " ".join((f"tp={tp_rank}", f"pp={pp_rank}", f"dp={dp_rank}", *cp, *quoted_labels(static)))


def server_id(index: int) -> str:
    """A server's id in the document, by its place among the servers: `v0`, `v1`, ..."""
    return f"v{index}"


def cell_id(server: str, dp_rank: int, pp_rank: int, attn_cp_rank: int, tp_rank: int) -> str:
    """A rank cell's id in the document: `v0/dp=1,pp=0,cp=0,tp=1`."""
    return f"{server}/dp={dp_rank},pp={pp_rank},cp={attn_cp_rank},tp={tp_rank}"


class Names:
    """What the document writes once and references by id (label sets, groups, streams, rank cells), read back."""

    def __init__(self, doc: v1.StatusDocument) -> None:
        self.labels: dict[str, Mapping[str, str]] = {s.id: s.labels for s in doc.label_sets}
        self.groups: dict[str, v1.Group] = {g.id: g for g in doc.groups}
        self.streams: dict[str, v1.Stream] = {s.id: s for s in doc.streams}
        self.cells: dict[str, v1.RankCell] = {c.id: c for c in doc.ranks}

    def group_text(self, group: v1.Group) -> str:
        """A replica group: `dp=<n> name="value" ...`."""
        return " ".join((f"dp={group.dp_rank}", *quoted_labels(self.labels[group.label_set].items())))

    def stream_labels(self, stream: v1.Stream) -> dict[str, str]:
        """Every static label of a stream's identity (its group's, then its own), in name order."""
        labels = {**self.labels[self.groups[stream.group].label_set], **stream.own_labels}
        return dict(sorted(labels.items()))

    def identity(self, stream: v1.Stream) -> str:
        """A stream's full identity: its axes as labelled, then every static label in name order (`identity_text`)."""
        return identity_text(stream.tp_rank, stream.pp_rank, stream.dp_rank, stream.attn_cp_rank,
                             self.stream_labels(stream).items())

    def server_labels(self, server: v1.Server) -> Mapping[str, str]:
        """The labels a server's streams share (less what their collectors add)."""
        return self.labels[server.label_set]

    def rank_elsewhere(self, stream: v1.Stream) -> v1.RankCell | None:
        """The drawn cell a stream reports for where its labelled tp (or cp) rank is not the cell's: a
        scheduler's global tp rank; None where they agree or the cell is not drawn."""
        cell = self.cells.get(stream.rank)
        if cell is None or (cell.tp_rank, cell.attn_cp_rank) == (stream.tp_rank, stream.attn_cp_rank or 0):
            return None
        return cell

    def cell_streams(self, cell: v1.RankCell) -> list[v1.Stream]:
        """The streams a cell lists, in KIND_ORDER (other kinds after, by name)."""
        return sorted((self.streams[s] for s in cell.streams if s in self.streams), key=kind_order)


def kind_order(stream: v1.Stream) -> tuple[int, str]:
    """Where a stream's kind sorts in a cell."""
    return (KIND_ORDER.index(stream.kind) if stream.kind in KIND_ORDER else len(KIND_ORDER), stream.kind)


def streams_by_state(sidecar: v1.Sidecar) -> list[tuple[str, int]]:
    """Known streams by state, in STREAM_STATES order, zeros included."""
    return [(state, getattr(sidecar.streams_by_state, state)) for state in STREAM_STATES]


def rejections(sidecar: v1.Sidecar) -> list[tuple[str, int]]:
    """The rejection reasons that counted something, the largest first, ties by name."""
    return sorted(((reason, n) for reason, n in sidecar.rejections.items() if n), key=lambda item: (-item[1], item[0]))


def cells_by_group(doc: v1.StatusDocument) -> dict[tuple[str, int], dict[tuple[int, int, int], v1.RankCell]]:
    """The drawn rank cells by (server id, dp rank), then by (pp, cp, tp)."""
    out: dict[tuple[str, int], dict[tuple[int, int, int], v1.RankCell]] = {}
    for cell in doc.ranks:
        out.setdefault((cell.server, cell.dp_rank), {})[(cell.pp_rank, cell.attn_cp_rank, cell.tp_rank)] = cell
    return out


@dataclass(frozen=True, slots=True)
class GridCut:
    """What a dp group's grid leaves out, with exact counts."""

    rows: int
    row_count: int
    columns: int
    column_count: int
    hidden_ranks: int


def grid_cut(grid: v1.Grid) -> GridCut | None:
    """What a grid leaves out of its dp group (the sidecar caps it); None when it draws it whole."""
    rows, columns = len(grid.rows), len(grid.tp_ranks)
    if rows == grid.row_count and columns == grid.column_count:
        return None
    return GridCut(rows, grid.row_count, columns, grid.column_count, grid.hidden_ranks)


@dataclass(frozen=True, slots=True)
class TransferRow:
    """One tier transfer as views list it: its name (with its profile's where the sidecar serves several),
    its tiers, totals, active bandwidth and bandwidth history (empty without a bytes/duration pair)."""

    name: str
    source: str
    target: str
    tokens: float | None
    bytes: float | None
    bytes_per_second: float | None
    history: list[float | None]


def transfer_rows(doc: v1.StatusDocument) -> list[TransferRow]:
    """Every transfer of every profile the sidecar serves, in the document's order."""
    history = {family.transfer: family.history for family in doc.bandwidth.families if family.transfer is not None}
    default = doc.sidecar.profiles[0].name if doc.sidecar.profiles else None
    return [TransferRow(
        name=t.name if t.profile in (None, default) else f"{t.profile} {t.name}",
        source=t.source, target=t.target, tokens=t.tokens, bytes=t.bytes, bytes_per_second=t.bytes_per_second,
        history=[point[1] for point in history.get(t.name, ())],
    ) for t in doc.transfers]


# --- prefill: where prefill tokens come from, and what a hit costs (DESIGN section 18) ---

# The bar's order, the nearest tier first: a profile that tells host hits from storage hits, and one that cannot.
PREFILL_KINDS = ("device", "host", "storage", "computed")
PREFILL_KINDS_TOGETHER = ("device", "offload", "computed")


def percent(share: float) -> str:
    """A share as people read it: whole percents, half up; `<1 %` for a share that is not 0 but rounds to it."""
    value = share * 100
    if 0 < value < 0.5:
        return "<1 %"
    return f"{math.floor(value + 0.5)} %"


def _significant(value: float, units: Sequence[tuple[float, str]]) -> str:
    """`value` in the largest unit it reaches (the first unit otherwise), three significant digits."""
    size, unit = units[0]
    for size_, unit_ in units:
        if abs(value) >= size_:
            size, unit = size_, unit_
    scaled = value / size
    digits = 0 if abs(scaled) >= 100 else 1 if abs(scaled) >= 10 else 2
    return f"{scaled:.{digits}f} {unit}"


def bytes_text(value: float) -> str:
    """Bytes in binary units, three significant digits: `13.3 B`, `160 KiB`."""
    return _significant(value, ((1, "B"), (1 << 10, "KiB"), (1 << 20, "MiB"), (1 << 30, "GiB"), (1 << 40, "TiB")))


def seconds_text(value: float) -> str:
    """A short duration, three significant digits: `3.33 µs`, `12.0 ms`, `1.50 s`."""
    return _significant(value, ((1e-9, "ns"), (1e-6, "µs"), (1e-3, "ms"), (1.0, "s")))


def transfer_words(name: str | None) -> str:
    """A transfer's name as words: `load back`, `storage backup`."""
    return "–" if name is None else name.replace("_", " ")


def tier_cost_text(cost: v1.TierCost, transfers: v1.TierTransfers) -> str:
    """What a tier's hits cost, per hit token: what its read transfer moved and took, and what its fill
    transfer wrote; a tier that was written and never hit says so. Empty when there is nothing to say."""
    parts = []
    read = [text for value, fmt in ((cost.bytes_per_hit_token, bytes_text), (cost.seconds_per_hit_token, seconds_text))
            if value is not None for text in (fmt(value),)]
    if transfers.read_transfer is not None and read:
        parts.append(f"{transfer_words(transfers.read_transfer)} {' · '.join(read)}")
    if transfers.fill_transfer is not None:
        if cost.fill_bytes_per_hit_token is not None:
            parts.append(f"{transfer_words(transfers.fill_transfer)} writes {bytes_text(cost.fill_bytes_per_hit_token)}")
        elif cost.fill_bytes:
            parts.append(f"{transfer_words(transfers.fill_transfer)} wrote {bytes_text(cost.fill_bytes)}, no hit")
    if not parts:
        return ""
    return "; ".join(parts) + (" per hit token" if read or cost.fill_bytes_per_hit_token is not None else "")


@dataclass(frozen=True, slots=True)
class ShareSegment:
    """One kind of prefill token as the views show it: its share of all, that share as text, its tokens and
    (for a tier with transfers) what a hit cost."""

    kind: str
    share: float
    percent: str
    tokens: float
    cost: str


def prefill_segments(figures: v1.PrefillFigures, tiers: v1.TiersTransfers) -> list[ShareSegment]:
    """The bar of one scope: device, host, storage hits (or offload, where the profile cannot tell those two
    apart), then what was computed; [] with no prefill token."""
    tokens = figures.tokens
    if tokens.total <= 0:
        return []
    ratio = figures.hit_ratio
    shares = {"device": ratio.device, "host": ratio.host, "storage": ratio.storage, "offload": ratio.offload,
              "computed": figures.computed_ratio}
    counted = {"device": tokens.device, "host": tokens.host, "storage": tokens.storage, "offload": tokens.offload,
               "computed": tokens.computed}
    costs = {kind: tier_cost_text(cost, transfers) for kind, cost, transfers in (
        ("host", figures.cost.host, tiers.host), ("storage", figures.cost.storage, tiers.storage),
        ("offload", figures.cost.offload, tiers.offload)) if cost is not None and transfers is not None}
    kinds = PREFILL_KINDS if tokens.host is not None else PREFILL_KINDS_TOGETHER
    return [ShareSegment(kind=kind, share=share, percent=percent(share), tokens=counted[kind] or 0.0,
                         cost=costs.get(kind, ""))
            for kind in kinds for share in (shares[kind] or 0.0,)]


NO_PREFILL = "no prefill token counted yet"


def shares_text(segments: Sequence[ShareSegment]) -> str:
    """`device 61 % · host 22 % · storage 7 % · computed 10 %`."""
    return " · ".join(f"{s.kind} {s.percent}" for s in segments) or NO_PREFILL
