"""Engine profiles in the config and on the command line: upstreams[].profile, --upstream-profile, --profile, check-config."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from exporter.catalog import default_catalog, load_profiles
from exporter.cli import build_parser, per_upstream
from exporter.config import config_from_data, load_config
from exporter.defaults import default_path
from exporter.errors import ConfigError, HicacheExporterError

CLI = [sys.executable, "-m", "exporter.cli"]
LMCACHE_FAMILIES = 94  # every family LMCache 0.5.6's logger registers (docs/lmcache-0.5.6.md)


def profiles_of(*argv: str) -> dict[str, str]:
    """Each command-line upstream's --upstream-profile, by its URL or directory, as serve reads them."""
    args = build_parser().parse_args(["serve", *argv])
    return per_upstream(args, args.upstream_profile, "--upstream-profile")


def test_an_upstream_reads_the_default_profile_unless_its_profile_says_otherwise_and_its_profile_is_served() -> None:
    config = config_from_data({"upstreams": [{"url": "http://a/metrics"}]}, "test")
    assert config.upstreams[0].profile is None and config.profiles_in_use == ()  # the default's: one catalog
    config = config_from_data({"upstreams": [{"url": "http://a/metrics", "profile": "lmcache"},
                                             {"multiprocess_dir": "/d", "profile": "lmcache"}]}, "test")
    assert [u.profile for u in config.upstreams] == ["lmcache", "lmcache"]
    assert config.profiles_in_use == ("lmcache",)


def test_one_upstream_profile_is_for_every_command_line_upstream() -> None:
    assert profiles_of("--upstream", "http://a/m", "--upstream-multiprocess-dir", "/d",
                       "--upstream-profile", "lmcache") == {"http://a/m": "lmcache", "/d": "lmcache"}


def test_upstream_profiles_go_with_the_command_line_upstreams_in_their_order() -> None:
    assert profiles_of("--upstream-multiprocess-dir", "/d", "--upstream-profile", "lmcache", "--upstream",
                       "http://a/m", "--upstream-profile", "sglang") == {"/d": "lmcache", "http://a/m": "sglang"}
    config = load_config(None, env={}, upstreams=["http://a/m"], upstream_dirs=["/d"],
                         upstream_profiles={"/d": "lmcache", "http://a/m": "sglang"})
    assert [(u.label, u.profile) for u in config.upstreams] == [("http://a/m", "sglang"), ("/d", "lmcache")]
    assert config.profiles_in_use == ("sglang", "lmcache")


def test_as_many_upstream_profiles_as_upstreams_or_one() -> None:
    with pytest.raises(HicacheExporterError, match="^2 --upstream-profile for 3 upstreams: give one for all of them"):
        profiles_of("--upstream", "http://a/m", "--upstream", "http://b/m", "--upstream-multiprocess-dir", "/d",
                    "--upstream-profile", "lmcache", "--upstream-profile", "sglang")
    with pytest.raises(HicacheExporterError, match="^--upstream-profile applies to the upstreams given with"):
        profiles_of("--upstream-profile", "lmcache")


