"""The ``kv_transfer_params`` protocol (vllm_pd.protocol.transfer_params): round trips, bad values
rejected with an error naming the key, the release fan-out over TP ranks, and that the proxy's
side of it loads neither torch nor vLLM."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from vllm_pd.connector.step_specs import LocalPrompt
from vllm_pd.protocol.transfer_params import (
    AwaitedPrefill,
    RemoteDecodeRequest,
    RemotePrefill,
    StoreFetch,
    TransferParamsError,
    asks_remote_decode,
    asks_remote_prefill,
    mark_remote_prefill_taken,
    parse_decode_leg,
    prompt_hash,
    requested_load_mode,
)


def remote_prefill(**kw: Any) -> RemotePrefill:
    """Prefill's answer for a 300-token prompt in 3 blocks of 128 (TP 1), fields overridable."""
    base: dict[str, Any] = dict(
        transfer_id="cmpl-1-0-abc",
        engine_id="e",
        endpoint="tcp://10.0.0.1:5000",
        host="10.0.0.1",
        port=5000,
        block_ids=(4, 9, 2),
        num_tokens=300,
        block_size=128,
        mode="pull",
        prompt_hash=prompt_hash([1, 2, 3]),
    )
    base.update(kw)
    return RemotePrefill(**base)


TP2 = dict(tp_size=2, endpoints=("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"))


# ---- prefill leg (proxy -> prefill) ---------------------------------------------------------------
def test_prefill_leg_round_trip_and_nixl_compatible_keys() -> None:
    plain = RemoteDecodeRequest().to_params()
    # what NixlConnector's proxies send, so any vLLM connector serves our prefill legs
    assert plain == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    ask = RemoteDecodeRequest("push", "shm://127.0.0.1:7000", "k1")
    params = json.loads(json.dumps(ask.to_params()))  # through JSON, as on the wire
    assert params == {**plain, "transfer_mode": "push", "decode_endpoint": "shm://127.0.0.1:7000", "transfer_id": "k1"}
    assert RemoteDecodeRequest.from_params(params) == ask
    assert RemoteDecodeRequest.from_params(plain) == RemoteDecodeRequest()
    assert RemoteDecodeRequest.from_params({"do_remote_prefill": True}) is None
    assert RemoteDecodeRequest.from_params(None) is None
    assert asks_remote_decode(params) and not asks_remote_prefill(params)


def test_prefill_leg_resolves_the_mode_prefill_uses() -> None:
    assert RemoteDecodeRequest().resolve("pull").mode == "pull"
    assert RemoteDecodeRequest().resolve("push").mode == "pull"  # nowhere to push to
    push = RemoteDecodeRequest(None, "tcp://h:1").resolve("push")
    assert (push.mode, push.push_endpoint, push.announce_endpoint) == ("push", "tcp://h:1", None)
    # pull beside a decode leg: nothing pushed, the KV is announced to decode, which reads it
    pull = RemoteDecodeRequest("pull", "tcp://h:1", "k1").resolve("push")
    assert (pull.mode, pull.push_endpoint, pull.announce_endpoint) == ("pull", None, "tcp://h:1")


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"transfer_mode": "teleport"}, "transfer_mode"),
        ({"decode_endpoint": 7}, "decode_endpoint"),
        ({"decode_endpoint": ""}, "decode_endpoint"),
        ({"transfer_id": "k1"}, "transfer_id needs decode_endpoint"),
        # version 1's name of a proxy-chosen transfer: refused by name, never silently ignored
        ({"transfer_key": "k1", "decode_endpoint": "tcp://h:1"}, "`transfer_key` is not accepted any more"),
    ],
)
def test_prefill_leg_bad_values_rejected_naming_the_key(extra: dict, key: str) -> None:
    with pytest.raises(TransferParamsError, match=key):
        RemoteDecodeRequest.from_params({"do_remote_decode": True, **extra})


# ---- prefill's answer (prefill -> proxy -> decode) ------------------------------------------------
def test_remote_prefill_round_trip_through_json() -> None:
    for rp in (remote_prefill(), remote_prefill(mode="push", transfer_id="k1", **TP2)):
        params = json.loads(json.dumps(rp.to_params()))
        # vLLM's standard keys are there, so standard proxies pass them on unchanged
        for key in (
            "do_remote_prefill",
            "remote_engine_id",
            "remote_request_id",
            "remote_host",
            "remote_port",
            "remote_block_ids",
            "tp_size",
        ):
            assert key in params
        assert RemotePrefill.parse(params) == rp
        assert parse_decode_leg(params) == rp
        assert params["remote_request_id"] == rp.transfer_id  # the transfer's one name, under vLLM's key


def test_remote_prefill_of_another_request_kind_is_none() -> None:
    params = remote_prefill().to_params()
    assert RemotePrefill.parse({**params, "do_remote_prefill": False}) is None
    assert RemotePrefill.parse(None) is None
    mark_remote_prefill_taken(params)  # what the scheduler does once it took the load
    assert RemotePrefill.parse(params) is None and not asks_remote_prefill(params)


