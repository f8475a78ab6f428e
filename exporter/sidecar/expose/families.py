"""Every family the sidecar exposes, defined once: exported name, type and help text.

Names follow prometheus_client's convention: a counter's name is given without `_total`
(FamilySpec.exported_name), which its samples (and the 0.0.4 text format's HELP and TYPE lines)
add: `value_sample_name` is the one place that adds it.
"""

from __future__ import annotations

from dataclasses import dataclass

from exporter.catalog import Catalog, MetricType, Semantics
from exporter.errors import ConfigError

SELF = "hicache_exporter_"
ROLLUP_HELP = {
    Semantics.PER_SHARD: "Sum over all ranks (per-shard quantity). ",
    Semantics.REPLICATED: "Furthest replica of each dp replica group, summed over groups (logically replicated quantity). ",
    Semantics.PER_ENGINE: "Sum over all ranks, where only each engine's own process counts (per-engine quantity). ",
}


def value_sample_name(name: str, kind: str) -> str:
    """The name of a counter's or gauge's value samples, from its family's name and type: a
    counter's add `_total`, which its family's name leaves out (FamilySpec.exported_name)."""
    return name + "_total" if kind == MetricType.COUNTER.value else name


@dataclass(frozen=True, slots=True)
class Family:
    """One exposed family: name (counters without `_total`), Prometheus type and HELP text."""

    name: str
    type: str
    help: str

    @property
    def sample_name(self) -> str:
        """The name of its value samples (a counter's with `_total`)."""
        return value_sample_name(self.name, self.type)


SELF_FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family(SELF + "build_info", "gauge", "Version, git revision and Python version of the running sidecar (value is always 1)."),
    Family(SELF + "ranks", "gauge", "Rank identities the sidecar knows, by status."),
    Family(SELF + "ranks_missing", "gauge", (
        "Ranks (positions) of a dp group that the server's world expects and no unexpired stream reports for; "
        "by the server's labels and dp_rank, for servers with an expected world.")),
    Family(SELF + "rank_up", "gauge", "1 while the rank is connected and pushing, else 0."),
    Family(SELF + "rank_last_push_timestamp_seconds", "gauge", "Wall-clock time of the rank's last snapshot."),
    Family(SELF + "rank_restarts", "counter", "Process restarts (new epochs) seen for the rank."),
    Family(SELF + "connections", "gauge", "Open rank connections."),
    Family(SELF + "connections_accepted", "counter", "Rank connections accepted."),
    Family(SELF + "frames_received", "counter", "Frames received from ranks."),
    Family(SELF + "snapshots_received", "counter", "Snapshot frames received from ranks."),
    Family(SELF + "snapshots_applied", "counter", "Snapshots applied to rank state."),
    Family(SELF + "samples_applied", "counter", "Samples applied to rank state."),
    Family(SELF + "rejections", "counter", "Frames, hellos, snapshots and samples refused, by reason."),
    Family(SELF + "rollup_layout_conflicts", "counter",
           "Rank histogram series left out of their rollup because their bucket layout differs from the rollup's, by family."),
    Family(SELF + "upstream_up", "gauge", "1 when the last read of the upstream succeeded, else 0."),
    Family(SELF + "upstream_last_scrape_timestamp_seconds", "gauge", "Wall-clock time of the upstream's last successful read."),
    Family(SELF + "upstream_scrape_duration_seconds", "gauge", "Seconds the upstream's last read took."),
    Family(SELF + "upstream_samples", "gauge", "Samples in the upstream's last successful read."),
    Family(SELF + "upstream_scrape_errors", "counter", "Failed or partly refused reads of the upstream, by kind."),
    Family(SELF + "upstream_unranked_families", "gauge",
           "1 for a catalog family whose upstream series carry no rank labels: summed over ranks upstream, not rolled up."),
    Family(SELF + "upstream_cp_colliding_families", "gauge",
           "1 for a catalog family whose context-parallel peers share one label set upstream (summed there): not rolled up."),
    Family(SELF + "upstream_series_resets", "counter",
           "Counters and histograms of the upstream read lower than the read before: each a restart of that series."),
    Family(SELF + "upstream_series_flapping", "gauge",
           "Series of the upstream that went down more than twice within 5 minutes (two engines behind one URL, "
           "or a broken engine): they count only above their highest value."),
    Family(SELF + "persistence_load_failures", "counter",
           "State files that could not be used at start (set aside as FILE.corrupt-<time>; the sidecar started fresh), "
           "by reason."),
    Family(SELF + "persistence_write_failures", "counter", "Writes of the state file that failed, by reason."),
    Family(SELF + "persistence_dropped_series", "counter",
           "Series of the state file left out at load (the catalog or namespace changed, or a limit), by reason."),
    Family(SELF + "persistence_writes", "counter", "Successful writes of the state file."),
    Family(SELF + "persistence_last_write_timestamp_seconds", "gauge",
           "Wall-clock time of the last successful write of the state file (written only when the state changed)."),
    Family(SELF + "persistence_write_duration_seconds", "gauge",
           "Seconds the last successful write took (encoding on the event loop, then the atomic write)."),
    Family(SELF + "persistence_file_bytes", "gauge", "Size of the state file last written or loaded."),
    Family(SELF + "persistence_load_duration_seconds", "gauge",
           "Seconds the load of the state file at start took (read, check, decode, take back)."),
    Family(SELF + "persistence_loaded_identities", "gauge", "Rank identities taken back from the state file at start."),
    Family(SELF + "scrape_duration_seconds", "histogram", "Time to render /metrics."),
    Family(SELF + "ingest_duration_seconds", "histogram", "Time to apply one snapshot."),
)}


