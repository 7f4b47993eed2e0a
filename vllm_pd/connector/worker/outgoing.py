"""Prefill side: the KV a worker is sending or holding for decode instances.

A transfer's blocks stay untouched (vLLM does not free them) until this module
reports the transfer finished. That happens only once all of:

* the scheduler saw the request finish (held for decode, or aborted),
* decode released it, or its lease ran out, or it was aborted,
* every push reading its blocks has completed (ok or failed),

and only after reads of its blocks were revoked, so a late reader gets an error,
never another request's KV.
"""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass
class OutgoingTransfer:
    transfer_id: str
    request_id: str = ""  # vLLM's, known once the scheduler saw the request finish
    pushes: list[Future[None]] = field(default_factory=list)
    push_failures: int = 0
    granted: bool = False
    finished: bool = False  # scheduler saw request_finished
    held: bool = False
    released: bool = False  # decode is done with it (or aborted)
    releasers: set[int] = field(default_factory=set)  # decode ranks done with it, of several reading it
    expiry: float | None = None
    created: float = field(default_factory=time.monotonic)
    # layer-wise overlap: first push started, prompt fully computed, last push landed
    first_push_at: float | None = None
    computed_at: float | None = None
    last_push_done_at: float | None = None

    def pushes_done(self) -> bool:
        return all(f.done() for f in self.pushes)


class OutgoingTransfers:
    """Thread-safe: the transport's threads deliver releases while the model runs."""

    def __init__(self, lease_s: float, changed: threading.Event | None = None) -> None:
        self.lease_s = lease_s
        self._lock = threading.Lock()
        self._transfers: dict[str, OutgoingTransfer] = {}
        self.expired_total = 0
        self.push_failures_total = 0
        # set when something may have become reportable (release, push done); the worker passes the
        # event its idle step waits on (one for both sides), a transfer table on its own makes one
        self.changed = changed if changed is not None else threading.Event()

    def _get(self, transfer_id: str) -> OutgoingTransfer:
        t = self._transfers.get(transfer_id)
        if t is None:
            t = self._transfers[transfer_id] = OutgoingTransfer(transfer_id)
        return t

    def add_push(self, transfer_id: str, fut: Future[None]) -> None:
        with self._lock:
            t = self._get(transfer_id)
            t.pushes.append(fut)
            if t.first_push_at is None:
                t.first_push_at = time.monotonic()
        fut.add_done_callback(functools.partial(self._push_done, transfer_id))

    def _push_done(self, transfer_id: str, fut: Future[None]) -> None:
        exc = fut.exception()
        with self._lock:
            t = self._transfers.get(transfer_id)
            if t is not None:
                t.last_push_done_at = time.monotonic()
        if exc is not None:
            with self._lock:
                t = self._transfers.get(transfer_id)
                if t is not None:
                    t.push_failures += 1
                self.push_failures_total += 1
            logger.warning("push of transfer %s failed (%s); decode will pull instead", transfer_id, exc)
        self.changed.set()

    def mark_computed(self, transfer_id: str) -> None:
        """The prompt's last layer was computed (and handed to the transport)."""
        with self._lock:
            t = self._get(transfer_id)
            t.granted = True
            t.computed_at = time.monotonic()

    def finish(self, transfer_id: str, request_id: str, held: bool) -> None:
        with self._lock:
            t = self._get(transfer_id)
            t.finished, t.held, t.request_id = True, held, request_id
            if held:
                t.expiry = time.monotonic() + self.lease_s
            else:
                t.released = True
        self.changed.set()

    def release(self, transfer_id: str, releaser: int = -1, of: int = 1) -> None:
        """Decode took the KV (or will never need it): at once, or (``releaser`` >= 0) once ``of``
        decode ranks reading it each said so."""
        with self._lock:
            t = self._get(transfer_id)
            if releaser >= 0:
                t.releasers.add(releaser)
            if releaser < 0 or len(t.releasers) >= of:
                t.released = True
            else:
                return
        self.changed.set()

    def wait_pushes(self, transfer_id: str, timeout: float) -> None:
        """Block until pushes reading this transfer's blocks are done (preemption)."""
        with self._lock:
            t = self._transfers.get(transfer_id)
            pushes = list(t.pushes) if t else []
        deadline = time.monotonic() + timeout
        for f in pushes:
            try:
                f.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # failures are counted by _push_done
                pass
        with self._lock:
            if t is not None:
                t.pushes = [f for f in t.pushes if not f.done()]

    def take_reportable(self) -> list[OutgoingTransfer]:
        """Transfers whose blocks vLLM may free now; removed from tracking."""
        now = time.monotonic()
        out: list[OutgoingTransfer] = []
        with self._lock:
            for transfer_id, t in list(self._transfers.items()):
                if not t.finished:
                    # a release for a transfer we never saw finish: forget it after a lease
                    if not t.pushes and not t.granted and now - t.created > self.lease_s:
                        del self._transfers[transfer_id]
                    continue
                expired = t.expiry is not None and now >= t.expiry
                if not (t.released or expired) or not t.pushes_done():
                    continue
                if expired and not t.released:
                    self.expired_total += 1
                    logger.warning(
                        "lease of transfer %s expired after %.0fs: releasing its KV blocks", transfer_id, self.lease_s
                    )
                out.append(t)
                del self._transfers[transfer_id]
        return out

    def pending(self) -> int:
        with self._lock:
            return len(self._transfers)

    def held(self) -> int:
        with self._lock:
            return sum(1 for t in self._transfers.values() if t.held)
