"""The proxy's HTTP/1.1 client for its backends: a keep-alive pool of asyncio Protocols parsed by httptools.

Why not aiohttp's client (which this replaces): per leg it builds request,
payload, timer and response objects and walks its connector, about half of the
proxy's CPU per request (benchmarks/RESULTS.md "Proxy", profile). Here a leg is
one pre-joined write and a C parser feeding a deque.

Scope is what the proxy sends: a bytes body with Content-Length; responses
framed by Content-Length, chunked, or by the close of the connection. No TLS,
no redirects, no decompression (backends are vLLM instances on the local
network). A response body is buffered up to ``HIGH_WATER`` bytes; past that the
socket is paused until the reader catches up (a slow client slows decode's
socket, not the proxy's memory).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from functools import lru_cache
from typing import Iterable
from urllib.parse import urlsplit

import httptools

# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s: reusing one
# later races with its close, so connections idle longer than this are dropped
IDLE_KEEPALIVE = 4.0
HIGH_WATER = 256 * 1024  # buffered response bytes at which reading pauses
LOW_WATER = 64 * 1024  # ... and resumes


class BackendError(Exception):
    """A backend exchange failed (connection refused, reset, closed early, bad HTTP)."""


class BackendConnectError(BackendError):
    """No connection could be made: the backend never saw the request."""


@lru_cache(maxsize=1024)
def _origin(url: str) -> tuple[str, int, bytes]:
    """(host, port, Host header) of an instance URL such as ``http://10.0.0.1:8000``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"only http://host[:port] backends are supported, got {url!r}")
    port = parts.port or 80
    return parts.hostname, port, parts.netloc.encode("latin-1")


class BackendResponse:
    """One response: ``status`` once the head arrived, then its body through ``read``/``readany``.

    ``close()`` must follow (it is idempotent): a complete response hands its
    connection back to the pool, an unfinished one aborts it (which is how a
    backend learns that the request was abandoned).
    """

    __slots__ = ("status", "_conn", "_chunks", "_buffered", "_done", "_error", "_waiter", "_idle_timeout",
                 "_closed", "_timer", "_idle_timer", "_active_at")

    def __init__(self, conn: _Connection, idle_timeout: float | None) -> None:
        self.status = 0
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._idle_timeout = idle_timeout
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None  # the whole exchange's (or the head's) deadline
        # read timeout, checked lazily: one timer per response that re-arms itself while data keeps
        # coming, instead of a timer per wait (a stream of N events would create N)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._active_at = 0.0  # when data last arrived or a wait began (time.monotonic, the loop's clock)

    # ------------------------------------------------------- reader side
    async def readany(self) -> bytes:
        """Whatever body bytes arrived (waiting for some), b"" at the end of the body."""
        while not self._chunks:
            if self._error is not None:
                raise self._error
            if self._done:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join([chunks.popleft() for _ in range(len(chunks))])
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while True:
            chunk = await self.readany()
            if not chunk:
                return b"".join(parts) if len(parts) != 1 else parts[0]
            parts.append(chunk)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._conn.release(reuse=self._done and self._error is None)

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        if self._idle_timeout is not None:
            self._active_at = time.monotonic()
            if self._idle_timer is None:
                self._idle_timer = loop.call_at(self._active_at + self._idle_timeout, self._check_idle)
        try:
            await fut
        finally:
            self._waiter = None

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._closed or self._done or self._error is not None or self._idle_timeout is None:
            return
        due = self._active_at + self._idle_timeout
        if self._waiter is not None and time.monotonic() >= due:
            self._time_out(self._idle_timeout)
        else:  # data came (or nobody waits): look again when the newest wait could expire
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_at(max(due, loop.time() + 0.001), self._check_idle)

    async def _head(self) -> None:
        while not self.status:
            if self._error is not None:
                raise self._error
            await self._wait()

    # ------------------------------------------------------ protocol side
    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._active_at = time.monotonic()
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = exc
            self._wake()

    def _time_out(self, seconds: float) -> None:
        self._fail(TimeoutError(f"backend did not answer within {seconds} s"))


