"""`hicache-exporter top` in a pseudo-terminal, read back as a person sees it.

A real sidecar (`serve`, basic auth on, short stale and expiry timeouts) with real rank processes
pushing over its Unix socket through exporter.client; `top` runs in a shell on a 160x50 pty
(pexpect) whose screen pyte emulates, so the assertions read characters and their colours off the
screen. A rank is frozen (stale), another killed (departed, then expired), the sidecar is stopped
(unreachable) and started again (the poll comes back), then q quits; Ctrl-C quits another run.
After each, the shell's own `stty` and `$?` say the terminal is as it was and the exit status 0.
"""

from __future__ import annotations

import http.server
import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import bcrypt
import pexpect
import pyte
import pytest
import yaml

from tests.exporter.test_top import status_document, validate_status
from tests.helpers import free_port, http_get, steady_rank, wait_until

REPO = Path(__file__).resolve().parents[2]
COLS, ROWS = 160, 50
PROMPT = "pty$ "
PASSWORD = "s3cret"
STALE_AFTER, EXPIRE_AFTER = 1.5, 10.0
LABELS = {"cache_type": "HiRadixCache"}
RANKS = [(dp, tp) for dp in range(2) for tp in range(2)]  # dp 2 x pp 1 x tp 2
PYTE_COLOURS = {"brown": "yellow"}  # pyte names SGR 43 by the VT100's palette


def rank_process(socket_path: str, tp: int, dp: int) -> None:
    """A rank loading tokens back at a steady rate until it is stopped, killed or the test ends."""
    steady_rank(socket_path, {"tp_rank": tp, "pp_rank": 0, "dp_rank": dp}, LABELS, 0.2, 0.5)


class Terminal:
    """A shell on a pseudo-terminal; what it prints goes through pyte, as a terminal would draw it."""

    def __init__(self, env: dict[str, str]) -> None:
        self.screen = pyte.Screen(COLS, ROWS)
        self.stream = pyte.ByteStream(self.screen)
        self.raw = bytearray()
        self.child = pexpect.spawn("bash", ["--norc", "--noprofile"], env=env, dimensions=(ROWS, COLS), cwd=str(REPO))
        self.wait_for(lambda text: text.rstrip().endswith(PROMPT.rstrip()), 20, "the shell's prompt")

    def pump(self, seconds: float = 0.1) -> None:
        try:
            while True:
                data = self.child.read_nonblocking(65536, timeout=seconds)
                self.raw.extend(data)
                self.stream.feed(data)
                seconds = 0.01
        except (pexpect.TIMEOUT, pexpect.EOF):
            return

    @property
    def text(self) -> str:
        return "\n".join(line.rstrip() for line in self.screen.display)

    def wait_for(self, predicate: Callable[[str], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.pump()
            if predicate(self.text):
                return
        raise AssertionError(f"not on screen within {timeout} s: {what}\n--- screen ---\n{self.text}")

    def resize(self, rows: int, cols: int) -> None:
        """As a terminal window resized by hand: the emulated screen, then the pty (SIGWINCH to top)."""
        self.screen.resize(rows, cols)
        self.child.setwinsize(rows, cols)

    def run(self, command: str) -> None:
        self.child.sendline(command)

    def shell_says(self, command: str, timeout: float = 10) -> str:
        """Run `command` in the shell after top has exited and return what it printed."""
        serial = time.monotonic_ns()
        marker = f"done-{serial}\r\n"  # printed by printf; the echoed command line reads differently
        self.raw.clear()
        self.child.sendline(f"{command}; printf '%s-%s\\n' done {serial}")
        deadline = time.monotonic() + timeout
        while marker.encode() not in bytes(self.raw) and time.monotonic() < deadline:
            self.pump()
        out = bytes(self.raw).decode(errors="replace")
        assert marker in out, f"the shell did not answer {command!r}: {out!r}"
        return out.split(marker)[0].split("\r\n", 1)[1]  # what came after the echoed command line

    def cell_backgrounds(self, title: str, tps: int) -> list[str]:
        """The background colours of a group's first grid row (pp0), tp 0 first, found below its title."""
        for y, line in enumerate(self.screen.display):
            x = line.find(title)
            if x >= 0:
                row = self.screen.buffer[y + 1]
                assert self.screen.display[y + 1][x:x + 4] == "pp0 ", self.text
                return [PYTE_COLOURS.get(row[x + 4 + 2 * tp].bg, row[x + 4 + 2 * tp].bg) for tp in range(tps)]
        raise AssertionError(f"no {title!r} on screen\n{self.text}")

    def close(self) -> None:
        self.child.close(force=True)


def quits_cleanly(term: Terminal, press: Callable[[], object]) -> None:
    """After `press`, top exits 0 with no traceback and leaves the terminal as the shell had it."""
    # As it had it: the alternate screen left, the cursor shown, canonical mode with echo and signals.
    left = len(term.raw)
    press()
    term.wait_for(lambda text: text.rstrip().endswith(PROMPT.rstrip()), 15, "the shell's prompt after top")
    tail = bytes(term.raw[left:])
    assert b"\x1b[?1049l" in tail and b"\x1b[?25h" in tail, tail
    assert b"Traceback" not in term.raw and b"KeyboardInterrupt" not in term.raw
    assert not term.screen.cursor.hidden
    assert term.shell_says("echo rc=$?").strip().endswith("rc=0")
    modes = term.shell_says("stty -a").split()
    assert "icanon" in modes and "echo" in modes and "isig" in modes, modes


@pytest.fixture
def terminal(tmp_path: Path) -> Iterator[Callable[[], Terminal]]:
    opened: list[Terminal] = []
    env = {key: value for key, value in os.environ.items() if key not in ("COLORTERM", "NO_COLOR", "FORCE_COLOR")}
    env.update(TERM="xterm-256color", PS1=PROMPT, PYTHONPATH=str(REPO), HISTFILE="/dev/null")

    def open_terminal() -> Terminal:
        opened.append(Terminal(env))
        return opened[-1]

    yield open_terminal
    for term in opened:
        term.close()


class SidecarProcess:
    """`hicache-exporter serve` with basic auth and short rank timeouts, as a process the test can stop."""

    def __init__(self, workdir: Path, socket_path: Path) -> None:
        hashed = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()
        self.config = workdir / "sidecar.yaml"
        self.config.write_text(yaml.safe_dump({
            "http": {"basic_auth_users": {"prom": hashed}},
            "ranks": {"stale_after_seconds": STALE_AFTER, "expire_after_seconds": EXPIRE_AFTER},
        }))
        self.log = workdir / "sidecar.log"
        self.port = free_port()
        self.socket_path = socket_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "exporter.cli", "serve", "--config", str(self.config), "--host", "127.0.0.1",
                 "--port", str(self.port), "--socket", str(self.socket_path)], stdout=log, stderr=subprocess.STDOUT)
        wait_until(self._ready, timeout=30)

    def _ready(self) -> bool:
        try:
            return http_get(self.url + "/-/ready")[0] == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(20)

    def status(self) -> dict[str, Any]:
        import base64
        import json

        auth = base64.b64encode(f"prom:{PASSWORD}".encode()).decode()
        code, body, _ = http_get(self.url + "/api/v1/status", {"Authorization": f"Basic {auth}"})
        assert code == 200, body
        return json.loads(body)


