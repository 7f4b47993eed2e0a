"""Health checks of instances (GET /health, and /v1/models to learn what each one
serves): every instance periodically, and at once an instance whose legs stall
(stall_probe.py). Two failed checks in a row mark an instance down."""

from __future__ import annotations

import asyncio
import logging

import msgspec

from vllm_pd.router.backend.backend_response import BackendError
from vllm_pd.router.backend.http_client import BackendClient
from vllm_pd.router.pool.instance_pool import Instance, InstancePool
from vllm_pd.router.pool.partition_watch import PartitionWatch
from vllm_pd.router.pool.periodic_task import PeriodicTask

logger = logging.getLogger(__name__)

MAX_HEALTH_BODY = 1024 * 1024  # bytes read of a /health or /v1/models answer


class HealthChecker(PeriodicTask):
    def __init__(
        self,
        pool: InstancePool,
        client: BackendClient,
        interval: float,
        timeout: float,
        failures_to_down: int = 2,
        headers: tuple[tuple[str, str], ...] = (),
        watch: PartitionWatch | None = None,
    ) -> None:
        self._pool = pool
        self._headers = headers  # the proxy's own key for the instances, when it has one
        self._client = client
        self.interval = interval
        self._timeout = timeout
        self._failures_to_down = failures_to_down
        self._failures: dict[str, int] = {}
        self._watch = watch  # told of every verdict, so legs waiting on a lost instance move on

    async def tick(self) -> None:
        await self.check_all()

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(i) for i in self._pool.all()))

    async def check(self, inst: Instance, timeout: float | None = None) -> bool:
        """One check of ``inst`` within ``timeout`` seconds (default: health_timeout); True if it passed."""
        ok = False
        timeout = self._timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(timeout):
                status, _ = await self._get(inst.url, "/health", timeout)
                ok = status == 200
                if ok and not inst.models:
                    status, raw = await self._get(inst.url, "/v1/models", timeout)
                    if status == 200:
                        data = msgspec.json.decode(raw)
                        cards = [m for m in data.get("data", []) if isinstance(m, dict) and "id" in m]
                        inst.models = [m["id"] for m in cards]
                        # a LoRA adapter's card names its base model and its path (kv_extra_keys.py)
                        inst.adapters = {
                            m["id"]: m["root"] for m in cards if m.get("parent") and isinstance(m.get("root"), str)
                        }
        except (BackendError, TimeoutError, ValueError, TypeError, KeyError, AttributeError) as e:
            logger.debug("health check %s failed: %s", inst.url, repr(e))
            ok = False
        if ok:
            if not inst.healthy:
                logger.info("instance %s is healthy again", inst.url)
            self._failures[inst.url] = 0
            inst.healthy = True
            if self._watch is not None:
                self._watch.mark(inst.url, reachable=True)
        else:
            n = self._failures.get(inst.url, 0) + 1
            self._failures[inst.url] = n
            if n >= self._failures_to_down and inst.healthy:
                logger.warning("instance %s failed %d health checks; no new requests go there", inst.url, n)
                inst.healthy = False
            if n >= self._failures_to_down and self._watch is not None:
                self._watch.mark(inst.url, reachable=False)
        return ok

    async def _get(self, url: str, path: str, timeout: float) -> tuple[int, bytes]:
        r = await self._client.request("GET", url, path, headers=self._headers, connect_timeout=timeout)
        try:
            return r.status, await r.read(MAX_HEALTH_BODY)
        finally:
            r.close()
