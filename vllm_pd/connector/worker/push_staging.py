"""Decode side: KV pushed by prefill before decode has admitted the request.

Prefill pushes each layer while it computes, usually before the proxy has even
sent the request to decode, so the bytes land here first (bounded memory) and
are copied into the request's blocks when decode admits it.

Each pushed batch lands in one host buffer of its own, ``[blocks, block_nbytes]``
indexed by the batch's positions (pinned where the KV cache is on a GPU): a layer of
a request pushed in one step is one contiguous run of rows, placed into the
request's blocks by one host-to-device copy and one scatter (``landed_runs``).

A layer counts as complete only once the batch prefill marked ``last`` for it
has landed: pushes to one peer land in order, so by then every earlier version
of a re-sent partial block has been superseded by its final one (a position's
bytes are those of the newest batch that carried it; a batch whose every position
a newer one carries is dropped at once, so memory stays bounded).

Prefill ranks of another TP size push pieces of their blocks (a run of heads), each
rank under a key of its own (``kv_geometry.RankPlan.staging_key``, ``<transfer id>#src<rank>``):
such keys belong to their transfer when it is abandoned or dropped.

When our proxy sends the decode leg beside the prefill leg, decode learns what
was pushed (prefill's ``RemotePrefill`` params) from prefill's announcement,
kept here with the bytes. A push no request will claim is *abandoned*: its
bytes are dropped and, once it is announced, prefill is told to release.

Bounds per peer (the pushing endpoint, ``BlockBatch.peer``): one peer holds at most
``peer_capacity_bytes`` of the staging, so a peer that floods it cannot take it from the
others, and a transfer's blocks come from the peer that pushed its first ones (another
peer's batch for it is rejected, not written over it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_pd.connector.device.kv_geometry import transfer_of_key
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass(eq=False)  # compared by identity
class _Chunk:
    """One pushed batch's bytes: row i holds position ``positions[i]``."""

    positions: tuple[int, ...]
    rows: torch.Tensor  # [len(positions), block_nbytes]
    landed: bool = False  # arrived and verified


@dataclass
class _StagedTransfer:
    chunks: dict[int, list[_Chunk]] = field(default_factory=dict)  # layer -> its batches, oldest first
    receiving: dict[int, _Chunk] = field(default_factory=dict)  # id(batch) -> its chunk, until it landed
    last_landed: set[int] = field(default_factory=set)  # layers whose final batch landed
    announcement: dict[str, Any] | None = None  # prefill's RemotePrefill params
    peer: str = ""  # who pushed its blocks ("" until the first push)
    abandoned: bool = False
    touched: float = field(default_factory=time.monotonic)


