"""The proxy's HTTP server (vllm_pd/router/http/http_server.py) driven by raw sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

from vllm_pd.router.http.errors import ProxyError
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse, json_response
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.vllm_server import free_port


class App:
    """Routes for the tests, with hooks they control."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.stream_gate = asyncio.Event()
        self.written = 0

    async def echo(self, req: HttpRequest) -> HttpResponse:
        return json_response(
            {
                "method": req.method,
                "path": req.path,
                "query": req.query,
                "len": len(req.body),
                "tail": req.body[-8:].decode(),
                "x": req.headers.get("x-test"),
            }
        )

    async def fail(self, req: HttpRequest) -> HttpResponse:
        raise ProxyError(418, "no coffee", code="teapot")

    async def hang(self, req: HttpRequest) -> HttpResponse:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return HttpResponse(b"")

    async def stream(self, req: HttpRequest) -> StreamResponse:
        out = StreamResponse(200, {"Content-Type": "text/event-stream"})
        await out.prepare(req)
        await out.write(b"data: 1\n\n")
        await self.stream_gate.wait()
        await out.write(b"data: 2\n\n")
        await out.write_eof()
        return out

    async def flood(self, req: HttpRequest) -> StreamResponse:
        out = StreamResponse(200)
        await out.prepare(req)
        piece = b"y" * 65536
        try:
            for _ in range(2048):  # 128 MiB unless the client reads
                await out.write(piece)
                self.written += len(piece)
        except ConnectionResetError:
            pass
        return out


@contextlib.asynccontextmanager
async def server(max_body: int = 1 << 20) -> AsyncIterator[tuple[App, int]]:
    app = App()
    routes: dict[str, dict[str, Callable[[HttpRequest], Awaitable[HttpResponse | StreamResponse]]]] = {
        "/echo": {"POST": app.echo, "GET": app.echo},
        "/fail": {"GET": app.fail},
        "/hang": {"GET": app.hang},
        "/stream": {"GET": app.stream},
        "/flood": {"GET": app.flood},
    }
    port = free_port()
    srv = HttpServer(routes, max_body)
    await srv.start("127.0.0.1", port)
    try:
        yield app, port
    finally:
        await srv.cleanup()


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ln)}
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:  # chunked
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status, headers, body
        body += chunk[:-2]


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def test_keep_alive_and_pipelined_requests_answer_in_order() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(
                b"POST /echo?a=1 HTTP/1.1\r\nHost: x\r\nX-Test: one\r\nContent-Length: 5\r\n\r\nhello"
                b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n"
            )
            s1, _, b1 = await read_response(r)
            s2, _, b2 = await read_response(r)
            assert s1 == s2 == 200
            assert json.loads(b1) == {
                "method": "POST",
                "path": "/echo",
                "query": {"a": "1"},
                "len": 5,
                "tail": "hello",
                "x": "one",
            }
            assert json.loads(b2)["method"] == "GET" and json.loads(b2)["len"] == 0
            w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            s3, h3, _ = await read_response(r)
            assert s3 == 200 and h3["connection"] == "close" and await r.read() == b""  # then closed
            w.close()

    run(go())


def test_chunked_request_body_and_expect_continue() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n4\r\ndefg\r\n0\r\n\r\n"
            )
            _, _, body = await read_response(r)
            assert json.loads(body)["tail"] == "abcdefg"
            w.write(b"POST /echo HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 3\r\n\r\n")
            assert await r.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
            w.write(b"xyz")
            _, _, body = await read_response(r)
            assert json.loads(body)["tail"] == "xyz"
            w.close()

    run(go())


def test_errors_are_openai_json() -> None:
    async def go() -> None:
        async with server(max_body=100) as (app, port):
            cases = [
                (b"GET /nowhere HTTP/1.1\r\nHost: x\r\n\r\n", 404),
                (b"DELETE /echo HTTP/1.1\r\nHost: x\r\n\r\n", 405),
                (b"GET /fail HTTP/1.1\r\nHost: x\r\n\r\n", 418),
                (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n" + b"z" * 101, 413),
                (
                    b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                    b"40\r\n" + b"z" * 64 + b"\r\n40\r\n" + b"z" * 64 + b"\r\n0\r\n\r\n",
                    413,
                ),
                (b"NOT HTTP AT ALL\r\n\r\n", 400),
            ]
            for raw, status in cases:
                r, w = await asyncio.open_connection("127.0.0.1", port)
                w.write(raw)
                got, _, body = await read_response(r)
                err = json.loads(body)["error"]
                assert got == status and set(err) == {"message", "type", "param", "code"}, (raw, got, body)
                w.close()

    run(go())


def test_each_stream_write_is_flushed_at_once() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            head = await r.readuntil(b"\r\n\r\n")
            assert b"Transfer-Encoding: chunked" in head and b"text/event-stream" in head
            assert await r.readuntil(b"\r\n") == b"9\r\n"  # the first event, while the handler waits
            assert await r.readexactly(11) == b"data: 1\n\n\r\n"
            app.stream_gate.set()
            assert await r.readexactly(14) == b"9\r\ndata: 2\n\n\r\n"
            assert await r.readexactly(5) == b"0\r\n\r\n"
            w.write(b"GET /echo HTTP/1.1\r\nHost: x\r\n\r\n")  # the connection stays usable
            assert (await read_response(r))[0] == 200
            w.close()

    run(go())


def test_client_disconnect_cancels_the_handler() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /hang HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.1)
            w.close()
            await asyncio.wait_for(app.cancelled.wait(), 2)

    run(go())


def test_stream_writes_wait_for_a_slow_client() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port, limit=1 << 16)
            w.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
            await asyncio.sleep(0.3)  # the client reads nothing
            stalled = app.written
            assert stalled < 64 * 1024 * 1024  # held back by the socket, not buffered in the proxy
            await asyncio.sleep(0.2)
            assert app.written == stalled
            w.close()

    run(go())


def test_http10_stream_is_not_chunked_and_ends_with_the_connection() -> None:
    async def go() -> None:
        async with server() as (app, port):
            app.stream_gate.set()
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /stream HTTP/1.0\r\n\r\n")
            raw = await r.read()  # until the server closes
            head, body = raw.split(b"\r\n\r\n", 1)
            assert b"chunked" not in head.lower() and body == b"data: 1\n\ndata: 2\n\n"
            w.close()

    run(go())


def test_malformed_request_behind_a_running_one_closes_after_its_answer() -> None:
    async def go() -> None:
        async with server() as (app, port):
            r, w = await asyncio.open_connection("127.0.0.1", port)
            w.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            await r.readuntil(b"data: 1")
            w.write(b"GARBAGE\x00\r\n\r\n")
            await asyncio.sleep(0.05)
            app.stream_gate.set()
            rest = await asyncio.wait_for(r.read(), 2)  # the stream ends, then the connection closes
            assert rest.endswith(b"0\r\n\r\n")
            w.close()

    run(go())
