"""The package's shape: modules small enough to read whole, and no module reaching into another's private names."""

from __future__ import annotations

import ast
from pathlib import Path

import exporter

PACKAGE = Path(exporter.__file__).parent
MAX_LINES = 800  # past this a module holds more than one concept (issue: one concept per module)


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _private_imports(path: Path) -> list[str]:
    """`from exporter.x import _name` and `exporter.x._name` in one module: the names it takes from
    another module's inside."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "exporter":
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if alias.name.startswith("_") and not alias.name.startswith("__")]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names
                      if any(part.startswith("_") and not part.startswith("__") for part in alias.name.split("."))]
    return found


def test_no_module_of_the_package_or_the_page_script_is_over_800_lines() -> None:
    files = [*_sources(), *PACKAGE.rglob("static/*.js")]
    long = {str(path.relative_to(PACKAGE)): n for path in files
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert files and long == {}


def test_no_module_imports_another_modules_private_names() -> None:
    found = {str(path.relative_to(PACKAGE)): names for path in _sources() if (names := _private_imports(path))}
    assert found == {}


def test_the_private_import_check_sees_one(tmp_path: Path) -> None:
    """The check above can fail: a module written as the old upstream/saved.py was is caught."""
    module = tmp_path / "saved.py"
    module.write_text("from exporter.sidecar.upstream.feed import UpstreamFeed, _Continuity\n"
                      "import exporter.sidecar._inside\nfrom exporter import __version__\n", encoding="utf-8")
    assert _private_imports(module) == ["exporter.sidecar.upstream.feed._Continuity", "exporter.sidecar._inside"]
