"""A hybrid model (sliding-window layers beside full attention) disaggregated on real vLLM CPU servers.

The model: `vllm-pd make-model --sliding-window 128 --full-attention-every 4` (Gemma 3 /
Mistral-style ``layer_types``): three sliding-window layers and one full-attention layer.
PDConnector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on (one KV
cache group per kind of layer, a window's blocks freed behind it) with the connector
configured. The promises: greedy output == a plain instance's, token for token; decode
computes only the prompt's last token (every group's KV came from prefill, the windows'
blocks only inside the window); and afterwards neither side holds a block.

And a pairing the connector cannot serve: the same model on a decode instance with the hybrid KV
cache manager off (one KV cache group, full-length KV for every layer) beside a prefill that has
it on. Prefill's KV comes in other groups, so the transfer is refused at the handshake (the KV
shapes both sides exchange), with a log line naming the reason and ``vllm:pd_shape_refused_total``
counted, and decode computes the prompt at once: it never waits for KV that will not come.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_nothing_held, assert_prefill_served, prompt_sources
from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.small_model import ModelSpec
from vllm_pd.small_model.cache import ensure_model

pytestmark = pytest.mark.e2e

WINDOW = 128
KEYS = ("ids17", "ids129", "ids300", "ids640", "ids1500", "text3", "chat2")
HYBRID_GROUPS = "groups window/"  # the worker's log line names its KV cache groups
# the refusing decode's waits for KV (an announcement, pushes): long, so that a wait would show
TRANSFER_TIMEOUT_S, PUSH_WAIT_S = 120.0, 60.0
REFUSED_KEYS = {"pull": ("ids129", "ids1500", "text3"), "push-beside": ("ids300", "ids640", "chat2")}
GROUPS_REFUSED = "KV cache groups differ"  # kv_geometry.incompatibility's reason
# vLLM's line when it recomputes the tokens of a failed load (kv_load_failure_policy recompute)
RECOVERED = re.compile(r"Recovered from KV load failure: 1 request\(s\) rescheduled \((\d+) tokens affected\)")


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(
        ModelSpec(sliding_window=WINDOW, full_attention_every=4),
        cache_dir=tmp_path_factory.mktemp("vllm-pd-hybrid-cache"),
    )


@pytest.fixture(scope="module")
def hybrid_reference(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs of a plain instance of the hybrid model (hybrid KV cache manager on), alone."""
    [plain] = ec.start_all(
        [(ec.server_spec(hybrid_model, "0-1", None), None)], tmp_path_factory.mktemp("vllm-hybrid-logs")
    )
    try:
        with httpx.Client() as client:
            return {key: ec.output_tokens(ec.post(client, plain.url, CONNECTOR_CASES[key])) for key in KEYS}
    finally:
        ec.stop_all([plain])


@pytest.fixture(scope="module")
def hybrid_pair(hybrid_reference: dict[str, list[int]], hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory):
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
    assert_prefill_served(client, prefill, decode, KEYS, mode, hybrid_reference)


@pytest.fixture(scope="module")
def one_group_decode(hybrid_pair, hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """The hybrid model on a decode instance with vLLM's hybrid KV cache manager off (one KV cache
    group), waiting up to TRANSFER_TIMEOUT_S for an announcement and PUSH_WAIT_S for pushes."""
    kv_port = ec.free_port()
    ktc = ec.connector_config("kv_consumer", kv_port, transfer_timeout_s=TRANSFER_TIMEOUT_S, push_wait_s=PUSH_WAIT_S)
    spec = ec.server_spec(hybrid_model, "1", ktc)
    spec.extra_args.append("--disable-hybrid-kv-cache-manager")
    [decode] = ec.start_all([(spec, kv_port)], tmp_path_factory.mktemp("vllm-hybrid-logs"))
    yield decode
    ec.stop_all([decode])


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
def test_other_kv_cache_groups_are_refused_at_once(
    mode: str, hybrid_pair, one_group_decode, hybrid_reference, client
) -> None:
    """Prefill (hybrid manager on) -> decode (off): refused for its KV cache groups, recomputed at once.

    pull: decode refuses when the decode leg comes (prefill's answer names its shape) and computes the
    whole prompt. push-beside: prefill asks decode's shape before pushing, refuses and pushes nothing, but
    announces; decode's worker refuses the announced shape, the layer-wise load fails at once, and vLLM
    recomputes its tokens (it counted them as transferred when it admitted the request)."""
    prefill, decode = hybrid_pair[0], one_group_decode
    refused_before = {
        inst.url: ec.metric(client, inst.url, "vllm:pd_shape_refused_total") for inst in (prefill, decode)
    }
    failed_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed")
    keys = REFUSED_KEYS[mode]
    for key in keys:
        before, logged = prompt_sources(client, decode), len(log_text(decode))
        t0 = time.monotonic()
        _, d = ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], mode)
        took = time.monotonic() - t0
        ext, local, hit = (a - b for a, b in zip(prompt_sources(client, decode), before))
        assert ec.output_tokens(d) == hybrid_reference[key], f"{key} {mode}: output differs from the plain instance"
        # a behaviour bound, not a speed target: decode did not sit out a wait for KV that never comes
        assert took < min(TRANSFER_TIMEOUT_S, PUSH_WAIT_S) / 2, f"{key} {mode}: {took:.1f}s - decode waited"
        prompt_tokens = d["usage"]["prompt_tokens"]
        new_lines = log_text(decode)[logged:]
        assert GROUPS_REFUSED in new_lines, f"{key} {mode}: decode logged no reason: {new_lines}"
        if mode == "pull":
            assert (ext, local, hit) == (0, prompt_tokens, 0), (
                f"{key}: {ext} transferred, {local} computed, {hit} cached of {prompt_tokens} prompt tokens"
            )
        else:
            recomputed = [int(n) for n in RECOVERED.findall(new_lines)]
            assert recomputed == [prompt_tokens - 1] and hit == 0, (
                f"{key}: vLLM recomputed {recomputed} of {prompt_tokens} prompt tokens ({hit} cached)"
            )
    assert ec.metric(client, decode.url, "vllm:pd_shape_refused_total") - refused_before[decode.url] == len(keys)
    failed = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed") - failed_before
    assert failed == (len(keys) if mode == "push-beside" else 0)
    if mode == "push-beside":
        assert ec.metric(client, prefill.url, "vllm:pd_shape_refused_total") > refused_before[prefill.url]
        assert f"decode at {decode.kv_endpoint} cannot take our KV ({GROUPS_REFUSED}" in log_text(prefill)
    assert ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total") == 0
    assert_nothing_held(client, [prefill, decode])


def log_text(inst: ec.Instance) -> str:
    return inst.server.log_path.read_text(errors="replace") if inst.server.log_path else ""
