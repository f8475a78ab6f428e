"""The Kubernetes examples, built from one set of parts: the sidecar, the engine container, the volumes.

Every example pod is made of the same functions, so the sidecar's security context, probes,
resources and config exist once; the examples differ only in how the engine reaches the sidecar:

* `deployment.yaml`: one pod, SGLang launched through the stat-logger hook (push over the socket);
* `proxy.yaml`: one pod, an unmodified SGLang, the sidecar reading its /metrics (the proxy);
* `lws.yaml`: one server over two pods (LeaderWorkerSet), a proxy sidecar in each pod;
* `vllm-lmcache.yaml`: one pod, vLLM + LMCache, LMCache's metrics pushed through the vLLM plugin;
* `vllm-lmcache-proxy.yaml`: one pod, vLLM + LMCache unmodified, the sidecar reading vLLM's /metrics
  with the `lmcache` profile and the engine's world;
* `annotations-scrape.yaml`, `proxy-multiprocess-dir.yaml`: small strategic-merge patches of the
  single-pod examples (scrape by annotations; read the engine's multiprocess directory).
"""

from __future__ import annotations

from typing import Any

from .yamltext import Key, dump_mapping

SGLANG_IMAGE = "lmsysorg/sglang:v0.5.23"
EXPORTER_IMAGE = "registry.example.com/hicache-exporter:0.1.0"
EXPORTER = "hicache-exporter"
UID = 65532
METRICS_PORT = 9400
ENGINE_PORT = 30000
UPSTREAM_URL = f"http://127.0.0.1:{ENGINE_PORT}/metrics"  # the engine's own /metrics, as the proxy reads it
SOCKET_DIR = "/run/hicache"
SOCKET = f"{SOCKET_DIR}/metrics.sock"
CONFIG_DIR = "/etc/hicache-exporter"
CLIENT_DIR = "/opt/hicache-exporter"
MULTIPROC_DIR = "/prometheus-multiproc"
STATE_DIR = "/var/lib/hicache-exporter"
STATE_FILE = f"{STATE_DIR}/state"  # the sidecar's --persistence.file
# The state file is bounded by the series budget and the label limits (exporter/sidecar/durable/keeper.py
# max_file_bytes: at the defaults 136 MiB for a pushed pod, 271 MiB for a proxy of one upstream); a write
# holds it twice (the temporary file, then the rename), and a file that could not be used is kept aside
# beside it. Going over an emptyDir's sizeLimit evicts the whole pod, GPUs and all, so the limit is far
# above that (tests/deploy/test_k8s.py: at least four times the pod's bound).
STATE_SIZE_LIMIT = "2Gi"
STATE_CLAIM_SIZE = "1Gi"
HF_HOME = "/root/.cache/huggingface"
APP = "sglang-hicache"  # the pod label the PodMonitor selects
NAME_LABEL = "app.kubernetes.io/name"
INSTANCE_LABEL = "app.kubernetes.io/instance"
# The sidecar's memory limit: docs/reliability.md's budget, the worst case the default limits allow
# (about 293 MB, response bodies in flight included) under 320 Mi.
SIDECAR_MEMORY_LIMIT = "320Mi"
LWS_NAME_LABEL = "leaderworkerset.sigs.k8s.io/name"
LWS_GROUP_LABEL = "leaderworkerset.sigs.k8s.io/group-index"

# vLLM + LMCache (the `lmcache` profile): LMCache's own release image, vLLM and LMCache in one.
VLLM_IMAGE = "lmcache/vllm-openai:v0.5.6"
VLLM_APP = "vllm-lmcache"  # the name label of the vLLM pods, which the PodMonitor selects too
VLLM_PORT = 8000  # vllm serve's default
VLLM_UPSTREAM_URL = f"http://127.0.0.1:{VLLM_PORT}/metrics"
VLLM_TP = 2
VLLM_PLUGIN = "hicache_exporter_lmcache"  # pyproject's vllm.general_plugins entry point
LMCACHE_PROFILE = "lmcache"
# vLLM's KV connector for LMCache, saving and loading (vllm/distributed/kv_transfer/kv_connector/factory.py).
KV_TRANSFER_CONFIG = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'

MODEL = "Qwen/Qwen3-8B"
LWS_MODEL = "Qwen/Qwen3-235B-A22B"
LWS_TP = 16  # over the group's two pods of 8 GPUs
# The node count and node rank of a pod in a LeaderWorkerSet group, as Kubernetes expands them in args
# from the variables LWS's pod webhook sets in every container (lws pkg/utils/pod AddLWSVariables).
NODES = "$(LWS_GROUP_SIZE)"
NODE_RANK = "$(LWS_WORKER_INDEX)"


# --- the sidecar ------------------------------------------------------------------------------

