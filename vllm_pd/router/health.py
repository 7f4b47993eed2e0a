"""Periodic health checks of every instance (GET /health, and /v1/models to
learn what each one serves)."""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from vllm_pd.router.instance_pool import Instance, InstancePool
from vllm_pd.router.periodic_task import PeriodicTask

logger = logging.getLogger(__name__)


class HealthChecker(PeriodicTask):
    def __init__(self, pool: InstancePool, session: aiohttp.ClientSession, interval: float, timeout: float,
                 failures_to_down: int = 2) -> None:
        self._pool = pool
        self._session = session
        self.interval = interval
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._failures_to_down = failures_to_down
        self._failures: dict[str, int] = {}

    async def tick(self) -> None:
        await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self._pool.all()))

    async def check(self, inst: Instance) -> bool:
        ok = False
        try:
            async with self._session.get(inst.url + "/health", timeout=self._timeout) as r:
                ok = r.status == 200
            if ok and not inst.models:
                async with self._session.get(inst.url + "/v1/models", timeout=self._timeout) as r:
                    if r.status == 200:
                        data = await r.json(content_type=None)
                        inst.models = [m["id"] for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, TypeError, KeyError) as e:
            logger.debug("health check %s failed: %r", inst.url, e)
            ok = False
        if ok:
            if not inst.healthy:
                logger.info("instance %s is healthy again", inst.url)
            self._failures[inst.url] = 0
            inst.healthy = True
        else:
            n = self._failures.get(inst.url, 0) + 1
            self._failures[inst.url] = n
            if n >= self._failures_to_down and inst.healthy:
                logger.warning("instance %s failed %d health checks; no new requests go there", inst.url, n)
                inst.healthy = False
        return ok
