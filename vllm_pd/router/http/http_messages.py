"""Requests and responses of the proxy's HTTP server (http_server.py), and their bytes on the wire."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Protocol
from urllib.parse import parse_qsl

import msgspec

from vllm_pd.router.http.errors import ProxyError

_encode_json = msgspec.json.Encoder().encode


class ClientConnection(Protocol):
    """What a request and its response use of the client's connection (http_server.py's, one per client)."""

    closed: bool  # the client left, or the server closed the connection: nothing more is written
    write_paused: bool  # the client reads slower than we write

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...


_STATUS_LINES: dict[int, bytes] = {}


def status_line(status: int) -> bytes:
    line = _STATUS_LINES.get(status)
    if line is None:
        try:
            reason = HTTPStatus(status).phrase
        except ValueError:
            reason = "Unknown"
        line = _STATUS_LINES[status] = f"HTTP/1.1 {status} {reason}\r\n".encode()
    return line


def _header_lines(headers: dict[str, str] | None) -> bytes:
    if not headers:
        return b""
    return "".join([f"{k}: {v}\r\n" for k, v in headers.items()]).encode("latin-1")


class HttpRequest:
    """One parsed request; header names are lower-case."""

    __slots__ = ("method", "path", "query_string", "headers", "body", "keep_alive", "conn", "http10")

    def __init__(
        self,
        method: str,
        path: str,
        query_string: str,
        headers: dict[str, str],
        body: bytes,
        keep_alive: bool,
        conn: ClientConnection,
        http10: bool = False,
    ) -> None:
        self.method = method
        self.path = path
        self.query_string = query_string
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.conn = conn
        self.http10 = http10  # an HTTP/1.0 client: no chunked encoding, a stream ends with the connection

    @property
    def query(self) -> dict[str, str]:
        return dict(parse_qsl(self.query_string))


class HttpResponse:
    """A whole response, written in one piece."""

    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(
        self,
        body: bytes = b"",
        status: int = 200,
        content_type: str = "application/json",
        headers: dict[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type
        self.headers = headers

    def encode(self, keep_alive: bool, head_only: bool = False) -> bytes:
        """The response's bytes; ``head_only`` (an answer to HEAD): the same head, no body."""
        return b"".join(
            [
                status_line(self.status),
                b"Content-Type: ",
                self.content_type.encode("latin-1"),
                b"\r\nContent-Length: ",
                str(len(self.body)).encode(),
                b"\r\n",
                _header_lines(self.headers),
                b"" if keep_alive else b"Connection: close\r\n",
                b"\r\n",
                b"" if head_only else self.body,
            ]
        )


def json_response(data: Any, status: int = 200) -> HttpResponse:
    return HttpResponse(_encode_json(data), status)


def error_response(e: ProxyError) -> HttpResponse:
    return HttpResponse(e.json_bytes(), e.status, headers=e.headers)


class StreamResponse:
    """A response written piece by piece (chunked encoding); every write is sent at once, so each SSE event
    reaches the client as soon as it is relayed. Writes wait while the client's socket buffer is full and
    raise ConnectionResetError once the client has gone."""

    __slots__ = ("status", "headers", "finished", "_conn", "_head", "_chunked")

    def __init__(self, status: int = 200, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.headers = headers
        self.finished = False
        self._conn: ClientConnection | None = None
        self._head = b""
        self._chunked = True

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: HttpRequest) -> None:
        """Bind to the request's connection; the head goes out with the first write."""
        if request.conn.closed:
            raise ConnectionResetError("client disconnected")
        self._conn = request.conn
        self._chunked = not request.http10
        if not self._chunked:
            request.keep_alive = False
        self._head = b"".join(
            [
                status_line(self.status),
                _header_lines(self.headers),
                b"Transfer-Encoding: chunked\r\n" if self._chunked else b"",
                b"" if request.keep_alive else b"Connection: close\r\n",
                b"\r\n",
            ]
        )

    async def write(self, data: bytes) -> None:
        if not self.send(data):
            await self.drain()

    def send(self, data: bytes) -> bool:
        """Write ``data`` at once, without awaiting (a stream relayed from a socket callback sends this way);
        False when the client reads slower than we write: :meth:`drain` before sending more."""
        conn = self._conn
        assert conn is not None, "prepare() first"
        if conn.closed:
            raise ConnectionResetError("client disconnected")
        if data:
            frame = b"%x\r\n%b\r\n" % (len(data), data) if self._chunked else data
            if self._head:
                frame, self._head = self._head + frame, b""
            conn.write(frame)
        return not conn.write_paused

    async def drain(self) -> None:
        """Wait until the client read enough of what was sent (ConnectionResetError once it has gone)."""
        assert self._conn is not None, "prepare() first"
        await self._conn.drain()

    async def write_eof(self) -> None:
        conn = self._conn
        assert conn is not None, "prepare() first"
        if self.finished:
            return
        conn.write(self._head + b"0\r\n\r\n" if self._chunked else self._head)
        self._head = b""
        self.finished = True