def sidecar_config(ns: str, proxy: bool, upstreams: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The sidecar's config file, as data with comments; the same keys in every example (and `upstreams`
    where an example configures them in the file)."""
    config: dict[str, Any] = {
        "http": {
            "host": "0.0.0.0",
            Key("port", "Must match the container port named `metrics`. 9400 is also dcgm-exporter's default: "
                        "move one of them if both share this pod's network."): METRICS_PORT,
        },
        "ingest": {
            Key("socket_path", "In the emptyDir shared with the engine container, whose HICACHE_EXPORTER_SOCKET "
                               "names the same path." if not proxy else
                "The proxy needs no pushes, but the sidecar always listens; the emptyDir keeps the socket off the "
                "read-only root filesystem."): SOCKET,
            Key("socket_mode", "Owner and group (fsGroup 65532) may connect; nobody else."): "0660",
            Key("allowed_uids", "null: any process that can open the socket (the file mode and the emptyDir "
                                "already confine it to this pod). [0] would also check each peer's uid "
                                "(SO_PEERCRED): the engine runs as root."): None,
        },
        "ranks": {"stale_after_seconds": 10, "expire_after_seconds": 300},
        "metrics": {Key("namespace", "The exported names' prefix; the dashboards and recording rules generated "
                                     "with it (python config/generate.py --namespace ...) must use the same."): ns},
        "rollup": {"window_seconds": 60},
        "log_level": "info",
    }
    if upstreams:
        config["upstreams"] = upstreams
    return config


def config_map(name: str, instance: str, ns: str, proxy: bool, extra: dict[str, str] | None = None,
               upstreams: list[dict[str, Any]] | None = None, app: str = APP) -> dict[str, Any]:
    data = {"sidecar.yaml": dump_mapping(sidecar_config(ns, proxy, upstreams))}
    data.update(extra or {})
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "labels": {NAME_LABEL: app, INSTANCE_LABEL: instance,
                                              "app.kubernetes.io/component": EXPORTER}},
        "data": data,
    }


def restricted(read_only_root: bool = True) -> dict[str, Any]:
    """Pod Security "restricted" for a container of the exporter's image (numeric uid 65532)."""
    return {
        "runAsNonRoot": True,
        Key("runAsUser", "The image's `USER 65532:65532`, numeric so the kubelet can check runAsNonRoot."): UID,
        "runAsGroup": UID,
        "readOnlyRootFilesystem": read_only_root,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def sidecar(args: list[str], liveness: bool = True, mounts: list[dict[str, Any]] | None = None,
            ) -> dict[str, Any]:
    """The exporter as a native sidecar: an init container with restartPolicy Always."""
    probes: dict[str, Any] = {
        Key("startupProbe", """
            Probes use the cheap health routes, never /metrics (rendering /metrics grows with ranks and
            series). The startup probe passes once HTTP serves, which is after the ingest socket listens,
            and only then does the engine container start: its ranks find the socket at once.
            """): {"httpGet": {"path": "/-/healthy", "port": "metrics"}, "periodSeconds": 1, "failureThreshold": 30},
    }
    if liveness:
        probes["livenessProbe"] = {"httpGet": {"path": "/-/healthy", "port": "metrics"},
                                   "periodSeconds": 10, "timeoutSeconds": 2, "failureThreshold": 3}
    return {
        Key("name", """
            A native sidecar: an init container with restartPolicy Always starts before the engine
            container, runs beside it, is restarted on its own if it dies, and is stopped after the engine,
            so the ranks' last snapshots still reach it. No readinessProbe, on purpose: a sidecar's
            readiness counts toward the pod's Ready condition, and the engine must never leave its Service
            because its metrics sidecar is not ready (HiCacheExporterDown alerts on the sidecar instead).
            """): EXPORTER,
        Key("image", "Built from this repository's Dockerfile; pin its digest in production."): EXPORTER_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "restartPolicy": "Always",
        Key("args", "The image's ENTRYPOINT is `hicache-exporter`; these are its arguments."): args,
        "ports": [{Key("name", "The PodMonitor scrapes this port by name."): "metrics",
                   "containerPort": METRICS_PORT, "protocol": "TCP"}],
        **probes,
        Key("resources", f"""
            The sidecar idles on a fraction of a core. No CPU limit, so a burst of scrapes is never
            throttled. The memory limit is docs/reliability.md's budget: the worst case the default limits
            allow (ranks.max_series_total, ingest.max_buffered_bytes, connections, http.max_response_bytes_in_flight)
            is about 293 MB, under
            {SIDECAR_MEMORY_LIMIT}; raise both together. If the pod must be Guaranteed QoS (static CPU manager
            for the GPUs), set limits equal to requests in every container.
            """): {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": SIDECAR_MEMORY_LIMIT}},
        Key("securityContext", "Restricted: the sidecar writes only its socket and its state file, each in its "
                               "emptyDir."): restricted(),
        "volumeMounts": [
            {"name": "hicache-socket", "mountPath": SOCKET_DIR},
            {"name": "exporter-config", "mountPath": CONFIG_DIR, "readOnly": True},
            {Key("name", "--persistence.file's directory: the rollups' state, kept across restarts of the sidecar."):
             "hicache-state", "mountPath": STATE_DIR},
            *(mounts or []),
        ],
    }


def serve_args(*extra: str) -> list[str]:
    """`serve` with the config file and the state file (written every 5 s when it changed, and at SIGTERM)."""
    return ["serve", "--config", f"{CONFIG_DIR}/sidecar.yaml", "--persistence.file", STATE_FILE, *extra]


# --- the engine -------------------------------------------------------------------------------

def engine_security(image: str = "lmsysorg/sglang", caches: str = "Triton, FlashInfer, torch compile") -> dict[str, Any]:
    """The engine container's own context: the image runs as root, so the pod sets no uid for it."""
    return {
        Key("runAsUser", f"""
            {image} runs as root and writes its caches ({caches}) under its
            home; Pod Security "restricted" cannot hold it, "baseline" does. Nothing here is privileged, and
            it cannot gain privileges. Multi-node NCCL over RDMA (InfiniBand, RoCE) also needs IPC_LOCK and
            the RDMA device plugin's resource; add them here when the nodes have such NICs.
            """): 0,
        "runAsNonRoot": False,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def engine_probes() -> dict[str, Any]:
    health = {"httpGet": {"path": "/health", "port": "http"}}
    return {
        Key("startupProbe", "Downloading and loading the model and capturing CUDA graphs take minutes: up to "
                            "30 minutes here before liveness applies."): {
            **health, "periodSeconds": 10, "failureThreshold": 180},
        "readinessProbe": {**health, "periodSeconds": 10, "timeoutSeconds": 5, "failureThreshold": 3},
        "livenessProbe": {**health, "periodSeconds": 30, "timeoutSeconds": 10, "failureThreshold": 5},
    }


def launch_args(tp: int, model: str, *extra: str) -> list[str]:
    """SGLang 0.5.23's server flags: metrics on (the collectors exist only then), HiCache on."""
    return ["--model-path", model, "--tp-size", str(tp), "--enable-metrics", "--enable-hierarchical-cache",
            *extra, "--host", "0.0.0.0", "--port", str(ENGINE_PORT)]


def engine(command: list[str], args: list[str], gpus: int, env: list[dict[str, Any]] | None = None,
           mounts: list[dict[str, Any]] | None = None, comment: str = "", probes: bool = True,
           name: str = "sglang", image: str = SGLANG_IMAGE,
           image_comment: str = "The SGLang 0.5.23 release image (CUDA 13); pin its digest in production.",
           port: int = ENGINE_PORT, security: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        Key("name", comment): name,
        Key("image", image_comment): image,
        "command": command,
        "args": args,
        "env": [
            {Key("name", "The model cache (the PVC below); the image's own default is the same path."): "HF_HOME",
             "value": HF_HOME},
            {Key("name", "For gated models; optional, so the pod starts without the Secret."): "HF_TOKEN",
             "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token", "optional": True}}},
            *(env or []),
        ],
        "ports": [{"name": "http", "containerPort": port, "protocol": "TCP"}],
        **(engine_probes() if probes else {}),
        Key("resources", "GPUs only: the engine sizes its own memory. A memory-backed /dev/shm counts against a "
                         "memory limit, if you set one."): {"limits": {"nvidia.com/gpu": gpus}},
        Key("securityContext", ""): security or engine_security(),
        "volumeMounts": [
            {Key("name", "NCCL and torch's worker processes share memory through /dev/shm; a container's "
                         "default is 64 MiB."): "dshm", "mountPath": "/dev/shm"},
            {"name": "model-cache", "mountPath": HF_HOME},
            *(mounts or []),
        ],
    }


def volumes(config_name: str, *extra: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        {Key("name", """
            The socket's directory, shared by the containers that use it. Memory-backed: a socket needs no
            disk, and a node-local tmpfs never outlives the pod, so no stale socket of an earlier pod lingers.
            """): "hicache-socket", "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}},
        {"name": "exporter-config", "configMap": {"name": config_name}},
        {Key("name", f"""
            The sidecar's state (--persistence.file {STATE_FILE}): its rollups' history, so that a restart
            of the sidecar container (OOM kill, crash, failed liveness probe) goes on from where it was,
            exactly. An emptyDir outlives container restarts, not the pod: a new pod (a rollout, a
            reschedule, a deletion) starts its rollups over (docs/kubernetes.md). On disk, not in memory:
            tmpfs pages would count against the sidecar's memory limit. fsGroup 65532 makes it writable
            for the sidecar. sizeLimit: several times the largest file the sidecar writes (going over
            evicts the pod).
            """): "hicache-state", "emptyDir": {"sizeLimit": STATE_SIZE_LIMIT}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}},
        {Key("name", "config/k8s/model-cache.yaml: the Hugging Face cache, kept across pod restarts."): "model-cache",
         "persistentVolumeClaim": {"claimName": "sglang-model-cache"}},
        *extra,
    ]


def pod_spec(init: list[dict[str, Any]], containers: list[dict[str, Any]], vols: list[dict[str, Any]],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {
        Key("automountServiceAccountToken", "Neither container talks to the Kubernetes API."): False,
        Key("securityContext", """
            Pod-level settings that bind every container. No runAsUser or runAsNonRoot here: the engine runs
            as root, the sidecar sets its own. fsGroup 65532 group-owns the emptyDirs and is a supplemental
            group of every container, so the root engine can connect to the sidecar's 0660 socket without
            CAP_DAC_OVERRIDE; OnRootMismatch spares the model cache a recursive chown at every start.
            """): {"fsGroup": UID, "fsGroupChangePolicy": "OnRootMismatch", "seccompProfile": {"type": "RuntimeDefault"}},
        Key("terminationGracePeriodSeconds", "The engine drains requests; the sidecar stops after it, in seconds."): 60,
        **(extra or {}),
        "initContainers": init,
        "containers": containers,
        "volumes": vols,
    }


def deployment(name: str, instance: str, spec: dict[str, Any], comment: str = "", app: str = APP) -> dict[str, Any]:
    labels = {NAME_LABEL: app, INSTANCE_LABEL: instance}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": 1,
            Key("strategy", "Recreate: the GPUs are not free for a second pod during a rollout."): {"type": "Recreate"},
            "selector": {"matchLabels": dict(labels)},
            "template": {"metadata": {Key("labels", comment or "podmonitor.yaml selects pods by the name label."):
                                      dict(labels)}, "spec": spec},
        },
    }


