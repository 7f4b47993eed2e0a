"""End-to-end kv_aware routing on real vLLM servers (2 prefill + 1 decode, KV events on).

A conversation's second turn must go to the prefill instance that computed its
first turn (the only one whose KV events announced that prefix), a repeated
prompt that decode already holds must skip prefill, the proxy's token count
must equal vLLM's own, and every answer must equal a plain instance's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_router_e2e import ProxyThread, _model_dir
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.router.request.request_body import CHAT, parse_body

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are a careful assistant for conversation {i}. Answer in short sentences, cite numbers exactly, "
    "and never repeat the question. "
) * 6
QUESTIONS = ("List the first five prime numbers.", "Now add them up and say the total.")
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    c = LocalCluster(
        model=_model_dir(),
        n_prefill=2,
        n_decode=1,
        max_model_len=1024,
        kv_events=True,
        connector_extra={"lease_s": 15.0},
    )
    with c.running(600):
        yield c


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {"model": _model_dir(), "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}


def _answer(client: httpx.Client, url: str, body: dict[str, Any]) -> tuple[str, int]:
    r = client.post(url + CHAT, json=body)
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["prompt_tokens"]


def _wait(pred: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def test_second_turn_goes_where_its_prefix_is_and_outputs_equal_plain(cluster: LocalCluster) -> None:
    proxy = ProxyThread(
        cluster.instances(), prefill_policy="kv_aware", decode_policy="kv_aware", tokenizer=_model_dir()
    )
    routing = proxy.server.kv_routing
    assert routing is not None and proxy.server.flow is not None
    flow = proxy.server.flow
    chosen: list[str] = []
    choose_for = flow.prefill_policy.choose_for  # type: ignore[attr-defined]

    def recording(candidates: Any, role: str, req: Any) -> Any:
        inst = choose_for(candidates, role, req)
        chosen.append(inst.url)
        return inst

    flow.prefill_policy.choose_for = recording  # type: ignore[attr-defined]
    decode_url = next(s.server.url for s in cluster.servers if s.role == "decode")
    sent: list[tuple[dict[str, Any], str]] = []
    try:
        with httpx.Client(timeout=120) as client:
            first: dict[int, tuple[list[dict[str, Any]], str, str]] = {}
            for i in range(3):
                messages = [
                    {"role": "system", "content": SYSTEM.format(i=i)},
                    {"role": "user", "content": QUESTIONS[0]},
                ]
                body = _body(messages)
                text, vllm_tokens = _answer(client, proxy.url, body)
                blocks = routing.tokenizer.blocks(parse_body(httpx.Request("POST", "/", json=body).content, CHAT))
                assert blocks is not None and len(blocks.token_ids) == vllm_tokens  # vLLM's own count
                first[i] = (messages, chosen[-1], text)
                sent.append((body, text))
                assert _wait(lambda: routing.locations.cached_tokens(chosen[-1], blocks) > 0), (
                    "the prefill's KV events never announced the prompt"
                )
            assert not routing.locations.hash_mismatch
            for i, (messages, prefill_url, text) in first.items():
                body = _body(
                    messages + [{"role": "assistant", "content": text}, {"role": "user", "content": QUESTIONS[1]}]
                )
                before = len(chosen)
                answer, _ = _answer(client, proxy.url, body)
                assert chosen[before:] == [prefill_url], f"turn 2 of conversation {i} left its prefix"
                sent.append((body, answer))
            # the first turn again: decode holds every full block of it now, so no prefill leg
            body = sent[0][0]
            blocks = routing.tokenizer.blocks(parse_body(httpx.Request("POST", "/", json=body).content, CHAT))
            assert blocks is not None
            assert _wait(lambda: routing.locations.holds_prompt(decode_url, blocks)), (
                "decode's KV events never announced the prompt it decoded"
            )
            before = len(chosen)
            answer, _ = _answer(client, proxy.url, body)
            assert chosen[before:] == []
            sent.append((body, answer))
            # a plain instance: decode itself, asked directly without kv_transfer_params
            for body, answer in sent:
                assert _answer(client, decode_url, body)[0] == answer
    finally:
        proxy.close()
