"""Legs waiting on an instance that became unreachable fail as soon as that is known.

A partitioned backend (link down, host paused) closes none of its connections: a
leg waiting on it would wait its whole timeout (``prefill_timeout``, 300 s by
default), though the request could move on at once - to another prefill, or to
decode computing the prompt itself. The health checker finds such an instance
within about ``2 x health_interval + health_timeout`` (two failed checks in a row);
it then marks the instance down here, and every leg guarded by :meth:`guard`
that still waits on it raises :class:`InstanceUnreachable`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class InstanceUnreachable(Exception):
    """The instance was found unreachable while this leg waited on it."""


class PartitionWatch:
    def __init__(self) -> None:
        self._down: set[str] = set()  # urls found unreachable (until a check passes again)
        self._waiting: dict[str, set[asyncio.Task]] = {}  # url -> tasks awaiting a leg on it
        self._cut: set[asyncio.Task] = set()  # of those, the ones cancelled here (not by their client)

    def mark(self, url: str, reachable: bool) -> None:
        """The health checker's verdict on ``url`` changed."""
        if reachable:
            self._down.discard(url)
            return
        if url in self._down:
            return
        self._down.add(url)
        waiting = self._waiting.get(url, set())
        logger.warning("instance %s unreachable: %d leg(s) waiting on it move on", url, len(waiting))
        for task in waiting:
            self._cut.add(task)
            task.cancel()

    async def guard(self, url: str, leg: Awaitable[T]) -> T:
        """``leg``'s result, unless ``url`` is (or becomes) unreachable first: then the leg is
        cancelled and InstanceUnreachable raised. The leg is awaited in the caller's own task
        (no task of its own: this runs for every leg)."""
        if url in self._down:
            _discard(leg)
            raise InstanceUnreachable(url)
        me = asyncio.current_task()
        assert me is not None
        waiting = self._waiting.setdefault(url, set())
        waiting.add(me)
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


def _discard(leg: Awaitable[object]) -> None:
    """A leg that will not run: close a coroutine (no "never awaited" warning), cancel a future."""
    if asyncio.iscoroutine(leg):
        leg.close()
    elif isinstance(leg, asyncio.Future):
        leg.cancel()