# --- the examples -----------------------------------------------------------------------------

LAUNCHER = '''\
"""SGLang's own launcher (python -m sglang.launch_server), with the exporter's stat loggers.

ServerArgs.stat_loggers has no command-line flag, so this sets it between parsing the flags
and starting the server; everything else is sglang/launch_server.py's __main__ as released.
"""

import os
import sys

from sglang.launch_server import run_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import prepare_server_args
from sglang.srt.utils import kill_process_tree

from exporter.integrations.sglang import stat_loggers

if __name__ == "__main__":  # the scheduler processes are spawned and import this file again
    load_plugins()
    server_args = prepare_server_args(sys.argv[1:])
    server_args.stat_loggers = stat_loggers()  # push over $HICACHE_EXPORTER_SOCKET
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
'''

# Copies the exporter package (pure Python: the client and the stat-logger hook) from the sidecar's
# image into an emptyDir the engine imports it from, as the OpenTelemetry operator injects its Python
# instrumentation: the engine's image stays the released one.
COPY_CLIENT = ("import pathlib, shutil, exporter; "
               "shutil.copytree(pathlib.Path(exporter.__file__).parent, '/opt/hicache-exporter/exporter', "
               "ignore=shutil.ignore_patterns('__pycache__'), dirs_exist_ok=True)")


