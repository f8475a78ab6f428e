"""The engine integrations are light: an engine process that loads one loads no YAML, pydantic or aiohttp
(nor, for LMCache's, the engine itself: it imports LMCache only when installed)."""

from __future__ import annotations

from types import ModuleType

from tests.helpers import HEAVY_MODULES, loaded_after

ROOTS = (*HEAVY_MODULES, "torch")


def test_the_sglang_integration_loads_no_yaml_pydantic_or_aiohttp(ranks: ModuleType) -> None:
    # The released collectors (the `ranks` fixture has the wheel) stand in for the engine's own module.
    code = ("from tests.upstream_sglang import install\n"
            "install()\n"
            "from exporter.integrations import sglang\n"
            "from exporter.rank_catalog import MetricType\n"
            "assert sglang.catalog_family('sglang:evicted_tokens', MetricType.COUNTER) is not None")
    assert loaded_after(code, ROOTS) == []


def test_the_lmcache_integration_loads_no_yaml_pydantic_aiohttp_or_lmcache() -> None:
    code = ("import exporter.integrations.lmcache as hook\n"
            "from exporter.rank_catalog import MetricType\n"
            "assert hook.profile_family('lmcache:num_hit_tokens', MetricType.COUNTER) is not None")
    assert loaded_after(code, (*ROOTS, "lmcache", "vllm")) == []
