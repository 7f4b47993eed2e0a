"""The PD connector with a DeepSeek-V2-style (MLA) model on vLLM's CPU MLA backend.

MLA caches one latent vector per token (kv_lora_rank 512 + rope 64 = 576) and
the CPU MLA backend forces 16-token blocks: the connector moves those blocks as
opaque bytes like any other layout. Plain instance first (alone), then the pair.
"""

from __future__ import annotations

import httpx
import pytest

from tests import e2e_cluster as ec
from vllm_pd.small_model import ModelSpec, ensure_model

pytestmark = pytest.mark.e2e

PROMPTS = {
    "short": ec.completion_body("hello"),
    "one_block": ec.completion_body(list(range(100, 116))),  # exactly one 16-token block
    "blocks": ec.completion_body("the prefill instance computes the prompt " * 12),
    "long": ec.completion_body(list(range(7, 7 + 700))),
    "chat": ec.chat_body("tell me about latent attention"),
}


def _spec(model, cores: str, ktc):  # noqa: ANN001, ANN202
    s = ec.server_spec(model, cores, ktc)
    s.max_model_len = 1024
    s.extra_args = [*s.extra_args, "--attention-backend", "CPU_MLA"]
    return s


@pytest.fixture(scope="module")
def mla_runs(tmp_path_factory: pytest.TempPathFactory):
    model = ensure_model(ModelSpec(arch="deepseek_v2"), tmp_path_factory.mktemp("mla-model"))
    logs = tmp_path_factory.mktemp("mla-logs")
    client = httpx.Client()
    [plain] = ec.start_all([(_spec(model, "0-1", None), None)], logs)
    try:
        reference = {k: ec.output_tokens(ec.post(client, plain.url, b)) for k, b in PROMPTS.items()}
    finally:
        ec.stop_all([plain])
    specs = []
    for cores in ("0", "1"):
        kv_port = ec.free_port()
        specs.append((_spec(model, cores, ec.connector_config("kv_both", kv_port)), kv_port))
    pair = ec.start_all(specs, logs)
    try:
        yield client, reference, pair
    finally:
        ec.stop_all(pair)
        client.close()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_mla_disaggregated_output_equals_plain(mode: str, mla_runs) -> None:
    client, reference, (prefill, decode) = mla_runs
    mismatches = [key for key, body in PROMPTS.items()
                  if ec.output_tokens(ec.disagg(client, prefill, decode, body, mode)[1]) != reference[key]]
    assert not mismatches, f"MLA {mode}: outputs differ from the plain instance for {mismatches}"
    source = "push" if mode == "push" else "fetch"
    assert ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=source) > 0
    for inst in (prefill, decode):
        assert ec.wait_until(lambda: ec.metric(client, inst.url, "vllm:kv_cache_usage_perc") == 0
                             and ec.metric(client, inst.url, "vllm:pd_held_transfers") == 0, timeout=15)
