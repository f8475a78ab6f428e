"""Kubernetes manifests in config/k8s: schema-valid, and saying what the sidecar needs.

Core kinds are validated by `kubernetes-validate` (strict: unknown fields fail) against the
newest Kubernetes it knows. The Prometheus Operator kinds (PodMonitor, PrometheusRule) are
CRDs it has no schema for, so their structure is checked here.
"""

from __future__ import annotations

import copy
import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "config" / "k8s"
PROMETHEUS = ROOT / "config" / "prometheus"
GENERATOR = K8S / "generate_prometheusrule.py"
EXPORTER = "hicache-exporter"
MONITORING = "monitoring.coreos.com/v1"
UID = 65532


# --- loading ---------------------------------------------------------------------------------

def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.iterdir() if p.suffix in {".yaml", ".yml"})


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"{path.name} holds no manifest"
    return docs


def all_documents() -> Iterator[tuple[str, dict[str, Any]]]:
    for path in manifest_files():
        for doc in documents(path):
            yield path.name, doc


def deployments() -> list[tuple[str, dict[str, Any]]]:
    return [(name, d) for name, d in all_documents() if d.get("kind") == "Deployment"]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    return deployment["spec"]["template"]["spec"]


def exporter_container(spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) if c["name"] == EXPORTER]
    assert len(found) == 1, f"one initContainers entry named {EXPORTER!r} (a native sidecar)"
    assert not [c for c in spec["containers"] if c["name"] == EXPORTER], "the exporter is not a regular container"
    return found[0]


def rank_containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [c for c in spec["containers"] if any(e.get("name") == "HICACHE_EXPORTER_SOCKET" for e in c.get("env", []))]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("generate_prometheusrule", GENERATOR)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_expected_files_exist() -> None:
    names = {p.name for p in manifest_files()}
    assert {"deployment.yaml", "podmonitor.yaml", "annotations-scrape.yaml"} <= names
    assert GENERATOR.is_file()


# --- schema validation -------------------------------------------------------------------------

