"""Prefill -> decode on real vLLM CPU servers with the PD connector.

The core promise: disaggregated greedy output == plain single-instance output,
token for token, in push and pull mode, for prompts from 1 token to near
max-model-len, completions and chat; decode does not recompute the prompt; and
afterwards neither side holds a single KV block.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.protocol.transfer_params import AwaitedPrefill

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


def prompt_sources(client: httpx.Client, inst: ec.Instance) -> tuple[float, float, float]:
    """vLLM's count of prompt tokens (transferred from elsewhere, computed here, found in the local
    prefix cache) on ``inst``."""
    name = "vllm:prompt_tokens_by_source_total"
    return tuple(
        ec.metric(client, inst.url, name, source=source)  # type: ignore[return-value]
        for source in ("external_kv_transfer", "local_compute", "local_cache_hit")
    )


def held_soon(client: httpx.Client, prefill: ec.Instance) -> bool:
    """Prefill reports a held transfer (its gauge follows the request's end by a step or two)."""
    return ec.wait_until(lambda: ec.metric(client, prefill.url, "vllm:pd_held_transfers") >= 1, timeout=10)


def assert_nothing_held(client: httpx.Client, instances: list[ec.Instance]) -> None:
    for inst in instances:
        assert ec.wait_until(
            lambda: (
                ec.metric(client, inst.url, "vllm:kv_cache_usage_perc") == 0
                and ec.metric(client, inst.url, "vllm:pd_held_transfers") == 0
                and ec.metric(client, inst.url, "vllm:pd_loading_requests") == 0
            ),
            timeout=60,  # aborted requests finish their step first; a loaded 2-core CI is slow
        ), (
            f"{inst.url} still holds KV: usage={ec.metric(client, inst.url, 'vllm:kv_cache_usage_perc')} "
            f"held={ec.metric(client, inst.url, 'vllm:pd_held_transfers')}"
        )


def assert_prefill_served(
    client: httpx.Client,
    prefill: ec.Instance,
    decode: ec.Instance,
    keys: Sequence[str],
    mode: str,
    reference: dict[str, list[int]],
    sources: Sequence[str] = (),
    held: Sequence[ec.Instance] = (),
) -> None:
    """``decode`` answers the prompts ``keys`` (of CONNECTOR_CASES) from ``prefill``'s KV, sent in ``mode``
    (ec.disagg): each answer == ``reference`` (a plain instance's greedy tokens); decode computes only the
    prompt's last token (the rest transferred, or found in decode's own prefix cache where an earlier test
    sent the prompt) and most prompts' KV was transferred; decode counts its loads ok, none failed, and blocks and bytes
    loaded from ``sources`` (default: fetch for pull modes, else push); no shape is refused; and afterwards
    none of ``held`` (default: the pair) holds KV."""
    sources = tuple(sources) or (("fetch",) if mode.startswith("pull") else ("push",))
    ok_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok")
    failed_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed")
    refused_before = ec.metric(client, decode.url, "vllm:pd_shape_refused_total")
    bytes_before = ec.metric(client, decode.url, "vllm:pd_loaded_bytes_total")
    blocks_before = loaded_blocks(client, decode, sources)
    mismatches, transferred = [], 0
    for key in keys:
        before = prompt_sources(client, decode)
        _, d = ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], mode)
        ext, local, hit = (a - b for a, b in zip(prompt_sources(client, decode), before))
        if ec.output_tokens(d) != reference[key]:
            mismatches.append(key)
        prompt_tokens = d["usage"]["prompt_tokens"]
        # decode computes the last prompt token only (beside a layer-wise load)
        assert local == 1, f"{key} {mode}: decode computed {local} of {prompt_tokens} prompt tokens"
        assert ext > 0 or hit == prompt_tokens - 1, f"{key}: nothing was transferred ({hit} cached here)"
        transferred += ext > 0
    assert not mismatches, f"{prefill.url} -> {decode.url} {mode}: outputs differ from the plain one for {mismatches}"
    assert transferred >= len(keys) // 2
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok") - ok_before >= transferred
    # a layer-wise load that fails is recomputed by vLLM after it counted the tokens as transferred:
    # prompt sources alone do not show it
    failed = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed") - failed_before
    assert failed == 0, f"{prefill.url} -> {decode.url} {mode}: {failed:.0f} loads failed and were recomputed"
    assert loaded_blocks(client, decode, sources) > blocks_before
    assert ec.metric(client, decode.url, "vllm:pd_loaded_bytes_total") > bytes_before
    assert ec.metric(client, decode.url, "vllm:pd_shape_refused_total") == refused_before
    assert_nothing_held(client, list(held) or [prefill, decode])


def loaded_blocks(client: httpx.Client, decode: ec.Instance, sources: Sequence[str]) -> float:
    """Blocks ``decode`` loaded by any of ``sources`` (fetch, push)."""
    return sum(ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=s) for s in sources)


