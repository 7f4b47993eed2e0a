"""Whole KV blocks copied between the KV cache and host memory, on a copy stream.

A block's bytes are its bytes in memory order (``region.blocks[block_id]``, see
``MemoryRegion``), whatever vLLM's layout: every layout's block becomes one row of
``block_nbytes`` on the host.

One :class:`BlockCopies` is one copy stream: the connector keeps one for sends and
one for landings, so a send never queues behind eight load threads' landings. Every
copy is launched on the stream after it waited on an event (the forward's write of
that layer, for a send), and returns the event that marks it done: the caller
decides who waits on it (a sender thread on the host, or the compute stream). On the
CPU the copies run at once.

Per layer and direction one gather (``index_select``) or one scatter
(``index_copy_``), never a copy per block: host rows come as *runs* (contiguous
``[n, block_nbytes]`` slices of pinned memory, each with its block ids), all runs of
a layer gathered or scattered by one kernel through one device buffer. The block
index reaches the device from pinned memory without blocking, once per set of
block ids (``_IndexCache``): a request's layers reuse it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import torch

from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent, KVDevice
from vllm_pd.connector.transport.base import MemoryRegion

#: (block ids, host rows ``[len(ids), block_nbytes]``): one contiguous run of host memory
Run = tuple[Sequence[int], torch.Tensor]

# index tensors kept per copy stream: a step's sends, or a load's landings, reuse theirs for every layer
INDEX_CACHE_ENTRIES = 64


def byte_blocks(region: MemoryRegion) -> torch.Tensor:
    """``region`` as ``[num_blocks, ...]`` bytes (a view of the KV memory), each block's bytes in
    memory order (``MemoryRegion.blocks``): ``index_select(0, ids).reshape(len(ids), -1)`` gives
    the blocks' wire bytes, one row each, and ``index_copy_`` of such rows puts them back."""
    t = region.blocks
    if t.dim() < 2 or t.stride(-1) != 1:
        raise ValueError(f"region {region.name!r}: its innermost dimension must be dense to be moved as bytes")
    return t.view(torch.uint8)


def widest_elements(blocks: torch.Tensor) -> torch.Tensor:
    """``blocks`` (``byte_blocks``) as the widest integer elements its layout allows: the same
    bytes, which a gather or scatter then moves 8 at a time instead of one (a uint8
    ``index_copy_`` is ~8x slower on the CPU; a GPU's kernel vectorises the wider type)."""
    for dtype in (torch.int64, torch.int32, torch.int16):
        try:
            return blocks.view(dtype)
        except RuntimeError:  # the last dimension, a stride or the offset is not a multiple
            continue
    return blocks


