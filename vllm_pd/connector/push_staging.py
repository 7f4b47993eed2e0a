"""Decode side: KV pushed by prefill before decode has admitted the request.

Prefill pushes each layer while it computes, usually before the proxy has even
sent the request to decode, so the bytes land here first (bounded memory) and
are copied into the request's blocks when decode admits it.

A layer counts as complete only once the batch prefill marked ``last`` for it
has landed: pushes to one peer land in order, so by then every earlier version
of a re-sent partial block has been overwritten by its final one.

When our proxy sends the decode leg beside the prefill leg, decode learns what
was pushed (prefill's ``RemotePrefill`` params) from prefill's announcement,
kept here with the bytes. A push no request will claim is *abandoned*: its
bytes are dropped and, once it is announced, prefill is told to release.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass
class _StagedTransfer:
    blocks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)  # (layer, pos) -> bytes
    landed: dict[tuple[int, int], bool] = field(default_factory=dict)
    last_landed: set[int] = field(default_factory=set)  # layers whose final batch landed
    announcement: dict[str, Any] | None = None  # prefill's RemotePrefill params
    abandoned: bool = False
    touched: float = field(default_factory=time.monotonic)


class PushStaging:
    def __init__(self, capacity_bytes: int, ttl_s: float) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.used_bytes = 0
        self.rejected_total = 0
        self._cond = threading.Condition()
        self._transfers: dict[str, _StagedTransfer] = {}
        # host buffers for pushed blocks: pinned where the KV cache is on a GPU (set at registration)
        self.alloc: Callable[[int], torch.Tensor] = lambda n: torch.empty(n, dtype=torch.uint8)

    # ---- BlockSink half (transport threads) ----------------------------------------------------
    def destinations(self, batch: BlockBatch) -> list[memoryview] | None:
        with self._cond:
            self._expire_locked()
            st = self._transfers.get(batch.transfer_id)
            new = [p for p in batch.positions if st is None or (batch.layer, p) not in st.blocks]
            need = len(new) * batch.block_nbytes
            if self.used_bytes + need > self.capacity_bytes:
                self.rejected_total += 1
                logger.warning("push staging full (%d/%d bytes): rejecting transfer %s layer %d",
                               self.used_bytes, self.capacity_bytes, batch.transfer_id, batch.layer)
                return None
            if st is None:
                st = self._transfers[batch.transfer_id] = _StagedTransfer()
            if st.abandoned:
                return None
            views = []
            for p in batch.positions:
                key = (batch.layer, p)
                buf = st.blocks.get(key)
                if buf is None or buf.numel() != batch.block_nbytes:
                    if buf is not None:
                        self.used_bytes -= buf.numel()
                    buf = st.blocks[key] = self.alloc(batch.block_nbytes)
                    self.used_bytes += batch.block_nbytes
                st.landed[key] = False
                views.append(memoryview(buf.numpy()))
            st.touched = time.monotonic()
            return views

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        with self._cond:
            st = self._transfers.get(batch.transfer_id)
            if st is None:
                return
            for p in batch.positions:
                st.landed[(batch.layer, p)] = ok
            if batch.last:
                st.last_landed.add(batch.layer)
            st.touched = time.monotonic()
            self._cond.notify_all()

    def announce(self, transfer_id: str, params: dict[str, Any]) -> bool:
        """Record prefill's announcement; True if the push was abandoned (release it)."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            if st is None:
                st = self._transfers[transfer_id] = _StagedTransfer()
            if st.abandoned:
                self._drop_locked(transfer_id)
                return True
            st.announcement = params
            st.touched = time.monotonic()
            self._cond.notify_all()
            return False

    def abandon(self, transfer_id: str) -> dict[str, Any] | None:
        """No request will claim this push: drop its bytes. Returns the announcement
        if it came already (release it now); else it is released when it comes."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            if st is not None and st.announcement is not None:
                self._drop_locked(transfer_id)
                return st.announcement
            self._drop_locked(transfer_id)
            self._transfers[transfer_id] = _StagedTransfer(abandoned=True)
            return None

    def is_announced(self, transfer_id: str) -> bool:
        with self._cond:
            st = self._transfers.get(transfer_id)
            return st is not None and st.announcement is not None

    # ---- decode's load ------------------------------------------------------------------------
    def wait_announced(self, transfer_id: str, deadline: float) -> dict[str, Any] | None:
        """Prefill's announcement of this push, or None if the deadline passed first."""
        st = self._wait_for(transfer_id, lambda st: st.announcement is not None, deadline)
        return st.announcement if st is not None else None

    def wait_layer(self, transfer_id: str, layer: int, deadline: float, stall_s: float | None = None,
                   since: float = 0.0) -> bool:
        """Wait until the layer's final batch has landed (True) or the deadline passed - or, with
        ``stall_s``, until no push of the transfer has landed for that long (counted from ``since``
        at the earliest): pushes that keep coming are waited for, stalled ones are not."""
        if stall_s is None:
            return self._wait_for(transfer_id, lambda st: layer in st.last_landed, deadline) is not None
        with self._cond:
            while True:
                st = self._transfers.get(transfer_id)
                if st is not None and layer in st.last_landed:
                    return True
                now = time.monotonic()
                quiet_until = max(st.touched if st is not None else 0.0, since) + stall_s
                remaining = min(deadline, quiet_until) - now
                if remaining <= 0:
                    return False
                self._cond.wait(timeout=min(remaining, 0.5))

    def _wait_for(self, transfer_id: str, ready: Callable[[_StagedTransfer], bool],
                  deadline: float) -> _StagedTransfer | None:
        with self._cond:
            while True:
                st = self._transfers.get(transfer_id)
                if st is not None and ready(st):
                    return st
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(timeout=min(remaining, 0.5))

    def last_push(self, transfer_id: str) -> float:
        """When a push (or the announcement) of ``transfer_id`` last arrived (time.monotonic(); 0.0: never)."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            return st.touched if st is not None else 0.0

    def landed_block(self, transfer_id: str, layer: int, position: int) -> torch.Tensor | None:
        with self._cond:
            st = self._transfers.get(transfer_id)
            if st is None or not st.landed.get((layer, position)):
                return None
            return st.blocks[(layer, position)]

    def drop(self, transfer_id: str) -> None:
        with self._cond:
            self._drop_locked(transfer_id)

    def _drop_locked(self, transfer_id: str) -> None:
        st = self._transfers.pop(transfer_id, None)
        if st is not None:
            self.used_bytes -= sum(b.numel() for b in st.blocks.values())

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, st in self._transfers.items() if now - st.touched > self.ttl_s]:
            abandoned = self._transfers[transfer_id].abandoned
            self._drop_locked(transfer_id)
            if abandoned:
                continue  # never announced: prefill's lease frees its copy
            logger.warning("pushed KV of transfer %s never claimed by a request within %.0fs: dropped",
                           transfer_id, self.ttl_s)

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def __len__(self) -> int:
        with self._cond:
            return len(self._transfers)
