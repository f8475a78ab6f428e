"""`hicache-exporter demo`: the sidecar plus one cache_core process per rank, with progress."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import itertools
import multiprocessing
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from exporter.config import load_config
from exporter.errors import HicacheExporterError
from exporter.sidecar.runner import Sidecar

PROGRESS_SECONDS = 2.0


def _rank_entry(spec: Any, slot: int, steps: Any, completed: Any, stop_step: Any, stop: Any, barrier: Any) -> None:
    """Child process entry: cache_core (and torch) are imported here, never in the sidecar."""
    from cache_core.rank import run_rank

    # Ctrl-C reaches the whole process group: the demo process stops the ranks itself, in step.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run_rank(spec, slot, steps, completed, stop_step, stop, barrier)


def run_demo(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("torch") is None:
        raise HicacheExporterError("the demo runs cache_core, which needs torch: pip install 'hicache-exporter[cache]'")
    for name in ("attn_tp", "cp", "pp", "dp"):
        if getattr(args, name) < 1:
            raise HicacheExporterError(f"--{name.replace('_', '-')} must be at least 1")
    if args.requests is not None and args.requests < 1:
        raise HicacheExporterError("--requests must be at least 1")
    if args.duration is not None and args.duration <= 0:
        raise HicacheExporterError("--duration must be positive")
    if args.l3_capacity_mb <= 0:
        raise HicacheExporterError("--l3-capacity-mb must be positive")
    workdir = Path(tempfile.mkdtemp(prefix="hicache-demo-"))
    # SIGTERM before the event loop takes the signal over must still remove the directory.
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        socket_path = args.socket or workdir / "metrics.sock"
        config = load_config(None, port=args.port, host=args.host, socket_path=socket_path)
        return asyncio.run(_demo(args, config, workdir))
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(workdir, ignore_errors=True)  # the L3 store and the socket: nothing is left behind


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


async def _demo(args: argparse.Namespace, config: Any, workdir: Path) -> int:
    from cache_core.rank import RankSpec
    from cache_core.workload import WorkloadConfig

    sidecar = Sidecar(config)
    await sidecar.start()
    # (dp, pp, cp, attention tp): the attention tp rank changes fastest, as the engine lays tp ranks out.
    layout = list(itertools.product(range(args.dp), range(args.pp), range(args.cp), range(args.attn_tp)))
    # Ranks fork from a server that imported torch once: eight cold torch imports take ~30 s on 2 cores.
    # The forkserver is its own process, so the sidecar itself still never imports torch.
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["cache_core.rank"])
    steps = ctx.Array("i", len(layout), lock=False)
    completed = ctx.Array("i", len(layout), lock=False)
    stop_step = ctx.Value("i", -1, lock=False)
    stop = ctx.Event()
    # One lock-step per replica group: the attention tp, cp and pp ranks of a dp group.
    barriers = {dp: ctx.Barrier(args.attn_tp * args.cp * args.pp) for dp in range(args.dp)}
    procs = []
    for slot, (dp, pp, cp, tp) in enumerate(layout):
        spec = RankSpec(attn_tp_rank=tp, pp_rank=pp, dp_rank=dp, attn_tp_size=args.attn_tp, pp_size=args.pp,
                        dp_size=args.dp, attn_cp_rank=cp, attn_cp_size=args.cp,
                        socket_path=str(config.ingest.socket_path), storage_root=str(workdir / "l3"),
                        interval=args.interval, requests=args.requests, workload=WorkloadConfig(seed=args.seed),
                        storage_capacity_bytes=int(args.l3_capacity_mb * 2**20))
        proc = ctx.Process(target=_rank_entry, args=(spec, slot, steps, completed, stop_step, stop, barriers[dp]),
                           name=f"rank-dp{dp}-pp{pp}-cp{cp}-tp{tp}")
        proc.start()
        procs.append(proc)
    host = "localhost" if config.http.host in ("0.0.0.0", "::") else config.http.host
    print(f"hicache-exporter demo: {len(procs)} ranks (attn_tp={args.attn_tp} cp={args.cp} pp={args.pp} "
          f"dp={args.dp}), "
          f"socket {config.ingest.socket_path}, L3 in {workdir / 'l3'} (at most {args.l3_capacity_mb:g} MiB, "
          f"least recently used pages evicted; removed on exit)", flush=True)
    print(f"  curl http://{host}:{sidecar.http_port}/metrics    (Ctrl-C stops)", flush=True)

    interrupted = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    started = time.monotonic()
    announced = False
    try:
        while not interrupted.is_set():
            try:
                await asyncio.wait_for(interrupted.wait(), PROGRESS_SECONDS)
            except asyncio.TimeoutError:
                pass
            if args.duration is not None and stop_step.value < 0 and time.monotonic() - started >= args.duration:
                stop_step.value = max(steps) + 1  # every replica stops at this same step
            alive = sum(p.is_alive() for p in procs)
            if not announced:
                _print_progress(sidecar, layout, steps, completed, alive, time.monotonic() - started)
            if alive == 0 and not announced:
                failed = [p.name for p in procs if p.exitcode != 0]
                if failed:
                    print(f"ranks failed: {', '.join(failed)}", file=sys.stderr, flush=True)
                print("ranks finished and pushed their last snapshot; the sidecar keeps serving until Ctrl-C", flush=True)
                announced = True
    finally:
        stop.set()
        for barrier in barriers.values():
            barrier.abort()  # release replicas waiting for a peer that already stopped
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join(5)
        await sidecar.stop()
    return 0


def _print_progress(sidecar: Sidecar, layout: list[tuple[int, int, int, int]], steps: Any, completed: Any,
                    alive: int, elapsed: float) -> None:
    state = sidecar.state
    groups = sorted({slot[0] for slot in layout})
    per_group = []
    for dp in groups:
        done = [completed[i] for i, slot in enumerate(layout) if slot[0] == dp]
        per_group.append(f"dp{dp}:{min(done)}")
    live = sum(1 for r in state.known_ranks() if r.live)
    tokens = sum(v for (family, _, _), v in state.rollup_counters().items() if family == "load_back_tokens_total")
    moved = sum(v for (family, _, _), v in state.rollup_counters().items() if family == "load_back_bytes_total")
    print(f"[{elapsed:6.1f}s] requests {' '.join(per_group)} | ranks alive {alive}, connections pushing {live} | "
          f"rollup load-back {int(tokens)} tokens, {moved / 2**20:.1f} MiB", flush=True)
