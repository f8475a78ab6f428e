"""The proxy's CPU time per upstream read against prometheus_client's text parser on the same text.

    python -m bench.proxy [--ranks 16,64,256|none] [--repeats N] [--lmcache 8x8|none] [--lmcache-source auto]

An upstream exposition of N ranks (radix and storage families of the default catalog, as the
released engine labels them) is written by prometheus_client, once per read with every counter
and histogram advanced, as between two scrapes of a busy engine. Per read the sidecar takes the
text as the scraper does (`UpstreamFeed.plan_text`, then `apply`: text in, state updated) and
the parser reads the same text; the two take turns, read by read, timed with
`time.process_time`, and the medians are compared. The first read (untimed) makes the ranks and
the text's layout. Part of `make bench` (bench.run): the goal is at most 0.2x the parser's time
at 64 ranks, and a time per sample that stays flat from the smallest to the largest rank count
(linear in the samples).

The lmcache case (`--lmcache 8x8`, in `make bench` too): vLLM's /metrics with LMCache 0.5.6's families
for 8 engines x TP 8 = 64 workers (bench/lmcache_exposition.py writes it in a process of its own, as
vLLM's multiprocess /metrics does, with LMCache's released PrometheusLogger where its wheel can be had,
else with prometheus_client objects of the lmcache profile's families; the row says which). LMCache
labels no DP replica: the engines are 8 engines of 8 different models (model_name, served_model_name),
each with worker_id 0-7. The sidecar reads it as an upstream of profile lmcache with world tp=8, dp=1,
in a state of the lmcache profile, and must make every worker a rank and take every sample. Goal: at
most 0.2x the parser's time on the same text.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from exporter.catalog import MetricType, default_catalog, load_profiles
from exporter.config import UpstreamConfig, UpstreamWorld
from exporter.sidecar.core.health import UpstreamHealth
from exporter.sidecar.core.state import SidecarState
from exporter.sidecar.upstream.feed import UpstreamFeed

from bench.common import REPO_ROOT, child_env, progress_printer
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


def measure(ranks: int, repeats: int) -> dict[str, Any]:
    engine = Engine(ranks)
    texts = [engine.text()]
    for _ in range(repeats):
        engine.advance()
        texts.append(engine.text())
    state = SidecarState(default_catalog())
    config = UpstreamConfig(url="http://engine:30000/metrics")
    return {"ranks": ranks, **compare(texts, UpstreamFeed(config, state, UpstreamHealth(config.label, "bench")))}


def compare(texts: list[str], feed: UpstreamFeed, ranks: int | None = None) -> dict[str, Any]:
    """The sidecar's and the parser's CPU time per read of texts[1:] (medians), after the first read (timed apart:
    it makes the ranks and the text's layout, which later reads of the same layout reuse).

    With `ranks`, the first read must make that many ranks and take every sample of the text."""
    started = time.process_time()
    samples = sum(len(f.samples) for f in text_string_to_metric_families(texts[0]))
    first_parser = time.process_time() - started
    started = time.process_time()
    first = feed.apply(feed.plan_text(texts[0], False))  # the first read makes the ranks and the text's layout
    first_sidecar = time.process_time() - started
    if ranks is not None and (first.ranks != ranks or first.samples != samples or first.rejected or first.unranked):
        raise RuntimeError(f"the sidecar's first read is not the whole text: {ranks} ranks and {samples} samples "
                           f"expected, {first}")
    parser, sidecar, parsed = [], [], 0
    for text in texts[1:]:  # in turn, read by read: a slow minute of the VM hits both alike
        started = time.process_time()
        list(text_string_to_metric_families(text))
        parser.append(time.process_time() - started)
        started = time.process_time()
        reading = feed.plan_text(text, False)
        feed.apply(reading)
        sidecar.append(time.process_time() - started)
        parsed += reading.parsed
    parser_s, sidecar_s = statistics.median(parser), statistics.median(sidecar)
    return {"samples": samples, "parser_ms": parser_s * 1e3, "sidecar_ms": sidecar_s * 1e3,
            "ratio": sidecar_s / parser_s, "sidecar_us_per_sample": sidecar_s * 1e6 / samples,
            "reads": len(sidecar), "reads_parsed": parsed,
            "first_ms": first_sidecar * 1e3, "first_parser_ms": first_parser * 1e3}


def lmcache_texts(engines: int, tp: int, reads: int, source: str = "auto") -> tuple[list[str], dict[str, Any]]:
    """`reads` texts of vLLM's /metrics with LMCache's families (bench/lmcache_exposition.py, in its own process
    with a fresh multiprocess directory), and what wrote them."""
    work = Path(tempfile.mkdtemp(prefix="hcb-lmcache-"))
    try:
        (work / "mp").mkdir()
        done = subprocess.run(
            [sys.executable, "-m", "bench.lmcache_exposition", "--engines", str(engines), "--tp", str(tp),
             "--reads", str(reads), "--source", source, "--out", str(work / "out")],
            env=child_env(PROMETHEUS_MULTIPROC_DIR=str(work / "mp")), cwd=REPO_ROOT, capture_output=True, text=True,
            timeout=600)
        if done.returncode != 0:
            raise RuntimeError(f"bench.lmcache_exposition exited with {done.returncode}: {done.stderr.strip()[-2000:]}")
        meta = json.loads((work / "out" / "source.json").read_text())
        return [(work / "out" / f"read-{n}.txt").read_text() for n in range(reads)], meta
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_lmcache(engines: int, tp: int, repeats: int, source: str = "auto") -> dict[str, Any]:
    """The sidecar reading `engines` LMCache engines of TP `tp` as one upstream of profile lmcache, against the parser."""
    texts, meta = lmcache_texts(engines, tp, repeats + 1, source)
    state = SidecarState(load_profiles(None, ["lmcache"]))
    config = UpstreamConfig(url="http://engine:8000/metrics", profile="lmcache",
                            world=UpstreamWorld(tp_size=tp, dp_size=1))
    feed = UpstreamFeed(config, state, UpstreamHealth(config.label, "bench"))
    return {"engines": engines, "tp": tp, "ranks": engines * tp, "source": meta["source"], "source_note": meta["note"],
            **compare(texts, feed, engines * tp)}


def run(ranks: tuple[int, ...] = (16, 64, 256), repeats: int = 10, goal_ranks: int = 64,
        lmcache: tuple[int, int] | None = (8, 8), lmcache_source: str = "auto", progress: bool = True
        ) -> list[dict[str, Any]]:
    """Rows for bench.run: per rank count the CPU time per read against the parser, then flatness, then the
    lmcache case (`lmcache`: engines, tp)."""
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
    if lmcache is not None:
        engines, tp = lmcache
        say(f"lmcache: {engines} engines x TP {tp}, {repeats} reads of each contender ...")
        m = measure_lmcache(engines, tp, repeats, lmcache_source)
        say(f"lmcache exposition written by {m['source_note']}")
        rows.append(row(
            f"proxy: CPU per upstream read, lmcache {engines} engines x TP {tp} ({m['ranks']} workers, "
            f"{m['samples']:.0f} samples, {m['source']})", m["sidecar_ms"], "CPU ms",
            "prometheus_client text parser, same text", m["parser_ms"], m["ratio"], f"ratio <= {GOAL_RATIO:g}",
            m["ratio"] <= GOAL_RATIO, ratio_means="value / anchor", profile="lmcache", engines=engines, tp=tp,
            ranks=m["ranks"], samples=m["samples"], reads=m["reads"], reads_parsed=m["reads_parsed"],
            source=m["source"], source_note=m["source_note"]))
        rows.append(row(  # what a read costs when the text's layout is new (then the parser reads it): once per change
            f"proxy: CPU of the first upstream read (ranks and layout made), lmcache {engines} engines x TP {tp}",
            m["first_ms"], "CPU ms", "prometheus_client text parser, same text", m["first_parser_ms"],
            m["first_ms"] / m["first_parser_ms"], None, None, ratio_means="value / anchor", profile="lmcache",
            samples=m["samples"]))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", default="16,64,256")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--lmcache", default="8x8", help="ENGINESxTP of the lmcache case, or 'none'")
    parser.add_argument("--lmcache-source", choices=("auto", "released", "catalog"), default="auto",
                        help="what writes the lmcache exposition: LMCache's released logger, the catalog's objects, "
                             "or the first that can (default)")
    args = parser.parse_args(argv)
    lmcache = None if args.lmcache == "none" else tuple(int(n) for n in args.lmcache.lower().split("x"))
    if lmcache is not None and len(lmcache) != 2:
        parser.error("--lmcache takes ENGINESxTP, e.g. 8x8")
    ranks_list = [int(n) for n in args.ranks.split(",")] if args.ranks != "none" else []
    header = (f"{'ranks':>6} {'samples':>8} {'parser ms':>10} {'sidecar ms':>11} {'ratio':>6} {'us/sample':>10} "
              f"{'parsed':>7}")
    if ranks_list:
        print(header)
    for ranks in ranks_list:
        m: dict[str, Any] = measure(ranks, args.repeats)
        print(f"{m['ranks']:>6} {m['samples']:>8} {m['parser_ms']:>10.1f} {m['sidecar_ms']:>11.1f} "
              f"{m['ratio']:>6.3f} {m['sidecar_us_per_sample']:>10.2f} {m['reads_parsed']:>3}/{m['reads']}")
    if lmcache is not None:
        engines, tp = lmcache
        m = measure_lmcache(engines, tp, args.repeats, args.lmcache_source)
        print(f"lmcache: {engines} engines x TP {tp}, exposition by {m['source_note']}")
        print(header)
        print(f"{m['ranks']:>6} {m['samples']:>8} {m['parser_ms']:>10.1f} {m['sidecar_ms']:>11.1f} "
              f"{m['ratio']:>6.3f} {m['sidecar_us_per_sample']:>10.2f} {m['reads_parsed']:>3}/{m['reads']}")
        print(f"lmcache ratio {m['ratio']:.3f}x the parser (goal <= {GOAL_RATIO:g}x): "
              f"{'met' if m['ratio'] <= GOAL_RATIO else 'NOT met'}")
        print(f"lmcache first read (ranks and layout made): {m['first_ms']:.1f} ms, parser {m['first_parser_ms']:.1f} ms, "
              f"{m['first_ms'] / m['first_parser_ms']:.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
