"""A client never controls the KV flow: its KV fields are gone from every leg on every path."""

from __future__ import annotations

from typing import Any

import pytest

from tests.support.router_harness import Harness, harness, run
from vllm_pd.router.request.client_kv import CLIENT_KV_FIELDS, strip_client_kv

EVIL_KV = {
    "do_remote_prefill": True,
    "remote_engine_id": "evil",
    "remote_host": "169.254.169.254",
    "remote_port": 80,
    "remote_block_ids": [0],
    "remote_request_id": "someone-else",
    "transfer_id": "someone-elses-transfer",
    "decode_endpoint": "tcp://169.254.169.254:80",
    "store_fetch": {"node": "evil", "endpoint": "tcp://169.254.169.254:80", "blocks": 9},
}


def _evil_body(**kw: Any) -> dict[str, Any]:
    return {
        "prompt": "a long enough prompt " * 10,
        "max_tokens": 3,
        "kv_transfer_params": EVIL_KV,
        "remote_host": "10.9.9.9",
        "transfer_id": "k",
        "store_fetch": {"node": "evil", "endpoint": "tcp://169.254.169.254:80", "blocks": 9},
        "vllm_xargs": {"kv_transfer_params": "x", "keep": 1},
        **kw,
    }


def _assert_no_client_kv(h: Harness) -> None:
    """Every leg any backend saw: no client KV field, and any kv_transfer_params is the proxy's own."""
    legs = [s for b in h.prefills + h.decodes for s in b.seen]
    assert legs, "no leg was sent"
    for leg in legs:
        assert not (CLIENT_KV_FIELDS - {"kv_transfer_params"}) & set(leg.body), leg.body
        assert leg.body["vllm_xargs"] == {"keep": 1}
        kvp = leg.body.get("kv_transfer_params")
        assert kvp is None or "evil" not in str(kvp) and "169.254" not in str(kvp), kvp


def _go(check: Any, body: dict[str, Any] | None = None, **harness_kw: Any) -> None:
    async def go() -> None:
        async with harness(**harness_kw) as h:
            status, answer = await h.post("/v1/completions", body or _evil_body())
            assert status == 200, answer
            check(h)
            _assert_no_client_kv(h)

    run(go)


def test_both_legs_of_the_standard_flow() -> None:
    def check(h: Harness) -> None:
        (p,), (d,) = h.prefills[0].seen, h.decodes[0].seen
        assert p.body["kv_transfer_params"]["do_remote_decode"] is True
        assert d.body["kv_transfer_params"]["remote_engine_id"] == "p0"  # prefill's answer, not the client's

    _go(check)


@pytest.mark.parametrize("kv_mode", ["push", "pull"])
def test_both_legs_at_once(kv_mode: str) -> None:
    def check(h: Harness) -> None:
        (p,), (d,) = h.prefills[0].seen, h.decodes[0].seen
        transfer_id = p.body["kv_transfer_params"]["transfer_id"]
        assert transfer_id != "someone-elses-transfer" and d.body["kv_transfer_params"]["transfer_id"] == transfer_id
        assert p.body["kv_transfer_params"]["decode_endpoint"] == "tcp://127.0.0.1:14601"

    _go(check, decode_kv=True, kv_mode=kv_mode)


def test_decode_only_fallback_without_prefill() -> None:
    def check(h: Harness) -> None:
        assert "kv_transfer_params" not in h.decodes[0].seen[0].body

    _go(check, n_prefill=0)


def test_short_prompt_bypass() -> None:
    def check(h: Harness) -> None:
        assert not h.prefills[0].seen and "kv_transfer_params" not in h.decodes[0].seen[0].body

    _go(check, short_prompt_tokens=10_000)


def test_n_greater_than_one() -> None:
    def check(h: Harness) -> None:
        assert not h.prefills[0].seen and "kv_transfer_params" not in h.decodes[0].seen[0].body

    _go(check, body=_evil_body(n=2))


