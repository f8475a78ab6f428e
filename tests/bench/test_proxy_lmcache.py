"""The proxy benchmark's lmcache case: its exposition is what vLLM's /metrics serves of LMCache 0.5.6's
released logger, the sidecar reads all of it, and the ratio line is printed. Timings are never asserted.

The released wheel is needed (tests/upstream_lmcache.py): without it these tests fail, never skip.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalog import MetricType, load_profile, load_profiles
from exporter.config import UpstreamConfig, UpstreamWorld
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.upstream.feed import UpstreamFeed

from bench import proxy

ENGINES, TP = 2, 2


def families(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def value(text: str, name: str, labels: dict[str, str]) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return float(sample.value)
    raise KeyError((name, labels))


@pytest.fixture(scope="module")
def released() -> tuple[list[str], dict[str, Any]]:
    return proxy.lmcache_texts(ENGINES, TP, 3, "released")


def test_the_exposition_is_the_released_loggers_as_vllm_serves_it(released: tuple[list[str], dict[str, Any]]) -> None:
    texts, meta = released
    assert meta["source"] == "released" and "0.5.6" in meta["note"], meta
    # A counter's family name has no `_total`; a gauge named `..._total` keeps it.
    profile = {spec.name.removesuffix("_total") if spec.type is MetricType.COUNTER else spec.name: spec
               for spec in load_profile("lmcache")}
    workers = {(f"bench/model-{e}", str(w)) for e in range(ENGINES) for w in range(TP)}
    first = families(texts[0])
    assert set(first) == {"lmcache:" + name for name in profile}  # all 94, under their released names
    # The 39 livemostrecent gauges fed by set_function have no sample through multiprocess files
    # (docs/lmcache-0.5.6.md section 1): the rest do, for every worker.
    empty = {name for name, family in first.items() if not family.samples}
    assert len(empty) == 39 and all(profile[n.removeprefix("lmcache:")].multiprocess_mode == "livemostrecent"
                                    for n in empty), sorted(empty)
    for name, family in first.items():
        if name in empty:
            continue
        assert name.startswith("lmcache:"), name
        spec = profile[name.removeprefix("lmcache:")]
        assert family.type == spec.type.value, name
        seen = set()
        for sample in family.samples:
            assert not sample.name.endswith("_created"), sample  # multiprocess mode writes none
            labels = dict(sample.labels)
            le = labels.pop("le", None)
            assert labels["role"] == "worker" and labels["model_name"] == labels["served_model_name"], sample
            assert set(labels) == {"model_name", "worker_id", "role", "served_model_name"}, sample
            seen.add((labels["model_name"], labels["worker_id"]))
            if le is not None and le != "+Inf":
                assert float(le) in (spec.buckets or ()), sample
        assert seen == workers, name
    # The engine's counters move between two reads; every worker of one engine counts its requests alike.
    engine_0 = {"model_name": "bench/model-0", "served_model_name": "bench/model-0", "role": "worker"}
    looked_up = [value(text, "lmcache:num_lookup_tokens_total", {**engine_0, "worker_id": "0"}) for text in texts]
    assert 0 < looked_up[0] < looked_up[1] < looked_up[2], looked_up
    assert value(texts[2], "lmcache:num_lookup_tokens_total", {**engine_0, "worker_id": "1"}) == looked_up[2]
    assert any(profile[n.removeprefix("lmcache:")].type is MetricType.HISTOGRAM for n in first)


def test_the_sidecar_reads_every_worker_and_sample(released: tuple[list[str], dict[str, Any]]) -> None:
    texts, _ = released
    state = SidecarState(load_profiles(None, ["lmcache"]))
    config = UpstreamConfig(url="http://engine:8000/metrics", profile="lmcache", world=UpstreamWorld(tp_size=TP))
    m = proxy.compare(texts, UpstreamFeed(config, state, UpstreamHealth(config.label, "bench")), ENGINES * TP)
    assert m["samples"] == sum(len(f.samples) for f in families(texts[0]).values()) and m["reads"] == 2
    assert math.isfinite(m["ratio"]) and m["ratio"] > 0
    # The check is able to fail: a read that makes other than the expected ranks is refused.
    state = SidecarState(load_profiles(None, ["lmcache"]))
    with pytest.raises(RuntimeError, match="expected"):
        proxy.compare(texts, UpstreamFeed(config, state, UpstreamHealth(config.label, "bench")), ENGINES * TP + 1)


def test_the_catalog_exposition_stands_in_for_the_released_one(released: tuple[list[str], dict[str, Any]]) -> None:
    texts, meta = proxy.lmcache_texts(ENGINES, TP, 2, "catalog")
    assert meta["source"] == "catalog" and "lmcache.yaml" in meta["note"], meta
    ours, theirs = families(texts[0]), families(released[0][0])
    assert set(ours) == set(theirs) and all(ours[n].type == theirs[n].type for n in ours)  # the same families
    assert all(family.samples for family in ours.values())  # every gauge set, the set_function ones too
    m = proxy.measure_lmcache(ENGINES, TP, 1, "catalog")
    assert m["ranks"] == ENGINES * TP and m["source"] == "catalog"


def test_the_row_and_the_printed_ratio(capsys: pytest.CaptureFixture[str]) -> None:
    rows = proxy.run((), repeats=1, lmcache=(ENGINES, TP), lmcache_source="released", progress=False)
    r, first = rows
    assert first["goal"] is None and first["met"] is None and first["value"] > 0 and first["anchor_value"] > 0
    assert r["profile"] == "lmcache" and r["source"] == "released" and r["ranks"] == ENGINES * TP
    assert r["goal"] == f"ratio <= {proxy.GOAL_RATIO:g}" and isinstance(r["met"], bool)
    assert r["anchor"] == "prometheus_client text parser, same text" and r["value"] > 0 and r["anchor_value"] > 0
    assert proxy.main(["--ranks", "none", "--repeats", "1", "--lmcache", f"{ENGINES}x{TP}"]) == 0
    printed = capsys.readouterr().out
    assert "exposition by LMCache 0.5.6's own PrometheusLogger" in printed
    assert "lmcache ratio " in printed and "x the parser (goal <= 0.2x)" in printed
    assert "lmcache first read (ranks and layout made): " in printed
