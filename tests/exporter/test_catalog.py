"""The metric catalog (DESIGN §4): the packaged default matches the documented semantics, and
invalid catalogs stop start-up with a ConfigError that names the field."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from exporter.catalog import (
    Catalog,
    Collector,
    MetricType,
    Semantics,
    catalog_from_data,
    default_catalog,
    load_catalog,
)
from exporter.defaults import default_path
from exporter.errors import ConfigError, UnknownFamilyError

REPO = Path(__file__).resolve().parents[2]

C, G, H = MetricType.COUNTER, MetricType.GAUGE, MetricType.HISTOGRAM
PS, R = Semantics.PER_SHARD, Semantics.REPLICATED

RADIX, STORAGE, SCHED = Collector.RADIX, Collector.STORAGE, Collector.SCHEDULER

# name: (type, extra labels, semantics, collector), from DESIGN §4 and the released engine's
# collectors (sglang 0.5.23 observability/metrics_collector.py).
DOCUMENTED = {
    "eviction_duration_seconds": (H, (), PS, RADIX),
    "evicted_tokens_total": (C, (), R, RADIX),
    "load_back_duration_seconds": (H, (), PS, RADIX),
    "load_back_tokens_total": (C, ("pool",), R, RADIX),
    "load_back_bytes_total": (C, (), PS, RADIX),
    "hicache_host_pool_evicted_tokens_total": (C, ("pool",), R, RADIX),
    "hicache_backup_duration_seconds": (H, (), PS, RADIX),
    "hicache_backup_tokens_total": (C, ("pool",), R, RADIX),
    "hicache_backup_bytes_total": (C, (), PS, RADIX),
    "hicache_dropped_tokens_total": (C, ("reason", "pool"), R, RADIX),
    "prefetched_tokens_total": (C, (), R, STORAGE),
    "backuped_tokens_total": (C, (), R, STORAGE),
    "storage_prefetch_hit_tokens_total": (C, (), R, STORAGE),
    "storage_prefetch_unfulfilled_tokens_total": (C, ("reason",), R, STORAGE),
    "storage_prefetch_deferred_tokens_total": (C, ("reason",), R, STORAGE),
    "hicache_backup_dropped_tokens_total": (C, (), R, STORAGE),
    "hicache_prefetch_aux_alloc_failed_tokens_total": (C, (), R, STORAGE),
    "prefetch_pgs": (H, (), R, STORAGE),
    "backup_pgs": (H, (), R, STORAGE),
    "prefetch_bandwidth": (H, (), PS, STORAGE),
    "backup_bandwidth": (H, (), PS, STORAGE),
    "hicache_host_used_tokens": (G, (), R, SCHED),
    "hicache_host_total_tokens": (G, (), R, SCHED),
    "hicache_host_mamba_used_states": (G, (), R, SCHED),
    "hicache_host_mamba_total_states": (G, (), R, SCHED),
    "hicache_host_pool_used_tokens": (G, ("pool",), R, SCHED),
    "hicache_host_pool_total_tokens": (G, ("pool",), R, SCHED),
    "prefill_effective_tokens_total": (C, ("mode",), R, SCHED),
    # Beyond upstream: L3 bytes with their duration histograms.
    "storage_prefetch_bytes_total": (C, (), PS, STORAGE),
    "storage_backup_bytes_total": (C, (), PS, STORAGE),
    "storage_prefetch_duration_seconds": (H, (), PS, STORAGE),
    "storage_backup_duration_seconds": (H, (), PS, STORAGE),
}

# Families the released engine does not emit: the L3 bytes/duration view, and per-pool host gauges
# and host evictions (no collector of sglang 0.5.23 has them).
BEYOND_UPSTREAM = {
    "storage_prefetch_bytes_total", "storage_backup_bytes_total",
    "storage_prefetch_duration_seconds", "storage_backup_duration_seconds",
    "hicache_host_pool_evicted_tokens_total", "hicache_host_pool_used_tokens", "hicache_host_pool_total_tokens",
}

SHORT_DURATION = (0.001, 0.002, 0.003, 0.004, 0.005, 0.006, 0.007, 0.008, 0.009,
                  0.01, 0.02, 0.03, 0.04, 0.05, 0.1, 0.2, 0.5, 1.0)
BACKUP_DURATION = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30, 60)
PAGES = (1, 5, 10, 50, 100)
BANDWIDTH = (0.1, 0.5, 1, 5, 10, 50, 100)

# The engine's pre-set order (metrics_collector.py:2247-2259).
UNFULFILLED_REASONS = (
    "below_threshold", "host_capacity", "device_capacity", "device_covered", "storage_transfer",
    "deadline", "anchor_lost", "aux_window_trim", "device_overlap", "cache_admission_shortfall", "dropped",
)
PREFILL_MODES = ("input", "device_hit", "host_hit", "storage_hit")

BANDWIDTH_PAIRS = {
    "load_back_bytes_total": ("load_back_duration_seconds", "load_back_active_bandwidth_bytes_per_second"),
    "hicache_backup_bytes_total": (
        "hicache_backup_duration_seconds", "hicache_backup_active_bandwidth_bytes_per_second"),
    "storage_prefetch_bytes_total": (
        "storage_prefetch_duration_seconds", "storage_prefetch_active_bandwidth_bytes_per_second"),
    "storage_backup_bytes_total": (
        "storage_backup_duration_seconds", "storage_backup_active_bandwidth_bytes_per_second"),
}


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return default_catalog()


# --- the packaged default ---------------------------------------------------------------------


def test_default_catalog_has_exactly_the_documented_families(catalog):
    assert sorted(f.name for f in catalog) == sorted(DOCUMENTED)
    assert len(catalog) == len(DOCUMENTED)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_family_type_labels_and_semantics(catalog, name):
    family = catalog.get(name)
    kind, labels, semantics, collector = DOCUMENTED[name]
    assert family.type is kind
    assert tuple(family.labels) == labels
    assert family.semantics is semantics
    assert family.collector is collector
    assert family.beyond_upstream is (name in BEYOND_UPSTREAM)
    assert family.help.strip()
    assert name in catalog
    assert catalog.find(name) is family


def test_counter_names_end_in_total_and_others_do_not(catalog):
    for family in catalog:
        assert family.name.endswith("_total") == (family.type is MetricType.COUNTER), family.name


def test_only_unfulfilled_is_attempt_level(catalog):
    flagged = {f.name for f in catalog if f.attempt_level}
    assert flagged == {"storage_prefetch_unfulfilled_tokens_total"}


def test_unfulfilled_presets_exactly_the_engines_eleven_reasons_in_order(catalog):
    family = catalog.get("storage_prefetch_unfulfilled_tokens_total")
    assert dict(family.preset) == {"reason": UNFULFILLED_REASONS}
    assert tuple(family.preset["reason"]) == UNFULFILLED_REASONS
    assert family.preset_label_sets() == [{"reason": r} for r in UNFULFILLED_REASONS]
    assert "shrunk" not in family.preset["reason"]  # emitted lazily, never pre-set


def test_deferred_presets_host_and_device_capacity(catalog):
    family = catalog.get("storage_prefetch_deferred_tokens_total")
    assert dict(family.preset) == {"reason": ("host_capacity", "device_capacity")}
    assert family.preset_label_sets() == [{"reason": "host_capacity"}, {"reason": "device_capacity"}]


def test_prefill_effective_tokens_presets_the_four_modes(catalog):
    family = catalog.get("prefill_effective_tokens_total")
    assert dict(family.preset) == {"mode": PREFILL_MODES}
    assert not family.attempt_level


def test_only_the_two_reason_families_and_the_prefill_modes_have_presets(catalog):
    assert {f.name for f in catalog if f.preset} == {
        "storage_prefetch_unfulfilled_tokens_total",
        "storage_prefetch_deferred_tokens_total",
        "prefill_effective_tokens_total",
    }


def test_every_default_family_names_its_collector(catalog):
    assert all(f.collector is not None for f in catalog)


def test_for_collector_gives_each_collectors_families_as_a_catalog(catalog):
    parts = {c: catalog.for_collector(c) for c in Collector}
    assert sum(len(p) for p in parts.values()) == len(catalog)
    for collector, part in parts.items():
        assert {f.name for f in part} == {n for n, spec in DOCUMENTED.items() if spec[3] is collector}
        assert all(part.get(f.name) is catalog.get(f.name) for f in part)
    # A bytes counter travels with its duration histogram.
    assert parts[STORAGE].get("storage_prefetch_bytes_total").duration_histogram in parts[STORAGE]
    assert catalog.for_collector("radix") == parts[RADIX]
    with pytest.raises(ValueError):
        catalog.for_collector("tokenizer")
    with pytest.raises(UnknownFamilyError):
        catalog_from_data({"families": [_fam()]}).for_collector("radix")


def test_preset_label_sets_of_unlabelled_and_unpreset_families(catalog):
    assert catalog.get("evicted_tokens_total").preset_label_sets() == [{}]
    assert catalog.get("load_back_tokens_total").preset_label_sets() == []


@pytest.mark.parametrize(
    "name, buckets",
    [
        ("eviction_duration_seconds", SHORT_DURATION),
        ("load_back_duration_seconds", SHORT_DURATION),
        ("hicache_backup_duration_seconds", BACKUP_DURATION),
        ("prefetch_pgs", PAGES),
        ("backup_pgs", PAGES),
        ("prefetch_bandwidth", BANDWIDTH),
        ("backup_bandwidth", BANDWIDTH),
    ],
)
def test_histogram_buckets_as_documented(catalog, name, buckets):
    assert tuple(catalog.get(name).buckets) == tuple(float(b) for b in buckets)


def test_every_histogram_has_finite_strictly_ascending_buckets(catalog):
    for family in catalog:
        if family.type is MetricType.HISTOGRAM:
            b = list(family.buckets)
            assert b and b == sorted(set(b)) and all(x < float("inf") for x in b), family.name
        else:
            assert family.buckets is None, family.name


def test_bandwidth_pairs_and_gauge_names(catalog):
    pairs = catalog.bandwidth_pairs()
    got = {nbytes.name: (duration.name, nbytes.bandwidth_name) for nbytes, duration in pairs}
    assert got == BANDWIDTH_PAIRS
    for nbytes, duration in pairs:
        assert nbytes.type is MetricType.COUNTER and nbytes.name.endswith("_bytes_total")
        assert duration.type is MetricType.HISTOGRAM
        assert nbytes.semantics is duration.semantics is Semantics.PER_SHARD
        assert nbytes.labels == duration.labels
        assert nbytes.duration_histogram == duration.name
    assert {f.name for f in catalog if f.duration_histogram} == set(BANDWIDTH_PAIRS)


def test_unknown_family_lookup(catalog):
    with pytest.raises(UnknownFamilyError) as info:
        catalog.get("no_such_family_total")
    assert "no_such_family_total" in str(info.value)
    assert isinstance(info.value, KeyError)
    assert catalog.find("no_such_family_total") is None
    assert "no_such_family_total" not in catalog


def test_config_catalog_yaml_is_a_symlink_that_loads_equal_to_the_default(catalog):
    path = REPO / "config" / "catalog.yaml"
    assert path.is_symlink()
    assert path.resolve() == default_path("catalog.yaml").resolve()
    loaded = load_catalog(path)
    assert loaded == catalog
    assert loaded.families == catalog.families


def test_default_catalog_is_parsed_once():
    assert default_catalog() is default_catalog()
    assert load_catalog() == default_catalog()


def test_operator_can_add_a_family_without_code(tmp_path):
    data = yaml.safe_load(default_path("catalog.yaml").read_text())
    data["families"].append(
        {"name": "custom_things_total", "type": "counter", "semantics": "per_shard", "help": "x",
         "labels": ["kind"], "preset": {"kind": ["a", "b"]}}
    )
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(data))
    loaded = load_catalog(path)
    assert len(loaded) == len(DOCUMENTED) + 1
    assert loaded.get("custom_things_total").preset_label_sets() == [{"kind": "a"}, {"kind": "b"}]


# --- invalid catalogs -------------------------------------------------------------------------


def _fam(name="things_total", type="counter", **extra):
    return {"name": name, "type": type, "semantics": "replicated", "help": "h", **extra}


def _hist(name="things_seconds", **extra):
    return _fam(name, "histogram", **{"buckets": [0.1, 1], **extra})


def test_minimal_catalog_is_valid():
    catalog = catalog_from_data({"families": [_fam(), _hist()]})
    assert [f.name for f in catalog] == ["things_total", "things_seconds"]


INVALID = [
    ("unknown-family-key", [_fam(unit="tokens")], ["families.0.unit"]),
    ("unknown-family-key-2nd", [_fam(), _hist(bucket=[1])], ["families.1.bucket"]),
    ("counter-without-total", [_fam(name="things")], ["families.0", "things", "_total"]),
    ("histogram-with-total", [_fam(type="histogram", buckets=[1.0])], ["families.0", "things_total", "_total"]),
    ("histogram-without-buckets", [_fam(name="things_seconds", type="histogram")],
     ["families.0", "things_seconds", "buckets"]),
    ("histogram-empty-buckets", [_fam(name="things_seconds", type="histogram", buckets=[])],
     ["families.0", "buckets"]),
    ("descending-buckets", [_hist(buckets=[1, 0.5])], ["families.0", "things_seconds", "ascending"]),
    ("repeated-bucket", [_hist(buckets=[0.1, 0.1, 1])], ["families.0", "ascending"]),
    ("infinite-bucket", [_hist(buckets=[0.1, float("inf")])], ["families.0", "buckets"]),
    ("counter-with-buckets", [_fam(buckets=[1])], ["families.0", "buckets"]),
    ("duplicate-family", [_fam(), _hist(), _fam()], ["things_total", "twice"]),
    ("preset-foreign-label", [_fam(labels=["pool"], preset={"reason": ["a"]})],
     ["families.0", "preset", "reason"]),
    ("preset-without-labels", [_fam(preset={"reason": ["a"]})], ["families.0", "preset", "reason"]),
    ("duration-histogram-is-a-gauge",
     [_fam(name="x_bytes_total", duration_histogram="x_seconds"), _fam(name="x_seconds", type="gauge")],
     ["x_bytes_total", "duration_histogram", "x_seconds"]),
    ("duration-histogram-is-a-counter",
     [_fam(name="x_bytes_total", duration_histogram="things_total"), _fam()],
     ["x_bytes_total", "duration_histogram", "things_total"]),
    ("duration-histogram-missing", [_fam(name="x_bytes_total", duration_histogram="nope_seconds")],
     ["x_bytes_total", "duration_histogram", "nope_seconds"]),
    ("duration-histogram-on-non-bytes", [_fam(duration_histogram="things_seconds"), _hist()],
     ["families.0", "things_total", "duration_histogram"]),
    ("reserved-le", [_fam(labels=["le"])], ["families.0.labels", "'le'"]),
    ("reserved-quantile", [_fam(labels=["quantile"])], ["families.0.labels", "quantile"]),
    ("reserved-tp_rank", [_fam(labels=["tp_rank"])], ["families.0.labels", "tp_rank"]),
    ("reserved-pp_rank", [_fam(labels=["pool", "pp_rank"])], ["families.0.labels", "pp_rank"]),
    ("reserved-dp_rank", [_fam(labels=["dp_rank"])], ["families.0.labels", "dp_rank"]),
    ("reserved-attn_cp_rank", [_fam(labels=["attn_cp_rank"])], ["families.0.labels", "attn_cp_rank"]),
    ("reserved-dunder", [_fam(labels=["__meta"])], ["families.0.labels", "__meta"]),
    ("bad-label-name", [_fam(labels=["po-ol"])], ["families.0.labels", "po-ol"]),
    ("repeated-label", [_fam(labels=["pool", "pool"])], ["families.0.labels", "pool"]),
    ("bad-family-name", [_fam(name="bad-name_total")], ["families.0.name"]),
    ("bad-type", [_fam(type="summary")], ["families.0.type"]),
    ("bad-semantics", [{**_fam(), "semantics": "summed"}], ["families.0.semantics"]),
    ("missing-semantics", [{k: v for k, v in _fam().items() if k != "semantics"}], ["families.0.semantics"]),
    ("empty-help", [_fam(help="")], ["families.0.help"]),
    ("bad-collector", [_fam(collector="tokenizer")], ["things_total", "collector 'tokenizer'", "streams"]),
    ("bad-beyond-upstream", [_fam(beyond_upstream="maybe")], ["families.0.beyond_upstream"]),
    ("duration-histogram-other-collector",
     [_fam(name="x_bytes_total", duration_histogram="x_seconds", collector="storage"),
      _hist(name="x_seconds", collector="radix")],
     ["x_bytes_total", "x_seconds", "collector"]),
]


@pytest.mark.parametrize("families, fragments", [c[1:] for c in INVALID], ids=[c[0] for c in INVALID])
def test_invalid_catalog_names_the_field(families, fragments):
    with pytest.raises(ConfigError) as info:
        catalog_from_data({"families": copy.deepcopy(families)}, "my-catalog.yaml")
    message = str(info.value)
    assert message.startswith("my-catalog.yaml")
    for fragment in fragments:
        assert fragment in message


def test_unknown_top_level_key():
    with pytest.raises(ConfigError) as info:
        catalog_from_data({"families": [_fam()], "familys": []})
    assert "familys" in str(info.value)


def test_x_keys_hold_yaml_anchors_and_are_ignored():
    catalog = catalog_from_data({"x-buckets": {"a": [1, 2]}, "families": [_hist(buckets=[1, 2])]})
    assert catalog.get("things_seconds").buckets == (1.0, 2.0)


@pytest.mark.parametrize("data", [None, [], ["families"], "families", 3])
def test_catalog_must_be_a_mapping(data):
    with pytest.raises(ConfigError) as info:
        catalog_from_data(data, "cat.yaml")
    assert "cat.yaml" in str(info.value)


def test_missing_families_key():
    with pytest.raises(ConfigError) as info:
        catalog_from_data({}, "cat.yaml")
    assert "families" in str(info.value)


def test_invalid_catalog_file_names_the_file_and_field(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text("families:\n  - name: things\n    type: counter\n    semantics: replicated\n    help: h\n")
    with pytest.raises(ConfigError) as info:
        load_catalog(path)
    assert str(path) in str(info.value)
    assert "families.0" in str(info.value) and "_total" in str(info.value)


def test_missing_and_unparsable_catalog_files(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_catalog(missing)
    assert str(missing) in str(info.value)
    broken = tmp_path / "broken.yaml"
    broken.write_text("families: [\n")
    with pytest.raises(ConfigError) as info:
        load_catalog(broken)
    assert str(broken) in str(info.value)
