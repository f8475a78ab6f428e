"""The dashboard's pod rows across a sidecar restart, checked by promtool on the generated expressions.

A sidecar's rollup counter carries its ranks' earlier epochs. Without a state file they live only
in the sidecar's memory: when the sidecar restarts, its rollups start again from the sum of the
ranks' current epochs, which is lower than the last value exposed if a rank restarted earlier:
Prometheus reads a counter reset and counts the whole new value as the increase (a phantom
spike). The pod rows therefore guard every rate of a rollup with the sidecar's
`process_start_time_seconds`. A sidecar that took its ranks back from its state file
(`hicache_exporter_persistence_loaded_identities` above 0) goes on without a drop, and the guard
lets its windows through: the rate reads the truth across the restart. A state file that could
not be used (nothing loaded) is guarded as no file is.

The expressions under test are the generated dashboard's own (every namespace), with Grafana's
variables replaced, so a generator change that drops the guard, or narrows its window below the
rate's, fails here. The unguarded rate is asserted to spike in the same series, so the test also
shows that the problem exists.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from config.generator import outputs
from config.generator.dashboard import RESTART_GUARD
from config.generator.dashboard import STATE_LOADED as STATE_GUARD_LIFT
from tests.config.test_prometheus_rules import LMCACHE_NS, NAMESPACES, promtool

INSTANCE = "10.0.0.1:9400"
TARGET = {"job": "hicache", "instance": INSTANCE, "pod": "srv-a"}
RANGE = "5m"  # what $__rate_interval stands for here; the guard's range follows it
ROLLUP_RATE = re.compile(r"\b(?:rate|irate|increase)\(\s*([\w:]+?rollup_\w+)\{")

# One sidecar, scraped every minute. It restarts between 19m and 21m (the scrape at 20m fails);
# its new process starts at 20m30s. A rank had restarted before, so the rollup's history of
# that rank's earlier epoch (600000) is lost: the rollup drops from 1001140 to 401260 while the
# ranks really moved 60 per minute (1/s) all along.
RESTART_START = "0x19 _ 1230x19"
RESTART_ROLLUP = "1000000+60x19 _ 401260+60x19"
# Windows [T-5m, T] holding samples of both processes: 21m..24m.
BLANK = ["21m", "22m", "23m", "24m"]
EXACT = ["19m", "20m", "25m", "30m", "40m"]
# The same restart with a state file: the new process took back its 2 ranks (the old one had started
# fresh, 0), and the rollup goes on at the ranks' true 60 per minute, the missed scrape at 20m aside.
STATE_LOADED = "0x19 _ 2x19"
STATE_ROLLUP = "1000000+60x19 _ 1001260+60x19"
# A state file that could not be used (set aside): nothing loaded, the rollup drops as without a file.
STATE_UNUSABLE = "0x19 _ 0x19"
# A first start (no earlier process): the sidecar appears at 10m, its rollups already high.
FIRST_START = "_x10 600x20"
FIRST_ROLLUP = "_x10 500000+60x20"


def _series(name: str, labels: dict[str, str]) -> str:
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


def pod_rollup_rates(ns: str) -> list[tuple[str, str, str]]:
    """(panel / refId, rollup series name, expression) of every pod-row target taking a rate of a rollup."""
    board = json.loads(outputs(ns)["grafana/hicache-exporter.json"])
    found = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            for name in ROLLUP_RATE.findall(target["expr"]):
                assert name.startswith((ns + "rollup_", LMCACHE_NS + "rollup_")), name
                found.append((f"{panel['title']} / {target['refId']}", name, target["expr"]))
    return found


def plain(expr: str) -> str:
    """A dashboard expression as a plain query for one pod and a 5m rate interval."""
    out = expr.replace("$__rate_interval", RANGE).replace('instance="$instance"', f'instance="{INSTANCE}"')
    assert "$" not in out, out
    return out


def guard_spec(ns: str, targets: list[tuple[str, str, str]]) -> dict:
    """A promtool test of `targets` (their expressions as given) across a sidecar restart and a first start."""
    from exporter.catalog import load_profiles

    profiles = load_profiles(None, ["lmcache"])
    catalog = {profiles.namespace_of(f, ns) + "rollup_" + f.name: f for f in profiles}

    def own(name: str) -> dict[str, str]:
        fam = catalog[name]
        return {label: (fam.preset.get(label) or ("x",))[0] for label in fam.labels}

    def inputs(start: str, rollup: str, loaded: str | None = None) -> list[dict]:
        series = [{"series": _series("process_start_time_seconds", TARGET), "values": start}]
        if loaded is not None:  # a sidecar with --persistence.file
            series.append({"series": _series("hicache_exporter_persistence_loaded_identities", TARGET),
                           "values": loaded})
        for name in sorted({name for _, name, _ in targets}):
            labels = {**TARGET, "cache_type": "HiRadixCache", **own(name)}
            series.append({"series": _series(name, labels), "values": rollup})
        return series

    restart: list[dict] = []
    first: list[dict] = []
    through: list[dict] = []
    for _, name, expr in targets:
        guarded = f"sum({plain(expr)})"
        unguarded = f'sum(rate({name}{{instance="{INSTANCE}"}}[{RANGE}]))'
        # Outside the windows spanning the restart: the ranks' true rate, exactly.
        restart += [{"expr": guarded, "eval_time": t, "exp_samples": [{"labels": "{}", "value": 1}]} for t in EXACT]
        # Inside them: nothing, where the plain rate reads the lost history as a burst (> 1000/s).
        restart += [{"expr": guarded, "eval_time": t, "exp_samples": []} for t in BLANK]
        restart += [{"expr": f"{unguarded} > bool 1000", "eval_time": t, "exp_samples": [{"labels": "{}", "value": 1}]}
                    for t in BLANK]
        restart += [{"expr": unguarded, "eval_time": t, "exp_samples": [{"labels": "{}", "value": 1}]} for t in EXACT]
        # A first start leaves no gap: a line from the second scrape on, exact once the window is full.
        first += [{"expr": f"count({plain(expr)})", "eval_time": "11m", "exp_samples": [{"labels": "{}", "value": 1}]},
                  {"expr": guarded, "eval_time": "16m", "exp_samples": [{"labels": "{}", "value": 1}]}]
        # Restarted on its state file: every window reads the ranks' true rate, those spanning the restart too,
        # guarded or not.
        through += [{"expr": e, "eval_time": t, "exp_samples": [{"labels": "{}", "value": 1}]}
                    for t in EXACT + BLANK for e in (guarded, unguarded)]
    return {
        "rule_files": [],
        "evaluation_interval": "1m",
        "tests": [
            {"name": f"{ns}: a sidecar restart lowers its rollups; the pod rows skip the windows spanning it",
             "interval": "1m", "input_series": inputs(RESTART_START, RESTART_ROLLUP), "promql_expr_test": restart},
            {"name": f"{ns}: a first start is no restart", "interval": "1m",
             "input_series": inputs(FIRST_START, FIRST_ROLLUP), "promql_expr_test": first},
            {"name": f"{ns}: a sidecar restarted on its state file is read straight through", "interval": "1m",
             "input_series": inputs(RESTART_START, STATE_ROLLUP, STATE_LOADED), "promql_expr_test": through},
            {"name": f"{ns}: a state file that could not be used is guarded as no file is", "interval": "1m",
             "input_series": inputs(RESTART_START, RESTART_ROLLUP, STATE_UNUSABLE), "promql_expr_test": restart},
        ],
    }


def run_spec(spec: dict, directory: Path) -> tuple[int, str]:
    import subprocess

    path = directory / "restart_guard_test.yml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    result = subprocess.run([promtool(), "test", "rules", str(path)], cwd=directory, capture_output=True,
                            text=True, timeout=120)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.parametrize("ns", NAMESPACES)
def test_every_rollup_rate_of_the_pod_rows_is_guarded(ns: str) -> None:
    targets = pod_rollup_rates(ns)
    # Tokens and bytes of the four tiers; LMCache's hit and requested tokens, their ratio (two rates), stored
    # tokens, remote read and write bytes. No other panel takes a rate of a rollup.
    assert len(targets) == 8 + 7, [where for where, _, _ in targets]
    assert len([name for _, name, _ in targets if name.startswith(LMCACHE_NS)]) == 7
    for where, _, expr in targets:
        assert "process_start_time_seconds" in expr, f"{where}: unguarded rate of a rollup: {expr}"
        assert "hicache_exporter_persistence_loaded_identities" in expr, f"{where}: guarded even with a state file"


@pytest.mark.parametrize("ns", NAMESPACES)
def test_the_pod_rows_skip_a_sidecar_restart_and_read_exactly_outside_it(ns: str, tmp_path: Path) -> None:
    code, output = run_spec(guard_spec(ns, pod_rollup_rates(ns)), tmp_path)
    assert code == 0, output


def test_without_the_guard_the_check_fails(tmp_path: Path) -> None:
    """The same check on the dashboard's expressions with the guard taken out: promtool sees the spike."""
    ns = NAMESPACES[0]
    targets = pod_rollup_rates(ns)
    stripped = [(where, name, expr.replace(" " + RESTART_GUARD, "")) for where, name, expr in targets]
    assert all("process_start_time_seconds" not in expr for _, _, expr in stripped)
    code, output = run_spec(guard_spec(ns, stripped), tmp_path)
    assert code != 0, output
    # Exactly the windows spanning the restart fail, each with the plain rate's burst.
    failed = set(re.findall(r"time: (\w+),", output))
    assert failed == set(BLANK), output
    assert "got: {} 1.3381333333333334E+03" in output, output


def test_a_guard_blind_to_the_state_file_would_blank_what_is_right(tmp_path: Path) -> None:
    """The guard without its `or` on the loaded identities (the guard before the state file): the windows
    spanning a restart on the state file are left out although they are right. The `or` is what lifts it."""
    ns = NAMESPACES[0]
    targets = pod_rollup_rates(ns)
    lifted = " or on (job, instance) " + STATE_GUARD_LIFT
    assert all(lifted in expr for _, _, expr in targets)
    blind = [(where, name, expr.replace(lifted, "")) for where, name, expr in targets]
    code, output = run_spec(guard_spec(ns, blind), tmp_path)
    assert code != 0, output
    # Exactly the guarded rates at the windows spanning the restart fail, each blank where the truth (1/s) is
    # expected: only the state-file case expects a line there (promtool 2.x names no test in its report).
    failing = re.findall(r'expr: "(.+)", time: (\w+),\n\s+exp: \{\} 1E\+00\n\s+got: nil', output)
    assert len(failing) == len(targets) * len(BLANK) == output.count("expr: "), output
    assert {time for _, time in failing} == set(BLANK), output
    assert all("process_start_time_seconds" in expr for expr, _ in failing), output
