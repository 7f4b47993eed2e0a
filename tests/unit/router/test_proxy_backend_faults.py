"""The proxy against backends that misbehave: each failure gets the answer it calls for, and no leg
waits longer than the failure takes to see. Backends are the router's mock (tests/support/mock_backend.py):
the test is about the proxy, not vLLM.

- a decode that never answers: 504; one whose connection breaks (reset, truncated answer): 502;
- 429/503 with Retry-After: that instance gets nothing until then, the others serve; with none left
  the client gets 503 with Retry-After;
- a malformed or endless SSE event: retried elsewhere before the first event, an error event after it;
- an instance whose legs stall while it stops answering (a partition, a paused host) is probed at once
  and its legs move on within seconds, with the default health interval; an idle proxy probes nothing;
- an instance that flaps (unreachable, back, unreachable...) under load loses no request.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from tests.support.router_harness import harness, run, wait_for

LONG = {"prompt": "long prompt " * 30, "max_tokens": 3}
STREAM = dict(LONG, max_tokens=6, stream=True)
# the proxy's defaults for detection: health checks every 5 s (too slow to matter here), probes 1 s
DEFAULT_CHECKS = {"health_interval": 5.0, "health_timeout": 2.0}
DETECTED_WITHIN = 8.0  # probe_after 1 s + two probes of 1 s, with room for a loaded machine


def _events(raw: bytes) -> list[bytes]:
    return [e for e in raw.split(b"\n\n") if e]


def test_decode_that_never_answers_gets_504_one_that_breaks_gets_502() -> None:
    async def go() -> None:
        async with harness(decode_timeout=0.5, decode_attempts=1) as h:
            h.decodes[0].fail_next("hang")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 504 and out["error"]["code"] == "upstream_timeout", out
            for mode in ("reset", "truncate"):
                h.decodes[0].fail_next(mode)
                status, out = await h.post("/v1/completions", LONG)
                assert status == 502 and out["error"]["type"] == "upstream_error", (mode, out)
            h.decodes[0].fail_next("truncate")  # a stream cut inside its first event
            status, out = await h.post("/v1/completions", STREAM)
            assert status == 502, out

    run(go)


def test_decode_stream_idle_past_its_timeout_gets_504_before_output_and_an_error_event_after() -> None:
    async def go() -> None:
        async with harness(decode_idle_timeout=0.5, decode_attempts=1) as h:
            h.decodes[0].fail_next("stall:0")
            status, out = await h.post("/v1/completions", STREAM)
            assert status == 504, out
            h.decodes[0].fail_next("stall:2")
            async with h.session.post(h.url + "/v1/completions", json=STREAM) as r:
                assert r.status == 200
                events = _events(await r.read())
            assert json.loads(events[2][6:])["error"]["code"] == "stream_interrupted"
            assert events[-1] == b"data: [DONE]"

    run(go)


def test_retry_after_keeps_a_busy_decode_out_and_the_other_serves() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            h.decodes[0].fail_next("429:30")
            h.decodes[1].fail_next("503:30")
            status, out = await h.post("/v1/completions", LONG)  # d0 busy, retried on d1: busy too
            assert status == 503 and out["error"]["code"] == "backend_busy", out
            d0, d1 = (h.proxy.pool.get(h.backend_urls[n]) for n in ("d0", "d1"))
            assert 25 < d0.busy_for() <= 30 and 25 < d1.busy_for() <= 30
            async with h.session.post(h.url + "/v1/completions", json=LONG) as r:
                assert r.status == 503 and 25 <= int(r.headers["Retry-After"]) <= 30
            assert len(h.decodes[0].seen) == len(h.decodes[1].seen) == 1  # nothing more went to either
            assert d0.breaker.state.value == d1.breaker.state.value == "closed"  # busy is no failure
            d1.busy_until = 0.0  # d1's pause is over: it serves, d0 still gets nothing
            for _ in range(3):
                status, out = await h.post("/v1/completions", LONG)
                assert status == 200 and out["served_by"] == "d1"
            assert len(h.decodes[0].seen) == 1

    run(go)


def test_retry_after_from_a_prefill_sends_prompts_to_the_other_prefill() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin") as h:
            h.prefills[0].fail_next("429:20")
            for _ in range(4):
                status, _ = await h.post("/v1/completions", LONG)
                assert status == 200
            assert len(h.prefills[0].seen) == 1 and len(h.prefills[1].seen) == 4
            assert all("kv_transfer_params" in s.body for s in h.decodes[0].seen)  # always a prefill leg

    run(go)


def test_retry_after_without_any_other_prefill_runs_decode_only() -> None:
    async def go() -> None:
        async with harness() as h:
            h.prefills[0].fail_next("503:20")
            for _ in range(2):
                status, _ = await h.post("/v1/completions", LONG)
                assert status == 200
            assert len(h.prefills[0].seen) == 1
            assert [("kv_transfer_params" in s.body) for s in h.decodes[0].seen] == [False, False]

    run(go)


@pytest.mark.parametrize("garbage_at", [0, 2])
def test_a_malformed_sse_event_is_not_relayed(garbage_at: int) -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            h.decodes[0].fail_next(f"garbage:{garbage_at}")
            async with h.session.post(h.url + "/v1/completions", json=STREAM) as r:
                raw = await r.read()
            events = _events(raw)
            assert b"<html>" not in raw
            if garbage_at == 0:  # nothing reached the client yet: the other decode answers it all
                assert r.status == 200 and b'"served_by": "d1"' in raw and events[-1] == b"data: [DONE]"
                assert len(events) == 7
            else:  # the client has two tokens: the stream ends with an error event saying why
                assert [json.loads(e[6:])["choices"][0]["text"] for e in events[:2]] == [" t0", " t1"]
                assert json.loads(events[2][6:])["error"]["code"] == "malformed_sse_event"
                assert events[3:] == [b"data: [DONE]"]
            assert (
                b'vllm_pd_proxy_bad_stream_events_total{reason="malformed_sse_event"} 1.0' in h.proxy.metrics.render()
            )

    run(go)


def test_a_decode_found_unreachable_ends_its_legs_with_default_health_checks() -> None:
    """Legs on a decode that stops answering (and its /health too) end within seconds, though the
    periodic checks (5 s apart) have not noticed: the stalled legs' instance is probed at once."""

    async def go() -> None:
        async with harness(**DEFAULT_CHECKS) as h:
            await h.proxy.health.check_all()
            d0 = h.decodes[0]
            d0.fail_next("stall:2", "hang")
            async with h.session.post(h.url + "/v1/completions", json=STREAM) as r:
                assert r.status == 200
                first_events = [await r.content.readline(), await r.content.readline()]
                assert first_events[0].startswith(b"data: {")
                waiting = asyncio.create_task(h.post("/v1/completions", LONG))
                await wait_for(lambda: len(d0.seen) == 2)
                d0.unreachable = True  # cut off: the stream stops mid-way, the other leg never hears
                t0 = time.monotonic()
                events = _events(b"".join(first_events) + await r.read())
            status, out = await waiting
            assert time.monotonic() - t0 < DETECTED_WITHIN
            # before output: nothing to answer with (one decode), the client hears at once
            assert status == 504 and "unreachable" in out["error"]["message"], out
            # a stream under way ends with an error event
            assert json.loads(events[2][6:])["error"]["code"] == "stream_interrupted"
            assert h.proxy.stall_probe is not None and h.proxy.stall_probe.probes >= 2
            # back on the network: found healthy again by the periodic checks, serves again
            d0.unreachable = False
            await h.proxy.health.check_all()
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200

    run(go)


