"""A hybrid model (sliding-window layers beside full attention) disaggregated on real vLLM CPU servers.

The model: `vllm-pd make-model --sliding-window 128 --full-attention-every 4` (Gemma 3 /
Mistral-style ``layer_types``): three sliding-window layers and one full-attention layer.
PDConnector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on (one KV
cache group per kind of layer, a window's blocks freed behind it) with the connector
configured. The promises: greedy output == a plain instance's, token for token; decode
computes only the prompt's last token (every group's KV came from prefill, the windows'
blocks only inside the window); and afterwards neither side holds a block.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from tests.e2e.test_connector_e2e import assert_nothing_held, prompt_sources
from vllm_pd.small_model import ModelSpec
from vllm_pd.small_model.cache import ensure_model

pytestmark = pytest.mark.e2e

WINDOW = 128
KEYS = ("ids17", "ids129", "ids300", "ids640", "ids1500", "text3", "chat2")
HYBRID_GROUPS = "groups window/"  # the worker's log line names its KV cache groups


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(ModelSpec(sliding_window=WINDOW, full_attention_every=4),
                        cache_dir=tmp_path_factory.mktemp("vllm-pd-hybrid-cache"))


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs of a plain instance of the hybrid model (hybrid KV cache manager on), alone."""
    [plain] = ec.start_all([(ec.server_spec(hybrid_model, "0-1", None), None)],
                           tmp_path_factory.mktemp("vllm-hybrid-logs"))
    try:
        with httpx.Client() as client:
            return {key: ec.output_tokens(ec.post(client, plain.url, CONNECTOR_CASES[key])) for key in KEYS}
    finally:
        ec.stop_all([plain])


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_reference: dict[str, list[int]], hybrid_model: Path,
                tmp_path_factory: pytest.TempPathFactory):
    specs = []
    for cores in ("0", "1"):
        kv_port = ec.free_port()
        spec = ec.server_spec(hybrid_model, cores, ec.connector_config("kv_both", kv_port, lease_s=20.0))
        specs.append((spec, kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp("vllm-hybrid-logs"))
    yield instances
    ec.stop_all(instances)


def test_hybrid_kv_cache_manager_stays_on(hybrid_pair) -> None:
    """vLLM kept one KV cache group per kind of layer with PDConnector configured."""
    for inst in hybrid_pair:
        log = inst.server.log_path.read_text(errors="replace") if inst.server.log_path else ""
        assert "Turning off hybrid kv cache manager" not in log
        assert HYBRID_GROUPS in log and "full/" in log, f"{inst.url}: no hybrid KV cache groups in its log"


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
def test_hybrid_disaggregated_output_equals_plain(mode: str, hybrid_pair, hybrid_reference, client) -> None:
    prefill, decode = hybrid_pair
    source = "fetch" if mode == "pull" else "push"
    ok_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok")
    blocks_before = ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=source)
    mismatches, transferred = [], 0
    for key in KEYS:
        before = prompt_sources(client, decode)
        _, d = ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], mode)
        ext, local, hit = (a - b for a, b in zip(prompt_sources(client, decode), before))
        if ec.output_tokens(d) != hybrid_reference[key]:
            mismatches.append(key)
        prompt_tokens = d["usage"]["prompt_tokens"]
        assert local == 1, f"{key}: decode computed {local} of {prompt_tokens} prompt tokens"
        assert ext > 0 or hit == prompt_tokens - 1, f"{key}: nothing was transferred ({hit} cached here)"
        transferred += ext > 0
    assert not mismatches, f"{mode}: outputs differ from the plain instance for {mismatches}"
    assert transferred >= len(KEYS) // 2
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok") - ok_before >= transferred
    assert ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=source) > blocks_before
    assert_nothing_held(client, hybrid_pair)
