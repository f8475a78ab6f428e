"""Helpers for the integration tests that need nothing of the engine."""

from __future__ import annotations

import json
import multiprocessing
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from tests.helpers import Scrape, free_port, http_get, wait_ready

REPO = Path(__file__).resolve().parents[2]

SPAWN = multiprocessing.get_context("spawn")  # how SGLang starts its scheduler processes
FORK = multiprocessing.get_context("fork")

Sample = tuple[str, tuple[tuple[str, str], ...], float]


def run_processes(target: Callable[..., None], arguments: Sequence[tuple[Any, ...]], context: Any = SPAWN,
                  timeout: float = 120, receive: bool = False) -> list[Any]:
    """Run one process per argument tuple at once; each must exit normally. With `receive`, each
    process gets the sending end of a pipe as its last argument and the objects it sent come back."""
    pipes = [context.Pipe(duplex=False) if receive else None for _ in arguments]
    processes = [
        context.Process(target=target, args=(*args, pipe[1]) if pipe else args)
        for args, pipe in zip(arguments, pipes)
    ]
    for process in processes:
        process.start()
    received = []
    for pipe in pipes:
        if pipe is not None:
            pipe[1].close()
            try:
                received.append(pipe[0].recv() if pipe[0].poll(timeout) else None)
            except EOFError:  # the process died before it sent anything; its exit code says more
                received.append(None)
    for process in processes:
        process.join(timeout)
    codes = [process.exitcode for process in processes]
    for process in processes:
        if process.exitcode is None:
            process.kill()
            process.join()
    assert codes == [0] * len(processes), f"rank processes exited with {codes}"
    return received


def samples(text: str, families: set[str] | None = None) -> list[Sample]:
    """Every sample of an exposition (of the named families only, when given) as (name, sorted labels, value), sorted."""
    return sorted(
        (sample.name, tuple(sorted(sample.labels.items())), float(sample.value))
        for family in text_string_to_metric_families(text)
        if families is None or family.name in families
        for sample in family.samples
    )


def documentation(text: str) -> dict[str, str]:
    """HELP text per family of an exposition."""
    return {family.name: family.documentation for family in text_string_to_metric_families(text)}


class ServeProcess:
    """`hicache-exporter serve` in its own process: a config file (`config`, with this sidecar's HTTP port and
    socket), then `flags`; ready once /-/ready answers, and a start that fails says what the sidecar said."""

    def __init__(self, directory: Path, config: dict[str, Any], flags: Sequence[str] = ()) -> None:
        self.port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(directory / "m.sock")
        path = directory / "sidecar.yaml"
        path.write_text(json.dumps({"http": {"host": "127.0.0.1", "port": self.port},
                                    "ingest": {"socket_path": self.socket_path}, **config}))
        self.proc = subprocess.Popen([sys.executable, "-m", "exporter.cli", "serve", "--config", str(path), *flags],
                                     cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            wait_ready(self.proc, self._ready)
        except AssertionError as err:  # what it said, when it exited
            said = self.proc.stdout.read()[-2000:] if self.proc.poll() is not None and self.proc.stdout else ""
            raise AssertionError(f"{err}: {said}") from None

    def _ready(self) -> bool:
        try:
            return http_get(f"http://127.0.0.1:{self.port}/-/ready")[0] == 200
        except OSError:
            return False

    def get_json(self, path: str) -> Any:
        return json.loads(http_get(f"http://127.0.0.1:{self.port}{path}")[1])

    def scrape(self) -> Scrape:
        return Scrape(http_get(f"http://127.0.0.1:{self.port}/metrics")[1].decode())

    def stop(self) -> str:
        """SIGTERM (SIGKILL after 10 s); what it wrote."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            out, _ = self.proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        return out
