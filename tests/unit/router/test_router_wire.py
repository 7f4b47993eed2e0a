"""The proxy's byte-level pieces: decode-leg bodies built from the client's bytes, SSE event splitting,
and the fields read from backend answers."""

from __future__ import annotations

import json

import pytest

from vllm_pd.router.backend.backend_answer import BackendAnswer
from vllm_pd.router.backend.sse_relay import SseSplitter
from vllm_pd.router.http.errors import ProxyError
from vllm_pd.router.request.request_body import COMPLETIONS, decode_body, parse_body

KV = {"do_remote_prefill": True, "remote_block_ids": [1, 2], "remote_host": "10.0.0.1"}


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "max_tokens": 5, "x-unknown": {"nested": [1, 2.5, null]}}',
        b'{"prompt":"hi","seed":123456789012345678901234567890}\n  ',
        b'{"prompt": "h\\u00e9 \\"quoted\\" }", "stream": true}',
    ],
)
def test_decode_body_is_client_bytes_plus_params(raw: bytes) -> None:
    req = parse_body(raw, COMPLETIONS)
    out = decode_body(req, KV)
    assert out.startswith(raw.rstrip()[:-1])  # the client's bytes, untouched
    assert json.loads(out) == {**json.loads(raw), "kv_transfer_params": KV}
    assert decode_body(req, None) is req.raw  # decode-only: the very bytes the client sent


def test_decode_body_reencodes_when_client_named_kv_params_or_body_is_empty() -> None:
    req = parse_body(b'{"prompt": "hi", "kv_transfer_params": {"old": 1}}', COMPLETIONS)
    out = decode_body(req, KV)
    assert out.count(b"kv_transfer_params") == 1
    assert json.loads(out)["kv_transfer_params"] == KV
    with pytest.raises(ProxyError, match="prompt"):
        parse_body(b"{}", COMPLETIONS)  # no prompt: rejected before any leg is built


def test_sse_splitter_passes_whole_events_and_holds_partial_ones() -> None:
    s = SseSplitter(None)
    whole = b'data: {"a": 1}\n\n'
    assert s.feed(whole) is whole  # no copy on the common path
    assert s.feed(b'data: {"b"') == b""
    assert s.feed(b': 2}\n\ndata: {"c"') == b'data: {"b": 2}\n\n'
    assert s.feed(b": 3}\n\n") == b'data: {"c": 3}\n\n'
    assert s.flush() == b""


def test_sse_splitter_rewrites_only_usage_events_when_prefill_had_cache_hits() -> None:
    s = SseSplitter(7)
    text = b'data: {"choices": [{"text": "x"}]}\n\n'
    usage = b'data: {"choices": [], "usage": {"prompt_tokens": 9}}\n\ndata: [DONE]\n\n'
    assert s.feed(text) is text
    out = s.feed(usage).split(b"\n\n")
    assert json.loads(out[0][6:])["usage"]["prompt_tokens_details"] == {"cached_tokens": 7}
    assert out[1] == b"data: [DONE]"


def test_backend_answer_reads_only_what_it_needs() -> None:
    a = BackendAnswer(
        b'{"choices": [{"text": "t", "logprobs": null}], "kv_transfer_params": {"k": 1},'
        b' "usage": {"completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 16}}}'
    )
    assert (a.kv_params, a.cached_tokens, a.completion_tokens) == ({"k": 1}, 16, 3)
    b = BackendAnswer(b'{"kv_transfer_params": "nope", "usage": null}')
    assert (b.kv_params, b.cached_tokens, b.completion_tokens) == (None, None, 0)
    c = BackendAnswer(b"[1, 2]")  # valid JSON, not an object: no fields
    assert c.kv_params is None
    with pytest.raises(ValueError):
        BackendAnswer(b'{"truncated": ')


def test_sse_splitter_holds_an_unfinished_event_in_pieces_up_to_its_cap() -> None:
    from vllm_pd.router.backend.sse_relay import BadBackendStream

    s = SseSplitter(None, max_event_bytes=100)
    assert s.feed(b'data: {"a": "' + b"x" * 40) == b""
    assert s.feed(b"y" * 40) == b""  # held as pieces, no copy per read
    with pytest.raises(BadBackendStream, match="max_sse_event_bytes") as e:
        s.feed(b"z" * 40)
    assert e.value.code == "sse_event_too_large"
    assert s.flush() == b""  # nothing kept once over the cap
    s = SseSplitter(None, max_event_bytes=100)
    assert s.feed(b'data: {"a": 1}\n') == b""
    assert s.feed(b'\ndata: {"b": 2}\n\n') == b'data: {"a": 1}\n\ndata: {"b": 2}\n\n'  # a boundary across reads
    with pytest.raises(BadBackendStream):
        s.feed(b'data: {"c": "' + b"x" * 100 + b'"}\n\n')  # a whole event over the cap, in one read


@pytest.mark.parametrize(
    "event", [b"data: not json", b"data: [1, 2]", b"garbage line", b'data: {"a": 1', b"\x00\x01binary"]
)
def test_sse_splitter_refuses_events_that_are_not_openai_stream_events(event: bytes) -> None:
    from vllm_pd.router.backend.sse_relay import BadBackendStream

    with pytest.raises(BadBackendStream) as e:
        SseSplitter(None).feed(event + b"\n\n")
    assert e.value.code == "malformed_sse_event" and event[:20] in e.value.sample


def test_sse_splitter_passes_sse_comments_fields_and_done() -> None:
    s = SseSplitter(None)
    ok = b': keep-alive\n\nevent: message\nid: 3\ndata: {"a": 1}\n\n\ndata:{"b": 2}\n\ndata: [DONE]\n\n'
    assert s.feed(ok) == ok
    assert s.feed(b'data: {"tail": 1}') == b""
    assert s.flush() == b'data: {"tail": 1}'  # a stream ended without its last blank line
    s.feed(b"data: {broken")
    from vllm_pd.router.backend.sse_relay import BadBackendStream

    with pytest.raises(BadBackendStream):
        s.flush()


def test_retry_after_reads_seconds_and_http_dates() -> None:
    from vllm_pd.router.backend.retry_after import header_value, retry_after_seconds

    now = 1_700_000_000.0
    assert retry_after_seconds("120", now) == 120.0
    assert retry_after_seconds("Tue, 14 Nov 2023 22:13:50 GMT", now) == 30.0
    assert retry_after_seconds("Tue, 14 Nov 2023 22:00:00 GMT", now) == 0.0  # in the past: now
    for bad in (None, "", "-5", "1.5", "soon"):
        assert retry_after_seconds(bad, now) is None
    assert (header_value(0.2), header_value(29.1)) == ("1", "30")