@pytest.fixture
def sidecar(tmp_path: Path, socket_dir: Path) -> Iterator[SidecarProcess]:
    running = SidecarProcess(tmp_path, socket_dir / "metrics.sock")
    running.start()
    try:
        yield running
    finally:
        running.stop()


def _by_id(text: str, rank: str, state: str) -> bool:
    """The list under the grid names `rank` in `state`."""
    return any(line.startswith(f"   {state}  {rank} ") for line in text.splitlines())


def test_top_shows_ranks_turn_stale_departed_expired_and_the_sidecar_unreachable(
        sidecar: SidecarProcess, terminal: Callable[[], Terminal], tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ranks = {key: ctx.Process(target=rank_process, args=(str(sidecar.socket_path), key[1], key[0]), daemon=True)
             for key in RANKS}
    for proc in ranks.values():
        proc.start()
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    try:
        wait_until(lambda: sidecar.status()["sidecar"]["ranks_by_state"]["live"] == 4, timeout=60)
        validate_status(sidecar.status())
        term = terminal()
        term.run(f"{sys.executable} -m exporter.cli top --url {sidecar.url} --interval 0.5 "
                 f"--web.user prom --web.password-file {password_file}")
        term.wait_for(lambda text: " 4 live " in text and "dp1 cache_type=HiRadixCache  2/2 live" in text, 30,
                      "four live ranks in two groups")
        text = term.text
        assert text.splitlines()[0].startswith(f"hicache-exporter top  {sidecar.url}  sidecar ")
        assert "dp0 cache_type=HiRadixCache  2/2 live" in text and " 0 stale " in text
        for dp in range(2):
            assert term.cell_backgrounds(f"dp{dp} cache_type=HiRadixCache", 2) == ["green", "green"]
        term.wait_for(lambda text: any(line.lstrip().startswith("load_back") and "L2→L1" in line and "/s" in line
                                       for line in text.splitlines()), 30, "the load-back bandwidth")

        # Frozen: still connected, silent past stale_after.
        frozen = f"tp=1 pp=0 dp=0 cache_type=\"{LABELS['cache_type']}\""
        os.kill(ranks[(0, 1)].pid or 0, signal.SIGSTOP)
        term.wait_for(lambda text: _by_id(text, frozen, "stale") and " 1 stale " in text, 20, f"{frozen} stale")
        assert term.cell_backgrounds("dp0 cache_type=HiRadixCache", 2) == ["green", "yellow"]
        assert "dp0 cache_type=HiRadixCache  1/2 live" in term.text

        # Killed: its connection closes (departed), and past expire_after it expires.
        killed = f"tp=0 pp=0 dp=1 cache_type=\"{LABELS['cache_type']}\""
        ranks[(1, 0)].kill()
        ranks[(1, 0)].join(10)
        term.wait_for(lambda text: _by_id(text, killed, "departed"), 20, f"{killed} departed")
        assert term.cell_backgrounds("dp1 cache_type=HiRadixCache", 2) == ["blue", "green"]
        term.wait_for(lambda text: _by_id(text, killed, "expired"), EXPIRE_AFTER + 20, f"{killed} expired")
        assert term.cell_backgrounds("dp1 cache_type=HiRadixCache", 2) == ["red", "green"]

        # The sidecar goes away: said on screen, the last status stays below it, top keeps polling.
        sidecar.stop()
        term.wait_for(lambda text: f"unreachable: {sidecar.url}: connection refused  (retrying every 0.5 s; "
                                   "below: the status read at " in text, 20, "unreachable")
        assert "dp1 cache_type=HiRadixCache" in term.text and "Traceback" not in term.text
        sidecar.start()  # same port: the next poll reads it again, and the ranks still running reconnect
        term.wait_for(lambda text: "unreachable" not in text and " 2 live " in text, 30, "the sidecar back")

        # A smaller window: redrawn at once to its size, the body scrolls under the header.
        term.resize(24, 100)
        term.wait_for(lambda text: "j/k or arrows scroll" in text.splitlines()[-1], 10, "the scroll line after a resize")
        first = term.text.splitlines()
        assert first[0].startswith("hicache-exporter top") and first[-1].startswith("lines 1-")
        term.child.send("j")
        term.wait_for(lambda text: text.splitlines()[-1].startswith("lines 2-"), 10, "one line scrolled")
        assert term.text.splitlines()[0].startswith("hicache-exporter top"), "the header stays put"

        quits_cleanly(term, lambda: term.child.send("q"))
    finally:
        for proc in ranks.values():
            if proc.is_alive():
                proc.kill()
                proc.join(10)


def test_ctrl_c_quits_cleanly_and_a_401_says_to_pass_credentials(
        sidecar: SidecarProcess, terminal: Callable[[], Terminal]) -> None:
    term = terminal()
    term.run(f"{sys.executable} -m exporter.cli top --url {sidecar.url} --interval 0.5")
    term.wait_for(lambda text: f"unauthorized: {sidecar.url} needs credentials (HTTP 401): pass --web.user" in text,
                  30, "the 401 line")
    quits_cleanly(term, term.child.sendintr)


class ChangingSidecar:
    """A fake sidecar on a local port whose answer the test changes: a good status, or a hostile body."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.polls = 0
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                owner.polls += 1
                body = owner.body
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


def test_the_poller_survives_a_body_json_cannot_read_and_recovers(terminal: Callable[[], Terminal]) -> None:
    good = status_document(dp=2, pp=1, tp=2)
    evil = json.loads(json.dumps(good))
    evil["groups"][0]["dp_rank"] = "\x1b]0;PWNED\x07\x1b[2J"  # the title and a clear, were they sent raw
    fake = ChangingSidecar(json.dumps(good).encode())
    try:
        term = terminal()
        term.run(f"{sys.executable} -m exporter.cli top --url {fake.url} --interval 0.3")
        term.wait_for(lambda text: "dp1 cache_type=UnifiedRadixCache  2/2 live" in text, 30, "the good status")
        fake.body = b"[" * 200_000 + b"]" * 200_000
        term.wait_for(lambda text: "sent JSON that is not an object  (retrying every 0.3 s; below: the status read at"
                      in text, 20, "the failure line for a deep body")
        polls = fake.polls
        term.wait_for(lambda text: fake.polls >= polls + 3, 10, "polls going on after the deep body")
        assert b"Traceback" not in term.raw and "Traceback" not in term.text
        fake.body = json.dumps(evil).encode()
        term.wait_for(lambda text: "cannot read: Expected `int`, got `str` - at `$.groups[0].dp_rank`" in text, 20,
                      "the hostile dp_rank refused")
        assert b"\x1b]0;PWNED" not in term.raw and b"\x1b[2J" not in term.raw
        fake.body = json.dumps(good).encode()
        term.wait_for(lambda text: "not an object" not in text and "cannot read" not in text
                      and "dp0 cache_type=UnifiedRadixCache  2/2 live" in text, 20, "the good status again")
        quits_cleanly(term, lambda: term.child.send("q"))
    finally:
        fake.stop()
