"""The proxy's backend HTTP client (vllm_pd/router/backend/http_client.py, backend_response.py) against
scripted servers on real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from vllm_pd.router.backend import backend_response, http_client
from vllm_pd.router.backend.backend_response import BackendConnectError, BackendError
from vllm_pd.router.backend.http_client import BackendClient
from vllm_pd.vllm_server import free_port


class ScriptedServer:
    """Reads each request head (+ Content-Length body) and lets ``script`` answer it; counts connections."""

    def __init__(self, answer: Callable[[int, bytes, asyncio.StreamWriter], Awaitable[bool]]) -> None:
        self.answer = answer  # (request number, request bytes, writer) -> keep the connection open?
        self.connections = 0
        self.requests: list[bytes] = []
        self.closed_by_peer = 0
        self.url = ""

    async def __aenter__(self) -> ScriptedServer:
        port = free_port()
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", port)
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                body = await reader.readexactly(length)
                self.requests.append(head + body)
                if not await self.answer(len(self.requests), head + body, writer):
                    writer.close()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            self.closed_by_peer += 1
            writer.close()


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n%b\r\n%b" % (len(body), extra, body)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))  # type: ignore[arg-type]


def test_content_length_and_keep_alive_reuse_one_connection() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(ok(b'{"n": %d}' % n))
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            for i in (1, 2, 3):
                r = await client.request("POST", srv.url, "/v1/x", b'{"a": 1}', [("X-Request-Id", "r")])
                assert r.status == 200 and await r.read() == b'{"n": %d}' % i
                r.close()
            assert srv.connections == 1
            first = srv.requests[0]
            assert first.startswith(b"POST /v1/x HTTP/1.1\r\n") and b"\r\nX-Request-Id: r\r\n" in first
            assert b"\r\nContent-Length: 8\r\n" in first and first.endswith(b'\r\n\r\n{"a": 1}')
            client.close()

    run(go())


def test_chunked_body_arrives_piece_by_piece() -> None:
    gate = asyncio.Event()

    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await w.drain()
        await gate.wait()
        w.write(b"6\r\n world\r\n0\r\n\r\n")
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            r = await client.request("GET", srv.url, "/s")
            assert await r.readany() == b"hello"  # before the rest was even sent
            gate.set()
            assert await r.read() == b" world"
            r.close()
            gate.clear()
            gate.set()
            r = await client.request("GET", srv.url, "/s")  # reused after a chunked body
            assert await r.read() == b"hello world"
            r.close()
            assert srv.connections == 1

    run(go())


def test_connection_close_and_close_delimited_bodies_are_not_reused() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            w.write(ok(b"one", b"Connection: close\r\n"))
        else:  # no length: the body ends with the connection
            w.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        return False

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            for expected in (b"one", b"until the end"):
                r = await client.request("GET", srv.url, "/")
                assert await r.read() == expected
                r.close()
            assert srv.connections == 2

    run(go())


def test_unfinished_response_aborts_connection_and_next_request_uses_a_fresh_one() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
            await w.drain()
            await asyncio.sleep(0.2)
            return True
        w.write(ok(b"fine") if n != 2 else b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n\r\noops")
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            r = await client.request("GET", srv.url, "/")
            assert await r.readany() == b"partial"
            r.close()  # the rest is unread: the backend must see the connection go
            r = await client.request("GET", srv.url, "/")
            assert r.status == 500 and await r.read() == b"oops"
            r.close()
            r = await client.request("GET", srv.url, "/")  # an error status leaves the connection usable
            assert await r.read() == b"fine"
            r.close()
            assert srv.connections == 2
            for _ in range(100):  # the first connection's server task is still sleeping in its answer
                if srv.closed_by_peer:
                    break
                await asyncio.sleep(0.01)
            assert srv.closed_by_peer == 1

    run(go())


def test_backend_closing_mid_body_is_an_error() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        return False

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            r = await BackendClient().request("GET", srv.url, "/")
            with pytest.raises(BackendError):
                await r.read()
            r.close()

    run(go())


def test_stale_idle_connection_is_not_reused(monkeypatch: pytest.MonkeyPatch) -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(ok(b"x"))
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            r = await client.request("GET", srv.url, "/")
            await r.read()
            r.close()
            monkeypatch.setattr(http_client, "IDLE_KEEPALIVE", 0.05)
            await asyncio.sleep(0.1)
            r = await client.request("GET", srv.url, "/")
            assert await r.read() == b"x"
            r.close()
            assert srv.connections == 2

    run(go())


def test_reading_pauses_while_the_consumer_is_slow() -> None:
    total = 32 * 1024 * 1024  # far beyond what loopback socket buffers hold
    sent = 0

    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        nonlocal sent
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % total)
        piece = b"x" * 65536
        for _ in range(total // len(piece)):
            w.write(piece)
            await w.drain()  # blocks once the client stops reading
            sent += len(piece)
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            r = await BackendClient().request("GET", srv.url, "/")
            await asyncio.sleep(0.3)  # the consumer reads nothing
            assert r._conn._paused and r._buffered <= backend_response.HIGH_WATER + 65536 * 4
            assert sent < total  # the server is held back by TCP, not buffered by the proxy
            got = 0
            while chunk := await r.readany():
                got += len(chunk)
            assert got == total == sent
            r.close()

    run(go())


def test_timeouts() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        if n == 1:
            await asyncio.sleep(1)  # no head in time
        else:
            w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await asyncio.sleep(1)  # body stalls
        return False

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            with pytest.raises(TimeoutError):
                await client.request("GET", srv.url, "/", head_timeout=0.1)
            r = await client.request("GET", srv.url, "/", read_timeout=0.1)
            assert await r.readany() == b"abc"
            with pytest.raises(TimeoutError):
                await r.readany()
            r.close()

    run(go())


def test_refused_connection_is_a_connect_error() -> None:
    async def go() -> None:
        with pytest.raises(BackendConnectError):
            await BackendClient().request("GET", f"http://127.0.0.1:{free_port()}", "/")

    run(go())


def test_read_timeout_is_per_wait_not_per_body() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(6):  # 0.36 s in all, never more than 0.06 s without data
            await asyncio.sleep(0.06)
            w.write(b"1\r\nx\r\n")
        w.write(b"0\r\n\r\n")
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            r = await BackendClient().request("GET", srv.url, "/", read_timeout=0.15)
            assert await r.read() == b"x" * 6
            r.close()

    run(go())


def test_read_stops_at_its_limit_and_the_response_keeps_no_bytes() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 429 Too Many Requests\r\nRetry-After: 7\r\nContent-Length: %d\r\n\r\n" % (1 << 20))
        for _ in range(16):
            w.write(b"z" * 65536)
            await w.drain()
        return True

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            r = await client.request("GET", srv.url, "/big")
            assert (r.status, r.retry_after) == (429, "7")
            with pytest.raises(backend_response.BodyTooLarge, match="max_test_bytes") as e:
                await r.read(100_000, "max_test_bytes")
            assert e.value.limit == 100_000
            r.close()
            assert not r._chunks  # what was buffered went with the close
            client.close()

    run(go())


def test_a_failed_response_raises_a_fresh_error_each_time() -> None:
    async def answer(n: int, req: bytes, w: asyncio.StreamWriter) -> bool:
        w.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nshort")
        return False  # closed before the body's end

    async def go() -> None:
        async with ScriptedServer(answer) as srv:
            client = BackendClient()
            r = await client.request("GET", srv.url, "/cut")
            raised = []
            for _ in range(2):
                with pytest.raises(BackendError) as e:
                    await r.read()
                raised.append(e.value)
            # the stored error is never raised itself: its traceback would tie the reader's frames to r
            assert raised[0] is not raised[1] and r._error is not raised[0] and r._error.__traceback__ is None
            r.close()

    run(go())
