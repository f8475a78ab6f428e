"""The command line: help, version, check-config, and `serve` as a real process."""

from __future__ import annotations

import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter import __version__
from exporter.protocol.messages import Welcome
from tests.helpers import RawClient, free_port, hello, http_get, wait_ready, wait_until

CLI = [sys.executable, "-m", "exporter.cli"]


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def test_help_names_every_command_and_the_environment() -> None:
    top = run_cli("--help")
    assert top.returncode == 0
    for command in ("serve", "demo", "check-config", "version"):
        assert command in top.stdout
    serve = run_cli("serve", "--help")
    for word in ("--config", "--port", "--socket", "HICACHE_EXPORTER_PORT", "HICACHE_EXPORTER_SOCKET", "HICACHE_EXPORTER_CONFIG"):
        assert word in serve.stdout
    bare = run_cli()
    assert bare.returncode == 2 and "serve" in bare.stdout


def test_version() -> None:
    result = run_cli("version")
    assert result.returncode == 0 and result.stdout.strip() == f"hicache-exporter {__version__}"


def test_check_config_accepts_the_default_and_names_bad_fields(tmp_path: Path) -> None:
    good = run_cli("check-config", "config/sidecar.yaml")
    assert good.returncode == 0 and "OK" in good.stdout and "32 families" in good.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("ranks:\n  stale_after_seconds: -1\n  typo_key: 3\n")
    result = run_cli("check-config", str(bad))
    assert result.returncode == 2
    assert "ranks.stale_after_seconds" in result.stderr and "ranks.typo_key" in result.stderr
    missing = run_cli("check-config", str(tmp_path / "absent.yaml"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


def test_check_config_loads_the_tls_files_it_names(tmp_path: Path) -> None:
    config = tmp_path / "tls.yaml"
    config.write_text(f"http:\n  tls_server_config:\n    cert_file: {tmp_path}/no.crt\n    key_file: {tmp_path}/no.key\n")
    result = run_cli("check-config", str(config))
    assert result.returncode == 2, result.stdout
    assert "no.crt" in result.stderr and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def _start_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([*CLI, "serve", *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **(env or {})})


def _ready(port: int) -> bool:
    try:
        return http_get(f"http://127.0.0.1:{port}/-/ready")[0] == 200
    except OSError:
        return False


def test_serve_flags_beat_environment_and_sigterm_cleans_up(socket_dir: Path) -> None:
    env_port, flag_port = free_port(), free_port()
    sock = socket_dir / "s" / "metrics.sock"
    proc = _start_serve("--host", "127.0.0.1", "--port", str(flag_port),
                        env={"HICACHE_EXPORTER_PORT": str(env_port), "HICACHE_EXPORTER_SOCKET": str(sock)})
    try:
        wait_ready(proc, lambda: _ready(flag_port))
        assert not _ready(env_port)
        assert sock.is_socket()
        assert oct(sock.stat().st_mode & 0o777) == oct(0o660)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert time.monotonic() - started < 5
        assert not sock.exists()
    finally:
        if proc.poll() is None:
            proc.kill()


def _scrapes_rendered(port: int) -> int:
    """/metrics bodies the sidecar rendered before this one (its scrape-duration count)."""
    for line in http_get(f"http://127.0.0.1:{port}/metrics")[1].decode().splitlines():
        if line.startswith("hicache_exporter_scrape_duration_seconds_count "):
            return int(float(line.rsplit(" ", 1)[1]))
    raise AssertionError("no scrape-duration count on /metrics")


def test_sigterm_is_prompt_while_http_clients_never_read(socket_dir: Path) -> None:
    """Clients that ask for /metrics and never read held shutdown for aiohttp's default 60 s."""
    from exporter.client import RankClient

    sock, port = socket_dir / "metrics.sock", free_port()
    proc = _start_serve("--host", "127.0.0.1", "--port", str(port), "--socket", str(sock))
    stuck: list[socket.socket] = []
    try:
        wait_ready(proc, lambda: _ready(port))
        clients = [RankClient(str(sock), rank={"tp_rank": tp, "pp_rank": 0, "dp_rank": 0}) for tp in range(4)]
        for client in clients:  # a body of several MB: far more than the socket buffers between us hold
            for i in range(3500):
                client.counter("load_back_tokens_total", pool=f"pool-{i:04d}").inc(i)
            client.start()
        wait_until(lambda: len(http_get(f"http://127.0.0.1:{port}/metrics")[1]) > 1_500_000, timeout=30)
        for client in clients:
            client.close()
        ours = [_scrapes_rendered(port)]  # each GET of ours is rendered too: count them
        for _ in range(4):
            peer = socket.socket()
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            peer.connect(("127.0.0.1", port))
            peer.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            stuck.append(peer)  # and never read

        def four_stuck_rendered() -> bool:
            ours.append(_scrapes_rendered(port))  # the k-th of ours sees ours[0] + k + the stuck ones
            return ours[-1] - ours[0] - (len(ours) - 1) >= 4

        # Not a sleep: wait until the server has rendered the four bodies it now cannot finish writing.
        wait_until(four_stuck_rendered, timeout=30)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert time.monotonic() - started < 15
    finally:
        for peer in stuck:
            peer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def test_live_socket_is_refused_and_a_stale_one_replaced(socket_dir: Path) -> None:
    sock = socket_dir / "metrics.sock"
    port = free_port()
    first = _start_serve("--host", "127.0.0.1", "--port", str(port), "--socket", str(sock))
    try:
        wait_ready(first, lambda: _ready(port))
        second = _start_serve("--host", "127.0.0.1", "--port", str(free_port()), "--socket", str(sock))
        output, _ = second.communicate(timeout=20)
        assert second.returncode == 2
        assert "another sidecar is already listening" in output
    finally:
        first.kill()  # no clean-up: leaves a dead socket file behind
        first.wait(10)
    assert sock.exists()
    port = free_port()
    third = _start_serve("--host", "127.0.0.1", "--port", str(port), "--socket", str(sock))
    try:
        wait_ready(third, lambda: _ready(port))
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.connect(str(sock))
        probe.close()
    finally:
        third.send_signal(signal.SIGTERM)
        third.wait(10)


def test_bad_config_stops_start_up_with_the_field_named(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("http:\n  port: 70000\n")
    result = run_cli("serve", "--config", str(config))
    assert result.returncode == 2 and "http.port" in result.stderr


def test_the_serving_gc_settings_apply_in_their_own_process() -> None:
    # Run in a child: the settings are process-wide and must not leak into this test process.
    code = ("import gc; from exporter.sidecar.process import tune_gc; tune_gc(); "
            "print(gc.get_threshold()[0], gc.get_freeze_count() > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == ["20000", "True"]



@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt() is glibc's")
@pytest.mark.parametrize("default", [False, True])
def test_serve_keeps_large_freed_blocks_in_the_heap(default: bool) -> None:
    # A 4 MB body made and dropped again and again: a fresh mmap would fault on every page each
    # time (about 1,000 a round), a block kept in the heap does not. (Left to itself glibc keeps
    # one block of a repeated size too; serve's mix of bodies and copies it did not: `serve` at 64
    # ranks took about 730 faults a scrape before, about 1 after.)
    code = ("import resource; from exporter.sidecar.process import tune_malloc\n"
            "applied = tune_malloc(); faults = []\n"
            "for _ in range(6):\n"
            "    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "    body = b'x' * (4 << 20); del body\n"
            "    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)\n"
            "print(applied, max(faults[2:]) < 100)")
    env = {**os.environ, "HICACHE_EXPORTER_MALLOC_DEFAULT": "1"} if default else None
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60,
                         env=env).stdout.split()
    assert out[0] == str(not default) and (default or out[1] == "True")


def test_serving_gc_settings_last_for_their_block_only() -> None:
    code = ("import gc; from exporter.sidecar.process import serving_gc\n"
            "before = gc.get_threshold()\n"
            "with serving_gc():\n"
            "    inside = (gc.get_threshold()[0], gc.get_freeze_count() > 0)\n"
            "print(*inside, gc.get_threshold() == before, gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == ["20000", "True", "True", "0"]


def test_serve_raises_the_soft_open_file_limit_to_the_hard_one() -> None:
    code = ("import resource; soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
            "from exporter.sidecar.process import raise_fd_limit\n"
            "got = raise_fd_limit(); now = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "print(got == now, now[0] > 64)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60).stdout.split()
    assert out == ["True", "True"]


def test_serve_help_names_the_persistence_flags() -> None:
    serve = run_cli("serve", "--help")
    assert serve.returncode == 0
    assert "--persistence.file FILE" in serve.stdout and "--persistence.interval DURATION" in serve.stdout


def test_the_persistence_flags_reach_the_config() -> None:
    from exporter.cli import build_parser
    from exporter.config import load_config

    args = build_parser().parse_args(["serve", "--persistence.file", "/state/hicache", "--persistence.interval", "1m30s"])
    config = load_config(None, env={}, persistence_file=args.persistence_file,
                         persistence_interval=args.persistence_interval)
    assert config.persistence.file == Path("/state/hicache") and config.persistence.interval_seconds == 90.0


def test_a_bad_persistence_interval_flag_stops_serve_naming_the_flag() -> None:
    result = run_cli("serve", "--persistence.interval", "5")
    assert result.returncode == 2
    assert "persistence.interval" in result.stderr and "from --persistence.interval" in result.stderr


def test_serve_writes_the_persistence_file_at_sigterm(socket_dir: Path, tmp_path: Path) -> None:
    """The flag reaches the running sidecar: with an hour's interval, the one write is the one at SIGTERM
    (a start and stop with nothing new leaves no file: tests/exporter/sidecar/durable/test_keeper.py)."""
    from exporter.sidecar.durable.file import unframe

    port, state = free_port(), tmp_path / "state"
    proc = _start_serve("--host", "127.0.0.1", "--port", str(port), "--socket", str(socket_dir / "m.sock"),
                        "--persistence.file", str(state), "--persistence.interval", "1h")
    try:
        wait_ready(proc, lambda: _ready(port))
        rank = RawClient(str(socket_dir / "m.sock"))  # a rank says hello: something to save
        rank.send(hello(tp=0))
        assert isinstance(rank.recv(), Welcome)
        assert not state.exists()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert unframe(state.read_bytes())
        rank.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_upstream_worlds_go_with_the_command_line_upstreams_in_their_order() -> None:
    from exporter.cli import build_parser, upstream_worlds
    from exporter.errors import HicacheExporterError

    def worlds(*argv: str) -> dict[str, str]:
        return upstream_worlds(build_parser().parse_args(["serve", *argv]))

    assert worlds("--upstream", "http://a/m", "--upstream-multiprocess-dir", "/d", "--upstream-world", "tp=2") == {
        "http://a/m": "tp=2", "/d": "tp=2"}  # one for all
    assert worlds("--upstream-multiprocess-dir", "/d", "--upstream-world", "tp=2", "--upstream", "http://a/m",
                  "--upstream-world", "tp=4,dp=2,dp-attention") == {"/d": "tp=2", "http://a/m": "tp=4,dp=2,dp-attention"}
    assert worlds("--upstream", "http://a/m") == {}
    with pytest.raises(HicacheExporterError, match="2 --upstream-world for 3 upstreams"):
        worlds("--upstream", "http://a/m", "--upstream", "http://b/m", "--upstream-multiprocess-dir", "/d",
               "--upstream-world", "tp=2", "--upstream-world", "tp=4")
    with pytest.raises(HicacheExporterError, match="none is"):
        worlds("--upstream-world", "tp=2")


def test_a_bad_upstream_world_stops_serve_in_one_line() -> None:
    serve = run_cli("serve", "--help")
    assert "--upstream-world SPEC" in serve.stdout
    result = run_cli("serve", "--upstream", "http://127.0.0.1:1/metrics", "--upstream-world", "tp=4,dp=3,dp-attention")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr == ("hicache-exporter: error: --upstream-world 'tp=4,dp=3,dp-attention': with dp_attention, "
                             "tp_size 4 must be a multiple of dp_size x attn_cp_size; the form is "
                             "tp=N[,dp=N][,pp=N][,cp=N][,dp-attention]\n")


# --- every flag and config value out of range: one line naming it, exit 2, no traceback -------------

BIG, HUGE = "9" * 400, "9" * 5000
CUT = "'" + "9" * 40 + "'..."
UPSTREAM = ("--upstream", "http://127.0.0.1:1/metrics")
ARGPARSE = "hicache-exporter {command}: error: argument {flag}: {why} (see --help)"
SECONDS = "must be positive: a number of seconds above 0, at most 292 years"
EMPTY = "the path must not be empty (an unset variable?)"
OUT_OF_RANGE = "is longer than the longest duration Prometheus takes (292y)"
FLAG_CASES: list[tuple[list[str], str]] = [
    # Before: tracebacks (an empty name in pathlib, an int too large for a float, int()'s 4300-digit limit).
    (["serve", "--persistence.file", ""], ARGPARSE.format(command="serve", flag="--persistence.file", why=EMPTY)),
    (["serve", "--persistence.file", "/"],
     "  persistence.file: Value error, '/' names a directory, not the state file (got \"/\", from --persistence.file)"),
    (["serve", "--persistence.interval", BIG + "s"],
     f"  persistence.interval: Value error, {CUT} (401 characters) {OUT_OF_RANGE} (got \"{'9' * 76}..., "
     "from --persistence.interval)"),
    (["serve", "--persistence.interval", "293y"],
     f"  persistence.interval: Value error, '293y' {OUT_OF_RANGE} (got \"293y\", from --persistence.interval)"),
    (["serve", *UPSTREAM, "--upstream-world", "tp=" + HUGE],
     f"hicache-exporter: error: --upstream-world 'tp={'9' * 77}...': tp: Input should be less than or equal to 65536; "
     "the form is tp=N[,dp=N][,pp=N][,cp=N][,dp-attention]"),
    (["serve", *UPSTREAM, "--upstream-world", "tp=2,dp=" + BIG],
     f"hicache-exporter: error: --upstream-world 'tp=2,dp={'9' * 72}...': dp: Input should be less than or equal to "
     "65536; the form is tp=N[,dp=N][,pp=N][,cp=N][,dp-attention]"),
    # Before: served the current directory, or an unbound socket path ".".
    (["serve", "--upstream-multiprocess-dir", ""],
     ARGPARSE.format(command="serve", flag="--upstream-multiprocess-dir", why=EMPTY)),
    (["serve", "--socket", ""], ARGPARSE.format(command="serve", flag="--socket", why=EMPTY)),
    (["serve", "--config", ""], ARGPARSE.format(command="serve", flag="--config", why=EMPTY)),
    (["serve", "--web.config.file", ""], ARGPARSE.format(command="serve", flag="--web.config.file", why=EMPTY)),
    (["check-config", ""], ARGPARSE.format(command="check-config", flag="file", why=EMPTY)),
    (["serve", "--profile", ""],
     "  metrics.profiles.0: String should have at least 1 character (got \"\", from command-line flags)"),
    # Before: a 5,000-character line naming every digit.
    (["serve", "--port", HUGE], ARGPARSE.format(command="serve", flag="--port",
                                                 why=f"{CUT} (5000 characters) is out of range (more than 20 digits)")),
    (["serve", "--port", ""], ARGPARSE.format(command="serve", flag="--port", why="'' is not a whole number")),
    (["serve", "--port", "-1"],
     "  http.port: Input should be greater than or equal to 0 (got -1, from --port or --web.listen-address)"),
    (["serve", "--ranks.nodes", BIG], ARGPARSE.format(command="serve", flag="--ranks.nodes",
                                                       why=f"{CUT} (400 characters) is out of range (more than 20 digits)")),
    (["serve", "--ranks.node-rank", "-1"],
     "  ranks.node_rank: Input should be greater than or equal to 0 (got -1, from command-line flags)"),
    # Before: nan and inf were taken (demo --duration nan ran on, and outlived SIGTERM), and demo --interval 0 too.
    (["demo", "--duration", "nan"], ARGPARSE.format(command="demo", flag="--duration", why=f"'nan' {SECONDS}")),
    (["demo", "--interval", "0"], ARGPARSE.format(command="demo", flag="--interval", why=f"'0' {SECONDS}")),
    (["demo", "--interval", "-1"], ARGPARSE.format(command="demo", flag="--interval", why=f"'-1' {SECONDS}")),
    (["demo", "--l3-capacity-mb", "inf"], ARGPARSE.format(
        command="demo", flag="--l3-capacity-mb", why="'inf' must be positive: a number of MiB above 0, at most 1 PiB")),
    (["demo", "--tp", "0"], ARGPARSE.format(command="demo", flag="--attn-tp/--tp",
                                            why="'0' must be a whole number from 1 to 65536")),
    (["demo", "--dp", BIG], ARGPARSE.format(command="demo", flag="--dp",
                                            why=f"{CUT} (400 characters) is out of range (more than 20 digits)")),
    (["top", "--interval", "inf"], ARGPARSE.format(command="top", flag="--interval", why=f"'inf' {SECONDS}")),
    (["top", "--timeout", "nan"], ARGPARSE.format(command="top", flag="--timeout", why=f"'nan' {SECONDS}")),
]


@pytest.mark.parametrize("argv, line", FLAG_CASES, ids=[" ".join(a)[:40] for a, _ in FLAG_CASES])
def test_a_flag_out_of_range_is_one_line_naming_it(argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    from exporter.cli import main

    try:
        code = main(argv)  # in process: an exception other than the exit would fail the test (no traceback)
    except SystemExit as done:
        code = done.code
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert line in err.splitlines(), err
    assert len(err.splitlines()) == (2 if line.startswith("  ") else 1)  # a config error: its source, then the problem


CONFIG_CASES: list[tuple[str, str]] = [
    ('persistence: {file: ""}', "  persistence.file: Value error, the path must not be empty (an unset variable?) (got \"\""),
    (f'persistence: {{file: /s, interval: "{BIG}s"}}', f"  persistence.interval: Value error, {CUT} (401 characters) "
                                                        f"{OUT_OF_RANGE}"),
    ("ranks: {expire_after_seconds: .inf}", "  ranks.expire_after_seconds: Input should be a finite number"),
    ("rollup: {window_seconds: .nan}", "  rollup.window_seconds: Input should be a finite number"),
    ('upstreams: [{multiprocess_dir: ""}]', "  upstreams.0.multiprocess_dir: Value error, the path must not be empty "
                                            "(an unset variable?)"),
    ("upstreams: [{url: 'http://e:1/metrics', interval_seconds: 1, timeout_seconds: 2}]",
     "  upstreams.0: Value error, timeout_seconds 2 must not exceed interval_seconds 1"),
]


@pytest.mark.parametrize("text, start", CONFIG_CASES)
def test_a_config_value_out_of_range_is_one_line_naming_the_field(
        text: str, start: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from exporter.cli import main

    path = tmp_path / "sidecar.yaml"
    path.write_text(text + "\n")
    assert main(["check-config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 2
    assert err.splitlines()[1].startswith(start), err