def install_step(name: str, comment: str, code: str) -> dict[Any, Any]:
    """An init container that runs `code` in the sidecar's image to put the exporter package into the
    emptyDir the engine imports it from (`comment` says what it installs and why)."""
    return {
        Key("name", comment): name,
        "image": EXPORTER_IMAGE,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-c", code],
        "resources": {"requests": {"cpu": "50m", "memory": "64Mi"}, "limits": {"memory": "128Mi"}},
        "securityContext": restricted(),
        "volumeMounts": [{"name": "hicache-client", "mountPath": CLIENT_DIR}],
    }


def hook_example(ns: str) -> list[dict[str, Any]]:
    """One pod: SGLang launched through the stat-logger hook, pushing to the sidecar over the socket."""
    copy = install_step("install-hicache-client", """
        Runs once, first: copies the exporter's Python package (the client and the stat-logger hook,
        no torch) from the sidecar image into the emptyDir the engine imports it from. Its imports
        (prometheus_client, msgspec, pydantic, PyYAML) are SGLang's own dependencies.
        """, COPY_CLIENT)
    sglang = engine(
        ["python3", f"{CONFIG_DIR}/launch.py"], launch_args(2, MODEL), gpus=2,
        env=[
            {Key("name", "The socket the stat loggers push to (the sidecar's ingest.socket_path)."):
             "HICACHE_EXPORTER_SOCKET", "value": SOCKET},
            {Key("name", "The copied exporter package; the engine's spawned scheduler processes inherit it."):
             "PYTHONPATH", "value": CLIENT_DIR},
        ],
        mounts=[
            {"name": "hicache-socket", "mountPath": SOCKET_DIR},
            {"name": "hicache-client", "mountPath": CLIENT_DIR, "readOnly": True},
            {"name": "exporter-config", "mountPath": f"{CONFIG_DIR}/launch.py", "subPath": "launch.py", "readOnly": True},
        ],
        comment="""
            SGLang, the released image and flags, started through launch.py (the ConfigMap above) so that its
            schedulers' HiCache collectors push over the socket: exact restarts (an epoch per process), and the
            pushed families leave the engine's own /metrics.
            """)
    client_volume = {Key("name", "The exporter package copied by install-hicache-client."): "hicache-client",
                     "emptyDir": {"sizeLimit": "64Mi"}}
    spec = pod_spec([copy, sidecar(serve_args())], [sglang], volumes("sglang-hicache-exporter", client_volume))
    return [config_map("sglang-hicache-exporter", "sglang-hicache", ns, proxy=False, extra={"launch.py": LAUNCHER}),
            deployment("sglang-hicache", "sglang-hicache", spec)]


