"""The `_total` rule: FamilySpec.exported_name drops it from a counter's family, value_sample_name adds it back."""

from __future__ import annotations

from exporter.catalog import default_catalog
from exporter.sidecar.expose.families import SELF_FAMILIES, ExposedFamilies


def test_every_catalog_series_is_exposed_under_its_catalog_name() -> None:
    families = ExposedFamilies(default_catalog(), "sglang_")
    for spec in default_catalog():
        assert families.per_rank[spec.name].sample_name == "sglang_" + spec.name
        assert families.rollup[spec.name].sample_name == "sglang_rollup_" + spec.name


def test_self_counters_are_named_without_total_and_sampled_with_it() -> None:
    for name, family in SELF_FAMILIES.items():
        assert not name.endswith("_total"), name
        assert family.sample_name == (name + "_total" if family.type == "counter" else name)
