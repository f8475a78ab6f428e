"""The Kubernetes examples in config/k8s: schema-valid, and what an engine pod (SGLang, or vLLM with
LMCache) with the sidecar needs.

Schemas: core kinds by `kubernetes-validate` (strict: unknown fields fail) against the newest
Kubernetes it knows; PodMonitor and PrometheusRule by the Prometheus Operator's CRD models of
`cloudcoil-models-prometheus-operator` (pydantic, generated from the operator's CRDs: patterns,
enums and types), loaded and dumped back so that a field the model does not know shows up as a
difference; the LeaderWorkerSet's spec by an excerpt of its CRD's schema vendored in
tests/deploy/schemas/ and its pod templates as Pods by kubernetes-validate. The two patch files
are applied to their bases with strategic-merge rules and the result is validated like the rest.
"""

from __future__ import annotations

import ast
import copy
import json
import re
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from functools import cache
from pathlib import Path, PurePosixPath
from typing import Any

import jsonschema
import pytest
import yaml

from config.generator import DEFAULT_NAMESPACE, manifests, outputs

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "config" / "k8s"
LWS_SCHEMA = Path(__file__).resolve().parent / "schemas" / "leaderworkerset-v1.json"
EXPORTER = "hicache-exporter"
MONITORING = "monitoring.coreos.com/v1"
UID = 65532
PATCHES = {"annotations-scrape.yaml": "deployment.yaml", "proxy-multiprocess-dir.yaml": "proxy.yaml"}
# The environment LeaderWorkerSet's pod webhook sets in every container (lws pkg/utils/pod AddLWSVariables).
LWS_ENV = {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"}


# --- loading ---------------------------------------------------------------------------------

def manifest_files() -> list[Path]:
    return sorted(p for p in K8S.iterdir() if p.suffix in {".yaml", ".yml"})


def documents(path: Path) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d is not None]
    assert docs, f"{path.name} holds no manifest"
    return docs


@cache
def generated(namespace: str) -> dict[str, list[dict[str, Any]]]:
    """The k8s documents the generator makes for `namespace`, by file name."""
    return {rel.removeprefix("k8s/"): [d for d in yaml.safe_load_all(text) if d is not None]
            for rel, text in outputs(namespace).items() if rel.startswith("k8s/")}


NAMESPACES = [DEFAULT_NAMESPACE, "sglang:"]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (found,) = [d for d in docs if d["kind"] == kind]
    return found


# Strategic merge: lists of these fields merge item by item on the key, as the API server merges them.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort"}


def strategic_merge(base: Any, patch: Any, field: str = "") -> Any:
    """`patch` applied to `base` by strategic-merge rules (maps merged, keyed lists merged, other lists replaced)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        merged = dict(base)
        for key, value in patch.items():
            merged[key] = strategic_merge(base[key], value, key) if key in base else copy.deepcopy(value)
        return merged
    if isinstance(base, list) and isinstance(patch, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        merged_list = [copy.deepcopy(item) for item in base]
        for item in patch:
            index = next((i for i, old in enumerate(merged_list) if old[key] == item[key]), None)
            if index is None:
                merged_list.append(copy.deepcopy(item))
            else:
                merged_list[index] = strategic_merge(merged_list[index], item)
        return merged_list
    return copy.deepcopy(patch)


def patched(name: str, namespace: str = DEFAULT_NAMESPACE) -> list[dict[str, Any]]:
    """The base file's documents with the patch `name` applied to the object it names."""
    (patch,) = generated(namespace)[name]
    out = []
    for doc in generated(namespace)[PATCHES[name]]:
        if doc["kind"] == patch["kind"] and doc["metadata"]["name"] == patch["metadata"]["name"]:
            doc = strategic_merge(doc, patch)
        out.append(doc)
    return out


def pod_templates(namespace: str = DEFAULT_NAMESPACE) -> Iterator[tuple[str, dict[str, Any], list[dict[str, Any]]]]:
    """(where, pod template, the file's documents) for every example pod, patched variants included."""
    files = {name: docs for name, docs in generated(namespace).items() if name not in PATCHES}
    files.update({f"{name} on {PATCHES[name]}": patched(name, namespace) for name in PATCHES})
    for name, docs in files.items():
        for doc in docs:
            if doc["kind"] == "Deployment":
                yield name, doc["spec"]["template"], docs
            elif doc["kind"] == "LeaderWorkerSet":
                for role in ("leaderTemplate", "workerTemplate"):
                    yield f"{name} {role}", doc["spec"]["leaderWorkerTemplate"][role], docs


POD_IDS = [where for where, _, _ in pod_templates()]


def exporter_container(spec: dict[str, Any]) -> dict[str, Any]:
    found = [c for c in spec.get("initContainers", []) if c["name"] == EXPORTER]
    assert len(found) == 1, f"one initContainers entry named {EXPORTER!r} (a native sidecar)"
    assert not [c for c in spec["containers"] if c["name"] == EXPORTER], "the exporter is not a regular container"
    return found[0]


def engine_container(spec: dict[str, Any]) -> dict[str, Any]:
    """The pod's one regular container: the engine, SGLang or vLLM."""
    (engine,) = spec["containers"]
    assert engine["name"] in {"sglang", "vllm"}
    return engine


def is_vllm(spec: dict[str, Any]) -> bool:
    return engine_container(spec)["name"] == "vllm"


def env(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container.get("env", [])}


def lws_variables(where: str) -> dict[str, str]:
    """What LWS's pod webhook adds to the env of every container of the example's pod (lws.yaml's group of
    two: the leader is worker index 0, the worker 1); nothing outside a LeaderWorkerSet."""
    if not where.startswith("lws.yaml"):
        return {}
    index = "0" if "leaderTemplate" in where else "1"
    return {"LWS_LEADER_ADDRESS": "sglang-lws-0.sglang-lws.default", "LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": index}


def expanded(args: list[str], variables: dict[str, str]) -> list[str]:
    """`args` as the kubelet passes them: $(VAR) replaced for every VAR in the container's env, `$$` an
    escaped `$`, and a reference to an undefined variable left as it is."""
    def one(match: re.Match[str]) -> str:
        name = match.group(1)
        if name is None:
            return "$"
        return variables.get(name, match.group(0))

    return [re.sub(r"\$\$|\$\((\w+)\)", one, arg) for arg in args]


