"""The proxy source: an engine's own prometheus_client metrics, read back as ranks of the sidecar's state.

An upstream is an engine's `/metrics` URL (text or OpenMetrics, parsed with prometheus_client's
parsers) or its `PROMETHEUS_MULTIPROC_DIR` (read with prometheus_client's multiprocess reader,
each process's files apart). Each series of a catalog family belongs to the rank its rank axes
name (static labels: the rest); the feed turns each rank's series into the protocol's hello and
snapshots and hands them to the same `SidecarState` that pushed ranks go through, so rollups,
restarts, staleness and expiry follow one set of rules:

* a rank is hello'd once, with an epoch the feed makes; every read is a snapshot with a rising seq;
* a counter or histogram of a rank that went down since the last read is a reset: the rank's
  connection closes and it says hello again with a new epoch (an engine restart);
* in a multiprocess directory the epoch is the process (pid): a new pid for a known rank is an
  exact restart, and the older process's files are never summed into the newer one's;
* an upstream that cannot be read sends no snapshots, so its ranks turn stale, then expire, on
  the registry's clock exactly as silent pushed ranks do; rollups keep their contribution.

Families outside the catalog pass through unchanged. A catalog family whose series carry no rank
axes (an engine from before per-rank labels: multiprocess mode summed its ranks) and radix series
whose context-parallel peers share labels are flagged and left out: no rollup is made of them.
"""

from __future__ import annotations

import asyncio
import glob
import hashlib
import logging
import os
import re
import ssl
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client.exposition import generate_latest as text_exposition
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_exposition
from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
from prometheus_client.parser import text_string_to_metric_families as parse_text

from exporter.catalog import Catalog, FamilySpec, MetricType
from exporter.config import UpstreamConfig
from exporter.errors import ConfigError, ProtocolError
from exporter.labels import RANK_AXES, RANK_KEYS
from exporter.protocol.messages import PROTOCOL_VERSION, Hello, RankId, Sample, Snapshot
from exporter.sidecar.families import exported_name
from exporter.sidecar.registry import RankIdentity, RankState
from exporter.sidecar.series import static_key
from exporter.sidecar.state import SidecarState
from exporter.sidecar.stats import UpstreamHealth

log = logging.getLogger("hicache_exporter.upstream")
MULTIPROCESS_HELP = "Multiprocess metric"  # what a multiprocess /metrics says for every family: not worth keeping
# The engine's OpenMetrics quirk (prometheus_client 0.26 without `escaping=allow-utf-8`): sample
# names have `:` escaped to `_` while HELP, TYPE and UNIT lines keep it, which its own parser
# refuses. The metadata lines get the samples' spelling before parsing.
_OM_METADATA = re.compile(r"(?m)^(# (?:HELP|TYPE|UNIT) )(\S+)")
_DB_FILE = re.compile(r"^(?P<kind>[a-z]+)(?:_[a-z]+)?_(?P<pid>[^_]+)\.db$")

Reading = list[tuple[str | None, float, list[Metric]]]  # (pid or None, its files' mtime, families), oldest first
# In a directory's reading, the entry of every process's files merged as the engine's /metrics
# merges them: the families passed through come from it (one series per label set, summed).
MERGED = "*"


# --- reading an upstream: prometheus_client's parsers and multiprocess reader ---


def parse_exposition(text: str, openmetrics: bool) -> list[Metric]:
    """Families of one exposition, by prometheus_client's text or OpenMetrics parser."""
    if openmetrics:
        return list(parse_openmetrics(_OM_METADATA.sub(lambda m: m.group(1) + m.group(2).replace(":", "_"), text)))
    return list(parse_text(text))


def read_multiprocess_dir(directory: Path) -> Reading:
    """Each process's families from a prometheus_client multiprocess directory, read apart, oldest first.

    prometheus_client's own reader (`MultiProcessCollector.merge`, the code the engine's /metrics
    runs) is given one process's files at a time, so one process's values are never summed with
    another's. A process's age is its files' latest modification time.
    """
    by_pid: dict[str, list[str]] = {}
    for path in glob.glob(os.path.join(directory, "*.db")):
        match = _DB_FILE.match(os.path.basename(path))
        if match:
            by_pid.setdefault(match.group("pid"), []).append(path)
    processes: Reading = []
    for pid, files in by_pid.items():
        try:
            mtime = max(os.stat(path).st_mtime for path in files)
        except FileNotFoundError:  # a live gauge's file removed between the glob and now
            continue
        processes.append((pid, mtime, list(MultiProcessCollector.merge(sorted(files), accumulate=True))))
    processes.sort(key=lambda process: (process[1], process[0]))
    every = sorted(path for _, files in by_pid.items() for path in files if os.path.exists(path))
    processes.append((MERGED, 0.0, list(MultiProcessCollector.merge(every, accumulate=True))))
    return processes


