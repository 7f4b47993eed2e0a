"""Decode's stream relayed from its socket's callback (decode_relay.py's pump, BackendResponse.relay_to).

The pump sends each read's events to the client at once; a client that reads slower than decode writes
holds decode's stream (its socket pauses, later pieces queue) until the client caught up. These tests
drive the hold with real sockets: a client with a 4 KiB receive buffer that reads nothing for a while,
then everything; and a backend response whose sink holds it. The mock backend stands in for vLLM.
"""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from tests.support.router_harness import harness, run, wait_for
from vllm_pd.router.backend.backend_response import BackendResponse
from vllm_pd.router.backend.http_client import BackendClient

TOKENS = 60_000  # ~8 MB of events: more than the socket buffers between decode and a client reading nothing


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e.strip()]


def _dechunk(body: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = body.index(b"\r\n", i)
        n = int(body[i:j], 16)
        if n == 0:
            return b"".join(out)
        out.append(body[j + 2 : j + 2 + n])
        i = j + 2 + n + 2


async def _read_to_the_end(sock: socket.socket) -> bytes:
    parts, loop = [], asyncio.get_running_loop()
    while part := await loop.sock_recv(sock, 1 << 16):
        parts.append(part)
    return b"".join(parts)


def test_a_client_reading_slower_than_decode_holds_the_stream_and_gets_all_of_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    holds = []
    relayed = BackendResponse.relayed

    async def counted(self: BackendResponse) -> bool:
        ended = await relayed(self)
        if not ended:
            holds.append(1)
        return ended

    monkeypatch.setattr(BackendResponse, "relayed", counted)

    async def go() -> None:
        async with harness() as h:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # set before connecting: no autotuning
            sock.setblocking(False)
            port = int(h.url.rsplit(":", 1)[1])
            loop = asyncio.get_running_loop()
            await loop.sock_connect(sock, ("127.0.0.1", port))
            body = json.dumps({"prompt": "long prompt " * 30, "max_tokens": TOKENS, "stream": True}).encode()
            await loop.sock_sendall(
                sock,
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                b"application/json\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body),
            )
            await wait_for(lambda: bool(holds), 60)  # the client reads nothing: the proxy's writes pause
            await asyncio.sleep(0.3)
            (seen,) = h.decodes[0].seen
            assert not seen.finished  # decode's stream is held, not buffered in the proxy
            raw = await asyncio.wait_for(_read_to_the_end(sock), 60)
            sock.close()
            head, chunked = raw.split(b"\r\n\r\n", 1)
            assert head.startswith(b"HTTP/1.1 200")
            events = _events(_dechunk(chunked))
            assert events[-1] == b"data: [DONE]"
            texts = [json.loads(e[6:])["choices"][0]["text"] for e in events[:-1]]
            assert texts == [f" t{i}" for i in range(TOKENS)]  # every event, in order, once
            assert seen.finished

    run(go)


async def _chunked_server(pieces: list[bytes], gate: asyncio.Event) -> tuple[asyncio.Server, int]:
    """Answers one request with ``pieces`` as chunks: the first at once, the rest in one write (one read
    on the other side, parsed piece by piece) once ``gate`` is set."""

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readuntil(b"\r\n\r\n")
        w.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n" % (len(pieces[0]), pieces[0]))
        await w.drain()
        await gate.wait()
        w.write(b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces[1:]) + b"0\r\n\r\n")
        await w.drain()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_sink_that_holds_the_body_gets_the_queued_pieces_in_order_once_resumed() -> None:
    pieces = [b"a" * 10, b"b" * 20, b"c" * 30, b"d" * 40]

    async def go() -> None:
        gate = asyncio.Event()
        server, port = await _chunked_server(pieces, gate)
        client = BackendClient()
        resp = await client.request("GET", f"http://127.0.0.1:{port}", "/", read_timeout=5.0)
        got: list[bytes] = []
        hold = {b"b" * 20}  # the sink cannot take more after this piece

        def sink(data: bytes) -> bool:
            got.append(data)
            return data not in hold

        try:
            assert await resp.readany() == pieces[0]
            resp.relay_to(sink)
            gate.set()
            assert await resp.relayed() is False  # held after the second piece
            await asyncio.sleep(0.1)
            assert got == [pieces[1]]  # the rest of that read queued: the sink gets nothing while held
            resp.resume_relay()
            assert await resp.relayed() is True
            assert b"".join(got) == b"".join(pieces[1:])  # in order, each byte once
        finally:
            resp.close()
            client.close()
            server.close()
            await server.wait_closed()

    run(go)
