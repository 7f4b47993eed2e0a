"""Bad input on every endpoint gets a 4xx OpenAI-style error; the proxy never crashes."""

from __future__ import annotations

import pytest

from router_harness import harness, run

ERROR_KEYS = {"message", "type", "param", "code"}


def _is_openai_error(body: object) -> bool:
    return isinstance(body, dict) and set(body.get("error", {})) == ERROR_KEYS


CASES = [
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"[1, 2]", 400, None),
    ("/v1/completions", b'"a string"', 400, None),
    ("/v1/completions", b'{"prompt": 5}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": []}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": [true]}', 400, "prompt"),
    ("/v1/completions", b'{"prompt": "a", "stream": "yes"}', 400, "stream"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": -1}', 400, "max_tokens"),
    ("/v1/completions", b'{"prompt": "a", "n": 1.5}', 400, "n"),
    ("/v1/completions", b'{"prompt": "a", "model": 7}', 400, "model"),
    ("/v1/completions", b'{"prompt": "a", "stream": true, "stream_options": 3}', 400, "stream_options"),
    ("/v1/completions", b"\xff\xfe\x00", 400, None),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": []}', 400, "messages"),
    ("/v1/chat/completions", b'{"messages": [5]}', 400, "messages[0]"),
    ("/v1/chat/completions", b'{"messages": [{"content": "x"}]}', 400, "messages[0].role"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": 5}]}', 400, "messages[0].content"),
    ("/v1/chat/completions", b"", 400, None),
]


@pytest.mark.parametrize("path,raw,status,param", CASES)
def test_bad_bodies(path: str, raw: bytes, status: int, param: str | None) -> None:
    async def go() -> None:
        async with harness() as h:
            async with h.session.post(h.url + path, data=raw,
                                      headers={"Content-Type": "application/json"}) as r:
                body = await r.json(content_type=None)
                assert r.status == status, body
            assert _is_openai_error(body)
            assert body["error"]["param"] == param
            assert not h.prefills[0].seen and not h.decodes[0].seen
    run(go)


def test_body_size_limit_wrong_method_and_unknown_path() -> None:
    async def go() -> None:
        async with harness(max_body_bytes=1000) as h:
            async with h.session.post(h.url + "/v1/completions", json={"prompt": "a" * 5000}) as r:
                assert r.status == 413 and _is_openai_error(await r.json())
            async with h.session.get(h.url + "/v1/completions") as r:
                assert r.status == 405 and _is_openai_error(await r.json())
            async with h.session.post(h.url + "/v1/nothing", json={}) as r:
                assert r.status == 404 and _is_openai_error(await r.json())
            async with h.session.post(h.url + "/v1/models", data=b"x") as r:
                assert r.status == 405 and _is_openai_error(await r.json())
            # still alive and serving
            async with h.session.post(h.url + "/v1/completions", json={"prompt": "ok " * 30}) as r:
                assert r.status == 200
    run(go)


def test_no_instances_gives_503() -> None:
    async def go() -> None:
        async with harness(n_prefill=0, n_decode=0) as h:
            status, body = await h.post("/v1/completions", {"prompt": "x"})
            assert status == 503 and _is_openai_error(body)
    run(go)