# --- the feed: an upstream's families into the sidecar's state ---


@dataclass(eq=False)
class _UpstreamRank:
    """One rank identity this upstream feeds: its connection token, epoch and last values."""

    token: object = field(default_factory=object)  # stands for the rank's "connection"
    rank: RankState | None = None
    epoch: str = ""
    pid: str | None = None
    generation: int = 0
    seq: int = 0
    last: dict[tuple[str, tuple[tuple[str, str], ...], str], float] = field(default_factory=dict)
    replaced_pids: set[str] = field(default_factory=set)


@dataclass
class FeedResult:
    """What one read gave: samples read, ranks fed, families passed through, problems found."""

    samples: int = 0
    ranks: int = 0
    resets: int = 0
    rejected: int = 0
    pass_through: list[Metric] = field(default_factory=list)
    unranked: set[str] = field(default_factory=set)
    cp_colliding: set[str] = field(default_factory=set)
    clashes: set[str] = field(default_factory=set)


class UpstreamFeed:
    """One upstream's reads, turned into hellos and snapshots of the sidecar's state (on its event loop)."""

    def __init__(
        self, config: UpstreamConfig, state: SidecarState, health: UpstreamHealth,
        reserved_names: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.state = state
        self.health = health
        self.reserved = frozenset(reserved_names)  # family names the sidecar makes: pass-through must not reuse them
        self.catalog: Catalog = state.catalog
        # The upstream's names of catalog families (without the prefix), in both spellings of `:`.
        self.specs: dict[str, FamilySpec] = {exported_name(spec, ""): spec for spec in self.catalog}
        self.prefixes = tuple(dict.fromkeys((config.prefix, config.prefix.replace(":", "_"))))
        self.ranks: dict[RankIdentity, _UpstreamRank] = {}
        digest = hashlib.sha256(config.label.encode()).hexdigest()[:8]
        self.tag = f"up-{digest}"  # epochs are at most 64 characters: the name itself may be longer
        self.pass_through: list[Metric] = []
        self._logged: set[tuple[str, str]] = set()

    def spec_of(self, name: str) -> FamilySpec | None:
        for prefix in self.prefixes:
            if name.startswith(prefix):
                return self.specs.get(name[len(prefix):])
        return None

    def apply(self, reading: Reading, wall: float | None = None) -> FeedResult:
        """Apply one read of the upstream: each process's catalog series to its ranks, the rest passed through."""
        wall = time.time() if wall is None else wall
        result = FeedResult()
        per_process: list[tuple[str | None, dict[RankIdentity, tuple[RankId, dict[str, str], list[Sample]]]]] = []
        pass_through: dict[str, Metric] = {}
        cp_size_above_one = False
        lacking_cp: dict[str, bool] = {}  # catalog family -> whether none of its series carries attn_cp_rank
        help_texts: dict[str, str] = {}
        merged = any(pid == MERGED for pid, _, _ in reading)
        for pid, _, families in reading:
            by_rank: dict[RankIdentity, tuple[RankId, dict[str, str], list[Sample]]] = {}
            for family in families:
                spec = self.spec_of(family.name)
                if pid == MERGED or spec is None:
                    if spec is None and self.config.pass_through and (pid == MERGED or not merged):
                        result.samples += len(family.samples)
                        self._pass(family, pass_through, result)
                    continue
                result.samples += len(family.samples)
                if family.documentation and family.documentation != MULTIPROCESS_HELP:
                    help_texts[spec.name] = family.documentation
                for labels, sample in _series(spec, family):
                    if "attn_cp_size" in labels and _int(labels["attn_cp_size"]) > 1:
                        cp_size_above_one = True
                    if not all(key in labels for key in RANK_KEYS):
                        result.unranked.add(spec.name)
                        continue
                    if spec.type is not MetricType.GAUGE:
                        lacking_cp[spec.name] = lacking_cp.get(spec.name, True) and "attn_cp_rank" not in labels
                    rank_id, static = self._rank_of(labels, spec.labels)
                    if rank_id is None:
                        result.unranked.add(spec.name)
                        continue
                    identity = (rank_id.tp_rank, rank_id.pp_rank, rank_id.dp_rank, rank_id.attn_cp_rank or 0,
                                static_key(static))
                    entry = by_rank.setdefault(identity, (rank_id, static, []))
                    entry[2].append(sample)
            per_process.append((pid, by_rank))
        if cp_size_above_one:
            result.cp_colliding = {name for name, lacking in lacking_cp.items() if lacking}
        left_out = result.unranked | result.cp_colliding
        self._flag(result)
        for pid, by_rank in per_process:
            for identity, (rank_id, static, samples) in by_rank.items():
                kept = [s for s in samples if s.family not in left_out]
                if kept:
                    self._feed(identity, rank_id, static, kept, pid, wall, help_texts, result)
        self.pass_through = list(pass_through.values())
        result.pass_through = self.pass_through
        result.ranks = sum(1 for r in self.ranks.values() if r.rank is not None)
        return result

    def _rank_of(self, labels: dict[str, str], own: tuple[str, ...]) -> tuple[RankId | None, dict[str, str]]:
        """The rank axes, and the static labels: neither a rank axis nor one of the family's own labels."""
        try:
            axes = {key: int(labels[key]) for key in RANK_AXES if key in labels}
            rank_id = RankId(**axes)
        except (ValueError, TypeError):
            return None, {}
        static = {k: v for k, v in labels.items() if k not in RANK_AXES and k not in own}
        static.update(self.config.labels)
        return rank_id, static

    def _pass(self, family: Metric, out: dict[str, Metric], result: FeedResult) -> None:
        if family.name in self.reserved:
            result.clashes.add(family.name)
            self._log_once("clash", family.name, logging.ERROR,
                           "upstream %s: family %s is also a family the sidecar makes; it is not passed through",
                           self.health.name, family.name)
            return
        out.setdefault(family.name, family)

    def _flag(self, result: FeedResult) -> None:
        for name in sorted(result.unranked - self.health.unranked):
            self._log_once("unranked", name, logging.WARNING,
                           "upstream %s: family %s carries no rank labels (tp_rank, pp_rank, dp_rank): the engine "
                           "predates per-rank labels and prometheus_client's multiprocess mode summed its ranks, "
                           "so its values are a sum of replicas, not a count; it is not rolled up. Upgrade the "
                           "engine (SGLang 0.5.23 or later) or push with exporter.integrations.sglang",
                           self.health.name, name)
        for name in sorted(result.cp_colliding - self.health.cp_colliding):
            self._log_once("cp", name, logging.WARNING,
                           "upstream %s: family %s has no attn_cp_rank while the engine runs context parallelism "
                           "(attn_cp_size > 1 on its storage series): its CP peers share one label set and "
                           "multiprocess mode summed them; it is not rolled up. Push with "
                           "exporter.integrations.sglang, which adds attn_cp_rank", self.health.name, name)
        self.health.unranked |= result.unranked
        self.health.cp_colliding |= result.cp_colliding

    def _log_once(self, kind: str, name: str, level: int, message: str, *args: object) -> None:
        if (kind, name) not in self._logged:
            self._logged.add((kind, name))
            log.log(level, message, *args)

    def _feed(
        self, identity: RankIdentity, rank_id: RankId, static: dict[str, str], samples: list[Sample],
        pid: str | None, wall: float, help_texts: dict[str, str], result: FeedResult,
    ) -> None:
        entry = self.ranks.get(identity)
        if entry is None:
            entry = self.ranks[identity] = _UpstreamRank()
        values = _monotone(samples)
        if entry.rank is not None:
            if pid is not None and pid != entry.pid:
                if pid in entry.replaced_pids:
                    return  # an older process's files: that epoch was replaced
                entry.replaced_pids.add(str(entry.pid))
                self._restart(entry, result)
            elif any(values.get(key, value) < value for key, value in entry.last.items()):
                self._restart(entry, result)  # a counter went down: the engine restarted
        if entry.rank is None:
            entry.pid = pid
            entry.epoch = f"{self.tag}-{'pid' + pid if pid is not None else entry.generation}"[:64]
            hello = Hello(protocol=PROTOCOL_VERSION, epoch=entry.epoch, pid=_int(pid or "0"), rank=rank_id,
                          labels=static)
            try:
                entry.rank = self.state.hello(entry.token, hello).rank
            except ProtocolError as err:
                self.health.error(err.code.value, err.message)
                self._log_once("hello", str(identity), logging.ERROR, "upstream %s: rank refused: %s",
                               self.health.name, err.message)
                return
            entry.seq = 0
        entry.seq += 1
        helps = {s.family: help_texts[s.family] for s in samples if s.family in help_texts}
        applied = self.state.snapshot(entry.rank, Snapshot(seq=entry.seq, time=wall, samples=samples, help=helps))
        result.rejected += len(applied.rejections)
        for code, message in applied.rejections[:1]:
            self._log_once("sample", f"{code.value}:{message}", logging.WARNING,
                           "upstream %s: sample refused (%s): %s", self.health.name, code.value, message)
        entry.last.update(values)  # what the next read compares with

    def _restart(self, entry: _UpstreamRank, result: FeedResult) -> None:
        assert entry.rank is not None
        self.state.disconnect(entry.token, entry.rank)
        entry.rank = None
        entry.token = object()
        entry.generation += 1
        entry.last = {}
        result.resets += 1


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def _series(spec: FamilySpec, family: Metric) -> Iterable[tuple[dict[str, str], Sample]]:
    """(all labels, protocol sample with the family's own labels) per series of a catalog family."""
    own = spec.labels
    if spec.type is MetricType.HISTOGRAM:
        grouped: dict[tuple[tuple[str, str], ...], dict[str, object]] = {}
        for s in family.samples:
            if s.name.endswith("_bucket"):
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                entry = grouped.setdefault(tuple(sorted(labels.items())), {"buckets": []})
                entry["buckets"].append((s.labels.get("le", "+Inf"), s.value))  # type: ignore[attr-defined]
            elif s.name.endswith("_sum") or s.name.endswith("_count"):
                entry = grouped.setdefault(tuple(sorted(s.labels.items())), {"buckets": []})
                entry[s.name.rsplit("_", 1)[1]] = s.value
        for key, parts in grouped.items():
            if not any(le == "+Inf" for le, _ in parts["buckets"]):  # type: ignore[attr-defined]
                # A process creating the child right now: prometheus_client writes its buckets
                # in ascending order, +Inf last, so the layout is not whole yet. Next read.
                continue
            labels = dict(key)
            buckets = sorted(
                ((float(le), int(v)) for le, v in parts["buckets"]),  # type: ignore[attr-defined]
                key=lambda b: b[0],
            )
            wire: list[tuple[float | str, int]] = [(b, c) for b, c in buckets if b != float("inf")]
            count = int(parts.get("count", buckets[-1][1] if buckets else 0))  # type: ignore[call-overload]
            wire.append(("+Inf", count))
            yield labels, Sample(spec.name, {k: labels[k] for k in own if k in labels}, buckets=wire,
                                 sum=float(parts.get("sum", 0.0)), count=count)  # type: ignore[arg-type]
        return
    wanted = family.name + "_total" if spec.type is MetricType.COUNTER else family.name
    for s in family.samples:
        if s.name == wanted:
            yield s.labels, Sample(spec.name, {k: s.labels[k] for k in own if k in s.labels}, value=float(s.value))


def _monotone(samples: list[Sample]) -> dict[tuple[str, tuple[tuple[str, str], ...], str], float]:
    """The values of a rank's counters and histograms that only rise within an epoch."""
    out: dict[tuple[str, tuple[tuple[str, str], ...], str], float] = {}
    for s in samples:
        labels = tuple(s.labels.items())
        if isinstance(s.buckets, list):
            out[(s.family, labels, "count")] = float(s.count)  # type: ignore[arg-type]
            out[(s.family, labels, "sum")] = float(s.sum)  # type: ignore[arg-type]
            for bound, count in s.buckets:
                out[(s.family, labels, str(bound))] = float(count)
        elif isinstance(s.value, float):
            out[(s.family, labels, "")] = s.value
    return out


# --- the scraper: reads on an interval, in the app's cleanup context ---


def client_ssl_context(config: UpstreamConfig) -> ssl.SSLContext | None:
    tls = config.tls
    if tls is None:
        return None
    context = ssl.create_default_context(cafile=str(tls.ca_file) if tls.ca_file else None)
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file))
    if tls.insecure_skip_verify:
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    return context


