"""Pinned host rows that stand in for device KV blocks on host transports.

Stream transports (tcp, shm) move bytes between host memory regions. A GPU's KV
cache reaches them through this arena: per layer a pinned ``[rows, block_nbytes]``
tensor, registered with the transport in place of the layer's device cache. A
transfer takes a contiguous run of rows (the same row numbers in every layer),
so one device-to-host copy per layer fills it and one transport message sends it.

Bounded: when no run of the size asked for is free, ``take`` returns None and the
caller falls back (decode reads instead of a push, or recomputes), never waits.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Sequence

from vllm_pd.connector.device.kv_device import KVDevice
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.errors import ConfigError


class StagingArena:
    def __init__(self, device: KVDevice, block_nbytes: Sequence[int], capacity_bytes: int) -> None:
        per_row = sum(block_nbytes)
        self.rows = capacity_bytes // per_row if per_row else 0
        if self.rows < 1:
            raise ConfigError(f"host staging of {capacity_bytes} bytes holds no block of all layers ({per_row} bytes)")
        self.tensors = [device.host_empty(self.rows * n).view(self.rows, n) for n in block_nbytes]
        self.regions = [MemoryRegion(f"host-staging-{i}", t) for i, t in enumerate(self.tensors)]
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, self.rows)]  # sorted (start, length) runs

    def take(self, n: int) -> int | None:
        """First row of a free run of ``n`` rows (first fit), or None if there is none."""
        with self._lock:
            for i, (start, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (start + n, length - n)
                    return start
        return None

    def give_back(self, start: int, n: int) -> None:
        with self._lock:
            i = bisect.bisect(self._free, (start, n))
            self._free.insert(i, (start, n))
            merged: list[tuple[int, int]] = []
            for s, length in self._free[max(0, i - 1) : i + 2]:
                if merged and merged[-1][0] + merged[-1][1] == s:
                    merged[-1] = (merged[-1][0], merged[-1][1] + length)
                else:
                    merged.append((s, length))
            self._free[max(0, i - 1) : i + 2] = merged

    @property
    def free_rows(self) -> int:
        with self._lock:
            return sum(length for _, length in self._free)
