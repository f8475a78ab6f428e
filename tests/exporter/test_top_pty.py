"""`hicache-exporter top` in a pseudo-terminal, read back as a person sees it.

A real sidecar (`serve`, basic auth on, short stale and expiry timeouts) with real rank processes
pushing over its Unix socket through exporter.client, shaped as `make demo`'s server (dp 2 x pp 2 x
attention tp 2 under DP attention): each process one rank with a radix and a storage stream, and a
scheduler stream labelled with the global tp rank on attention tp 0; `top` runs in a shell on a
160x50 pty (pexpect) whose screen pyte emulates, so the assertions read characters and their
colours off the screen. A rank is frozen (stale), another killed (departed, then expired: missing),
the sidecar is stopped (unreachable) and started again (the poll comes back, the two ranks that do
not come back are missing), then q quits; Ctrl-C quits another run. After each, the shell's own
`stty` and `$?` say the terminal is as it was and the exit status 0.
"""

from __future__ import annotations

import http.server
import json
import multiprocessing
import os
import re
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
from tests.helpers import free_port, http_get, wait_until

REPO = Path(__file__).resolve().parents[2]
COLS, ROWS = 160, 50
PROMPT = "pty$ "
PASSWORD = "s3cret"
STALE_AFTER, EXPIRE_AFTER = 1.5, 10.0
DP, PP, ATTN_TP = 2, 2, 2
RANKS = [(dp, pp, tp) for dp in range(DP) for pp in range(PP) for tp in range(ATTN_TP)]
# The world each stream says hello with: under DP attention the engine's tp spans the dp groups.
WORLD = {"tp_size": DP * ATTN_TP, "pp_size": PP, "dp_size": DP, "attn_tp_size": ATTN_TP, "attn_cp_size": 1}
RADIX = {"cache_type": "HiRadixCache"}
STORAGE = {"storage_backend": "file", "pp_size": str(PP), "attn_cp_size": "1"}
SCHEDULER = {"model_name": "m", "engine_type": "unified"}
# The scheduler's prefill tokens per step, by mode: device 50 %, host 25 %, storage 8 %, computed 17 %.
PREFILL = {"device_hit": 96, "host_hit": 48, "storage_hit": 16, "input": 32}
SHARES = "device 50 % · host 25 % · storage 8 % · computed 17 %"
PYTE_COLOURS = {"brown": "yellow"}  # pyte names SGR 43 by the VT100's palette


def rank_process(socket_path: str, dp: int, pp: int, tp: int) -> None:
    """One engine process at (dp, pp, tp) reporting through a stream per collector, as SGLang's do, until it is
    stopped, killed or the test ends: radix (loading tokens back at a steady rate), storage (its cp rank 0),
    and on attention tp 0 the scheduler, which labels the engine's global tp rank and its moe_ep_rank."""
    from exporter.client import RankClient

    here = {"tp_rank": tp, "pp_rank": pp, "dp_rank": dp}
    streams = {"radix": ({**here}, RADIX), "storage": ({**here, "attn_cp_rank": 0}, STORAGE)}
    if tp == 0:
        engine_tp = dp * ATTN_TP + tp
        streams["scheduler"] = ({**here, "tp_rank": engine_tp}, {**SCHEDULER, "moe_ep_rank": str(engine_tp)})
    clients = {kind: RankClient(socket_path, rank=rank, labels=labels, world=WORLD, interval=0.2, max_backoff=0.5,
                                preset=False) for kind, (rank, labels) in streams.items()}
    tokens = clients["radix"].counter("load_back_tokens_total", pool="kv")
    moved = clients["radix"].counter("load_back_bytes_total")
    took = clients["radix"].histogram("load_back_duration_seconds")
    prefetched = clients["storage"].counter("prefetched_tokens_total")
    prefilled = []
    if "scheduler" in clients:
        clients["scheduler"].gauge("hicache_host_total_tokens").set(4096)
        clients["scheduler"].gauge("hicache_host_used_tokens").set(1024)
        prefilled = [(clients["scheduler"].counter("prefill_effective_tokens_total", mode=mode), n)
                     for mode, n in PREFILL.items()]
    for client in clients.values():
        client.start()
    while True:
        for counter, n in prefilled:
            counter.inc(n)
        tokens.inc(64)
        moved.inc(64 * 4096)
        took.observe(0.002)
        prefetched.inc(16)
        time.sleep(0.05)


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

    def grid(self, title: str) -> dict[str, list[tuple[str, str, str]]]:
        """The grid under the block titled `title` (`dp0  `): by row label, its ATTN_TP cells tp 0 first, each
        (tp rank and mark, its background, its letters each followed by its background's first letter)."""
        for y, line in enumerate(self.screen.display):
            x = line.find(title)
            if x < 0:
                continue
            rows: dict[str, list[tuple[str, str, str]]] = {}
            for below in range(y + 1, y + 1 + PP):
                text, chars = self.screen.display[below], self.screen.buffer[below]
                label = text[x:x + 4]
                assert label.startswith("pp"), self.text
                cells: list[tuple[str, str, str]] = []
                for word in re.finditer(r"\S+", text[x + 4:]):  # "0 RSE 1 RS" ("0?RSE" missing), then "pp0" ...
                    parts = re.fullmatch(r"(?P<tp>[0-9]+\??)?(?P<letters>[A-Z+]*)", word[0])
                    if parts is None or (parts["tp"] and len(cells) == ATTN_TP) or not (parts["tp"] or cells):
                        break
                    if parts["tp"]:
                        cells.append((parts["tp"], self.background(chars[x + 4 + word.start()]), ""))
                    at = x + 4 + word.start() + parts.start("letters")
                    tp, bg, letters = cells[-1]
                    cells[-1] = (tp, bg, letters + "".join(letter + self.background(chars[at + i])[0]
                                                           for i, letter in enumerate(parts["letters"])))
                rows[label.strip()] = cells
            return rows
        raise AssertionError(f"no {title!r} on screen\n{self.text}")

    @staticmethod
    def background(char: Any) -> str:
        return PYTE_COLOURS.get(char.bg, char.bg)

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


