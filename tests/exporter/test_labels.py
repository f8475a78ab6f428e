"""Rank labels (DESIGN §3) and the label-name rules shared by the client and the sidecar."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.errors import LabelError
from exporter.labels import (
    MAX_RANK_AXIS,
    RANK_KEYS,
    label_name_problem,
    linear_rank_axes,
    own_labels_problem,
    radix_cache_metric_labels,
    rank_axis,
    rank_axis_problem,
    split_rank_labels,
    static_label_problem,
)
from exporter.protocol.messages import MAX_RANK

UPSTREAM = SimpleNamespace(tp_rank=3, pp_rank=1, attn_tp_rank=1, attn_dp_rank=2)


def test_upstream_case_with_dp_attention():
    labels = radix_cache_metric_labels("UnifiedRadixCache", UPSTREAM, True)
    assert labels == {"cache_type": "UnifiedRadixCache", "tp_rank": 1, "pp_rank": 1, "dp_rank": 2}


def test_upstream_case_without_dp_attention():
    labels = radix_cache_metric_labels("UnifiedRadixCache", UPSTREAM, False)
    assert labels == {"cache_type": "UnifiedRadixCache", "tp_rank": 3, "pp_rank": 1, "dp_rank": 0}


def test_keys_are_exactly_cache_type_and_the_rank_keys():
    for enabled in (True, False):
        assert set(radix_cache_metric_labels("HiRadixCache", UPSTREAM, enabled)) == {
            "cache_type", *RANK_KEYS
        }
    assert RANK_KEYS == ("tp_rank", "pp_rank", "dp_rank")


def test_without_dp_attention_the_attention_ranks_are_not_needed():
    parallel = SimpleNamespace(tp_rank=5, pp_rank=2)
    assert radix_cache_metric_labels("C", parallel, False) == {
        "cache_type": "C", "tp_rank": 5, "pp_rank": 2, "dp_rank": 0
    }


@settings(max_examples=100, deadline=None)
@given(
    tp=st.integers(0, 1023), pp=st.integers(0, 63), attn_tp=st.integers(0, 1023),
    attn_dp=st.integers(0, 1023), cache_type=st.text(max_size=20), enabled=st.booleans(),
)
def test_rule_for_any_ranks(tp, pp, attn_tp, attn_dp, cache_type, enabled):
    parallel = SimpleNamespace(tp_rank=tp, pp_rank=pp, attn_tp_rank=attn_tp, attn_dp_rank=attn_dp)
    labels = radix_cache_metric_labels(cache_type, parallel, enabled)
    expected_tp, expected_dp = (attn_tp, attn_dp) if enabled else (tp, 0)
    assert labels == {"cache_type": cache_type, "tp_rank": expected_tp, "pp_rank": pp, "dp_rank": expected_dp}


def test_split_rank_labels():
    rank, static = split_rank_labels(
        {"cache_type": "UnifiedRadixCache", "tp_rank": "1", "pp_rank": 1, "dp_rank": 2, "zone": 7}
    )
    assert rank == {"tp_rank": 1, "pp_rank": 1, "dp_rank": 2}
    assert static == {"cache_type": "UnifiedRadixCache", "zone": "7"}


def test_split_rank_labels_of_the_upstream_rule():
    labels = radix_cache_metric_labels("UnifiedRadixCache", UPSTREAM, True)
    rank, static = split_rank_labels(labels)
    assert rank == {"tp_rank": 1, "pp_rank": 1, "dp_rank": 2}
    assert static == {"cache_type": "UnifiedRadixCache"}


@pytest.mark.parametrize("name", ["cache_type", "pool", "reason", "_private", "A", "zone1", "x_" * 20])
def test_usable_label_names(name):
    assert label_name_problem(name) is None


@pytest.mark.parametrize(
    "name",
    ["", "1abc", "a-b", "a b", "a.b", "a:b", "é", " pool", "pool ", "po\nol"],
)
def test_malformed_label_names(name):
    problem = label_name_problem(name)
    assert problem is not None
    assert repr(name) in problem


@pytest.mark.parametrize("name", ["pool\n", "zone\n", "cache_type\n"])
def test_label_name_with_a_trailing_newline_is_malformed(name):
    # `$` in a Python regex also matches before a final newline; a label name like this would
    # be written raw into the text exposition and break /metrics for every rank.
    problem = label_name_problem(name)
    assert problem is not None
    assert repr(name) in problem


@pytest.mark.parametrize("name", ["le", "quantile", "__name__", "tp_rank", "pp_rank", "dp_rank"])
def test_reserved_label_names(name):
    problem = label_name_problem(name)
    assert problem is not None
    assert "reserved" in problem and name in problem


@pytest.mark.parametrize("name", ["__meta", "__", "__address__"])
def test_double_underscore_prefix_is_reserved_by_prometheus(name):
    problem = label_name_problem(name)
    assert problem is not None and name in problem


def test_split_rank_labels_keeps_attn_cp_rank_as_a_rank_axis_when_present():
    storage = {"storage_backend": "file", "tp_rank": 1, "dp_rank": 0, "pp_rank": 0, "pp_size": 2,
               "attn_cp_rank": 3, "attn_cp_size": 4}
    rank, static = split_rank_labels(storage)
    assert rank == {"tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 3}
    assert static == {"storage_backend": "file", "pp_size": "2", "attn_cp_size": "4"}
    assert "attn_cp_rank" not in split_rank_labels({"tp_rank": 0, "pp_rank": 0, "dp_rank": 0})[0]
    assert label_name_problem("attn_cp_rank") is not None  # a rank axis is never a static label


# --- rank axes: one spelling per rank number ---


@pytest.mark.parametrize("text, number", [("0", 0), ("3", 3), ("10", 10), ("65535", 65535)])
def test_a_rank_axis_is_a_plain_decimal(text, number):
    assert rank_axis(text) == number


@pytest.mark.parametrize("text", ["-1", "1" + "0" * 3999, "\u0663", " 3", "3 ", "+2", "1_0", "03", "00", "",
                                  "65536", "1e3", "0x1", "3\n", "\uff13"])
def test_other_spellings_are_no_rank_axis(text):
    """Before: int() took all but "" and "0x1"/"1e3", merging " 3", "+2", "1_0" and "\u0663" into ranks 3, 2, 10, 3."""
    assert rank_axis(text) is None


def test_the_largest_rank_axis_is_the_wire_protocols():
    assert MAX_RANK_AXIS == MAX_RANK - 1 == 65535


@settings(max_examples=300)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=8) | st.integers(-5, 70_000).map(str))
def test_a_rank_axis_has_one_spelling(text):
    """Every number a rank axis takes is written exactly one way: str() of it."""
    number = rank_axis(text)
    assert number is None or (str(number) == text and 0 <= number <= MAX_RANK_AXIS)


@pytest.mark.parametrize("value", ["-1", " 3", "+2", "1_0", "\u0663", -1, 65536, True, 1.5])
def test_split_rank_labels_refuses_what_is_no_rank_number(value):
    with pytest.raises(ValueError, match="tp_rank=.* must be a whole number from 0 to 65535"):
        split_rank_labels({"tp_rank": value, "pp_rank": 0, "dp_rank": 0})


# --- the one split and the one static-label rule (client, stat-logger hook, proxy, the sidecar's hello) ---


def test_split_rank_labels_leaves_out_the_familys_own_labels_and_empty_values():
    labels = {"tp_rank": 1, "pp_rank": "0", "dp_rank": 0, "pool": "kv", "priority": "", "zone": "eu"}
    assert split_rank_labels(labels, own=("pool",)) == ({"tp_rank": 1, "pp_rank": 0, "dp_rank": 0}, {"zone": "eu"})


def test_split_rank_labels_names_every_missing_rank_axis():
    with pytest.raises(LabelError, match=r"rank labels \['pp_rank', 'dp_rank'\] are missing"):
        split_rank_labels({"tp_rank": 0, "zone": "eu"})


def test_a_rank_axis_problem_cuts_a_long_value():
    assert rank_axis_problem("tp_rank", "3") is None and rank_axis_problem("tp_rank", 3) is None
    problem = rank_axis_problem("dp_rank", "9" * 5000)
    assert problem is not None and len(problem) < 200 and "(5000 characters)" in problem
    assert problem.startswith("rank label dp_rank='9999")


@pytest.mark.parametrize("name, value, problem", [
    ("zone", "eu", None),
    ("le", "1", "label name 'le' is reserved"),
    ("pool", "kv", "label name 'pool' is a family label in the catalog"),
    ("zone", "", "label 'zone' has an empty value; leave the label out instead"),
    ("zone", "x" * 9, "value of label 'zone' is longer than 8 characters"),
    ("pool", "", "label name 'pool' is a family label in the catalog"),  # the first problem is named
])
def test_static_label_problem(name, value, problem):
    assert static_label_problem(name, value, family_labels={"pool"}, max_value_length=8) == problem


def test_own_labels_problem_names_what_the_family_takes():
    assert own_labels_problem("f_total", ("pool",), {"pool": "kv"}) is None
    assert own_labels_problem("f_total", ("pool",), {"zone": "eu"}) == "'f_total' takes labels ['pool'], got ['zone']"


@given(tp=st.integers(1, 16), pp=st.integers(1, 8), cp=st.integers(1, 4), data=st.data())
@settings(max_examples=200, deadline=None)
def test_linear_rank_axes_inverts_vllms_layout(tp: int, pp: int, cp: int, data: st.DataObject) -> None:
    """vLLM numbers a replica's workers (pp_rank * cp_size + cp_rank) * tp_size + tp_rank
    (parallel_state.py:2045-2060): the axes read back are the ones it was made from, each worker its own."""
    tp_rank, pp_rank, cp_rank = data.draw(st.integers(0, tp - 1)), data.draw(st.integers(0, pp - 1)), data.draw(
        st.integers(0, cp - 1))
    worker = (pp_rank * cp + cp_rank) * tp + tp_rank
    axes = linear_rank_axes(worker, tp, cp)
    assert axes == {"tp_rank": tp_rank, "pp_rank": pp_rank, "dp_rank": 0, **({"attn_cp_rank": cp_rank} if cp > 1 else {})}
    seen = {tuple(sorted(linear_rank_axes(w, tp, cp).items())) for w in range(tp * pp * cp)}
    assert len(seen) == tp * pp * cp


def test_without_a_tp_size_every_worker_is_a_tp_rank_of_one_stage() -> None:
    assert linear_rank_axes(5, None) == {"tp_rank": 5, "pp_rank": 0, "dp_rank": 0}
