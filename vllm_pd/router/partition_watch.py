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
        self._down: dict[str, asyncio.Event] = {}  # url -> set while the instance is unreachable

    def _event(self, url: str) -> asyncio.Event:
        ev = self._down.get(url)
        if ev is None:
            ev = self._down[url] = asyncio.Event()
        return ev

    def mark(self, url: str, reachable: bool) -> None:
        """The health checker's verdict on ``url`` changed."""
        ev = self._event(url)
        if reachable:
            ev.clear()
        elif not ev.is_set():
            ev.set()
            logger.warning("instance %s unreachable: legs waiting on it move on", url)

    async def guard(self, url: str, leg: Awaitable[T]) -> T:
        """``leg``'s result, unless ``url`` is (or becomes) unreachable first: then the leg is
        cancelled and InstanceUnreachable raised."""
        down = self._event(url)
        task = asyncio.ensure_future(leg)
        if down.is_set():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise InstanceUnreachable(url)
        watcher = asyncio.ensure_future(down.wait())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()  # cut off, or this request itself was cancelled
                await asyncio.gather(task, return_exceptions=True)
        if task.cancelled():
            raise InstanceUnreachable(url)
        return task.result()
