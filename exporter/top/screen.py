"""The refreshing terminal: a poller thread, keys read in cbreak mode, rich's Live on the alternate screen.

The main thread only waits (select on the keyboard and a wake-up pipe), updates the View and
redraws; the poller thread only fetches. q, Ctrl-C and SIGTERM all leave the same way: the
alternate screen closed, the cursor shown and the terminal's modes put back, exit status 0.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import termios
import threading
import time
import tty
from collections.abc import Iterator
from types import FrameType

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.live import Live
from rich.segment import Segment
from rich.text import Text

from exporter.errors import HicacheExporterError
from exporter.top.fetch import PASSWORD_IN_URL_WARNING, FailureKind, FetchFailed, FetchResult, Target, fetch_status
from exporter.top.render import UNSHOWABLE, body_or_problem, problem, render_frame, render_header
from exporter.top.view import View

REDRAW_SECONDS = 1.0  # the header's "read N s ago" moves on even while no poll lands
QUIT_KEYS = {b"q", b"Q"}
# Key sequences a terminal sends (xterm and its kin): scrolling by line, page and to either end.
SCROLL_KEYS = {
    b"j": 1, b"\x1b[B": 1, b"k": -1, b"\x1b[A": -1,
    b" ": "page", b"\x1b[6~": "page", b"b": "-page", b"\x1b[5~": "-page",
    b"g": "home", b"\x1b[H": "home", b"\x1b[1~": "home", b"G": "end", b"\x1b[F": "end", b"\x1b[4~": "end",
}


def run_top(target: Target, interval: float, timeout: float, once: bool) -> int:
    """Watch `target` until q, Ctrl-C or SIGTERM (0); with `once`, print one frame (0 when it was read, else 1)."""
    view = View(target, interval)
    if target.password_in_url:
        print(f"hicache-exporter: {PASSWORD_IN_URL_WARNING}", file=sys.stderr)
    if once:
        result = fetch_status(target, timeout)
        view.update(result)
        Console().print(render_frame(view))
        return 0 if view.ok else 1
    if not sys.stdout.isatty():
        raise HicacheExporterError("top needs a terminal on standard output; --once prints one frame instead")
    return Screen(view, timeout).run()


class Poller(threading.Thread):
    """Fetches every `interval` seconds and keeps the latest result; a byte on `wake_fd` says one landed."""

    def __init__(self, target: Target, interval: float, timeout: float, wake_fd: int) -> None:
        super().__init__(name="hicache-top-poller", daemon=True)  # a fetch in flight never holds up the exit
        self.target, self.interval, self.timeout, self.wake_fd = target, interval, timeout, wake_fd
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._latest: FetchResult | None = None

    def run(self) -> None:
        while not self._stopping.is_set():
            started = time.monotonic()
            result = self._poll()
            with self._lock:
                self._latest = result
            if self._stopping.is_set():
                return
            _wake(self.wake_fd)
            self._stopping.wait(max(0.0, self.interval - (time.monotonic() - started)))

    def _poll(self) -> FetchResult:
        """One fetch; whatever it raises is a failure on screen, and the next poll comes as usual."""
        try:
            return fetch_status(self.target, self.timeout)
        except Exception as err:  # noqa: BLE001 (a poller that dies leaves a screen that never changes)
            message = f"{self.target.status_url}: the poll failed ({type(err).__name__}: {err})"
            return FetchFailed(FailureKind.ERROR, message[:300], at=time.time())

    def take(self) -> FetchResult | None:
        """The result that landed since the last take, if any."""
        with self._lock:
            result, self._latest = self._latest, None
        return result

    def stop(self) -> None:
        self._stopping.set()


def _wake(fd: int) -> None:
    with contextlib.suppress(BlockingIOError, OSError):  # a full pipe is already a wake-up
        os.write(fd, b".")


class Scroll:
    """Which body line is at the top of the screen, kept within the body."""

    def __init__(self) -> None:
        self.offset = 0
        self.room = 1  # body lines that fit on the screen, as the last frame measured
        self.lines = 0

    def key(self, key: bytes) -> bool:
        """Apply a scrolling key; False if it is not one."""
        step = SCROLL_KEYS.get(key)
        if step is None:
            return False
        if step == "page":
            self.offset += self.room
        elif step == "-page":
            self.offset -= self.room
        elif step == "home":
            self.offset = 0
        elif step == "end":
            self.offset = self.lines
        else:
            assert isinstance(step, int)
            self.offset += step
        self.clamp()
        return True

    def clamp(self) -> None:
        self.offset = max(0, min(self.offset, self.lines - self.room))


class Frame:
    """The header, then as much of the body as fits from the scroll offset, then where that is."""

    def __init__(self, view: View, scroll: Scroll) -> None:
        self.view, self.scroll = view, scroll

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        height = options.height or console.height
        unbounded = options.update(height=None)
        header = console.render_lines(render_header(self.view, time.time()), unbounded, pad=False)
        try:
            body = console.render_lines(Group(*body_or_problem(self.view)), unbounded, pad=False)
        except UNSHOWABLE as err:  # the sections read the document as they are built; this is a last guard
            body = console.render_lines(problem("cannot show the status document", err), unbounded, pad=False)
        scroll = self.scroll
        scroll.lines = len(body)
        scroll.room = max(1, height - len(header) - 1)  # one line for the scroll position when it overflows
        if len(body) <= height - len(header):
            scroll.room, shown, footer = len(body), body, None
        else:
            scroll.clamp()
            shown = body[scroll.offset:scroll.offset + scroll.room]
            footer = Text(f"lines {scroll.offset + 1}-{scroll.offset + len(shown)} of {len(body)}: "
                          f"j/k or arrows scroll, space/b a page, g/G the ends", style="reverse")
        for line in (*header, *shown):
            yield from line
            yield Segment.line()
        if footer is not None:
            yield footer


class Screen:
    """One interactive session: keys, signals, the poller and the Live display, and their undoing."""

    def __init__(self, view: View, timeout: float) -> None:
        self.view, self.timeout = view, timeout
        self.scroll = Scroll()
        self.quit = False

    def run(self) -> int:
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_read, False)
        os.set_blocking(wake_write, False)
        poller = Poller(self.view.target, self.view.interval, self.timeout, wake_write)
        keyboard = sys.stdin.fileno() if sys.stdin is not None and sys.stdin.isatty() else None
        console = Console()
        try:
            with _signals(self, wake_write), _cbreak(keyboard), Live(
                    Frame(self.view, self.scroll), console=console, screen=True, auto_refresh=False,
                    redirect_stdout=False, redirect_stderr=False) as live:
                poller.start()
                while not self.quit:
                    waiting = [wake_read] if keyboard is None else [wake_read, keyboard]
                    ready, _, _ = select.select(waiting, [], [], REDRAW_SECONDS)
                    if wake_read in ready:
                        with contextlib.suppress(BlockingIOError):
                            os.read(wake_read, 4096)
                    result = poller.take()
                    if result is not None:
                        self.view.update(result)
                    if keyboard is not None and keyboard in ready:
                        keyboard = self._keys(keyboard)
                    if not self.quit:
                        live.refresh()
        finally:
            poller.stop()
            poller.join(0.2)
            if not poller.is_alive():  # else it may still write to the pipe; the process exit closes it
                os.close(wake_read)
                os.close(wake_write)
        return 0

    def _keys(self, fd: int) -> int | None:
        """Act on what was typed; None once the keyboard is gone (end of file)."""
        data = os.read(fd, 1024)
        if not data:
            return None
        for key in _split_keys(data):
            if key in QUIT_KEYS:
                self.quit = True
            else:
                self.scroll.key(key)
        return fd


def _split_keys(data: bytes) -> Iterator[bytes]:
    """Single bytes, and escape sequences (ESC [ ... final byte) whole."""
    i = 0
    while i < len(data):
        if data[i:i + 2] == b"\x1b[":
            end = i + 2
            while end < len(data) and not 0x40 <= data[end] <= 0x7E:
                end += 1
            yield data[i:end + 1]
            i = end + 1
        else:
            yield data[i:i + 1]
            i += 1


@contextlib.contextmanager
def _cbreak(fd: int | None) -> Iterator[None]:
    """Keys arrive one by one and unechoed; Ctrl-C stays a signal. The modes are put back however we leave."""
    if fd is None:
        yield
        return
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd, termios.TCSANOW)
        yield
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


@contextlib.contextmanager
def _signals(screen: Screen, wake_fd: int) -> Iterator[None]:
    """Ctrl-C and SIGTERM end the loop between frames (never mid-draw); a resize redraws at once."""

    def leave(signum: int, frame: FrameType | None) -> None:
        screen.quit = True
        _wake(wake_fd)

    def resized(signum: int, frame: FrameType | None) -> None:
        _wake(wake_fd)

    handlers = {signal.SIGINT: leave, signal.SIGTERM: leave, signal.SIGWINCH: resized}
    saved = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)

