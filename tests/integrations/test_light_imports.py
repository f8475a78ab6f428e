"""The engine integrations are light: an engine process that loads one loads no YAML, pydantic or aiohttp
(nor, for LMCache's, the engine itself: it imports LMCache only when installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("yaml", "pydantic", "pydantic_core", "aiohttp", "torch")
SIDECAR = ("exporter.catalog", "exporter.config", "exporter.sidecar", "exporter.cli")


def loaded_after(code: str, engines: tuple[str, ...] = ()) -> list[str]:
    """The heavy, sidecar and `engines` modules a fresh interpreter of this environment holds after running `code`."""
    roots = HEAVY + engines
    probe = (f"import json, sys\n{code}\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {roots!r} "
             f"or '.'.join(m.split('.')[:2]) in {SIDECAR!r})))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_the_sglang_integration_loads_no_yaml_pydantic_or_aiohttp(ranks: ModuleType) -> None:
    # The released collectors (the `ranks` fixture has the wheel) stand in for the engine's own module.
    code = ("from tests.upstream_sglang import install\n"
            "install()\n"
            "from exporter.integrations import sglang\n"
            "from exporter.rank_catalog import MetricType\n"
            "assert sglang.catalog_family('sglang:evicted_tokens', MetricType.COUNTER) is not None")
    assert loaded_after(code) == []


def test_the_lmcache_integration_loads_no_yaml_pydantic_aiohttp_or_lmcache() -> None:
    code = ("import exporter.integrations.lmcache as hook\n"
            "from exporter.rank_catalog import MetricType\n"
            "assert hook.profile_family('lmcache:num_hit_tokens', MetricType.COUNTER) is not None")
    assert loaded_after(code, ("lmcache", "vllm")) == []
