"""The two-leg flow against mock backends: bodies on the wire, passthrough, streaming."""

from __future__ import annotations

import json

from tests.support.router_harness import harness, run
from vllm_pd.protocol.transfer_params import AwaitedPrefill

LONG = {"prompt": "long prompt " * 30, "max_tokens": 3}

NIXL_REQUEST = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def test_two_leg_bodies_exactly() -> None:
    async def go() -> None:
        async with harness() as h:
            body = {
                "model": "mock-model",
                "prompt": "hello world " * 10,
                "max_tokens": 5,
                "max_completion_tokens": 5,
                "min_tokens": 2,
                "stream": True,
                "stream_options": {"include_usage": True},
                "n": 1,
                "stop": ["x"],
                "logprobs": 2,
                "my_unknown_field": {"a": [1, 2]},
            }
            async with h.session.post(h.url + "/v1/completions", json=body, headers={"X-Request-Id": "rid-1"}) as r:
                assert r.status == 200
                await r.read()
            (p,) = h.prefills[0].seen
            (d,) = h.decodes[0].seen
            expected_p = dict(
                body, max_tokens=1, max_completion_tokens=1, stream=False, kv_transfer_params=NIXL_REQUEST
            )
            del expected_p["stream_options"], expected_p["min_tokens"]
            assert p.body == expected_p
            kv = {
                "do_remote_prefill": True,
                "do_remote_decode": False,
                "remote_engine_id": "p0",
                "remote_block_ids": [1, 2, 3],
                "remote_request_id": "rid-1",
                "remote_host": "127.0.0.1",
                "remote_port": 5600,
            }
            assert d.body == dict(body, kv_transfer_params=kv)
            assert p.headers["x-request-id"] == d.headers["x-request-id"] == "rid-1"

    run(go)


def test_legs_go_out_together_when_decode_kv_endpoint_is_known() -> None:
    async def go() -> None:
        for kv_mode, mode in (("auto", "push"), ("push", "push"), ("pull", "pull")):
            async with harness(decode_kv=True, kv_mode=kv_mode) as h:
                await h.post("/v1/completions", {"prompt": "abc " * 20, "max_tokens": 2})
                kvp = h.prefills[0].seen[0].body["kv_transfer_params"]
                transfer_id = kvp.get("transfer_id")
                assert isinstance(transfer_id, str) and len(transfer_id) == 32
                assert kvp == dict(
                    NIXL_REQUEST, transfer_mode=mode, decode_endpoint="tcp://127.0.0.1:14601", transfer_id=transfer_id
                )
                # the decode leg went out beside the prefill leg, waiting for prefill's announcement of it
                assert h.decodes[0].seen[0].body["kv_transfer_params"] == AwaitedPrefill(transfer_id, mode).to_params()
        # no KV endpoint for decode: vLLM's standard flow, prefill's answer carried to decode
        async with harness(decode_kv=False, kv_mode="auto") as h:
            await h.post("/v1/completions", {"prompt": "abc " * 20, "max_tokens": 2})
            assert h.prefills[0].seen[0].body["kv_transfer_params"] == NIXL_REQUEST
            assert h.decodes[0].seen[0].body["kv_transfer_params"]["remote_engine_id"] == "p0"

    run(go)


def test_chat_non_streaming_passthrough_and_request_id_generated() -> None:
    async def go() -> None:
        async with harness() as h:
            body = {
                "model": "mock-model",
                "messages": [{"role": "user", "content": "hi there"}],
                "max_completion_tokens": 3,
                "temperature": 0,
                "tools": [{"type": "function", "function": {"name": "f"}}],
            }
            status, out = await h.post("/v1/chat/completions", body)
            assert status == 200
            assert out["choices"][0]["message"]["content"] == " t0 t1 t2"
            assert out["served_by"] == "d0"
            d = h.decodes[0].seen[0]
            assert d.body["tools"] == body["tools"] and d.body["max_completion_tokens"] == 3
            assert h.prefills[0].seen[0].body["max_completion_tokens"] == 1
            rid = d.headers["x-request-id"]
            assert len(rid) >= 16 and h.prefills[0].seen[0].headers["x-request-id"] == rid

    run(go)


def test_streaming_is_flushed_per_event() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.25}) as h:
            body = {"prompt": "x " * 40, "max_tokens": 4, "stream": True}
            loop = __import__("asyncio").get_running_loop()
            arrivals = []
            t0 = loop.time()
            async with h.session.post(h.url + "/v1/completions", json=body) as r:
                assert r.headers["Content-Type"].startswith("text/event-stream")
                async for line in r.content:
                    if line.startswith(b"data:"):
                        arrivals.append(loop.time())
            assert len(arrivals) == 5  # 4 tokens + [DONE]
            # the backend spends 0.75 s on the 4 events: a buffering proxy would deliver
            # them all at the end; a flushing one delivers the first at once
            assert arrivals[0] - t0 < 0.45, arrivals[0] - t0
            assert arrivals[3] - arrivals[0] > 0.5

    run(go)


