"""Closed connections and their request bodies are freed by reference counting alone (gc disabled)."""

from __future__ import annotations

import asyncio
import gc
import tracemalloc
import weakref

from tests.support.router_harness import harness, run
from tests.unit.router.test_proxy_http_limits import limited_server
from tests.unit.router.test_router_http_server import read_response
from vllm_pd.router.http.http_limits import HttpLimits
from vllm_pd.router.http.http_server import HttpServer

BIG = 4 * 1024 * 1024


def test_raw_server_connections_and_bodies_free_without_gc() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits(), max_body=2 * BIG) as (srv, port):
            srv_conns: list[weakref.ref] = []
            body = b"x" * BIG
            await _one(srv, port, body)  # warm up (first-use allocations)
            gc.collect()
            gc.disable()
            try:
                tracemalloc.start()
                before = tracemalloc.get_traced_memory()[0]
                for _ in range(8):
                    await _one(srv, port, body, srv_conns)
                await asyncio.sleep(0.05)
                grown = tracemalloc.get_traced_memory()[0] - before
                tracemalloc.stop()
                alive = [r for r in srv_conns if r() is not None]
                assert not alive, f"{len(alive)} closed connections still referenced"
                assert grown < BIG, f"{grown} bytes not given back after 8 requests of {BIG} bytes"
            finally:
                gc.enable()

    run(go)


async def _one(srv: HttpServer, port: int, body: bytes, refs: list | None = None) -> None:
    """One request of ``body`` on a connection of its own; ``refs`` gets a weak reference to the server's
    connection object."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"POST /echo HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(body))
    w.write(body)
    status, _, _ = await read_response(r)
    assert status == 200
    if refs is not None:
        refs.extend(weakref.ref(c) for c in srv.connections)
    w.close()
    await w.wait_closed()
    await asyncio.sleep(0.01)


def test_proxy_legs_and_bodies_free_without_gc() -> None:
    async def go() -> None:
        async with harness(backend_kw={"record": False}, max_body_bytes=4 * BIG) as h:
            await h.proxy.health.check_all()
            prompt = "y" * BIG
            for stream in (False, True):  # warm up both paths
                status, _ = await h.post("/v1/completions", {"prompt": prompt, "max_tokens": 2, "stream": stream})
                assert status == 200
            gc.collect()
            gc.disable()
            try:
                tracemalloc.start()

                async def requests(n: int) -> int:
                    for i in range(n):
                        status, _ = await h.post(
                            "/v1/completions",
                            {"prompt": prompt, "max_tokens": 2, "stream": bool(i % 2)},
                            headers={"Connection": "close"},
                        )
                        assert status == 200
                    await asyncio.sleep(0.1)
                    return tracemalloc.get_traced_memory()[0]

                # what the last request left in flight (a background leg, a pooled connection) is there
                # after 2 requests as after 8: only memory kept per request grows in between
                after_2 = await requests(2)
                after_8 = await requests(6)
                tracemalloc.stop()
                # each request holds the body several times (client bytes, parsed prompt, two legs)
                assert after_8 - after_2 < BIG, f"{after_8 - after_2} bytes kept by 6 requests of {BIG} bytes"
            finally:
                gc.enable()

    run(go)
