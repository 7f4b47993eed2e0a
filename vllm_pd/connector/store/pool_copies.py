"""Block copies between one rank's KV cache and its store pool, on the KV's device.

The pool (cpu_pool.py) is host memory in every case; a slot holds all layers of a
block back to back, so one layer's rows of several slots are never contiguous.

* :class:`InlinePoolCopies` - vLLM's CPU KV: the copies run at once on the calling
  thread, straight between the KV cache and the pool (the store's CPU path as it
  always was).
* :class:`StreamPoolCopies` - KV on a GPU (any :class:`KVDevice` that the host may not
  touch directly): whole blocks go through :class:`BlockCopies` on copy streams of
  their own, into or out of pinned bounce rows (one contiguous ``[rows, block_nbytes]``
  run per layer: one gather or scatter and one copy per layer and pass, the block
  index reused across layers), and the host moves the bytes between those rows and
  the slots (host memory only: ``cpu_pool``'s index tensors never meet the device).

Ordering (the connector's rules, kv_device.py):

* A save's copy waits on an event recorded on the compute stream when the save
  started (after the forward's writes of those blocks); the caller - the store's
  save thread, never the forward's - learns from the copy's event that the bytes
  are in the pool, and only then may the blocks be committed anywhere.
* A load's copies wait on the compute stream's mark taken when the loads started
  (vLLM zeroes new blocks on it before ``start_load_kv``), and return the event
  the layer's attention waits on with a stream wait (:meth:`PoolCopies.wait`).
* The host waits for a copy (``synchronize``) only on the store's own threads, never
  on the forward's.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence

from vllm_pd.connector.device.block_copies import BlockCopies, byte_blocks
from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent, KVDevice
from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.errors import StoreError


class PoolCopies(abc.ABC):
    def __init__(self, pool: CpuBlockPool, regions: Sequence[MemoryRegion], device: KVDevice) -> None:
        self.pool = pool
        self.regions = list(regions)
        self.device = device

    def mark_forward(self) -> DeviceEvent:
        """An event after everything launched on the compute stream so far (call on the
        forward's thread as saves or loads start)."""
        return self.device.record(self.device.compute_stream())

    def wait(self, event: DeviceEvent) -> None:
        """Work the forward launches from now on runs after ``event`` (a stream wait)."""
        self.device.wait(self.device.compute_stream(), event)

    @abc.abstractmethod
    def save(self, slots: Sequence[int], block_ids: Sequence[int], after: DeviceEvent) -> None:
        """Every layer of ``block_ids`` into ``slots``, once ``after`` is complete; returns when
        the bytes are in the pool (blocks the calling thread)."""

    def begin_loads(self, after: DeviceEvent) -> None:
        """The loads that follow write the KV only after ``after`` (from :meth:`mark_forward`)."""

    @abc.abstractmethod
    def load_layer(self, layer: int, slots: Sequence[int], block_ids: Sequence[int]) -> DeviceEvent:
        """``layer`` of ``slots`` into ``block_ids``; the slots may be rewritten on return,
        the blocks hold the bytes once the returned event is complete."""

    def fence(self) -> DeviceEvent:
        """An event after every load copy launched so far."""
        return COMPLETED


class InlinePoolCopies(PoolCopies):
    """KV in host memory: index_select / index_copy_ between the cache and the pool, at once."""

    def __init__(self, pool: CpuBlockPool, regions: Sequence[MemoryRegion], device: KVDevice) -> None:
        super().__init__(pool, regions, device)
        self._blocks = [byte_blocks(r) for r in self.regions]

    def save(self, slots: Sequence[int], block_ids: Sequence[int], after: DeviceEvent) -> None:
        after.synchronize()
        for layer, blocks in enumerate(self._blocks):
            self.pool.save_layer(layer, slots, blocks, block_ids)

    def load_layer(self, layer: int, slots: Sequence[int], block_ids: Sequence[int]) -> DeviceEvent:
        self.pool.load_layer(layer, slots, self._blocks[layer], block_ids)
        return COMPLETED


class StreamPoolCopies(PoolCopies):
    """KV on a device: copy streams and pinned bounce rows of ``bounce_rows`` blocks per direction."""

    def __init__(self, pool: CpuBlockPool, regions: Sequence[MemoryRegion], device: KVDevice, bounce_rows: int) -> None:
        super().__init__(pool, regions, device)
        if bounce_rows < 1:
            raise StoreError(f"bounce_rows must be >= 1, got {bounce_rows}")
        # saves and loads on streams of their own: a load (on the forward's path) never
        # queues behind a large save
        self._save_copies = BlockCopies(self.regions, device)
        self._load_copies = BlockCopies(self.regions, device)
        shape = (len(self.regions), bounce_rows, pool.layer_block_nbytes)
        nbytes = shape[0] * shape[1] * shape[2]
        self._save_rows = device.host_empty(nbytes).view(shape)
        self._load_rows = device.host_empty(nbytes).view(shape)
        # per layer: the copy that still reads that layer's load rows
        self._load_rows_busy: list[DeviceEvent] = [COMPLETED] * len(self.regions)

    @property
    def bounce_rows(self) -> int:
        return int(self._save_rows.shape[1])

    def save(self, slots: Sequence[int], block_ids: Sequence[int], after: DeviceEvent) -> None:
        for start in range(0, len(slots), self.bounce_rows):
            ids, run = block_ids[start : start + self.bounce_rows], slots[start : start + self.bounce_rows]
            copied: DeviceEvent = COMPLETED
            for layer in range(len(self.regions)):
                copied = self._save_copies.to_rows(layer, [(ids, self._save_rows[layer, : len(ids)])], after=after)
            copied.synchronize()  # one stream: the last layer's event follows every layer's copy
            for layer in range(len(self.regions)):
                self.pool.write_rows(layer, run, self._save_rows[layer, : len(ids)])

    def begin_loads(self, after: DeviceEvent) -> None:
        self.device.wait(self._load_copies.stream, after)

    def load_layer(self, layer: int, slots: Sequence[int], block_ids: Sequence[int]) -> DeviceEvent:
        placed: DeviceEvent = COMPLETED
        for start in range(0, len(slots), self.bounce_rows):
            ids, run = block_ids[start : start + self.bounce_rows], slots[start : start + self.bounce_rows]
            rows = self._load_rows[layer, : len(ids)]
            self._load_rows_busy[layer].synchronize()  # the rows' previous copy has read them
            self.pool.read_rows(layer, run, out=rows)
            placed = self._load_rows_busy[layer] = self._load_copies.from_rows(layer, [(ids, rows)])
        return placed

    def fence(self) -> DeviceEvent:
        return self._load_copies.fence()


def pool_copies(pool: CpuBlockPool, regions: Sequence[MemoryRegion], device: KVDevice, bounce_rows: int) -> PoolCopies:
    """Inline copies where the host may touch the KV (CPU), else streams and a pinned bounce."""
    if device.host_accessible:
        return InlinePoolCopies(pool, regions, device)
    return StreamPoolCopies(pool, regions, device, bounce_rows)
