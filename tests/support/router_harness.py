"""Test harness for the proxy: mock backends + a proxy on free ports, one event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from tests.support.mock_backend import MockBackend, start_backend
from vllm_pd.router.config import InstanceConfig, ProxyConfig
from vllm_pd.router.http.http_server import HttpServer
from vllm_pd.router.server.app import ProxyServer, RunningProxy, serve
from vllm_pd.vllm_server import free_port


@dataclass
class Harness:
    proxy: ProxyServer
    url: str
    prefills: list[MockBackend]
    decodes: list[MockBackend]
    backend_urls: dict[str, str]
    runners: dict[str, HttpServer]
    session: aiohttp.ClientSession
    released: list[dict] = field(default_factory=list)
    running: RunningProxy | None = None  # the listening proxy (its cleanup() runs when the harness ends)

    async def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        async with self.session.post(self.url + path, json=body, **kw) as r:
            raw = await r.read()
            try:
                import json

                return r.status, json.loads(raw)
            except ValueError:
                return r.status, raw

    async def stop_backend(self, name: str) -> None:
        await self.runners.pop(name).cleanup()


@contextlib.asynccontextmanager
async def harness(
    n_prefill: int = 1,
    n_decode: int = 1,
    release_ok: bool = True,
    decode_kv: bool = False,
    backend_kw: dict | None = None,
    **config_kw: Any,
) -> AsyncIterator[Harness]:
    runners: dict[str, HttpServer] = {}
    urls: dict[str, str] = {}
    prefills = [MockBackend(name=f"p{i}", **(backend_kw or {})) for i in range(n_prefill)]
    decodes = [MockBackend(name=f"d{i}", **(backend_kw or {})) for i in range(n_decode)]
    instances = []
    for b in prefills + decodes:
        runners[b.name], urls[b.name] = await start_backend(b)
        role = "prefill" if b in prefills else "decode"
        kv = f"tcp://127.0.0.1:{14600 + len(instances)}" if decode_kv and role == "decode" else None
        instances.append(InstanceConfig(url=urls[b.name], role=role, kv_endpoint=kv))
    released: list[dict] = []

    def release(params: dict) -> bool:  # stands in for vllm_pd.connector.worker.release (a real ZMQ call)
        released.append(params)
        return release_ok

    config_kw.setdefault("health_interval", 0.2)
    config_kw.setdefault("breaker_cooldown", 0.3)
    cfg = ProxyConfig(port=free_port(), instances=instances, **config_kw)
    proxy = ProxyServer(cfg, release_kv=release)
    runner = await serve(proxy)
    session = aiohttp.ClientSession()
    h = Harness(proxy, f"http://127.0.0.1:{cfg.port}", prefills, decodes, urls, runners, session, released, runner)
    try:
        yield h
    finally:
        await session.close()
        await runner.cleanup()
        for r in runners.values():
            await r.cleanup()


def run(coro_fn: Callable[[], Any]) -> Any:
    return asyncio.run(coro_fn())


async def wait_for(cond: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)
