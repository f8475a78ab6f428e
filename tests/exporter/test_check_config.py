"""Config errors help a person fix them: the close match of a misspelt key, the value received,
and the source (file, environment variable, flag) that gave it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from exporter.config import config_from_data, load_config
from exporter.errors import ConfigError


def error_of(data: object, source: str = "test.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        config_from_data(data, source)
    return str(info.value)


@pytest.mark.parametrize("data, line", [
    ({"http": {"prot": 9400}}, "  http.prot: unknown key (value 9400, from test.yaml); did you mean `port`?"),
    ({"ranks": {"stale_after_second": 3}}, "did you mean `stale_after_seconds`?"),
    ({"ingest": {"socket_pth": "/x.sock"}}, '(value "/x.sock", from test.yaml); did you mean `socket_path`?'),
    ({"http": {"tls_server_config": {"cert": "c", "key_file": "k"}}}, "did you mean `cert_file`?"),
    ({"loglevel": "info"}, "did you mean `log_level`?"),
])
def test_a_misspelt_key_gets_its_close_match(data: object, line: str) -> None:
    assert line in error_of(data)


def test_an_unknown_key_with_no_close_match_lists_the_known_ones() -> None:
    assert "  zzz: unknown key (value 1, from test.yaml); known keys: http, ingest, ranks" in error_of({"zzz": 1})


def test_a_bad_value_is_shown_as_received() -> None:
    message = error_of({"http": {"port": "9400"}, "log_level": "loud"})
    assert '  http.port: Input should be a valid integer (got "9400", from test.yaml)' in message
    assert '(got "loud", from test.yaml)' in message


def test_the_environment_and_flags_are_named_as_the_source() -> None:
    with pytest.raises(ConfigError) as env:
        load_config(env={"HICACHE_EXPORTER_PORT": "70000"})
    assert "(got 70000, from HICACHE_EXPORTER_PORT in the environment)" in str(env.value)
    with pytest.raises(ConfigError) as flag:
        load_config(env={}, port=70000)
    assert "(got 70000, from --port or --web.listen-address)" in str(flag.value)


def test_check_config_shows_the_suggestion_the_value_and_the_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("http:\n  prot: 9401\n")
    result = subprocess.run([sys.executable, "-m", "exporter.cli", "check-config", str(path)],
                            capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"  http.prot: unknown key (value 9401, from {path}); did you mean `port`?" in result.stderr
