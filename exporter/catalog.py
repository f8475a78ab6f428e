"""The metric catalog: family types, labels, semantics and buckets, loaded from YAML and validated.

The sidecar's side: a rank reads the packaged profiles pre-built (exporter.rank_catalog), which
`python -m exporter.catalog` writes from what this module validates."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import fields
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exporter.defaults import default_path
from exporter.errors import ConfigError, UnknownFamilyError
from exporter.labels import LABEL_NAME_RE, label_name_problem
from exporter.rank_catalog import (
    DEFAULT_PROFILE,
    RANK_CATALOGS,
    BuiltFamily,
    FamilyLookup,
    MetricType,
    bucket_layout_problem,
    preset_label_sets,
)


class Semantics(str, Enum):
    """How a family's per-rank values combine into a rollup."""

    PER_SHARD = "per_shard"
    REPLICATED = "replicated"
    # Only the engine's own process (one per replica: LMCache's role="scheduler") counts it, the
    # others report 0 or nothing: summed over ranks like per_shard, so each engine counts once.
    PER_ENGINE = "per_engine"


class Collector(str, Enum):
    """SGLang 0.5.23's collectors (the sglang profile's streams), by the names its hook and proxy use.

    A profile names its own collectors in its `streams:` table; these are the default profile's.
    """

    RADIX = "radix"
    STORAGE = "storage"
    SCHEDULER = "scheduler"


class FamilySpec(BaseModel):
    """One metric family as ranks push it (names are without the namespace)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=LABEL_NAME_RE.pattern)
    type: MetricType
    semantics: Semantics
    help: str = Field(min_length=1)
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] | None = None
    preset: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    attempt_level: bool = False
    duration_histogram: str | None = None
    # Which engine collector emits the family (a key of its profile's `streams:`); None for an
    # operator's family that names none.
    # SGLang's collector names read as Collector members (left to right), another profile's as strings.
    collector: Collector | str | None = Field(None, union_mode="left_to_right")
    # The released engine does not emit this family (the exporter's own addition).
    beyond_upstream: bool = False
    # The engine profile the family belongs to: its exported names take that profile's namespace.
    profile: str = Field(DEFAULT_PROFILE, pattern=LABEL_NAME_RE.pattern)
    # The profile's table (documentation): which of the engine's roles emit it, the multiprocess mode
    # the engine gives a gauge, and where in the released code its meaning is settled (file:line).
    roles: tuple[str, ...] = ()
    multiprocess_mode: Literal["all", "liveall", "livesum", "max", "livemax", "min", "livemin", "sum",
                               "mostrecent", "livemostrecent"] | None = None
    evidence: str | None = None

    @field_validator("labels")
    @classmethod
    def _labels_are_usable(cls, labels: tuple[str, ...]) -> tuple[str, ...]:
        for name in labels:
            problem = label_name_problem(name)
            if problem:
                raise ValueError(problem)
        if len(set(labels)) != len(labels):
            raise ValueError(f"labels repeat a name: {list(labels)}")
        return labels

    @model_validator(mode="after")
    def _shape_matches_type(self) -> FamilySpec:
        if self.type is MetricType.HISTOGRAM:
            if not self.buckets:
                raise ValueError(f"histogram {self.name!r} needs `buckets`")
            problem = bucket_layout_problem(self.buckets)
            if problem:
                raise ValueError(f"histogram {self.name!r}: {problem}")
        elif self.buckets is not None:
            raise ValueError(f"{self.type.value} {self.name!r} cannot have `buckets`")
        if self.type is MetricType.COUNTER and not self.name.endswith("_total"):
            raise ValueError(f"counter {self.name!r} must end in '_total'")
        # A gauge may (LMCache's periodic_threads_*_total are gauges); a histogram's samples would clash.
        if self.type is MetricType.HISTOGRAM and self.name.endswith("_total"):
            raise ValueError(f"{self.type.value} {self.name!r} must not end in '_total'")
        unknown = set(self.preset) - set(self.labels)
        if unknown:
            raise ValueError(f"{self.name!r}: preset names labels it does not have: {sorted(unknown)}")
        for label, values in self.preset.items():
            if not values or len(set(values)) != len(values):
                raise ValueError(f"{self.name!r}: preset {label!r} must list distinct values")
        if self.duration_histogram is not None:
            if self.type is not MetricType.COUNTER or not self.name.endswith("_bytes_total"):
                raise ValueError(
                    f"{self.name!r}: only a '*_bytes_total' counter can name a duration_histogram"
                )
        return self

    @property
    def bandwidth_name(self) -> str:
        """Name of the active-bandwidth gauge derived from this bytes counter."""
        return self.name[: -len("_bytes_total")] + "_active_bandwidth_bytes_per_second"

    @property
    def base_name(self) -> str:
        """Name without the counter's `_total` suffix."""
        return self.name[: -len("_total")] if self.name.endswith("_total") else self.name

    def exported_name(self, prefix: str) -> str:
        """The exported family name under `prefix`, as prometheus_client names it: a counter's without
        its `_total` suffix, which its samples (and the 0.0.4 HELP and TYPE lines) add."""
        return prefix + (self.base_name if self.type is MetricType.COUNTER else self.name)

    @property
    def replicated(self) -> bool:
        """Every replica of a dp group counts it alike (tokens, requests): one replica per group counts."""
        return self.semantics is Semantics.REPLICATED

    @property
    def replicated_counter(self) -> bool:
        """A replicated counter: what the replica spread compares and the one-replica-per-group rates read."""
        return self.type is MetricType.COUNTER and self.replicated

    @property
    def per_shard(self) -> bool:
        """The ranks add up: each counts its own shard (bytes, time), or only the engine's own process counts."""
        return self.semantics is not Semantics.REPLICATED

    def preset_label_sets(self) -> list[dict[str, str]]:
        """Label sets to create at 0 on every rank: the cross product of `preset`, if it covers all labels."""
        return preset_label_sets(self.labels, self.preset)