_BAD_ANSWERS: list[tuple[Callable[[dict], Any], str]] = [
    (lambda p: p.pop("remote_endpoint"), "remote_endpoint"),
    (lambda p: p.update(remote_port="x"), "remote_port"),
    (lambda p: p.update(remote_block_ids=[1]), "remote_block_ids"),  # too few blocks for 300 tokens
    (lambda p: p.update(remote_block_ids=[1, -2, 3]), "remote_block_ids"),
    (lambda p: p.update(remote_num_tokens=-1), "remote_num_tokens"),
    (lambda p: p.update(block_size=0), "block_size"),
    (lambda p: p.update(transfer_mode="teleport"), "transfer_mode"),
    (lambda p: p.update(tp_size=2), "remote_endpoints"),  # two ranks, one endpoint
    (lambda p: p.update(tp_size=0), "tp_size"),
    (lambda p: p.update(remote_request_id=""), "remote_request_id"),
    (lambda p: p.pop("vllm_pd"), "vllm_pd"),  # another connector's params
    (lambda p: p.update(vllm_pd=1), "older vllm-pd .vllm_pd=1, ours 4"),  # version 1 named a transfer twice
    (lambda p: p.update(vllm_pd=2), "older vllm-pd .vllm_pd=2, ours 4"),  # version 2 knew one KV shape
    (lambda p: p.update(vllm_pd=3), "older vllm-pd .vllm_pd=3, ours 4"),  # version 3 cut no state across TP
    (lambda p: p.update(vllm_pd=5), "newer vllm-pd .vllm_pd=5, ours 4"),
    (lambda p: p.update(vllm_pd="x"), "vllm_pd='x', expected 4"),
    (lambda p: p.update(transfer_key="k1"), "transfer_key"),
]


@pytest.mark.parametrize("mutate, key", _BAD_ANSWERS)
def test_remote_prefill_bad_values_rejected_naming_the_key(mutate: Callable[[dict], Any], key: str) -> None:
    params = remote_prefill().to_params()
    mutate(params)
    with pytest.raises(TransferParamsError, match=key):
        RemotePrefill.parse(params)
    assert RemotePrefill.from_params(params) is None  # the connector's lenient form: logged, recomputed


def test_remote_prefill_endpoints_must_match_tp_size() -> None:
    params = remote_prefill(**TP2).to_params()
    params["remote_endpoints"] = params["remote_endpoints"][:1]
    with pytest.raises(TransferParamsError, match="1 endpoints for tp_size 2"):
        RemotePrefill.parse(params)


# ---- the release: every prefill rank, once ---------------------------------------------------------
def test_release_reaches_every_prefill_rank_once() -> None:
    eps = tuple(f"tcp://p:{5000 + r}" for r in range(4))
    rp = remote_prefill(tp_size=4, endpoints=eps)
    assert rp.release_endpoints() == eps  # the proxy: one process, all ranks
    assert rp.endpoint_for_rank(3) == eps[3]
    # decode of prefill's TP size: rank r releases the rank it loaded from, and only that one
    assert [rp.release_endpoints(r, 4) for r in range(4)] == [(e,) for e in eps]
    # other TP sizes (the KV is refused, see LocalPrompt): the ranks' shares still cover each prefill rank once
    for decode_tp in (1, 2, 3, 8):
        shares = [e for r in range(decode_tp) for e in rp.release_endpoints(r, decode_tp)]
        assert sorted(shares) == sorted(eps), decode_tp
    assert remote_prefill().release_endpoints() == ("tcp://10.0.0.1:5000",)  # TP 1: its one endpoint
    with pytest.raises(ValueError, match="rank 2"):
        rp.release_endpoints(2, 2)


# ---- the decode leg sent beside the prefill leg -----------------------------------------------------
def test_awaited_prefill_round_trip_and_told_apart_from_prefills_answer() -> None:
    for mode in ("push", "pull"):
        awaited = AwaitedPrefill("k1", mode)  # type: ignore[arg-type]
        params = json.loads(json.dumps(awaited.to_params()))
        assert AwaitedPrefill.parse(params) == awaited
        assert parse_decode_leg(params) == awaited
        assert asks_remote_prefill(params)
    assert AwaitedPrefill.parse(remote_prefill().to_params()) is None  # prefill's answer: the other flow
    nixl = {"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]}
    assert AwaitedPrefill.parse(nixl) is None
    with pytest.raises(TransferParamsError, match="vllm_pd"):
        parse_decode_leg(nixl)  # another connector's answer reached our decode


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"transfer_id": ""}, "transfer_id"),
        ({"transfer_id": 7}, "transfer_id"),
        ({"transfer_key": "k1"}, "transfer_key"),  # version 1's name of the transfer
        ({"transfer_mode": "teleport"}, "transfer_mode"),
        ({"vllm_pd": 1}, "older vllm-pd .vllm_pd=1, ours 4"),  # version 1 named a transfer twice
    ],
)
def test_awaited_prefill_bad_values_rejected_naming_the_key(extra: dict, key: str) -> None:
    with pytest.raises(TransferParamsError, match=key):
        AwaitedPrefill.parse({**AwaitedPrefill("k1", "push").to_params(), **extra})


