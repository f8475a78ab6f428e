"""The series budget's weights (keys.series_cost): what a series' labels write on its lines, and the budget
holding exactly the weights of the series and rollup cells the state holds."""

from __future__ import annotations

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exporter.catalog import MetricType, default_catalog
from exporter.config import RanksConfig
from exporter.errors import ProtocolError
from exporter.sidecar.core.keys import (
    LABEL_CHARS_PER_UNIT,
    HistAccumulator,
    SeriesKey,
    Value,
    histogram_cost,
    label_chars,
    label_width,
    line_chars,
    scalar_lines,
    series_cost,
)
from exporter.sidecar.core.ranks import RankState
from exporter.sidecar.expose.render import label_text
from tests.exporter.sidecar.harness import (
    BYTES,
    DURATION,
    PGS,
    TOKENS,
    USED,
    Harness,
    bytes_,
    dropped,
    hist,
    layout,
    one_hot,
    tokens,
    used,
)

CATALOG = default_catalog()
AXES = {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}


# --- what labels write ---


def test_label_chars_are_what_the_exposition_writes() -> None:
    """Per label its name, its escaped value, `=`, two quotes and a comma: the renderer's text, whose
    labels are joined by one comma fewer."""
    for labels in ({"a": "bc"}, {"cache_type": "HiRadixCache", **AXES}, {"x": 'q"b\\s\nn', "é": "ā😀"}):
        assert label_chars(labels.items()) == len(label_text(labels)) + 1
    assert label_chars([("a", "bc")]) == 7
    assert label_chars([("x", 'q"b\\s\nn')]) == 1 + 7 + 3 + 4  # a quote, a backslash and a newline take two
    assert label_chars([]) == 0


def test_label_width_is_the_width_a_string_of_them_is_held_at() -> None:
    assert label_width([]) == 1
    assert label_width([("a", "b"), ("c", "é")]) == 1  # Latin-1
    assert label_width([("a", "b"), ("c", "ā")]) == 2
    assert label_width([("a", "b"), ("c", "a😀")]) == 4
    assert line_chars(100, 1, 20, 4) == 480 and line_chars(100, 2, 20, 1) == 240 and line_chars(100, 1, 20, 1) == 120


def test_scalar_lines() -> None:
    """A gauge's rank series accounts for the rollup line made of it, a replicated counter's for its group's
    spread line; a per_shard counter writes its line alone."""
    assert scalar_lines(CATALOG.get(BYTES)) == 1
    assert scalar_lines(CATALOG.get(TOKENS)) == 2
    assert scalar_lines(CATALOG.get(USED)) == 2


# --- weights ---


def _chars(static: dict[str, str], own: dict[str, str] | None = None, axes: dict[str, str] = AXES) -> int:
    rank = {**axes, **static}.items()
    return line_chars(label_chars(rank), label_width(rank), label_chars((own or {}).items()), label_width((own or {}).items()))


ORDINARY = {  # a radix stream, a scheduler stream with a 60-character model path, LMCache with a snapshot path
    "radix": {"cache_type": "HiRadixCache"},
    "scheduler": {"model_name": "/models/meta-llama/Llama-3.1-70B-Instruct-FP8-dynamic/v2.0.1", "engine_type": "unified",
                  "priority": "0"},
    "lmcache": {"model_name": "/models/Qwen/Qwen3-8B", "served_model_name": "qwen3-8b", "role": "worker"},
}


def test_ordinary_labels_weigh_a_counter_or_gauge_1() -> None:
    assert len(ORDINARY["scheduler"]["model_name"]) == 60
    for name, static in ORDINARY.items():
        for spec in CATALOG:
            if spec.type is MetricType.HISTOGRAM:
                continue
            own = {label: "write_through_unbacked_eviction" for label in spec.labels}
            chars = _chars(static, own, {**AXES, "attn_cp_rank": "0"})
            assert series_cost(None, chars, scalar_lines(spec)) == 1, (name, spec.name, chars)


def test_the_catalogs_histograms_of_a_radix_stream_weigh_their_buckets() -> None:
    chars = _chars(ORDINARY["radix"])
    assert chars == 62
    for spec in CATALOG:
        if spec.type is MetricType.HISTOGRAM:
            assert series_cost(layout(spec.name), chars) == histogram_cost(layout(spec.name)), spec.name


def test_series_cost_exact_values() -> None:
    assert LABEL_CHARS_PER_UNIT == 512
    assert [series_cost(None, chars) for chars in (0, 1, 512, 513, 1024, 1025)] == [1, 1, 1, 2, 2, 3]
    assert [series_cost(None, chars, 2) for chars in (256, 257, 512, 513)] == [1, 2, 2, 3]
    # The longest labels the limits allow: 8 static values of 288 (max_static_label_chars 2,304 over 8), two of
    # the family's own of 128: 2,662 characters a line.
    longest = _chars({f"l{i}": "v" * 288 for i in range(8)}, {"reason": "r" * 128, "pool": "p" * 128})
    assert longest == 2662
    assert (series_cost(None, longest), series_cost(None, longest, 2)) == (6, 11)
    assert series_cost(None, longest * 4, 2) == 42  # a character outside the BMP in them: 4 bytes each
    # Histograms: their buckets' weight, or their lines' labels (a bucket line each, count and sum).
    assert series_cost(layout(PGS), 62) == 1  # 6 bounds, 8 lines: 496 characters
    assert series_cost(layout(PGS), 67) == 2  # the harness's labels: 536
    assert series_cost(layout(DURATION), 67) == histogram_cost(layout(DURATION)) == 3
    wide = (*(float(i + 1) for i in range(1023)), "+Inf")
    assert (series_cost(wide, 64), series_cost(wide, 65), series_cost(wide, 67)) == (129, 131, 135)
    assert series_cost(layout(DURATION), longest) == math.ceil(21 * longest / 512) == 110