class StreamSpec(BaseModel):
    """One engine collector as a stream of a rank: the label that marks its identities, the labels that
    only it adds (they tell streams of one rank apart, not servers), and which tp rank it labels."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    marker: str = Field(pattern=LABEL_NAME_RE.pattern)
    labels: tuple[str, ...] = ()
    # attention: tp_rank is the rank within its dp group (and cp rank); global: the engine's tp rank,
    # mapped to its position through the server's world.
    tp_rank: Literal["attention", "global"] = "attention"

    @model_validator(mode="after")
    def _marker_is_its_own(self) -> StreamSpec:
        if self.marker not in self.labels:
            raise ValueError(f"stream marker {self.marker!r} must be one of its labels {list(self.labels)}")
        return self


# SGLang 0.5.23's collectors (metrics_collector.py:2416, 2197, 1380-1394; see the catalog header).
DEFAULT_STREAMS: dict[str, StreamSpec] = {
    Collector.RADIX.value: StreamSpec(marker="cache_type", labels=("cache_type",)),
    Collector.STORAGE.value: StreamSpec(marker="storage_backend", labels=("storage_backend", "pp_size", "attn_cp_size")),
    Collector.SCHEDULER.value: StreamSpec(marker="engine_type", labels=("model_name", "engine_type", "priority"),
                                          tp_rank="global"),
}


Tier = Literal["L1", "L2", "L3"]


class TransferSpec(BaseModel):
    """One movement of KV data between two cache tiers (L1 device, L2 host, L3 storage or remote), and the
    families that count it: its logical tokens, its physical bytes and the seconds it took (each optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=LABEL_NAME_RE.pattern)
    source: Tier  # the tier the data leaves
    target: Tier  # the tier it arrives in
    tokens: str | None = None
    bytes: str | None = None
    seconds: str | None = None  # a histogram of the transfers' durations, in seconds
    label: str | None = Field(None, min_length=1)  # how people name it, where that is not its name's words

    @property
    def title(self) -> str:
        """Its name for people: `label`, else its name's words (`remote_read`: remote read)."""
        return self.label or self.name.replace("_", " ")

    @property
    def tiers(self) -> str:
        """`L2→L1`: where the data leaves and arrives."""
        return f"{self.source}→{self.target}"

    def families(self) -> tuple[str, ...]:
        """The families it names, tokens, bytes, then seconds."""
        return tuple(name for name in (self.tokens, self.bytes, self.seconds) if name is not None)


# Where each cache tier of a hierarchy sits: hits served from device memory, host memory or storage, and
# `offload`, the hits of every tier past the device where a profile's families cannot tell host from storage.
PREFILL_TIERS: tuple[tuple[Literal["device", "host", "storage"], Tier], ...] = (
    ("device", "L1"), ("host", "L2"), ("storage", "L3"))
