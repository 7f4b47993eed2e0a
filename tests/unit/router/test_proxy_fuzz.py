"""A fuzz battery over raw sockets and JSON: every client mistake gets a 4xx with an OpenAI-style JSON body,
the proxy stays up, and its file descriptors and memory come back.

Own generators over a seeded random.Random (no extra dependency); each case is one connection.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import tracemalloc
from collections.abc import Callable

import pytest

from tests.support.router_harness import Harness, harness, run
from tests.unit.router.test_router_http_server import read_response

pytestmark = pytest.mark.slow

ERROR_KEYS = {"message", "type", "param", "code"}
SEED_BODIES = [
    {"model": "mock-model", "prompt": "hello world", "max_tokens": 3},
    {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "stream": True,
        "stream_options": {"include_usage": True},
        "n": 1,
    },
    {"prompt": [1, 2, 3], "max_tokens": 2, "kv_transfer_params": {"remote_host": "1.2.3.4"}},
]
TOKEN = "fuzz-admin"


def _valid_head(rng: random.Random) -> bytes:
    path = rng.choice(
        [
            b"/v1/completions",
            b"/v1/chat/completions",
            b"/v1/models",
            b"/health",
            b"/metrics",
            b"/admin/instances",
            b"/nowhere",
        ]
    )
    return b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


def _raw_garbage(rng: random.Random) -> bytes:
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 300))) + b"\r\n\r\n"


def _mutated_head(rng: random.Random) -> bytes:
    """A request whose head is broken in one of the ways clients and scanners break it."""
    body = b'{"prompt": "x"}'
    cases: list[bytes] = [
        b"G@T / HTTP/1.1\r\n\r\n",
        b"GET / HTTP/9.9\r\n\r\n",
        b"GET /v1/models HTTP/1.1 extra\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nNo colon here\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nBad Name: v\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\nX: a\x00b\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: abc\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nhello!",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 3\r\n\r\n"
        b"3\r\nabc\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nabc\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n0\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nConnection: Upgrade\r\nUpgrade: h2c\r\nContent-Length: 0\r\n\r\n",
        b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n",
        b"GET /v1/models HTTP/1.1\r\n" + b"".join(b"X-%d: v\r\n" % i for i in range(200)) + b"\r\n",
        b"GET /v1/models HTTP/1.1\r\nX-Big: " + b"v" * 40000 + b"\r\n\r\n",
        b"DELETE /v1/completions HTTP/1.1\r\n\r\n",
        b"PUT /health HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /nowhere HTTP/1.1\r\n\r\n",
        b"POST /v1/completions HTTP/1.1\r\nContent-Length: 99999999999\r\n\r\n",
        _valid_head(rng) + b"Content-Length: %d\r\n\r\n" % len(body) + body[: rng.randint(0, len(body) - 1)],
        _valid_head(rng) + b"Content-Length: 10\r\n",  # a head that never ends
    ]
    return rng.choice(cases)


def _mutated_json(rng: random.Random) -> bytes:
    raw = bytearray(json.dumps(rng.choice(SEED_BODIES)).encode())
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(6)
        pos = rng.randrange(len(raw) + 1)
        if op == 0 and raw:
            raw[min(pos, len(raw) - 1)] = rng.randrange(256)  # a byte flip (often not UTF-8)
        elif op == 1:
            del raw[pos : pos + rng.randint(1, 10)]  # truncation
        elif op == 2:
            raw[pos:pos] = rng.choice([b"[" * 3000, b'{"a":' * 2000, b"\\ud800", b"\xff\xfe", b'"', b",", b"null"])
        elif op == 3:
            raw[pos:pos] = rng.choice(["\u4e2d", "\U0001f600", "\x00", "\u2028"]).encode()
        elif op == 4:
            raw = bytearray(rng.choice([b"", b"null", b"[]", b"1e999", b'"s"', b"{}" * 3, b"\xef\xbb\xbf{}"]))
        else:
            raw += rng.choice([b"}", b"]]", b" trailing", b"\x00"])
    return bytes(raw)


async def _exchange(port: int, raw: bytes) -> tuple[int, bytes] | None:
    """Send one request; the answer's status and body, None if the connection closed without one."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    try:
        w.write(raw)
        status, _, body = await asyncio.wait_for(read_response(r), 10)
    except (ConnectionError, OSError, asyncio.IncompleteReadError):
        return None
    finally:
        w.close()
    return status, body


def _assert_client_error(raw: bytes, answer: tuple[int, bytes] | None, allow_ok: bool) -> bool:
    """True when the answer was a 4xx with an OpenAI-style body."""
    if answer is None:
        return False  # (the connection closed first: no such case is expected, the counts below tell)
    status, body = answer
    assert status < 500, (raw[:200], status, body[:300])
    if status >= 400:
        err = json.loads(body)["error"]
        assert set(err) == ERROR_KEYS, (raw[:200], body[:300])
        return True
    assert allow_ok, (raw[:200], status)
    return False


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def _battery(
    h: Harness, port: int, rng: random.Random, make: Callable[[random.Random], bytes], n: int, json_body: bool
) -> int:
    errors = 0
    for _ in range(n):
        if json_body:
            body = make(rng)
            path = rng.choice([b"/v1/completions", b"/v1/chat/completions", b"/admin/instances"])
            raw = (
                b"POST "
                + path
                + b" HTTP/1.1\r\nAuthorization: Bearer "
                + TOKEN.encode()
                + b"\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body
            )
        else:
            raw = make(rng)
        errors += _assert_client_error(raw, await _exchange(port, raw), allow_ok=json_body)
    return errors


def test_fuzz_battery_gets_4xx_and_gives_resources_back() -> None:
    rng = random.Random(20261125)

    async def go() -> None:
        # short read deadlines: a truncated request is answered 408 at once
        async with harness(
            admin_token=TOKEN,
            max_body_bytes=1 << 20,
            backend_kw={"record": False},
            header_timeout=0.3,
            body_timeout=0.3,
        ) as h:
            await h.proxy.health.check_all()
            port = int(h.url.rsplit(":", 1)[1])
            ok = json.dumps(SEED_BODIES[0]).encode()
            valid = (b"POST /v1/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n" % len(ok)) + ok
            assert (await _exchange(port, valid) or (0, b""))[0] == 200  # warm: pooled backend connections
            fds = _open_fds()
            tracemalloc.start()
            before = tracemalloc.get_traced_memory()[0]
            garbage = await _battery(h, port, rng, _raw_garbage, 150, json_body=False)
            heads = await _battery(h, port, rng, _mutated_head, 150, json_body=False)
            bodies = await _battery(h, port, rng, _mutated_json, 250, json_body=True)
            await asyncio.sleep(0.2)
            grown = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            # every raw case is a mistake: each got its 4xx; of the mutated bodies a few are still valid
            assert garbage == 150 and heads == 150 and bodies > 200, (garbage, heads, bodies)
            assert (await _exchange(port, valid) or (0, b""))[0] == 200  # still up and serving
            assert _open_fds() <= fds + 2, "file descriptors not given back"
            assert grown < 4 * 1024 * 1024, f"{grown} bytes kept after the battery"

    run(go)
