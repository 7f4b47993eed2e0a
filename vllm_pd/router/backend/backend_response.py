"""A backend's response as the proxy reads it (see http_client.py), and the client's errors.

The body arrives through the connection's parser callbacks into a deque; the
reader takes whatever is there (``readany``) or all of it up to a limit
(``read``). Past ``HIGH_WATER`` buffered bytes the socket is paused until the
reader catches up, so what a backend sends is never buffered beyond that and
the limit the reader names.

Or, for a long stream, the body goes to a sink (``relay_to``) right in the
parser's callback: no task switch per piece, which at a thousand streams is
most of the relay's Python time. A sink that returns False (it cannot take
more now, or it failed) holds the response: the socket pauses, later pieces
queue, and the task waiting in ``relayed`` wakes to look; ``resume_relay``
hands it the queue and reads on.

A failed response raises a fresh copy of its error on every read, never the
stored one: a raised exception takes a traceback whose frames hold the reader's
locals (its buffers) and this response, and the response holding that
exception would make a cycle that only a full garbage collection frees.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from typing import Protocol

from vllm_pd.errors import RouterError

HIGH_WATER = 256 * 1024  # buffered response bytes at which reading pauses (it resumes once all is read)

Sink = Callable[[bytes], bool]  # takes a piece of the body; False: hold the body (the sink cannot go on now)


class BackendConnection(Protocol):
    """What a response uses of the connection it arrives on (http_client.py's, one per backend socket)."""

    def pause(self) -> None: ...  # stop reading the socket

    def resume(self) -> None: ...

    def release(self, reuse: bool) -> None: ...  # the response is done with it: back to the pool, or closed


class BackendError(RouterError):
    """A backend exchange failed (connection refused, reset, closed early, bad HTTP)."""


class BackendConnectError(BackendError):
    """No connection could be made: the backend never saw the request."""


class BackendUnreachable(BackendError):
    """The instance was found unreachable (partition_watch.py) while this response was read."""


class BodyTooLarge(BackendError):
    """A body longer than the reader's limit: read up to the limit, the rest never read."""

    def __init__(self, message: str, limit: int) -> None:
        super().__init__(message, limit)
        self.limit = limit

    def __str__(self) -> str:
        return str(self.args[0])


def _fresh(error: BaseException) -> BaseException:
    """A new exception like ``error`` (same type and arguments), without its traceback or context."""
    try:
        return type(error)(*error.args)
    except TypeError:  # a type whose constructor takes other arguments than it stores
        return BackendError(str(error))


class BackendResponse:
    """One response: ``status`` once the head arrived, then its body through ``read``/``readany``.

    ``close()`` must follow (it is idempotent): a complete response hands its
    connection back to the pool, an unfinished one aborts it (which is how a
    backend learns that the request was abandoned).
    """

    __slots__ = (
        "status",
        "retry_after",
        "_conn",
        "_chunks",
        "_buffered",
        "_done",
        "_error",
        "_waiter",
        "_idle_timeout",
        "_closed",
        "_timer",
        "_idle_timer",
        "_active_at",
        "_sink",
        "_held",
        "__weakref__",
    )

    def __init__(self, conn: BackendConnection, idle_timeout: float | None) -> None:
        self.status = 0
        self.retry_after: str | None = None  # the Retry-After header, when the backend sent one
        self._conn = conn
        self._chunks: deque[bytes] = deque()
        self._buffered = 0
        self._done = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._idle_timeout = idle_timeout
        self._closed = False
        self._timer: asyncio.TimerHandle | None = None  # the whole exchange's (or the head's) deadline
        # read timeout, checked lazily: one timer per response that re-arms itself while data keeps
        # coming, instead of a timer per wait (a stream of N events would create N)
        self._idle_timer: asyncio.TimerHandle | None = None
        self._active_at = 0.0  # when data last arrived or a wait began (time.monotonic, the loop's clock)
        self._sink: Sink | None = None  # takes the body as it arrives (relay_to)
        self._held = False  # the sink returned False: pieces queue until resume_relay

    # ------------------------------------------------------- reader side
    async def readany(self) -> bytes:
        """Whatever body bytes arrived (waiting for some), b"" at the end of the body."""
        while not self._chunks:
            if self._error is not None:
                raise _fresh(self._error)
            if self._done:
                return b""
            await self._wait()
        chunks = self._chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join([chunks.popleft() for _ in range(len(chunks))])
        self._buffered = 0
        self._conn.resume()
        return data

    async def read(self, limit: int | None = None, key: str = "limit") -> bytes:
        """The whole body; past ``limit`` bytes :class:`BodyTooLarge` naming ``key`` (the setting that
        limits it), after reading no more than the limit and a piece."""
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                chunk = await self.readany()
                if not chunk:
                    return b"".join(parts) if len(parts) != 1 else parts[0]
                size += len(chunk)
                if limit is not None and size > limit:
                    chunk = b""
                    raise BodyTooLarge(f"the backend's answer is larger than {limit} bytes ({key})", limit)
                parts.append(chunk)
        finally:
            parts.clear()  # what an abandoned read held goes now, not with its traceback

    def relay_to(self, sink: Sink | None) -> None:
        """From now on every piece of the body goes to ``sink`` as it arrives, in the connection's callback
        (what was queued first); None: back to ``readany``. The sink must not raise: a failure is its
        False, for the task waiting in :meth:`relayed` to handle."""
        self._sink = sink
        self._held = False
        if sink is not None:
            self._relay_queued()

    def resume_relay(self) -> None:
        """Go on after the sink held the body: the queued pieces to the sink, then read on."""
        self._held = False
        self._relay_queued()

    async def relayed(self) -> bool:
        """With a sink: wait until the whole body went to it (True) or it held the body (False);
        the response's error (a broken connection, a read timeout) raises."""
        while True:
            if self._held:
                return False
            if self._error is not None:
                raise _fresh(self._error)
            if self._done and not self._chunks:
                return True
            await self._wait()

    def _relay_queued(self) -> None:
        chunks, sink = self._chunks, self._sink
        while chunks and sink is not None:
            data = chunks.popleft()
            self._buffered -= len(data)
            if not sink(data):
                self._held = True
                self._conn.pause()
                return
        self._conn.resume()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sink = None
        if self._timer is not None:
            self._timer.cancel()
        if self._idle_timer is not None:
            self._idle_timer.cancel()
        self._chunks.clear()  # an abandoned body's bytes go with the leg, whoever still holds this response
        self._conn.release(reuse=self._done and self._error is None)

    async def _wait(self) -> None:
        loop = asyncio.get_running_loop()
        fut = self._waiter = loop.create_future()
        if self._idle_timeout is not None:
            self._active_at = time.monotonic()
            if self._idle_timer is None:
                self._idle_timer = loop.call_at(self._active_at + self._idle_timeout, self._check_idle)
        try:
            await fut
        finally:
            self._waiter = None

    def _check_idle(self) -> None:
        self._idle_timer = None
        if self._closed or self._done or self._error is not None or self._idle_timeout is None:
            return
        due = self._active_at + self._idle_timeout
        if self._waiter is not None and time.monotonic() >= due:
            self._time_out(self._idle_timeout)
        else:  # data came (or nobody waits): look again when the newest wait could expire
            loop = asyncio.get_running_loop()
            self._idle_timer = loop.call_at(max(due, loop.time() + 0.001), self._check_idle)

    async def _head(self) -> None:
        while not self.status:
            if self._error is not None:
                raise _fresh(self._error)
            await self._wait()

    # ------------------------------------------------------ protocol side
    def _wake(self) -> None:
        fut = self._waiter
        if fut is not None and not fut.done():
            fut.set_result(None)

    def _feed(self, data: bytes) -> None:
        self._active_at = time.monotonic()
        sink = self._sink
        if sink is not None and not self._held:
            if not sink(data):
                self._held = True
                self._conn.pause()
                self._wake()
            return
        self._chunks.append(data)
        self._buffered += len(data)
        if self._buffered > HIGH_WATER:
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if not self._done and self._error is None:
            self._error = exc
            self._sink = None  # nothing reaches a sink after the failure its task is woken for
            self._wake()

    def _time_out(self, seconds: float) -> None:
        self._fail(TimeoutError(f"backend did not answer within {seconds} s"))