PrefillKind = Literal["prompt", "computed", "device", "host", "storage", "offload"]


class TokenCount(BaseModel):
    """One kind of prefill token as a profile counts it: a counter family and, where one family counts
    several kinds, the value of its label that counts this one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: str
    label: str | None = Field(None, pattern=LABEL_NAME_RE.pattern)
    value: str | None = None

    @model_validator(mode="after")
    def _label_with_value(self) -> TokenCount:
        if (self.label is None) != (self.value is None):
            raise ValueError(f"prefill count {self.family!r}: give both `label` and `value`, or neither")
        return self


class PrefillSpec(BaseModel):
    """Where a profile counts its prefill tokens by the tier that served them (DESIGN section 18). Either
    every kind is counted, computed among them (the prompt is their sum: SGLang), or the prompt is counted
    apart and what it leaves after the hits was computed (LMCache). The tiers past the device are `host`
    and `storage`, or `offload` where the families cannot tell them apart."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: TokenCount | None = None
    computed: TokenCount | None = None
    device: TokenCount
    host: TokenCount | None = None
    storage: TokenCount | None = None
    offload: TokenCount | None = None

    @model_validator(mode="after")
    def _one_shape(self) -> PrefillSpec:
        if (self.prompt is None) == (self.computed is None):
            raise ValueError("prefill: give `computed` (every kind counted) or `prompt` (computed is what it "
                             "leaves after the hits), not both or neither")
        if not ((self.host is not None and self.storage is not None and self.offload is None)
                or (self.host is None and self.storage is None and self.offload is not None)):
            raise ValueError("prefill: give `host` and `storage`, or `offload` where the engine cannot tell them apart")
        by_family: dict[str, list[TokenCount]] = {}
        for count in self.counts().values():
            by_family.setdefault(count.family, []).append(count)
        for family, counts in by_family.items():
            # One family counting two kinds must tell them apart by one label, each kind its own value.
            if len(counts) > 1 and (len({(c.label, c.value) for c in counts}) < len(counts)
                                    or len({c.label for c in counts}) > 1 or counts[0].label is None):
                raise ValueError(f"prefill: {family!r} counts several kinds: give each the same `label` and its "
                                 "own `value`")
        return self

    def counts(self) -> dict[PrefillKind, TokenCount]:
        """Every kind it counts, by kind: the prompt or computed, then the tiers' hits, device first."""
        kinds: tuple[PrefillKind, ...] = ("prompt", "computed", "device", "host", "storage", "offload")
        return {kind: count for kind in kinds if (count := getattr(self, kind)) is not None}

    def tiers(self) -> tuple[tuple[Literal["device", "host", "storage", "offload"], Tier], ...]:
        """Its hit tiers and where each sits, device first: `offload` is read back from L2 (as a storage hit
        is staged through host memory)."""
        return PREFILL_TIERS if self.offload is None else (("device", "L1"), ("offload", "L2"))

    def returned(self, tier: str) -> tuple[PrefillKind, ...]:
        """The kinds of hits a tier returns toward the device: its own and those of every tier below it, which
        are staged through it (a storage hit is prefetched into host memory and loaded back from there,
        sglang 0.5.23 schedule_batch.py:231-265), so the tier's reads and fills are paid by all of them."""
        kinds = [kind for kind, _ in self.tiers()]
        return tuple(kinds[kinds.index(tier):])  # type: ignore[arg-type]  # a tier name of tiers()

    @property
    def apart(self) -> bool:
        """Whether its families tell host hits from storage hits."""
        return self.offload is None


SPREAD_THRESHOLD = 0.2  # the default: a replica group whose spread ratio is above it is diverging


def dp_attention_by_sizes(tp_size: int, dp_size: int, attn_cp_size: int, attn_tp_size: int) -> bool:
    """SGLang's sizes of DP attention: the dp groups share one tp group, so the engine's tp size spans every
    dp group's attention ranks (tp = dp x cp x attention tp). The one statement of it (the core's layouts
    and a profile's rule read it)."""
    return dp_size > 1 and tp_size == dp_size * attn_cp_size * attn_tp_size


