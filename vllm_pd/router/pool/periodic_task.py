"""A coroutine run every ``interval`` seconds until stopped (health checks, the supervisor)."""

from __future__ import annotations

import asyncio


class PeriodicTask:
    interval: float
    run_first: bool = True  # tick once at start, before the first sleep

    async def tick(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._task: asyncio.Task | None = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        task = getattr(self, "_task", None)
        if task is not None:
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass

    async def _loop(self) -> None:
        if self.run_first:
            await self.tick()
        while True:
            await asyncio.sleep(self.interval)
            await self.tick()
