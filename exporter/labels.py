"""Rank labels: the upstream label rule, and the one split and checks of the client, the stat-logger
hook, the proxy's feed and the sidecar's hello (split_rank_labels, rank_axis_problem,
static_label_problem, own_labels_problem, label_name_problem)."""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from typing import Any

from exporter.errors import LabelError
from exporter.protocol.messages import MAX_RANK

RANK_KEYS: tuple[str, str, str] = ("tp_rank", "pp_rank", "dp_rank")
# Rank axes a rank may leave out: absent means 0 in its identity, and no such label is exposed
# (the engine's radix series carry no attn_cp_rank, its storage series do).
OPTIONAL_RANK_KEYS: tuple[str] = ("attn_cp_rank",)
RANK_AXES: tuple[str, ...] = (*RANK_KEYS, *OPTIONAL_RANK_KEYS)
LABEL_NAME_RE = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
# Names Prometheus gives meaning to, or that the exposition adds itself.
RESERVED_LABEL_NAMES: frozenset[str] = frozenset({"le", "quantile", "__name__", *RANK_AXES})
# One spelling per rank number: "0", or ASCII digits without a leading zero. int() would also take
# a sign, spaces, underscores and non-ASCII digits ("+2", " 3", "1_0", "٣"), which would merge
# differently spelled series into one rank.
_RANK_AXIS_RE = re.compile(r"0|[1-9][0-9]{0,5}")
# The largest rank number is the wire protocol's (MAX_RANK - 1 = 65535): a pushed rank and an
# upstream's series must be able to name the same ranks, and 65,536 ranks per axis is far above any
# engine's parallelism (thousands of GPUs at most), so a larger number is a broken label, not a rank.
MAX_RANK_AXIS = MAX_RANK - 1


def radix_cache_metric_labels(
    cache_type: str, parallel: Any, dp_attention_enabled: bool
) -> dict[str, Any]:
    """Rank labels of one cache, exactly as the upstream engine derives them.

    With DP attention the KV cache is split by attention domain, so the rank inside that
    domain is what identifies a shard; without it every rank is its own tp_rank and dp_rank is 0.
    The keys match the storage (L3) collector's so one rank's L2 and L3 series line up.
    """
    if dp_attention_enabled:
        tp_rank, dp_rank = parallel.attn_tp_rank, parallel.attn_dp_rank
    else:
        tp_rank, dp_rank = parallel.tp_rank, 0
    return {
        "cache_type": cache_type,
        "tp_rank": tp_rank,
        "pp_rank": parallel.pp_rank,
        "dp_rank": dp_rank,
    }


def rank_axis(text: str) -> int | None:
    """A rank axis label value as its number: "0" or a decimal without a leading zero, up to MAX_RANK_AXIS; else None."""
    if not _RANK_AXIS_RE.fullmatch(text):  # fullmatch: match() would let a trailing newline through
        return None
    number = int(text)
    return number if number <= MAX_RANK_AXIS else None


def _rank_number(value: Any) -> int | None:
    """A rank axis given as a label string (see rank_axis) or as an int, as its number; else None."""
    if isinstance(value, str):
        return rank_axis(value)
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_RANK_AXIS:
        return value
    return None


def split_rank_labels(
    labels: Mapping[str, Any], own: Collection[str] = ()
) -> tuple[dict[str, int], dict[str, str]]:
    """A series' labels as (rank axes as numbers, static labels as strings): the one split of the client,
    the stat-logger hook and the proxy. A static label is neither a rank axis nor one of the family's
    `own` labels, and an empty one is none (Prometheus drops a label whose value is empty, so the
    sidecar refuses it as a static label); the optional axes only when present.

    Raises LabelError (a ValueError) for a missing tp_rank, pp_rank or dp_rank, or an axis that is no
    rank number (rank_axis_problem)."""
    missing = [key for key in RANK_KEYS if key not in labels]
    if missing:
        raise LabelError(f"rank labels {missing} are missing; a rank has {list(RANK_KEYS)}")
    rank: dict[str, int] = {}
    for key in RANK_AXES:
        if key in labels:
            number = _rank_number(labels[key])
            if number is None:
                raise LabelError(_rank_axis_message(key, labels[key]))
            rank[key] = number
    static = {str(k): str(v) for k, v in labels.items() if k not in RANK_AXES and k not in own and str(v)}
    return rank, static


def linear_rank_axes(worker: int, tp_size: int | None, cp_size: int = 1) -> dict[str, int]:
    """The rank axes of a replica-local linear rank laid out as vLLM lays out its workers,
    (pp_rank * cp_size + cp_rank) * tp_size + tp_rank (vllm/distributed/parallel_state.py:2045-2060);
    without a tp size, every worker is a tp rank of one stage. dp_rank is not in it: 0."""
    if tp_size is None:
        return {"tp_rank": worker, "pp_rank": 0, "dp_rank": 0}
    axes = {"tp_rank": worker % tp_size, "pp_rank": worker // (tp_size * cp_size), "dp_rank": 0}
    if cp_size > 1:
        axes["attn_cp_rank"] = (worker // tp_size) % cp_size
    return axes


def label_name_problem(name: str) -> str | None:
    """Why `name` cannot be a static label name, or None when it can."""
    if not LABEL_NAME_RE.fullmatch(name):  # match() would let a trailing newline through
        return f"label name {name!r} must match [a-zA-Z_][a-zA-Z0-9_]*"
    if name in RESERVED_LABEL_NAMES:
        return f"label name {name!r} is reserved"
    if name.startswith("__"):
        return f"label name {name!r} starts with '__', which Prometheus reserves"
    return None


def _rank_axis_message(key: str, value: Any) -> str:
    shown = repr(value) if len(repr(value)) <= 42 else repr(str(value)[:40]) + f"... ({len(str(value))} characters)"
    return (f"rank label {key}={shown} must be a whole number from 0 to {MAX_RANK_AXIS}, "
            "in ASCII digits without a sign, spaces, underscores or a leading zero")


def rank_axis_problem(key: str, value: Any) -> str | None:
    """Why `value` (a label string or an int) cannot be the rank axis `key`, or None when it can; a long
    value is cut in the message, which goes to logs."""
    return None if _rank_number(value) is not None else _rank_axis_message(key, value)


def static_label_problem(
    name: str, value: str, *, family_labels: Collection[str] = (), max_value_length: int | None = None
) -> str | None:
    """Why `name`=`value` cannot be a rank's static label, or None when it can: the one rule of the
    client and the sidecar's hello. `family_labels` are the catalog families' own label names; the
    sidecar's configured value length limit applies where it is known."""
    problem = label_name_problem(name)
    if problem is None and name in family_labels:
        problem = f"label name {name!r} is a family label in the catalog"
    if problem is None and not value:
        # Prometheus drops a label whose value is empty: two identities would expose as one.
        problem = f"label {name!r} has an empty value; leave the label out instead"
    if problem is None and max_value_length is not None and len(value) > max_value_length:
        problem = f"value of label {name!r} is longer than {max_value_length} characters"
    return problem


def own_labels_problem(family: str, names: Collection[str], given: Collection[str]) -> str | None:
    """Why a sample of `family`, whose own labels are `names`, cannot carry the labels `given`, or None."""
    if set(given) != set(names):
        return f"{family!r} takes labels {list(names)}, got {sorted(given)}"
    return None
