"""The proxy's Kubernetes discovery against a stand-in API server (tests/support/k8s_api_standin.py).

No Kubernetes cluster can run here, so the API server is a stand-in that
serves LIST and WATCH of pods the way the real one does (JSON-lines watch
events, 410 Gone for an expired resourceVersion, watches ending on
timeoutSeconds). The pods' "containers" are mock vLLM backends
(tests/support/mock_backend.py) on 127.0.0.1, so requests through the proxy really
reach the instances it discovered.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.support.k8s_api_standin import StandInApiServer, make_pod
from tests.support.mock_backend import MockBackend, start_backend
from vllm_pd.router.config import K8sDiscoveryConfig, ProxyConfig
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.router.pool.instance_pool import Instance
from vllm_pd.router.server.app import ProxyServer, serve
from vllm_pd.vllm_server import free_port

PREFILL = {"app": "vllm", "role": "prefill"}
DECODE = {"app": "vllm", "role": "decode"}


@dataclass
class Cluster:
    api: StandInApiServer
    proxy: ProxyServer
    url: str
    backends: dict[str, MockBackend]
    ports: dict[str, int]
    session: aiohttp.ClientSession

    def pod(self, name: str, labels: dict[str, str], ready: bool = True, **kw: Any) -> dict[str, Any]:
        return make_pod(name, labels, "127.0.0.1", ready=ready, http_port=self.ports[name], **kw)

    def instance(self, name: str) -> Instance | None:
        url = f"http://127.0.0.1:{self.ports[name]}"
        return next((i for i in self.proxy.pool.all() if i.url == url), None)

    async def complete(self, stream: bool = False, max_tokens: int = 4) -> tuple[int, str]:
        body = {"model": "mock-model", "prompt": "hello there", "max_tokens": max_tokens, "stream": stream}
        async with self.session.post(self.url + "/v1/completions", json=body) as r:
            return r.status, (await r.read()).decode()

    async def one_prefill_one_decode(self) -> None:
        """Pods p0 (prefill) and d0 (decode), Ready, and wait until the proxy routes to both."""
        self.api.put(self.pod("p0", PREFILL))
        self.api.put(self.pod("d0", DECODE))
        await eventually(lambda: self.instance("p0") and self.instance("d0"), what="p0 and d0 routed")

    def served_by(self, name: str) -> int:
        return len(self.backends[name].seen)


async def eventually(cond: Callable[[], Any], timeout: float = 10.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def cluster(names: list[str], itl: float = 0.0, **k8s_kw: Any) -> AsyncIterator[Cluster]:
    api = StandInApiServer(namespace="llm")
    await api.start()
    servers: dict[str, HttpServer] = {}
    backends = {n: MockBackend(name=n, itl=itl) for n in names}
    ports = {}
    for n, b in backends.items():
        servers[n], url = await start_backend(b)
        ports[n] = int(url.rsplit(":", 1)[1])
    k8s_kw.setdefault("reap_interval", 0.05)
    k8s_kw.setdefault("backoff_max", 0.3)
    k8s = K8sDiscoveryConfig(
        prefill_selector="app=vllm,role=prefill",
        decode_selector="app=vllm,role=decode",
        namespace="llm",
        api_url=api.url,
        **k8s_kw,
    )
    cfg = ProxyConfig(port=free_port(), kubernetes=k8s, decode_policy="round_robin", health_interval=0.2)
    proxy = ProxyServer(cfg, release_kv=lambda params: True)
    runner = await serve(proxy)
    session = aiohttp.ClientSession()
    try:
        yield Cluster(api, proxy, f"http://127.0.0.1:{cfg.port}", backends, ports, session)
    finally:
        await session.close()
        await runner.cleanup()
        for s in servers.values():
            await s.cleanup()
        await api.stop()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_ready_pods_of_each_selector_become_instances_and_serve_requests() -> None:
    async def go() -> None:
        async with cluster(["p0", "d0", "d1", "other"]) as c:
            c.api.put(c.pod("p0", PREFILL))
            c.api.put(c.pod("d0", DECODE, annotations={"vllm-pd/kv-port": "14579"}))
            c.api.put(c.pod("d1", DECODE, ready=False))
            c.api.put(c.pod("other", {"app": "vllm", "role": "embedding"}))
            await eventually(lambda: c.instance("p0") and c.instance("d0"), what="p0 and d0")
            assert c.instance("p0").role == "prefill" and c.instance("d0").role == "decode"
            assert c.instance("d0").kv_endpoint == "tcp://127.0.0.1:14579"
            assert c.instance("d1") is None and c.instance("other") is None  # not Ready / not selected
            for _ in range(4):
                status, body = await c.complete()
                assert status == 200, body
            assert c.served_by("p0") == 4 and c.served_by("d0") == 4 and c.served_by("d1") == 0

            c.api.set_ready("d1", True)  # readiness flips: d1 is routable now, and gets its share
            await eventually(lambda: c.instance("d1"), what="d1 added once Ready")
            for _ in range(4):
                assert (await c.complete())[0] == 200
            assert c.served_by("d1") == 2 and c.served_by("d0") == 6

            c.api.set_ready("d0", False)  # and back: d0 is drained, then (idle) removed
            await eventually(lambda: c.instance("d0") is None, what="d0 removed once not Ready")
            for _ in range(3):
                assert (await c.complete())[0] == 200
            assert c.served_by("d0") == 6 and c.served_by("d1") == 5
            assert c.api.requests.count("LIST") == 2  # one per role: everything else came by WATCH

    run(go())


def test_deleted_pod_is_drained_its_stream_finishes_and_new_requests_avoid_it() -> None:
    async def go() -> None:
        async with cluster(["p0", "d0", "d1"], itl=0.05) as c:
            await c.one_prefill_one_decode()
            in_flight = asyncio.create_task(c.complete(stream=True, max_tokens=30))  # ~1.5 s of stream
            await eventually(lambda: c.served_by("d0") == 1, what="the stream reached d0")
            c.api.put(c.pod("d1", DECODE))
            c.api.delete("d0")
            await eventually(lambda: c.instance("d0") and c.instance("d0").draining, what="d0 draining")
            await eventually(lambda: c.instance("d1"), what="d1 added")
            assert c.instance("d0").load == 1  # kept while its request streams
            for _ in range(3):
                assert (await c.complete())[0] == 200
            assert c.served_by("d0") == 1 and c.served_by("d1") == 3
            status, body = await in_flight
            events = [line for line in body.split("\n") if line.startswith("data: ")]
            assert status == 200 and events[-1] == "data: [DONE]" and len(events) == 31
            assert c.backends["d0"].seen[0].finished
            await eventually(lambda: c.instance("d0") is None, what="d0 removed once its stream ended")

    run(go())


def test_expired_watch_lists_again_and_catches_up() -> None:
    async def go() -> None:
        async with cluster(["p0", "d0", "d1"]) as c:
            await c.one_prefill_one_decode()
            lists, seen = c.proxy.discovery.lists, len(c.api.requests)
            # in one step, as the loop cannot run in between: the watches end, the pods change, history is
            # compacted; the proxy's next WATCH is from a version that is gone -> 410 -> LIST again
            c.api.end_watches()
            c.api.delete("d0")
            c.api.put(c.pod("d1", DECODE))
            c.api.compact()
            await eventually(lambda: c.instance("d1") and c.instance("d0") is None, what="caught up")
            assert c.proxy.discovery.lists == lists + 2  # both roles listed again
            assert c.proxy.discovery.failures == 0  # at once, as 410 asks: not as a failure, after a backoff
            after = c.api.requests[seen:]
            stale = [r for r in after if r.startswith("WATCH") and int(r.split()[1]) < c.api.compacted_at]
            assert len(stale) == 2 and after.count("LIST") == 2, after
            assert (await c.complete())[0] == 200 and c.served_by("d1") == 1

    run(go())


def test_api_server_restart_reconnects_and_applies_what_changed_meanwhile() -> None:
    async def go() -> None:
        async with cluster(["p0", "d0", "d1"]) as c:
            await c.one_prefill_one_decode()
            await c.api.stop()
            c.api.delete("d0")  # while the API server is down: no watch sees these
            c.api.put(c.pod("d1", DECODE))
            await asyncio.sleep(0.8)  # the proxy keeps failing to reconnect meanwhile
            assert c.instance("d0") is not None and not c.instance("d0").draining  # nothing learnt yet
            assert (await c.complete())[0] == 200 and c.served_by("d0") == 1  # and it still serves
            await c.api.start()  # the same port
            await eventually(lambda: c.instance("d1") and c.instance("d0") is None, what="reconnected")
            assert c.proxy.discovery.failures >= 2  # each role failed to reach it at least once
            assert (await c.complete())[0] == 200 and c.served_by("d1") == 1

    run(go())


def test_watch_renewed_from_its_version_when_the_server_ends_it() -> None:
    async def go() -> None:
        async with cluster(["p0", "d0"], watch_timeout=1.0) as c:
            c.api.put(c.pod("p0", PREFILL))
            await eventually(lambda: c.instance("p0"))
            await eventually(
                lambda: sum(r.startswith("WATCH") for r in c.api.requests) >= 4,
                timeout=5,
                what="each role's watch renewed",
            )
            c.api.put(c.pod("d0", DECODE))
            await eventually(lambda: c.instance("d0"), what="an event after the renewal")
            assert c.api.requests.count("LIST") == 2

    run(go())
