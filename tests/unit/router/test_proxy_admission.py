"""The concurrency limit: a bounded queue, then 429 with Retry-After; slots survive clients that leave."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.router_harness import harness, run, wait_for
from vllm_pd.router.flow.admission import AdmissionGate
from vllm_pd.router.http.errors import ProxyError

BODY = {"prompt": "hello there " * 10, "max_tokens": 2}


def test_beyond_limit_and_queue_requests_get_429_with_retry_after() -> None:
    async def go() -> None:
        async with harness(max_concurrent_requests=2, max_queued_requests=1, backend_kw={"ttft": 0.4}) as h:

            async def one() -> tuple[int, str | None, dict]:
                async with h.session.post(h.url + "/v1/completions", json=BODY) as r:
                    return r.status, r.headers.get("Retry-After"), await r.json()

            results = await asyncio.gather(*(one() for _ in range(6)))
            statuses = sorted(s for s, _, _ in results)
            assert statuses == [200, 200, 200, 429, 429, 429]
            for status, retry, body in results:
                if status == 429:
                    assert retry == "1" and body["error"]["code"] == "too_many_requests"
            assert h.proxy.gate is not None and h.proxy.gate.active == 0 and h.proxy.gate.waiting == 0
            status, _ = await h.post("/v1/completions", BODY)  # and it serves again
            assert status == 200

    run(go)


def test_gate_hands_slots_over_and_survives_cancelled_waiters() -> None:
    async def go() -> None:
        gate = AdmissionGate(limit=1, queue=2)
        await gate.enter()
        w1 = asyncio.ensure_future(gate.enter())
        w2 = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0)
        with pytest.raises(ProxyError) as e:
            await gate.enter()
        assert e.value.status == 429 and e.value.headers == {"Retry-After": "1"}
        w1.cancel()  # a client that left while waiting
        await asyncio.gather(w1, return_exceptions=True)
        assert gate.waiting == 1
        gate.leave()  # the slot goes to the next waiter, not back to the pool
        await w2
        assert gate.active == 1 and gate.waiting == 0
        # a waiter cancelled just as the slot reached it passes the slot on
        w3 = asyncio.ensure_future(gate.enter())
        w4 = asyncio.ensure_future(gate.enter())
        await asyncio.sleep(0)
        gate.leave()
        w3.cancel()
        await asyncio.gather(w3, return_exceptions=True)
        await w4
        gate.leave()
        assert gate.active == 0 and gate.waiting == 0
        await gate.enter()  # free again: no wait
        assert gate.active == 1

    asyncio.run(go())


def test_client_disconnect_while_queued_frees_its_place() -> None:
    async def go() -> None:
        async with harness(max_concurrent_requests=1, max_queued_requests=1, backend_kw={"ttft": 0.5}) as h:
            first = asyncio.ensure_future(h.post("/v1/completions", BODY))
            await wait_for(lambda: h.proxy.gate is not None and h.proxy.gate.active == 1)
            queued = asyncio.ensure_future(h.post("/v1/completions", BODY))
            await wait_for(lambda: h.proxy.gate is not None and h.proxy.gate.waiting == 1)
            queued.cancel()
            await asyncio.gather(queued, return_exceptions=True)
            await wait_for(lambda: h.proxy.gate is not None and h.proxy.gate.waiting == 0)
            assert (await first)[0] == 200
            assert h.proxy.gate is not None and h.proxy.gate.active == 0

    run(go)
