"""Whole KV blocks copied between the KV cache and host memory, on a copy stream.

A block's bytes are its bytes in memory order (``region.blocks[block_id]``, see
``MemoryRegion``), whatever vLLM's layout: every layout's block becomes one row of
``block_nbytes`` on the host.

Every copy is launched on the copy stream after the stream waited on an event
(the forward's write of that layer, for a send), and returns the event that
marks it done: the caller decides who waits on it (a sender thread on the host,
or the compute stream). On the CPU the copies run at once.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from vllm_pd.connector.kv_device import COMPLETED, DeviceEvent, KVDevice
from vllm_pd.connector.transport.base import MemoryRegion


def byte_blocks(region: MemoryRegion) -> torch.Tensor:
    """``region`` as ``[num_blocks, ...]`` bytes (a view of the KV memory), each block's bytes in
    memory order (``MemoryRegion.blocks``): ``index_select(0, ids).reshape(len(ids), -1)`` gives
    the blocks' wire bytes, one row each, and ``index_copy_`` of such rows puts them back."""
    t = region.blocks
    if t.dim() < 2 or t.stride(-1) != 1:
        raise ValueError(f"region {region.name!r}: its innermost dimension must be dense to be moved as bytes")
    return t.view(torch.uint8)


class BlockCopies:
    """Block copies in and out of one worker's KV cache."""

    def __init__(self, regions: Sequence[MemoryRegion], device: KVDevice) -> None:
        self.regions = list(regions)
        self.device = device
        self.stream = device.new_stream()
        self._bytes = [byte_blocks(r) for r in self.regions]
        self._index_device = self.regions[0].tensor.device if self.regions else torch.device("cpu")

    def record_compute(self) -> DeviceEvent:
        """An event after everything the forward launched so far (e.g. a layer's KV write)."""
        return self.device.record(self.device.compute_stream())

    def to_rows(self, layer: int, block_ids: Sequence[int], rows: torch.Tensor,
                after: DeviceEvent = COMPLETED) -> DeviceEvent:
        """Copy blocks ``block_ids`` of ``layer`` into host ``rows`` ``[len(block_ids), block_nbytes]``
        once ``after`` is complete; the returned event marks the bytes in ``rows``."""
        src = self._bytes[layer]

        def work() -> None:
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=self._index_device)
            rows.copy_(src.index_select(0, idx).reshape(len(block_ids), -1), non_blocking=True)

        return self._launch(after, work)

    def from_rows(self, layer: int, block_ids: Sequence[int], rows: torch.Tensor,
                  after: DeviceEvent = COMPLETED) -> DeviceEvent:
        """Copy host ``rows`` ``[len(block_ids), block_nbytes]`` into blocks ``block_ids`` of ``layer``
        once ``after`` is complete (vLLM zeroing the blocks on the compute stream, say). ``rows``
        must stay untouched until the returned event is complete."""
        dst = self._bytes[layer]

        def work() -> None:
            idx = torch.tensor(list(block_ids), dtype=torch.long, device=self._index_device)
            staged = rows.to(dst.device, non_blocking=True).view(len(block_ids), *dst.shape[1:])
            dst.index_copy_(0, idx, staged)

        return self._launch(after, work)

    def from_buffers(self, layer: int, block_ids: Sequence[int], buffers: Sequence[torch.Tensor],
                     after: DeviceEvent = COMPLETED) -> DeviceEvent:
        """Copy one host buffer per block into blocks ``block_ids`` of ``layer`` (same contract)."""
        dst = self._bytes[layer]

        def work() -> None:
            for block_id, buf in zip(block_ids, buffers):
                dst[block_id].copy_(buf.view(dst.shape[1:]), non_blocking=True)

        return self._launch(after, work)

    def fence(self) -> DeviceEvent:
        """An event after every copy launched so far."""
        return self.device.record(self.stream)

    def _launch(self, after: DeviceEvent, work: Callable[[], None]) -> DeviceEvent:
        self.device.wait(self.stream, after)
        self.device.launch(self.stream, work)
        return self.device.record(self.stream)

