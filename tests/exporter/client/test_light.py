"""The rank client is light: an engine process that imports and uses it loads no YAML, pydantic or aiohttp."""

from __future__ import annotations

from tests.helpers import loaded_after


def test_importing_the_client_loads_no_yaml_pydantic_or_aiohttp() -> None:
    assert loaded_after("import exporter.client") == []


def test_a_client_with_its_catalog_loads_no_yaml_pydantic_or_aiohttp() -> None:
    # The packaged catalog is read when a client is made, pre-built: still no YAML.
    code = ("from exporter.client import RankClient\n"
            "client = RankClient('/nonexistent/metrics.sock')\n"
            "client.counter('evicted_tokens_total').inc()\n"
            "assert client.metrics.samples()")
    assert loaded_after(code) == []