def _listed(text: str, state: str, stream: str) -> bool:
    """The list under the grids names `stream` (its kind, then its identity) in `state`."""
    return any(line.startswith(f"   {state}  {stream}  ") for line in text.splitlines())


def _all_live(tp: int) -> tuple[str, str, str]:
    """A cell of every stream live: green, and so are its letters (radix, storage, and the scheduler on tp 0)."""
    return (str(tp), "green", "RgSgEg" if tp == 0 else "RgSg")


def test_top_shows_one_cell_per_rank_its_streams_turn_stale_departed_expired_missing_and_the_sidecar_unreachable(
        sidecar: SidecarProcess, terminal: Callable[[], Terminal], tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    ranks = {key: ctx.Process(target=rank_process, args=(str(sidecar.socket_path), *key), daemon=True)
             for key in RANKS}
    for proc in ranks.values():
        proc.start()
    password_file = tmp_path / "password"
    password_file.write_text(PASSWORD + "\n")
    try:
        wait_until(lambda: sidecar.status()["sidecar"]["streams_by_state"]["live"] == 20, timeout=90)
        status = sidecar.status()
        validate_status(status)
        assert status["totals"] == {"servers": 1, "ranks": 8, "live_ranks": 8, "streams": 20, "missing": 0}
        term = terminal()
        term.run(f"{sys.executable} -m exporter.cli top --url {sidecar.url} --interval 0.5 "
                 f"--web.user prom --web.password-file {password_file}")
        term.wait_for(lambda text: "Ranks   8 ranks, 20 streams" in text and "dp1  4/4 live" in text, 30,
                      "8 ranks of 20 streams in two dp groups")
        # The first lines: where prefill tokens come from, a bar and the shares beside it.
        term.wait_for(lambda text: text.splitlines()[3].endswith("  " + SHARES), 30, "the prefill shares")
        lines = term.text.splitlines()
        assert lines[2].startswith("Where prefill tokens come from   since the sidecar started: ")
        assert lines[3] == "█" * 40 + "  " + SHARES
        assert lines[5].split()[:3] == ["host", "25", "%"] and "load back " in lines[5]
        text = term.text
        assert text.splitlines()[0].startswith(f"hicache-exporter top  {sidecar.url}  sidecar ")
        assert "  ready  8 ranks, 20 streams  read " in text.splitlines()[0]
        assert " ranks    8 live    0 not live    0 missing\n" in text
        assert " streams  20 live    0 stale    0 departed    0 expired " in text
        assert "server (no labels of its own)  expects dp 2 × pp 2 × tp 2  8 ranks, 20 streams  8/8 live" in text
        # One cell per rank, 8 in all: the scheduler's global tp 2 is dp 1's attention tp 0, in its cell.
        everyone = {"pp0": [_all_live(0), _all_live(1)], "pp1": [_all_live(0), _all_live(1)]}
        assert term.grid("dp0  ") == everyone and term.grid("dp1  ") == everyone
        term.wait_for(lambda text: any(line.lstrip().startswith("load_back") and "L2→L1" in line and "/s" in line
                                       for line in text.splitlines()), 30, "the load-back bandwidth")

        # Frozen: still connected, silent past stale_after: both streams of the rank, and so the rank.
        radix = 'radix  tp=1 pp=0 dp=0 cache_type="HiRadixCache"'
        os.kill(ranks[(0, 0, 1)].pid or 0, signal.SIGSTOP)
        term.wait_for(lambda text: _listed(text, "stale", radix) and " 2 stale " in text, 20, "the frozen rank stale")
        assert _listed(term.text, "stale", 'storage  tp=1 pp=0 dp=0 cp=0 attn_cp_size="1" pp_size="2" '
                                           'storage_backend="file"')
        assert term.grid("dp0  ")["pp0"] == [_all_live(0), ("1", "yellow", "RySy")]
        assert "dp0  3/4 live" in term.text

        # Killed: its connections close (departed). Past expire_after the streams of both ranks expire (the frozen
        # one's connections still open): the two ranks are missing, and their cells still list their streams.
        scheduler = 'scheduler  tp=2 pp=1 dp=1 engine_type="unified" model_name="m" moe_ep_rank="2"  (rank tp=0)'
        ranks[(1, 1, 0)].kill()
        ranks[(1, 1, 0)].join(10)
        term.wait_for(lambda text: _listed(text, "departed", scheduler) and " 3 departed " in text, 20,
                      "the killed rank's streams departed")
        assert term.grid("dp1  ")["pp1"] == [("0", "blue", "RbSbEb"), _all_live(1)]
        term.wait_for(lambda text: " 0 stale    0 departed    5 expired " in text, EXPIRE_AFTER + 20,
                      "the streams of both ranks expired")
        text = term.text
        assert _listed(text, "expired", scheduler) and _listed(text, "expired", radix)
        assert term.grid("dp0  ")["pp0"] == [_all_live(0), ("1?", "magenta", "RrSr")]
        assert term.grid("dp1  ")["pp1"] == [("0?", "magenta", "RrSrEr"), _all_live(1)]
        assert "   missing  dp0: pp0 tp1\n" in text and "   missing  dp1: pp1 tp0\n" in text
        assert "dp0  3/4 live  1 missing" in text and "dp1  3/4 live  1 missing" in text
        assert " ranks    6 live    2 not live    2 missing\n" in text
        assert "  ready  8 ranks, 20 streams  2 missing  read " in text.splitlines()[0]

        # The sidecar goes away: said on screen, the last status stays below it, top keeps polling.
        sidecar.stop()
        term.wait_for(lambda text: f"unreachable: {sidecar.url}: connection refused  (retrying every 0.5 s; "
                                   "below: the status read at " in text, 20, "unreachable")
        assert "dp1  3/4 live" in term.text and "Traceback" not in term.text
        # Same port: the next poll reads it again, and the ranks still running reconnect; the two that cannot are
        # ranks the world expects and no stream reports for.
        sidecar.start()
        term.wait_for(lambda text: "unreachable" not in text and "Ranks   6 ranks, 15 streams" in text
                      and " 2 missing\n" in text, 30, "the sidecar back, two ranks missing")
        assert term.grid("dp0  ")["pp0"] == [_all_live(0), ("1?", "magenta", "")]
        assert term.grid("dp1  ")["pp1"] == [("0?", "magenta", ""), _all_live(1)]

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
    evil["servers"][0]["dp_groups"][0]["dp_rank"] = "\x1b]0;PWNED\x07\x1b[2J"  # a title and a clear, if sent raw
    fake = ChangingSidecar(json.dumps(good).encode())
    try:
        term = terminal()
        term.run(f"{sys.executable} -m exporter.cli top --url {fake.url} --interval 0.3")
        term.wait_for(lambda text: "dp1  2/2 live" in text, 30, "the good status")
        fake.body = b"[" * 200_000 + b"]" * 200_000
        term.wait_for(lambda text: "sent JSON that is not an object  (retrying every 0.3 s; below: the status read at"
                      in text, 20, "the failure line for a deep body")
        polls = fake.polls
        term.wait_for(lambda text: fake.polls >= polls + 3, 10, "polls going on after the deep body")
        assert b"Traceback" not in term.raw and "Traceback" not in term.text
        fake.body = json.dumps(evil).encode()
        term.wait_for(lambda text: "cannot read: Expected `int`, got `str` - at `$.servers[0].dp_groups[0].dp_rank`"
                      in text, 20,
                      "the hostile dp_rank refused")
        assert b"\x1b]0;PWNED" not in term.raw and b"\x1b[2J" not in term.raw
        fake.body = json.dumps(good).encode()
        term.wait_for(lambda text: "not an object" not in text and "cannot read" not in text
                      and "dp0  2/2 live" in text, 20, "the good status again")
        quits_cleanly(term, lambda: term.child.send("q"))
    finally:
        fake.stop()
