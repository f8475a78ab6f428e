"""The metric catalog: family types, labels, semantics and buckets, loaded from YAML and validated."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from enum import Enum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from exporter.defaults import default_path
from exporter.errors import ConfigError, UnknownFamilyError
from exporter.labels import LABEL_NAME_RE, label_name_problem


class MetricType(str, Enum):
    """Prometheus metric types a family can have."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class Semantics(str, Enum):
    """How a family's per-rank values combine into a rollup."""

    PER_SHARD = "per_shard"
    REPLICATED = "replicated"


class Collector(str, Enum):
    """The engine collector that emits a family, which fixes the family's rank label set.

    A rank process pushes each collector's families over a connection of its own, since each
    collector labels its series differently (see the catalog header).
    """

    RADIX = "radix"
    STORAGE = "storage"
    SCHEDULER = "scheduler"


def bucket_layout_problem(bounds: Sequence[float]) -> str | None:
    """Why `bounds` cannot be a histogram's finite upper bounds (+Inf implied), or None: they must be
    finite and strictly ascending. The one check of a layout, wherever one enters."""
    if not all(math.isfinite(b) for b in bounds):
        return "buckets must be finite (+Inf is implied)"
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        return "buckets must be strictly ascending"
    return None


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
    # Which engine collector emits the family; None for an operator's family that names none.
    collector: Collector | None = None
    # The released engine does not emit this family (the exporter's own addition).
    beyond_upstream: bool = False

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
        if self.type is not MetricType.COUNTER and self.name.endswith("_total"):
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
    def per_shard(self) -> bool:
        """Each rank counts its own shard (bytes, time): the ranks add up."""
        return self.semantics is Semantics.PER_SHARD

    def preset_label_sets(self) -> list[dict[str, str]]:
        """Label sets to create at 0 on every rank: the cross product of `preset`, if it covers all labels."""
        if not self.labels or set(self.preset) != set(self.labels):
            return [] if self.labels else [{}]
        combos: list[dict[str, str]] = [{}]
        for label in self.labels:
            combos = [{**c, label: v} for c in combos for v in self.preset[label]]
        return combos


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
DEFAULT_STREAMS: dict[Collector, StreamSpec] = {
    Collector.RADIX: StreamSpec(marker="cache_type", labels=("cache_type",)),
    Collector.STORAGE: StreamSpec(marker="storage_backend", labels=("storage_backend", "pp_size", "attn_cp_size")),
    Collector.SCHEDULER: StreamSpec(marker="engine_type", labels=("model_name", "engine_type", "priority"),
                                    tp_rank="global"),
}


class Catalog(BaseModel):
    """The validated set of families; look families up by name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    families: tuple[FamilySpec, ...] = Field(min_length=1)
    # How a rank's streams are told apart from its server (DESIGN section 13).
    streams: dict[Collector, StreamSpec] = Field(default_factory=lambda: dict(DEFAULT_STREAMS))

    @model_validator(mode="after")
    def _families_are_consistent(self) -> Catalog:
        markers = [spec.marker for spec in self.streams.values()]
        if len(set(markers)) != len(markers):
            raise ValueError(f"stream markers must differ: {markers}")
        names = [f.name for f in self.families]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"families defined twice: {repeated}")
        by_name = {f.name: f for f in self.families}
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
            if hist.collector is not fam.collector:
                raise ValueError(
                    f"{fam.name!r} and {hist.name!r} must come from the same collector (their series pair by labels)"
                )
        return self

    def __iter__(self) -> Iterator[FamilySpec]:  # type: ignore[override]
        return iter(self.families)

    def __len__(self) -> int:
        return len(self.families)

    def __contains__(self, name: object) -> bool:
        return name in self._index

    def get(self, name: str) -> FamilySpec:
        """The family called `name`; raises UnknownFamilyError naming the catalog's families."""
        try:
            return self._index[name]
        except KeyError:
            raise UnknownFamilyError(
                f"family {name!r} is not in the metric catalog (known: {', '.join(sorted(self._index))})"
            ) from None

    def find(self, name: str) -> FamilySpec | None:
        """The family called `name`, or None."""
        return self._index.get(name)

    @property
    def _index(self) -> dict[str, FamilySpec]:
        index = self.__dict__.get("_cached_index")
        if index is None:
            index = {f.name: f for f in self.families}
            object.__setattr__(self, "_cached_index", index)
        return index

    def for_collector(self, collector: Collector | str) -> Catalog:
        """The families one collector emits, as a catalog of their own (for that collector's client)."""
        wanted = Collector(collector)
        families = tuple(f for f in self.families if f.collector is wanted)
        if not families:
            raise UnknownFamilyError(f"no family in the metric catalog is emitted by the {wanted.value!r} collector")
        return Catalog(families=families, streams=self.streams)

    def bandwidth_pairs(self) -> list[tuple[FamilySpec, FamilySpec]]:
        """(bytes counter, duration histogram) pairs that get active-bandwidth gauges."""
        return [(f, self.get(f.duration_histogram)) for f in self.families if f.duration_histogram]

    def static_label_conflicts(self, names: set[str]) -> set[str]:
        """Static label names that collide with a family's own labels."""
        return names & {label for fam in self.families for label in fam.labels}


def format_validation_error(err: ValidationError, source: str) -> str:
    """One line per problem, each naming the field path, for a person to fix."""
    lines = [f"{source}: {err.error_count()} problem(s)"]
    for problem in err.errors():
        loc = ".".join(str(part) for part in problem["loc"]) or "(top level)"
        lines.append(f"  {loc}: {problem['msg']}")
    return "\n".join(lines)


def catalog_from_data(data: Any, source: str = "catalog") -> Catalog:
    """Validate parsed YAML as a catalog, dropping `x-` keys that hold YAML anchors."""
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: expected a mapping with a `families` list")
    data = {k: v for k, v in data.items() if not str(k).startswith("x-")}
    try:
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
    """Load the catalog at `path`, or the packaged default."""
    resolved = Path(path) if path is not None else default_path("catalog.yaml")
    return catalog_from_data(load_yaml(resolved), str(resolved))


_default_catalog: Catalog | None = None


def default_catalog() -> Catalog:
    """The packaged catalog, parsed once per process."""
    global _default_catalog
    if _default_catalog is None:
        _default_catalog = load_catalog()
    return _default_catalog
