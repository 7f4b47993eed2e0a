"""Prefill's sends, run in order once the device work they read is complete.

``save_kv_layer`` runs on the forward's thread while the GPU may still be writing
the layer: the forward must neither wait for the GPU nor let the bytes leave
early. Each send is queued behind the event marking its bytes final and runs on
the ``pd-send`` thread once the event completes. When nothing waits before it and
its event is already complete - always on the CPU, where events complete when
made - it runs at once on the caller's thread, so the CPU path pays no thread hop.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from vllm_pd.connector.device.kv_device import DeviceEvent
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

T = TypeVar("T")


class SendQueue:
    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._queue: deque[tuple[DeviceEvent, Callable[[], None]]] = deque()
        self._running = False  # the thread is running an item taken off the queue
        self._closed = False
        self._thread: threading.Thread | None = None

    def after(self, event: DeviceEvent, send: Callable[[], None]) -> None:
        """Run ``send`` once ``event`` is complete, after every send queued before it."""
        with self._cond:
            if not self._queue and not self._running and event.query():
                inline = True
            else:
                inline = False
                self._queue.append((event, send))
                self._start_locked()
                self._cond.notify_all()
        if inline:
            _run(send)

    def future_after(self, event: DeviceEvent, start: Callable[[], Future[T]]) -> Future[T]:
        """``after`` for a send that returns a future: a future now, resolved as that one is."""
        proxy: Future[T] = Future()

        def send() -> None:
            try:
                inner = start()
            except Exception as e:
                proxy.set_exception(e)
                return
            inner.add_done_callback(lambda f: _settle(proxy, f))

        self.after(event, send)
        return proxy

    def drain(self, timeout: float) -> bool:
        """Wait until every queued send ran; False if still busy after ``timeout``."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._running, timeout)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def _start_locked(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="pd-send", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if self._closed:
                    return
                event, send = self._queue.popleft()
                self._running = True
            try:
                event.synchronize()
                _run(send)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()


def _run(send: Callable[[], None]) -> None:
    try:
        send()
    except Exception:
        logger.exception("queued KV send failed")


def _settle(proxy: Future[Any], inner: Future[Any]) -> None:
    exc = inner.exception()
    if exc is not None:
        proxy.set_exception(exc)
    else:
        proxy.set_result(inner.result())
