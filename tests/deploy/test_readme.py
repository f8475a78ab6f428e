"""README.md and docs/: the first screen, links that resolve, configs that load, nothing outside the repo.

The first screen (before the first `## `) says whom the project is for, the three ways to connect
an engine with a link to each section, the one-line semantics and the two make commands. Every
relative link points at a file of the repository (and, with `#anchor`, at a heading there); the
config examples load with the sidecar's strict loader; every `serve`, `demo` and `top` flag is documented.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
# docs/api* is written by another part of the project; everything else under docs/ is checked here.
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if not p.name.startswith("api"))
PAGES = [README, *DOCS]


def text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for the headings of a Markdown file."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", strip_code(text(path)), re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def strip_code(markdown: str) -> str:
    return re.sub(r"```.*?```", "", markdown, flags=re.S)


def first_screen() -> str:
    return text(README).split("\n## ", 1)[0]


def test_first_screen_says_who_how_what_and_the_two_commands() -> None:
    screen = first_screen()
    assert len(screen.splitlines()) <= 40, "a first screen"
    assert "For operators" in screen
    for way, anchor in (("Push client", "push-the-client-library"), ("stat-logger hook", "the-stat-logger-hook"),
                        ("Proxy", "the-proxy")):
        line = next((ln for ln in screen.splitlines() if ln.startswith("* ") and way in ln), None)
        assert line and f"(#{anchor})" in line, f"the first screen links {way} to its section"
    assert "bytes and seconds are summed over ranks" in screen and "once per" in screen
    assert "$ make demo" in screen and "$ make test" in screen
    assert "(#which-series-to-read-one-pod-or-a-fleet)" in screen


def test_the_one_rule_is_stated_once_and_linked() -> None:
    readme = text(README)
    assert readme.count("### Which series to read: one pod or a fleet") == 1
    rule = "**One pod: read its sidecar's rollups"
    assert readme.count(rule) == 1
    for page in PAGES:
        if page != README:
            assert rule not in text(page), f"{page.name} restates the rule instead of linking it"
    assert "README.md#which-series-to-read-one-pod-or-a-fleet" in text(ROOT / "docs" / "kubernetes.md")


def test_links_resolve_inside_the_repository() -> None:
    problems = []
    for page in PAGES:
        body = strip_code(text(page))
        for target in re.findall(r"\]\(([^)]+)\)", body):
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists() or ROOT not in resolved.parents and resolved != ROOT:
                problems.append(f"{page.name}: {target} does not exist in the repository")
            elif anchor and anchor not in anchors(resolved):
                problems.append(f"{page.name}: {target}: no heading #{anchor}")
    assert not problems, "\n".join(problems)


def test_link_check_can_fail(tmp_path: Path) -> None:
    page = tmp_path / "x.md"
    page.write_text("# Title\n", encoding="utf-8")
    assert anchors(page) == {"title"} and "nope" not in anchors(page)


def test_nothing_refers_to_files_outside_the_repository() -> None:
    for page in PAGES:
        body = text(page)
        assert "DESIGN" not in body, f"{page.name} refers to the design document, which is not in the repository"
        assert "/work/" not in body and "shared/" not in body


def test_the_status_page_and_top_follow_the_routes() -> None:
    readme = text(README)
    running = readme.index("\n## Running the sidecar\n")
    page = readme.index("\n### The status page and the JSON API\n")
    top = readme.index("\n### `hicache-exporter top`")
    assert running < readme.index("/api/v1/status", running) < page < top < readme.index("\n## Deploying on Kubernetes\n")
    assert "docs/api.md" in readme[page:top] and "docs/api/v1.schema.json" in readme[page:top]


def test_config_examples_load_with_the_sidecars_strict_loader() -> None:
    from exporter.config import config_from_data

    blocks = re.findall(r"```yaml\n(# sidecar\.yaml \((\w+)\)\n.*?)```", text(README), re.S)
    assert {kind for _, kind in blocks} == {"push", "proxy"}
    for body, kind in blocks:
        config = config_from_data(yaml.safe_load(body), f"README sidecar.yaml ({kind})")
        if kind == "proxy":
            assert {u.label for u in config.upstreams} == {"engine", "engine-dir"}


def test_every_serve_demo_and_top_flag_is_documented() -> None:
    import argparse

    from exporter.cli import build_parser

    documented = "\n".join(text(page) for page in PAGES)
    (subparsers,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    missing = [f"{name} {flag}" for name in ("serve", "demo", "top") for action in subparsers.choices[name]._actions
               for flag in action.option_strings if flag not in ("-h", "--help") and flag not in documented]
    assert not missing, f"flags documented nowhere in README.md or docs/: {missing}"


def test_the_scrape_config_in_docs_is_valid_prometheus_config(tmp_path: Path) -> None:
    (block,) = [b for b in re.findall(r"```yaml\n(.*?)```", text(ROOT / "docs" / "kubernetes.md"), re.S)
                if b.startswith("scrape_configs:")]
    promtool = shutil.which("promtool")
    assert promtool, "promtool is required (README: make test installs it)"
    config = yaml.safe_load(block)
    # Debian's Prometheus is built without Kubernetes discovery, so its promtool refuses
    # kubernetes_sd_configs; a static target in its place still checks every relabel rule.
    job = config["scrape_configs"][0]
    assert job.pop("kubernetes_sd_configs") == [{"role": "pod"}]
    job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    result = subprocess.run([promtool, "check", "config", "--syntax-only", str(path)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr
    relabel = yaml.safe_load(block)["scrape_configs"][0]["relabel_configs"]
    monitor = next(d for d in yaml.safe_load_all(text(ROOT / "config" / "k8s" / "podmonitor.yaml")) if d)
    server = [{"source_labels": r["sourceLabels"], **{k: r[k] for k in ("regex", "replacement") if k in r},
               "target_label": r["targetLabel"]} for r in monitor["spec"]["podMetricsEndpoints"][0]["relabelings"]]
    assert [r for r in relabel if r.get("target_label") == "server"] == server, "the same `server` as the PodMonitor"


@pytest.mark.parametrize("page", DOCS, ids=lambda p: p.name)
def test_every_doc_is_linked_from_the_readme(page: Path) -> None:
    assert f"docs/{page.name}" in text(README)
