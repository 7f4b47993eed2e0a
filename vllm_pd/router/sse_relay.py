"""Relaying decode's SSE stream: whole events only, and the usage the client should see."""

from __future__ import annotations

import json


def rewrite_usage(raw: bytes, cached_tokens: int) -> bytes | None:
    """Put prefill's prefix-cache hits into usage.prompt_tokens_details.cached_tokens."""
    try:
        data = json.loads(raw)
    except ValueError:
        return None
    usage = data.get("usage") if isinstance(data, dict) else None
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict):
        details = {}
    details["cached_tokens"] = cached_tokens
    usage["prompt_tokens_details"] = details
    return json.dumps(data, separators=(",", ":")).encode()


class SseSplitter:
    """Passes whole SSE events through as soon as they are complete.

    Events are the unit a client parses, so an error event can always be
    appended cleanly. Only the last (usage) event is rewritten, and only when
    prefill reported cached tokens.
    """

    def __init__(self, cached_tokens: int | None) -> None:
        self._buf = b""
        self.cached_tokens = cached_tokens

    def feed(self, chunk: bytes) -> bytes:
        # the common case - a read that ends on an event boundary with nothing held back -
        # passes the very bytes object through: no concatenation, no slicing
        if self._buf:
            chunk, self._buf = self._buf + chunk, b""
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                self._buf = chunk
                return b""
            chunk, self._buf = chunk[:cut + 2], chunk[cut + 2:]
        if self.cached_tokens is not None and (b'"usage":{' in chunk or b'"usage": {' in chunk):
            chunk = self._rewrite(chunk)
        return chunk

    def _rewrite(self, out: bytes) -> bytes:
        events = out.split(b"\n\n")
        for i, ev in enumerate(events):
            if ev.startswith(b"data: {") and b'"usage"' in ev:
                new = rewrite_usage(ev[6:], self.cached_tokens)  # type: ignore[arg-type]
                if new is not None:
                    events[i] = b"data: " + new
        return b"\n\n".join(events)

    def flush(self) -> bytes:
        out, self._buf = self._buf, b""
        return out

    def drop_partial(self) -> None:
        self._buf = b""
