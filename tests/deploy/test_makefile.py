"""The README's two commands are all the set-up: `make test` installs or names promtool, the
Prometheus server and Chromium before anything else, and `make demo` installs only what the demo needs."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MAKE = shutil.which("make")
# Under `make test` the environment says this is a sub-make (MAKELEVEL, MAKEFLAGS), which would
# make the make run here print "Entering directory" lines and number its own messages.
PLAIN_ENV = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES")}


def make(*args: str, path: str) -> tuple[subprocess.CompletedProcess[str], float]:
    assert MAKE, "make is required"
    started = time.monotonic()
    result = subprocess.run([MAKE, "-s", *args], cwd=REPO, capture_output=True, text=True, timeout=60,
                            env={**PLAIN_ENV, "PATH": path})
    return result, time.monotonic() - started


def test_make_test_without_promtool_stops_at_once_with_one_line(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()  # no promtool, no prometheus, no apt-get: nothing can be installed
    result, seconds = make("test", path=str(bare))
    assert result.returncode != 0
    assert seconds < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", result.stderr  # make's own `*** ... Stop.` is that line
    assert "make test: promtool and prometheus not on the PATH; install the Debian package prometheus" in lines[0]
    assert "Traceback" not in result.stderr and "pytest" not in result.stdout + result.stderr


def test_make_test_installs_the_debian_package_as_root(tmp_path: Path) -> None:
    """As root with apt-get: `apt-get update`, then `apt-get install prometheus` (faked here)."""
    bin_dir = tmp_path / "bin"
    log = _fake_root_apt(bin_dir, "promtool", "prometheus")
    result, _ = make("prometheus-tools", path=str(bin_dir))
    assert result.returncode == 0, result.stderr
    assert "installing the Debian package prometheus" in result.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("update") and "install -y -qq prometheus" in calls[1]
    assert (bin_dir / "promtool").exists() and (bin_dir / "prometheus").exists()
    again, _ = make("prometheus-tools", path=str(bin_dir))
    assert again.returncode == 0 and again.stdout == again.stderr == "", "installed: nothing more to say"


def _fake_root_apt(bin_dir: Path, *installs: str) -> Path:
    """`id` that says root and an `apt-get` that logs its calls (to the returned file) and, on
    install, puts empty `installs` on the PATH."""
    bin_dir.mkdir(exist_ok=True)
    log = bin_dir.parent / "apt.log"
    (bin_dir / "id").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "apt-get").write_text(
        f"#!/bin/sh\necho \"$*\" >> {log}\n"
        f"case \"$*\" in *install*) for t in {' '.join(installs)}; do printf '#!/bin/sh\\n' > {bin_dir}/$t; "
        f"/bin/chmod +x {bin_dir}/$t; done;; esac\n")
    for tool in ("id", "apt-get"):
        (bin_dir / tool).chmod(0o755)
    return log


def _fake_tools(bin_dir: Path, *names: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)


def test_make_test_without_chromium_stops_at_once_with_one_line(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    _fake_tools(bare, "promtool", "prometheus")  # Prometheus is there; Chromium and apt-get are not
    result, seconds = make("test", path=str(bare))
    assert result.returncode != 0
    assert seconds < 10
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and result.stdout == "", result.stderr
    assert "make test: chromium not on the PATH; install the Debian package chromium" in lines[0]
    assert "Traceback" not in result.stderr and "pytest" not in result.stdout + result.stderr


def test_make_test_installs_chromium_as_root(tmp_path: Path) -> None:
    """As root with apt-get: `apt-get update`, then `apt-get install chromium` (faked here)."""
    bin_dir = tmp_path / "bin"
    _fake_tools(bin_dir, "promtool", "prometheus")
    log = _fake_root_apt(bin_dir, "chromium")
    result, _ = make("chromium", path=str(bin_dir))
    assert result.returncode == 0, result.stderr
    assert "installing the Debian package chromium" in result.stderr
    calls = log.read_text().splitlines()
    assert calls[0].startswith("update") and "install -y -qq chromium" in calls[1]
    assert (bin_dir / "chromium").exists()
    again, _ = make("chromium", path=str(bin_dir))
    assert again.returncode == 0 and again.stdout == again.stderr == "", "installed: nothing more to say"


def test_make_test_checks_the_tools_first_and_ci_calls_it() -> None:
    dry = subprocess.run([MAKE or "make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=30, env=PLAIN_ENV)
    assert dry.stdout.splitlines()[0].endswith(".ci/prometheus-tools")
    assert dry.stdout.splitlines()[1].endswith(".ci/chromium")
    assert "make test" in (REPO / ".ci" / "run").read_text()


def test_make_demo_installs_only_the_cache_extra(tmp_path: Path) -> None:
    dry = subprocess.run([MAKE or "make", "-n", "demo", f"VENV={tmp_path / 'venv'}"], cwd=REPO,
                         capture_output=True, text=True, timeout=30, env=PLAIN_ENV)
    assert dry.returncode == 0, dry.stderr
    installs = [line for line in dry.stdout.splitlines() if "pip install" in line and " -e " in line]
    assert installs == [f"{tmp_path / 'venv'}/bin/python -m pip install --quiet -e '.[cache]'"]
    assert "installing hicache-exporter with its cache extra" in dry.stdout
