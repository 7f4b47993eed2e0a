"""PDConnector beside someone else's offload tier, in one vLLM instance, through vLLM's MultiConnector.

One vLLM CPU server, ``MultiConnector([PDConnector kv_both, OffloadingConnector])``: vLLM's own CPU
offloading connector, all of it vLLM's code except its CUDA copy engine, which cannot run on vLLM CPU
(``CPUOffloadingSpec.get_worker``: "CPU Offloading is currently only supported on CUDA-alike and XPU
GPUs") and is replaced by host copies (tests/support/offload_cpu_spec.py). Prefix caching is off, so what a
request finds again comes from the offload tier, never from the instance's own block cache.

Shown: outputs equal the plain instance's; the second turn of a conversation loads its first turn's
blocks from the offload tier (vLLM's offload metrics and prompt-token sources say so, PD loads do not
move); a PD transfer (prefill leg and decode leg on this same kv_both instance, over its own KV
endpoint: the whole transport path) is PD's, not the offload tier's, pull and push; nothing held.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.offload_cpu_spec import OFFLOAD
from tests.support.prompt_catalogue import CONNECTOR_CASES, STORE_CASES

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def multi_config(kv_port: int) -> dict[str, Any]:
    pd = ec.connector_config("kv_both", kv_port, lease_s=20.0)
    return {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [pd, OFFLOAD]},
    }


@pytest.fixture(scope="module")
def multi(reference_outputs, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The one instance; runs alone (tests/conftest.py runs this module before the session's pair)."""
    kv_port = ec.free_port()
    spec = ec.server_spec(small_model_dir, "0-1", multi_config(kv_port))
    spec.extra_args.append("--no-enable-prefix-caching")
    # the engine's processes import tests.support.offload_cpu_spec
    spec.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    [inst] = ec.start_all([(spec, kv_port)], tmp_path_factory.mktemp("vllm-logs"))
    yield inst
    ec.stop_all([inst])


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


def family(client: httpx.Client, url: str, prefix: str) -> float:
    """Sum of every sample of the metrics whose name starts with ``prefix`` (counters' ``_total``)."""
    total = 0.0
    for line in client.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith(prefix) and not line.startswith("#"):
            name = line.split("{", 1)[0].split(" ", 1)[0]
            if name in (prefix, prefix + "_total"):
                total += float(line.rpartition(" ")[2])
    return total


def counters(client: httpx.Client, inst: ec.Instance) -> dict[str, float]:
    sources = {
        s: ec.metric(client, inst.url, "vllm:prompt_tokens_by_source_total", source=s)
        for s in ("external_kv_transfer", "local_compute")
    }
    return {
        **sources,
        "offload_loaded": family(client, inst.url, "vllm:kv_offload_load_bytes"),
        "offload_stored": family(client, inst.url, "vllm:kv_offload_store_bytes"),
        "pd_loads": ec.metric(client, inst.url, "vllm:pd_loads_total", result="ok"),
    }


def delta(client: httpx.Client, inst: ec.Instance, before: dict[str, float]) -> dict[str, float]:
    return {k: v - before[k] for k, v in counters(client, inst).items()}


def settled(client: httpx.Client, inst: ec.Instance) -> None:
    """No KV held by a request or a transfer (offload stores finished too: their blocks are freed last)."""
    assert ec.wait_until(
        lambda: (
            ec.metric(client, inst.url, "vllm:kv_cache_usage_perc") == 0
            and ec.metric(client, inst.url, "vllm:pd_held_transfers") == 0
        ),
        timeout=60,
    ), f"{inst.url} still holds KV"


def test_output_equals_plain_and_repeats_come_from_the_offload_tier(multi, reference_outputs, client) -> None:
    keys = ["ids1", "ids129", "ids300", "text2", "chat2", "ids1000"]
    for key in keys:
        assert ec.output_tokens(ec.post(client, multi.url, CONNECTOR_CASES[key])) == reference_outputs[key], key
    settled(client, multi)
    before = counters(client, multi)
    for key in keys:  # again: the prompts' full blocks are in the offload tier now
        assert ec.output_tokens(ec.post(client, multi.url, CONNECTOR_CASES[key])) == reference_outputs[key], key
    d = delta(client, multi, before)
    assert d["offload_loaded"] > 0 and d["external_kv_transfer"] > 0, d
    assert d["pd_loads"] == 0, d
    settled(client, multi)


