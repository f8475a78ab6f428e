"""Engine profiles (DESIGN section 14): each catalog file is one engine's profile, the profiles in use
merge into one catalog without a clash, and each family is exported under its own profile's namespace."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import yaml

from exporter.catalog import (
    DEFAULT_PROFILE,
    Catalog,
    MetricType,
    Semantics,
    catalog_from_data,
    default_catalog,
    dp_attention_by_sizes,
    load_profile,
    load_profiles,
)
from exporter.defaults import default_path
from exporter.errors import ConfigError, UnknownFamilyError
from exporter.sidecar.expose.families import ExposedFamilies

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lmcache() -> Catalog:
    return load_profile("lmcache")


@pytest.fixture(scope="module")
def both() -> Catalog:
    return load_profiles(None, ["lmcache"])


def _family(name: str = "things_total", **extra: object) -> dict[str, object]:
    return {"name": name, "type": "counter", "semantics": "per_shard", "help": "Things.", **extra}


def _profile(**extra: object) -> dict[str, object]:
    return {"name": "other", "namespace": "other_", "upstream_prefix": "other:", **extra}


def test_the_default_catalog_is_the_sglang_profile() -> None:
    profile = default_catalog().default_profile
    assert (profile.name, profile.namespace, profile.upstream_prefix) == (DEFAULT_PROFILE, "sglang_", "sglang:")
    assert profile.linear_rank_label is None
    assert default_catalog().derived_labels == {"moe_ep_rank"}
    assert {f.profile for f in default_catalog()} == {"sglang"}


def test_the_lmcache_profile_is_every_family_of_lmcache_0_5_6_with_its_meaning(lmcache: Catalog) -> None:
    profile = lmcache.default_profile
    assert (profile.name, profile.namespace, profile.upstream_prefix) == ("lmcache", "lmcache_", "lmcache:")
    assert profile.linear_rank_label == "worker_id" and lmcache.derived_labels == {"worker_id"}
    assert set(profile.static_labels) == {"model_name", "role", "served_model_name"}
    assert len(lmcache) == 94
    assert Counter(f.type for f in lmcache) == {MetricType.COUNTER: 23, MetricType.GAUGE: 51, MetricType.HISTOGRAM: 20}
    # docs/lmcache-0.5.6.md: 15 replicated, 13 per engine, 46 per shard and 20 the code does not settle (summed).
    assert Counter(f.semantics for f in lmcache) == {
        Semantics.REPLICATED: 15, Semantics.PER_ENGINE: 13, Semantics.PER_SHARD: 66}
    assert sum(1 for f in lmcache if f.evidence and f.evidence.startswith("unsure")) == 20
    assert all(f.collector == "lmcache" and f.roles and f.evidence and not f.labels for f in lmcache)
    assert {f.multiprocess_mode for f in lmcache if f.type is MetricType.GAUGE} == {"sum", "livemostrecent"}
    assert all(f.multiprocess_mode is None for f in lmcache if f.type is not MetricType.GAUGE)
    assert lmcache.get("num_hit_tokens_total").replicated and lmcache.get("num_remote_read_bytes_total").per_shard
    assert lmcache.get("scheduler_unfinished_requests_count").semantics is Semantics.PER_ENGINE
    assert lmcache.streams["lmcache"].marker == "role"


def test_per_engine_families_add_up_like_per_shard_ones(lmcache: Catalog) -> None:
    spec = lmcache.get("chunk_statistics_total_requests")
    assert spec.per_shard and not spec.replicated


def test_config_lmcache_yaml_is_a_symlink_to_the_packaged_profile(lmcache: Catalog) -> None:
    link = REPO / "config" / "lmcache.yaml"
    assert link.is_symlink() and link.resolve() == default_path("lmcache.yaml").resolve()
    assert load_profile(link) == lmcache


def test_profiles_in_use_merge_into_one_catalog(both: Catalog, lmcache: Catalog) -> None:
    assert list(both.profiles) == ["sglang", "lmcache"] and both.default_profile.name == "sglang"
    assert len(both) == len(default_catalog()) + len(lmcache)
    assert set(both.streams) == {"radix", "storage", "scheduler", "lmcache"}
    assert both.derived_labels == {"moe_ep_rank", "worker_id"}
    assert both.of_profile("lmcache").families == lmcache.families
    assert both.of_profile("sglang").families == default_catalog().families
    assert load_profiles(None, ["sglang"]) == default_catalog()
    with pytest.raises(UnknownFamilyError, match="profile 'vllm' is not in use"):
        both.of_profile("vllm")


def test_each_family_is_exported_under_its_profiles_namespace_and_no_name_clashes(both: Catalog) -> None:
    exposed = ExposedFamilies(both, "sglang_")
    alone = ExposedFamilies(default_catalog(), "sglang_")
    for table in ("per_rank", "rollup", "spread", "bandwidth"):
        # The sglang profile's names are what they were without lmcache.
        mine = {k: v for k, v in getattr(exposed, table).items() if k in getattr(alone, table)}
        assert mine == getattr(alone, table)
    assert exposed.per_rank["num_hit_tokens_total"].name == "lmcache_num_hit_tokens"
    assert exposed.rollup["num_hit_tokens_total"].name == "lmcache_rollup_num_hit_tokens"
    assert exposed.spread["num_hit_tokens_total"].name == "lmcache_num_hit_tokens_replica_spread_ratio"
    assert ExposedFamilies(both, "engine:").per_rank["evicted_tokens_total"].name == "engine:evicted_tokens"
    assert ExposedFamilies(both, "engine:").per_rank["num_hit_tokens_total"].name == "lmcache_num_hit_tokens"
    names = [f.name for table in (exposed.per_rank, exposed.rollup, exposed.spread) for f in table.values()]
    names += [f.name for pair in exposed.bandwidth.values() for f in pair]
    assert len(names) == len(set(names))
    assert not any(n.startswith("sglang_") for n in names if "num_hit" in n or "lmcache" in n[:8])


def test_two_profiles_may_not_share_a_family_name(tmp_path: Path) -> None:
    clash = tmp_path / "clash.yaml"
    clash.write_text(yaml.safe_dump({"profile": _profile(), "families": [_family("evicted_tokens_total")]}))
    with pytest.raises(ConfigError, match="evicted_tokens_total"):
        load_profiles(None, [str(clash)])
    with pytest.raises(ConfigError, match="profile 'lmcache' is given twice"):
        Catalog.merged([load_profile("lmcache"), load_profile("lmcache")])


def test_an_unknown_profile_is_one_line_naming_the_packaged_ones() -> None:
    with pytest.raises(ConfigError) as info:
        load_profile("vllm")
    assert str(info.value) == "profile 'vllm' is neither a packaged profile (sglang, lmcache) nor a profile file"


@pytest.mark.parametrize("profile, fragment", [
    (_profile(linear_rank_label="worker_id"), "must be one of derived_labels"),
    (_profile(namespace="bad-name"), "profile.namespace"),
    (_profile(colour="red"), "profile.colour"),
    ({"name": "other"}, "profile.namespace"),
])
def test_a_bad_profile_block_names_the_problem(profile: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        catalog_from_data({"profile": profile, "families": [_family()]}, "other.yaml")


def test_an_operator_profile_file_gives_its_families_its_namespace(tmp_path: Path) -> None:
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"profile": _profile(), "families": [_family("widgets_total")]}))
    merged = load_profiles(None, [str(path)])
    assert merged.get("widgets_total").profile == "other"
    assert ExposedFamilies(merged, "sglang_").rollup["widgets_total"].name == "other_rollup_widgets"


@pytest.mark.parametrize("profile, family, clash", [
    (_profile(namespace="hicache_exporter_"), _family("ranks", type="gauge"), "hicache_exporter_ranks"),
    (_profile(namespace="sglang_hicache_"), _family("host_used_tokens", type="gauge"), "sglang_hicache_host_used_tokens"),
    (_profile(namespace="lmcache_"), _family("rollup_num_hit_tokens_total"), "lmcache_rollup_num_hit_tokens"),
])
def test_a_profile_whose_exported_names_clash_with_another_family_is_refused(
        tmp_path: Path, profile: dict[str, object], family: dict[str, object], clash: str) -> None:
    """Family names differ, yet namespace + name is what another family already writes: /metrics would carry
    two TYPE lines for it and Prometheus would refuse the scrape, so the sidecar refuses to start."""
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"profile": profile, "families": [family]}))
    catalog = load_profiles(None, ["lmcache", str(path)])
    with pytest.raises(ConfigError, match=f"exported names clash .*{clash}"):
        ExposedFamilies(catalog, "sglang_")


def test_an_engines_metric_name_finds_its_family_as_both_hooks_look_it_up(lmcache: Catalog) -> None:
    counter = lmcache.get("num_hit_tokens_total")
    assert lmcache.engine_family("lmcache:num_hit_tokens", "lmcache:", MetricType.COUNTER) is counter
    assert lmcache.engine_family("lmcache:num_hit_tokens_total", "lmcache:", MetricType.COUNTER) is counter
    assert lmcache.engine_family("lmcache:periodic_threads_low_total", "lmcache:", MetricType.GAUGE) is lmcache.get(
        "periodic_threads_low_total")
    assert lmcache.engine_family("lmcache:num_hit_tokens", "lmcache:", MetricType.GAUGE) is None  # no _total added
    assert lmcache.engine_family("sglang:num_hit_tokens", "lmcache:", MetricType.COUNTER) is None
    assert default_catalog().engine_family("sglang:evicted_tokens", "sglang:", MetricType.COUNTER) is \
        default_catalog().get("evicted_tokens_total")


# --- profile facts: tier transfers, spread threshold, DP-attention rule --------------------


def test_each_profile_declares_its_transfers_and_both_are_listed(both: Catalog) -> None:
    listed = [(profile.name, transfer.name, transfer.tiers) for profile, transfer in both.transfers()]
    assert listed == [
        ("sglang", "load_back", "L2→L1"), ("sglang", "backup", "L1→L2"), ("sglang", "prefetch", "L3→L2"),
        ("sglang", "storage_backup", "L2→L3"),
        ("lmcache", "retrieve", "L2→L1"), ("lmcache", "store", "L1→L2"), ("lmcache", "remote_read", "L3→L2"),
        ("lmcache", "remote_write", "L2→L3"),
    ]
    for _, transfer in both.transfers():  # every family a packaged transfer names is in its profile
        assert all(name in both for name in transfer.families()), transfer.name
    assert [t.title for _, t in both.transfers()][:4] == ["load-back", "backup", "prefetch", "backup"]


def test_a_transfer_of_a_trimmed_profile_file_is_left_out_and_a_wrong_family_type_refused() -> None:
    transfer = {"name": "move", "source": "L2", "target": "L1", "tokens": "moved_tokens_total", "bytes": "moved_total"}
    trimmed = catalog_from_data({"profile": _profile(transfers=[transfer]), "families": [_family()]})
    assert trimmed.transfers() == []  # neither of its families is in the file
    with pytest.raises(ConfigError, match="'things_total' is a counter, not a histogram"):
        catalog_from_data({"profile": _profile(transfers=[{**transfer, "seconds": "things_total"}]),
                           "families": [_family()]})
    with pytest.raises(ConfigError, match="transfers repeat a name"):
        catalog_from_data({"profile": _profile(transfers=[transfer, transfer]), "families": [_family()]})


def test_spread_threshold_and_dp_attention_are_profile_facts(both: Catalog) -> None:
    sglang, lmcache = both.profiles["sglang"], both.profiles["lmcache"]
    assert sglang.spread_threshold == lmcache.spread_threshold == 0.2
    # SGLang: the dp groups share one tp group when its size spans them (tp 4 = dp 2 x attention tp 2).
    assert sglang.dp_attention == "sizes"
    assert dp_attention_by_sizes(tp_size=4, dp_size=2, attn_cp_size=1, attn_tp_size=2)
    assert not dp_attention_by_sizes(tp_size=2, dp_size=2, attn_cp_size=1, attn_tp_size=2)
    # vLLM's data-parallel replicas each have their own tp group, whatever the sizes.
    assert lmcache.dp_attention == "never"
    assert lmcache.world_problem(1, dp_attention=True) is not None and sglang.world_problem(1, dp_attention=True) is None


def test_replicated_counter_is_one_predicate(both: Catalog) -> None:
    expected = {f.name for f in both if f.type is MetricType.COUNTER and f.semantics is Semantics.REPLICATED}
    assert {f.name for f in both if f.replicated_counter} == expected
    assert "num_hit_tokens_total" in expected and "load_back_tokens_total" in expected
