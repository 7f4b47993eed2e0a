"""The proxy's HTTP/1.1 client for its backends: a keep-alive pool of asyncio Protocols parsed by httptools.

Why not aiohttp's client (which this replaces): per leg it builds request,
payload, timer and response objects and walks its connector, about half of the
proxy's CPU per request (docs/benchmarks/proxy.md, profile). Here a leg is
one pre-joined write and a C parser feeding a deque.

Scope is what the proxy sends: a bytes body with Content-Length; responses
framed by Content-Length, chunked, or by the close of the connection; https://
backends through the ``ssl`` context the client is given (``tls_context``). No
redirects, no decompression (backends are vLLM instances on the local network).
A response body is buffered up to ``HIGH_WATER`` bytes; past that the socket is
paused until the reader catches up (a slow client slows decode's socket, not the
proxy's memory).
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Iterable
from functools import lru_cache
from urllib.parse import urlsplit

import httptools

from vllm_pd.errors import ConfigError
from vllm_pd.router.backend.backend_response import BackendConnectError, BackendError, BackendResponse

# uvicorn (vLLM's server) closes idle keep-alive connections after 5 s: reusing one
# later races with its close, so connections idle longer than this are dropped
IDLE_KEEPALIVE = 4.0


def tls_context(ca_file: str | None = None, verify: bool = True) -> ssl.SSLContext:
    """The context https:// backends are reached with: the system's CAs (or ``ca_file``'s), the host name
    checked against the certificate; ``verify`` False checks nothing (a test cluster's self-signed certs)."""
    ctx = ssl.create_default_context(cafile=ca_file)
    if not verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


@lru_cache(maxsize=1024)
def _origin(url: str) -> tuple[str, int, bytes, bool]:
    """(host, port, Host header, TLS) of an instance URL such as ``http://10.0.0.1:8000``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"only http(s)://host[:port] backends are supported, got {url!r}")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    return parts.hostname, port, parts.netloc.encode("latin-1"), tls


class _Origin:
    """One backend (host, port, TLS): its idle connections, and when any of its connections last
    received a byte - a leg's progress, which the partition watch reads instead of probing."""

    __slots__ = ("idle", "last_received")

    def __init__(self) -> None:
        self.idle: list[_Connection] = []
        self.last_received = 0.0  # time.monotonic()


class _Connection(asyncio.Protocol):
    """One TCP connection; one request at a time (no pipelining)."""

    def __init__(self, origin: _Origin) -> None:
        self._origin = origin
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
        self._origin.last_received = time.monotonic()
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
                resp._fail(
                    BackendError(f"backend closed the connection ({exc!r})" if exc else "backend closed the connection")
                )
        # break the cycles (parser -> our bound methods, response <-> connection) so a closed
        # connection and the body it buffered are freed without waiting for a full collection
        del self._parser
        self.response = None

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        n = name.lower()
        if n == b"content-length" or n == b"transfer-encoding":
            self._framed = True
        elif n == b"retry-after" and self.response is not None:
            self.response.retry_after = value[:64].decode("latin-1")

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
            self._origin.idle.append(self)
        else:
            self.abort()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()


class BackendClient:
    """Keep-alive connections per backend, reused last-in first-out (the warmest first)."""

    def __init__(self, connect_timeout: float = 5.0, tls: ssl.SSLContext | None = None) -> None:
        self.connect_timeout = connect_timeout
        self._tls = tls  # for https:// backends; made with the defaults on first use when not given
        self._origins: dict[tuple[str, int, bool], _Origin] = {}

    async def request(
        self,
        method: str,
        url: str,
        path: str,
        body: bytes = b"",
        headers: Iterable[tuple[str, str]] = (),
        *,
        timeout: float | None = None,
        head_timeout: float | None = None,
        read_timeout: float | None = None,
        connect_timeout: float | None = None,
    ) -> BackendResponse:
        """Send one request to the backend at ``url`` (``http://host:port``) and wait for the response head.

        Timeouts (TimeoutError), in seconds once connected: ``timeout`` for the whole exchange, body
        included; ``head_timeout`` until the response head; ``read_timeout`` for each wait for the
        head or a piece of the body. (One timer per request, not asyncio.timeout's task machinery.)
        Raises BackendConnectError when no connection could be made, BackendError when the exchange
        broke after that. The caller closes the response.
        """
        host, port, host_header, tls = _origin(url)
        conn = await self._connection(host, port, tls, connect_timeout)
        head = b"".join(
            [
                method.encode(),
                b" ",
                path.encode(),
                b" HTTP/1.1\r\nHost: ",
                host_header,
                b"\r\nContent-Length: ",
                str(len(body)).encode(),
                b"\r\n",
                *[f"{k}: {v}\r\n".encode("latin-1") for k, v in headers],
                b"\r\n",
            ]
        )
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

    def last_received(self, url: str) -> float:
        """When a connection to ``url`` last received a byte (time.monotonic(); 0.0: never)."""
        host, port, _, tls = _origin(url)
        origin = self._origins.get((host, port, tls))
        return origin.last_received if origin is not None else 0.0

    async def _connection(self, host: str, port: int, tls: bool, connect_timeout: float | None) -> _Connection:
        origin = self._origins.get((host, port, tls))
        if origin is None:
            origin = self._origins[(host, port, tls)] = _Origin()
        idle = origin.idle
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if not conn.closed and now - conn.idle_since < IDLE_KEEPALIVE:
                return conn
            conn.abort()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(connect_timeout if connect_timeout is not None else self.connect_timeout):
                if tls:
                    if self._tls is None:
                        self._tls = tls_context()
                    _, conn = await loop.create_connection(
                        lambda: _Connection(origin), host, port, ssl=self._tls, server_hostname=host
                    )
                else:
                    _, conn = await loop.create_connection(lambda: _Connection(origin), host, port)
        except (OSError, TimeoutError) as e:  # (ssl.SSLError, a failed handshake, is an OSError)
            raise BackendConnectError(f"cannot connect to {host}:{port}: {e!r}") from None
        return conn

    def close(self) -> None:
        """Drop every idle connection (responses still open close their own)."""
        for origin in self._origins.values():
            for conn in origin.idle:
                conn.abort()
            origin.idle.clear()
