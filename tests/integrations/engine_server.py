"""The engine's /metrics, stood in for: `python -m tests.integrations.engine_server DIR PORT`.

The engine mounts prometheus_client's exposition over a fresh registry holding a
MultiProcessCollector of its PROMETHEUS_MULTIPROC_DIR (utils/common.py:2843-2853); this serves
the same registry with prometheus_client's own HTTP server (same negotiation: text by default,
OpenMetrics on request, gzip when asked) until killed.
"""

from __future__ import annotations

import sys
import time

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.multiprocess import MultiProcessCollector


def main(directory: str, port: int) -> None:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=directory)
    start_http_server(port, addr="127.0.0.1", registry=registry)
    print("serving", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