def effective_config(where: str, template: dict[str, Any], docs: list[dict[str, Any]], tmp_path: Path):  # -> SidecarConfig
    """The config the sidecar runs with: its ConfigMap's file under its flags, loaded as `serve` loads it."""
    from exporter.cli import build_parser, per_upstream, upstream_worlds
    from exporter.config import load_config

    sidecar_config(template, docs)  # the file alone, strictly
    sidecar = exporter_container(template["spec"])
    args = build_parser().parse_args(sidecar_argv(where, sidecar))
    config_file = tmp_path / "sidecar.yaml"
    config_file.write_text(config_map_text(template, docs), encoding="utf-8")
    return load_config(config_file, env={}, port=args.port, host=args.host, socket_path=args.socket,
                       upstreams=args.upstream, upstream_dirs=args.upstream_multiprocess_dir,
                       upstream_worlds=upstream_worlds(args),
                       upstream_profiles=per_upstream(args, args.upstream_profile, "--upstream-profile"),
                       profiles=args.profile, persistence_file=args.persistence_file,
                       persistence_interval=args.persistence_interval, nodes=args.ranks_nodes,
                       node_rank=args.ranks_node_rank)


def sidecar_argv(where: str, sidecar: dict[str, Any]) -> list[str]:
    """The sidecar's args after Kubernetes expands them from its env and the variables LWS adds (which
    replace a variable of the same name the template declares)."""
    variables = {e["name"]: e["value"] for e in sidecar.get("env", []) if "value" in e}
    return expanded(sidecar["args"], {**variables, **lws_variables(where)})


def as_pod(template: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "example", **template.get("metadata", {})},
            "spec": template["spec"]}


def validate_core(doc: dict[str, Any]) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def validate_operator_kind(doc: dict[str, Any]) -> None:
    """Validated by the operator's CRD model; a field it does not know fails too (it would be dropped)."""
    from cloudcoil.models.prometheus_operator import v1

    assert doc["apiVersion"] == MONITORING
    model = getattr(v1, doc["kind"]).model_validate(doc)
    back = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
    if back != doc:
        raise ValueError(f"{doc['kind']}: fields the Prometheus Operator's schema does not know:\n"
                         f"{json.dumps(doc, sort_keys=True)}\n!=\n{json.dumps(back, sort_keys=True)}")


def validate_lws(doc: dict[str, Any]) -> None:
    jsonschema.validate(doc, json.loads(LWS_SCHEMA.read_text(encoding="utf-8")))
    for role in ("leaderTemplate", "workerTemplate"):
        validate_core(as_pod(doc["spec"]["leaderWorkerTemplate"][role]))


def validate(doc: dict[str, Any]) -> None:
    if doc["apiVersion"] == MONITORING:
        validate_operator_kind(doc)
    elif doc["kind"] == "LeaderWorkerSet":
        validate_lws(doc)
    else:
        validate_core(doc)


# --- what is there ---------------------------------------------------------------------------

def test_the_files_are_exactly_the_generated_examples() -> None:
    """No hand-written manifest beside the generated ones (the staleness test compares their bytes)."""
    assert {p.name for p in manifest_files()} == set(generated(DEFAULT_NAMESPACE))
    assert {"deployment.yaml", "proxy.yaml", "lws.yaml", "podmonitor.yaml", "prometheusrule.yaml",
            "annotations-scrape.yaml", "proxy-multiprocess-dir.yaml", "model-cache.yaml",
            "vllm-lmcache.yaml", "vllm-lmcache-proxy.yaml"} == set(generated(DEFAULT_NAMESPACE))
    for path in manifest_files():
        assert documents(path) == generated(DEFAULT_NAMESPACE)[path.name]
        assert path.read_text(encoding="utf-8").startswith("# GENERATED by python config/generate.py")


# --- schema validation -------------------------------------------------------------------------

@pytest.mark.parametrize("namespace", NAMESPACES)
def test_every_object_validates_against_its_schema(namespace: str) -> None:
    import kubernetes_validate

    version = kubernetes_validate.latest_version()
    assert tuple(int(x) for x in version.split(".")[:2]) >= (1, 33), \
        f"kubernetes-validate knows only up to {version}; native sidecars are GA in 1.33"
    problems = []
    kinds = set()
    files = {n: d for n, d in generated(namespace).items() if n not in PATCHES}
    files.update({f"{n} on {PATCHES[n]}": patched(n, namespace) for n in PATCHES})
    for name, docs in files.items():
        for doc in docs:
            kinds.add(doc["kind"])
            try:
                validate(doc)
            except (kubernetes_validate.ValidationError, jsonschema.ValidationError) as err:
                problems.append(f"{name}: {doc['kind']}/{doc['metadata'].get('name')}: "
                                f"{'.'.join(str(p) for p in err.path)}: {err.message}")
            except ValueError as err:  # pydantic's ValidationError, and the round trip's difference
                problems.append(f"{name}: {err}")
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)
    assert kinds == {"ConfigMap", "Deployment", "PersistentVolumeClaim", "LeaderWorkerSet", "PodMonitor", "PrometheusRule"}


