"""Relaying decode's SSE stream: whole, checked events only, and the usage the client should see.

A backend's stream is held to what an OpenAI stream is: events that end with a blank
line (``\\n\\n``), each line ``data: <JSON object>``, ``data: [DONE]``, an SSE comment
(``:``) or another SSE field (``event:``, ``id:``, ``retry:``). An event longer than
``max_event_bytes`` (an unfinished one included: it is never buffered past that) or
one that is not of that form raises :class:`BadBackendStream`; the relay then ends
the stream with an error event rather than dropping the event - a dropped event is
a token missing from the answer, which the client could not tell from a right one.
"""

from __future__ import annotations

import json

import msgspec

from vllm_pd.errors import ProtocolError

DEFAULT_MAX_EVENT_BYTES = 4 * 1024 * 1024
_DONE = b"[DONE]"
_FIELDS = (b"event:", b"id:", b"retry:")


class _JsonObject(msgspec.Struct):
    """Any JSON object, its fields skipped: decoding checks the syntax (~0.5 us per event)."""


_check_object = msgspec.json.Decoder(_JsonObject).decode


class BadBackendStream(ProtocolError):
    """The backend's stream cannot be relayed as it is (``code`` says why; ``sample``: the start of the
    offending line, for the log - the client is not shown the backend's bytes)."""

    def __init__(self, message: str, code: str, sample: bytes = b"") -> None:
        super().__init__(message, code, sample)
        self.code = code
        self.sample = sample

    def __str__(self) -> str:
        return str(self.args[0])


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


def check_event(event: bytes, max_event_bytes: int) -> None:
    """Raise BadBackendStream unless ``event`` (without its closing blank line) is an OpenAI stream event."""
    if len(event) > max_event_bytes:
        raise BadBackendStream(
            f"the backend sent an SSE event of {len(event)} bytes, more than {max_event_bytes} (max_sse_event_bytes)",
            "sse_event_too_large",
        )
    for line in event.split(b"\n") if b"\n" in event else (event,):
        if line.startswith(b"data:"):
            payload = line[6:] if line.startswith(b"data: ") else line[5:]
            if payload == _DONE:
                continue
            try:
                _check_object(payload)
            except (msgspec.DecodeError, msgspec.ValidationError):
                raise BadBackendStream(
                    "the backend sent an SSE event whose data is not a JSON object", "malformed_sse_event", line[:120]
                ) from None
        elif line and not line.startswith(b":") and not line.startswith(_FIELDS):
            raise BadBackendStream("the backend sent a line that is no SSE field", "malformed_sse_event", line[:120])


class SseSplitter:
    """Passes whole, checked SSE events through as soon as they are complete.

    Events are the unit a client parses, so an error event can always be
    appended cleanly. Only the last (usage) event is rewritten, and only when
    prefill reported cached tokens. An unfinished event is kept as its pieces
    (no copy per read) and never past ``max_event_bytes``.
    """

    def __init__(self, cached_tokens: int | None, max_event_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> None:
        self._pending: list[bytes] = []  # an unfinished event, as it arrived
        self._pending_len = 0
        self.cached_tokens = cached_tokens
        self.max_event_bytes = max_event_bytes

    def feed(self, chunk: bytes) -> bytes:
        """The events ``chunk`` completes (b"" if none); BadBackendStream if the stream is not relayable."""
        # the common case - a read that ends on an event boundary with nothing held back -
        # passes the very bytes object through: no concatenation, no slicing
        if self._pending:
            last = self._pending[-1]
            if b"\n\n" not in chunk and not (last.endswith(b"\n") and chunk.startswith(b"\n")):
                self._hold(chunk)
                return b""
            self._pending.append(chunk)
            chunk = b"".join(self._pending)
            self._pending.clear()
            self._pending_len = 0
        if not chunk.endswith(b"\n\n"):
            cut = chunk.rfind(b"\n\n")
            if cut < 0:
                self._hold(chunk)
                return b""
            chunk, rest = chunk[: cut + 2], chunk[cut + 2 :]
            self._hold(rest)
        self._check(chunk)
        if self.cached_tokens is not None and (b'"usage":{' in chunk or b'"usage": {' in chunk):
            chunk = self._rewrite(chunk)
        return chunk

    def _hold(self, piece: bytes) -> None:
        self._pending_len += len(piece)
        if self._pending_len > self.max_event_bytes:
            self.drop_partial()
            raise BadBackendStream(
                f"the backend sent more than {self.max_event_bytes} bytes without ending an "
                "SSE event (max_sse_event_bytes)",
                "sse_event_too_large",
            )
        self._pending.append(piece)

    def _check(self, data: bytes) -> None:
        """Every event of ``data`` (which ends with a blank line)."""
        if data.count(b"\n") == 2:  # one event of one line: the common case
            check_event(data[:-2], self.max_event_bytes)
            return
        for event in data[:-2].split(b"\n\n"):
            check_event(event, self.max_event_bytes)

    def _rewrite(self, out: bytes) -> bytes:
        events = out.split(b"\n\n")
        for i, ev in enumerate(events):
            if ev.startswith(b"data: {") and b'"usage"' in ev:
                new = rewrite_usage(ev[6:], self.cached_tokens)  # type: ignore[arg-type]
                if new is not None:
                    events[i] = b"data: " + new
        return b"\n\n".join(events)

    def flush(self) -> bytes:
        """What the stream's end left unfinished (a backend that omitted the last blank line), checked."""
        out = b"".join(self._pending)
        self.drop_partial()
        if out.strip():
            check_event(out.rstrip(b"\n"), self.max_event_bytes)
        return out

    def drop_partial(self) -> None:
        self._pending.clear()
        self._pending_len = 0
