"""Build and run the sidecar image with podman and buildah, on a base made from Debian packages.

No base image registry needs to be reachable: a stand-in for the Dockerfile's `FROM` image (the
official slim Python image) is made with mmdebstrap from Debian's own python3 packages and tagged
locally with exactly the name `FROM` uses, so the Dockerfile built is the one users build. The
stand-in is cached in podman's image store, keyed on its recipe; the sidecar image is built afresh.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.test_dockerfile import instructions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
CACHE = ROOT / ".cache" / "image"
TOOLS = ("podman", "buildah", "mmdebstrap")
TEST_TAG = "localhost/hicache-exporter:image-test"
CONTAINER = "hicache-exporter-image-test"
RECIPE_LABEL = "org.hicache-exporter.stand-in-recipe"
# A TLS-intercepting network needs the host's CA bundle for the builder stage's pip to reach PyPI.
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# podman run needs cgroups this kind of host may not give ("crun: cgroups in hybrid mode not
# supported"); buildah in chroot isolation runs the image all the same.
ISOLATION = ("--isolation", "chroot", "--network", "host")
NONROOT = "65532:65532"

# The official image keeps Python in /usr/local with pip free to install into it; Debian's python3
# is in /usr and marked externally managed. These hooks make Debian's behave like the official one.
STAND_IN_HOOKS = (
    'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
    'ln -s /usr/bin/python3 "$1/usr/local/bin/python"',
    'ln -s /usr/bin/pip3 "$1/usr/local/bin/pip"',
)
STAND_IN_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "ENV LANG=C.UTF-8",
    'CMD ["python3"]',
)


def missing_tools() -> str | None:
    """One line naming what to install, or None when podman, buildah and mmdebstrap are on the PATH."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    if not missing:
        return None
    return (f"{', '.join(missing)} not on the PATH: install the Debian packages {' '.join(TOOLS)} "
            f"(`make image-tools` does, as root)")


def base_image(dockerfile: Path = DOCKERFILE) -> str:
    """The one image the Dockerfile's stages start `FROM` (stage names left out)."""
    stage_names: set[str] = set()
    bases: set[str] = set()
    for keyword, args in instructions(dockerfile.read_text(encoding="utf-8")):
        if keyword != "FROM":
            continue
        words = [w for w in args.split() if not w.startswith("--")]
        if words[0] not in stage_names:
            bases.add(words[0])
        if len(words) == 3 and words[1].upper() == "AS":
            stage_names.add(words[2])
    assert len(bases) == 1, f"the stand-in replaces one base image; the Dockerfile uses {sorted(bases)}"
    return bases.pop()


@dataclass(frozen=True)
class StandIn:
    """What the stand-in for the `FROM` image is made of."""

    name: str  # exactly the Dockerfile's FROM
    python: str  # the Python minor version that name promises, e.g. "3.11"
    suite: str  # the Debian release, e.g. "bookworm"

    @classmethod
    def for_base(cls, name: str) -> StandIn:
        match = re.fullmatch(r"python:(\d+\.\d+)(?:\.\d+)?-slim-([a-z]+)", name)
        assert match, f"{name}: the stand-in is made for python:X.Y-slim-<debian release> (no digest) only"
        return cls(name, match.group(1), match.group(2))

    def mmdebstrap(self, tarball: Path) -> list[str]:
        return ["mmdebstrap", "--quiet", "--variant=minbase",
                "--include=python3,python3-pip,python3-venv,ca-certificates",
                *(f"--customize-hook={hook}" for hook in STAND_IN_HOOKS), self.suite, str(tarball)]

    @property
    def key(self) -> str:
        """The recipe's digest: a stand-in with another label is made again."""
        recipe = [self.name, self.mmdebstrap(Path("rootfs.tar")), list(STAND_IN_CHANGES)]
        return hashlib.sha256(json.dumps(recipe).encode()).hexdigest()[:16]


