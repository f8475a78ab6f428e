"""An engine's released wheel, fetched without its dependencies and hash-pinned, and code compiled out of it.

The tests that claim compatibility with an engine run its own released code, not a copy. Installing
an engine pulls GBs of CUDA packages, while its metrics code needs little more than
prometheus_client: so the wheel alone is fetched (tests/upstream_sglang.py, tests/upstream_lmcache.py
say from where), exactly the top-level definitions needed are pulled out of its sources with `ast`,
and they are compiled, unchanged, into one module registered under the engine's own name.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CACHE_ROOT = Path(__file__).resolve().parent.parent / ".cache"  # git-ignored
Definitions = tuple[tuple[str, tuple[str, ...]], ...]  # (file in the wheel, top-level names taken from it)


class WheelUnavailable(RuntimeError):
    """The released wheel could not be found or fetched; the message is one line."""


@dataclass(frozen=True)
class ReleasedWheel:
    """One released wheel: where it may already be, how to fetch it, and the SHA-256 it must have."""

    project: str
    version: str
    name: str  # the released file's name
    sha256: str
    env: str  # a variable naming a copy of the file
    platform: str  # pip's --platform that finds the file (its own manylinux tag)

    @property
    def cache_dir(self) -> Path:
        return CACHE_ROOT / self.project

    def path(self) -> Path:
        """The wheel: from the variable `env`, the repository cache, or the package index."""
        named = os.environ.get(self.env)
        if named:
            path = Path(named)
            if not path.is_file():
                raise WheelUnavailable(f"{self.env}={named} is not a file")
            return self._checked(path)
        cached = self.cache_dir / self.name
        if cached.is_file():
            return self._checked(cached)
        # Several test processes (pytest-xdist's workers) may want it at once: one fetches while the
        # others wait on the lock, and the file appears whole (renamed into place) or not at all.
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        with open(self.cache_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not cached.is_file():
                with tempfile.TemporaryDirectory(prefix="download-", dir=self.cache_dir) as work:
                    os.replace(self.download(Path(work)), cached)
        return self._checked(cached)

    def download(self, directory: Path) -> Path:
        """Fetch the wheel alone (no dependencies) with pip into `directory`; return its path."""
        directory.mkdir(parents=True, exist_ok=True)
        # The platform flags name the released file whatever Python runs the tests: only its Python
        # source is used. pip matches the file's own tag, not a newer glibc's.
        pinned = f"{self.project}=={self.version}"
        command = [
            sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.11", "--implementation", "cp", "--abi", "cp311",
            "--platform", self.platform, pinned, "-d", str(directory),
        ]
        try:
            result = subprocess.run(command, capture_output=True, text=True, timeout=240)  # within pytest's 300 s
        except (OSError, subprocess.TimeoutExpired) as err:
            raise WheelUnavailable(f"pip download {pinned} failed: {err}") from None
        path = directory / self.name
        if result.returncode != 0 or not path.is_file():
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            raise WheelUnavailable(f"pip download {pinned} failed ({last}); set {self.env} to a copy of {self.name}")
        return path

    def _checked(self, path: Path) -> Path:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != self.sha256:
            raise WheelUnavailable(f"{path} has SHA-256 {digest}, not the released {self.name}'s {self.sha256}")
        return path


def compile_released(wheel: Path, module_name: str, doc: str, definitions: Definitions,
                     namespace: Mapping[str, Any] | None = None, third_party: Iterable[str] = ()) -> types.ModuleType:
    """Compile `definitions` out of `wheel` into a module registered as `module_name` (its parent packages
    empty namespaces, nothing else of the engine imports), `namespace` put in first (stand-ins for what
    the engine's runtime would provide); the module, marked `__released_from__` the wheel."""
    module = types.ModuleType(module_name, doc)
    module.__file__ = f"{wheel}/{definitions[-1][0]}"
    module.__released_from__ = str(wheel)  # type: ignore[attr-defined]
    module.__dict__.update(namespace or {})
    parts = module_name.split(".")
    for depth in range(1, len(parts)):
        package = ".".join(parts[:depth])
        if package not in sys.modules:
            parent = types.ModuleType(package)
            parent.__path__ = []
            sys.modules[package] = parent
    sys.modules[module_name] = module  # dataclasses look their module up while the classes are built
    try:
        with zipfile.ZipFile(wheel) as archive:
            for inner, names in definitions:
                filename = f"{wheel}/{inner}"
                chosen = select_definitions(archive.read(inner).decode("utf-8"), names, filename, third_party)
                exec(compile(ast.Module(body=chosen, type_ignores=[]), filename, "exec", dont_inherit=True),
                     module.__dict__)
    except BaseException:
        del sys.modules[module_name]
        raise
    setattr(sys.modules[".".join(parts[:-1])], parts[-1], module)
    return module


def installed(module_name: str) -> types.ModuleType | None:
    """The module compile_released registered in this process already, if any."""
    module = sys.modules.get(module_name)
    return module if module is not None and getattr(module, "__released_from__", None) else None


def select_definitions(source: str, names: Iterable[str], filename: str,
                       third_party: Iterable[str] = ()) -> list[ast.stmt]:
    """Standard-library (and named `third_party`) imports and exactly the top-level definitions named, in source order."""
    wanted, allowed = set(names), set(third_party)
    tree = ast.parse(source, filename)
    chosen: list[ast.stmt] = []
    found: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if all(_is_stdlib(module) or module.split(".")[0] in allowed for module in _imported_modules(node)):
                chosen.append(node)
            continue
        defined = _defined_names(node) & wanted
        if defined:
            chosen.append(node)
            found |= defined
    missing = wanted - found
    if missing:
        raise WheelUnavailable(f"{filename} no longer defines {sorted(missing)}")
    return chosen


def _imported_modules(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [node.module or ""] if node.level == 0 else [""]
    return [alias.name for alias in node.names]


def _is_stdlib(module: str) -> bool:
    top = module.split(".")[0]
    return top == "__future__" or top in sys.stdlib_module_names


def _defined_names(node: ast.stmt) -> set[str]:
    if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
        return {node.name}
    if isinstance(node, ast.Assign):
        return {target.id for target in node.targets if isinstance(target, ast.Name)}
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        return {node.target.id}
    return set()
