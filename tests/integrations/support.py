"""Helpers for the integration tests that need nothing of the engine."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

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
