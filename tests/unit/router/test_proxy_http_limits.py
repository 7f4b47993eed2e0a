"""The HTTP server's limits (http_limits.py), HEAD and 405, driven by raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from tests.unit.router.test_router_http_server import App, read_response, run
from vllm_pd.router.http.http_limits import HttpLimits
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.vllm_server import free_port

ERROR_KEYS = {"message", "type", "param", "code"}


@contextlib.asynccontextmanager
async def limited_server(limits: HttpLimits, max_body: int = 1 << 20) -> AsyncIterator[tuple[HttpServer, int]]:
    app = App()
    routes = {"/echo": {"POST": app.echo, "GET": app.echo}, "/post": {"POST": app.echo}, "/hang": {"GET": app.hang}}
    port = free_port()
    srv = HttpServer(routes, max_body, limits)  # type: ignore[arg-type]
    await srv.start("127.0.0.1", port)
    try:
        yield srv, port
    finally:
        await srv.cleanup()


async def _ask(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes, bytes]:
    """Send raw bytes; (status, headers, body, what followed before the server closed)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(raw)
    status, headers, body = await read_response(r)
    rest = await asyncio.wait_for(r.read(), 5)
    w.close()
    return status, headers, body, rest


def _assert_error(status: int, body: bytes, want: int, code: str) -> None:
    err = json.loads(body)["error"]
    assert status == want and set(err) == ERROR_KEYS and err["code"] == code, (status, err)


def test_head_size_header_count_and_url_length() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits(max_header_bytes=2048, max_headers=10, max_url_bytes=256)) as (_, port):
            ok = await _ask(port, b"GET /echo?" + b"q" * 200 + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert ok[0] == 200
            s, h, b, rest = await _ask(port, b"GET /echo?" + b"q" * 300 + b" HTTP/1.1\r\nHost: x\r\n\r\n")
            _assert_error(s, b, 414, "url_too_long")
            assert h["connection"] == "close" and rest == b""
            many = b"".join(b"X-%d: v\r\n" % i for i in range(11))
            s, _, b, _ = await _ask(port, b"GET /echo HTTP/1.1\r\n" + many + b"\r\n")
            _assert_error(s, b, 431, "headers_too_large")
            s, _, b, _ = await _ask(port, b"GET /echo HTTP/1.1\r\nX-Big: " + b"v" * 3000 + b"\r\n\r\n")
            _assert_error(s, b, 431, "headers_too_large")
            # a header line that never ends, sent in pieces: refused once the pieces pass the cap
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /echo HTTP/1.1\r\nX-Big: ")
            for _ in range(40):
                w.write(b"v" * 100)
                await asyncio.sleep(0.005)
            s, _, b = await read_response(r)
            _assert_error(s, b, 431, "headers_too_large")
            w.close()
            # a body larger than the head cap is no head
            body = b"x" * 100_000
            s, _, b, _ = await _ask(
                port, b"POST /echo HTTP/1.1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body
            )
            assert s == 200 and json.loads(b)["len"] == len(body)

    run(go())


def test_slow_head_and_slow_body_get_408_and_are_dropped() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits(header_timeout=0.3, body_timeout=0.5)) as (srv, port):
            # slowloris: a byte now and then, the head never ends
            r, w = await asyncio.open_connection("127.0.0.1", port)
            t0 = asyncio.get_running_loop().time()
            w.write(b"GET /echo HTTP/1.1\r\n")
            for _ in range(5):  # (stops before the deadline: writing on after the close would reset)
                await asyncio.sleep(0.05)
                w.write(b"X")
            s, _, b = await read_response(r)
            _assert_error(s, b, 408, "request_timeout")
            assert await r.read() == b""
            assert asyncio.get_running_loop().time() - t0 < 2.0
            # a body that stops coming
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"POST /echo HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc")
            s, _, b = await read_response(r)
            _assert_error(s, b, 408, "request_timeout")
            assert await r.read() == b""
            # a connection that never says anything is closed after the head deadline too
            r, w = await asyncio.open_connection("127.0.0.1", port)
            s, _, b = await asyncio.wait_for(read_response(r), 3)
            _assert_error(s, b, 408, "request_timeout")
            assert await asyncio.wait_for(r.read(), 3) == b""
            # every connection is gone, even those whose client never closed its side
            for _ in range(100):
                if not srv.connections:
                    break
                await asyncio.sleep(0.02)
            assert not srv.connections

    run(go())


def test_a_running_request_is_not_a_slow_client() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits(header_timeout=0.2, body_timeout=0.2)) as (srv, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /hang HTTP/1.1\r\n\r\n")
            await asyncio.sleep(0.8)  # the handler runs; the connection is not reading anything
            assert len(srv.connections) == 1 and not r.at_eof()
            w.close()

    run(go())


def test_head_on_every_get_route_and_405_with_allow() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits()) as (_, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"HEAD /echo HTTP/1.1\r\n\r\nGET /echo HTTP/1.1\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and b"Content-Length: " in head
            length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
            s, _, body = await read_response(r)  # the next answer follows the head at once: no body between
            assert s == 200 and json.loads(body)["method"] == "GET" and length > 0
            # HEAD on a route without GET: 405 head, no body; a wrong method: 405 with Allow
            w.write(b"HEAD /post HTTP/1.1\r\n\r\nDELETE /echo HTTP/1.1\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 405") and b"Allow: POST\r\n" in head
            s, h, body = await read_response(r)
            _assert_error(s, body, 405, "405")
            assert h["allow"] == "GET, HEAD, POST"
            w.write(b"HEAD /nowhere HTTP/1.1\r\nConnection: close\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 404") and await r.read() == b""
            w.close()

    run(go())


def test_pipelining_client_that_never_reads_does_not_grow_our_buffers() -> None:
    async def go() -> None:
        async with limited_server(HttpLimits()) as (srv, port):
            r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 20)
            req = b"GET /echo HTTP/1.1\r\nX-Test: " + b"v" * 4000 + b"\r\n\r\n"  # echoed: 4 KB answers
            sent = 0
            with contextlib.suppress(asyncio.TimeoutError):
                for _ in range(30000):  # ~120 MB of requests whose answers are never read
                    w.write(req)
                    sent += 1
                    await asyncio.wait_for(w.drain(), 0.5)
            (conn,) = srv.connections
            assert conn.transport is not None
            # the server stopped reading: the client's sends back up instead of our memory
            assert sent < 30000
            assert conn.transport.get_write_buffer_size() < 2 * 1024 * 1024
            w.close()

    run(go())
