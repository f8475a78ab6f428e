"""The push door's label value limits over a real Unix socket: a model path (LMCache's model_name is the path
vLLM was given, often a Hugging Face snapshot path) fits the default ranks.max_label_value_length (1024) of a
static label; past it the hello is refused, naming the label and the limit. A family's own label values (pool,
reason) are short words, held to ranks.max_family_label_value_length (128).

The proxy door's side is in tests/exporter/sidecar/upstream/test_profiles.py (test_a_model_path_*)."""

from __future__ import annotations

import pytest

from exporter.config import SidecarConfig
from exporter.protocol.messages import ErrorMessage, Welcome
from tests.helpers import RawClient, SidecarThread, counter, hello, snapshot, wait_until

MODEL_PATH = "/root/.cache/huggingface/hub/models--Qwen--Qwen3-8B/snapshots/"


def model_path(length: int) -> str:
    return (MODEL_PATH + "0" * length)[:length]


def test_the_default_label_value_limit_fits_a_model_path() -> None:
    assert SidecarConfig().ranks.max_label_value_length == 1024


@pytest.mark.parametrize("length", [129, 600, 1024])
def test_a_hello_and_a_sample_with_a_long_model_path_are_taken(sidecar: SidecarThread, length: int) -> None:
    """Before: a value over 128 characters was refused (invalid_hello for a static label, wrong_labels for a sample's)."""
    client = RawClient(sidecar.socket_path)
    try:
        client.send(hello(tp=0, epoch="long", model_name=model_path(length)))
        assert isinstance(client.recv(), Welcome)
        client.send(snapshot(1, counter("load_back_tokens_total", 64.0, pool="p" * 128),
                             counter("load_back_tokens_total", 5.0, pool="p" * 129)))
        wait_until(lambda: sidecar.scrape().find("sglang_load_back_tokens_total", tp_rank="0") != [])
        scrape = sidecar.scrape()
        assert scrape.value("sglang_load_back_tokens_total", model_name=model_path(length), pool="p" * 128) == 64
        assert scrape.find("sglang_load_back_tokens_total", pool="p" * 129) == []  # refused alone: a family label
        assert scrape.total("hicache_exporter_rejections_total") == 1
    finally:
        client.close()


def test_a_hello_past_the_limit_is_refused_naming_the_label_and_the_limit(sidecar: SidecarThread) -> None:
    client = RawClient(sidecar.socket_path)
    try:
        client.send(hello(tp=0, epoch="long", model_name="m" * 1025))
        assert client.recv() == ErrorMessage(
            code="invalid_hello", message="static label: value of label 'model_name' is longer than 1024 characters")
        assert client.closed_by_peer()
    finally:
        client.close()