@pytest.mark.parametrize("mode", ["pull", "push", "push-beside", "pull-beside"])
def test_disaggregated_output_equals_plain(mode: str, pd_pair, reference_outputs, client) -> None:
    prefill, decode = pd_pair
    source = "fetch" if mode.startswith("pull") else "push"
    ok_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok")
    failed_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed")
    blocks_before = ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=source)
    mismatches = []
    transferred = 0  # requests whose KV came from prefill
    for key, body in CONNECTOR_CASES.items():
        before = prompt_sources(client, decode)
        p, d = ec.disagg(client, prefill, decode, body, mode)
        ext, local, hit = (a - b for a, b in zip(prompt_sources(client, decode), before))
        prompt_tokens = d["usage"]["prompt_tokens"]
        assert p["usage"]["prompt_tokens"] == prompt_tokens
        if ec.output_tokens(d) != reference_outputs[key]:
            mismatches.append(key)
        # decode did not compute the prompt: it came from prefill (or, when an earlier test sent
        # the same prompt, partly from decode's own prefix cache). An idle decode loads layer-wise
        # (load_mode auto): the step that samples the first output token computes the prompt's
        # last token itself, beside the load, so exactly that one token counts as computed here.
        if prompt_tokens > 1:
            cached = (d["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            assert local == 1, f"{key}: decode computed {local} of {prompt_tokens} prompt tokens"
            if mode.endswith("-beside"):
                # no prefill answer in the decode leg to take prefill's cache hits from, so vLLM counts
                # the transferred tokens as cached (our proxy rewrites usage with prefill's figure)
                assert cached == prompt_tokens - 1 and ext <= cached, f"{key}: {ext} transferred, {cached} cached"
            else:
                assert ext + cached + local == prompt_tokens, (
                    f"{key}: {ext} transferred + {cached} cached + {local} computed != {prompt_tokens}"
                )
            # nothing to transfer when decode's own prefix cache held all but the last token
            assert ext > 0 or hit == prompt_tokens - 1, f"{key}: nothing was transferred ({hit} cached here)"
            transferred += ext > 0
    assert not mismatches, f"{mode}: outputs differ from the plain instance for {mismatches}"
    assert transferred >= len(CONNECTOR_CASES) // 2
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok") - ok_before >= transferred
    # vLLM recomputes a failed layer-wise load after counting its tokens as transferred: `local == 1`
    # above does not show it
    failed = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed") - failed_before
    assert failed == 0, f"{mode}: {failed:.0f} loads failed and were recomputed"
    assert ec.metric(client, decode.url, "vllm:pd_loaded_blocks_total", source=source) > blocks_before
    assert_nothing_held(client, pd_pair)


def test_tampered_block_ids_are_rejected_and_recomputed(pd_pair, reference_outputs, client) -> None:
    """Decode asks for blocks prefill never granted: the read is refused, decode recomputes."""
    prefill, decode = pd_pair
    key = "ids300"
    body = CONNECTOR_CASES[key]
    failed_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed")
    p = ec.post(client, prefill.url, ec.prefill_leg(body, "pull", decode))
    params = copy.deepcopy(p["kv_transfer_params"])
    params["remote_block_ids"] = [b + 7 for b in params["remote_block_ids"]]
    d = ec.post(client, decode.url, dict(body, kv_transfer_params=params))
    assert ec.output_tokens(d) == reference_outputs[key]
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="failed") == failed_before + 1
    # decode released prefill's real transfer anyway (same transfer id)
    assert_nothing_held(client, pd_pair)


def test_dead_prefill_endpoint_is_recomputed(pd_pair, reference_outputs, client) -> None:
    prefill, decode = pd_pair
    key = "text3"
    body = CONNECTOR_CASES[key]
    p = ec.post(client, prefill.url, ec.prefill_leg(body, "pull", decode))
    params = dict(p["kv_transfer_params"])
    real = dict(params)
    dead = f"{ec.TRANSPORT}://127.0.0.1:{ec.free_port()}"
    params.update(remote_endpoint=dead, remote_endpoints=[dead])
    d = ec.post(client, decode.url, dict(body, kv_transfer_params=params))
    assert ec.output_tokens(d) == reference_outputs[key]
    # the real prefill still holds its copy until its lease ends (nobody could reach it)
    assert held_soon(client, prefill)
    ec.post(client, decode.url, dict(body, kv_transfer_params=real))  # the real one releases it
    assert_nothing_held(client, pd_pair)


def test_decode_rejecting_the_request_releases_prefill(pd_pair, client) -> None:
    """A request decode refuses before admission must not strand prefill's blocks until the lease."""
    prefill, decode = pd_pair
    body = CONNECTOR_CASES["ids512"]
    p = ec.post(client, prefill.url, ec.prefill_leg(body, "pull", decode))
    assert held_soon(client, prefill)
    bad = dict(body, max_tokens=ec.MAX_MODEL_LEN * 4, kv_transfer_params=p["kv_transfer_params"])
    r = client.post(decode.url + "/v1/completions", json=bad, timeout=60)
    assert r.status_code == 400
    # released well before the 20 s lease
    assert ec.wait_until(lambda: ec.metric(client, prefill.url, "vllm:pd_held_transfers") == 0, timeout=8)
    assert_nothing_held(client, pd_pair)


def test_unclaimed_kv_is_freed_when_the_lease_ends(pd_pair, client) -> None:
    prefill, decode = pd_pair
    expired_before = ec.metric(client, prefill.url, "vllm:pd_lease_expired_total")
    ec.post(client, prefill.url, ec.prefill_leg(CONNECTOR_CASES["ids640"], "pull", decode))
    assert held_soon(client, prefill)
    assert ec.wait_until(lambda: ec.metric(client, prefill.url, "vllm:pd_held_transfers") == 0, timeout=45)
    assert ec.metric(client, prefill.url, "vllm:pd_lease_expired_total") == expired_before + 1
    assert_nothing_held(client, pd_pair)


def test_proxy_side_release_frees_prefill_at_once(pd_pair, client) -> None:
    """What the proxy does when the decode leg will never run (client gone between legs)."""
    from vllm_pd.connector.worker.release import release_remote_kv

    prefill, decode = pd_pair
    p = ec.post(client, prefill.url, ec.prefill_leg(CONNECTOR_CASES["ids1000"], "pull", decode))
    assert held_soon(client, prefill)
    assert release_remote_kv(p["kv_transfer_params"], secret=prefill.secret)
    assert ec.wait_until(lambda: ec.metric(client, prefill.url, "vllm:pd_held_transfers") == 0, timeout=8)
    assert not release_remote_kv({"do_remote_prefill": True}, secret=prefill.secret)  # not ours: nothing to do
    assert_nothing_held(client, pd_pair)


def hang_up(client: httpx.Client, url: str, body: dict) -> None:
    """Send ``body`` and go away after 50 ms (a client hanging up mid-leg). An answer that comes
    back first must still be a good one: CI once saw this leg answered within 50 ms, and only the
    answer's status can say why."""
    try:
        r = client.post(url + "/v1/completions", json=body, timeout=0.05)
    except httpx.TimeoutException:
        return
    assert r.status_code == 200, f"{url}: HTTP {r.status_code} within 50 ms: {r.text[:500]}"


def test_aborts_on_either_side_leak_nothing(pd_pair, client) -> None:
    """Clients that hang up mid-prefill (prefill leg) or mid-load/decode (decode leg)."""
    import random

    prefill, decode = pd_pair
    rng = random.Random(7)
    for mode in ("pull", "push"):
        # fresh prompts (nothing cached anywhere) and a long decode, so neither leg can finish in 50 ms
        body = ec.completion_body([rng.randrange(5, 4000) for _ in range(1800)], max_tokens=200)
        # prefill leg abandoned while prefill computes
        hang_up(client, prefill.url, ec.prefill_leg(body, mode, decode))
        # decode leg abandoned while its KV lands or it decodes
        body = ec.completion_body([rng.randrange(5, 4000) for _ in range(1800)], max_tokens=200)
        p = ec.post(client, prefill.url, ec.prefill_leg(body, mode, decode))
        hang_up(client, decode.url, dict(body, kv_transfer_params=p["kv_transfer_params"]))
    # a decode leg sent beside its prefill leg, abandoned while it waits for the push
    body = ec.completion_body([rng.randrange(5, 4000) for _ in range(1800)], max_tokens=200)
    hang_up(client, decode.url, dict(body, kv_transfer_params=AwaitedPrefill("abandoned-1", "push").to_params()))
    ec.post(client, prefill.url, ec.prefill_leg(body, "push", decode, transfer_id="abandoned-1"))
    assert_nothing_held(client, pd_pair)


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
def test_async_load_output_equals_plain(mode: str, pd_pair, reference_outputs, client) -> None:
    """load_mode=async, what load_mode=auto does when decode has other requests: the request waits
    off the batch until its whole KV has landed, then vLLM recomputes the last prompt token."""
    prefill, decode = pd_pair
    keys = ["ids17", "ids129", "ids640", "ids1500", "text4", "chat2"]
    mismatches = []
    for key in keys:
        body = CONNECTOR_CASES[key]
        before = prompt_sources(client, decode)
        p, d = ec.disagg(client, prefill, decode, body, mode, load_mode="async")
        ext, local, hit = (a - b for a, b in zip(prompt_sources(client, decode), before))
        if ec.output_tokens(d) != reference_outputs[key]:
            mismatches.append(key)
        assert local == 0 and ext > 0, f"{key}: {ext} transferred, {local} computed"
    assert not mismatches, f"async {mode}: outputs differ for {mismatches}"
    assert_nothing_held(client, pd_pair)