class ExposedFamilies:
    """The catalog-derived families, each under its profile's namespace: per rank, rollups, bandwidth and spread."""

    def __init__(self, catalog: Catalog, namespace: str) -> None:
        self.namespace = namespace  # the default profile's (metrics.namespace)
        prefix = {spec.name: catalog.namespace_of(spec, namespace) for spec in catalog}
        self.per_rank = {spec.name: Family(spec.exported_name(prefix[spec.name]), spec.type.value, spec.help)
                         for spec in catalog}
        self.rollup = {
            spec.name: Family(spec.exported_name(prefix[spec.name] + "rollup_"), spec.type.value,
                              ROLLUP_HELP[spec.semantics] + spec.help)
            for spec in catalog
        }
        self.bandwidth: dict[str, tuple[Family, Family]] = {}
        for bytes_spec, _ in catalog.bandwidth_pairs():
            help_text = (
                f"Active bandwidth of {bytes_spec.name}: byte increase over the window divided by the "
                "increase of its duration histogram's sum (idle time excluded); absent without transfers."
            )
            own = prefix[bytes_spec.name]
            self.bandwidth[bytes_spec.name] = (
                Family(own + bytes_spec.bandwidth_name, "gauge", help_text),
                Family(own + "rollup_" + bytes_spec.bandwidth_name, "gauge", "Rolled up: " + help_text),
            )
        self.spread = {
            spec.name: Family(
                prefix[spec.name] + spec.base_name + "_replica_spread_ratio", "gauge",
                f"How far live replicas' increases of {spec.name} over the window disagree: (max - min) / max.",
            )
            for spec in catalog if spec.replicated_counter
        }
        self._refuse_clashes()

    def _refuse_clashes(self) -> None:
        """ConfigError where two exposed families would write one sample name (two profiles' names, or a
        namespace that makes a family's name the sidecar's own): Prometheus would refuse the whole scrape."""
        families = [*self.per_rank.values(), *self.rollup.values(), *self.spread.values(),
                    *(f for pair in self.bandwidth.values() for f in pair), *SELF_FAMILIES.values()]
        seen: dict[str, str] = {}
        clashes: list[str] = []
        for family in families:
            for name in {family.name, family.sample_name}:
                if name in seen and seen[name] != family.name:
                    clashes.append(f"{seen[name]} and {family.name}")
                elif name in seen:
                    clashes.append(family.name)
                seen.setdefault(name, family.name)
        if clashes:
            raise ConfigError(f"exported names clash ({', '.join(sorted(set(clashes))[:3])}): give the profiles "
                              "namespaces and family names that no other family of the sidecar writes")