def test_second_turn_of_a_conversation_is_served_from_the_offload_tier(multi, reference_outputs, client) -> None:
    """store_turn2 = store_turn1 (300 tokens) + the reply and the next message (120 tokens)."""
    turn1 = ec.post(client, multi.url, STORE_CASES["store_turn1"])
    assert ec.output_tokens(turn1) == reference_outputs["store_turn1"]
    settled(client, multi)
    before = counters(client, multi)
    turn2 = ec.post(client, multi.url, STORE_CASES["store_turn2"])
    assert ec.output_tokens(turn2) == reference_outputs["store_turn2"]
    d = delta(client, multi, before)
    block = 128  # vLLM CPU's block size: the first turn's full blocks are what the tier holds
    assert d["external_kv_transfer"] == 300 // block * block, d
    assert d["local_compute"] == 420 - 300 // block * block, d
    assert d["offload_loaded"] > 0 and d["pd_loads"] == 0, d
    settled(client, multi)


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_pd_transfer_is_pds_beside_the_offload_tier(mode: str, multi, reference_outputs, client) -> None:
    """Prefill leg and decode leg on the one kv_both instance, KV over its own endpoint. The offload
    tier holds the prompt too (the prefill leg stored it), but MultiConnector asks PD first."""
    keys = ["ids255", "ids640", "chat1"] if mode == "pull" else ["ids256", "ids512", "text4"]
    for key in keys:
        before = counters(client, multi)
        p, d = ec.disagg(client, multi, multi, CONNECTOR_CASES[key], mode)
        assert ec.output_tokens(d) == reference_outputs[key], key
        moved = delta(client, multi, before)
        prompt_tokens = d["usage"]["prompt_tokens"]
        assert moved["pd_loads"] == 1, (key, moved)
        # the decode leg computed one prompt token (layer-wise load), PD brought the rest
        assert moved["external_kv_transfer"] == prompt_tokens - 1, (key, moved)
        assert moved["offload_loaded"] == 0, (key, moved)
    settled(client, multi)


def test_both_connectors_report_their_metrics(multi, client) -> None:
    text = client.get(multi.url + "/metrics", timeout=30).text
    assert "vllm:pd_loads_total" in text and "vllm:kv_offload_store_bytes" in text
    log = multi.server.log_path.read_text(errors="replace") if multi.server.log_path else ""
    assert "Traceback" not in log, ec.live_log_digest()


@pytest.mark.parametrize("mode,key", [("pull", "ids1000"), ("push", "ids300")])
def test_a_prefill_leg_that_loads_from_the_offload_tier_still_hands_everything_to_decode(
    mode: str, key: str, multi, reference_outputs, client
) -> None:
    """The prompt's full blocks are in the offload tier (the first test sent it twice): the prefill
    leg loads them from there instead of computing them, and PD still moves the whole prompt."""
    before = counters(client, multi)
    p = ec.post(client, multi.url, ec.prefill_leg(CONNECTOR_CASES[key], mode, multi))
    prefill_leg = delta(client, multi, before)
    assert prefill_leg["offload_loaded"] > 0 and prefill_leg["external_kv_transfer"] > 0, prefill_leg
    before = counters(client, multi)
    d = ec.post(client, multi.url, dict(CONNECTOR_CASES[key], kv_transfer_params=p["kv_transfer_params"]))
    assert ec.output_tokens(d) == reference_outputs[key]
    decode_leg = delta(client, multi, before)
    assert decode_leg["pd_loads"] == 1 and decode_leg["offload_loaded"] == 0, decode_leg
    assert decode_leg["external_kv_transfer"] == d["usage"]["prompt_tokens"] - 1, decode_leg
    settled(client, multi)
