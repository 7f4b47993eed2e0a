"""Failures handled by the flow: retries, fallbacks, breaker, mid-stream errors, disconnects."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from tests.support.router_harness import harness, run, wait_for

LONG = {"prompt": "long prompt " * 30, "max_tokens": 3}


def test_prefill_5xx_retries_on_another_prefill() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin") as h:
            h.prefills[0].fail_next("500")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 200
            assert len(h.prefills[0].seen) == len(h.prefills[1].seen) == 1
            assert h.decodes[0].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "p1"
            # every prefill fails once: each is tried once, then decode computes the prompt
            h.prefills[0].fail_next("500")
            h.prefills[1].fail_next("500")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 200
            assert len(h.prefills[0].seen) == len(h.prefills[1].seen) == 2
            assert "kv_transfer_params" not in h.decodes[0].seen[1].body

    run(go)


def test_prefill_dead_falls_back_to_decode_only_unless_required() -> None:
    async def go() -> None:
        async with harness() as h:
            await h.stop_backend("p0")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 200
            assert "kv_transfer_params" not in h.decodes[0].seen[0].body
        async with harness(require_disagg=True) as h:
            await h.stop_backend("p0")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 503 and out["error"]["code"] == "prefill_unavailable"
            assert not h.decodes[0].seen

    run(go)


def test_prefill_timeout_is_retried() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin", prefill_timeout=0.3) as h:
            h.prefills[0].fail_next("hang")
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200
            assert h.decodes[0].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "p1"
            await wait_for(lambda: h.prefills[0].seen[0].cancelled)  # the timed-out leg was aborted

    run(go)


def test_client_error_from_prefill_is_passed_through_without_decode() -> None:
    async def go() -> None:
        async with harness() as h:
            h.prefills[0].fail_next("400")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 400 and out["error"]["message"] == "bad prompt" and out["error"]["param"] == "prompt"
            assert not h.decodes[0].seen
            assert h.proxy.pool.all()[0].breaker.state.value == "closed"

    run(go)


def test_decode_5xx_before_output_retries_with_fresh_prefill_and_releases_kv() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            h.decodes[0].fail_next("500")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 200 and out["served_by"] == "d1"
            # decode saw the request and failed: its KV may be gone, so prefill ran again
            assert len(h.prefills[0].seen) == 2
            await wait_for(lambda: len(h.released) == 1)
            # both decodes fail: a clean 502, and no KV left held
            h.decodes[0].fail_next("500")
            h.decodes[1].fail_next("500")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 502 and out["error"]["type"] == "upstream_error"
            await wait_for(lambda: len(h.released) == 3)

    run(go)


def test_decode_connect_error_in_pull_mode_reuses_kv() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            await h.stop_backend("d0")
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200
            assert len(h.prefills[0].seen) == 1  # KV untouched on prefill: decode d1 takes it
            assert h.decodes[1].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "p0"
            assert h.released == []

    run(go)


@pytest.mark.parametrize("kv_mode", ["push", "pull"])
def test_decode_connect_error_beside_prefill_reruns_prefill_for_new_target(kv_mode: str) -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin", decode_kv=True, kv_mode=kv_mode) as h:
            h.prefills[0].ttft = 0.3  # decode d0's leg fails while the first prefill leg computes
            await h.stop_backend("d0")
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200
            seen = h.prefills[0].seen
            targets = [s.body["kv_transfer_params"]["decode_endpoint"] for s in seen]
            assert targets == ["tcp://127.0.0.1:14601", "tcp://127.0.0.1:14602"]
            # both legs go out at once; d1 waits for the announcement of the second prefill leg
            transfer_id = seen[1].body["kv_transfer_params"]["transfer_id"]
            assert h.decodes[1].seen[0].body["kv_transfer_params"]["transfer_id"] == transfer_id
            assert "remote_request_id" not in h.decodes[1].seen[0].body["kv_transfer_params"]
            # the first prefill leg lost its decode: it is aborted (vLLM frees its KV), not held
            await wait_for(lambda: seen[0].cancelled)
            assert h.released == []

    run(go)


def test_only_decode_dead_gives_clean_error_no_hang() -> None:
    async def go() -> None:
        async with harness() as h:
            await h.stop_backend("d0")
            status, out = await asyncio.wait_for(h.post("/v1/completions", dict(LONG, stream=True)), 5)
            assert status == 502 and out["error"]["type"] == "upstream_error"
            await wait_for(lambda: len(h.released) == 1)  # prefill's KV is not left held

    run(go)


def test_stream_broken_after_output_ends_with_error_event() -> None:
    async def go() -> None:
        async with harness() as h:
            h.decodes[0].fail_next("break:2")
            async with h.session.post(h.url + "/v1/completions", json=dict(LONG, max_tokens=6, stream=True)) as r:
                assert r.status == 200
                raw = await r.read()
            events = [e for e in raw.split(b"\n\n") if e]
            assert len(events) == 4  # two tokens, the error, [DONE]
            err = json.loads(events[2][6:])
            assert err["error"]["code"] == "stream_interrupted"
            assert events[3] == b"data: [DONE]"

    run(go)


def test_stream_failing_before_first_event_is_retried() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            h.decodes[0].fail_next("empty")
            async with h.session.post(h.url + "/v1/completions", json=dict(LONG, stream=True)) as r:
                raw = await r.read()
            assert b"[DONE]" in raw and b'"served_by": "d1"' in raw

    run(go)


def test_client_disconnect_mid_stream_aborts_decode() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.05}) as h:
            async with h.session.post(h.url + "/v1/completions", json=dict(LONG, max_tokens=200, stream=True)) as r:
                await r.content.readline()
                r.close()
            await wait_for(lambda: h.decodes[0].seen and h.decodes[0].seen[0].cancelled)
            assert not h.decodes[0].seen[0].finished
            await wait_for(lambda: all(i.load == 0 for i in h.proxy.pool.all()))
            assert h.proxy.metrics.disconnects.labels("stream")._value.get() == 1

    run(go)


def test_client_disconnect_during_prefill_cancels_prefill_and_skips_decode() -> None:
    async def go() -> None:
        async with harness() as h:
            h.prefills[0].fail_next("hang")
            with_timeout = aiohttp.ClientTimeout(total=0.3)
            try:
                await h.post("/v1/completions", LONG, timeout=with_timeout)
            except TimeoutError:
                pass
            await wait_for(lambda: h.prefills[0].seen[0].cancelled)
            await asyncio.sleep(0.1)
            assert not h.decodes[0].seen
            assert h.proxy.metrics.disconnects.labels("prefill")._value.get() == 1

    run(go)


def test_client_disconnect_between_legs_releases_prefill_kv() -> None:
    async def go() -> None:
        async with harness() as h:
            h.decodes[0].fail_next("hang")  # decode holds the request: the client gives up waiting
            # make the decode leg wait before it is sent: a gate the test controls
            gate = asyncio.Event()
            flow = h.proxy.flow
            original = flow._decode

            async def gated(*a, **kw):
                await gate.wait()
                return await original(*a, **kw)

            flow._decode = gated
            task = asyncio.create_task(h.post("/v1/completions", LONG))
            await wait_for(lambda: len(h.prefills[0].seen) == 1 and h.prefills[0].seen[0].finished)
            await asyncio.sleep(0.05)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
            await wait_for(lambda: len(h.released) == 1)
            assert h.released[0]["remote_engine_id"] == "p0"
            assert not h.decodes[0].seen

    run(go)


def test_breaker_opens_and_recovers() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin", breaker_failures=2, breaker_cooldown=3.0) as h:
            h.prefills[0].fail_next("500", "500")
            for _ in range(4):
                await h.post("/v1/completions", LONG)
            p0 = h.proxy.pool.get(h.backend_urls["p0"])
            assert p0.breaker.state.value == "open"
            before = len(h.prefills[0].seen)
            for _ in range(4):
                await h.post("/v1/completions", LONG)
            assert len(h.prefills[0].seen) == before  # open: no traffic
            await asyncio.sleep(3.1)
            for _ in range(4):
                await h.post("/v1/completions", LONG)
            assert p0.breaker.state.value == "closed" and len(h.prefills[0].seen) > before

    run(go)


def test_health_checks_take_dead_instance_out_and_drain_stops_new_requests() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin") as h:
            await h.stop_backend("d0")
            d0 = h.proxy.pool.get(h.backend_urls["d0"])
            await wait_for(lambda: not d0.healthy, 3)
            d1 = h.proxy.pool.get(h.backend_urls["d1"])
            d1.draining = True
            status, out = await h.post("/v1/completions", LONG)
            assert status == 503 and out["error"]["type"] == "service_unavailable"
            async with h.session.get(h.url + "/health") as r:
                assert r.status == 503

    run(go)


def test_decode_rejecting_request_releases_prefill_kv() -> None:
    async def go() -> None:
        async with harness() as h:
            h.decodes[0].fail_next("400")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 400 and out["error"]["message"] == "bad prompt"
            await wait_for(lambda: len(h.released) == 1)

    run(go)


def test_client_disconnect_seen_on_write_is_not_a_decode_failure(caplog) -> None:
    async def go() -> None:
        # a fast stream: the proxy notices the disconnect while writing, not by cancellation
        async with harness(backend_kw={"itl": 0.0005}) as h:
            for _ in range(3):
                async with h.session.post(
                    h.url + "/v1/completions", json=dict(LONG, max_tokens=5000, stream=True)
                ) as r:
                    await r.content.readline()
                    r.close()
            await wait_for(lambda: all(s.cancelled for s in h.decodes[0].seen))
            await wait_for(lambda: all(i.load == 0 for i in h.proxy.pool.all()))
            assert h.proxy.metrics.disconnects.labels("stream")._value.get() == 3
            assert h.proxy.metrics.stream_errors._value.get() == 0
            d0 = h.proxy.pool.get(h.backend_urls["d0"])
            assert d0.breaker._failures == 0

    run(go)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


def test_prefill_dying_under_load_loses_no_request() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, prefill_policy="round_robin", backend_kw={"ttft": 0.02}) as h:
            done: list[int] = []

            async def one(i: int) -> int:
                status, _ = await h.post("/v1/completions", dict(LONG, prompt=f"{i} " + LONG["prompt"]))
                done.append(i)
                return status

            sem = asyncio.Semaphore(16)

            async def limited(i: int) -> int:
                async with sem:
                    return await one(i)

            tasks = [asyncio.create_task(limited(i)) for i in range(200)]
            await wait_for(lambda: len(done) >= 40, 20)
            await h.stop_backend("p1")  # in-flight prefills on p1 are cut
            statuses = await asyncio.gather(*tasks)
            assert statuses == [200] * 200
            assert len(h.prefills[0].seen) > 100

    run(go)


def test_default_release_uses_the_connector_and_ignores_foreign_params() -> None:
    from vllm_pd.router.flow.pd_flow import default_release_remote_kv

    # NixlConnector-style params are not ours: nothing to release, no exception
    assert (
        default_release_remote_kv({"do_remote_prefill": True, "remote_engine_id": "x", "remote_block_ids": [1]})
        is False
    )


def test_push_mode_prefill_failure_cancels_the_waiting_decode_leg_and_runs_decode_only() -> None:
    async def go() -> None:
        async with harness(decode_kv=True) as h:
            h.decodes[0].ttft = 0.5  # the first decode leg is still waiting when prefill fails
            h.prefills[0].fail_next("500")
            status, out = await h.post("/v1/completions", LONG)
            assert status == 200 and out["served_by"] == "d0"
            legs = h.decodes[0].seen
            assert len(legs) == 2
            assert legs[0].body["kv_transfer_params"]["transfer_id"]  # sent beside the prefill leg
            await wait_for(lambda: legs[0].cancelled)  # no push will come: not left waiting
            assert "kv_transfer_params" not in legs[1].body  # decode computes the prompt

    run(go)
