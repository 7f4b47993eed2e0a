"""Probe an instance as soon as the legs waiting on it stop making progress.

The periodic health checks find a partitioned or paused instance only after two
intervals; with the default 5 s that is up to ~14 s, and a leg waiting on it
waits as long. Here the legs themselves say when to look: an instance that legs
wait on (partition_watch.py) and that sent no byte on any connection for
``probe_after`` seconds (http_client.py's ``last_received``) is checked at once
(GET /health within ``probe_timeout``) and again as long as that lasts. Two failed
checks in a row mark it down, and its legs move on - within about
``probe_after + 2 x probe_timeout`` of its last byte, whatever ``health_interval``
is. An instance that keeps sending (streams flowing, answers coming back) is
never probed, nor is one that no leg waits on: with no legs in flight this
costs nothing, not even a timer.
"""

from __future__ import annotations

import asyncio
import logging
import time

from vllm_pd.router.backend.http_client import BackendClient
from vllm_pd.router.pool.health import HealthChecker
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.pool.partition_watch import PartitionWatch

logger = logging.getLogger(__name__)


class StallProbe:
    def __init__(
        self,
        watch: PartitionWatch,
        pool: InstancePool,
        client: BackendClient,
        health: HealthChecker,
        probe_after: float,
        probe_timeout: float,
    ) -> None:
        self._watch = watch
        self._pool = pool
        self._client = client
        self._health = health
        self.probe_after = probe_after
        self.probe_timeout = probe_timeout
        self._task: asyncio.Task[None] | None = None
        self._probing: dict[str, asyncio.Task[bool]] = {}  # url -> its probe in flight
        self.probes = 0  # probes sent (tests, metrics)
        watch.on_wait = self.kick

    def kick(self) -> None:
        """A leg began waiting on an instance: run the loop if it is not running."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._watch.on_wait = None
        tasks = [t for t in (self._task, *self._probing.values()) if t is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        tick = min(self.probe_after, self.probe_timeout) / 2
        while True:
            waiting = self._watch.waiting()
            if not waiting:
                return
            now = time.monotonic()
            for url, since in waiting.items():
                quiet = now - max(since, self._client.last_received(url))
                if quiet >= self.probe_after and url not in self._probing and not self._watch.is_down(url):
                    self._start_probe(url)
            await asyncio.sleep(tick)

    def _start_probe(self, url: str) -> None:
        try:
            inst = self._pool.get(url)
        except KeyError:  # removed meanwhile
            return
        self.probes += 1
        task = asyncio.get_running_loop().create_task(self._health.check(inst, self.probe_timeout))
        self._probing[url] = task
        task.add_done_callback(lambda _: self._probing.pop(url, None))