def run_tool(args: Sequence[str], timeout: float, log: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a tool and fail with its output's tail (or its log's) when it exits non-zero."""
    if log is None:
        proc = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
        output = proc.stdout + proc.stderr
    else:
        with log.open("w", encoding="utf-8") as out:
            proc = subprocess.run(list(args), stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        output = log.read_text(encoding="utf-8", errors="replace")
    assert proc.returncode == 0, f"`{' '.join(args[:3])} ...` exited {proc.returncode}:\n{output[-4000:]}"
    return proc


def image_inspect(name: str) -> dict[str, object] | None:
    """podman's description of a local image, or None when there is none by that name."""
    proc = subprocess.run(["podman", "image", "inspect", name], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        return None
    (found,) = json.loads(proc.stdout)
    return dict(found)


def image_size(name: str) -> int:
    info = image_inspect(name)
    assert info is not None, f"no image {name}"
    return int(str(info["Size"]))


def ensure_stand_in(stand_in: StandIn) -> float | None:
    """Make the stand-in unless podman holds one made from the same recipe; the seconds it took, or None."""
    info = image_inspect(stand_in.name)
    labels = info.get("Labels") if info else None
    if isinstance(labels, dict) and labels.get(RECIPE_LABEL) == stand_in.key:
        return None
    started = time.monotonic()
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stand-in-", dir=CACHE) as work:
        tarball = Path(work) / "rootfs.tar"
        run_tool(stand_in.mmdebstrap(tarball), timeout=600, log=CACHE / "stand-in.log")
        changes = [*STAND_IN_CHANGES, f"LABEL {RECIPE_LABEL}={stand_in.key}"]
        run_tool(["podman", "import", "--quiet", *(f"--change={c}" for c in changes), str(tarball), stand_in.name],
                 timeout=300)
    return time.monotonic() - started


def git_revision() -> str:
    """The checkout's HEAD, as the README's build command passes it; a fixed value outside git."""
    proc = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    return proc.stdout.strip() if proc.returncode == 0 and proc.stdout.strip() else "image-test"


def build_image(revision: str) -> float:
    """Build the Dockerfile from the repository root into TEST_TAG; the seconds it took.

    --pull=never: the base is the local stand-in, never a registry's. --layers=false: nothing is
    cached between runs (the builder stage fetches the runtime dependencies afresh) and no
    intermediate image is left behind."""
    mount = ["--volume", f"{HOST_CA}:{HOST_CA}:ro"] if HOST_CA.is_file() else []
    CACHE.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    run_tool(["podman", "build", "--pull=never", "--layers=false", *ISOLATION, *mount,
              "--build-arg", f"REVISION={revision}", "--tag", TEST_TAG, "--file", str(DOCKERFILE), str(ROOT)],
             timeout=600, log=CACHE / "build.log")
    return time.monotonic() - started


def remove_image(name: str) -> None:
    subprocess.run(["podman", "rmi", "--force", name], capture_output=True, timeout=120)


def remove_container(name: str) -> None:
    """`buildah rm`, a no-op when there is no such container."""
    subprocess.run(["buildah", "rm", name], capture_output=True, timeout=120)


def new_container(image: str, name: str = CONTAINER) -> str:
    remove_container(name)  # one a stopped run left behind
    run_tool(["buildah", "from", "--pull=never", "--quiet", "--name", name, image], timeout=120)
    return name


def run_in(container: str, *command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """A command in the container as the image's non-root user, to completion."""
    return run_tool(["buildah", "run", *ISOLATION, "--user", NONROOT, container, "--", *command], timeout=timeout)


def start_in(container: str, *command: str, log: Path) -> subprocess.Popen[bytes]:
    """A command in the container as the image's non-root user, in the background (its own session)."""
    with log.open("wb") as out:
        return subprocess.Popen(["buildah", "run", *ISOLATION, "--user", NONROOT, container, "--", *command],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (chroot isolation shares the host's process table)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def cmdline(pid: int) -> list[str]:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
    except OSError:
        return []


def ids(pid: int) -> tuple[list[int], list[int]]:
    """The real, effective, saved and filesystem uids and gids of a process."""
    fields = dict(line.split(":", 1) for line in (Path("/proc") / str(pid) / "status").read_text().splitlines())
    return [int(v) for v in fields["Uid"].split()], [int(v) for v in fields["Gid"].split()]


def alive(pid: int) -> bool:
    """Running (a zombie, already exited, is not)."""
    try:
        stat = (Path("/proc") / str(pid) / "stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_tree(process: subprocess.Popen[bytes], pids: Sequence[int]) -> None:
    """SIGKILL what is left of a run: the processes found below it, then its session."""
    for pid in [*pids, *descendants(process.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
