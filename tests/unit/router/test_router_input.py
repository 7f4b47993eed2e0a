"""Bad input on every endpoint gets a 4xx OpenAI-style error; the proxy never crashes."""

from __future__ import annotations

import pytest

from tests.support.router_harness import harness, run

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
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400, None),  # not UTF-8 inside a string
    ("/v1/completions", b"[" * 100_000, 400, None),  # absurdly deep
    ("/v1/completions", b'{"prompt": "a", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, None),
]


@pytest.mark.parametrize("path,raw,status,param", CASES, ids=lambda v: repr(v)[:40] if isinstance(v, bytes) else None)
def test_bad_bodies(path: str, raw: bytes, status: int, param: str | None) -> None:
    async def go() -> None:
        async with harness() as h:
            async with h.session.post(h.url + path, data=raw, headers={"Content-Type": "application/json"}) as r:
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


def _random_value(rng, depth: int = 0):
    kinds = ["int", "float", "str", "bool", "none", "list", "dict", "neg"]
    kind = rng.choice(kinds if depth < 3 else kinds[:5])
    if kind == "int":
        return rng.randint(0, 10**6)
    if kind == "neg":
        return -rng.randint(1, 10)
    if kind == "float":
        return rng.random() * 1e3
    if kind == "str":
        return "".join(rng.choice('ab \u00e9\u4e2d"\\{}\n') for _ in range(rng.randint(0, 20)))
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "none":
        return None
    if kind == "list":
        return [_random_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["role", "content", "text", "x"]): _random_value(rng, depth + 1) for _ in range(3)}


def test_random_bodies_never_give_500() -> None:
    import random

    rng = random.Random(7)
    fields = [
        "prompt",
        "messages",
        "stream",
        "stream_options",
        "n",
        "max_tokens",
        "max_completion_tokens",
        "model",
        "best_of",
        "min_tokens",
        "kv_transfer_params",
        "logprobs",
        "stop",
    ]

    async def go() -> None:
        async with harness() as h:
            await h.proxy.health.check_all()
            for _ in range(150):
                body = {f: _random_value(rng) for f in rng.sample(fields, rng.randint(0, len(fields)))}
                if rng.random() < 0.5:
                    body["prompt"] = "valid prompt " * rng.randint(0, 20)
                path = rng.choice(["/v1/completions", "/v1/chat/completions"])
                async with h.session.post(h.url + path, json=body) as r:
                    raw = await r.read()
                    assert r.status < 500, (body, r.status, raw[:300])
                    if r.status >= 400:
                        import json

                        assert _is_openai_error(json.loads(raw))
            status, _ = await h.post("/v1/completions", {"prompt": "still alive " * 10})
            assert status == 200

    run(go)
