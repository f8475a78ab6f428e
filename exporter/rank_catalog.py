"""The metric catalog as a rank reads it: the packaged profiles pre-built from their YAML, and the rules
that both sides apply, each written once.

Imported by the rank client and the engine integrations, so it imports nothing heavy (no pydantic, yaml
or aiohttp; `make lint`'s import contracts keep it so). The sidecar validates the YAML (exporter.catalog,
which takes MetricType and these rules from here); `python -m exporter.catalog` writes what it validated
into exporter/defaults/rank_catalogs.json, and a test fails, naming that command, when the two differ.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any, Generic, Protocol, TypeVar

from exporter.defaults import default_path
from exporter.errors import UnknownFamilyError

DEFAULT_PROFILE = "sglang"
# The pre-built catalogs of the packaged profiles, in exporter/defaults (package data).
RANK_CATALOGS = "rank_catalogs.json"


class MetricType(str, Enum):
    """Prometheus metric types a family can have."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


def bucket_layout_problem(bounds: Sequence[float]) -> str | None:
    """Why `bounds` cannot be a histogram's finite upper bounds (+Inf implied), or None: they must be
    finite and strictly ascending. The one check of a layout, wherever one enters."""
    if not all(math.isfinite(b) for b in bounds):
        return "buckets must be finite (+Inf is implied)"
    if any(a >= b for a, b in zip(bounds, bounds[1:])):
        return "buckets must be strictly ascending"
    return None


def preset_label_sets(labels: Sequence[str], preset: Mapping[str, Sequence[str]]) -> list[dict[str, str]]:
    """Label sets to create at 0 on every rank: the cross product of `preset`, if it covers all `labels`."""
    if not labels or set(preset) != set(labels):
        return [] if labels else [{}]
    combos: list[dict[str, str]] = [{}]
    for label in labels:
        combos = [{**c, label: v} for c in combos for v in preset[label]]
    return combos


def engine_family_name(name: str, prefix: str, kind: MetricType) -> str | None:
    """The catalog name of an engine's metric `name` (`prefix` + family, a counter's with or without
    `_total`, which prometheus_client adds); None when it lacks the prefix."""
    if not name.startswith(prefix):
        return None
    family = name[len(prefix):]
    if kind is MetricType.COUNTER and not family.endswith("_total"):
        family += "_total"
    return family


def unknown_family(name: str, known: Iterable[str]) -> UnknownFamilyError:
    """The error for a family outside the catalog, naming the catalog's families."""
    return UnknownFamilyError(f"family {name!r} is not in the metric catalog (known: {', '.join(sorted(known))})")


class RankFamily(Protocol):
    """What a rank's client reads of a family: a pre-built one, or the sidecar's validated FamilySpec."""

    @property
    def name(self) -> str: ...
    @property
    def type(self) -> MetricType: ...
    @property
    def labels(self) -> tuple[str, ...]: ...
    @property
    def buckets(self) -> tuple[float, ...] | None: ...
    @property
    def preset(self) -> Mapping[str, tuple[str, ...]]: ...
    @property
    def collector(self) -> str | None: ...

    def preset_label_sets(self) -> list[dict[str, str]]: ...


class RankCatalog(Protocol):
    """What a rank's client reads of a catalog: a pre-built one, or the sidecar's validated Catalog."""

    def __iter__(self) -> Iterator[RankFamily]: ...
    def get(self, name: str) -> RankFamily: ...
    def static_label_conflicts(self, names: set[str]) -> set[str]: ...


@dataclass(frozen=True, slots=True)
class BuiltFamily:
    """One family of a pre-built catalog: the fields a rank reads, as the sidecar validated them."""

    name: str
    type: MetricType
    labels: tuple[str, ...]
    buckets: tuple[float, ...] | None
    preset: Mapping[str, tuple[str, ...]]
    collector: str | None  # the engine collector that emits it (a key of its profile's `streams:`)

    @classmethod
    def from_data(cls, data: Mapping[str, Any]) -> BuiltFamily:
        """A family as `python -m exporter.catalog` wrote it (JSON: lists for tuples)."""
        buckets = data["buckets"]
        return cls(name=data["name"], type=MetricType(data["type"]), labels=tuple(data["labels"]),
                   buckets=None if buckets is None else tuple(float(b) for b in buckets),
                   preset={label: tuple(values) for label, values in data["preset"].items()},
                   collector=data["collector"])

    def preset_label_sets(self) -> list[dict[str, str]]:
        """Label sets to create at 0 on every rank (see `preset_label_sets`)."""
        return preset_label_sets(self.labels, self.preset)