def proxy_pod_spec(config_name: str, liveness: bool = True, extra: dict[str, Any] | None = None,
                   engine_args: list[str] | None = None, gpus: int = 2, command: list[str] | None = None,
                   comment: str = "", sidecar_args: list[str] | None = None) -> dict[str, Any]:
    sglang = engine(command or ["python3", "-m", "sglang.launch_server"], engine_args or launch_args(2, MODEL),
                    gpus=gpus, comment=comment or """
            SGLang unmodified: the released image and its own launcher. --enable-metrics makes it serve
            /metrics on its port, which stays private to the pod: Prometheus scrapes the sidecar only
            (the sidecar passes the engine's other families through).
            """)
    args = sidecar_args or serve_args("--upstream", UPSTREAM_URL)
    return pod_spec([sidecar(args, liveness=liveness)], [sglang], volumes(config_name), extra)


def proxy_example(ns: str) -> list[dict[str, Any]]:
    """One pod: an unmodified SGLang and the sidecar reading its /metrics."""
    return [config_map("sglang-proxy-exporter", "sglang-proxy", ns, proxy=True),
            deployment("sglang-proxy", "sglang-proxy", proxy_pod_spec("sglang-proxy-exporter"))]


def lws_example(ns: str) -> list[dict[str, Any]]:
    """One server over a LeaderWorkerSet group of two pods (TP=16 over 2 x 8 GPUs), a sidecar in each."""
    labels = {NAME_LABEL: APP, INSTANCE_LABEL: "sglang-lws"}
    multi_node = ["--dist-init-addr", "$(LWS_LEADER_ADDRESS):20000", "--nnodes", NODES, "--node-rank", NODE_RANK]
    args = launch_args(LWS_TP, LWS_MODEL, *multi_node)
    # The sidecar expects only its node's ranks: the same node count and node rank as the engine's. Its
    # upstream is in the ConfigMap (with the server's world), so no --upstream here: one place to change.
    exporter_args = serve_args("--ranks.nodes", NODES, "--ranks.node-rank", NODE_RANK)
    upstream = {
        "url": UPSTREAM_URL,
        Key("world", """
            The server's parallel layout (the engine's --tp-size; no --dp-size or --pp-size), so the
            sidecar knows which ranks to expect and counts a rank that never reports as missing
            (hicache_exporter_ranks_missing, HiCacheRankMissing). Of it, each sidecar expects only its own
            node's share (--ranks.nodes and --ranks.node-rank in its args): tp 0-7 on the leader, tp 8-15
            on the worker.
            """): {"tp_size": LWS_TP, "dp_size": 1, "pp_size": 1},
    }

    def template(role: str, comment: str) -> dict[str, Any]:
        return {
            "metadata": {Key("labels", "podmonitor.yaml selects the name label; LWS adds its own set-name and "
                                       "group-index labels, which the PodMonitor turns into `server`."):
                         {**labels, "role": role}},
            "spec": proxy_pod_spec("sglang-lws-exporter", liveness=False, engine_args=args, gpus=LWS_TP // 2,
                                   comment=comment, sidecar_args=exporter_args),
        }

    lws = {
        "apiVersion": "leaderworkerset.x-k8s.io/v1",
        "kind": "LeaderWorkerSet",
        "metadata": {"name": "sglang-lws", "labels": labels},
        "spec": {
            Key("replicas", "Independent servers; each is one group of `size` pods."): 1,
            "leaderWorkerTemplate": {
                Key("size", "Pods per server: the leader (node rank 0) and one worker."): 2,
                Key("restartPolicy", """
                    A multi-node server cannot lose one pod and go on, so any restart recreates the whole
                    group. That includes a restart of the hicache-exporter sidecar (LWS counts init
                    containers' restarts): hence no livenessProbe on the sidecar here, and a memory limit
                    above its worst case.
                    """): "RecreateGroupOnPodRestart",
                Key("leaderTemplate", f"""
                    The sidecars' state is in an emptyDir (hicache-state), which RecreateGroupOnPodRestart
                    loses with any restart in the group (a new pod), the sidecar's own included. To keep it
                    across those and across rescheduling, give each pod a PersistentVolumeClaim instead: a
                    claim takes precedence over the template's volume of the same name, and each pod keeps its
                    own across recreations. Your LWS CRD must have the field (kubectl explain
                    leaderworkerset.spec.leaderWorkerTemplate.volumeClaimTemplates). Uncomment:

                    | volumeClaimTemplates:
                    |   - metadata:
                    |       name: hicache-state
                    |     spec:
                    |       accessModes: ["ReadWriteOnce"]
                    |       resources:
                    |         requests:
                    |           storage: {STATE_CLAIM_SIZE}
                    | persistentVolumeClaimRetentionPolicy:
                    |   whenDeleted: Delete
                    |   whenScaled: Delete
                    """): template("leader", """
                    Node rank 0: the scheduler ranks tp 0-7 and the HTTP server. LWS's pod webhook (LWS 0.6
                    or later) adds LWS_LEADER_ADDRESS, LWS_GROUP_SIZE and LWS_WORKER_INDEX to the env of every
                    container, init containers (the sidecar) included, so Kubernetes expands $(VAR) in their
                    args (docs/kubernetes.md).
                    """),
                "workerTemplate": template("worker", """
                    Node rank 1: the scheduler ranks tp 8-15. SGLang serves /health and /metrics on the same
                    port on non-zero node ranks too (a small health server), so its sidecar proxies them as
                    the leader's does.
                    """),
            },
            "startupPolicy": "LeaderCreated",
        },
    }
    return [config_map("sglang-lws-exporter", "sglang-lws", ns, proxy=True, upstreams=[upstream]), lws]


