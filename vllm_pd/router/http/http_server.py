"""The proxy's HTTP/1.1 server: an asyncio Protocol per connection, requests parsed by httptools.

Why not aiohttp's server (which this replaces): per request it builds a
request object, a task, a router match and a response object and writes the
head through its own writer; about a third of the proxy's CPU per request
(docs/benchmarks/proxy.md, profile). Here a request is one small object
and a whole response is a single ``transport.write``.

Semantics kept from aiohttp: keep-alive (and pipelined requests, answered in
order), ``Expect: 100-continue``, chunked or Content-Length request bodies up
to ``max_body`` bytes (413 beyond), a handler task per request that is
cancelled when the client disconnects, streamed responses in chunked encoding
whose writes wait while the client reads slower than the proxy writes, idle
connections closed after ``KEEPALIVE_TIMEOUT``. Errors are OpenAI-style JSON.

Beyond aiohttp: the limits of http_limits.py (431, 414, 408 for a slow client),
``HEAD`` on every GET route (the head alone), 405 with ``Allow``, and a client
pipelining without reading its answers stops being read.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections import deque
from collections.abc import Awaitable, Callable

import httptools

from vllm_pd.router.http.errors import ProxyError
from vllm_pd.router.http.http_limits import HttpLimits, head_too_large, read_timed_out, too_many_headers, url_too_long
from vllm_pd.router.http.http_messages import HttpRequest, HttpResponse, StreamResponse, error_response

logger = logging.getLogger(__name__)

Handler = Callable[[HttpRequest], Awaitable[HttpResponse | StreamResponse]]

KEEPALIVE_TIMEOUT = 75.0  # seconds an idle client connection stays open (aiohttp's default)
_SWEEP_INTERVAL = 5.0
_CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
_PIPELINE_DEPTH = 4  # requests read ahead of the running one before reading pauses

# what a connection is reading: its deadlines (http_limits.py) depend on it
_IDLE, _HEAD, _BODY = 0, 1, 2


class _Connection(asyncio.Protocol):
    """One client connection: parses requests, runs their handlers one after the other."""

    def __init__(self, server: HttpServer) -> None:
        self._server = server
        self._loop = server.loop
        self.transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._limits = server.limits
        self._url = b""
        self._headers: dict[str, str] = {}
        self._head_bytes = 0  # of the head being read: bytes of its header fields
        self._n_headers = 0
        self._head_reads: int | None = None  # bytes of the reads after the one where the head began
        self._reading = _HEAD  # a new connection owes a head within header_timeout
        self._reading_since = self._loop.time()
        self._read_paused = False
        self._lingering = False  # answered an unparseable request: what follows is dropped until close
        self._body: list[bytes] = []
        self._body_len = 0
        self._rejected = False  # the request being parsed was answered already (413)
        self._queue: deque[HttpRequest] = deque()  # pipelined requests behind the running one
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.last_active = self._loop.time()
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            return
        if self._head_reads is not None:
            # a head that began in an earlier read: count whole reads, so a header line that never
            # ends cannot grow httptools' buffer without bound (fields are counted exactly in on_header)
            self._head_reads += len(data)
            if self._head_reads > self._limits.max_header_bytes:
                self._reject(head_too_large(self._limits.max_header_bytes))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(ProxyError(400, "protocol upgrades are not supported", code="bad_request"))
        except httptools.HttpParserCallbackError as e:  # a limit, raised from a callback
            cause = e.__context__
            self._reject(
                cause
                if isinstance(cause, ProxyError)
                else ProxyError(400, f"malformed HTTP request: {e}", code="bad_request")
            )
        except httptools.HttpParserError as e:
            self._reject(ProxyError(400, f"malformed HTTP request: {e}", code="bad_request"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._server.connections.discard(self)
        if self.task is not None:
            self.task.cancel()  # the client went away: its request's legs are cancelled
        self._queue.clear()
        self._wake_writer()
        # the parser holds our bound methods: without this cycle the connection, its buffers and its
        # request's body go as soon as the last task lets go, not at the next full collection
        del self._parser
        self._body = []

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        self._wake_writer()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []
        self._body_len = 0
        self._rejected = False
        self._head_bytes = 0
        self._n_headers = 0
        self._head_reads = 0
        if self._reading == _IDLE:
            self._reading = _HEAD
            self._reading_since = self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._url += url
        if len(self._url) > self._limits.max_url_bytes:
            raise url_too_long(self._limits.max_url_bytes)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._n_headers += 1
        self._head_bytes += len(name) + len(value) + 4
        if self._n_headers > self._limits.max_headers:
            raise too_many_headers(self._limits.max_headers)
        if self._head_bytes > self._limits.max_header_bytes:
            raise head_too_large(self._limits.max_header_bytes)
        key = name.decode("latin-1").lower()
        headers = self._headers
        if key in headers:
            headers[key] = f"{headers[key]}, {value.decode('latin-1')}"
        else:
            headers[key] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        self._reading = _BODY
        self._reading_since = self._loop.time()
        self._head_reads = None
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._server.max_body:
            self._too_large()
        elif self._headers.get("expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(_CONTINUE)

    def on_body(self, body: bytes) -> None:
        if self._rejected:
            return
        self._body_len += len(body)
        if self._body_len > self._server.max_body:
            self._too_large()
        else:
            self._body.append(body)

    def on_message_complete(self) -> None:
        self._reading = _IDLE
        if self._rejected:  # answered already (413); its body was read to the end so the client sees the answer
            self.close()
            return
        url = httptools.parse_url(self._url)
        body = self._body[0] if len(self._body) == 1 else b"".join(self._body)
        self._body.clear()  # an idle keep-alive connection does not hold its last request's body
        parser = self._parser
        req = HttpRequest(
            parser.get_method().decode("latin-1"),
            url.path.decode("latin-1"),
            url.query.decode("latin-1") if url.query else "",
            self._headers,
            body,
            parser.should_keep_alive(),
            self,
            parser.get_http_version() == "1.0",
        )
        if self.task is None:
            self.task = self._loop.create_task(self._run(req))
        else:
            self._queue.append(req)
            if len(self._queue) >= _PIPELINE_DEPTH:
                self._pause_reading()  # a client pipelining without limit waits for answers

    # request handling
    async def _run(self, req: HttpRequest) -> None:
        while True:
            try:
                if self.write_paused:  # answers the client does not read are not piled up in our buffer
                    await self.drain()
                resp = await self._server.dispatch(req)
            except (asyncio.CancelledError, ConnectionResetError):  # the client went away
                self.close()
                return
            if self.closed:
                return
            if self._server.draining:  # the answer ends the connection (drain.py)
                req.keep_alive = False
            if isinstance(resp, HttpResponse):
                self.write(resp.encode(req.keep_alive, req.method == "HEAD"))
            elif not resp.finished:  # a stream the handler did not end: end it (as aiohttp does)
                if not resp.prepared:
                    await resp.prepare(req)
                await resp.write_eof()
            self.last_active = self._loop.time()
            if not req.keep_alive or self._rejected:  # (a later request was malformed: answered and done)
                self.close()
                return
            if not self._queue:
                self.task = None
                return
            req = self._queue.popleft()
            if len(self._queue) < _PIPELINE_DEPTH:
                self._resume_reading()

    def _pause_reading(self) -> None:
        if self.transport is not None and not self._read_paused:
            self._read_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self.transport is not None and self._read_paused and not self.closed:
            self._read_paused = False
            self.transport.resume_reading()

    def expire(self, now: float) -> None:
        """Drop the connection if it is past a deadline (called by the server's sweep)."""
        if self._reading == _IDLE or self._read_paused:  # (paused: waiting for us, not the client)
            if self.task is None and self.last_active < now - KEEPALIVE_TIMEOUT:
                self.close()
            return
        limits = self._limits
        timeout, what = (limits.header_timeout, "head") if self._reading == _HEAD else (limits.body_timeout, "body")
        if now - self._reading_since > timeout:
            if self._lingering or self._rejected:
                self.close()
            else:
                self._reading = _IDLE
                self._reject(read_timed_out(what, timeout))

    def write(self, data: bytes) -> None:
        if not self.closed and self.transport is not None:
            self.transport.write(data)

    async def drain(self) -> None:
        """Wait while the client reads slower than we write (raises ConnectionResetError once it left)."""
        while self.write_paused and not self.closed:
            self._drain = self._loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
        if self.closed:
            raise ConnectionResetError("client disconnected")

    def _wake_writer(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)

    def close(self) -> None:
        if not self.closed and self.transport is not None:
            self.closed = True  # nothing more is written; connection_lost still cancels the handler
            self.transport.close()

    def _too_large(self) -> None:
        self._reject(
            ProxyError(413, f"request body larger than {self._server.max_body} bytes", code="body_too_large"),
            close_now=False,
        )

    def _reject(self, e: ProxyError, close_now: bool = True) -> None:
        """Answer a request that never reaches a handler, then close: at once, or (``close_now`` False)
        once its body was read and dropped - closing with unread bytes would reset the connection
        before the client read the answer."""
        if self._rejected:
            return
        self._rejected = True
        if self.task is None and not self.closed:
            self.write(error_response(e).encode(keep_alive=False))
            if close_now:
                self._linger()
        elif self.transport is not None:
            # behind a running request: nothing more is read, and the connection closes after its answer
            self._pause_reading()
            self._queue.clear()

    def _linger(self) -> None:
        """After an answer to a request that cannot be parsed on: end our side and drop what the client
        still sends until it closes (or the header deadline passes). Closing at once with unread bytes
        would reset the connection, and the client might never read the answer."""
        self._lingering = True
        self._reading = _HEAD
        self._reading_since = self._loop.time()
        if self.transport is not None and not self.closed and self.transport.can_write_eof():
            self.transport.write_eof()
        else:
            self.close()


class HttpServer:
    """Routes (path -> method -> handler) served on one listening socket."""

    def __init__(self, routes: dict[str, dict[str, Handler]], max_body: int, limits: HttpLimits | None = None) -> None:
        self.routes = routes
        self.max_body = max_body
        self.limits = limits or HttpLimits()
        self.connections: set[_Connection] = set()
        self.loop = asyncio.get_running_loop()
        self._server: asyncio.base_events.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self.draining = False  # no longer accepting; every connection closes after its answer

    async def start(self, host: str, port: int, backlog: int = 2048, tls: ssl.SSLContext | None = None) -> None:
        self._server = await self.loop.create_server(
            lambda: _Connection(self), host, port, backlog=backlog, reuse_address=True, ssl=tls
        )
        self._sweeper = self.loop.create_task(self._sweep())

    @property
    def port(self) -> int:
        """The port listened on (the one the kernel chose when started with port 0)."""
        assert self._server is not None and self._server.sockets, "start() first"
        return int(self._server.sockets[0].getsockname()[1])

    async def dispatch(self, req: HttpRequest) -> HttpResponse | StreamResponse:
        methods = self.routes.get(req.path)
        try:
            if methods is None:
                raise ProxyError(404, f"no route {req.path}", code="404")
            handler = methods.get(req.method) or (methods.get("GET") if req.method == "HEAD" else None)
            if handler is None:
                raise ProxyError(
                    405,
                    f"method {req.method} not allowed on {req.path}",
                    code="405",
                    headers={"Allow": _allow(methods)},
                )
            return await handler(req)
        except ProxyError as e:
            return error_response(e)
        except (ConnectionResetError, asyncio.CancelledError):
            raise
        except Exception:
            logger.exception("unexpected error on %s %s", req.method, req.path)
            return error_response(ProxyError(500, "internal proxy error", "internal_error"))

    async def _sweep(self) -> None:
        interval = self.limits.sweep_interval(_SWEEP_INTERVAL)
        while True:
            await asyncio.sleep(interval)
            now = self.loop.time()
            for conn in list(self.connections):
                conn.expire(now)

    def stop_accepting(self) -> None:
        """Close the listening socket and idle connections; busy ones close after their answer."""
        self.draining = True
        if self._server is not None:
            self._server.close()
        for conn in [c for c in self.connections if c.task is None]:
            conn.close()

    def busy(self) -> int:
        """Connections with a request being answered."""
        return sum(1 for c in self.connections if c.task is not None)

    async def cleanup(self) -> None:
        """Stop listening, close every connection and wait for the handlers they cancel."""
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close()
        tasks = [c.task for c in self.connections if c.task is not None]
        for conn in list(self.connections):
            conn.close()
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.wait_closed()


def _allow(methods: dict[str, Handler]) -> str:
    """The Allow header of a route: its methods, and HEAD wherever GET is."""
    return ", ".join(sorted(set(methods) | ({"HEAD"} if "GET" in methods else set())))