def test_each_validator_rejects_a_wrong_field() -> None:
    """Every schema check above can fail: a misspelt or ill-typed field of each kind is refused."""
    import kubernetes_validate
    from pydantic import ValidationError

    docs = generated(DEFAULT_NAMESPACE)
    broken = copy.deepcopy(by_kind(docs["proxy.yaml"], "Deployment"))
    exporter_container(broken["spec"]["template"]["spec"])["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(broken)

    monitor = copy.deepcopy(docs["podmonitor.yaml"][0])
    monitor["spec"]["podMetricsEndpoints"][0]["intervall"] = "15s"
    with pytest.raises(ValueError, match="does not know"):
        validate(monitor)
    monitor = copy.deepcopy(docs["podmonitor.yaml"][0])
    monitor["spec"]["podMetricsEndpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(ValidationError):
        validate(monitor)

    rule = copy.deepcopy(docs["prometheusrule.yaml"][0])
    rule["spec"]["groups"][-1]["rules"][0]["for"] = "5 minutes"
    with pytest.raises(ValidationError):
        validate(rule)
    rule = copy.deepcopy(docs["prometheusrule.yaml"][0])
    rule["spec"]["groups"][0]["rules"][0]["recordd"] = rule["spec"]["groups"][0]["rules"][0].pop("record")
    with pytest.raises(ValueError):
        validate(rule)

    lws = copy.deepcopy(by_kind(docs["lws.yaml"], "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] = "RecreateGroupOnContainerRestart"
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws = copy.deepcopy(by_kind(docs["lws.yaml"], "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["sizee"] = 2
    with pytest.raises(jsonschema.ValidationError):
        validate(lws)
    lws = copy.deepcopy(by_kind(docs["lws.yaml"], "LeaderWorkerSet"))
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["imagee"] = "x"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(lws)


def test_the_vendored_lws_schema_is_the_crd_excerpt_it_says() -> None:
    schema = json.loads(LWS_SCHEMA.read_text(encoding="utf-8"))
    assert "kubernetes-sigs/lws" in schema["$comment"]
    assert schema["properties"]["apiVersion"] == {"const": "leaderworkerset.x-k8s.io/v1"}
    template = schema["properties"]["spec"]["properties"]["leaderWorkerTemplate"]
    assert template["required"] == ["workerTemplate"] and template["additionalProperties"] is False
    assert set(template["properties"]["restartPolicy"]["enum"]) >= {"RecreateGroupOnPodRestart", "None"}


# --- every pod -------------------------------------------------------------------------------

@pytest.mark.parametrize("where,template,docs", list(pod_templates()), ids=POD_IDS)
class TestPod:
    def test_exporter_is_a_native_sidecar_with_health_probes(self, where: str, template: dict[str, Any],
                                                              docs: list[dict[str, Any]]) -> None:
        spec = template["spec"]
        sidecar = exporter_container(spec)
        assert sidecar.get("restartPolicy") == "Always", "a native sidecar: initContainers + restartPolicy Always"
        assert sidecar["startupProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
        # Its readiness would count toward the pod's: the engine must not leave its Service over metrics.
        assert "readinessProbe" not in sidecar
        if "LeaderWorkerSet" in {d["kind"] for d in docs}:
            # LWS recreates the whole group when any container restarts.
            assert "livenessProbe" not in sidecar, "a liveness restart of the sidecar would recreate the LWS group"
        else:
            assert sidecar["livenessProbe"]["httpGet"] == {"path": "/-/healthy", "port": "metrics"}
        for container in spec.get("initContainers", []) + spec["containers"]:
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                path = ((container.get(probe) or {}).get("httpGet") or {}).get("path", "")
                assert not path.startswith("/metrics"), f"{container['name']}.{probe} must never hit /metrics"
        ports = {p["name"]: p for p in sidecar["ports"]}
        assert ports["metrics"]["containerPort"] == 9400 and ports["metrics"]["protocol"] == "TCP"

    def test_security_contexts(self, where: str, template: dict[str, Any], docs: list[dict[str, Any]]) -> None:
        spec = template["spec"]
        pod = spec["securityContext"]
        # The pod level binds the root engine too: no uid there.
        assert not {"runAsUser", "runAsNonRoot", "runAsGroup"} & set(pod)
        assert pod["fsGroup"] == UID, "fsGroup makes the 0660 socket connectable by the root engine"
        assert pod["fsGroupChangePolicy"] == "OnRootMismatch"
        assert pod["seccompProfile"]["type"] == "RuntimeDefault"
        for container in spec.get("initContainers", []):  # the exporter's image: restricted
            sc = container["securityContext"]
            assert sc["runAsNonRoot"] is True and sc["runAsUser"] == UID and sc["runAsGroup"] == UID
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert sc["seccompProfile"]["type"] == "RuntimeDefault"
        engine = engine_container(spec)["securityContext"]
        assert engine["runAsUser"] == 0 and engine["runAsNonRoot"] is False, "the engine's own: the image runs as root"
        assert engine["allowPrivilegeEscalation"] is False and engine["capabilities"] == {"drop": ["ALL"]}
        assert not engine.get("privileged")
        for key in ("hostNetwork", "hostPID", "hostIPC"):
            assert not spec.get(key)
        assert spec["automountServiceAccountToken"] is False

    def test_sidecar_resources_follow_the_memory_budget(self, where: str, template: dict[str, Any],
                                                        docs: list[dict[str, Any]]) -> None:
        resources = exporter_container(template["spec"])["resources"]
        budget = reliability_worst_case_bytes()
        limit = quantity_bytes(resources["limits"]["memory"])
        assert budget <= limit <= 1.15 * budget, "docs/reliability.md budgets the limit: its worst case just under it"
        assert "cpu" not in resources["limits"], "no CPU limit: scrapes must not be throttled"
        cpu = resources["requests"]["cpu"]
        assert re.fullmatch(r"\d+m", cpu) and int(cpu[:-1]) <= 100
        assert quantity_bytes(resources["requests"]["memory"]) <= limit

    def test_engine_is_the_released_engine_with_its_volumes(self, where: str, template: dict[str, Any],
                                                           docs: list[dict[str, Any]]) -> None:
        spec = template["spec"]
        engine = engine_container(spec)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
        hf_home = env(engine)["HF_HOME"]
        assert hf_home == "/root/.cache/huggingface", "the image's home is root's"
        claim = volumes[mounts[hf_home]]["persistentVolumeClaim"]["claimName"]
        assert claim == by_kind(generated(DEFAULT_NAMESPACE)["model-cache.yaml"], "PersistentVolumeClaim")["metadata"]["name"]
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert engine[probe]["httpGet"] == {"path": "/health", "port": "http"}
        assert engine["resources"]["limits"]["nvidia.com/gpu"] >= 1
        argv = engine["args"]
        if is_vllm(spec):  # tests/deploy/test_k8s.py's vLLM section checks its flags and LMCache's settings
            assert engine["image"] == manifests.VLLM_IMAGE
            assert argv[argv.index("--port") + 1] == str(manifests.VLLM_PORT)
            assert {p["name"]: p["containerPort"] for p in engine["ports"]}["http"] == manifests.VLLM_PORT
            return
        assert engine["image"] == "lmsysorg/sglang:v0.5.23"
        assert "--enable-metrics" in argv and argv[argv.index("--port") + 1] == "30000"
        assert {p["name"]: p["containerPort"] for p in engine["ports"]}["http"] == 30000
        unknown = [flag for flag in argv if flag.startswith("--") and flag[2:].replace("-", "_") not in sglang_fields()]
        assert not unknown, f"not flags of SGLang 0.5.23: {unknown}"

    def test_sidecar_config_and_args(self, where: str, template: dict[str, Any], docs: list[dict[str, Any]],
                                     tmp_path: Path) -> None:
        from exporter.cli import build_parser

        spec = template["spec"]
        sidecar = exporter_container(spec)
        assert "command" not in sidecar, "keep the image's ENTRYPOINT; pass arguments only"
        args = build_parser().parse_args(sidecar_argv(where, sidecar))
        assert args.command == "serve" and args.config is not None
        config = effective_config(where, template, docs, tmp_path)
        assert config.http.port == 9400
        assert config.metrics.namespace == DEFAULT_NAMESPACE
        assert config.ingest.socket_mode & 0o060 == 0o060 and config.ingest.socket_mode & 0o007 == 0
        socket_dir = str(config.ingest.socket_path.parent)
        volumes = {v["name"]: v for v in spec["volumes"]}
        mounts = {m["mountPath"]: m for m in sidecar["volumeMounts"]}
        assert volumes[mounts[socket_dir]["name"]]["emptyDir"]["medium"] == "Memory", "the socket off the read-only root"
        assert not mounts[socket_dir].get("readOnly")
        engine = engine_container(spec)
        socket = env(engine).get("HICACHE_EXPORTER_SOCKET")
        upstreams = [u.url for u in config.upstreams if u.url is not None]
        if socket is not None:  # push: the engine mounts the same directory
            assert PurePosixPath(socket) == PurePosixPath(str(config.ingest.socket_path))
            engine_mounts = {m["mountPath"]: m["name"] for m in engine["volumeMounts"]}
            assert engine_mounts[socket_dir] == mounts[socket_dir]["name"]
            assert not config.upstreams, "a pushing pod proxies nothing"
        else:  # the proxy: the engine's own /metrics, or its multiprocess directory
            assert config.upstreams, f"{where}: neither push nor proxy"
        port = {p["name"]: p["containerPort"] for p in engine["ports"]}["http"]
        for url in upstreams:
            assert url == f"http://127.0.0.1:{port}/metrics"
        # The engine's profile: sglang by default; LMCache's for a vLLM pod, pushed or proxied.
        profile = "lmcache" if is_vllm(spec) else None
        assert config.profiles_in_use == ((profile,) if profile else ())
        assert all(u.profile == profile for u in config.upstreams)

    def test_sidecar_keeps_its_state_in_an_emptydir_it_can_write(self, where: str, template: dict[str, Any],
                                                                   docs: list[dict[str, Any]], tmp_path: Path) -> None:
        """--persistence.file names a file in a disk-backed emptyDir mounted read-write in the sidecar only,
        group-owned by fsGroup 65532 (the sidecar's uid and gid; its root filesystem is read-only)."""
        from exporter.cli import build_parser

        spec = template["spec"]
        sidecar = exporter_container(spec)
        args = build_parser().parse_args(sidecar_argv(where, sidecar))
        assert args.persistence_file == Path("/var/lib/hicache-exporter/state")
        assert args.persistence_interval is None, "the default, 5s"
        directory = str(args.persistence_file.parent)
        (mount,) = [m for m in sidecar["volumeMounts"] if m["mountPath"] == directory]
        assert not mount.get("readOnly") and "subPath" not in mount
        volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
        assert set(volume) == {"name", "emptyDir"}, "an emptyDir: kept across container restarts"
        assert "medium" not in volume["emptyDir"], "on disk: tmpfs would count against the sidecar's memory limit"
        # Far above the largest file this sidecar writes (its limits, its catalog's widest family, its
        # upstreams: the keeper's own bound), twice during a write: going over the limit evicts the pod.
        from exporter.catalog import load_profiles
        from exporter.sidecar.durable.keeper import max_file_bytes

        config = effective_config(where, template, docs, tmp_path)
        upstreams = {u.url or str(u.multiprocess_dir) for u in config.upstreams}
        catalog = load_profiles(config.metrics.catalog, config.profiles_in_use)
        largest = max_file_bytes(config.ranks, max((len(f.labels) for f in catalog), default=0), len(upstreams))
        assert quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= 4 * largest, f"{largest} bytes at most"
        assert spec["securityContext"]["fsGroup"] == sidecar["securityContext"]["runAsGroup"] == UID
        for container in spec["containers"] + [c for c in spec.get("initContainers", []) if c is not sidecar]:
            assert mount["name"] not in {m["name"] for m in container.get("volumeMounts", [])}, container["name"]

    def test_labels_match_the_selectors(self, where: str, template: dict[str, Any], docs: list[dict[str, Any]]) -> None:
        labels = template["metadata"]["labels"]
        monitor = by_kind(generated(DEFAULT_NAMESPACE)["podmonitor.yaml"], "PodMonitor")
        assert selects(monitor["spec"]["selector"], labels), "the PodMonitor scrapes it"
        for doc in docs:
            if doc["kind"] == "Deployment":
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a label selector (matchLabels, matchExpressions) selects an object with `labels`, as the API server
    evaluates it."""
    if not selector.get("matchLabels", {}).items() <= labels.items():
        return False
    for expression in selector.get("matchExpressions", []):
        key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
        matched = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
                   "Exists": key in labels, "DoesNotExist": key not in labels}[operator]
        if not matched:
            return False
    return True


def test_selects_as_the_api_server_does() -> None:
    selector = {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "In", "values": ["x", "y"]}]}
    assert selects(selector, {"a": "1", "b": "y", "c": "z"})
    assert not selects(selector, {"a": "1", "b": "z"}) and not selects(selector, {"b": "x"})
    assert not selects({"matchExpressions": [{"key": "b", "operator": "Exists"}]}, {"a": "1"})


@cache
def reliability_worst_case_bytes() -> int:
    """docs/reliability.md's worst case for the default limits ("about ... = 243 MB")."""
    text = (ROOT / "docs" / "reliability.md").read_text(encoding="utf-8")
    match = re.search(r"worst case the default limits allow is about [\d +]+= (\d+) MB", text)
    assert match, "docs/reliability.md states the worst case of the default limits"
    return int(match.group(1)) * 10**6


def quantity_bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)(Ki|Mi|Gi)", quantity).groups()  # type: ignore[union-attr]
    return int(number) * {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30}[unit]


def sidecar_config(template: dict[str, Any], docs: list[dict[str, Any]]):  # -> SidecarConfig
    """The ConfigMap's sidecar config, validated by the sidecar's own strict loader."""
    from exporter.config import config_from_data

    cm, key = config_map_of(template, docs)
    return config_from_data(yaml.safe_load(cm["data"][key]), f"ConfigMap {cm['metadata']['name']}")


def config_map_of(template: dict[str, Any], docs: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """The sidecar's ConfigMap and the key of its config file there, the path --config names (mounted read-only)."""
    sidecar = exporter_container(template["spec"])
    args = sidecar["args"]
    config_path = PurePosixPath(args[args.index("--config") + 1])
    mount = next(m for m in sidecar["volumeMounts"] if config_path.is_relative_to(m["mountPath"]))
    assert mount.get("readOnly") is True
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    cm = next(d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == volume["configMap"]["name"])
    return cm, str(config_path.relative_to(mount["mountPath"]))


def config_map_text(template: dict[str, Any], docs: list[dict[str, Any]]) -> str:
    cm, key = config_map_of(template, docs)
    return cm["data"][key]


@cache
def sglang_wheel_sources() -> dict[str, str]:
    """The released SGLang 0.5.23's Python sources (the wheel the integration tests use)."""
    from tests.upstream_sglang import WheelUnavailable, wheel_path

    try:
        path = wheel_path()
    except WheelUnavailable as err:
        pytest.fail(f"the released SGLang wheel is needed: {err}", pytrace=False)
    with zipfile.ZipFile(path) as wheel:
        return {name: wheel.read(name).decode("utf-8") for name in wheel.namelist()
                if name.endswith(".py") and name.startswith("sglang/")}


@cache
def sglang_fields() -> frozenset[str]:
    """ServerArgs' field names in SGLang 0.5.23 (its arg_groups/fields/*.py): the flags' underscored names."""
    names: set[str] = set()
    for name, source in sglang_wheel_sources().items():
        if name.startswith("sglang/srt/arg_groups/fields/"):
            for node in ast.walk(ast.parse(source)):
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names.add(node.target.id)
    assert {"model_path", "tp_size", "enable_metrics", "stat_loggers"} <= names
    return frozenset(names)


def test_the_wheel_checks_catch_a_wrong_name() -> None:
    assert "enable_metrics" in sglang_fields() and "enable_metric" not in sglang_fields()
    sources = sglang_wheel_sources()
    assert defines(sources, "sglang.srt.utils", "kill_process_tree")  # through `from .common import *`
    assert not defines(sources, "sglang.srt.utils", "kill_process_trees")


# --- the push example: SGLang through the stat-logger hook -----------------------------------------

def hook_pod() -> tuple[dict[str, Any], list[dict[str, Any]]]:
    docs = generated(DEFAULT_NAMESPACE)["deployment.yaml"]
    return by_kind(docs, "Deployment")["spec"]["template"], docs


def defines(sources: dict[str, str], module: str, name: str) -> bool:
    """Whether the wheel's `module` defines or imports `name` (following `from x import *`, as Python does)."""
    file = next((f for f in (module.replace(".", "/") + ".py", module.replace(".", "/") + "/__init__.py")
                 if f in sources), None)
    assert file, f"SGLang 0.5.23 has no module {module}"
    tree = ast.parse(sources[file])
    top = set()
    starred = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if alias.name == "*" and isinstance(node, ast.ImportFrom) and node.module:
                    starred.append(node.module)
                else:
                    top.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.Assign):
            top.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return name in top or any(defines(sources, other, name) for other in starred if not name.startswith("_"))


def test_the_launcher_uses_names_the_released_engine_has() -> None:
    template, docs = hook_pod()
    engine = engine_container(template["spec"])
    script_path = PurePosixPath(engine["command"][1])
    mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == str(script_path))
    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
    source = by_kind(docs, "ConfigMap")["data"][mount["subPath"]]
    assert volume["configMap"]["name"] == by_kind(docs, "ConfigMap")["metadata"]["name"]
    tree = ast.parse(source)
    sources = sglang_wheel_sources()
    imported = [(node.module, alias.name) for node in tree.body if isinstance(node, ast.ImportFrom)
                for alias in node.names]
    assert ("exporter.integrations.sglang", "stat_loggers") in imported
    for module, name in imported:
        if module and module.startswith("sglang"):
            assert defines(sources, module, name), f"SGLang 0.5.23's {module} has no {name}"
    assert "server_args.stat_loggers = stat_loggers()" in source and 'if __name__ == "__main__":' in source
    assert env(engine)["PYTHONPATH"] == manifests.CLIENT_DIR


def run_copy_step(template: dict[str, Any], tmp_path: Path) -> tuple[dict[str, Any], Path]:
    """Run a pod's init container's own command (the copy into the emptyDir) here, into `tmp_path/opt`: the
    container and where it copied to."""
    (step,) = [c for c in template["spec"]["initContainers"] if c.get("restartPolicy") != "Always"]
    command = step["command"]
    assert command[:2] == ["python", "-c"]
    target = tmp_path / "opt"
    code = command[2].replace(manifests.CLIENT_DIR, str(target))
    assert code != command[2], "the command writes into the emptyDir"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env={"PYTHONPATH": str(ROOT)}, timeout=60)
    return step, target


def test_the_client_copy_gives_the_engine_an_importable_exporter(tmp_path: Path) -> None:
    """The init container's own command, run here: the copy imports from where the engine looks."""
    template, _ = hook_pod()
    copy_step, target = run_copy_step(template, tmp_path)
    assert (target / "exporter" / "defaults" / "catalog.yaml").is_file(), "the packaged catalog comes along"
    assert not list(target.rglob("__pycache__"))
    probe = ("import exporter, exporter.client, exporter.catalog; "
             f"assert exporter.__file__.startswith({str(target)!r}), exporter.__file__; "
             "exporter.catalog.default_catalog(); print('ok')")
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(target)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
    mounts = {m["mountPath"]: m for m in engine_container(template["spec"])["volumeMounts"]}
    assert mounts[manifests.CLIENT_DIR]["readOnly"] is True
    assert {m["mountPath"] for m in copy_step["volumeMounts"]} == {manifests.CLIENT_DIR}


# --- the patches ---------------------------------------------------------------------------------

def test_annotations_patch_scrapes_the_sidecar_port() -> None:
    deployment = by_kind(patched("annotations-scrape.yaml"), "Deployment")
    annotations = deployment["spec"]["template"]["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "9400", "prometheus.io/path": "/metrics"}
    port = next(p["containerPort"] for p in exporter_container(deployment["spec"]["template"]["spec"])["ports"])
    assert annotations["prometheus.io/port"] == str(port)
    base = by_kind(generated(DEFAULT_NAMESPACE)["deployment.yaml"], "Deployment")
    del deployment["spec"]["template"]["metadata"]["annotations"]
    assert deployment == base, "the patch adds the annotations and nothing else"


def test_multiprocess_dir_patch_shares_the_engines_directory() -> None:
    from exporter.cli import build_parser

    deployment = by_kind(patched("proxy-multiprocess-dir.yaml"), "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    sidecar, engine = exporter_container(spec), engine_container(spec)
    args = build_parser().parse_args(sidecar["args"])
    directory = env(engine)["PROMETHEUS_MULTIPROC_DIR"]
    assert [str(d) for d in args.upstream_multiprocess_dir] == [directory] and not args.upstream
    sidecar_mount = next(m for m in sidecar["volumeMounts"] if m["mountPath"] == directory)
    engine_mount = next(m for m in engine["volumeMounts"] if m["mountPath"] == directory)
    assert sidecar_mount["readOnly"] is True and not engine_mount.get("readOnly")
    assert sidecar_mount["name"] == engine_mount["name"]
    volume = next(v for v in spec["volumes"] if v["name"] == engine_mount["name"])
    assert "emptyDir" in volume
    assert [m["name"] for m in sidecar["volumeMounts"]] == [  # merged into the sidecar's mounts, not replacing them
        "hicache-socket", "exporter-config", "hicache-state", "prometheus-multiproc"]


def test_strategic_merge_merges_keyed_lists_and_replaces_others() -> None:
    base = {"containers": [{"name": "a", "args": ["x"], "env": [{"name": "E", "value": "1"}]}, {"name": "b"}]}
    patch = {"containers": [{"name": "a", "args": ["y"], "env": [{"name": "F", "value": "2"}]}]}
    assert strategic_merge(base, patch) == {"containers": [
        {"name": "a", "args": ["y"], "env": [{"name": "E", "value": "1"}, {"name": "F", "value": "2"}]}, {"name": "b"}]}


# --- the multi-node example ------------------------------------------------------------------------

def test_lws_runs_one_server_over_two_pods_with_a_sidecar_each() -> None:
    lws = by_kind(generated(DEFAULT_NAMESPACE)["lws.yaml"], "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert group["size"] == 2 and group["restartPolicy"] == "RecreateGroupOnPodRestart"
    gpus = 0
    for role in ("leaderTemplate", "workerTemplate"):
        spec = group[role]["spec"]
        exporter_container(spec)  # exactly one sidecar per pod
        engine = engine_container(spec)
        argv = engine["args"]
        used = set(re.findall(r"\$\((\w+)\)", " ".join(argv)))
        assert used == LWS_ENV, "the multi-node flags come from the variables LWS sets"
        assert argv[argv.index("--nnodes") + 1] == "$(LWS_GROUP_SIZE)"
        assert argv[argv.index("--node-rank") + 1] == "$(LWS_WORKER_INDEX)"
        tp = int(argv[argv.index("--tp-size") + 1])
        gpus += engine["resources"]["limits"]["nvidia.com/gpu"]
    assert tp == gpus == 16, "one TP group over both pods"


def test_lws_sidecars_expect_their_own_nodes_ranks(tmp_path: Path) -> None:
    """Each pod's sidecar takes the engine's node count and node rank from the same LWS variables, and with
    the world in its ConfigMap expects exactly the tp ranks its engine runs: 0-7 on the leader, 8-15 on the
    worker (the sidecar's NodeShare, sglang's own placement)."""
    from exporter.cli import build_parser
    from exporter.config import load_config
    from exporter.protocol.messages import World
    from exporter.sidecar.core.servers import Layout, NodeShare

    docs = generated(DEFAULT_NAMESPACE)["lws.yaml"]
    lws = by_kind(docs, "LeaderWorkerSet")
    group = lws["spec"]["leaderWorkerTemplate"]
    shares = []
    for role in ("leaderTemplate", "workerTemplate"):
        where, template = f"lws.yaml {role}", group[role]
        sidecar, engine = exporter_container(template["spec"]), engine_container(template["spec"])
        argv, engine_argv = sidecar["args"], engine["args"]
        assert argv[argv.index("--ranks.nodes") + 1] == engine_argv[engine_argv.index("--nnodes") + 1]
        assert argv[argv.index("--ranks.node-rank") + 1] == engine_argv[engine_argv.index("--node-rank") + 1]
        assert set(re.findall(r"\$\((\w+)\)", " ".join(argv))) <= LWS_ENV
        with pytest.raises(SystemExit):  # unexpanded (LWS's webhook not run): the sidecar refuses to start
            build_parser().parse_args(argv)
        args = build_parser().parse_args(sidecar_argv(where, sidecar))
        config_file = tmp_path / f"{role}.yaml"
        config_file.write_text(by_kind(docs, "ConfigMap")["data"]["sidecar.yaml"], encoding="utf-8")
        config = load_config(config_file, env={}, upstreams=args.upstream, nodes=args.ranks_nodes,
                             node_rank=args.ranks_node_rank)
        assert (config.ranks.nodes, config.ranks.node_rank) == (group["size"], 0 if role == "leaderTemplate" else 1)
        (upstream,) = config.upstreams
        assert upstream.world is not None
        assert upstream.world.tp_size == int(engine_argv[engine_argv.index("--tp-size") + 1])
        world = World(tp_size=upstream.world.tp_size, pp_size=upstream.world.pp_size or 1,
                      dp_size=upstream.world.dp_size)
        share = NodeShare.of(Layout.of(world), config.ranks.node_rank, config.ranks.nodes)
        assert len(share.tp) == engine["resources"]["limits"]["nvidia.com/gpu"], "one tp rank per GPU of the pod"
        shares.append((share.tp, share.pp))
    assert shares == [(range(0, 8), range(0, 1)), (range(8, 16), range(0, 1))]


def test_kubelet_expansion_as_the_tests_model_it() -> None:
    assert expanded(["--a", "$(X)", "$(Y)-$(X)", "$$(X)", "$$"], {"X": "1"}) == ["--a", "1", "$(Y)-1", "$(X)", "$"]


def uncommented_claims(text: str) -> dict[str, Any]:
    """The commented-out volumeClaimTemplates option of lws.yaml, uncommented as its comment says, as data."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == "# volumeClaimTemplates:")
    indent = lines[start].index("#")
    block = []
    for line in lines[start:]:
        if not line.startswith(" " * indent + "# "):
            break
        block.append(line[:indent] + line[indent + 2:])
    return yaml.safe_load("\n".join(block))


def test_lws_states_pvc_option_is_a_valid_leaderworkerset_claiming_the_state_volume() -> None:
    """Uncommented, the option validates against the LWS CRD schema and claims exactly the state volume
    of both pod templates (a claim takes precedence over the template's volume of the same name)."""
    text = outputs(DEFAULT_NAMESPACE)["k8s/lws.yaml"]
    option = uncommented_claims(text)
    assert set(option) == {"volumeClaimTemplates", "persistentVolumeClaimRetentionPolicy"}
    lws = by_kind(generated(DEFAULT_NAMESPACE)["lws.yaml"], "LeaderWorkerSet")
    with_claims = copy.deepcopy(lws)
    with_claims["spec"]["leaderWorkerTemplate"].update(option)
    validate_lws(with_claims)
    (claim,) = option["volumeClaimTemplates"]
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    for role in ("leaderTemplate", "workerTemplate"):
        spec = lws["spec"]["leaderWorkerTemplate"][role]["spec"]
        args = exporter_container(spec)["args"]
        directory = str(PurePosixPath(args[args.index("--persistence.file") + 1]).parent)
        (mount,) = [m for m in exporter_container(spec)["volumeMounts"] if m["mountPath"] == directory]
        assert mount["name"] == claim["metadata"]["name"] and mount["name"] in {v["name"] for v in spec["volumes"]}


def test_pod_monitor_names_the_server_for_the_cross_pod_rules() -> None:
    monitor = by_kind(generated(DEFAULT_NAMESPACE)["podmonitor.yaml"], "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics" and endpoint["interval"] == "15s"
    relabel = endpoint["relabelings"]
    assert [r["targetLabel"] for r in relabel] == ["server", "server"]

    def meta(label: str) -> str:  # Prometheus's name for a pod label in Kubernetes discovery
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    assert relabel[0]["sourceLabels"] == ["__meta_kubernetes_pod_name"]
    assert relabel[1]["sourceLabels"] == [meta(manifests.LWS_NAME_LABEL), meta(manifests.LWS_GROUP_LABEL)]
    from config.generator.rules import REPLICA_AXES, TARGET_LABELS

    assert "server" not in TARGET_LABELS + REPLICA_AXES, "the recording rules keep `server`"


# --- vLLM + LMCache ----------------------------------------------------------------------------------

def vllm_pod(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    docs = generated(DEFAULT_NAMESPACE)[name]
    return by_kind(docs, "Deployment")["spec"]["template"], docs


VLLM_FILES = ["vllm-lmcache.yaml", "vllm-lmcache-proxy.yaml"]


@cache
def lmcache_settings() -> dict[str, str]:
    """LMCache 0.5.6's settings (lmcache/v1/config.py _CONFIG_DEFINITIONS), each key's env_converter by name; LMCache
    reads each from LMCACHE_<KEY> (config.py _update_config_from_env)."""
    from tests.upstream_lmcache import WheelUnavailable, wheel_path

    try:
        path = wheel_path()
    except WheelUnavailable as err:
        pytest.fail(f"the released LMCache wheel is needed: {err}", pytrace=False)
    with zipfile.ZipFile(path) as wheel:
        source = wheel.read("lmcache/v1/config.py").decode("utf-8")
    assert 'return f"LMCACHE_{attr_name.upper()}"' in source, "LMCache reads LMCACHE_<KEY>"
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                and node.target.id == "_CONFIG_DEFINITIONS" and isinstance(node.value, ast.Dict):
            settings = {}
            for key, value in zip(node.value.keys, node.value.values):
                assert isinstance(key, ast.Constant) and isinstance(value, ast.Dict)
                fields = {k.value: v for k, v in zip(value.keys, value.values) if isinstance(k, ast.Constant)}
                settings[key.value] = ast.unparse(fields["env_converter"])
            return settings
    pytest.fail("LMCache 0.5.6's config.py has no _CONFIG_DEFINITIONS", pytrace=False)


@pytest.mark.parametrize("name", VLLM_FILES)
def test_vllm_runs_lmcache_as_its_kv_connector(name: str) -> None:
    """`vllm serve MODEL`, one GPU per tensor-parallel rank, LMCacheConnectorV1 saving and loading, and LMCache's
    settings named as the released LMCache 0.5.6 reads them from the environment."""
    template, _ = vllm_pod(name)
    engine = engine_container(template["spec"])
    command, argv = engine["command"], engine["args"]
    assert command == ["vllm", "serve"] or (command[:2] == ["/bin/sh", "-c"] and "exec vllm serve \"$@\"" in command[2])
    assert argv[0] == manifests.MODEL and not argv[0].startswith("--"), "the model is serve's positional argument"
    tp = int(argv[argv.index("--tensor-parallel-size") + 1])
    assert tp == engine["resources"]["limits"]["nvidia.com/gpu"] == manifests.VLLM_TP
    kv = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    assert kv == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    settings = lmcache_settings()
    lmcache_env = {k: v for k, v in env(engine).items() if k.startswith("LMCACHE_")}
    assert {"LMCACHE_LOCAL_CPU", "LMCACHE_MAX_LOCAL_CPU_SIZE"} <= set(lmcache_env)
    for variable, value in lmcache_env.items():
        key = variable.removeprefix("LMCACHE_").lower()
        assert key in settings, f"LMCache 0.5.6 has no setting {key!r} ({variable})"
        converter = settings[key]
        if converter in {"int", "float"}:
            {"int": int, "float": float}[converter](value)
        elif converter == "_to_bool":
            assert value.strip().lower() in {"true", "1", "false", "0"}, f"{variable}={value!r}"
    assert "LMCACHE_CONFIG_FILE" not in lmcache_env, "no file: the environment is LMCache's whole config here"


def test_lmcache_settings_check_catches_a_wrong_name() -> None:
    assert {"chunk_size", "local_cpu", "max_local_cpu_size"} <= set(lmcache_settings())
    assert "max_local_cpu_sizes" not in lmcache_settings()
    assert lmcache_settings()["local_cpu"] == "_to_bool"


def test_the_plugin_package_pyproject_declares_is_the_one_vllm_finds() -> None:
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    plugins = pyproject["project"]["entry-points"]["vllm.general_plugins"]
    assert plugins == {manifests.VLLM_PLUGIN: "exporter.integrations.lmcache:register"}


# vLLM's plugin loading (vllm/plugins/__init__.py load_plugins_by_group): the entry points of the group, those
# named in VLLM_PLUGINS when it is set, each loaded. Printed: name, value, where the distribution and the
# function come from.
VLLM_LOAD_PLUGINS = """\
import json, os, sys
from importlib.metadata import entry_points
allowed = os.environ.get("VLLM_PLUGINS")
found = []
for plugin in entry_points(group="vllm.general_plugins"):
    if allowed is None or plugin.name in allowed.split(","):
        entry = {"name": plugin.name, "value": plugin.value, "dist": str(plugin.dist.locate_file(""))}
        if "--load" in sys.argv:
            func = plugin.load()
            entry["module"] = sys.modules[func.__module__].__file__
            func()  # register(): never raises; without LMCache it only warns
        found.append(entry)
print(json.dumps(found))
"""


def test_the_plugin_install_gives_vllm_the_entry_point(tmp_path: Path) -> None:
    """The init container's own command, run here: on the engine's PYTHONPATH, vLLM's plugin loader finds
    hicache_exporter_lmcache in the copied metadata and loads register() from the copied package."""
    template, _ = vllm_pod("vllm-lmcache.yaml")
    spec = template["spec"]
    install, target = run_copy_step(template, tmp_path)
    assert not list(target.rglob("__pycache__"))
    assert (target / "exporter" / "defaults" / "lmcache.yaml").is_file(), "the packaged profiles come along"
    engine = engine_container(spec)
    variables = env(engine)
    assert variables["PYTHONPATH"] == manifests.CLIENT_DIR
    assert "VLLM_PLUGINS" not in variables or manifests.VLLM_PLUGIN in variables["VLLM_PLUGINS"].split(",")
    mounts = {m["mountPath"]: m for m in engine["volumeMounts"]}
    assert mounts[manifests.CLIENT_DIR]["readOnly"] is True
    assert mounts[manifests.CLIENT_DIR]["name"] == install["volumeMounts"][0]["name"]

    def load(*flags: str, site: bool = True) -> list[dict[str, str]]:
        argv = [sys.executable, *([] if site else ["-S"]), "-c", VLLM_LOAD_PLUGINS, *flags]
        result = subprocess.run(argv, cwd=tmp_path, env={"PYTHONPATH": str(target)}, capture_output=True,
                                text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    # Nothing but the copy on the path (no site-packages): the copy alone declares the plugin.
    (alone,) = load(site=False)
    assert (alone["name"], alone["value"]) == (manifests.VLLM_PLUGIN, "exporter.integrations.lmcache:register")
    assert Path(alone["dist"]) == target
    # As vLLM loads it, beside everything else installed: the copy is found first and register() is its own.
    (loaded,) = [p for p in load("--load") if p["name"] == manifests.VLLM_PLUGIN]
    assert Path(loaded["dist"]) == target and Path(loaded["module"]).is_relative_to(target), loaded


def test_the_pushing_vllm_pod_reaches_the_sidecar_serving_lmcache(tmp_path: Path) -> None:
    template, docs = vllm_pod("vllm-lmcache.yaml")
    config = effective_config("vllm-lmcache.yaml", template, docs, tmp_path)
    assert config.profiles_in_use == ("lmcache",) and not config.upstreams
    engine = engine_container(template["spec"])
    assert env(engine)["HICACHE_EXPORTER_SOCKET"] == str(config.ingest.socket_path)
    assert "PROMETHEUS_MULTIPROC_DIR" not in env(engine), "the push door needs no multiprocess files"


def test_the_vllm_proxy_reads_metrics_vllm_merges_from_multiprocess_files(tmp_path: Path) -> None:
    """The URL door works only where vLLM writes multiprocess files: PROMETHEUS_MULTIPROC_DIR is set at start, on an
    emptyDir of the engine's; the sidecar reads it with the lmcache profile and the engine's world."""
    from exporter.catalog import load_profiles

    template, docs = vllm_pod("vllm-lmcache-proxy.yaml")
    spec = template["spec"]
    engine = engine_container(spec)
    config = effective_config("vllm-lmcache-proxy.yaml", template, docs, tmp_path)
    (upstream,) = config.upstreams
    argv = engine["args"]
    assert upstream.url == f"http://127.0.0.1:{argv[argv.index('--port') + 1]}/metrics"
    assert upstream.profile == "lmcache" and upstream.world is not None
    assert (upstream.world.tp_size, upstream.world.pp_size or 1, upstream.world.dp_size) == (
        int(argv[argv.index("--tensor-parallel-size") + 1]), 1, 1)
    profile = load_profiles(config.metrics.catalog, config.profiles_in_use).of_profile("lmcache").default_profile
    assert profile.world_problem(upstream.world.dp_size, upstream.world.dp_attention) is None
    directory = env(engine)["PROMETHEUS_MULTIPROC_DIR"]
    (mount,) = [m for m in engine["volumeMounts"] if m["mountPath"] == directory]
    assert not mount.get("readOnly")
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert set(volume) == {"name", "emptyDir"} and "medium" not in volume["emptyDir"]
    sidecar = exporter_container(spec)
    assert mount["name"] not in {m["name"] for m in sidecar["volumeMounts"]}, "the URL door shares nothing"


def test_the_vllm_proxy_engine_empties_its_directory_then_serves(tmp_path: Path) -> None:
    """The engine's command, run here with a stand-in `vllm`: the files of earlier processes are removed, vLLM gets
    the args unchanged (the JSON of --kv-transfer-config too), and without the variable nothing is removed."""
    template, _ = vllm_pod("vllm-lmcache-proxy.yaml")
    engine = engine_container(template["spec"])
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "vllm"
    fake.write_text(f"#!{sys.executable}\nimport json, sys\nprint(json.dumps(sys.argv[1:]))\n", encoding="utf-8")
    fake.chmod(0o755)
    directory = tmp_path / "multiproc"
    directory.mkdir()
    for stale in ("counter_7.db", "gauge_livemostrecent_7.db", "histogram_12.db"):
        (directory / stale).write_bytes(b"\0" * 16)
    argv = [*engine["command"], *engine["args"]]
    path = f"{bin_dir}:/usr/bin:/bin"
    result = subprocess.run(argv, env={"PATH": path, "PROMETHEUS_MULTIPROC_DIR": str(directory)},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == ["serve", *engine["args"]]
    assert directory.is_dir() and not list(directory.iterdir())
    # Unset: the shell stops before rm (a stand-in here, which would say it ran) and before vLLM.
    (bin_dir / "rm").write_text("#!/bin/sh\necho rm-ran\n", encoding="utf-8")
    (bin_dir / "rm").chmod(0o755)
    result = subprocess.run(argv, env={"PATH": path}, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "rm-ran" not in result.stdout and "serve" not in result.stdout
