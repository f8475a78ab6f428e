"""Sidecar config (DESIGN §6, §7, §9): defaults, precedence, and strict validation naming the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from exporter.config import (
    WORLD_SPEC_FORM,
    SidecarConfig,
    UpstreamWorld,
    config_from_data,
    load_config,
    parse_upstream_world,
)
from exporter.defaults import default_path
from exporter.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str, name: str = "sidecar.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(data) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_data(data, "test.yaml")
    return str(info.value)


# --- defaults ---------------------------------------------------------------------------------


def check_defaults(config: SidecarConfig) -> None:
    assert config.http.port == 9400
    assert config.http.host == "0.0.0.0"
    assert config.ingest.socket_path == Path("/run/hicache/metrics.sock")
    assert config.ingest.max_frame_bytes == 1 << 20
    assert config.ingest.socket_mode == 0o660
    assert config.ingest.dir_mode == 0o750
    assert config.ingest.allowed_uids is None
    assert config.metrics.namespace == "sglang_"
    assert config.metrics.catalog is None
    assert config.rollup.window_seconds == 60
    assert config.ranks.stale_after_seconds == 10
    assert config.ranks.expire_after_seconds == 300
    assert config.log_level == "info"


def test_built_in_defaults():
    check_defaults(SidecarConfig())
    check_defaults(load_config(env={}))
    assert load_config(env={}) == SidecarConfig()


def test_no_data_means_defaults():
    assert config_from_data(None, "x") == SidecarConfig()
    assert config_from_data({}, "x") == SidecarConfig()


def test_config_sidecar_yaml_equals_the_defaults():
    path = REPO / "config" / "sidecar.yaml"
    assert path.is_symlink()
    assert path.resolve() == default_path("sidecar.yaml").resolve()
    config = load_config(path, env={})
    check_defaults(config)
    assert config == SidecarConfig()


def test_packaged_sidecar_yaml_equals_the_defaults():
    assert load_config(default_path("sidecar.yaml"), env={}) == SidecarConfig()


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_empty_file_means_defaults(tmp_path, text):
    assert load_config(write(tmp_path, text), env={}) == SidecarConfig()


# --- precedence: flags > env > file > defaults -----------------------------------------------

FILE_TEXT = "http:\n  port: 9001\n  host: 127.0.0.1\ningest:\n  socket_path: /tmp/file.sock\nrollup:\n  window_seconds: 30\n"


def test_file_beats_defaults(tmp_path):
    config = load_config(write(tmp_path, FILE_TEXT), env={})
    assert config.http.port == 9001
    assert config.http.host == "127.0.0.1"
    assert config.ingest.socket_path == Path("/tmp/file.sock")
    assert config.rollup.window_seconds == 30
    # Keys the file does not name keep their defaults, also inside a section it does name.
    assert config.ingest.max_frame_bytes == 1 << 20
    assert config.ranks.stale_after_seconds == 10


def test_env_beats_file(tmp_path):
    env = {"HICACHE_EXPORTER_PORT": "9002", "HICACHE_EXPORTER_SOCKET": "/tmp/env.sock"}
    config = load_config(write(tmp_path, FILE_TEXT), env=env)
    assert config.http.port == 9002
    assert config.ingest.socket_path == Path("/tmp/env.sock")
    assert config.http.host == "127.0.0.1"  # not overridden: still from the file
    assert config.rollup.window_seconds == 30


def test_env_beats_defaults():
    config = load_config(env={"HICACHE_EXPORTER_PORT": "9003", "HICACHE_EXPORTER_SOCKET": "/tmp/e.sock"})
    assert config.http.port == 9003
    assert config.ingest.socket_path == Path("/tmp/e.sock")


def test_flags_beat_env_and_file(tmp_path):
    env = {"HICACHE_EXPORTER_PORT": "9002", "HICACHE_EXPORTER_SOCKET": "/tmp/env.sock"}
    config = load_config(
        write(tmp_path, FILE_TEXT), env=env, port=9004, host="::1", socket_path=Path("/tmp/flag.sock")
    )
    assert config.http.port == 9004
    assert config.http.host == "::1"
    assert config.ingest.socket_path == Path("/tmp/flag.sock")
    assert config.rollup.window_seconds == 30


def test_flag_port_zero_is_still_a_flag():
    assert load_config(env={"HICACHE_EXPORTER_PORT": "9002"}, port=0).http.port == 0


def test_env_config_names_the_file(tmp_path):
    path = write(tmp_path, FILE_TEXT)
    config = load_config(env={"HICACHE_EXPORTER_CONFIG": str(path)})
    assert config.http.port == 9001


def test_config_flag_beats_env_config(tmp_path):
    from_env = write(tmp_path, "http:\n  port: 9005\n", "env.yaml")
    from_flag = write(tmp_path, "http:\n  port: 9006\n", "flag.yaml")
    assert load_config(from_flag, env={"HICACHE_EXPORTER_CONFIG": str(from_env)}).http.port == 9006


def test_env_port_beats_the_env_config_file(tmp_path):
    path = write(tmp_path, "http:\n  port: 9005\n")
    env = {"HICACHE_EXPORTER_CONFIG": str(path), "HICACHE_EXPORTER_PORT": "9007"}
    assert load_config(env=env).http.port == 9007


def test_explicit_env_is_used_instead_of_the_process_environment(monkeypatch):
    monkeypatch.setenv("HICACHE_EXPORTER_PORT", "9100")
    monkeypatch.setenv("HICACHE_EXPORTER_SOCKET", "/tmp/os.sock")
    assert load_config(env={}) == SidecarConfig()
    config = load_config()  # env=None reads the process environment
    assert config.http.port == 9100
    assert config.ingest.socket_path == Path("/tmp/os.sock")


def test_empty_env_values_are_ignored():
    env = {"HICACHE_EXPORTER_PORT": "", "HICACHE_EXPORTER_SOCKET": "", "HICACHE_EXPORTER_CONFIG": ""}
    assert load_config(env=env) == SidecarConfig()


def test_env_port_that_is_not_a_number_names_the_variable():
    with pytest.raises(ConfigError) as info:
        load_config(env={"HICACHE_EXPORTER_PORT": "http"})
    assert "HICACHE_EXPORTER_PORT" in str(info.value)


def test_env_port_out_of_range_names_the_field():
    with pytest.raises(ConfigError) as info:
        load_config(env={"HICACHE_EXPORTER_PORT": "70000"})
    assert "http.port" in str(info.value)


def test_flag_port_out_of_range_names_the_field():
    with pytest.raises(ConfigError) as info:
        load_config(env={}, port=-1)
    assert "http.port" in str(info.value)


# --- strict validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, path",
    [
        ({"bogus": 1}, "bogus"),
        ({"http": {"bogus": 1}}, "http.bogus"),
        ({"ranks": {"bogus": 1}}, "ranks.bogus"),
        ({"ingest": {"socket": "/x"}}, "ingest.socket"),
        ({"metrics": {"prefix": "x_"}}, "metrics.prefix"),
        ({"rollup": {"window": 60}}, "rollup.window"),
    ],
)
def test_unknown_keys_name_the_field_path(data, path):
    message = error_of(data)
    assert path in message
    assert "test.yaml" in message


@pytest.mark.parametrize(
    "data, path",
    [
        ({"http": {"port": -1}}, "http.port"),
        ({"http": {"port": 65536}}, "http.port"),
        ({"http": {"port": "http"}}, "http.port"),
        ({"http": {"port": 9400.5}}, "http.port"),
        ({"http": {"port": None}}, "http.port"),
        ({"http": 5}, "http"),
        ({"ingest": {"max_frame_bytes": 0}}, "ingest.max_frame_bytes"),
        ({"ingest": {"max_connections": 0}}, "ingest.max_connections"),
        ({"ingest": {"hello_timeout_seconds": 0}}, "ingest.hello_timeout_seconds"),
        ({"ingest": {"allowed_uids": ["root"]}}, "ingest.allowed_uids"),
        ({"ranks": {"stale_after_seconds": 0}}, "ranks.stale_after_seconds"),
        ({"ranks": {"stale_after_seconds": -5}}, "ranks.stale_after_seconds"),
        ({"ranks": {"expire_after_seconds": "soon"}}, "ranks.expire_after_seconds"),
        ({"ranks": {"max_series_per_rank": 0}}, "ranks.max_series_per_rank"),
        ({"rollup": {"window_seconds": 0}}, "rollup.window_seconds"),
        ({"rollup": {"window_seconds": -60}}, "rollup.window_seconds"),
        ({"log_level": "trace"}, "log_level"),
        ({"metrics": {"namespace": 5}}, "metrics.namespace"),
    ],
)
def test_bad_values_name_the_field_path(data, path):
    message = error_of(data)
    # One line per problem, starting with the field path (or a path inside it, like a list index).
    assert re.search(rf"^  {re.escape(path)}[.:]", message, re.MULTILINE), message


def test_every_bad_field_is_named():
    message = error_of({"http": {"port": -1}, "ranks": {"bogus": 1}, "log_level": "loud"})
    for path in ("http.port", "ranks.bogus", "log_level"):
        assert path in message


@pytest.mark.parametrize(
    "value, expected",
    [("0660", 0o660), ("0640", 0o640), ("0600", 0o600), ("660", 0o660), ("0", 0), ("0777", 0o777),
     (0o640, 0o640)],
)
def test_octal_mode_strings(value, expected):
    config = config_from_data({"ingest": {"socket_mode": value, "dir_mode": value}}, "x")
    assert config.ingest.socket_mode == expected
    assert config.ingest.dir_mode == expected


def test_octal_modes_from_yaml(tmp_path):
    path = write(tmp_path, 'ingest:\n  socket_mode: "0600"\n  dir_mode: "0700"\n')
    config = load_config(path, env={})
    assert (config.ingest.socket_mode, config.ingest.dir_mode) == (0o600, 0o700)


@pytest.mark.parametrize("value", ["0999", "rw-rw----", "0x1b0", "", "01000", 0o1000, -1, True, 1.5])
@pytest.mark.parametrize("field", ["socket_mode", "dir_mode"])
def test_bad_modes_name_the_field(field, value):
    assert f"ingest.{field}" in error_of({"ingest": {field: value}})


@pytest.mark.parametrize("namespace", ["sglang_", "sglang:", "hicache_", "_", "a1:b_"])
def test_good_namespaces(namespace):
    assert config_from_data({"metrics": {"namespace": namespace}}, "x").metrics.namespace == namespace


@pytest.mark.parametrize("namespace", ["1sglang_", "sg-lang_", "sglang ", "sglang.", "é_", "sg lang"])
def test_bad_namespace_names_the_field(namespace):
    assert "metrics.namespace" in error_of({"metrics": {"namespace": namespace}})


def test_expire_before_stale_is_rejected():
    message = error_of({"ranks": {"stale_after_seconds": 30, "expire_after_seconds": 20}})
    assert "ranks" in message and "expire_after_seconds" in message
    message = error_of({"ranks": {"expire_after_seconds": 5}})  # below the default stale of 10
    assert "expire_after_seconds" in message


def test_expire_equal_to_stale_is_accepted():
    config = config_from_data({"ranks": {"stale_after_seconds": 30, "expire_after_seconds": 30}}, "x")
    assert config.ranks.expire_after_seconds == 30


@pytest.mark.parametrize("text", ["- http\n- ingest\n", "9400\n", "just a string\n", "[]\n"])
def test_non_mapping_file_is_rejected(tmp_path, text):
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)
    assert "mapping" in str(info.value)


@pytest.mark.parametrize("data", [[], ["http"], "x", 3])
def test_non_mapping_data_is_rejected(data):
    assert "mapping" in error_of(data)


def test_missing_file_gives_a_clear_error(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    message = str(info.value)
    assert str(path) in message
    assert "No such file" in message or "not found" in message.lower()


def test_missing_file_named_by_env(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(env={"HICACHE_EXPORTER_CONFIG": str(path)})
    assert str(path) in str(info.value)


def test_invalid_yaml_names_the_file(tmp_path):
    path = write(tmp_path, "http: {port: 9400\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)


def test_bad_value_in_a_file_names_the_file_and_field(tmp_path):
    path = write(tmp_path, "ranks:\n  bogus: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path, env={})
    assert str(path) in str(info.value)
    assert "ranks.bogus" in str(info.value)


# --- upstreams (the proxy) ---


def test_upstreams_come_from_the_file_and_the_flags_add_to_them(tmp_path: Path) -> None:
    path = write(tmp_path, "upstreams:\n  - {name: engine, url: 'http://e:30000/metrics', interval_seconds: 4}\n")
    config = load_config(path, env={}, upstreams=["http://e:30000/metrics", "http://other:30000/metrics"],
                         upstream_dirs=["/prometheus-multiproc"])
    assert [(u.label, u.interval_seconds) for u in config.upstreams] == [
        ("engine", 4.0), ("http://other:30000/metrics", 5.0), ("/prometheus-multiproc", 5.0)]
    assert config.upstreams[2].multiprocess_dir == Path("/prometheus-multiproc")


@pytest.mark.parametrize("entry, says", [
    ({}, "exactly one of url and multiprocess_dir"),
    ({"url": "http://e/metrics", "multiprocess_dir": "/d"}, "exactly one of url and multiprocess_dir"),
    ({"url": "ftp://e/metrics"}, "http:// or https://"),
    ({"url": "http://e/metrics", "timeout_seconds": 9}, "timeout_seconds 9 must not exceed interval_seconds 5"),
    ({"multiprocess_dir": "/d", "headers": {"a": "b"}}, "url upstream only"),
    ({"multiprocess_dir": "/d", "follow_redirects": True}, "follow_redirects apply to a url upstream only"),
    ({"url": "http://e/metrics", "follow_redirects": "sometimes"}, "follow_redirects"),
    ({"url": "http://e/metrics", "basic_auth": {"username": "u"}}, "exactly one of password and password_file"),
    ({"url": "http://e/metrics", "colour": "red"}, "colour"),
])
def test_a_bad_upstream_stops_start_up_naming_the_field(entry: dict, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        config_from_data({"upstreams": [entry]}, "test")


@pytest.mark.parametrize("interval, timeout", [(1, 1.0), (0.5, 0.5), (2.5, 2.5), (3, 3.0), (10, 3.0)])
def test_an_unset_timeout_is_3s_or_the_interval_when_that_is_shorter(
        tmp_path: Path, interval: float, timeout: float) -> None:
    """Before: interval_seconds below 3 alone was refused, "timeout_seconds must not exceed interval_seconds",
    for a timeout the operator never set."""
    path = write(tmp_path, f"upstreams:\n  - {{url: 'http://e:30000/metrics', interval_seconds: {interval}}}\n")
    config = load_config(path, env={}, upstreams=["http://other:30000/metrics"])
    assert [(u.interval_seconds, u.timeout_seconds) for u in config.upstreams] == [(interval, timeout), (5.0, 3.0)]
    again = config_from_data(config.model_dump(mode="json", exclude_none=True), "again")  # as --web.config.file redoes it
    assert again.upstreams[0].timeout_seconds == timeout


def test_a_timeout_the_operator_set_longer_than_the_interval_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as refused:
        config_from_data({"upstreams": [{"url": "http://e/metrics", "interval_seconds": 1, "timeout_seconds": 3}]}, "f")
    assert str(refused.value) == ("f: 1 problem(s)\n  upstreams.0: Value error, timeout_seconds 3 must not exceed "
                                  "interval_seconds 1 (from f)")


def test_redirects_are_not_followed_unless_an_upstream_asks() -> None:
    config = config_from_data({"upstreams": [{"url": "http://a/metrics"},
                                             {"url": "http://b/metrics", "follow_redirects": True}]}, "test")
    assert [u.follow_redirects for u in config.upstreams] == [False, True]


def test_two_upstreams_with_one_name_are_refused() -> None:
    with pytest.raises(ConfigError, match="two upstreams are named 'e'"):
        config_from_data({"upstreams": [{"name": "e", "url": "http://a/metrics"},
                                        {"name": "e", "url": "http://b/metrics"}]}, "test")


def test_an_upstream_world_comes_from_the_file_or_from_the_flags_which_beat_it(tmp_path: Path) -> None:
    path = write(tmp_path, "upstreams:\n  - {name: engine, url: 'http://e/metrics', world: {tp_size: 8, pp_size: 2}}\n"
                           "  - {name: other, url: 'http://o/metrics', world: {tp_size: 2}}\n")
    config = load_config(path, env={}, upstreams=["http://e/metrics", "http://new/metrics"],
                         upstream_dirs=["/multiproc"],
                         upstream_worlds={"http://e/metrics": "tp=4,dp=2,dp-attention", "/multiproc": "tp=2,pp=2,cp=1"})
    worlds = {u.label: u.world for u in config.upstreams}
    assert worlds == {
        "engine": UpstreamWorld(tp_size=4, dp_size=2, dp_attention=True),  # the flag's, in place of the file's
        "other": UpstreamWorld(tp_size=2),
        "http://new/metrics": None,
        "/multiproc": UpstreamWorld(tp_size=2, pp_size=2, attn_cp_size=1),
    }
    assert worlds["engine"] is not None and worlds["engine"].pp_size is None  # left to the engine's labels


@pytest.mark.parametrize("spec, says", [
    ("tp=4,dp=2,pp=2,cp=1,dp-attention", None),
    ("dp=2", "tp: Field required"),
    ("tp=4,dp=3,dp-attention", "tp_size 4 must be a multiple of dp_size x attn_cp_size"),
    ("tp=4,cp=3", "tp_size 4 must be a multiple of attn_cp_size"),
    ("tp=0", "tp: Input should be greater than or equal to 1"),
    ("tp=four", "tp must be a whole number"),
    ("tp=-1", "tp must be a whole number"),
    ("tp=4,tp=2", "tp is given twice"),
    ("tp=4,ep=2", "'ep' is not one of tp, dp, pp, cp, dp-attention"),
    ("tp=4,dp-attention=yes", "'dp-attention' is not one of"),
    ("", "'' is not one of"),
])
def test_an_upstream_world_spec_is_parsed_or_refused_in_one_line(spec: str, says: str | None) -> None:
    if says is None:
        assert parse_upstream_world(spec) == {"tp_size": 4, "dp_size": 2, "pp_size": 2, "attn_cp_size": 1,
                                              "dp_attention": True}
        return
    with pytest.raises(ConfigError) as info:
        parse_upstream_world(spec)
    message = str(info.value)
    assert says in message and "\n" not in message
    assert message.startswith(f"--upstream-world {spec!r}: ") and message.endswith(WORLD_SPEC_FORM)


def test_a_long_upstream_world_spec_is_cut_in_its_error() -> None:
    with pytest.raises(ConfigError) as info:
        parse_upstream_world("tp=1," + "x" * 10_000)
    assert len(str(info.value)) < 250


def test_without_dp_attention_the_cp_size_must_divide_tp() -> None:
    assert "must be a multiple of attn_cp_size" in error_of(
        {"upstreams": [{"url": "http://e/metrics", "world": {"tp_size": 4, "attn_cp_size": 3}}]})


# --- persistence (the durable state) ---


def test_persistence_is_off_by_default_with_a_five_second_interval() -> None:
    config = config_from_data({}, "test")
    assert config.persistence.file is None
    assert (config.persistence.interval, config.persistence.interval_seconds) == ("5s", 5.0)


@pytest.mark.parametrize("text, seconds", [
    ("5s", 5.0), ("1m30s", 90.0), ("250ms", 0.25), ("1h", 3600.0), ("2d", 172800.0), ("1w", 604800.0), ("1y", 31536000.0),
    ("1h2m3s4ms", 3723.004), ("90s", 90.0),
])
def test_persistence_interval_takes_prometheus_durations(text: str, seconds: float) -> None:
    config = config_from_data({"persistence": {"file": "/state/hicache", "interval": text}}, "test")
    assert config.persistence.interval_seconds == pytest.approx(seconds, rel=0, abs=1e-9)
    assert config.persistence.file == Path("/state/hicache")


@pytest.mark.parametrize("text, says", [
    ("5", "'5' is not a duration like 5s, 1m30s or 500ms"),
    ("", "'' is not a duration"),
    ("-1s", "'-1s' is not a duration"),
    ("5x", "'5x' is not a duration"),
    ("1.5s", "'1.5s' is not a duration"),
    ("1s1m", "'1s1m' is not a duration"),  # units from the largest down
    (" 5s", "' 5s' is not a duration"),
    ("0s", "'0s': the interval must be longer than zero"),
    ("0ms", "'0ms': the interval must be longer than zero"),
])
def test_a_bad_persistence_interval_is_one_problem_line_naming_the_key(text: str, says: str) -> None:
    message = error_of({"persistence": {"interval": text}})
    problems = message.splitlines()[1:]
    assert len(problems) == 1 and problems[0].startswith("  persistence.interval: "), message
    assert says in problems[0]


def test_a_persistence_interval_that_is_a_number_is_refused_naming_the_key() -> None:
    message = error_of({"persistence": {"interval": 5}})
    assert re.search(r"^  persistence\.interval: .*string", message, re.MULTILINE), message


@pytest.mark.parametrize("data, path, hint", [
    ({"persistence": {"bogus": 1}}, "persistence.bogus", "known keys: file, interval"),
    ({"persistence": {"path": "/state"}}, "persistence.path", "known keys: file, interval"),
    ({"persistence": {"interval_seconds": 5}}, "persistence.interval_seconds", "did you mean `interval`?"),
])
def test_unknown_persistence_keys_are_refused(data: dict, path: str, hint: str) -> None:
    message = error_of(data)
    assert re.search(rf"^  {re.escape(path)}: unknown key", message, re.MULTILINE), message
    assert hint in message


def test_persistence_flags_beat_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "persistence:\n  file: /from/file\n  interval: 1m\n")
    config = load_config(path, env={}, persistence_file=tmp_path / "flag-state", persistence_interval="250ms")
    assert config.persistence.file == tmp_path / "flag-state" and config.persistence.interval_seconds == 0.25
    from_file = load_config(path, env={})
    assert from_file.persistence.file == Path("/from/file") and from_file.persistence.interval_seconds == 60.0


def test_a_bad_persistence_interval_flag_names_the_flag() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={}, persistence_interval="5")
    assert re.search(r"^  persistence\.interval: .*from --persistence\.interval\)$", str(info.value), re.MULTILINE)
