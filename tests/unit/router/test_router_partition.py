"""Legs waiting on an instance that became unreachable move on once the health checks find it
(vllm_pd/router/pool/partition_watch.py), instead of waiting their whole timeout."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.router_harness import harness, run, wait_for
from vllm_pd.router.pool.partition_watch import InstanceUnreachable, PartitionWatch

LONG = {"prompt": "long prompt " * 30, "max_tokens": 3}
# detection: two failed checks, 0.2 s apart, each given 0.2 s; legs would otherwise wait 300 s
FAST_CHECKS = {"health_interval": 0.2, "health_timeout": 0.2, "prefill_timeout": 300.0}
BOUND = 30.0  # far above the detection time, far below the legs' own timeouts


def test_guard_passes_results_and_cuts_legs_off_while_unreachable() -> None:
    async def go() -> None:
        watch = PartitionWatch()
        assert await watch.guard("http://a", asyncio.sleep(0, "answer")) == "answer"
        hung = asyncio.ensure_future(asyncio.sleep(3600))
        leg = asyncio.ensure_future(watch.guard("http://a", hung))
        await asyncio.sleep(0.01)
        watch.mark("http://b", reachable=False)  # another instance: no effect here
        await asyncio.sleep(0.01)
        assert not leg.done()
        watch.mark("http://a", reachable=False)
        with pytest.raises(InstanceUnreachable):
            await leg
        assert hung.cancelled()
        with pytest.raises(InstanceUnreachable):  # still down: a new leg fails at once
            await watch.guard("http://a", asyncio.sleep(3600))
        watch.mark("http://a", reachable=True)
        assert await watch.guard("http://a", asyncio.sleep(0, 1)) == 1
        # the caller going away cancels the leg too
        inner = asyncio.ensure_future(asyncio.sleep(3600))
        outer = asyncio.ensure_future(watch.guard("http://a", inner))
        await asyncio.sleep(0.01)
        outer.cancel()
        await asyncio.gather(outer, return_exceptions=True)
        assert inner.cancelled() and outer.cancelled()  # a client's cancel stays a cancel
        # cut off and cancelled by its caller at once: the caller's cancel wins
        both = asyncio.ensure_future(watch.guard("http://c", asyncio.sleep(3600)))
        await asyncio.sleep(0.01)
        watch.mark("http://c", reachable=False)
        both.cancel()
        await asyncio.gather(both, return_exceptions=True)
        assert both.cancelled()

    run(go)


def test_partitioned_prefill_falls_back_to_decode_only_without_waiting_its_timeout() -> None:
    async def go() -> None:
        async with harness(**FAST_CHECKS) as h:
            await h.proxy.health.check_all()
            h.prefills[0].fail_next("hang")
            h.prefills[0].unreachable = True
            status, out = await asyncio.wait_for(h.post("/v1/completions", LONG), BOUND)
            assert status == 200 and out["served_by"] == "d0"
            await wait_for(lambda: h.prefills[0].seen[0].cancelled)
            assert "kv_transfer_params" not in h.decodes[0].seen[0].body
            # back on the network: found healthy, and prefill serves again
            h.prefills[0].unreachable = False
            p0 = h.proxy.pool.get(h.backend_urls["p0"])
            await wait_for(lambda: p0.healthy)
            status, _ = await h.post("/v1/completions", LONG)
            assert status == 200 and len(h.prefills[0].seen) == 2
            assert "kv_transfer_params" in h.decodes[0].seen[1].body

    run(go)


def test_partitioned_prefill_beside_a_waiting_decode_leg_reruns_decode_only() -> None:
    async def go() -> None:
        async with harness(decode_kv=True, **FAST_CHECKS) as h:
            await h.proxy.health.check_all()
            h.prefills[0].fail_next("hang")
            h.decodes[0].fail_next("hang")  # waits for KV the cut prefill will never announce
            h.prefills[0].unreachable = True
            status, out = await asyncio.wait_for(h.post("/v1/completions", LONG), BOUND)
            assert status == 200 and out["served_by"] == "d0"
            legs = h.decodes[0].seen
            assert len(legs) == 2 and legs[0].body["kv_transfer_params"]["transfer_id"]
            await wait_for(lambda: legs[0].cancelled and h.prefills[0].seen[0].cancelled)
            assert "kv_transfer_params" not in legs[1].body
            assert b'kind="unreachable"' in h.proxy.metrics.render()

    run(go)


def test_partitioned_decode_before_its_answer_is_a_decode_failure_retried_elsewhere() -> None:
    async def go() -> None:
        async with harness(n_decode=2, decode_policy="round_robin", **FAST_CHECKS) as h:
            await h.proxy.health.check_all()
            h.decodes[0].fail_next("hang")
            h.decodes[0].unreachable = True
            status, out = await asyncio.wait_for(h.post("/v1/completions", LONG), BOUND)
            assert status == 200 and out["served_by"] == "d1"
            await wait_for(lambda: h.decodes[0].seen[0].cancelled)

    run(go)


def test_detection_time_is_set_by_flags() -> None:
    import argparse

    from vllm_pd.router.cli import command_proxy
    from vllm_pd.router.config import ConfigError

    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    cfg = command_proxy.config_from_args(p.parse_args(["--health-interval", "0.5", "--health-timeout", "0.25"]))
    assert (cfg.health_interval, cfg.health_timeout) == (0.5, 0.25)
    with pytest.raises(ConfigError, match="health_timeout"):
        command_proxy.config_from_args(p.parse_args(["--health-timeout", "0"]))
