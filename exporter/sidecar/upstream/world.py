"""An upstream's expected world: its configured `world:`, completed by the engine's storage labels,
and judged against the ranks a read lists.

The engine's storage series carry `pp_size` and `attn_cp_size` (SGLang 0.5.23
mem_cache/unified_cache/storage_attachment.py); they fill in what the config leaves out (1 where
neither says). The attention tp size is the engine's (runtime_context.derive_attn_tp_size):
tp_size / (dp_size x attn_cp_size) with DP attention, tp_size / attn_cp_size without.

A configured world is not trusted where a read contradicts it: a storage label that says another
pp_size or attn_cp_size (or two of them), a tp_size the attention sizes do not divide, or a rank
whose position lies outside the world (its tp_rank past the attention tp size for collectors that
label the attention tp rank under DP attention, past tp_size for the engine's tp rank, which the
scheduler labels and, without DP attention, every collector; its pp, dp or cp rank past its size).
Nor is a layout one /metrics cannot tell apart: DP-controller replicas (their radix and storage series
all say dp_rank 0) and context-parallel peers under DP attention with no storage series to name their
cp rank. Then nothing is expected of the upstream: a world that the engine's own labels deny would
count ranks missing that are not. Each read is judged anew, so a contradiction clears with
the first read that has none (the engine restarted with the configured layout, or the series that
contradicted it are gone).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from exporter.catalog import StreamSpec
from exporter.config import UpstreamWorld
from exporter.labels import rank_axis
from exporter.protocol.messages import RankId, World
from exporter.sidecar.core.keys import StaticKey
from exporter.sidecar.core.servers import Layout, stream_kind

# The sizes the engine's storage series carry as labels, as UpstreamWorld names them.
LABELLED_SIZES = ("pp_size", "attn_cp_size")
# A judgement lists at most this many problems (one line each): the grouping below makes at most
# eight kinds of them, so none is left out; the cap holds whatever comes later.
WORLD_PROBLEMS_LISTED = 8
VALUES_LISTED = 4  # rank numbers or label values named per problem; the rest are counted
MAX_PROBLEM_CHARS = 240  # no line of upstream text reaches /api/v1/status or the log unbounded
MAX_VALUE_CHARS = 24  # a label value quoted in a problem


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a read makes of an upstream's configured world."""

    world: World | None  # the world its ranks are expected in; None: none configured, or not trusted
    shown: World | None  # the configured world completed by the labels, trusted or not: for people
    problems: tuple[str, ...] = ()  # where the read contradicts it (then `world` is None)


NO_WORLD = Judgement(None, None)