class ProfileSpec(BaseModel):
    """An engine profile's own facts (DESIGN section 14): its name, exported namespace, the prefix of
    its names on the engine's /metrics, how a series' labels name its rank, and its static labels."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=LABEL_NAME_RE.pattern)
    # Exported names are namespace + family name (the sglang profile's: metrics.namespace).
    namespace: str = Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    # The engine's own prefix on its /metrics and multiprocess files: an upstream's default `prefix`.
    upstream_prefix: str = Field(pattern=r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
    # None: a series names its rank with the rank axes (tp_rank, pp_rank, dp_rank, attn_cp_rank).
    # A label name: that one label holds the replica-local rank, laid out as vLLM lays out its
    # workers, (pp_rank * cp_size + cp_rank) * tp_size + tp_rank, and dp_rank is not labelled.
    linear_rank_label: str | None = Field(None, pattern=LABEL_NAME_RE.pattern)
    # Labels that are functions of the rank (SGLang's moe_ep_rank, LMCache's worker_id): kept on the
    # per-rank series, left out of replica groups and rollups (which would count a group once per value).
    derived_labels: tuple[str, ...] = ()
    # The labels the engine puts on every series besides the rank's (documentation, and a start-up check).
    static_labels: tuple[str, ...] = ()
    # Its tier transfers, in the order views list them (a transfer whose families a trimmed profile file
    # leaves out is not shown).
    transfers: tuple[TransferSpec, ...] = ()
    # Above this spread ratio the replicas of a group disagree (the status document's `diverging`, the
    # HiCacheReplicaSpreadHigh alert, the dashboard's note).
    spread_threshold: float = Field(SPREAD_THRESHOLD, gt=0, le=1)
    # How a world of dp_size > 1 says DP attention (the dp groups sharing one tp group): "sizes", when the
    # engine's tp size spans every dp group's attention ranks (SGLang: tp = dp x cp x attention tp);
    # "never", for an engine whose data-parallel replicas each have their own tp group (vLLM).
    dp_attention: Literal["sizes", "never"] = "sizes"
    # Where its prefill tokens are counted by the tier that served them; None: its families cannot say.
    prefill: PrefillSpec | None = None

    def tier_transfers(self, tier: Tier) -> tuple[TransferSpec | None, TransferSpec | None]:
        """The transfers that serve a hit in `tier` and that keep it filled: a hit in L<k> is read to the tier
        above it (L<k> to L<k-1>), and the tier is filled from that one (L<k-1> to L<k>). (None, None) for L1."""
        level = int(tier[1])
        if level == 1:
            return None, None
        above = f"L{level - 1}"
        read = next((t for t in self.transfers if t.source == tier and t.target == above), None)
        fill = next((t for t in self.transfers if t.source == above and t.target == tier), None)
        return read, fill

    def world_problem(self, dp_size: int, dp_attention: bool = False) -> str | None:
        """Why an upstream of this profile cannot be given a world of `dp_size` replicas (with DP attention
        or not), or None: a profile whose series label no replica (a linear rank label) reads the replicas
        merged, as one; a profile whose engine has no DP attention cannot be told it runs it."""
        if self.linear_rank_label is not None and dp_size > 1:
            return (f"profile {self.name!r} labels no data-parallel replica, so its replicas read as one engine here "
                    "(their sum); give world dp_size 1, or push through the hook, which tells replicas apart")
        if dp_attention and self.dp_attention == "never":
            return (f"profile {self.name!r} has no DP attention (each data-parallel replica of its engine has its "
                    "own tp group): drop dp_attention from its world")
        return None

    @model_validator(mode="after")
    def _linear_rank_is_derived(self) -> ProfileSpec:
        if self.linear_rank_label is not None and self.linear_rank_label not in self.derived_labels:
            raise ValueError(f"linear_rank_label {self.linear_rank_label!r} must be one of derived_labels "
                             "(it differs between the replicas of a group)")
        names = [transfer.name for transfer in self.transfers]
        if len(set(names)) != len(names):
            raise ValueError(f"transfers repeat a name: {names}")
        return self


# SGLang 0.5.23 HiCache's four movements between its tiers (L1 device, L2 host, L3 storage).
SGLANG_TRANSFERS = (
    TransferSpec(name="load_back", source="L2", target="L1", tokens="load_back_tokens_total",
                 bytes="load_back_bytes_total", seconds="load_back_duration_seconds", label="load-back"),
    TransferSpec(name="backup", source="L1", target="L2", tokens="hicache_backup_tokens_total",
                 bytes="hicache_backup_bytes_total", seconds="hicache_backup_duration_seconds"),
    TransferSpec(name="prefetch", source="L3", target="L2", tokens="prefetched_tokens_total",
                 bytes="storage_prefetch_bytes_total", seconds="storage_prefetch_duration_seconds"),
    TransferSpec(name="storage_backup", source="L2", target="L3", tokens="backuped_tokens_total",
                 bytes="storage_backup_bytes_total", seconds="storage_backup_duration_seconds", label="backup"),
)
# The scheduler's final per-tier count (schedule_policy.py:975-983): `input` is what was computed.
SGLANG_PREFILL = PrefillSpec(**{kind: TokenCount(family="prefill_effective_tokens_total", label="mode", value=value)
                                for kind, value in (("computed", "input"), ("device", "device_hit"),
                                                    ("host", "host_hit"), ("storage", "storage_hit"))})
SGLANG_PROFILE = ProfileSpec(name=DEFAULT_PROFILE, namespace="sglang_", upstream_prefix="sglang:",
                             derived_labels=("moe_ep_rank",), transfers=SGLANG_TRANSFERS, prefill=SGLANG_PREFILL)


class Catalog(BaseModel, FamilyLookup[FamilySpec]):
    """The validated set of families; look families up by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    families: tuple[FamilySpec, ...] = Field(min_length=1)
    # How a rank's streams are told apart from its server (DESIGN section 13), by collector name.
    streams: dict[str, StreamSpec] = Field(default_factory=lambda: dict(DEFAULT_STREAMS))
    # The engine profiles whose families these are, the default (first) one first.
    profiles: dict[str, ProfileSpec] = Field(default_factory=lambda: {DEFAULT_PROFILE: SGLANG_PROFILE}, min_length=1)
    # How the config named a profile given as a file (its path) -> the profile's name.
    aliases: dict[str, str] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _families_are_consistent(self) -> Catalog:
        markers = [spec.marker for spec in self.streams.values()]
        if len(set(markers)) != len(markers):
            raise ValueError(f"stream markers must differ: {markers}")
        for key, profile in self.profiles.items():
            if key != profile.name:
                raise ValueError(f"profile {key!r} is named {profile.name!r}")
        names = [f.name for f in self.families]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"families defined twice (two profiles in use may not share a family name): {repeated}")
        for fam in self.families:
            if fam.profile not in self.profiles:
                raise ValueError(f"{fam.name!r}: profile {fam.profile!r} is not one of {list(self.profiles)}")
            if fam.collector is not None and fam.collector not in self.streams:
                raise ValueError(f"{fam.name!r}: collector {fam.collector!r} is not in `streams:` {list(self.streams)}")
        by_name = {f.name: f for f in self.families}
        for profile in self.profiles.values():
            for transfer in profile.transfers:
                for name, kind in ((transfer.tokens, MetricType.COUNTER), (transfer.bytes, MetricType.COUNTER),
                                   (transfer.seconds, MetricType.HISTOGRAM)):
                    named = by_name.get(name) if name is not None else None
                    if named is not None and named.type is not kind:  # absent: a trimmed profile file
                        raise ValueError(f"transfer {transfer.name!r}: {name!r} is a {named.type.value}, not a {kind.value}")
            for count in () if profile.prefill is None else profile.prefill.counts().values():
                named = by_name.get(count.family)  # absent: a trimmed profile file
                if named is not None and (named.type is not MetricType.COUNTER
                                          or (count.label is not None and count.label not in named.labels)):
                    labelled = "" if count.label is None else f" labelled {count.label!r}"
                    raise ValueError(f"prefill: {count.family!r} must be a counter{labelled}")
        for fam in self.families:
            if fam.duration_histogram is None:
                continue
            hist = by_name.get(fam.duration_histogram)
            if hist is None or hist.type is not MetricType.HISTOGRAM:
                raise ValueError(
                    f"{fam.name!r}: duration_histogram {fam.duration_histogram!r} is not a histogram family"
                )
            if hist.labels != fam.labels or hist.semantics is not fam.semantics:
                raise ValueError(
                    f"{fam.name!r} and {hist.name!r} must have the same labels and semantics"
                )
            if hist.collector != fam.collector:
                raise ValueError(
                    f"{fam.name!r} and {hist.name!r} must come from the same collector (their series pair by labels)"
                )
        return self

    @property
    def index(self) -> dict[str, FamilySpec]:
        """The families by name, made on first use (the families are not changed after validation)."""
        index = self.__dict__.get("_cached_index")
        if index is None:
            index = {f.name: f for f in self.families}
            object.__setattr__(self, "_cached_index", index)
        return index

    # BaseModel iterates a model's fields: a catalog iterates its families (FamilyLookup's).
    __iter__ = FamilyLookup.__iter__  # type: ignore[assignment]

    def for_collector(self, collector: str) -> Catalog:
        """The families one collector emits, as a catalog of their own (for that collector's client)."""
        wanted = str(collector.value if isinstance(collector, Collector) else collector)
        if wanted not in self.streams:
            raise ValueError(f"no collector {wanted!r} in `streams:` ({', '.join(self.streams)})")
        families = tuple(f for f in self.families if f.collector == wanted)
        if not families:
            raise UnknownFamilyError(f"no family in the metric catalog is emitted by the {wanted!r} collector")
        return Catalog(families=families, streams=self.streams, profiles=self.profiles)

    @property
    def default_profile(self) -> ProfileSpec:
        """The first profile: the one metrics.namespace, metrics.catalog and upstreams without `profile` mean."""
        return next(iter(self.profiles.values()))

    @property
    def derived_labels(self) -> frozenset[str]:
        """Every profile's derived labels (a rank's identity keeps them; its replica group does not)."""
        return frozenset(label for profile in self.profiles.values() for label in profile.derived_labels)

    def namespace_of(self, spec: FamilySpec, default_namespace: str | None = None) -> str:
        """The exported prefix of `spec`: its profile's namespace (`default_namespace` for the default profile)."""
        return self.profile_namespace(spec.profile, default_namespace)

    def profile_namespace(self, name: str, default_namespace: str | None = None) -> str:
        """The exported prefix of profile `name` (`default_namespace`, metrics.namespace, for the default profile)."""
        if default_namespace is not None and name == self.default_profile.name:
            return default_namespace
        return self.profiles[name].namespace

    def of_profile(self, name: str) -> Catalog:
        """The families of one profile (by name, or by the file the config named), as a catalog of their own."""
        name = self.aliases.get(name, name)
        if name not in self.profiles:
            raise UnknownFamilyError(f"profile {name!r} is not in use (in use: {', '.join(self.profiles)})")
        families = tuple(f for f in self.families if f.profile == name)
        streams = {key: spec for key, spec in self.streams.items()
                   if any(f.collector == key for f in families)} or dict(self.streams)
        return Catalog(families=families, streams=streams, profiles={name: self.profiles[name]})

    @classmethod
    def merged(cls, catalogs: Sequence[Catalog]) -> Catalog:
        """Several profiles' catalogs as one (the first is the default); ConfigError names what clashes."""
        profiles: dict[str, ProfileSpec] = {}
        streams: dict[str, StreamSpec] = {}
        families: list[FamilySpec] = []
        for catalog in catalogs:
            for name, profile in catalog.profiles.items():
                if name in profiles:
                    raise ConfigError(f"profile {name!r} is given twice")
                profiles[name] = profile
            for key, stream in catalog.streams.items():
                if key in streams and streams[key] != stream:
                    raise ConfigError(f"two profiles define the stream {key!r} differently")
                streams[key] = stream
            families.extend(catalog.families)
        try:
            return cls(families=tuple(families), streams=streams, profiles=profiles)
        except ValidationError as err:
            raise ConfigError(format_validation_error(err, "profiles in use")) from None

    def transfers(self) -> list[tuple[ProfileSpec, TransferSpec]]:
        """Every profile's tier transfers that have a family in the catalog, by profile, each with its profile."""
        return [(profile, transfer) for profile in self.profiles.values() for transfer in profile.transfers
                if transfer.tokens in self or transfer.bytes in self]

    def prefills(self) -> list[tuple[ProfileSpec, PrefillSpec]]:
        """Every profile in use that counts prefill tokens by tier, with its spec, the default profile first (a
        trimmed profile file that leaves out one of its counts does not)."""
        return [(profile, spec) for profile in self.profiles.values() if (spec := profile.prefill) is not None
                and all(count.family in self for count in spec.counts().values())]

    def prefill(self) -> tuple[ProfileSpec, PrefillSpec] | None:
        """The first of `prefills()`; None if no profile in use counts prefill tokens by tier."""
        found = self.prefills()
        return found[0] if found else None

    def bandwidth_pairs(self) -> list[tuple[FamilySpec, FamilySpec]]:
        """(bytes counter, duration histogram) pairs that get active-bandwidth gauges."""
        return [(f, self.get(f.duration_histogram)) for f in self.families if f.duration_histogram]


