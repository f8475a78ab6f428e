# syntax=docker/dockerfile:1
#
# hicache-exporter sidecar image.
#
# Only the sidecar goes in here: exporter/ with its runtime dependencies
# (prometheus_client, aiohttp, pydantic, msgspec, PyYAML, bcrypt). cache_core/ and the optional
# `cache` extra (torch) never enter the image; `hicache-exporter demo` therefore
# does not run in it, by design.
#
#   docker build -t hicache-exporter:0.1.0 .
#   docker run --rm -p 9400:9400 -v /run/hicache:/run/hicache hicache-exporter:0.1.0
#   docker run --rm -v "$PWD/sidecar.yaml:/etc/hicache-exporter/sidecar.yaml:ro" \
#       hicache-exporter:0.1.0 serve --config /etc/hicache-exporter/sidecar.yaml
#
# Config: the image ships the packaged defaults and sets no config path. Pass a
# file with `serve --config FILE`, or set HICACHE_EXPORTER_CONFIG=FILE at run
# time (a flag beats the environment, which beats the file, which beats the
# defaults). HICACHE_EXPORTER_PORT and HICACHE_EXPORTER_SOCKET override the port
# and the ingest socket path the same way.
#
# No HEALTHCHECK on purpose: the image runs as a Kubernetes sidecar, where the
# kubelet's startup and liveness probes (GET /-/healthy) do this job (see
# config/k8s/*.yaml and docs/kubernetes.md; GET /-/ready says the ingest socket
# listens). Kubernetes ignores a Dockerfile HEALTHCHECK, and the slim base has no
# curl/wget to run one with.
#
# The base image is pinned to a Python minor version and Debian release. For
# reproducible production builds pin its digest too (python:3.11-slim-bookworm@sha256:...).

############################ builder: wheels only ############################
FROM python:3.11-slim-bookworm AS builder

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

WORKDIR /src
# .dockerignore keeps the context to pyproject.toml, README.md (the package's
# readme) and exporter/; cache_core/ is not sent, so the wheel cannot contain it.
COPY pyproject.toml README.md ./
COPY exporter ./exporter

# 1. the project's own wheel (pip fetches setuptools/wheel for an isolated build);
# 2. wheels of its runtime dependencies, read from that wheel's metadata: the
#    base requirements only, never an extra, so torch cannot come along.
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels . \
    && pip wheel --no-cache-dir --wheel-dir /wheels /wheels/hicache_exporter-*.whl

############################ runtime ############################
FROM python:3.11-slim-bookworm

LABEL org.opencontainers.image.title="hicache-exporter" \
      org.opencontainers.image.description="Rank-aware Prometheus exporter sidecar for HiCache KV-cache metrics" \
      org.opencontainers.image.licenses="Apache-2.0"

# PYTHONDONTWRITEBYTECODE: the root filesystem is read-only in the pod, so never
# try to write .pyc at run time (pip byte-compiles the installed packages once,
# below, as root). PYTHONUNBUFFERED: logs reach `kubectl logs` at once.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Install from the builder's wheels only (--no-index: no network, no compiler).
# The wheels are bind-mounted for this one step, so they are not left in a layer.
# setuptools and wheel (shipped by the 3.11 base) are build tools the sidecar
# never imports: remove them (a no-op on bases without them). The last command
# proves the console script starts without torch.
RUN --mount=type=bind,from=builder,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels /wheels/hicache_exporter-*.whl \
    && pip uninstall --yes setuptools wheel \
    && hicache-exporter version

# build_info's revision label (the image holds no git checkout to read it from):
#   docker build --build-arg REVISION="$(git rev-parse HEAD)" -t hicache-exporter:0.1.0 .
ARG REVISION=unknown
LABEL org.opencontainers.image.revision="${REVISION}"
ENV HICACHE_EXPORTER_REVISION="${REVISION}"

# A numeric uid:gid (no passwd entry needed) lets Kubernetes verify
# runAsNonRoot; 65532 is the conventional "nonroot" id of distroless images and
# matches the sidecar's runAsUser/runAsGroup and the pods' fsGroup in config/k8s/.
USER 65532:65532

# /metrics, /-/healthy, /-/ready. 9400 is also dcgm-exporter's default port:
# move one of them (--port / HICACHE_EXPORTER_PORT) when both share a pod network.
EXPOSE 9400

# `serve` shuts down within seconds on SIGTERM and removes its socket.
STOPSIGNAL SIGTERM
ENTRYPOINT ["hicache-exporter"]
CMD ["serve"]
