"""The sidecar image, built from the Dockerfile and run: it serves as uid 65532, reports the
revision it was built with, and holds neither torch nor cache_core.

podman builds it against a local stand-in for the `FROM` image made from Debian packages
(tests/deploy/image_support.py); buildah runs it. Without podman, buildah or mmdebstrap the tests
fail with a line naming what to install (`make test` installs them as root first).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import pytest

from tests.deploy import image_support as img
from tests.deploy.test_makefile import MAKE, PLAIN_ENV, REPO, _fake_root_apt, make
from tests.helpers import Scrape, free_port, http_get, wait_ready, wait_until

# The first test carries the build: the stand-in base (about a minute, once) and the image (the
# builder stage fetches the runtime dependencies from PyPI).
pytestmark = pytest.mark.timeout(900)

SOCKET = "/tmp/hicache.sock"  # inside the container
# A bound on the sidecar's layers above the base: the wheels of exporter and its dependencies are
# about 30 MB; torch alone would be hundreds.
SIDECAR_LAYERS_MAX_BYTES = 100_000_000


@dataclass(frozen=True)
class Built:
    tag: str
    revision: str
    python: str  # the Python minor version the FROM image promises
    build_seconds: float
    stand_in_seconds: float | None  # None: the cached stand-in was used
    size: int
    base_size: int


@pytest.fixture(scope="module")
def built() -> Iterator[Built]:
    missing = img.missing_tools()
    if missing:
        pytest.fail(missing, pytrace=False)
    stand_in = img.StandIn.for_base(img.base_image())
    stand_in_seconds = img.ensure_stand_in(stand_in)
    revision = img.git_revision()
    img.remove_container(img.CONTAINER)  # it would hold on to the image a stopped run left
    img.remove_image(img.TEST_TAG)
    build_seconds = img.build_image(revision)
    try:
        result = Built(img.TEST_TAG, revision, stand_in.python, build_seconds, stand_in_seconds,
                       img.image_size(img.TEST_TAG), img.image_size(stand_in.name))
        (img.CACHE / "last-build.json").write_text(json.dumps(asdict(result), indent=2) + "\n", encoding="utf-8")
        yield result
    finally:
        img.remove_image(img.TEST_TAG)


@pytest.fixture(scope="module")
def container(built: Built) -> Iterator[str]:
    name = img.new_container(built.tag)
    try:
        yield name
    finally:
        img.remove_container(name)
    listed = img.run_tool(["buildah", "containers", "--format", "{{.ContainerName}}"], timeout=60).stdout.split()
    assert name not in listed, "the test's container is left behind"


def test_serves_as_uid_65532_with_the_revision_it_was_built_with(built: Built, container: str,
                                                                   tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "serve.log"
    run = img.start_in(container, "hicache-exporter", "serve", "--port", str(port), "--socket", SOCKET, log=log)
    seen: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_ready(run, lambda: _status(base + "/-/ready") == 200)
        seen = img.descendants(run.pid)
        servers = [pid for pid in seen if "python" in Path(img.cmdline(pid)[0]).name and "serve" in img.cmdline(pid)]
        assert len(servers) == 1, [img.cmdline(pid) for pid in seen]
        uids, gids = img.ids(servers[0])
        assert (set(uids), set(gids)) == ({65532}, {65532})

        status, body, headers = http_get(base + "/metrics")
        assert status == 200 and headers["Content-Type"].startswith("text/plain")
        (info,) = Scrape(body.decode()).find("hicache_exporter_build_info")
        assert info.labels["revision"] == built.revision
        assert info.labels["version"] == "0.1.0" and info.value == 1.0
        # The stand-in base is the Python the FROM tag names.
        assert info.labels["python_version"].startswith(built.python + "."), info.labels

        os.kill(servers[0], signal.SIGTERM)
        assert run.wait(timeout=60) == 0, log.read_text()
        assert log.read_text().splitlines()[-1].endswith("INFO hicache_exporter: stopped")
        wait_until(lambda: not any(img.alive(pid) for pid in seen), timeout=30)
    finally:
        if run.poll() is None:
            img.kill_tree(run, seen)


def test_torch_and_cache_core_are_absent(built: Built, container: str) -> None:
    probe = ("import importlib.util, json; "
             "print(json.dumps({m: importlib.util.find_spec(m) is not None for m in "
             "('exporter', 'prometheus_client', 'torch', 'cache_core', 'numpy')}))")
    found = json.loads(img.run_in(container, "python", "-c", probe).stdout)
    assert found == {"exporter": True, "prometheus_client": True,
                     "torch": False, "cache_core": False, "numpy": False}


def test_image_size_is_reported(built: Built, capsys: pytest.CaptureFixture[str]) -> None:
    layers = built.size - built.base_size
    stand_in = ("cached" if built.stand_in_seconds is None else f"made in {built.stand_in_seconds:.0f} s")
    with capsys.disabled():
        print(f"\nimage {built.tag}: built in {built.build_seconds:.0f} s (stand-in base {stand_in}); "
              f"{built.size / 1e6:.1f} MB, of which the sidecar's layers {layers / 1e6:.1f} MB "
              f"above the {built.base_size / 1e6:.1f} MB stand-in base")
    assert 0 < layers < SIDECAR_LAYERS_MAX_BYTES, f"the sidecar adds {layers / 1e6:.1f} MB to its base"


def test_make_test_installs_or_names_the_image_tools(tmp_path: Path) -> None:
    """All three missing: one line naming them; as root with apt-get, one install of all three."""
    bare = tmp_path / "bare"
    bare.mkdir()
    result, _ = make("image-tools", path=str(bare))
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.splitlines()[0] == (
        "make test: podman and buildah and mmdebstrap not on the PATH; install the Debian packages "
        "podman buildah mmdebstrap (sudo apt-get install podman buildah mmdebstrap) "
        "or put podman, buildah and mmdebstrap on the PATH")

    root = tmp_path / "bin"
    log = _fake_root_apt(root, *img.TOOLS)
    result, _ = make("image-tools", path=str(root))
    assert result.returncode == 0, result.stderr
    assert "installing the Debian packages podman buildah mmdebstrap" in result.stderr
    assert log.read_text().splitlines()[1] == "install -y -qq podman buildah mmdebstrap"
    again, _ = make("image-tools", path=str(root))
    assert again.returncode == 0 and again.stdout == again.stderr == ""

    dry = subprocess.run([MAKE or "make", "-n", "test"], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env=PLAIN_ENV)
    assert dry.stdout.splitlines()[2].endswith(".ci/image-tools"), dry.stdout


def _status(url: str) -> int:
    try:
        return http_get(url)[0]
    except OSError:
        return 0  # not listening yet
