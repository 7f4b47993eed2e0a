"""Legs waiting on an instance that became unreachable fail as soon as that is known.

A partitioned backend (link down, host paused) closes none of its connections: a
leg waiting on it would wait its whole timeout (``prefill_timeout``, 300 s by
default), though the request could move on at once - to another prefill, or to
decode computing the prompt itself. Two failed checks in a row find such an
instance - the periodic health checks, or the probes of an instance whose legs
stopped making progress (stall_probe.py, within a few seconds). It is then
marked down here, and every leg on it moves on: one still waiting for its
answer's head (:meth:`guard`) raises :class:`InstanceUnreachable`; one reading
its answer's body (:meth:`following`) reads :class:`BackendUnreachable`, so a
stream already under way ends with an error event.

The watch also says which instances have legs waiting on them and since when
(:meth:`waiting`), the only ones worth probing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from vllm_pd.errors import RouterError
from vllm_pd.router.backend.backend_response import BackendResponse, BackendUnreachable

logger = logging.getLogger(__name__)

T = TypeVar("T")


class InstanceUnreachable(RouterError):
    """The instance was found unreachable while this leg waited on it."""


class PartitionWatch:
    def __init__(self) -> None:
        self._down: set[str] = set()  # urls found unreachable (until a check passes again)
        self._waiting: dict[str, set[asyncio.Task]] = {}  # url -> tasks awaiting a leg's answer head on it
        self._reading: dict[str, set[BackendResponse]] = {}  # url -> responses whose body is being read
        self._since: dict[str, float] = {}  # url -> when its legs began waiting (the oldest still waits)
        self._cut: set[asyncio.Task] = set()  # tasks cancelled here (not by their client)
        # called when a leg starts waiting on an instance that had none: the stall probe's start
        self.on_wait: Callable[[], None] | None = None

    def mark(self, url: str, reachable: bool) -> None:
        """A check's verdict on ``url`` changed."""
        if reachable:
            self._down.discard(url)
            return
        if url in self._down:
            return
        self._down.add(url)
        waiting = self._waiting.get(url, set())
        reading = list(self._reading.get(url, ()))
        logger.warning("instance %s unreachable: %d leg(s) waiting on it move on", url, len(waiting) + len(reading))
        for task in waiting:
            self._cut.add(task)
            task.cancel()
        for resp in reading:
            resp._fail(BackendUnreachable(f"instance {url} was found unreachable"))

    def is_down(self, url: str) -> bool:
        return url in self._down

    def waiting(self) -> dict[str, float]:
        """url -> since when legs wait on it (time.monotonic()), for every instance with legs waiting."""
        return dict(self._since)

    async def guard(self, url: str, leg: Awaitable[T]) -> T:
        """``leg``'s result, unless ``url`` is (or becomes) unreachable first: then the leg is
        cancelled and InstanceUnreachable raised. The leg is awaited in the caller's own task
        (no task of its own: this runs for every leg)."""
        if url in self._down:
            _discard(leg)
            raise InstanceUnreachable(url)
        me = asyncio.current_task()
        assert me is not None
        waiting = self._waiting.get(url)
        if waiting is None:
            waiting = self._waiting[url] = set()
        waiting.add(me)
        self._begin(url)
        try:
            return await leg
        except asyncio.CancelledError:
            if me not in self._cut:
                raise  # the caller itself was cancelled (client gone)
            self._cut.discard(me)
            if me.uncancel() > 0:
                raise  # cancelled by its caller as well
            raise InstanceUnreachable(url) from None
        finally:
            waiting.discard(me)
            self._cut.discard(me)
            self._end(url)

    @contextlib.contextmanager
    def following(self, url: str, resp: BackendResponse) -> Iterator[None]:
        """While the block reads ``resp``'s body, ``url`` found unreachable fails the response."""
        reading = self._reading.get(url)
        if reading is None:
            reading = self._reading[url] = set()
        reading.add(resp)
        self._begin(url)
        try:
            yield
        finally:
            reading.discard(resp)
            self._end(url)

    def _begin(self, url: str) -> None:
        if url not in self._since:
            self._since[url] = time.monotonic()
            if self.on_wait is not None:
                self.on_wait()

    def _end(self, url: str) -> None:
        if not self._waiting.get(url) and not self._reading.get(url):
            self._since.pop(url, None)


def _discard(leg: Awaitable[object]) -> None:
    """A leg that will not run: close a coroutine (no "never awaited" warning), cancel a future."""
    if asyncio.iscoroutine(leg):
        leg.close()
    elif isinstance(leg, asyncio.Future):
        leg.cancel()