F = TypeVar("F", bound=RankFamily)


class FamilyLookup(Generic[F]):
    """Families looked up by name: what the pre-built and the validated catalog answer alike."""

    families: Sequence[F]

    @property
    def index(self) -> Mapping[str, F]:
        """The families by name (each catalog keeps its own)."""
        raise NotImplementedError

    def __iter__(self) -> Iterator[F]:
        return iter(self.families)

    def __len__(self) -> int:
        return len(self.families)

    def __contains__(self, name: object) -> bool:
        return name in self.index

    def get(self, name: str) -> F:
        """The family called `name`; raises UnknownFamilyError naming the catalog's families."""
        try:
            return self.index[name]
        except KeyError:
            raise unknown_family(name, self.index) from None

    def find(self, name: str) -> F | None:
        """The family called `name`, or None."""
        return self.index.get(name)

    def held(self, name: str | None) -> str | None:
        """`name` where the catalog holds that family; None for no name or one a trimmed profile file leaves out."""
        return name if name is not None and name in self.index else None

    def engine_family(self, name: str, prefix: str, kind: MetricType) -> F | None:
        """The family an engine's metric `name` (`prefix` + family, as the engine builds it; a counter's
        with or without `_total`, which prometheus_client adds) is, whatever its type; None outside both."""
        family = engine_family_name(name, prefix, kind)
        return None if family is None else self.find(family)

    def static_label_conflicts(self, names: set[str]) -> set[str]:
        """Static label names that collide with a family's own labels."""
        return names & {label for fam in self.families for label in fam.labels}


class BuiltCatalog(FamilyLookup[BuiltFamily]):
    """One packaged profile's families, pre-built; look families up by name."""

    def __init__(self, families: Sequence[BuiltFamily]) -> None:
        self.families = tuple(families)
        self._by_name = {f.name: f for f in self.families}

    @property
    def index(self) -> Mapping[str, BuiltFamily]:
        return self._by_name


_built: dict[str, BuiltCatalog] | None = None


def built_catalog(profile: str = DEFAULT_PROFILE) -> BuiltCatalog:
    """A packaged profile's pre-built catalog (sglang, lmcache), read once per process."""
    global _built
    if _built is None:
        data = json.loads(default_path(RANK_CATALOGS).read_text(encoding="utf-8"))
        # Assigned whole: a thread that finds it set finds every profile in it.
        _built = {name: BuiltCatalog([BuiltFamily.from_data(f) for f in families])
                  for name, families in data["profiles"].items()}
    try:
        return _built[profile]
    except KeyError:
        raise UnknownFamilyError(f"no packaged profile {profile!r} (packaged: {', '.join(_built)})") from None


_unreadable: list[str] = []  # why the packaged catalogs could not be read, once said


def packaged_engine_family(profile: str, name: str, prefix: str, kind: MetricType) -> BuiltFamily | None:
    """`built_catalog(profile).engine_family(...)` for code that runs inside an engine, which must never raise
    into it: None when the packaged catalogs cannot be read (a broken install), said once per process, so
    the engine's own metric stays and its /metrics serves it."""
    try:
        catalog = built_catalog(profile)
    except Exception as err:
        if not _unreadable:
            _unreadable.append(f"{type(err).__name__}: {err}")
            logging.getLogger("hicache_exporter").warning(
                "hicache-exporter: its packaged catalogs could not be read (%s); nothing is pushed, the engine's "
                "/metrics serves its metrics (reinstall the package)", _unreadable[0])
        return None
    return catalog.engine_family(name, prefix, kind)
