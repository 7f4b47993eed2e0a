"""Device work and host syncs per request of the connector's block copies, before and after.

No GPU here: the copies run on the checked stand-in (tests/support/async_device.py), which queues
every device operation on its stream (counted: what a GPU would launch) and records every
operation that would make a GPU's host wait (a copy from pageable memory, a pageable index).
For one request of ``--blocks`` blocks and ``--layers`` layers it counts, per layer:

* send (prefill, host-staged: tcp/shm with the KV on a GPU): gather + device-to-host copy;
* land (decode: pushed KV into the request's blocks).

Before: the copies as they were (re-enacted below from the previous ``BlockCopies``): an index
``torch.tensor(list)`` per layer (pageable: a stream synchronize on the launching thread, the
forward's for a send), and one host-to-device copy per block per layer for pushed KV. After:
``BlockCopies`` now. Also the CPU (vLLM's CPU backend, ``HostDevice``): seconds per layer to
land pushed KV, one copy per block before, one ``index_copy_`` after, measured in the same run
(``--threads`` torch threads: 1 by default, so a busy shared VM's descheduled second thread does
not decide the figure).

Usage: python3 benchmarks/kv_copy_launches.py [--layers 32] [--blocks 32] [--block-kib 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support.async_device import AsyncStandInDevice
from vllm_pd.connector.device.block_copies import BlockCopies, Run, byte_blocks
from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent, HostDevice, KVDevice
from vllm_pd.connector.transport.base import MemoryRegion


class BlockCopiesBefore(BlockCopies):
    """The copies as they were before this change (per-call pageable index, per-block landing)."""

    def __init__(self, regions: Sequence[MemoryRegion], device: KVDevice) -> None:
        super().__init__(regions, device)
        self._bytes = [byte_blocks(r) for r in self.regions]

    def to_rows(self, layer: int, runs: Sequence[Run], after: DeviceEvent = COMPLETED) -> DeviceEvent:
        src = self._bytes[layer]
        event = COMPLETED
        for block_ids, rows in runs:  # one copy per run, each with its own index

            def work(block_ids: Sequence[int] = block_ids, rows: torch.Tensor = rows) -> None:
                idx = torch.tensor(list(block_ids), dtype=torch.long, device=src.device)
                rows.copy_(src.index_select(0, idx).reshape(len(block_ids), -1), non_blocking=True)

            event = self._launch(after, work)
        return event

    def from_rows(self, layer: int, runs: Sequence[Run], after: DeviceEvent = COMPLETED) -> DeviceEvent:
        dst = self._bytes[layer]
        blocks = [(b, rows[i]) for block_ids, rows in runs for i, b in enumerate(block_ids)]

        def work() -> None:  # from_buffers: one host-to-device copy per block
            for block_id, buf in blocks:
                dst[block_id].copy_(buf.view(dst.shape[1:]), non_blocking=True)

        return self._launch(after, work)


def _kv(layers: int, num_blocks: int, block_kib: int, layout: str = "flash") -> list[MemoryRegion]:
    """Layers of ``block_kib`` KiB blocks, bf16: ``flash`` [2, blocks, 16, heads, 128] (K and V
    apart, block_dim 1) or vLLM's ``cpu`` page [blocks, heads, 16, 256] (block_dim 0)."""
    heads = max(1, block_kib * 1024 // (2 * 16 * 128 * 2))
    if layout == "cpu":
        return [
            MemoryRegion(f"l{i}", torch.zeros(num_blocks, heads, 16, 256, dtype=torch.bfloat16)) for i in range(layers)
        ]
    return [
        MemoryRegion(f"l{i}", torch.zeros(2, num_blocks, 16, heads, 128, dtype=torch.bfloat16), block_dim=1)
        for i in range(layers)
    ]


def count(copies_cls: type[BlockCopies], layers: int, blocks: int, block_kib: int) -> dict[str, float]:
    """Per layer: device operations queued on the copy streams, and host syncs, for one request."""
    dev = AsyncStandInDevice(compute_delay_s=0.0, copy_delay_s=0.0, checked=True, raise_on_sync=False)
    regions = _kv(layers, 2 * blocks, block_kib)
    for r in regions:
        dev.adopt(r.tensor)
    nbytes = regions[0].block_nbytes
    send, land = copies_cls(regions, dev), copies_cls(regions, dev)
    ids = list(range(0, 2 * blocks, 2))
    rows = dev.host_empty(blocks * nbytes).view(blocks, nbytes)  # a staging run / a pushed batch
    out: dict[str, float] = {}
    for name, copies, copy in (("send", send, send.to_rows), ("land", land, land.from_rows)):
        syncs_before = len(dev.violations)
        with dev.forward():
            for layer in range(layers):
                copy(layer, [(ids, rows)], copies.record_compute())
        out[f"{name} launches"] = sum(copies.stream.ops.values()) / layers
        out[f"{name} host syncs"] = (len(dev.violations) - syncs_before) / layers
    dev.violations.clear()
    dev.finish()
    return out


def cpu_land_s(
    copies_cls: type[BlockCopies], layout: str, layers: int, blocks: int, block_kib: int, repeats: int
) -> float:
    """Median seconds per layer to land pushed KV on vLLM's CPU backend (host memory, inline copies)."""
    device: KVDevice = HostDevice()
    regions = _kv(layers, 2 * blocks, block_kib, layout)
    nbytes = regions[0].block_nbytes
    copies = copies_cls(regions, device)
    ids = list(range(0, 2 * blocks, 2))
    rows = torch.randint(0, 256, (blocks, nbytes), dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for layer in range(layers):
            copies.from_rows(layer, [(ids, rows)])
        times.append((time.perf_counter() - t0) / layers)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--threads", type=int, default=1)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    print(f"one request: {a.blocks} blocks of {a.block_kib} KiB x {a.layers} layers")
    print(f"{'per layer':<22}{'before':>10}{'after':>10}")
    before = count(BlockCopiesBefore, a.layers, a.blocks, a.block_kib)
    after = count(BlockCopies, a.layers, a.blocks, a.block_kib)
    for key in before:
        print(f"{key:<22}{before[key]:>10.2f}{after[key]:>10.2f}")
    for layout in ("cpu", "flash"):
        cpu_before = cpu_land_s(BlockCopiesBefore, layout, a.layers, a.blocks, a.block_kib, a.repeats)
        cpu_after = cpu_land_s(BlockCopies, layout, a.layers, a.blocks, a.block_kib, a.repeats)
        print(f"{'CPU land ms/layer ' + layout:<22}{cpu_before * 1e3:>10.3f}{cpu_after * 1e3:>10.3f}")


if __name__ == "__main__":
    main()