class UpstreamScraper:
    """Reads one upstream every `interval_seconds` and applies what it read to the state."""

    def __init__(self, config: UpstreamConfig, feed: UpstreamFeed) -> None:
        self.config = config
        self.feed = feed
        self.health = feed.health
        self._session: aiohttp.ClientSession | None = None
        self._task: asyncio.Task[None] | None = None
        self._rendered: dict[bool, str] = {}

    async def start(self) -> None:
        """Read once (a pass-through family that clashes with the sidecar's stops start-up), then on an interval."""
        if self.config.url is not None:
            auth = None
            if self.config.basic_auth is not None:
                ba = self.config.basic_auth
                password = ba.password if ba.password is not None else Path(ba.password_file or "").read_text().strip()
                auth = aiohttp.BasicAuth(ba.username, password)
            self._session = aiohttp.ClientSession(
                auth=auth, headers=self.config.headers, timeout=aiohttp.ClientTimeout(total=self.config.timeout_seconds),
                connector=aiohttp.TCPConnector(ssl=client_ssl_context(self.config) or True, limit=1),
            )
        result = await self.scrape_once()
        if result is not None and result.clashes:
            await self.stop()
            raise ConfigError(
                f"upstream {self.health.name}: families {sorted(result.clashes)} are passed through and are also "
                "families the sidecar makes; set metrics.namespace to another prefix, or pass_through: false "
                "on this upstream"
            )
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.interval_seconds)
            await self.scrape_once()

    async def read(self) -> Reading:
        """One read of the upstream (the parsing and file reading run off the event loop)."""
        if self.config.multiprocess_dir is not None:
            directory = self.config.multiprocess_dir
            if not directory.is_dir():
                raise _ReadError("read", f"{directory} is not a directory")
            return await asyncio.wait_for(asyncio.to_thread(read_multiprocess_dir, directory),
                                          self.config.timeout_seconds)
        assert self._session is not None and self.config.url is not None
        openmetrics = self.config.format == "openmetrics"
        accept = "application/openmetrics-text; version=1.0.0" if openmetrics else "text/plain; version=0.0.4"
        try:
            async with self._session.get(self.config.url, headers={"Accept": accept}) as response:
                if response.status != 200:
                    raise _ReadError("http_status", f"HTTP {response.status}")
                body = await response.text()
                openmetrics = response.headers.get("Content-Type", "").startswith("application/openmetrics-text")
        except asyncio.TimeoutError:
            raise _ReadError("timeout", f"no answer within {self.config.timeout_seconds} s") from None
        except aiohttp.ClientError as err:
            raise _ReadError("connect", str(err) or type(err).__name__) from None
        try:
            families = await asyncio.to_thread(parse_exposition, body, openmetrics)
        except ValueError as err:
            raise _ReadError("parse", str(err)) from None
        return [(None, 0.0, families)]

    async def scrape_once(self) -> FeedResult | None:
        health = self.health
        started = time.perf_counter()
        try:
            reading = await self.read()
        except _ReadError as err:
            self._failed(err.kind, err.message)
        except asyncio.TimeoutError:
            self._failed("timeout", f"no read within {self.config.timeout_seconds} s")
        except (OSError, ValueError) as err:
            self._failed("read", str(err))
        else:
            result = self.feed.apply(reading)
            health.up = True
            health.scrapes += 1
            health.last_scrape_wall = time.time()
            health.samples = result.samples
            health.ranks = result.ranks
            health.pass_through = len(result.pass_through)
            if result.rejected:
                health.error("rejected_samples", f"{result.rejected} samples refused")
            if result.clashes:
                health.error("name_clash", ", ".join(sorted(result.clashes)))
            self._rendered = {}
            health.last_duration = time.perf_counter() - started
            return result
        health.last_duration = time.perf_counter() - started
        return None

    def _failed(self, kind: str, message: str) -> None:
        if self.health.up or not self.health.errors:
            log.warning("upstream %s: %s (%s); its ranks turn stale, then expire", self.health.name, message, kind)
        self.health.up = False
        self.health.error(kind, message)

    def pass_through_text(self, openmetrics: bool) -> str:
        """The families passed through, as prometheus_client's own exposition writes them (cached per read)."""
        text = self._rendered.get(openmetrics)
        if text is None:
            registry = _Families(self.feed.pass_through)
            if openmetrics:
                text = openmetrics_exposition(registry).decode()
                text = text.removesuffix("# EOF\n")
            else:
                text = text_exposition(registry).decode()
            self._rendered[openmetrics] = text
        return text


class _ReadError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message


class _Families:
    """Parsed families as a collector, for prometheus_client's exposition functions."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> list[Metric]:
        return self.families


UPSTREAMS: web.AppKey[list[UpstreamScraper]] = web.AppKey("upstreams", list)


async def run_upstreams(app: web.Application) -> AsyncIterator[None]:
    """The cleanup context of the proxy: every upstream's scraper, started and stopped with the app."""
    started: list[UpstreamScraper] = []
    try:
        for scraper in app[UPSTREAMS]:
            await scraper.start()
            started.append(scraper)
    except BaseException:
        for scraper in started:
            await scraper.stop()
        raise
    yield
    for scraper in started:
        await scraper.stop()