# --- vLLM + LMCache ---------------------------------------------------------------------------

def vllm_args(tp: int, model: str) -> list[str]:
    """`vllm serve`'s arguments: LMCache as the KV connector, the API on all addresses (its /metrics on by default)."""
    return [model, "--tensor-parallel-size", str(tp), "--kv-transfer-config", KV_TRANSFER_CONFIG,
            "--host", "0.0.0.0", "--port", str(VLLM_PORT)]


def lmcache_env() -> list[dict[str, Any]]:
    """LMCache's configuration, as environment variables (LMCACHE_ + a key of lmcache/v1/config.py)."""
    return [
        {Key("name", "LMCache's chunk of tokens, the unit it stores and retrieves (its default)."):
         "LMCACHE_CHUNK_SIZE", "value": "256"},
        {Key("name", "The CPU offload tier: pinned host memory."): "LMCACHE_LOCAL_CPU", "value": "True"},
        {Key("name", """
            GB of pinned host memory per worker (one per GPU: 40 GB for TP=2). The container sets no
            memory limit; if you set one, leave room for this.
            """): "LMCACHE_MAX_LOCAL_CPU_SIZE", "value": "20"},
    ]


def vllm_engine(command: list[str], env: list[dict[str, Any]], mounts: list[dict[str, Any]],
                comment: str) -> dict[str, Any]:
    return engine(
        command, vllm_args(VLLM_TP, MODEL), gpus=VLLM_TP, env=[*lmcache_env(), *env], mounts=mounts,
        comment=comment, name="vllm", image=VLLM_IMAGE, port=VLLM_PORT,
        image_comment="""
            LMCache's release image for 0.5.6: vLLM with LMCache installed (check the vLLM it carries: this
            project reads LMCache 0.5.6 under vLLM 0.31.0, whose wheel these flags, the
            vllm.general_plugins group and VLLM_PLUGINS were checked against). Or your own, FROM
            vllm/vllm-openai with `pip install lmcache`. Pin its digest in production.
            """,
        security=engine_security("The vLLM image", "torch compile, Triton, FlashInfer"))


# Copies the exporter package and its distribution metadata from the sidecar's image into an emptyDir on
# the engine's PYTHONPATH. The metadata (METADATA and entry_points.txt, in a *.dist-info directory) is what
# vLLM finds the plugin by: importlib.metadata looks for distributions on sys.path, and vLLM loads the
# entry points of the group vllm.general_plugins from there. An installed wheel's metadata file is METADATA;
# an egg-info's (a source checkout installed in place) is PKG-INFO, in the same format.
INSTALL_PLUGIN = f"""\
import importlib.metadata, pathlib, shutil, exporter
target = pathlib.Path('{CLIENT_DIR}')
shutil.copytree(pathlib.Path(exporter.__file__).parent, target / 'exporter',
                ignore=shutil.ignore_patterns('__pycache__'), dirs_exist_ok=True)
dist = importlib.metadata.distribution('hicache-exporter')
info = target / f'hicache_exporter-{{dist.version}}.dist-info'
info.mkdir(exist_ok=True)
(info / 'METADATA').write_text(dist.read_text('METADATA') or dist.read_text('PKG-INFO'))
(info / 'entry_points.txt').write_text(dist.read_text('entry_points.txt'))
"""


