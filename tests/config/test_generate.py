"""config/generate.py: the committed rules, PrometheusRule, dashboard and manifests are what it writes.

The staleness check is the generator's own `--check`, run as a person runs it; a mutation shows
it fails, and another namespace's set is written where asked and never over the committed one.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from config.generator import DEFAULT_NAMESPACE, outputs, readme_block, with_readme_block
from config.generator.yamltext import Folded, Key, dump_documents, dump_mapping

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "config"
GENERATE = CONFIG / "generate.py"


def generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(GENERATE), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})


def test_the_committed_files_are_not_stale() -> None:
    result = generate("--check")
    assert result.returncode == 0, f"run: python config/generate.py\n{result.stderr}"


def test_check_names_a_stale_file(tmp_path: Path) -> None:
    """The staleness check can fail: one changed line in a copy of the committed set is caught."""
    out = tmp_path / "config"
    for rel in outputs():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(CONFIG / rel, out / rel)
    assert generate("--check", "--output-dir", str(out)).returncode == 0
    rules = out / "prometheus" / "recording_rules.yml"
    rules.write_text(rules.read_text(encoding="utf-8").replace("[5m]", "[1m]", 1), encoding="utf-8")
    (out / "k8s" / "lws.yaml").unlink()
    result = generate("--check", "--output-dir", str(out))
    assert result.returncode == 1
    assert str(rules) in result.stderr and str(out / "k8s" / "lws.yaml") in result.stderr
    assert "podmonitor.yaml" not in result.stderr


def test_another_namespace_needs_an_output_dir_and_writes_the_same_layout(tmp_path: Path) -> None:
    refused = generate("--namespace", "sglang:")
    assert refused.returncode == 2 and "--output-dir" in refused.stderr
    assert generate("--namespace", "sglang:", "--output-dir", str(tmp_path)).returncode == 0
    written = {str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*") if p.is_file()}
    assert written == set(outputs())
    rules = (tmp_path / "prometheus" / "recording_rules.yml").read_text(encoding="utf-8")
    assert "cluster:sglang:load_back_bytes:rate5m" in rules and "rate(sglang:load_back_bytes_total[5m])" in rules
    assert "sglang_" not in rules.replace("sglang_rollup_", "")
    bad = generate("--namespace", "9x", "--output-dir", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "namespace" in bad.stderr and not (tmp_path / "bad").exists()


def test_output_is_deterministic_and_namespaced() -> None:
    assert outputs() == outputs(DEFAULT_NAMESPACE)
    colon = outputs("sglang:")
    assert set(colon) == set(outputs())
    assert yaml.safe_load(colon["k8s/prometheusrule.yaml"].split("---\n", 1)[1])["metadata"]["name"] == \
        "hicache-exporter-sglang-colon"
    assert '"uid": "hicache-exporter-sglang-colon"' in colon["grafana/hicache-exporter.json"]
    assert "namespace: 'sglang:'" in colon["k8s/proxy.yaml"]


def test_the_readme_block_is_the_proxy_deployment() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme_block() in readme
    block = readme_block().split("```yaml\n", 1)[1].split("```", 1)[0]
    (deployment,) = [d for d in yaml.safe_load_all(block) if d]
    committed = [d for d in yaml.safe_load_all((CONFIG / "k8s" / "proxy.yaml").read_text(encoding="utf-8")) if d]
    assert deployment == next(d for d in committed if d["kind"] == "Deployment")
    with pytest.raises(ValueError, match="markers"):
        with_readme_block("no markers here")


def test_yaml_writer_keeps_comments_and_refuses_what_does_not_load_back() -> None:
    text = dump_documents([{Key("a", "why a"): {"b": ["x", "y, z"], "c": "line 1\nline 2\n",
                                                "d": Folded("some prose " * 20 + "end"), "e": "0660"}}])
    assert "# why a\na:" in text and 'b: ["x", "y, z"]' in text and "d: >-" in text and "e: '0660'" in text
    assert yaml.safe_load(text)["a"]["d"] == "some prose " * 20 + "end"
    with pytest.raises(ValueError, match="single spaces"):
        dump_documents([{"d": Folded("two  spaces")}])


def test_yaml_writer_quotes_what_a_yaml_1_1_or_1_2_reader_would_misread() -> None:
    """Kubernetes and Prometheus read YAML 1.1 (`on` is a bool, `0660` octal, `12:30` base 60),
    ruamel.yaml writes 1.2 (`1e3` is a float): a string either would misread is quoted."""
    text = dump_mapping({"yes": "on", "b": "1e3", "c": "0660", "d": 1e-05, "e": None, "f": "12:30"})
    assert text == "'yes': 'on'\nb: '1e3'\nc: '0660'\nd: 1.0e-05\ne: null\nf: '12:30'\n"


def test_a_family_added_to_the_catalog_gets_its_rules(tmp_path: Path) -> None:
    """The rule set follows the catalog (`--catalog`, the sidecar's metrics.catalog), not a list in the generator."""
    catalog = yaml.safe_load((ROOT / "exporter" / "defaults" / "catalog.yaml").read_text(encoding="utf-8"))
    catalog["families"].append({"name": "custom_refill_tokens_total", "type": "counter", "semantics": "replicated",
                                "collector": "radix", "help": "Tokens refilled by a custom path."})
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog), encoding="utf-8")
    assert generate("--catalog", str(path)).returncode == 2, "never over the committed set"
    out = tmp_path / "out"
    assert generate("--catalog", str(path), "--output-dir", str(out)).returncode == 0
    rules = (out / "prometheus" / "recording_rules.yml").read_text(encoding="utf-8")
    assert "record: dp_group:sglang_custom_refill_tokens:rate5m" in rules
    assert "record: cluster:sglang_custom_refill_tokens:rate5m" in rules
    assert "custom_refill" not in outputs()["prometheus/recording_rules.yml"]


def test_the_rules_and_dashboard_cover_every_profile_in_use(tmp_path: Path) -> None:
    """The committed set holds the lmcache profile's groups and rows; `--profiles ""` leaves them out, the sglang
    rules staying the same bytes, and a set other than the committed one needs an output directory."""
    committed = (CONFIG / "prometheus" / "recording_rules.yml").read_text(encoding="utf-8")
    groups = [g["name"] for g in yaml.safe_load(committed)["groups"]]
    assert groups == ["hicache-per-shard", "hicache-replicated", "hicache-prefill-tiers", "lmcache-per-shard",
                      "lmcache-replicated", "lmcache-prefill-tiers"]
    assert "LMCache" in (CONFIG / "grafana" / "hicache-exporter.json").read_text(encoding="utf-8")
    assert generate("--profiles", "").returncode == 2, "never over the committed set"
    assert generate("--profiles", "", "--output-dir", str(tmp_path)).returncode == 0
    alone = (tmp_path / "prometheus" / "recording_rules.yml").read_text(encoding="utf-8")
    assert "lmcache" not in alone and "LMCache" not in (tmp_path / "grafana" / "hicache-exporter.json").read_text()
    sglang_groups = [g for g in yaml.safe_load(committed)["groups"] if g["name"].startswith("hicache-")]
    assert yaml.safe_load(alone)["groups"] == sglang_groups
    assert alone.split("\ngroups:\n", 1)[1] in committed, "the sglang groups' text, comments included, unchanged"
