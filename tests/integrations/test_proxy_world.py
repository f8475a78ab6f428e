"""The proxy with a configured world, against the released SGLang 0.5.23 collectors: `serve --upstream URL
--upstream-world SPEC` as a real process, reading a stand-in engine's /metrics over the ranks' multiprocess
directory (tests/integrations/engine_server.py).

The ranks run DP attention, two dp groups of two attention tp ranks (the engine's tp_size 4); their storage
series say pp_size 1 and attn_cp_size 1, which complete the world the command line gives.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.helpers import free_port, wait_until
from tests.integrations.support import ServeProcess
from tests.integrations.test_proxy import HTTP_PACE, EngineServer, run_engine

DP_ATTENTION_TP4 = "tp=4,dp=2,dp-attention"  # pp and cp from the engine's storage labels
EXPECTED_WORLD = {"tp_size": 4, "pp_size": 1, "dp_size": 2, "attn_tp_size": 2, "attn_cp_size": 1}


class Serve(ServeProcess):
    """The sidecar reading one engine: a config file that paces the upstream, and the flags."""

    def __init__(self, directory: Path, url: str, world: str) -> None:
        # The file names the URL for its pace; --upstream names it again with its world, which the flag gives.
        super().__init__(directory, {"upstreams": [{"name": "engine", "url": url, **HTTP_PACE}]},
                         ["--upstream", url, "--upstream-world", world])

    def status(self) -> dict[str, Any]:
        document: dict[str, Any] = self.get_json("/api/v1/status")
        return document


def missing(sidecar: Serve) -> dict[str, float]:
    """hicache_exporter_ranks_missing by dp group."""
    return {s.labels["dp_rank"]: s.value for s in sidecar.scrape().find("hicache_exporter_ranks_missing")}


def cells(status: dict[str, Any]) -> dict[tuple[int, int, int, int], str]:
    """The state of every rank cell of the status document, by (dp, pp, cp, attention tp)."""
    return {(c["dp_rank"], c["pp_rank"], c["attn_cp_rank"], c["tp_rank"]): c["state"] for c in status["ranks"]}


def test_a_rank_that_never_runs_is_missing_behind_the_proxy_until_it_runs(
    ranks: ModuleType, tmp_path: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch, running: list[Any],
) -> None:
    world = ranks.ranks(tp=2, dp=2)
    absent = world[-1]  # attention tp 1 of dp group 1
    assert (absent.tp_rank, absent.dp_rank) == (1, 1)
    directory = tmp_path / "multiproc"
    run_engine(ranks, directory, monkeypatch, world[:-1])
    engine = EngineServer(directory, free_port()).start()
    running.append(engine)
    sidecar = Serve(socket_dir / "world", engine.url, DP_ATTENTION_TP4)
    running.append(sidecar)

    wait_until(lambda: missing(sidecar) == {"0": 0.0, "1": 1.0}, timeout=20)
    status = sidecar.status()
    (upstream,) = status["upstreams"]
    assert upstream["world"] == EXPECTED_WORLD and upstream["world_problems"] == []
    live = {(dp, 0, 0, tp): "live" for dp in (0, 1) for tp in (0, 1)}
    assert cells(status) == {**live, (1, 0, 0, 1): "missing"}
    assert status["totals"]["missing"] == 1

    run_engine(ranks, directory, monkeypatch, [absent])  # it runs: its series appear upstream
    wait_until(lambda: missing(sidecar) == {"0": 0.0, "1": 0.0}, timeout=20)
    status = sidecar.status()
    assert cells(status) == live and status["totals"]["missing"] == 0


def test_a_world_the_engine_labels_contradict_is_flagged_and_expects_nothing(
    ranks: ModuleType, tmp_path: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch, running: list[Any],
) -> None:
    world = ranks.ranks(tp=2, dp=2)
    directory = tmp_path / "multiproc"
    run_engine(ranks, directory, monkeypatch, world)
    engine = EngineServer(directory, free_port()).start()
    running.append(engine)
    # Two pp stages configured; the engine's storage series say one. Trusted, it would count a whole
    # stage of each dp group missing.
    sidecar = Serve(socket_dir / "contradicted", engine.url, DP_ATTENTION_TP4 + ",pp=2")
    running.append(sidecar)

    wait_until(lambda: sidecar.status()["upstreams"][0]["world_problems"] != [], timeout=20)
    status = sidecar.status()
    (upstream,) = status["upstreams"]
    assert upstream["world_problems"] == ["pp_size is configured 2, the engine's storage series say 1"]
    assert upstream["world"] == {**EXPECTED_WORLD, "pp_size": 2}
    assert cells(status) == {(dp, 0, 0, tp): "live" for dp in (0, 1) for tp in (0, 1)}
    assert status["totals"]["missing"] == 0 and all(s["expected"] is None for s in status["servers"])
    assert missing(sidecar) == {}
