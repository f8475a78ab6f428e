"""The rank client is light: an engine process that imports and uses it loads no YAML, pydantic or aiohttp."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# What the sidecar's side loads: YAML and pydantic for its config and catalog, aiohttp for its server.
HEAVY = ("yaml", "pydantic", "pydantic_core", "aiohttp")
SIDECAR = ("exporter.catalog", "exporter.config", "exporter.sidecar", "exporter.cli")


def loaded_after(code: str) -> list[str]:
    """The heavy and sidecar modules a fresh interpreter of this environment holds after running `code`."""
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} "
             f"or '.'.join(m.split('.')[:2]) in {SIDECAR!r})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_importing_the_client_loads_no_yaml_pydantic_or_aiohttp() -> None:
    assert loaded_after("import exporter.client") == []


def test_a_client_with_its_catalog_loads_no_yaml_pydantic_or_aiohttp() -> None:
    # The packaged catalog is read when a client is made, pre-built: still no YAML.
    code = ("from exporter.client import RankClient\n"
            "client = RankClient('/nonexistent/metrics.sock')\n"
            "client.counter('evicted_tokens_total').inc()\n"
            "assert client.metrics.samples()")
    assert loaded_after(code) == []