def as_elements(rows: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Byte rows ``[n, block_nbytes]`` as ``n`` blocks of ``blocks``' elements and shape."""
    try:
        wide = rows.view(blocks.dtype)
    except RuntimeError:  # rows at an offset that is not a multiple of the element
        wide = rows.clone().view(blocks.dtype)
    return wide.view(rows.shape[0], *blocks.shape[1:])


class _IndexCache:
    """Device index tensors by block ids, most recently used kept. Each is made, used and
    dropped on one copy stream, so a dropped one's memory is reused only after its readers."""

    def __init__(self, device: KVDevice, entries: int = INDEX_CACHE_ENTRIES) -> None:
        self._device = device
        self._entries = entries
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self.built = 0  # index tensors made (each one host-to-device copy on a GPU)

    def get(self, block_ids: Sequence[int]) -> torch.Tensor:
        """Call inside launched work: a new index is copied on the current (copy) stream."""
        key = tuple(block_ids)
        with self._lock:
            idx = self._cache.get(key)
            if idx is not None:
                self._cache.move_to_end(key)
                return idx
        idx = self._device.indices(key)
        with self._lock:
            self.built += 1
            self._cache[key] = idx
            while len(self._cache) > self._entries:
                self._cache.popitem(last=False)
        return idx


class BlockCopies:
    """Block copies in and out of one worker's KV cache, on one copy stream of their own."""

    def __init__(self, regions: Sequence[MemoryRegion], device: KVDevice) -> None:
        self.regions = list(regions)
        self.device = device
        self.stream = device.new_stream()
        self._blocks = [widest_elements(byte_blocks(r)) for r in self.regions]
        self._nbytes = [r.block_nbytes for r in self.regions]
        self._index = _IndexCache(device)
        self._windows: dict[tuple[int, int, int], torch.Tensor] = {}

    def window(self, layer: int, offset: int, nbytes: int) -> torch.Tensor:
        """Bytes ``[offset, offset + nbytes)`` of every block of ``layer``, as a view
        ``[num_blocks, ...]`` (a run of heads of head-major blocks); ValueError where a block's
        bytes are not one contiguous run."""
        key = (layer, offset, nbytes)
        view = self._windows.get(key)
        if view is None:
            region = self.regions[layer]
            try:
                flat = byte_blocks(region).view(region.num_blocks, region.block_nbytes)
            except RuntimeError:
                raise ValueError(
                    f"region {region.name!r}: a block's bytes are not contiguous, so parts of it cannot be placed"
                ) from None
            if offset < 0 or nbytes <= 0 or offset + nbytes > region.block_nbytes:
                raise ValueError(
                    f"window [{offset}, {offset + nbytes}) is not inside a block of {region.block_nbytes} bytes"
                )
            view = self._windows[key] = widest_elements(flat[:, offset : offset + nbytes])
        return view

    def record_compute(self) -> DeviceEvent:
        """An event after everything the forward launched so far (e.g. a layer's KV write)."""
        return self.device.record(self.device.compute_stream())

    def to_rows(self, layer: int, runs: Sequence[Run], after: DeviceEvent = COMPLETED) -> DeviceEvent:
        """Copy each run's blocks of ``layer`` into its host rows once ``after`` is complete:
        one gather, then one device-to-host copy per run. The event marks the bytes in the rows."""
        src = self._blocks[layer]
        block_ids = [b for ids, _ in runs for b in ids]

        def work() -> None:
            gathered = src.index_select(0, self._index.get(block_ids)).view(len(block_ids), -1).view(torch.uint8)
            start = 0
            for ids, rows in runs:
                rows.copy_(gathered[start : start + len(ids)], non_blocking=True)
                start += len(ids)

        return self._launch(after, work)

    def from_rows(
        self, layer: int, runs: Sequence[Run], after: DeviceEvent = COMPLETED, window: tuple[int, int] | None = None
    ) -> DeviceEvent:
        """Copy each run's host rows into its blocks of ``layer`` once ``after`` is complete (vLLM
        zeroing the blocks on the compute stream, say): one host-to-device copy per run into one
        device buffer, then one scatter. The rows must stay untouched until the returned event.
        ``window``: (offset, nbytes) - the rows are that part of each block (a run of heads)."""
        dst = self._blocks[layer] if window is None else self.window(layer, *window)
        block_ids = [b for ids, _ in runs for b in ids]
        n = len(block_ids)
        nbytes = self._nbytes[layer] if window is None else window[1]

        def work() -> None:
            if len(runs) == 1:
                staged = self.device.upload(runs[0][1])
            elif self.device.host_accessible:  # the CPU: straight from each run, no staging copy
                for ids, rows in runs:
                    dst.index_copy_(0, self._index.get(ids), as_elements(rows, dst))
                return
            else:
                staged = self.device.empty((n, nbytes), torch.uint8)
                start = 0
                for ids, rows in runs:
                    staged[start : start + len(ids)].copy_(rows, non_blocking=True)
                    start += len(ids)
            dst.index_copy_(0, self._index.get(block_ids), as_elements(staged, dst))

        return self._launch(after, work)

    @property
    def indexes_built(self) -> int:
        return self._index.built

    def fence(self) -> DeviceEvent:
        """An event after every copy launched so far."""
        return self.device.record(self.stream)

    def _launch(self, after: DeviceEvent, work: Callable[[], None]) -> DeviceEvent:
        self.device.wait(self.stream, after)
        self.device.launch(self.stream, work)
        return self.device.record(self.stream)