def test_a_prefill_found_unreachable_hands_its_prompts_to_decode_with_default_health_checks() -> None:
    async def go() -> None:
        async with harness(decode_kv=True, **DEFAULT_CHECKS) as h:
            await h.proxy.health.check_all()
            h.prefills[0].fail_next("hang", "hang")
            h.decodes[0].fail_next("hang", "hang")  # beside legs: wait for KV the lost prefill never sends
            h.prefills[0].unreachable = True
            t0 = time.monotonic()
            results = await asyncio.gather(*(h.post("/v1/completions", LONG) for _ in range(2)))
            assert time.monotonic() - t0 < DETECTED_WITHIN
            assert [s for s, _ in results] == [200, 200]
            assert [out["served_by"] for _, out in results] == ["d0", "d0"]
            assert sum("kv_transfer_params" not in s.body for s in h.decodes[0].seen) == 2  # decode-only

    run(go)


def test_an_idle_proxy_and_legs_that_make_progress_probe_nothing() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.2}, **DEFAULT_CHECKS) as h:
            probe = h.proxy.stall_probe
            assert probe is not None
            await asyncio.sleep(1.5)
            assert probe.probes == 0  # no legs: no probes, no probe loop
            status, _ = await h.post("/v1/completions", dict(STREAM, max_tokens=12))  # 2.2 s, a token each 0.2 s
            assert status == 200
            assert probe.probes == 0

    run(go)


def test_a_flapping_decode_loses_no_request() -> None:
    """The second decode's link goes down and up every 0.4 s while requests flow: each request is
    answered (by whichever decode is reachable), none hangs."""

    async def go() -> None:
        async with harness(
            n_decode=2, decode_policy="round_robin", probe_after=0.2, probe_timeout=0.2, backend_kw={"ttft": 0.05}
        ) as h:
            await h.proxy.health.check_all()
            d1 = h.decodes[1]
            stop = asyncio.Event()

            async def flap() -> None:
                while not stop.is_set():
                    d1.unreachable = not d1.unreachable
                    await asyncio.sleep(0.4)
                d1.unreachable = False

            flapper = asyncio.create_task(flap())
            t0 = time.monotonic()
            results = await asyncio.gather(*(h.post("/v1/completions", LONG) for _ in range(40)))
            stop.set()
            await flapper
            assert [s for s, _ in results].count(200) == 40, [out for s, out in results if s != 200]
            assert time.monotonic() - t0 < 30
            await wait_for(lambda: all(i.load == 0 for i in h.proxy.pool.all()))
            # steady again: d1 is found reachable and takes its share
            await h.proxy.health.check_all()
            before = len(d1.seen)
            for _ in range(4):
                status, _ = await h.post("/v1/completions", LONG)
                assert status == 200
            assert len(d1.seen) > before

    run(go)