def format_validation_error(err: ValidationError, source: str, within: str = "") -> str:
    """One line per problem, each naming the field path (under `within`, where the model sits), for a person to fix."""
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for problem in err.errors():
        loc = ".".join(str(part) for part in ((within,) if within else ()) + tuple(problem["loc"])) or "(top level)"
        lines.append(f"  {loc}: {problem['msg']}")
    return "\n".join(lines)


def catalog_from_data(data: Any, source: str = "catalog") -> Catalog:
    """Validate parsed YAML as one profile's catalog, dropping `x-` keys that hold YAML anchors.

    Its `profile:` (default: the sglang profile) names every family's profile."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a `families` list")
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    try:
        profile = ProfileSpec.model_validate(data.pop("profile")) if "profile" in data else SGLANG_PROFILE
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source, "profile")) from None
    try:
        families = data.get("families")
        if isinstance(families, list):
            data["families"] = [{**f, "profile": profile.name} if isinstance(f, dict) else f for f in families]
        data["profiles"] = {profile.name: profile}
        return Catalog.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, source)) from None


def load_yaml(path: Path) -> Any:
    """Parse a YAML file, turning I/O and syntax errors into ConfigError."""
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except OSError as err:
        raise ConfigError(f"cannot read {path}: {err.strerror}") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: invalid YAML: {err}") from None


def load_catalog(path: Path | str | None = None) -> Catalog:
    """Load the catalog at `path`, or the packaged default (the sglang profile)."""
    resolved = Path(path) if path is not None else default_path("catalog.yaml")
    return catalog_from_data(load_yaml(resolved), str(resolved))


# Profiles shipped with the sidecar, by name: their catalog files in exporter/defaults.
PACKAGED_PROFILES = {DEFAULT_PROFILE: "catalog.yaml", "lmcache": "lmcache.yaml"}


def load_profile(name_or_path: str | Path) -> Catalog:
    """One profile's catalog: a packaged profile by name (sglang, lmcache) or a profile YAML file."""
    if str(name_or_path) in PACKAGED_PROFILES:
        return load_catalog(default_path(PACKAGED_PROFILES[str(name_or_path)]))
    if not Path(name_or_path).exists():
        raise ConfigError(f"profile {str(name_or_path)!r} is neither a packaged profile "
                          f"({', '.join(PACKAGED_PROFILES)}) nor a profile file")
    return load_catalog(name_or_path)