# --- the budget holds exactly the weights of what the state holds ---

CHARS = st.sampled_from("ab\\\"\né😀ā")
STATIC_VALUES = st.builds(lambda head, n, tail: head * n + tail, CHARS, st.integers(1, 300), st.text(CHARS, max_size=4))


def _value_cost(rank: RankState, key: SeriesKey, value: Value) -> int:
    """A rank series' weight, from its labels as written (not the state's cached counts)."""
    spec = CATALOG.get(key[0])
    labels = rank.label_dict().items()
    own = tuple(zip(spec.labels, key[1]))
    chars = line_chars(label_chars(labels), label_width(labels), label_chars(own), label_width(own))
    if spec.type is MetricType.HISTOGRAM:
        assert not isinstance(value, float)
        return series_cost(value.bounds, chars)
    return series_cost(None, chars, scalar_lines(spec))


def _expected(h: Harness) -> tuple[int, int]:
    per_rank = 0
    for rank in h.state.registry.ranks.values():
        held = [rank.values] + ([rank.other_writer.values] if rank.other_writer is not None else [])
        per_rank += sum(_value_cost(rank, key, value) for values in held for key, value in values.items())
    ledger = h.state.ledger
    cells: list[tuple[object, object]] = [*ledger.counter_cells.items(), *ledger.histograms.items()]
    rollup = 0
    for (family, shared, values), cell in cells:
        own = tuple(zip(CATALOG.get(family).labels, values))
        chars = line_chars(label_chars(shared), label_width(shared), label_chars(own), label_width(own))
        rollup += series_cost(cell.bounds if isinstance(cell, HistAccumulator) else None, chars)
    return per_rank, rollup


OPS = st.lists(st.tuples(
    st.sampled_from(("hello", "hello", "push", "push", "push", "push", "leave", "leave", "time", "time")),
    st.integers(0, 3),  # which rank (tp_rank)
    STATIC_VALUES,  # a hello's label value
    st.booleans(),  # a hello: a new epoch (a restart); a push: a value lower than the last (an epoch conflict)
    st.sets(st.integers(0, 7), min_size=1, max_size=8),  # a push: which series
), min_size=5, max_size=40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STATIC_VALUES, min_size=2, max_size=2), OPS)
def test_the_budget_is_the_weight_of_every_series_and_rollup_held(first: list[str], ops: list[tuple]) -> None:
    """Ranks of any labels (escapes, Latin-1, the BMP, beyond it; as a derived label, which rollups leave
    out, or not) say hello, push any of their series, restart, reconnect (as another writer, too), leave, expire
    and are forgotten to make room, the budget often full: after every step, the budget is the weight of
    every rank series held (a set-aside writer's included) and every rollup cell, each from its labels."""
    h = Harness(ranks_config=RanksConfig(stale_after_seconds=10.0, expire_after_seconds=30.0, max_ranks=2,
                                         max_series_total=160))
    conns: dict[int, object] = {}
    ranks: dict[int, RankState] = {}
    epochs = dict.fromkeys(range(4), 0)
    levels = dict.fromkeys(range(4), 10.0)  # each rank's values, moving up, or down (a conflict, or a refusal)
    for tp, value in enumerate(first):  # two ranks to begin with (max_ranks): another waits for one to expire
        ops.insert(tp, ("hello", tp, value, False, {0}))
    label_of: dict[int, str] = {}  # each rank's label value: its first hello's, so that it comes back as itself
    for kind, tp, value, flag, which in ops:
        if kind == "hello" and tp not in conns:
            epochs[tp] += flag
            value = label_of.setdefault(tp, value)
            labels = {"cache_type": value[:64], ("moe_ep_rank" if tp % 2 else "model"): value}
            try:
                conns[tp], ranks[tp] = h.hello(tp=tp, labels=labels, epoch=f"e{epochs[tp]}")
            except ProtocolError:  # refused (too many ranks, a replaced epoch): changes nothing here
                pass
        elif kind == "push" and tp in conns:
            level = levels[tp] = levels[tp] + (-5.0 if flag else 1.0)
            samples = [bytes_(level), tokens(level, pool="kv"), tokens(level, pool="é" * 40), used(level),
                       dropped(level, reason="r" * 100, pool="p"), dropped(level, reason="😀", pool="ā" * 90),
                       hist(PGS, one_hot(PGS, 0, max(0, int(level))), level),
                       hist(DURATION, one_hot(DURATION, 1, max(0, int(level))), level)]
            h.push(ranks[tp], *(samples[i] for i in sorted(which)))
        elif kind == "leave" and tp in conns:
            h.state.disconnect(conns.pop(tp), ranks[tp])
        elif kind == "time":
            h.clock.advance(40.0 if flag else 1.0)
        budget = h.state.registry.budget
        assert (budget.per_rank, budget.rollup) == _expected(h)
        assert budget.per_rank + budget.rollup <= budget.limit
        for rank in h.state.registry.ranks.values():
            assert rank.cost == sum(_value_cost(rank, key, value) for key, value in rank.values.items())