def test_usage_reports_prefill_cached_tokens() -> None:
    async def go() -> None:
        async with harness(backend_kw={"cached_tokens": 0}) as h:
            h.prefills[0].cached_tokens = 32
            status, out = await h.post("/v1/completions", {"prompt": "y " * 100, "max_tokens": 2})
            assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            body = {"prompt": "y " * 100, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
            async with h.session.post(h.url + "/v1/completions", json=body) as r:
                events = [
                    json.loads(line[6:]) for line in (await r.read()).split(b"\n\n") if line.startswith(b"data: {")
                ]
            assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 32
            assert events[-1]["usage"]["prompt_tokens"] > 0

    run(go)


def test_short_prompt_and_n_greater_than_one_skip_prefill() -> None:
    async def go() -> None:
        async with harness(short_prompt_tokens=8) as h:
            status, _ = await h.post("/v1/completions", {"prompt": "tiny", "max_tokens": 2})
            assert status == 200 and not h.prefills[0].seen
            assert "kv_transfer_params" not in h.decodes[0].seen[0].body
            status, _ = await h.post("/v1/completions", {"prompt": "long " * 50, "max_tokens": 2, "n": 2})
            assert status == 200 and not h.prefills[0].seen
            assert h.decodes[0].seen[1].body["n"] == 2
            status, _ = await h.post("/v1/completions", {"prompt": "long " * 50, "max_tokens": 2})
            assert len(h.prefills[0].seen) == 1

    run(go)


def test_prefill_without_kv_params_still_answers() -> None:
    async def go() -> None:
        async with harness() as h:
            h.prefills[0].kv_params = False  # an instance without a connector
            status, out = await h.post("/v1/completions", {"prompt": "long " * 50, "max_tokens": 2})
            assert status == 200
            assert "kv_transfer_params" not in h.decodes[0].seen[0].body

    run(go)


def test_models_health_metrics() -> None:
    async def go() -> None:
        async with harness(n_prefill=2, n_decode=1) as h:
            await h.proxy.health.check_all()
            async with h.session.get(h.url + "/v1/models") as r:
                assert [m["id"] for m in (await r.json())["data"]] == ["mock-model"]
            async with h.session.get(h.url + "/health") as r:
                assert r.status == 200
            await h.post("/v1/completions", {"prompt": "long " * 50, "max_tokens": 2})
            async with h.session.get(h.url + "/metrics") as r:
                text = await r.text()
            assert 'vllm_pd_proxy_requests_total{endpoint="/v1/completions",status="200"} 1.0' in text
            assert "vllm_pd_proxy_instance_healthy" in text

    run(go)


def test_unknown_model_is_404_with_openai_error() -> None:
    async def go() -> None:
        async with harness() as h:
            await h.proxy.health.check_all()
            status, out = await h.post("/v1/completions", {"model": "nope", "prompt": "a"})
            assert status == 404
            assert out["error"]["code"] == "model_not_found" and out["error"]["param"] == "model"
            assert set(out["error"]) == {"message", "type", "param", "code"}

    run(go)


def test_tpot_is_sampled_while_a_long_stream_runs() -> None:
    async def go() -> None:
        async with harness(backend_kw={"itl": 0.01}) as h:
            body = {"prompt": "x " * 40, "max_tokens": 400, "stream": True}
            async with h.session.post(h.url + "/v1/completions", json=body) as r:
                for _ in range(60):
                    await r.content.readline()
                # mid-stream, the supervisor's signal already has decode's time per token
                tpot = h.proxy.pool.recent_tpot.value
                assert tpot is not None and 0.005 < tpot < 0.2, tpot
                r.close()

    run(go)


def test_the_decode_leg_names_the_kv_endpoints_prefill_answered_with() -> None:
    """decode probes that prefill while its announcement is late (connector/announce_probe.py)."""
    from tests.unit.connector.test_transfer_params import remote_prefill
    from vllm_pd.router.pool.instance_pool import Instance

    inst = Instance("http://p:1", "prefill", None, breaker=None)  # type: ignore[arg-type]
    inst.learn_kv_peers({"do_remote_prefill": True, "remote_endpoint": "x"})  # another connector's: nothing
    assert inst.kv_peers == ()
    inst.learn_kv_peers(
        remote_prefill(
            endpoints=("tcp://10.0.0.9:7000", "tcp://10.0.0.9:7001"), tp_size=2, endpoint="tcp://10.0.0.9:7000"
        ).to_params()
    )
    assert inst.kv_peers == ("tcp://10.0.0.9:7000", "tcp://10.0.0.9:7001")

    async def go() -> None:
        async with harness(decode_kv=True) as h:
            p0 = h.proxy.pool.get(h.backend_urls["p0"])
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200 and "prefill_endpoints" not in h.decodes[0].seen[0].body["kv_transfer_params"]
            p0.kv_peers = ("tcp://10.0.0.9:7000",)
            status, _ = await h.post("/v1/completions", LONG)
            assert h.decodes[0].seen[1].body["kv_transfer_params"]["prefill_endpoints"] == ["tcp://10.0.0.9:7000"]

    run(go)


def test_a_prefill_given_with_its_kv_endpoint_is_named_from_the_first_request() -> None:
    from vllm_pd.router.config import InstanceConfig, ProxyConfig
    from vllm_pd.router.pool.instance_pool import InstancePool

    pool = InstancePool(
        ProxyConfig(
            instances=[
                InstanceConfig("http://p:1", "prefill", "tcp://p:7000"),
                InstanceConfig("http://d:1", "decode", "tcp://d:7000"),
            ]
        )
    )
    assert pool.get("http://p:1").kv_peers == ("tcp://p:7000",) and pool.get("http://d:1").kv_peers == ()