class PushStaging:
    def __init__(self, capacity_bytes: int, ttl_s: float, peer_capacity_bytes: int | None = None) -> None:
        self.capacity_bytes = capacity_bytes
        # what one peer may hold (None: all of it)
        self.peer_capacity_bytes = capacity_bytes if peer_capacity_bytes is None else peer_capacity_bytes
        self.ttl_s = ttl_s
        self.used_bytes = 0
        self._peer_bytes: dict[str, int] = {}
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
            if st is not None and st.peer and st.peer != batch.peer:
                self.rejected_total += 1
                logger.warning(
                    "push of transfer %s from %s rejected: its blocks come from %s",
                    batch.transfer_id,
                    batch.peer,
                    st.peer,
                )
                return None
            layer = st.chunks.get(batch.layer, []) if st is not None else []
            n = len(batch.positions)
            superseded = _superseded(layer, set(batch.positions))
            need = n * batch.block_nbytes - sum(c.rows.numel() for c in superseded)
            peer_used = self._peer_bytes.get(batch.peer, 0)
            if self.used_bytes + need > self.capacity_bytes or peer_used + need > self.peer_capacity_bytes:
                self.rejected_total += 1
                logger.warning(
                    "push staging full (%d/%d bytes; %d/%d of them from %s): rejecting transfer %s layer %d",
                    self.used_bytes,
                    self.capacity_bytes,
                    peer_used,
                    self.peer_capacity_bytes,
                    batch.peer or "this peer",
                    batch.transfer_id,
                    batch.layer,
                )
                return None
            base = self._transfers.get(transfer_of_key(batch.transfer_id))
            if base is not None and base.abandoned:
                return None  # a piece of an abandoned transfer
            if st is None:
                st = self._transfers[batch.transfer_id] = _StagedTransfer()
            if st.abandoned:
                return None
            st.peer = batch.peer
            chunk = _Chunk(tuple(batch.positions), self.alloc(n * batch.block_nbytes).view(n, batch.block_nbytes))
            st.chunks[batch.layer] = [c for c in layer if c not in superseded] + [chunk]
            st.receiving[id(batch)] = chunk
            self._count(st.peer, need)
            st.touched = time.monotonic()
            return [memoryview(chunk.rows[i].numpy()) for i in range(n)]

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        with self._cond:
            st = self._transfers.get(batch.transfer_id)
            if st is None:
                return
            chunk = st.receiving.pop(id(batch), None)
            if chunk is not None:
                chunk.landed = ok
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
        """No request will claim this push: drop its bytes (and its pieces'). Returns the
        announcement if it came already (release it now); else it is released when it comes."""
        with self._cond:
            for key in [k for k in self._transfers if k != transfer_id and transfer_of_key(k) == transfer_id]:
                self._drop_locked(key)
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

    def wait_layer(
        self, transfer_id: str, layer: int, deadline: float, stall_s: float | None = None, since: float = 0.0
    ) -> bool:
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

    def _wait_for(
        self, transfer_id: str, ready: Callable[[_StagedTransfer], bool], deadline: float
    ) -> _StagedTransfer | None:
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

    def landed_runs(
        self, transfer_id: str, layer: int, positions: Sequence[int], block_nbytes: int
    ) -> tuple[list[tuple[list[int], torch.Tensor]], list[int]]:
        """What of ``positions`` landed for ``layer``: (runs, missing). A run is (indexes into
        ``positions``, their rows): consecutive rows of one batch. ``missing``: indexes of
        positions with no landed ``block_nbytes`` bytes. The rows are read by copies after
        this returns: they stay allocated until ``drop`` (or the transfer's expiry)."""
        with self._cond:
            st = self._transfers.get(transfer_id)
            where: dict[int, tuple[_Chunk, int]] = {}
            for chunk in st.chunks.get(layer, []) if st is not None else []:  # oldest first: newest wins
                where.update((p, (chunk, row)) for row, p in enumerate(chunk.positions))
        runs: list[tuple[list[int], _Chunk, int]] = []  # (indexes, chunk, first row)
        missing: list[int] = []
        for i, p in enumerate(positions):
            found = where.get(p)
            if found is None:
                missing.append(i)
                continue
            chunk, row = found
            if not chunk.landed or chunk.rows.shape[1] != block_nbytes:
                missing.append(i)
            elif runs and runs[-1][1] is chunk and runs[-1][2] + len(runs[-1][0]) == row:
                runs[-1][0].append(i)
            else:
                runs.append(([i], chunk, row))
        return [(idxs, chunk.rows[row : row + len(idxs)]) for idxs, chunk, row in runs], missing

    def drop(self, transfer_id: str) -> None:
        with self._cond:
            self._drop_locked(transfer_id)

    def _drop_locked(self, transfer_id: str) -> None:
        st = self._transfers.pop(transfer_id, None)
        if st is not None:
            self._count(st.peer, -sum(c.rows.numel() for chunks in st.chunks.values() for c in chunks))

    def _count(self, peer: str, nbytes: int) -> None:
        self.used_bytes += nbytes
        left = self._peer_bytes.get(peer, 0) + nbytes
        if left:
            self._peer_bytes[peer] = left
        else:
            self._peer_bytes.pop(peer, None)

    def peer_bytes(self, peer: str) -> int:
        """Bytes staged for ``peer`` now."""
        with self._cond:
            return self._peer_bytes.get(peer, 0)

    def _expire_locked(self) -> None:
        now = time.monotonic()
        for transfer_id in [t for t, st in self._transfers.items() if now - st.touched > self.ttl_s]:
            abandoned = self._transfers[transfer_id].abandoned
            self._drop_locked(transfer_id)
            if abandoned:
                continue  # never announced: prefill's lease frees its copy
            logger.warning(
                "pushed KV of transfer %s never claimed by a request within %.0fs: dropped", transfer_id, self.ttl_s
            )

    def expire(self) -> None:
        with self._cond:
            self._expire_locked()

    def __len__(self) -> int:
        with self._cond:
            return len(self._transfers)


def _superseded(chunks: list[_Chunk], newer: set[int]) -> list[_Chunk]:
    """The chunks (oldest first) whose every position ``newer`` - a new batch's positions -
    or a chunk after them carries."""
    covered = set(newer)
    out = []
    for chunk in reversed(chunks):
        if covered.issuperset(chunk.positions):
            out.append(chunk)
        covered.update(chunk.positions)
    return out