def load_profiles(default_catalog_path: Path | str | None, others: Sequence[str | Path]) -> Catalog:
    """The catalog of every profile in use: the default profile's (metrics.catalog) first, then `others`."""
    first = load_catalog(default_catalog_path)
    loaded = {str(other): load_profile(other) for other in others if str(other) != first.default_profile.name}
    if not loaded:
        return first
    merged = Catalog.merged([first, *loaded.values()])
    aliases = {ref: catalog.default_profile.name for ref, catalog in loaded.items()
               if ref != catalog.default_profile.name}
    return merged.model_copy(update={"aliases": aliases}) if aliases else merged


_default_catalog: Catalog | None = None


def default_catalog() -> Catalog:
    """The packaged catalog, parsed once per process."""
    global _default_catalog
    if _default_catalog is None:
        _default_catalog = load_catalog()
    return _default_catalog


def rank_catalogs_text() -> str:
    """exporter/defaults/rank_catalogs.json as the packaged YAML gives it: each packaged profile's families,
    one a line, with the fields a rank reads (exporter.rank_catalog.BuiltFamily's)."""
    wanted = {f.name for f in fields(BuiltFamily)}
    profiles = [f"  {json.dumps(name)}: [\n"
                + ",\n".join(f"   {json.dumps(spec.model_dump(mode='json', include=wanted))}" for spec in load_profile(name))
                + "\n  ]"
                for name in PACKAGED_PROFILES]
    note = "written by `python -m exporter.catalog` from the packaged profiles' YAML: do not edit"
    return '{"generated": ' + json.dumps(note) + ',\n "profiles": {\n' + ",\n".join(profiles) + "\n }\n}\n"


def main() -> None:
    """`python -m exporter.catalog`: write the packaged profiles' pre-built catalogs (run it after editing their YAML)."""
    path = default_path(RANK_CATALOGS)
    path.write_text(rank_catalogs_text(), encoding="utf-8")
    print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
    main()