def test_streaming_chat() -> None:
    body = {
        "messages": [{"role": "user", "content": "hi " * 40}],
        "stream": True,
        "max_tokens": 3,
        "kv_transfer_params": EVIL_KV,
        "vllm_xargs": {"keep": 1, "kv_transfer_params": {"a": 1}},
    }

    async def go() -> None:
        async with harness() as h:
            async with h.session.post(h.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and b"[DONE]" in await r.read()
            assert h.decodes[0].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "p0"
            _assert_no_client_kv(h)

    run(go)


def test_retries_on_both_legs_and_prefill_fallback() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, n_decode=2) as h:
            await h.proxy.health.check_all()
            # least_outstanding picks decodes[0] first, then the other one
            h.proxy.pool.get(h.backend_urls["d1"]).outstanding["decode"] = 5
            for b in h.prefills:
                b.fail_next("500")
            h.decodes[0].fail_next("500")
            # both prefills fail: decode-only; the first decode fails: retried on the other
            status, answer = await h.post("/v1/completions", _evil_body())
            assert status == 200, answer
            assert sum(len(b.seen) for b in h.prefills) >= 2  # (the decode retry runs prefill again)
            assert len(h.decodes[0].seen) == len(h.decodes[1].seen) == 1
            _assert_no_client_kv(h)
            # a decode retry after a successful prefill re-sends the proxy's params, never the client's
            for b in h.prefills + h.decodes:
                b.seen.clear()
            h.decodes[0].fail_next("500")
            status, answer = await h.post("/v1/completions", _evil_body())
            assert status == 200, answer
            assert len(h.decodes[0].seen) == len(h.decodes[1].seen) == 1
            assert h.decodes[1].seen[0].body["kv_transfer_params"]["remote_engine_id"] in ("p0", "p1")
            _assert_no_client_kv(h)

    run(go)


def test_strip_only_touches_kv_fields() -> None:
    body = {"prompt": "x", "vllm_xargs": {"a": 1}, "temperature": 0.5}
    assert not strip_client_kv(body) and body == {"prompt": "x", "vllm_xargs": {"a": 1}, "temperature": 0.5}
    body = {"prompt": "x", "kv_transfer_params": {}, "remote_port": 1, "vllm_xargs": {"kv_transfer_params": 1}}
    assert strip_client_kv(body) and body == {"prompt": "x", "vllm_xargs": {}}


def test_a_client_does_not_pick_the_data_parallel_engine() -> None:
    """vLLM sends a request to the DP engine its ``X-data-parallel-rank`` names and refuses one out of
    range (400): forwarded to both legs, a client's rank could fail one leg after the other computed
    (instances of each role may run another DP size) or pile load on one engine. The proxy places legs;
    each instance balances its own engines."""

    async def go() -> None:
        async with harness() as h:
            status, answer = await h.post(
                "/v1/completions",
                {"prompt": "hello " * 20, "max_tokens": 3},
                headers={"X-Data-Parallel-Rank": "3", "traceparent": "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"},
            )
            assert status == 200, answer
            legs = [s for b in h.prefills + h.decodes for s in b.seen]
            assert len(legs) == 2
            for leg in legs:
                names = {k.lower() for k in leg.headers}
                assert "x-data-parallel-rank" not in names, leg.headers
                assert "traceparent" in names  # the other forwarded headers still pass

    run(go)


def test_store_fetch_hint_is_a_client_kv_field() -> None:
    """The proxy's hint where a prefill's store fetches from (transfer_params.STORE_FETCH): a client's
    would point a prefill's store at an address of the client's choosing."""
    from vllm_pd.protocol.transfer_params import STORE_FETCH

    assert STORE_FETCH in CLIENT_KV_FIELDS
    body = {"prompt": "x", STORE_FETCH: {"node": "n", "endpoint": "tcp://h:1", "blocks": 1}}
    assert strip_client_kv(body) and body == {"prompt": "x"}