def vllm_push_example(ns: str) -> list[dict[str, Any]]:
    """One pod: vLLM + LMCache, LMCache's metrics pushed through the vLLM plugin to the sidecar."""
    install = install_step("install-hicache-plugin", f"""
        Runs once, first: installs the exporter's Python package (the client and the LMCache hook, no
        torch) from the sidecar image into the emptyDir on the engine's PYTHONPATH, with its
        distribution metadata: its entry point {VLLM_PLUGIN} (group vllm.general_plugins) is how vLLM
        finds the plugin. Its imports (prometheus_client, msgspec, pydantic, PyYAML) are vLLM's own
        dependencies.
        """, INSTALL_PLUGIN)
    vllm = vllm_engine(
        ["vllm", "serve"],
        env=[
            {Key("name", "The socket the plugin's clients push to (the sidecar's ingest.socket_path)."):
             "HICACHE_EXPORTER_SOCKET", "value": SOCKET},
            {Key("name", f"""
                The installed package and its metadata. vLLM's processes (the API server, the engine core,
                one worker per GPU) inherit it, and each loads the plugin. No VLLM_PLUGINS: unset, vLLM
                loads every plugin it finds; set, it must name {VLLM_PLUGIN} too.
                """): "PYTHONPATH", "value": CLIENT_DIR},
        ],
        mounts=[
            {"name": "hicache-socket", "mountPath": SOCKET_DIR},
            {"name": "hicache-client", "mountPath": CLIENT_DIR, "readOnly": True},
        ],
        comment="""
            vLLM with LMCache as its KV connector, started as released (`vllm serve`). The plugin sets
            LMCache's metric classes in every vLLM process before LMCache makes its loggers, so every
            worker's and the scheduler's LMCache families are pushed over the socket: DP replicas apart,
            the set_function gauges too, reset_counters() as a new epoch. The engine's own metrics stay
            as they are.
            """)
    client_volume = {Key("name", "The exporter package and its metadata, installed by install-hicache-plugin."):
                     "hicache-client", "emptyDir": {"sizeLimit": "64Mi"}}
    sidecar_args = serve_args("--profile", LMCACHE_PROFILE)
    spec = pod_spec([install, sidecar(sidecar_args)], [vllm], volumes("vllm-lmcache-exporter", client_volume))
    return [config_map("vllm-lmcache-exporter", "vllm-lmcache", ns, proxy=False, app=VLLM_APP),
            deployment("vllm-lmcache", "vllm-lmcache", spec, app=VLLM_APP)]


# The engine's command in the proxy example: empty the multiprocess directory, then vLLM as released.
WIPE_AND_SERVE = 'rm -rf "${PROMETHEUS_MULTIPROC_DIR:?}"/* && exec vllm serve "$@"'