@pytest.mark.parametrize("path", manifest_files(), ids=lambda p: p.name)
def test_core_kinds_validate_against_kubernetes_schema(path: Path) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 33), \
        f"kubernetes-validate knows only up to {version}; native sidecars are GA in 1.33"
    problems = []
    for doc in documents(path):
        assert isinstance(doc.get("apiVersion"), str) and isinstance(doc.get("kind"), str), path.name
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # CRDs: checked below
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            problems.append(f"{path.name}: {doc['kind']}/{doc['metadata'].get('name')}: "
                            f"{'.'.join(str(p) for p in err.path)}: {err.message}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_kubernetes_validate_rejects_unknown_fields() -> None:
    """Strict validation is really on: a misspelt field fails."""
    import kubernetes_validate

    _, deployment = deployments()[0]
    broken = copy.deepcopy(deployment)
    exporter_container(pod_spec(broken))["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, kubernetes_validate.latest_version(), strict=True)


# PodMonitor / PrometheusRule fields (prometheus-operator v1 CRDs), to catch misspellings.
POD_MONITOR_SPEC_KEYS = {
    "selector", "podMetricsEndpoints", "namespaceSelector", "jobLabel", "podTargetLabels", "sampleLimit",
    "targetLimit", "labelLimit", "labelNameLengthLimit", "labelValueLengthLimit", "keepDroppedTargets",
    "attachMetadata", "scrapeProtocols", "fallbackScrapeProtocol", "scrapeClass", "selectorMechanism",
    "bodySizeLimit", "nativeHistogramBucketLimit", "nativeHistogramMinBucketFactor",
    "scrapeClassicHistograms", "convertClassicHistogramsToNHCB",
}
POD_METRICS_ENDPOINT_KEYS = {
    "port", "portNumber", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout",
    "honorLabels", "honorTimestamps", "trackTimestampsStaleness", "metricRelabelings", "relabelings",
    "proxyUrl", "noProxy", "proxyFromEnvironment", "proxyConnectHeader", "basicAuth", "bearerTokenSecret",
    "authorization", "oauth2", "tlsConfig", "followRedirects", "enableHttp2", "filterRunning",
}
RULE_GROUP_KEYS = {"name", "interval", "rules", "limit", "query_offset", "partial_response_strategy", "labels"}
RULE_KEYS = {"record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations"}
DURATION = r"^(\d+(ms|s|m|h|d|w|y))+$"


def check_metadata(doc: dict[str, Any], where: str) -> None:
    meta = doc.get("metadata")
    assert isinstance(meta, dict) and isinstance(meta.get("name"), str) and meta["name"], f"{where}: metadata.name"
    for key in ("labels", "annotations"):
        assert all(isinstance(v, str) for v in (meta.get(key) or {}).values()), f"{where}: {key} values are strings"


def check_pod_monitor(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == MONITORING and doc["kind"] == "PodMonitor"
    check_metadata(doc, "PodMonitor")
    spec = doc["spec"]
    assert set(spec) <= POD_MONITOR_SPEC_KEYS, f"unknown PodMonitor spec keys {set(spec) - POD_MONITOR_SPEC_KEYS}"
    assert isinstance(spec["selector"].get("matchLabels"), dict) and spec["selector"]["matchLabels"]
    endpoints = spec["podMetricsEndpoints"]
    assert isinstance(endpoints, list) and endpoints
    for ep in endpoints:
        assert set(ep) <= POD_METRICS_ENDPOINT_KEYS, f"unknown podMetricsEndpoints keys {set(ep) - POD_METRICS_ENDPOINT_KEYS}"
        for key in ("interval", "scrapeTimeout"):
            if key in ep:
                assert re.match(DURATION, ep[key]), f"{key}: {ep[key]!r} is not a Prometheus duration"


def check_prometheus_rule(doc: dict[str, Any]) -> None:
    assert doc["apiVersion"] == MONITORING and doc["kind"] == "PrometheusRule"
    check_metadata(doc, "PrometheusRule")
    assert set(doc["spec"]) == {"groups"}
    groups = doc["spec"]["groups"]
    assert isinstance(groups, list) and groups
    names = [g["name"] for g in groups]
    assert len(names) == len(set(names)), "group names must be unique"
    for group in groups:
        assert set(group) <= RULE_GROUP_KEYS and isinstance(group["name"], str)
        assert isinstance(group["rules"], list) and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= RULE_KEYS, f"{group['name']}: unknown rule keys {set(rule) - RULE_KEYS}"
            assert ("record" in rule) != ("alert" in rule), f"{group['name']}: record xor alert"
            assert isinstance(rule["expr"], str) and rule["expr"].strip()


def test_crds_are_well_formed() -> None:
    kinds = []
    for _name, doc in all_documents():
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kinds.append(doc["kind"])
            {"PodMonitor": check_pod_monitor, "PrometheusRule": check_prometheus_rule}[doc["kind"]](doc)
    assert "PodMonitor" in kinds


# --- the pod ---------------------------------------------------------------------------------

def test_every_deployment_carries_the_exporter() -> None:
    found = deployments()
    assert {name for name, _ in found} == {"deployment.yaml", "annotations-scrape.yaml"}


@pytest.mark.parametrize("name,deployment", deployments(), ids=[n for n, _ in deployments()])
class TestPod:
    def test_exporter_is_a_native_sidecar(self, name: str, deployment: dict[str, Any]) -> None:
        spec = pod_spec(deployment)
        container = exporter_container(spec)
        assert container.get("restartPolicy") == "Always", "a native sidecar: initContainers + restartPolicy Always"
        assert spec.get("restartPolicy", "Always") == "Always"

    def test_probes_use_health_routes_never_metrics(self, name: str, deployment: dict[str, Any]) -> None:
        container = exporter_container(pod_spec(deployment))
        port_names = {p.get("name") for p in container["ports"]} | {p["containerPort"] for p in container["ports"]}
        expected = {"startupProbe": "/-/healthy", "livenessProbe": "/-/healthy", "readinessProbe": "/-/ready"}
        for probe, path in expected.items():
            assert probe in container, f"{probe} is missing"
            http = container[probe].get("httpGet")
            assert http, f"{probe} must be an httpGet probe"
            assert http["path"] == path, f"{probe} must GET {path}, not {http['path']}"
            assert http["port"] in port_names
        for spec in (pod_spec(deployment).get("initContainers", []) + pod_spec(deployment)["containers"]):
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = ((spec.get(probe) or {}).get("httpGet") or {}).get("path", "")
                assert not path.startswith("/metrics"), f"{spec['name']}.{probe} must never hit /metrics"

    def test_metrics_port(self, name: str, deployment: dict[str, Any]) -> None:
        container = exporter_container(pod_spec(deployment))
        ports = {p.get("name"): p for p in container["ports"]}
        assert ports["metrics"]["containerPort"] == 9400
        assert ports["metrics"].get("protocol", "TCP") == "TCP"

    def test_restricted_security_context(self, name: str, deployment: dict[str, Any]) -> None:
        spec = pod_spec(deployment)
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True
        assert pod["runAsUser"] == UID and pod["runAsGroup"] == UID, "numeric uid/gid 65532, as the image's USER"
        assert pod["fsGroup"] == UID, "fsGroup makes the shared socket group-accessible"
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        sc = exporter_container(spec)["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert isinstance(sc["runAsUser"], int) and sc["runAsUser"] == UID
        assert isinstance(sc["runAsGroup"], int) and sc["runAsGroup"] == UID
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["capabilities"]["drop"] == ["ALL"] and not sc["capabilities"].get("add")
        assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        assert "privileged" not in sc or sc["privileged"] is False
        # Pod Security "restricted" applies to every container.
        for container in spec["containers"] + spec.get("initContainers", []):
            csc = container.get("securityContext", {})
            assert csc.get("allowPrivilegeEscalation") is False, f"{container['name']}: allowPrivilegeEscalation"
            assert csc.get("capabilities", {}).get("drop") == ["ALL"], f"{container['name']}: drop ALL"
            assert csc.get("runAsNonRoot", pod["runAsNonRoot"]) is True
            assert csc.get("runAsUser", pod["runAsUser"]) != 0
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key)

    def test_resources_are_small_and_bounded(self, name: str, deployment: dict[str, Any]) -> None:
        resources = exporter_container(pod_spec(deployment))["resources"]

        def mebibytes(quantity: str) -> float:
            number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
            return int(number) * {"Ki": 1 / 1024, "Mi": 1, "Gi": 1024}[unit]

        cpu = resources["requests"]["cpu"]
        assert re.fullmatch(r"\d+m", cpu) and int(cpu[:-1]) <= 100, f"cpu request {cpu}: keep the sidecar small"
        assert mebibytes(resources["requests"]["memory"]) <= 128
        limit = mebibytes(resources["limits"]["memory"])
        assert mebibytes(resources["requests"]["memory"]) <= limit <= 512, "a bounded memory limit"

    def test_socket_is_shared_through_a_memory_emptydir(self, name: str, deployment: dict[str, Any]) -> None:
        spec = pod_spec(deployment)
        exporter = exporter_container(spec)
        ranks = rank_containers(spec)
        assert ranks, "a rank container sets HICACHE_EXPORTER_SOCKET"
        volumes = {v["name"]: v for v in spec["volumes"]}
        for rank in ranks:
            socket = next(e["value"] for e in rank["env"] if e["name"] == "HICACHE_EXPORTER_SOCKET")
            assert socket == "/run/hicache/metrics.sock"
            socket_dir = str(PurePosixPath(socket).parent)
            mounts_r = {m["mountPath"]: m["name"] for m in rank["volumeMounts"]}
            mounts_e = {m["mountPath"]: m["name"] for m in exporter["volumeMounts"]}
            assert socket_dir in mounts_r and socket_dir in mounts_e, "both containers mount the socket directory"
            assert mounts_r[socket_dir] == mounts_e[socket_dir], "the same volume in both containers"
            volume = volumes[mounts_e[socket_dir]]
            assert set(volume) == {"name", "emptyDir"}, "the socket volume is an emptyDir"
            assert volume["emptyDir"]["medium"] == "Memory"
            limit = volume["emptyDir"]["sizeLimit"]
            assert limit.endswith(("Ki", "Mi")) and int(limit[:-2]) <= (64 if limit.endswith("Mi") else 65536)
            for m in exporter["volumeMounts"] + rank["volumeMounts"]:
                if m["mountPath"] == socket_dir:
                    assert not m.get("readOnly"), "the socket directory must be writable"
            # The sidecar's config puts its socket at the same path.
            assert sidecar_config(deployment, name).ingest.socket_path == PurePosixPath(socket)

    def test_config_map_is_mounted_read_only_and_passed_with_flag(self, name: str, deployment: dict[str, Any]) -> None:
        spec = pod_spec(deployment)
        exporter = exporter_container(spec)
        args = exporter.get("args", [])
        assert "command" not in exporter, "keep the image's ENTRYPOINT; pass arguments only"
        assert args[0] == "serve" and "--config" in args
        config_path = PurePosixPath(args[args.index("--config") + 1])
        mount = next(m for m in exporter["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
        assert mount.get("readOnly") is True
        volume = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        cm_name = volume["configMap"]["name"]
        config_maps = {d["metadata"]["name"]: d for _, d in all_documents_in(name) if d["kind"] == "ConfigMap"}
        assert cm_name in config_maps, f"{name} defines the ConfigMap {cm_name}"
        key = str(config_path.relative_to(mount["mountPath"]))
        assert key in config_maps[cm_name]["data"]

    def test_config_is_valid_for_the_sidecar(self, name: str, deployment: dict[str, Any]) -> None:
        config = sidecar_config(deployment, name)
        port = next(p["containerPort"] for p in exporter_container(pod_spec(deployment))["ports"] if p["name"] == "metrics")
        assert config.http.port == port
        assert config.ingest.socket_mode & 0o060 == 0o060, "group (fsGroup) must be able to connect"
        assert config.ingest.socket_mode & 0o007 == 0, "others must not"
        assert config.ingest.allowed_uids in (None, (UID,))

    def test_no_token_and_labels_match_selector(self, name: str, deployment: dict[str, Any]) -> None:
        spec = pod_spec(deployment)
        assert spec.get("automountServiceAccountToken") is False
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()


def all_documents_in(file_name: str) -> list[tuple[str, dict[str, Any]]]:
    return [(file_name, d) for d in documents(K8S / file_name)]


def sidecar_config(deployment: dict[str, Any], file_name: str):  # -> SidecarConfig
    """The ConfigMap's sidecar config, validated by the sidecar's own strict loader."""
    from exporter.config import config_from_data

    exporter = exporter_container(pod_spec(deployment))
    args = exporter["args"]
    config_path = PurePosixPath(args[args.index("--config") + 1])
    mount = next(m for m in exporter["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
    volume = next(v for v in pod_spec(deployment)["volumes"] if v["name"] == mount["name"])
    cm = next(d for _, d in all_documents_in(file_name)
              if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    text = cm["data"][str(config_path.relative_to(mount["mountPath"]))]
    return config_from_data(yaml.safe_load(text), f"{file_name}: ConfigMap {cm['metadata']['name']}")


def test_the_exporter_image_runs_serve_with_the_cli_flags() -> None:
    """The container's args parse with the real command line."""
    from exporter.cli import build_parser

    for _, deployment in deployments():
        args = build_parser().parse_args(exporter_container(pod_spec(deployment))["args"])
        assert args.command == "serve" and args.config is not None


def test_annotations_variant_differs_only_by_the_annotations() -> None:
    base = {d["kind"]: d for d in documents(K8S / "deployment.yaml")}
    variant = {d["kind"]: d for d in documents(K8S / "annotations-scrape.yaml")}
    assert set(base) == set(variant) == {"ConfigMap", "Deployment"}
    assert yaml.safe_load(base["ConfigMap"]["data"]["sidecar.yaml"]) == \
        yaml.safe_load(variant["ConfigMap"]["data"]["sidecar.yaml"])
    annotations = variant["Deployment"]["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/metrics"}
    stripped = copy.deepcopy(variant["Deployment"])
    del stripped["spec"]["template"]["metadata"]["annotations"]
    assert stripped == base["Deployment"], "annotations-scrape.yaml's Deployment drifted from deployment.yaml's"
    # The annotated port is the sidecar's metrics port, not the inference server's.
    port = next(p["containerPort"] for p in exporter_container(pod_spec(base["Deployment"]))["ports"])
    assert annotations["prometheus.io/port"] == str(port)


def test_pod_monitor_selects_the_pods_and_scrapes_the_sidecar() -> None:
    (monitor,) = documents(K8S / "podmonitor.yaml")
    check_pod_monitor(monitor)
    (_, deployment) = next((n, d) for n, d in deployments() if n == "deployment.yaml")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    port_names = {p["name"] for p in exporter_container(pod_spec(deployment))["ports"]}
    assert endpoint["port"] == "metrics" and endpoint["port"] in port_names
    assert endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "15s"


# --- PrometheusRule generation ---------------------------------------------------------------

RECORDING = """\
groups:
  - name: g-record
    interval: 30s
    rules:
      - record: cluster:sglang_load_back_bytes:rate5m
        expr: sum without (instance, pod, tp_rank, pp_rank, attn_cp_rank, dp_rank) (rate(sglang_load_back_bytes_total[5m]))
      - record: dp_group:sglang_load_back_tokens:rate5m
        expr: |
          max without (instance, pod, tp_rank, pp_rank, attn_cp_rank) (
            rate(sglang_load_back_tokens_total[5m])
          )
"""
ALERTING = """\
groups:
  - name: g-alert
    rules:
      - alert: HiCacheRankDown
        expr: hicache_exporter_rank_up == 0
        for: 5m
        labels: {severity: warning}
        annotations:
          summary: "rank {{ $labels.tp_rank }} is down"
          description: >-
            folded text: with a colon
            and a second line
"""


def write_rules(directory: Path, recording: str = RECORDING, alerting: str = ALERTING) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "recording_rules.yml").write_text(recording, encoding="utf-8")
    (directory / "alerting_rules.yml").write_text(alerting, encoding="utf-8")
    return directory


def test_generator_copies_groups_in_order(tmp_path: Path) -> None:
    gen = load_generator()
    text = gen.generate(write_rules(tmp_path))
    assert text.startswith("# GENERATED")
    (doc,) = [d for d in yaml.safe_load_all(text) if d]
    check_prometheus_rule(doc)
    expected = yaml.safe_load(RECORDING)["groups"] + yaml.safe_load(ALERTING)["groups"]
    assert doc["spec"]["groups"] == expected
    assert "expr: |" in text, "multi-line PromQL stays a readable block"


def test_generator_is_deterministic_and_checkable(tmp_path: Path) -> None:
    gen = load_generator()
    rules = write_rules(tmp_path / "rules")
    out = tmp_path / "prometheusrule.yaml"
    assert gen.main(["--prometheus-dir", str(rules), "--output", str(out)]) == 0
    first = out.read_bytes()
    assert gen.main(["--prometheus-dir", str(rules), "--output", str(out)]) == 0
    assert out.read_bytes() == first
    assert gen.main(["--prometheus-dir", str(rules), "--output", str(out), "--check"]) == 0
    write_rules(rules, alerting=ALERTING.replace("for: 5m", "for: 10m"))
    assert gen.main(["--prometheus-dir", str(rules), "--output", str(out), "--check"]) == 1


@pytest.mark.parametrize("recording,alerting,message", [
    (RECORDING, RECORDING, "unique"),
    ("groups: [{name: a, rules: [{record: x, alert: y, expr: '1'}]}]", ALERTING, "exactly one"),
    ("groups: [{name: a, rules: [{record: x}]}]", ALERTING, "expr"),
    ("groups: [{name: a, rules: [{record: x, expr: '1', bogus: 1}]}]", ALERTING, "unknown keys"),
    ("groups: [{name: a, rules: []}]", ALERTING, "non-empty"),
    ("rules: []", ALERTING, "groups"),
])
def test_generator_refuses_malformed_rules(tmp_path: Path, recording: str, alerting: str, message: str) -> None:
    gen = load_generator()
    with pytest.raises(gen.GenerateError, match=message):
        gen.generate(write_rules(tmp_path, recording, alerting))


def test_generator_names_a_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gen = load_generator()
    (tmp_path / "recording_rules.yml").write_text(RECORDING, encoding="utf-8")
    assert gen.main(["--prometheus-dir", str(tmp_path), "--output", str(tmp_path / "out.yaml")]) == 2
    assert "alerting_rules.yml" in capsys.readouterr().err


def test_prometheusrule_is_generated_from_the_current_rules() -> None:
    assert (PROMETHEUS / "recording_rules.yml").is_file(), "the recording rules ship with the repository"
    gen = load_generator()
    expected = gen.generate(PROMETHEUS)
    target = K8S / "prometheusrule.yaml"
    assert target.is_file(), "run: python config/k8s/generate_prometheusrule.py"
    assert target.read_text(encoding="utf-8") == expected, \
        "config/k8s/prometheusrule.yaml is stale: run python config/k8s/generate_prometheusrule.py"
    (doc,) = [d for d in yaml.safe_load_all(expected) if d]
    check_prometheus_rule(doc)
    sources = [yaml.safe_load((PROMETHEUS / f).read_text(encoding="utf-8")) for f in gen.RULE_FILES]
    assert doc["spec"]["groups"] == [g for source in sources for g in source["groups"]], \
        "the PrometheusRule holds exactly the rule files' groups, in order"
