"""The proxy's CPU time per upstream read against prometheus_client's text parser on the same text.

    python -m bench.proxy [--ranks 16,64,256] [--repeats N]

An upstream exposition of N ranks (radix and storage families of the default catalog, as the
released engine labels them) is written by prometheus_client, once per read with every counter
and histogram advanced, as between two scrapes of a busy engine. Per read the sidecar takes the
text as the scraper does (`UpstreamFeed.read_text`, then `apply`: text in, state updated) and
the parser reads the same text; the two take turns, read by read, timed with
`time.process_time`, and the medians are compared. The first read (untimed) makes the ranks and
the text's layout. Part of `make bench` (bench.run): the goal is at most 0.2x the parser's time
at 64 ranks, and a time per sample that stays flat from the smallest to the largest rank count
(linear in the samples).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalog import MetricType, default_catalog
from exporter.config import UpstreamConfig
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.upstream.feed import UpstreamFeed

from bench.common import progress_printer
from bench.report import row

GOAL_RATIO = 0.2
GOAL_FLATNESS = 1.5  # time per sample at the largest rank count over that at the smallest

RADIX = ("cache_type", "tp_rank", "pp_rank", "dp_rank")
STORAGE = ("storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")


class Engine:
    """One engine's /metrics with `ranks` ranks (tp 8 per dp group): every counter and histogram, advanced per read."""

    def __init__(self, ranks: int) -> None:
        self.registry = CollectorRegistry()
        self.children: list[tuple[Any, int]] = []
        for spec in default_catalog():
            if spec.type is MetricType.GAUGE or spec.beyond_upstream:
                continue
            axes = STORAGE if spec.collector == "storage" else RADIX
            name = "sglang:" + spec.exported_name("")
            labels = [*axes, *spec.labels]
            metric = (Counter(name, spec.help, labels, registry=self.registry) if spec.type is MetricType.COUNTER
                      else Histogram(name, spec.help, labels, buckets=spec.buckets or (1.0,), registry=self.registry))
            for r in range(ranks):
                values = {"cache_type": "UnifiedRadixCache", "tp_rank": str(r % 8), "pp_rank": "0",
                          "dp_rank": str(r // 8), "storage_backend": "file", "pp_size": "1", "attn_cp_rank": "0",
                          "attn_cp_size": "1"}
                own = {label: (spec.preset.get(label) or ("kv",))[0] for label in spec.labels}
                self.children.append((metric.labels(**{k: values[k] for k in axes}, **own), r))
        self.advance()

    def advance(self) -> None:
        """Every series moves: counters by the rank's number, histograms by one observation."""
        for child, r in self.children:
            if isinstance(child, Counter):
                child.inc(r + 1)
            else:
                child.observe(0.004 * (r + 1))

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def exposition(ranks: int) -> str:
    """One engine's /metrics with `ranks` ranks, every counter and histogram advanced once."""
    return Engine(ranks).text()


def measure(ranks: int, repeats: int) -> dict[str, float]:
    engine = Engine(ranks)
    texts = [engine.text()]
    for _ in range(repeats):
        engine.advance()
        texts.append(engine.text())
    samples = sum(len(f.samples) for f in text_string_to_metric_families(texts[0]))
    state = SidecarState(default_catalog())
    config = UpstreamConfig(url="http://engine:30000/metrics")
    feed = UpstreamFeed(config, state, UpstreamHealth(config.label, "bench"))
    feed.apply(feed.read_text(texts[0], False))  # the first read makes the ranks and the text's layout
    parser, sidecar, parsed = [], [], 0
    for text in texts[1:]:  # in turn, read by read: a slow minute of the VM hits both alike
        started = time.process_time()
        list(text_string_to_metric_families(text))
        parser.append(time.process_time() - started)
        started = time.process_time()
        reading = feed.read_text(text, False)
        feed.apply(reading)
        sidecar.append(time.process_time() - started)
        parsed += reading.parsed
    parser_s, sidecar_s = statistics.median(parser), statistics.median(sidecar)
    return {"ranks": ranks, "samples": samples, "parser_ms": parser_s * 1e3, "sidecar_ms": sidecar_s * 1e3,
            "ratio": sidecar_s / parser_s, "sidecar_us_per_sample": sidecar_s * 1e6 / samples,
            "reads": len(sidecar), "reads_parsed": parsed}


def run(ranks: tuple[int, ...] = (16, 64, 256), repeats: int = 10, goal_ranks: int = 64,
        progress: bool = True) -> list[dict[str, Any]]:
    """Rows for bench.run: per rank count the CPU time per read against the parser, then flatness."""
    say = progress_printer(progress, "proxy")
    measured = []
    for count in ranks:
        say(f"{count} ranks, {repeats} reads of each contender ...")
        measured.append(measure(count, repeats))
    rows = []
    for m in measured:
        goal = m["ranks"] == goal_ranks
        rows.append(row(
            f"proxy: CPU per upstream read, {m['ranks']} ranks ({m['samples']:.0f} samples)", m["sidecar_ms"], "CPU ms",
            "prometheus_client text parser, same text", m["parser_ms"], m["ratio"],
            f"ratio <= {GOAL_RATIO:g}" if goal else None, (m["ratio"] <= GOAL_RATIO) if goal else None,
            ratio_means="value / anchor", samples=m["samples"], reads=m["reads"], reads_parsed=m["reads_parsed"]))
    if len(measured) > 1:
        low, high = measured[0], measured[-1]
        flatness = high["sidecar_us_per_sample"] / low["sidecar_us_per_sample"]
        rows.append(row(
            f"proxy: CPU per sample, {high['ranks']} ranks", high["sidecar_us_per_sample"], "CPU us/sample",
            f"the same at {low['ranks']} ranks", low["sidecar_us_per_sample"], flatness,
            f"ratio <= {GOAL_FLATNESS:g}", flatness <= GOAL_FLATNESS, ratio_means="value / anchor"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args(argv)
    print(f"{'ranks':>6} {'samples':>8} {'parser ms':>10} {'sidecar ms':>11} {'ratio':>6} {'us/sample':>10} "
          f"{'parsed':>7}")
    for ranks in (int(n) for n in args.ranks.split(",")):
        m = measure(ranks, args.repeats)
        print(f"{m['ranks']:>6} {m['samples']:>8} {m['parser_ms']:>10.1f} {m['sidecar_ms']:>11.1f} "
              f"{m['ratio']:>6.3f} {m['sidecar_us_per_sample']:>10.2f} {m['reads_parsed']:>3}/{m['reads']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
