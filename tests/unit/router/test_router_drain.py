"""Draining the proxy (SIGTERM's path) against mock backends: nothing new accepted, in-flight requests
finish within the grace period, what remains after it is cancelled on both legs.

The signal wiring of a `vllm-pd proxy` process: tests/integration/test_router_drain_process.py; the same on
real vLLM servers: tests/e2e/test_router_e2e.py.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tests.support.router_harness import Harness, harness, run, wait_for
from vllm_pd.router.server.drain import drain

BODY = {"model": "mock-model", "prompt": "a prompt to drain " * 8, "stream": True}


async def _stream(h: Harness, max_tokens: int) -> bytes:
    async with aiohttp.ClientSession() as s:  # its own connection, so closing it is seen by this request only
        async with s.post(h.url + "/v1/completions", json=dict(BODY, max_tokens=max_tokens)) as r:
            assert r.status == 200
            return await r.read()


async def _refused(h: Harness) -> bool:
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(h.url + "/health", timeout=aiohttp.ClientTimeout(total=2)):
                return False
    except aiohttp.ClientConnectionError:
        return True


def test_in_flight_requests_finish_within_grace_and_new_ones_are_refused() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.05}) as h:
            assert h.running is not None
            streams = [asyncio.ensure_future(_stream(h, 12)) for _ in range(3)]
            await wait_for(lambda: sum(len(d.seen) for d in h.decodes) == 3)
            drained = asyncio.ensure_future(drain(h.running, grace=10.0))
            await wait_for(lambda: h.proxy.metrics.draining)
            assert await _refused(h)
            bodies = await asyncio.gather(*streams)
            assert all(b.count(b"data:") == 13 and b.endswith(b"data: [DONE]\n\n") for b in bodies)
            assert await asyncio.wait_for(drained, 5) == 0  # nothing was left to cancel
            assert not any(s.cancelled for d in h.decodes for s in d.seen)

    run(go)


def test_requests_past_the_grace_period_are_cancelled_on_both_legs() -> None:
    async def go() -> None:
        async with harness(n_decode=1, decode_kv=True, backend_kw={"itl": 0.05}) as h:
            assert h.running is not None
            # legs at once: the mock decode answers without waiting for the KV, while prefill never
            # answers - its leg runs on in the background after the client got its answer
            h.prefills[0].fail_next("hang")
            assert (await _stream(h, 4)).endswith(b"data: [DONE]\n\n")
            long = asyncio.ensure_future(_stream(h, 400))  # 20 s of tokens
            await wait_for(lambda: len(h.decodes[0].seen) == 2)
            t0 = asyncio.get_running_loop().time()
            assert await drain(h.running, grace=0.5) == 1
            assert asyncio.get_running_loop().time() - t0 < 5
            with pytest.raises(aiohttp.ClientError):
                await long
            # every leg's connection was closed: the backends saw their requests go away
            await wait_for(lambda: h.prefills[0].seen[0].cancelled and h.decodes[0].seen[1].cancelled)
            assert h.decodes[0].seen[0].finished
            assert all(i.load == 0 for i in h.proxy.pool.all())

    run(go)


def test_second_signal_cuts_the_grace_short() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.05}) as h:
            assert h.running is not None
            long = asyncio.ensure_future(_stream(h, 400))
            await wait_for(lambda: len(h.decodes[0].seen) == 1)
            hurry = asyncio.Event()
            drained = asyncio.ensure_future(drain(h.running, grace=60.0, hurry=hurry))
            await asyncio.sleep(0.2)
            assert not drained.done()
            hurry.set()
            assert await asyncio.wait_for(drained, 5) == 1
            with pytest.raises(aiohttp.ClientError):
                await long

    run(go)
