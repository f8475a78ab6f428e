"""Workloads for instruction counting: repeatable where wall time on a shared VM is not.

    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python -m bench.instructions ingest 160
    valgrind --tool=callgrind --callgrind-out-file=/dev/null .venv/bin/python -m bench.instructions ingest 0

The difference of the two "Collected" totals, divided by 160, is the instructions one snapshot
costs to apply (parse excluded); `decode N` decodes N of the same payloads instead, and
`loads N` runs `json.loads` on them (the ingest bench's anchor). Set PYTHONHASHSEED=0 for runs
that repeat to within about 1 %. `render N` renders N times after every rank pushed (the scrape
bench's case), `render-unchanged N` renders N more times with nothing pushed since; run each with
N = 5 and N = 0 and divide the difference by 5. Same catalog and payloads as the benchmarks.
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from exporter.catalog import default_catalog
from exporter.protocol.messages import parse_client_message
from exporter.sidecar.core.health import SidecarHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.expose.collector import SidecarCollector
from exporter.sidecar.expose.render import TextRenderer

from bench.common import NAMESPACE, advance_all, full_metric_set, hello_payload, rank_id, snapshot_payload


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workload", choices=["ingest", "decode", "loads", "render", "render-unchanged"])
    parser.add_argument("count", type=int, help="snapshots to apply (ingest) or renders to do (render)")
    parser.add_argument("--ranks", type=int, default=None, help="ranks (default: 16 for ingest, 64 for render)")
    args = parser.parse_args(argv)
    ranks = args.ranks or (16 if args.workload == "ingest" else 64)
    catalog = default_catalog()
    state = SidecarState(catalog)
    sets = [full_metric_set(catalog, seed=i) for i in range(ranks)]
    rngs = [random.Random(1000 + i) for i in range(ranks)]
    rank_states = [state.hello(object(), parse_client_message(hello_payload(rank_id(i)))).rank for i in range(ranks)]
    # A fixed number of rounds, all decoded before the counted work, so that the runs with N and
    # with 0 do the same setup and differ only in the work counted.
    per_snapshot = args.workload in ("ingest", "decode", "loads")
    rounds = 10 if per_snapshot else 6
    limit = rounds * ranks if per_snapshot else rounds - 1
    if args.count > limit:
        parser.error(f"count is at most {limit} for {args.workload} with {ranks} ranks")
    payloads = []
    for round_ in range(rounds + 1):
        for index in range(ranks):
            advance_all(sets[index], rngs[index])
            payloads.append((rank_states[index], snapshot_payload(sets[index], round_ + 1)))
    if args.workload in ("decode", "loads"):
        decode = parse_client_message if args.workload == "decode" else json.loads
        for _, payload in payloads[ranks:ranks + args.count]:
            decode(payload)
        return 0
    messages = [(rank, parse_client_message(payload)) for rank, payload in payloads]
    for rank, message in messages[:ranks]:  # the first push creates every series
        state.snapshot(rank, message)
    work = messages[ranks:]
    if args.workload == "ingest":
        for rank, message in work[: args.count]:
            state.snapshot(rank, message)
        return 0
    renderer = TextRenderer(SidecarCollector(state, SidecarHealth(), NAMESPACE))
    renderer.render()
    if args.workload == "render":
        for round_ in range(rounds - 1):  # every run applies all rounds; only N of them render
            for rank, message in work[round_ * ranks:(round_ + 1) * ranks]:
                state.snapshot(rank, message)
            if round_ < args.count:
                renderer.render()
        return 0
    for rank, message in work[:ranks]:
        state.snapshot(rank, message)
    renderer.render()
    renderer.render()  # the first unchanged render joins each rank's family strings
    for _ in range(args.count):
        renderer.render()
    return 0


if __name__ == "__main__":
    sys.exit(main())
