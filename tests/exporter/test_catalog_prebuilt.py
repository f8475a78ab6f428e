"""The packaged profiles pre-built for the rank client (exporter/defaults/rank_catalogs.json) are what their YAML gives."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

import pytest

from exporter.catalog import PACKAGED_PROFILES, MetricType, load_profile, rank_catalogs_text
from exporter.defaults import default_path
from exporter.errors import UnknownFamilyError
from exporter.rank_catalog import RANK_CATALOGS, BuiltFamily, built_catalog

REPO = Path(__file__).resolve().parents[2]
REGENERATE = "python -m exporter.catalog"


def test_the_prebuilt_catalogs_are_what_the_yaml_gives() -> None:
    written = default_path(RANK_CATALOGS).read_text(encoding="utf-8")
    assert written == rank_catalogs_text(), (
        f"exporter/defaults/{RANK_CATALOGS} is stale (a packaged profile's YAML changed): run `{REGENERATE}`")


@pytest.mark.parametrize("profile", list(PACKAGED_PROFILES))
def test_a_prebuilt_family_reads_as_the_validated_one(profile: str) -> None:
    validated, built = load_profile(profile), built_catalog(profile)
    assert [f.name for f in built] == [f.name for f in validated]
    assert len(built) == len(validated)
    for spec in validated:
        family = built.get(spec.name)
        assert isinstance(family, BuiltFamily) and spec.name in built
        assert (family.type, family.labels, family.buckets, dict(family.preset), family.collector) == \
            (spec.type, spec.labels, spec.buckets, spec.preset, spec.collector)
        assert family.preset_label_sets() == spec.preset_label_sets()
    labels = {label for spec in validated for label in spec.labels} | {"model_name", "not_a_family_label"}
    assert built.static_label_conflicts(labels) == validated.static_label_conflicts(labels)


@pytest.mark.parametrize("profile", list(PACKAGED_PROFILES))
def test_a_prebuilt_catalog_finds_an_engine_metric_as_the_validated_one(profile: str) -> None:
    validated, built = load_profile(profile), built_catalog(profile)
    prefix = validated.default_profile.upstream_prefix
    for spec in validated:
        for name in (prefix + spec.name, prefix + spec.base_name, "other:" + spec.name):
            for kind in MetricType:
                found, expected = built.engine_family(name, prefix, kind), validated.engine_family(name, prefix, kind)
                assert (found and found.name) == (expected and expected.name), (name, kind)


def test_an_unknown_family_or_profile_is_named() -> None:
    with pytest.raises(UnknownFamilyError) as built:
        built_catalog().get("no_such_family_total")
    with pytest.raises(UnknownFamilyError) as validated:
        load_profile("sglang").get("no_such_family_total")
    assert str(built.value) == str(validated.value)
    assert built_catalog().find("no_such_family_total") is None
    with pytest.raises(UnknownFamilyError, match="no packaged profile 'vllm' \\(packaged: sglang, lmcache\\)"):
        built_catalog("vllm")


def test_the_prebuilt_catalogs_are_read_once() -> None:
    assert built_catalog() is built_catalog("sglang")
    assert built_catalog("lmcache") is built_catalog("lmcache")


def test_the_prebuilt_catalogs_ship_as_package_data() -> None:
    # The table as pyproject.toml declares it (tomllib is Python 3.11+; the project supports 3.10).
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    line = re.search(r'^"exporter\.defaults" = \[(.*)\]$', text, re.M)
    assert line is not None
    patterns = re.findall(r'"([^"]+)"', line.group(1))
    assert any(fnmatch.fnmatch(RANK_CATALOGS, pattern) for pattern in patterns), patterns


def test_an_engine_whose_packaged_catalogs_cannot_be_read_keeps_its_metrics_and_is_told_once(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Guest code never raises into the engine: with the packaged file gone (a broken install) every lookup
    is None, so the engine's own metric stays, and one warning says why."""
    import exporter.rank_catalog as rank_catalog

    monkeypatch.setattr(rank_catalog, "_built", None)
    monkeypatch.setattr(rank_catalog, "_unreadable", [])
    monkeypatch.setattr(rank_catalog, "default_path", lambda name: tmp_path / name)  # no such file
    with pytest.raises(FileNotFoundError):
        built_catalog()
    for name in ("sglang:load_back_bytes_total", "sglang:prefill_effective_tokens_total"):
        assert rank_catalog.packaged_engine_family("sglang", name, "sglang:", MetricType.COUNTER) is None
    assert rank_catalog.packaged_engine_family("lmcache", "lmcache:num_hit_tokens", "lmcache:",
                                               MetricType.COUNTER) is None
    from exporter.integrations import lmcache

    assert lmcache.profile_family("lmcache:num_hit_tokens", MetricType.COUNTER) is None  # the LMCache hook's lookup
    warnings = [r.getMessage() for r in caplog.records if "packaged catalogs could not be read" in r.getMessage()]
    assert len(warnings) == 1 and "FileNotFoundError" in warnings[0]
    monkeypatch.setattr(rank_catalog, "default_path", default_path)
    spec = rank_catalog.packaged_engine_family("sglang", "sglang:load_back_bytes_total", "sglang:", MetricType.COUNTER)
    assert spec is not None and spec.name == "load_back_bytes_total"  # read again once the file is back