def judge(configured: UpstreamWorld | None, ranks: Iterable[tuple[RankId, StaticKey]],
          streams: Mapping[str, StreamSpec]) -> Judgement:
    """The world `ranks` (each rank's axes and static labels, as one read lists them) are expected in."""
    if configured is None:
        return NO_WORLD
    listed = list(ranks)
    problems: list[str] = []
    said = _labelled_sizes(listed)
    sizes: dict[str, int] = {}
    assumed: set[str] = set()  # sizes neither configured nor labelled: 1
    for name in LABELLED_SIZES:
        numbers, bad = said[name]
        value: int | None = getattr(configured, name)
        if bad:
            problems.append(f"the engine's storage series say {name}={_values(bad)}, which is not a size")
        if value is not None and any(n != value for n in numbers):
            problems.append(f"{name} is configured {value}, the engine's storage series say {_values(numbers)}")
        elif value is None and len(numbers) > 1:
            problems.append(f"the engine's storage series say {name} {_values(numbers)}: one server has one")
        sizes[name] = value if value is not None else min(numbers, default=1)
        if value is None and not numbers:
            assumed.add(name)
    tp, dp, pp, cp = configured.tp_size, configured.dp_size, sizes["pp_size"], sizes["attn_cp_size"]
    attention_dp = dp if configured.dp_attention else 1
    if tp % (attention_dp * cp):
        by = f"dp_size {dp} x attn_cp_size {cp} (DP attention)" if configured.dp_attention else f"attn_cp_size {cp}"
        problems.append(f"tp_size {tp} is not a multiple of {by}")
    if dp > 1 and not configured.dp_attention:
        # SGLang's radix and storage collectors label every DP-controller replica dp_rank 0
        # (metrics_collector.py:2423-2426, cache_controller.py:755-763): one /metrics cannot tell them apart.
        problems.append(f"dp_size {dp} without DP attention: the engine labels every replica's radix and storage "
                        "series dp_rank 0, so its replicas cannot be told apart here (push through the stat-logger "
                        "hook, which can)")
    if configured.dp_attention and cp > 1 and not said["attn_cp_size"][0]:
        # Under DP attention the radix series carry no cp rank (metrics_collector.py:2416): without storage
        # series naming attn_cp_rank, the cp peers of a rank read as one.
        problems.append(f"attn_cp_size {cp} with DP attention, and no storage series: the engine's radix series "
                        "carry no attn_cp_rank, so context-parallel peers cannot be told apart here")
    attn_tp = max(tp // (attention_dp * cp), 1)
    world = World(tp_size=tp, pp_size=pp, dp_size=dp, attn_tp_size=None if attn_tp == tp else attn_tp, attn_cp_size=cp)
    problems += _outside(world, attn_tp, listed, streams, assumed)
    if not problems:
        return Judgement(world, world)
    return Judgement(None, world, tuple(p if len(p) <= MAX_PROBLEM_CHARS else p[:MAX_PROBLEM_CHARS - 3] + "..."
                                        for p in problems[:WORLD_PROBLEMS_LISTED]))


def _labelled_sizes(ranks: list[tuple[RankId, StaticKey]]) -> dict[str, tuple[list[int], list[str]]]:
    """Per labelled size: the distinct sizes the ranks' labels say, ascending, and the values that are no size."""
    found: dict[str, set[str]] = {name: set() for name in LABELLED_SIZES}
    for _, static in ranks:
        for name, value in static:
            if name in found:
                found[name].add(value)
    out: dict[str, tuple[list[int], list[str]]] = {}
    for name, values in found.items():
        numbers = {number for value in values if (number := rank_axis(value)) is not None and number >= 1}
        bad = sorted(value for value in values if (rank_axis(value) or 0) < 1)
        out[name] = (sorted(numbers), bad)
    return out


def _outside(world: World, attn_tp: int, ranks: list[tuple[RankId, StaticKey]],
             streams: Mapping[str, StreamSpec], assumed: set[str]) -> list[str]:
    """One problem per axis (and kind of tp rank) that some listed rank has past the world's size."""
    found: dict[tuple[str, str, int], tuple[set[int], set[str]]] = {}
    # Without DP attention every collector labels the engine's tp rank (radix_cache_metric_labels: tp_rank),
    # which runs to tp_size; under DP attention only the scheduler's does.
    engine_tp_everywhere = Layout.of(world).engine_tp_everywhere
    for rank, static in ranks:
        kind, spec = stream_kind(static, streams)
        tp_bound = ("tp_size", world.tp_size) if engine_tp_everywhere or spec is not None and spec.tp_rank == "global" \
            else ("attention tp size", attn_tp)
        for axis, number, (bound_name, bound) in (
            ("tp_rank", rank.tp_rank, tp_bound),
            ("pp_rank", rank.pp_rank, ("pp_size", world.pp_size)),
            ("dp_rank", rank.dp_rank, ("dp_size", world.dp_size)),
            ("attn_cp_rank", rank.attn_cp_rank or 0, ("attn_cp_size", world.attn_cp_size)),
        ):
            if number >= bound:
                numbers, kinds = found.setdefault((axis, bound_name, bound), (set(), set()))
                numbers.add(number)
                kinds.add(kind)
    order = ("tp_rank", "pp_rank", "dp_rank", "attn_cp_rank")
    return [f"{' and '.join(sorted(kinds))} series have {axis} {_values(sorted(numbers))}, outside the world's "
            f"{bound_name} {bound}" + (" (not configured, and no storage series says it)" if bound_name in assumed else "")
            for (axis, bound_name, bound), (numbers, kinds) in sorted(found.items(), key=lambda item: (
                order.index(item[0][0]), item[0][1]))]


def _values(values: list[int] | list[str]) -> str:
    """At most VALUES_LISTED values (label values quoted and cut), and how many there are in all."""
    shown = [str(v) if isinstance(v, int) else repr(v if len(v) <= MAX_VALUE_CHARS else v[:MAX_VALUE_CHARS] + "...")
             for v in values[:VALUES_LISTED]]
    more = f" ({len(values)} in all)" if len(values) > VALUES_LISTED else ""
    return ", ".join(shown) + more