def test_store_fetch_hint_round_trip_beside_the_prefill_leg() -> None:
    hint = StoreFetch("node-a", "tcp://10.0.0.2:7000,tcp://10.0.0.2:7001", 5)
    params = {**RemoteDecodeRequest().to_params(), **hint.to_params()}
    params = json.loads(json.dumps(params))
    assert params["store_fetch"] == {
        "node": "node-a",
        "endpoint": "tcp://10.0.0.2:7000,tcp://10.0.0.2:7001",
        "blocks": 5,
    }
    assert StoreFetch.from_params(params) == hint
    assert RemoteDecodeRequest.from_params(params) == RemoteDecodeRequest()  # the leg itself is unchanged
    assert StoreFetch.from_params(RemoteDecodeRequest().to_params()) is None
    assert StoreFetch.from_params(None) is None


@pytest.mark.parametrize(
    "bad",
    [
        {"node": "a", "endpoint": "tcp://h:1", "blocks": 0},
        {"node": "", "endpoint": "tcp://h:1", "blocks": 1},
        {"node": "a", "blocks": 1},
        "tcp://h:1",
    ],
)
def test_malformed_store_fetch_hint_is_ignored_and_logged(bad: Any, caplog: pytest.LogCaptureFixture) -> None:
    """A bad hint only loses the hint: the store asks its master as without one."""
    with caplog.at_level("WARNING"):
        assert StoreFetch.from_params({"store_fetch": bad}) is None
    assert "store_fetch" in caplog.text


def test_requested_load_mode() -> None:
    assert requested_load_mode({"load_mode": "async"}, "auto") == "async"
    assert requested_load_mode(None, "layerwise") == "layerwise"
    assert requested_load_mode({"load_mode": "sometimes"}, "auto") == "auto"


# ---- decode's check of remote KV -------------------------------------------------------------------
def test_local_prompt_mismatch_names_the_reason() -> None:
    mine = LocalPrompt(prompt_hash([1, 2, 3]), 3, block_size=128, tp_size=1)
    assert mine.mismatch(remote_prefill()) is None
    assert "prompt differs" in mine.mismatch(remote_prefill(prompt_hash=prompt_hash([1, 2, 4])))
    assert "block size 256 != ours 128" in mine.mismatch(remote_prefill(block_size=256))
    assert "prefill TP 2 != ours 1" in mine.mismatch(remote_prefill(**TP2))


def test_kv_of_another_block_format_is_refused() -> None:
    """Same sizes, other meaning (LBNHC's token-major page against LBHNC's head-major one): used, it
    would be wrong KV. A side that does not know its format (hand-built params) is not checked."""
    ours = "bfloat16:H8.N16.C256"
    mine = LocalPrompt(prompt_hash([1, 2, 3]), 3, block_size=128, tp_size=1, kv_format=ours)
    assert mine.mismatch(remote_prefill(kv_format=ours)) is None
    why = mine.mismatch(remote_prefill(kv_format="bfloat16:N16.H8.C256"))
    assert why == f"KV cache blocks laid out as bfloat16:N16.H8.C256, ours as {ours}"
    assert mine.mismatch(remote_prefill()) is None
    assert RemotePrefill.parse(remote_prefill(kv_format=ours).to_params()).kv_format == ours


def test_prompt_hash_is_stable_and_sensitive() -> None:
    assert prompt_hash([1, 2, 3]) == prompt_hash((1, 2, 3))
    assert prompt_hash([1, 2, 3]) != prompt_hash([1, 2, 4])
    # fixed value: the same on every machine and process (no Python hash())
    assert prompt_hash([1, 2, 3]) == "001a4cc3a7c5c739df759df2c0563c82"


# ---- the proxy's process never loads torch or vLLM -------------------------------------------------
_PROXY_PROCESS = """
import sys
import vllm_pd.router.server.app, vllm_pd.router.flow.pd_flow, vllm_pd.router.cli.command_proxy
from vllm_pd.protocol.transfer_params import RemotePrefill
from vllm_pd.router.flow.pd_flow import default_release_remote_kv
# a whole release, down to the transport's connect (nothing listens on these ports: refused at once)
eps = ("tcp://127.0.0.1:1", "shm://127.0.0.1:1")
answer = RemotePrefill(transfer_id="t", engine_id="e", endpoint=eps[0], host="127.0.0.1", port=1, block_ids=(0,),
                       num_tokens=1, block_size=16, mode="pull", tp_size=2, endpoints=eps)
assert default_release_remote_kv(answer.to_params()) is False
print(sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "vllm")))
"""


def test_proxy_and_its_release_path_import_neither_torch_nor_vllm() -> None:
    out = subprocess.run([sys.executable, "-c", _PROXY_PROCESS], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
