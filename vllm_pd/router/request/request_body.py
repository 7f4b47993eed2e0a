"""Validation of client request bodies and the facts the router needs from them.

Only the fields the proxy itself reads are checked; every other field passes
through untouched (strict schemas reject real clients - vllm-router#275).

JSON is parsed once (msgspec, ~3 x the stdlib) and the decode leg reuses the
client's own bytes: a prompt of 100K tokens is never serialised again just to
add ``kv_transfer_params`` (docs/benchmarks/proxy.md, profile).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_pd.router.http.errors import ProxyError, bad_request
from vllm_pd.router.request.block_hashes import PromptBlocks
from vllm_pd.router.request.client_kv import strip_client_kv
from vllm_pd.router.request.store_prompt import StorePrompt

encode_json = msgspec.json.Encoder().encode

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass
class ParsedRequest:
    path: str
    body: dict[str, Any]
    raw: bytes  # the client's body as received; the decode leg is built from it
    stream: bool
    model: str | None
    prompt_key: str  # text the prefix-aware policy hashes
    prompt_tokens: int  # exact with a tokenizer, else estimated
    max_tokens: int
    # False when the request cannot be split into prefill + decode safely
    # (n > 1, best_of, several prompts: a shared remote_block_ids breaks vLLM, vllm#43509/#54707)
    disaggregable: bool
    blocks: PromptBlocks | None = None  # exact tokens and vLLM block hashes (kv_aware routing only)
    store: StorePrompt | None = None  # what the KV stores hold of it (kv_aware with a store master only)


TokenCounter = Callable[[str], int]


_decode_json = msgspec.json.Decoder().decode


def estimate_tokens(text: str) -> int:
    """~4 UTF-8 bytes per token (BPE on English); used when no tokenizer is configured."""
    return max(1, len(text.encode("utf-8", "surrogatepass")) // 4)


def parse_body(raw: bytes, path: str, count_tokens: TokenCounter = estimate_tokens) -> ParsedRequest:
    try:
        body = _decode_json(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"request body is not valid UTF-8 JSON: {e}", code="invalid_json") from None
    except RecursionError:
        raise bad_request("request body nests too deep", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object", code="invalid_json")
    if strip_client_kv(body):
        raw = encode_body(body)  # the decode leg is built from these bytes: they must not carry them either

    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    stream = body.get("stream", False)
    if stream is None:
        stream = False
    if not isinstance(stream, bool):
        raise bad_request("'stream' must be a boolean", "stream", "invalid_type")
    if "stream_options" in body and body["stream_options"] is not None and not isinstance(body["stream_options"], dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    for key in ("max_tokens", "max_completion_tokens", "n", "best_of", "min_tokens"):
        v = body.get(key)
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise bad_request(f"'{key}' must be a non-negative integer", key, "invalid_type")
    n = body.get("n") or 1
    best_of = body.get("best_of") or 1

    ids_len: int | None = None
    if path == CHAT:
        prompt_key, single = _chat_text(body), True
    elif path == COMPLETIONS:
        prompt_key, single, ids_len = _completion_text(body)
    else:  # pragma: no cover - routes are fixed
        raise ProxyError(404, f"unknown path {path}", code="not_found")

    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
    return ParsedRequest(
        path=path,
        body=body,
        raw=raw,
        stream=stream,
        model=model,
        prompt_key=prompt_key,
        prompt_tokens=ids_len if ids_len is not None else count_tokens(prompt_key),
        max_tokens=max_tokens,
        disaggregable=single and n == 1 and best_of == 1,
    )


def _chat_text(body: dict[str, Any]) -> str:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad_request("'messages' must be a non-empty array", "messages", "invalid_type")
    parts: list[str] = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise bad_request(f"'messages[{i}]' must be an object", f"messages[{i}]", "invalid_type")
        role = m.get("role")
        if not isinstance(role, str):
            raise bad_request(f"'messages[{i}].role' must be a string", f"messages[{i}].role", "invalid_type")
        content = m.get("content")
        parts.append(role)
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for c in content:
                if isinstance(c, dict) and isinstance(c.get("text"), str):
                    parts.append(c["text"])
        elif content is not None:
            raise bad_request(
                f"'messages[{i}].content' must be a string or an array", f"messages[{i}].content", "invalid_type"
            )
    return "\n".join(parts)


def _completion_text(body: dict[str, Any]) -> tuple[str, bool, int | None]:
    """(prefix key, whether there is exactly one prompt, token count if given as ids)."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt, True, None
    if isinstance(prompt, list) and prompt:
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return " ".join(map(str, prompt)), True, len(prompt)
        if all(isinstance(p, str) for p in prompt):
            return prompt[0], len(prompt) == 1, None
        if all(isinstance(p, list) and p and all(isinstance(t, int) for t in p) for p in prompt):
            return " ".join(map(str, prompt[0])), len(prompt) == 1, len(prompt[0])
    raise bad_request("'prompt' must be a string, an array of strings, or token ids", "prompt", "invalid_type")


def encode_body(body: dict[str, Any]) -> bytes:
    """A leg's body as JSON. The decoder's depth limit let the body in, but encoding runs deeper in the
    stack, so a body just under that limit can still overflow here: the client's 400, not a 500."""
    try:
        return encode_json(body)
    except RecursionError:
        raise bad_request("request body nests too deep", code="invalid_json") from None


def prefill_body(body: dict[str, Any], kv_params: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, KV kept for a remote decode."""
    out = dict(body)
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["stream"] = False
    for key in ("stream_options", "min_tokens", "min_completion_tokens"):
        out.pop(key, None)
    out["kv_transfer_params"] = kv_params
    return out


def decode_body(req: ParsedRequest, kv_params: dict[str, Any] | None) -> bytes:
    """The decode leg: the client's body, verbatim, plus the params prefill returned.

    The params are spliced in before the closing brace of the client's bytes
    instead of re-serialising the whole body; a body that already names
    ``kv_transfer_params`` (or is empty) is re-serialised so no key appears twice.
    """
    if kv_params is None:
        return req.raw
    raw = req.raw.rstrip()
    if req.body and "kv_transfer_params" not in req.body and raw.endswith(b"}"):
        return raw[:-1] + b',"kv_transfer_params":' + encode_json(kv_params) + b"}"
    return encode_body({**req.body, "kv_transfer_params": kv_params})