class _Connection(asyncio.Protocol):
    """One TCP connection; one request at a time (no pipelining)."""

    def __init__(self, pool: list[_Connection]) -> None:
        self._pool = pool
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.response: BackendResponse | None = None
        self.closed = False
        self.idle_since = 0.0
        self._paused = False
        self._framed = False  # the response names its length (Content-Length or chunked)

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.response is None:  # nothing was asked: a misbehaving server
            self.abort()
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self.response._fail(BackendError(f"malformed HTTP response: {e}"))
            self.abort()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        resp = self.response
        if resp is not None and not resp._done:
            if resp.status and not self._framed and exc is None:
                resp._finish()  # a body delimited by the close of the connection
            else:
                resp._fail(BackendError(f"backend closed the connection ({exc!r})" if exc
                                        else "backend closed the connection"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or n == b"transfer-encoding":
            self._framed = True

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is not None:
            resp.status = self._parser.get_status_code()
            resp._wake()

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._feed(body)

    def on_message_complete(self) -> None:
        if not self._parser.should_keep_alive():
            self.closed = True  # Connection: close - never reused
        if self.response is not None:
            self.response._finish()

    # used by the client and the response
    def send(self, head: bytes, body: bytes, response: BackendResponse) -> None:
        self.response = response
        self._framed = False
        assert self.transport is not None
        if len(body) < 16384:
            self.transport.write(head + body)  # one segment for the common small body
        else:
            self.transport.writelines((head, body))

    def pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def release(self, reuse: bool) -> None:
        self.resume()
        if reuse and not self.closed:
            self.response = None
            self.idle_since = time.monotonic()
            self._pool.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class BackendClient:
    """Keep-alive connections per backend, reused last-in first-out (the warmest first)."""

    def __init__(self, connect_timeout: float = 5.0) -> None:
        self.connect_timeout = connect_timeout
        self._idle: dict[tuple[str, int], list[_Connection]] = {}

    async def request(self, method: str, url: str, path: str, body: bytes = b"",
                      headers: Iterable[tuple[str, str]] = (), *, timeout: float | None = None,
                      head_timeout: float | None = None, read_timeout: float | None = None,
                      connect_timeout: float | None = None) -> BackendResponse:
        """Send one request to the backend at ``url`` (``http://host:port``) and wait for the response head.

        Timeouts (TimeoutError), in seconds once connected: ``timeout`` for the whole exchange, body
        included; ``head_timeout`` until the response head; ``read_timeout`` for each wait for the
        head or a piece of the body. (One timer per request, not asyncio.timeout's task machinery.)
        Raises BackendConnectError when no connection could be made, BackendError when the exchange
        broke after that. The caller closes the response.
        """
        host, port, host_header = _origin(url)
        conn = await self._connection(host, port, connect_timeout)
        head = b"".join([method.encode(), b" ", path.encode(), b" HTTP/1.1\r\nHost: ", host_header,
                         b"\r\nContent-Length: ", str(len(body)).encode(), b"\r\n",
                         *[f"{k}: {v}\r\n".encode("latin-1") for k, v in headers], b"\r\n"])
        resp = BackendResponse(conn, read_timeout)
        deadline = timeout if timeout is not None else head_timeout
        if deadline is not None:
            resp._timer = asyncio.get_running_loop().call_later(deadline, resp._time_out, deadline)
        try:
            conn.send(head, body, resp)
            await resp._head()
        except BaseException:
            resp.close()
            raise
        if timeout is None and resp._timer is not None:
            resp._timer.cancel()
            resp._timer = None
        return resp

    async def _connection(self, host: str, port: int, connect_timeout: float | None) -> _Connection:
        idle = self._idle.get((host, port))
        if idle is None:
            idle = self._idle[(host, port)] = []
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_KEEPALIVE:
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout if connect_timeout is not None else self.connect_timeout):
                _, conn = await loop.create_connection(lambda: _Connection(idle), host, port)
        except (OSError, TimeoutError) as e:
            raise BackendConnectError(f"cannot connect to {host}:{port}: {e!r}") from None
        return conn

    def close(self) -> None:
        """Drop every idle connection (responses still open close their own)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
            idle.clear()