def vllm_proxy_example(ns: str) -> list[dict[str, Any]]:
    """One pod: vLLM + LMCache unmodified, the sidecar reading vLLM's /metrics with the lmcache profile."""
    mount = {"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR}
    vllm = vllm_engine(
        ["/bin/sh", "-c", WIPE_AND_SERVE, "vllm"],
        env=[{Key("name", """
            Set at start, so that every vLLM process (and LMCache in each) writes prometheus_client's
            multiprocess files here, and vLLM's /metrics merges them all. Without it LMCache's series stay
            in each worker's own registry, and vLLM's /metrics shows none of them (LMCache's own default
            directory is set too late to take effect).
            """): "PROMETHEUS_MULTIPROC_DIR", "value": MULTIPROC_DIR}],
        mounts=[dict(mount)],
        comment=f"""
            vLLM with LMCache, unmodified. The command empties the multiprocess directory first, as vLLM
            asks of a PROMETHEUS_MULTIPROC_DIR the operator sets (a restarted container must not add up
            the files of the processes before it), then runs `vllm serve` with these args. Its /metrics on
            port {VLLM_PORT} stays private to the pod: Prometheus scrapes the sidecar only (vLLM's own
            vllm: families pass through it unchanged).
            """)
    multiproc_volume = {Key("name", """
        vLLM's prometheus_client multiprocess files. On disk: they grow with processes and series. The
        sidecar could read this directory itself instead of /metrics (--upstream-multiprocess-dir, mounted
        read-only there); the URL is kept here because it needs nothing shared with the sidecar, and both
        see the same merged families.
        """): "prometheus-multiproc", "emptyDir": {"sizeLimit": "1Gi"}}
    sidecar_args = serve_args("--upstream", VLLM_UPSTREAM_URL, "--upstream-profile", LMCACHE_PROFILE,
                              "--upstream-world", f"tp={VLLM_TP}")
    spec = pod_spec([sidecar(sidecar_args)], [vllm], volumes("vllm-lmcache-proxy-exporter", multiproc_volume))
    return [config_map("vllm-lmcache-proxy-exporter", "vllm-lmcache-proxy", ns, proxy=True, app=VLLM_APP),
            deployment("vllm-lmcache-proxy", "vllm-lmcache-proxy", spec, app=VLLM_APP)]


def model_cache() -> list[dict[str, Any]]:
    return [{
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": {"name": "sglang-model-cache", "labels": {NAME_LABEL: APP}},
        "spec": {
            Key("accessModes", "ReadWriteMany so the pods of a LeaderWorkerSet group (and a rollout's next pod) "
                               "share one download; a single pod can use ReadWriteOnce."): ["ReadWriteMany"],
            "resources": {"requests": {"storage": "1Ti"}},
            Key("storageClassName", "Yours: one that offers ReadWriteMany (NFS, CephFS, a cloud file store)."):
                "shared-files",
        },
    }]


def pod_monitor() -> list[dict[str, Any]]:
    return [{
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PodMonitor",
        "metadata": {"name": EXPORTER, "labels": {NAME_LABEL: APP, "app.kubernetes.io/component": EXPORTER}},
        "spec": {
            Key("selector", "Every example pod: the SGLang ones and the vLLM + LMCache ones."):
                {"matchExpressions": [{"key": NAME_LABEL, "operator": "In", "values": [APP, VLLM_APP]}]},
            "podMetricsEndpoints": [{
                Key("port", "The sidecar's container port name (9400). Pod discovery lists init containers' "
                            "ports too, so the native sidecar's port matches; do not drop init containers."): "metrics",
                "path": "/metrics",
                "scheme": "http",
                Key("interval", "15s resolves the sidecar's 60 s window and keeps rate(...[$__rate_interval]) "
                                "well-defined."): "15s",
                "scrapeTimeout": "10s",
                Key("honorLabels", "Keep the sidecar's own labels (tp_rank, ..., cache_type); on a clash the "
                                   "target's labels win as exported_<name>."): False,
                Key("relabelings", """
                    `server`: which LLM server a pod belongs to, kept by the recording rules (they drop pod and
                    instance). A single-pod server is its pod; the pods of one LeaderWorkerSet group are one
                    server, named by the set and the group index. Without it the token rules would take the max
                    of two single-pod servers at dp_rank 0 instead of adding them.
                    """): [
                    {"sourceLabels": ["__meta_kubernetes_pod_name"], "targetLabel": "server"},
                    {"sourceLabels": ["__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_name",
                                      "__meta_kubernetes_pod_label_leaderworkerset_sigs_k8s_io_group_index"],
                     "regex": "(.+);(.+)", "replacement": "$1-$2", "targetLabel": "server"},
                ],
            }],
        },
    }]


def annotations_patch() -> list[dict[str, Any]]:
    return [{
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sglang-hicache"},
        "spec": {"template": {"metadata": {"annotations": {
            "prometheus.io/scrape": "true",
            Key("prometheus.io/port", "The sidecar's metrics port, not the engine's."): str(METRICS_PORT),
            "prometheus.io/path": "/metrics",
        }}}},
    }]


def multiprocess_dir_patch() -> list[dict[str, Any]]:
    mount = {"name": "prometheus-multiproc", "mountPath": MULTIPROC_DIR}
    return [{
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "sglang-proxy"},
        "spec": {"template": {"spec": {
            "initContainers": [{
                "name": EXPORTER,
                Key("args", "Replaces the --upstream URL: the directory is read instead."):
                    serve_args("--upstream-multiprocess-dir", MULTIPROC_DIR),
                "volumeMounts": [{**mount, "readOnly": True}],
            }],
            "containers": [{
                "name": "sglang",
                "env": [{Key("name", """
                    The engine writes its prometheus_client files here (SGLang 0.5.23 keeps a directory the
                    operator sets, utils/common.py set_prometheus_multiproc_dir) and still serves /metrics.
                    """): "PROMETHEUS_MULTIPROC_DIR", "value": MULTIPROC_DIR}],
                "volumeMounts": [dict(mount)],
            }],
            "volumes": [{Key("name", "Not memory-backed: the files grow with processes and series, and an "
                                     "emptyDir keeps them across container restarts, where each dead process's "
                                     "files stay apart (a new pid is an exact restart to the sidecar)."):
                         "prometheus-multiproc", "emptyDir": {"sizeLimit": "1Gi"}}],
        }}},
    }]
