"""A concurrency limit on completions with a bounded queue: beyond both, 429 with ``Retry-After``.

Without it a burst piles up in the proxy (every request holding its body, a
task and two backend connections) and in the backends' queues. With
``limit`` requests running, the next ``queue`` wait in arrival order for a slot
and the rest are refused at once, so a client backs off instead of timing out.
"""

from __future__ import annotations

import asyncio
from collections import deque

from vllm_pd.router.http.errors import ProxyError

RETRY_AFTER_S = 1  # what a refused client is told; a slot frees as soon as any request ends


class AdmissionGate:
    def __init__(self, limit: int, queue: int) -> None:
        self.limit = limit
        self.queue = queue
        self.active = 0
        self._waiters: deque[asyncio.Future[None]] = deque()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def enter(self) -> None:
        """Take a slot, waiting for one while the queue has room; raises a 429 ProxyError otherwise."""
        if self.active < self.limit and not self._waiters:
            self.active += 1
            return
        if len(self._waiters) >= self.queue:
            raise ProxyError(
                429,
                f"the proxy is serving {self.active} requests and has {len(self._waiters)} waiting; retry later",
                "rate_limit_exceeded",
                code="too_many_requests",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        fut = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        try:
            await fut  # leave() hands its slot over: active is not decremented in between
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.leave()  # the slot arrived as the client left: pass it on
            else:
                self._waiters.remove(fut)
            raise

    def leave(self) -> None:
        """Give the slot back: to the first waiter, if any."""
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.active -= 1