def test_the_flag_gives_a_file_upstream_its_profile(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("upstreams:\n  - {name: engine, url: 'http://e:8000/metrics', interval_seconds: 4}\n")
    config = load_config(path, env={}, upstreams=["http://e:8000/metrics"],
                         upstream_profiles={"http://e:8000/metrics": "lmcache"})
    assert [(u.label, u.interval_seconds, u.profile) for u in config.upstreams] == [("engine", 4.0, "lmcache")]


def test_profile_serves_a_profile_to_pushing_ranks_once() -> None:
    assert build_parser().parse_args(["serve", "--profile", "lmcache", "--profile", "lmcache"]).profile == [
        "lmcache", "lmcache"]
    config = load_config(None, env={}, profiles=["lmcache", "lmcache"])
    assert config.metrics.profiles == ("lmcache",) and config.profiles_in_use == ("lmcache",)
    assert len(load_profiles(config.metrics.catalog, config.profiles_in_use)) == len(default_catalog()) + LMCACHE_FAMILIES


def test_an_unknown_profile_is_one_config_error_line_naming_it(socket_dir: Path) -> None:
    with pytest.raises(ConfigError) as refused:
        load_profiles(None, ["nosuch"])
    assert "nosuch" in str(refused.value) and "\n" not in str(refused.value)
    for flag in ("--upstream-profile", "--profile"):
        upstream = ["--upstream", "http://127.0.0.1:1/metrics"] if flag == "--upstream-profile" else []
        result = subprocess.run([*CLI, "serve", *upstream, flag, "nosuch", "--port", "0", "--socket",
                                 str(socket_dir / "m.sock")], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and result.stderr.startswith("hicache-exporter: error: ")
        assert "nosuch" in result.stderr


def test_two_profiles_that_define_one_family_name_are_refused(tmp_path: Path) -> None:
    other = yaml.safe_load(default_path("lmcache.yaml").read_text())
    other["profile"].update(name="other", namespace="other_")
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump(other))
    with pytest.raises(ConfigError) as refused:
        load_profiles(None, ["lmcache", str(path)])
    said = str(refused.value)
    assert "families defined twice (two profiles in use may not share a family name)" in said
    assert "'num_hit_tokens_total'" in said
    with pytest.raises(ConfigError, match="profile 'lmcache' is given twice"):
        other["profile"]["name"] = "lmcache"
        path.write_text(yaml.safe_dump(other))
        load_profiles(None, ["lmcache", str(path)])


@pytest.mark.parametrize("config, families", [
    ("upstreams: [{url: 'http://e:8000/metrics'}]\n", 0),
    ("upstreams: [{url: 'http://e:8000/metrics', profile: lmcache}]\n", LMCACHE_FAMILIES),
    ("metrics: {profiles: [lmcache]}\n", LMCACHE_FAMILIES),
    ("metrics: {profiles: [lmcache]}\nupstreams: [{multiprocess_dir: /d, profile: lmcache}]\n", LMCACHE_FAMILIES),
])
def test_check_config_counts_the_families_of_every_profile_in_use(tmp_path: Path, config: str, families: int) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(config)
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f": OK ({len(default_catalog()) + families} families, " in result.stdout


def test_serve_refuses_an_lmcache_upstream_world_of_several_replicas_in_one_line(socket_dir: Path) -> None:
    result = subprocess.run([*CLI, "serve", "--upstream", "http://127.0.0.1:1/metrics", "--upstream-profile", "lmcache",
                             "--upstream-world", "tp=4,dp=2", "--port", "0", "--socket", str(socket_dir / "m.sock")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        "hicache-exporter: error: upstream http://127.0.0.1:1/metrics: profile 'lmcache' labels no data-parallel "
        "replica, so its replicas read as one engine here (their sum); give world dp_size 1, or push through the "
        "hook, which tells replicas apart\n")


def test_check_config_refuses_what_serve_refuses_an_lmcache_world_of_several_replicas(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("upstreams: [{url: 'http://e:8000/metrics', profile: lmcache, world: {tp_size: 4, dp_size: 2}}]\n")
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr == (
        "hicache-exporter: error: upstream http://e:8000/metrics: profile 'lmcache' labels no data-parallel "
        "replica, so its replicas read as one engine here (their sum); give world dp_size 1, or push through the "
        "hook, which tells replicas apart\n")


def test_an_upstream_may_name_its_profile_by_file(tmp_path: Path) -> None:
    """A profile file the config names is found by that name, though the profile inside is called otherwise."""
    profile = tmp_path / "mine.yaml"
    profile.write_text(yaml.safe_dump({
        "profile": {"name": "mine", "namespace": "mine_", "upstream_prefix": "mine:"},
        "families": [{"name": "widgets_total", "type": "counter", "semantics": "per_shard", "help": "Widgets."}]}))
    path = tmp_path / "sidecar.yaml"
    path.write_text(f"upstreams: [{{url: 'http://e:8000/metrics', profile: {str(profile)!r}}}]\n")
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f": OK ({len(default_catalog()) + 1} families, " in result.stdout
    catalog = load_profiles(None, [str(profile)])
    assert [f.name for f in catalog.of_profile(str(profile))] == ["widgets_total"]


def test_check_config_refuses_a_profile_whose_names_clash_on_metrics(tmp_path: Path) -> None:
    profile = tmp_path / "mine.yaml"
    profile.write_text(yaml.safe_dump({
        "profile": {"name": "mine", "namespace": "hicache_exporter_", "upstream_prefix": "mine:"},
        "families": [{"name": "ranks", "type": "gauge", "semantics": "per_shard", "help": "Ranks."}]}))
    path = tmp_path / "sidecar.yaml"
    path.write_text(f"metrics: {{profiles: [{str(profile)!r}]}}\n")
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("hicache-exporter: error: exported names clash (hicache_exporter_ranks")
    assert result.stderr.count("\n") == 1


def test_an_upstream_without_a_profile_reads_the_default_profile_whichever_it_is(tmp_path: Path) -> None:
    """metrics.catalog may be another engine's profile: an upstream without `profile` reads that one, and the
    packaged sglang profile is not loaded beside it (its family names might clash)."""
    path = tmp_path / "sidecar.yaml"
    path.write_text(f"metrics: {{catalog: {str(default_path('lmcache.yaml'))!r}}}\n"
                    "upstreams: [{url: 'http://e:8000/metrics', world: {tp_size: 4, dp_size: 2}}]\n")
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2  # the lmcache profile's world rule, so the upstream reads lmcache
    assert "profile 'lmcache' labels no data-parallel replica" in result.stderr
    path.write_text(f"metrics: {{catalog: {str(default_path('lmcache.yaml'))!r}}}\n"
                    "upstreams: [{url: 'http://e:8000/metrics'}]\n")
    result = subprocess.run([*CLI, "check-config", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f": OK ({LMCACHE_FAMILIES} families, " in result.stdout
