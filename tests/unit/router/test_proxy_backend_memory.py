"""No backend can grow the proxy's memory past its limits, and a failed leg's memory goes when the leg ends.

Each case sends one request whose backend misbehaves (the router's mock, tests/support/mock_backend.py,
sending its bytes only as fast as the proxy takes them): a 200 MB prefill answer, a 200 MB non-streamed
decode answer, an SSE event that never ends, a stream that stops in the middle of a long event until
the idle timeout. It checks the answer the client gets, the process's peak RSS while the leg ran
(VmHWM, reset before each case: the proxy and the mock share this process, and the mock holds no more
than a piece or two of 64 KiB), and - with the garbage collector off, so only reference counting frees
anything - that no response, SSE splitter or request state of the finished leg is still alive and the
bytes it read were given back. A reference cycle (an exception's traceback holding the frames that
hold the buffers) would keep them until the next full collection; gc.get_referrers names the holder.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import re
import tracemalloc
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.router_harness import Harness, harness, run
from vllm_pd.router.backend.backend_response import BackendResponse
from vllm_pd.router.backend.sse_relay import SseSplitter
from vllm_pd.router.flow import decode_relay, pd_flow

MIB = 1024 * 1024
HUGE = 200 * MIB  # what the backend sends
CAP = 8 * MIB  # what the proxy is allowed to read of it
RSS_MARGIN = 48 * MIB  # interpreter, allocator and socket buffers beside the capped read
LONG = {"prompt": "long prompt " * 30, "max_tokens": 3}
_STATUS = Path("/proc/self/status")


def _peak_rss() -> int:
    return int(re.search(r"VmHWM:\s+(\d+) kB", _STATUS.read_text()).group(1)) * 1024  # type: ignore[union-attr]


def _reset_peak_rss() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class _Tracked:
    """Weak references to the proxy's objects of one leg: responses, SSE splitters, request states."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.refs: list[weakref.ref[Any]] = []
        tracked = self

        class Splitter(SseSplitter):
            def __init__(self, *a: Any, **kw: Any) -> None:
                super().__init__(*a, **kw)
                tracked.refs.append(weakref.ref(self))

        @dataclasses.dataclass
        class State(pd_flow.FlowState):
            def __post_init__(self) -> None:
                tracked.refs.append(weakref.ref(self))

        monkeypatch.setattr(decode_relay, "SseSplitter", Splitter)
        monkeypatch.setattr(pd_flow, "FlowState", State)

    def watch_client(self, h: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
        client = h.proxy.client
        assert client is not None
        request = client.request

        async def tracked_request(*a: Any, **kw: Any) -> BackendResponse:
            resp = await request(*a, **kw)
            self.refs.append(weakref.ref(resp))
            return resp

        monkeypatch.setattr(client, "request", tracked_request)

    def alive(self) -> list[Any]:
        return [obj for obj in (r() for r in self.refs) if obj is not None]


def _holders(obj: Any) -> str:
    """Who still refers to ``obj`` (for the failure message)."""
    return "; ".join(
        f"{type(r).__name__}: {str(r)[:120]}"
        for r in gc.get_referrers(obj)
        if not isinstance(r, list) or r is not gc.garbage
    )


async def _case(h: Harness, tracked: _Tracked, send: Callable[[], Any]) -> tuple[Any, int]:
    """Run ``send`` with the collector off; (its result, peak RSS growth). Asserts the leg left nothing."""
    await send()  # warm-up: first-use allocations, pooled connections
    await asyncio.sleep(0.1)
    gc.collect()
    gc.disable()
    try:
        tracked.refs.clear()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        rss0 = _peak_rss() if _reset_peak_rss() else None
        result = await send()
        peak = (_peak_rss() - rss0) if rss0 is not None else -1
        await asyncio.sleep(0.2)  # the aborted connections close, the legs' tasks end
        kept = tracemalloc.get_traced_memory()[0] - before
        tracemalloc.stop()
        alive = tracked.alive()
        assert tracked.refs, "nothing was tracked: the test proves nothing"
        assert not alive, "a finished leg left " + " | ".join(
            f"{type(o).__name__} held by {_holders(o)}" for o in alive
        )
        assert kept < MIB, f"{kept} bytes still held after the leg ended (gc off)"
        return result, peak
    finally:
        gc.enable()


def _check_rss(peak: int) -> None:
    if peak < 0:
        pytest.skip("/proc/self/clear_refs is not writable here: peak RSS cannot be reset")
    assert peak < CAP + RSS_MARGIN, f"peak RSS grew {peak / MIB:.0f} MiB for a cap of {CAP / MIB:.0f} MiB"


def test_a_huge_prefill_answer_fails_its_leg_over_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked = _Tracked(monkeypatch)

    async def go() -> None:
        async with harness(max_prefill_answer_bytes=CAP) as h:
            tracked.watch_client(h, monkeypatch)

            async def send() -> tuple[int, Any]:
                h.prefills[0].fail_next(f"huge:{HUGE}")
                return await h.post("/v1/completions", LONG)

            (status, out), peak = await _case(h, tracked, send)
            assert status == 200 and out["served_by"] == "d0"  # decode computed the prompt
            assert "kv_transfer_params" not in h.decodes[0].seen[-1].body
            assert b'vllm_pd_proxy_leg_errors_total{kind="too_large",leg="prefill"} 2.0' in h.proxy.metrics.render()
            _check_rss(peak)

    run(go)


def test_a_huge_decode_answer_ends_the_request_within_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked = _Tracked(monkeypatch)

    async def go() -> None:
        async with harness(max_decode_answer_bytes=CAP) as h:
            tracked.watch_client(h, monkeypatch)

            async def send() -> tuple[int, Any]:
                h.decodes[0].fail_next(f"huge:{HUGE}")
                return await h.post("/v1/completions", LONG)

            (status, out), peak = await _case(h, tracked, send)
            assert status == 502 and out["error"]["code"] == "answer_too_large", out
            assert "max_decode_answer_bytes" in out["error"]["message"]
            _check_rss(peak)

    run(go)


def test_an_sse_event_that_never_ends_is_cut_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    tracked = _Tracked(monkeypatch)

    async def go() -> None:
        async with harness(max_sse_event_bytes=CAP, decode_attempts=1) as h:
            tracked.watch_client(h, monkeypatch)

            async def send() -> tuple[int, Any]:
                h.decodes[0].fail_next(f"huge:{HUGE}")
                return await h.post("/v1/completions", dict(LONG, stream=True))

            (status, out), peak = await _case(h, tracked, send)
            assert status == 502 and "max_sse_event_bytes" in out["error"]["message"], out
            _check_rss(peak)

    run(go)


def test_a_stream_timed_out_in_a_long_event_frees_it_when_the_leg_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """The issue's case: 3 MB of an unfinished event, then silence until the idle timeout."""
    tracked = _Tracked(monkeypatch)

    async def go() -> None:
        async with harness(decode_idle_timeout=0.5, decode_attempts=1) as h:
            tracked.watch_client(h, monkeypatch)
            mock = h.decodes[0]
            original = mock._answer

            async def long_event_then_silence(request: Any, body: Any, seen: Any, failure: Any) -> Any:
                from vllm_pd.router.http.http_messages import StreamResponse

                resp = StreamResponse(200, {"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await resp.write(b'data: {"choices": [{"text": "' + b"y" * (3 * MIB))
                await asyncio.sleep(3600)
                return resp

            async def send() -> tuple[int, Any]:
                mock._answer = long_event_then_silence  # type: ignore[method-assign]
                try:
                    return await h.post("/v1/completions", dict(LONG, stream=True))
                finally:
                    mock._answer = original  # type: ignore[method-assign]

            (status, out), _ = await _case(h, tracked, send)
            assert status == 504, out

    run(go)
