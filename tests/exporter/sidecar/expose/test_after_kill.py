"""Whatever /metrics showed before a SIGKILL of the sidecar, the next sidecar on its state file never shows lower.

Real processes (`hicache-exporter serve` with --persistence.file), real clients pushing over the
socket, real HTTP. With a state file, /metrics shows the rollups as of the last save
(SidecarState.show_rollups): they lag the ranks by at most the persistence interval plus a write,
and what a SIGKILL loses (what the sidecar applied after its last save) was never shown. The
next sidecar shows the file's rollups at once, before any rank is back, and the ranks' own series
of the ranks it took back are absent (not lower) until they push again.

The ranks count on through every kill; the interval (1 s) is long beside a push (50 ms) and a scrape, and
each kill comes as soon as the ranks' own series moved past where they were just after a save the
rollups showed: the sidecar held values it had not saved. The file, read after the kill, tells
that it was so (at least once over the kills: a save may, rarely, fall before the kill). Once the
ranks are back with their epochs, the rollups are exact: what moved while a sidecar was down and
what a kill lost from the sidecar (never from the ranks, whose values are cumulative) are counted
once.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.exporter.sidecar.durable.restart_support import (
    WAIT,
    Key,
    Load,
    PushedRank,
    SidecarProcess,
    Watch,
    close_all,
    per_rank,
    ranks_by_state,
    reroute,
    rollups,
    saved,
    saved_as_scraped,
    saved_rank_values,
    truth,
)
from tests.helpers import free_port, wait_until

INTERVAL = "1s"  # 3 s took 27 s: each kill waits for two saves
KILLS = 3
BYTES = "sglang_load_back_bytes_total"
TOKENS = "sglang_load_back_tokens_total"
BYTES_ROLLUP: Key = ("sglang_rollup_load_back_bytes_total", (("cache_type", "HiRadixCache"),))
# Two skewed replicas of dp group 0: (tp, dp) -> tokens per step, bytes per step, seconds per observation.
STEPS = {(0, 0): (7, 4096, 0.25), (1, 0): (5, 2048, 0.0625)}


def pushed(text: str) -> float | None:
    """The sum of the ranks' own bytes series, or None while one of them is not shown."""
    own = per_rank(text, BYTES)
    return sum(own.values()) if len(own) == len(STEPS) else None


def moving(saves: int) -> Callable[[str], bool]:
    """A `Watch.until` condition: the rollups shown rose `saves` times (saves of moving values), and the
    ranks' own series moved since the scrape that showed the last of those saves: the sidecar holds
    values its last save has not (the next one is an interval away)."""
    seen: list[dict[Key, float]] = []
    at_save: list[float] = []  # the ranks' bytes at the first scrape (all shown) after the last save

    def done(text: str) -> bool:
        now = rollups(text)
        if len(seen) <= saves and (not seen or now != seen[-1]):
            seen.append(now)
        own = pushed(text)
        if len(seen) <= saves or own is None:
            return False
        if not at_save:
            at_save.append(own)
        return own > at_save[0]

    return done


def test_whatever_a_scrape_showed_before_a_sigkill_the_next_sidecar_never_shows_lower(
        socket_dir: Path, tmp_path: Path, cleanup: list[Any]) -> None:
    sidecar = SidecarProcess(free_port(), str(socket_dir / "metrics.sock"), tmp_path / "state.bin",
                             tmp_path / "sidecar.log", "--persistence.interval", INTERVAL).start()
    cleanup.append(sidecar.stop)
    sidecar.wait_ready()
    ranks = {key: PushedRank(sidecar.socket_path, *key).begin(*steps) for key, steps in STEPS.items()}
    cleanup.append(lambda: close_all(ranks.values()))
    load = Load(list(ranks.values())).start()
    cleanup.append(load.stop)
    # Nothing is shown before the first save; from then on every scrape is checked (never absent, never lower).
    wait_until(lambda: rollups(sidecar.scrape() or "") != {}, WAIT)
    watch = Watch(rollups(sidecar.scrape() or ""))
    ranks_socket = sidecar.socket_path
    lost_unshown: list[float] = []  # per kill: bytes the sidecar had applied and not saved, which the kill lost
    for kill in range(KILLS):
        last = watch.until(sidecar, moving(saves=2))
        shown = dict(watch.floor)  # the most each rollup was shown, by any sidecar so far
        sidecar.kill()
        state = saved(sidecar.state_file)  # as the kill left it: the last save
        file = {} if state is None else saved_as_scraped(state)
        # Nothing a scrape showed is above the file (or absent from it): the next sidecar cannot come back lower.
        below = {key: (file.get(key), value) for key, value in shown.items() if file.get(key, -1.0) < value}
        assert below == {}, f"kill {kill}: the file's rollups below what a scrape showed (file, shown)"
        assert state is not None
        own = per_rank(last, BYTES)  # the ranks' values the sidecar had applied when it was killed
        in_file = {key[:2]: values["load_back_bytes_total"] for key, values in saved_rank_values(state).items()}
        lost_unshown.append(sum(own.values()) - sum(in_file.values()))
        # The ranks count on while no sidecar runs; the next one listens on another socket, which the
        # ranks reach only once it has answered a scrape: that scrape is, for certain, before any rank is back.
        sidecar.socket_path = str(socket_dir / f"after-{kill}.sock")
        sidecar.start()
        first = watch.until(sidecar, lambda text: True)
        assert rollups(first) == file  # the file's rollups at once, exactly
        assert ranks_by_state(first) == {"live": 0, "stale": 0, "departed": len(STEPS), "expired": 0}
        assert per_rank(first, BYTES) == {} and per_rank(first, TOKENS) == {}  # absent until they push, not lower
        reroute(ranks_socket, sidecar.socket_path)
    # At least one kill came between two saves with values the sidecar held and never showed.
    assert max(lost_unshown) > 0, lost_unshown
    # The ranks back with their epochs, standing still: once a save has the last values, every rollup is exact.
    load.pause()
    final = watch.until(sidecar, lambda text: per_rank(text, TOKENS) == {
        key: float(rank.current.tokens) for key, rank in ranks.items()} and rollups(text) == truth(ranks.values()))
    assert per_rank(final, BYTES) == {key: float(rank.current.bytes) for key, rank in ranks.items()}
    assert watch.scrapes > 3 * KILLS
