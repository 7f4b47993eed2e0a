"""The few fields the proxy reads from a backend's JSON answer, decoded without the rest.

A typed msgspec view skips ``choices`` (the text, the logprobs) instead of
building Python objects for them: the proxy reads only the KV params and the
usage, once per answer.
"""

from __future__ import annotations

from typing import Any

import msgspec


class _Answer(msgspec.Struct):
    kv_transfer_params: Any = None
    usage: Any = None


_decode_answer = msgspec.json.Decoder(_Answer).decode


class BackendAnswer:
    """``kv_transfer_params``, cached and completion tokens of one answer (None where absent or mistyped)."""

    __slots__ = ("kv_params", "cached_tokens", "completion_tokens")

    def __init__(self, raw: bytes) -> None:
        """Raises ValueError (msgspec.DecodeError) when ``raw`` is not JSON; valid JSON that is not an
        object reads as an answer without any of the fields."""
        try:
            ans = _decode_answer(raw)
        except msgspec.ValidationError:
            ans = _Answer()
        self.kv_params: dict | None = ans.kv_transfer_params if isinstance(ans.kv_transfer_params, dict) else None
        usage = ans.usage if isinstance(ans.usage, dict) else {}
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.cached_tokens: int | None = cached if isinstance(cached, int) and not isinstance(cached, bool) else None
        done = usage.get("completion_tokens")
        self.completion_tokens: int = done if isinstance(done, int) and not isinstance(done, bool) else 0
