"""The names and defaults the sidecar, its ranks and `top` share are written once, in exporter.defaults."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from exporter import defaults
from exporter.cli import build_parser
from exporter.client import RankClient
from exporter.config import SidecarConfig, load_config
from exporter.top.fetch import DEFAULT_URL

PACKAGE = Path(__file__).resolve().parents[2] / "exporter"
# Each value as a literal anywhere in the package outside exporter/defaults would be a second home.
SPELLED_ONCE = {defaults.DEFAULT_PORT, defaults.DEFAULT_SOCKET_PATH, defaults.ENV_CONFIG, defaults.ENV_PORT,
                defaults.ENV_SOCKET, defaults.ENV_PUSH_INTERVAL}
# The same number with another meaning: NVIDIA dcgm-exporter's default port, which runner.py's
# clash hint names (it would stay 9400 if this sidecar's default moved).
OTHER_MEANINGS = {("sidecar/runner.py", defaults.DEFAULT_PORT)}


def _literals(path: Path) -> list[tuple[int, object]]:
    """(line, value) of every constant in `path` that is no docstring (prose may name a default)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                  and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and id(node) not in docstrings and not isinstance(node.value, bool)]


def test_each_shared_name_and_default_is_written_once() -> None:
    seconds = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith("defaults/"):
            continue
        for line, value in _literals(path):
            if value in SPELLED_ONCE and (relative, value) not in OTHER_MEANINGS:
                seconds.append(f"exporter/{relative}:{line}: {value!r}")
    assert seconds == []


def test_every_reader_of_a_default_gets_the_one_value(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(defaults.ENV_SOCKET, raising=False)
    config = SidecarConfig()
    assert config.http.port == defaults.DEFAULT_PORT and str(config.ingest.socket_path) == defaults.DEFAULT_SOCKET_PATH
    assert config.log_level == defaults.DEFAULT_LOG_LEVEL
    assert RankClient(preset=False).socket_path == defaults.DEFAULT_SOCKET_PATH
    assert DEFAULT_URL.endswith(f":{defaults.DEFAULT_PORT}")
    assert load_config(env={defaults.ENV_SOCKET: "/tmp/x.sock", defaults.ENV_PORT: "9"}).http.port == 9
    monkeypatch.setenv(defaults.ENV_SOCKET, "/tmp/pushed.sock")
    assert RankClient(preset=False).socket_path == "/tmp/pushed.sock"


def test_the_log_levels_the_flags_offer_are_the_configs() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    offered = {tuple(action.choices) for action in serve._actions if action.dest == "log_level"}
    assert offered == {defaults.LOG_LEVELS} and defaults.LOG_LEVELS == ("debug", "info", "warning", "error")
    assert SidecarConfig.model_fields["log_level"].annotation is defaults.LogLevel
