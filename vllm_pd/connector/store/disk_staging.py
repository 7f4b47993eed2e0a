"""Serving the holder's disk tier to peers: disk blocks staged into spare pool rows.

A peer's fetch reads pool rows over the transport, so a block that this node
holds only on disk is first read (and checksum-verified) from its file into a
*spare* row of the pool - rows past the ones the scheduler side hands out -
and served from there like any pool slot.

Why spare rows and not ordinary pool slots: the scheduler side (another
process) owns slot numbers and the CPU tier's policy; a worker that took slots
for a peer would race it, and promoting a block because *another* node reads
it would evict this node's own hot blocks for a one-off read. Why not the file
bytes straight onto the socket: the transport serves registered memory only
(one region, grants per row), and the bytes must be verified before they are
sent anyway, which needs them in memory. A staged row belongs to one grant
until that grant ends (the transport's revoke returns once no byte of it is
still being sent), so nothing overwrites it while a peer reads it.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.disk_tier import DiskTier
from vllm_pd.protocol.block_keys import BlockKey
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


class DiskStaging:
    def __init__(self, pool: CpuBlockPool, disk: DiskTier, rows: Sequence[int]) -> None:
        self.pool = pool
        self.disk = disk
        self._lock = threading.Lock()
        self._free = list(rows)
        self.rows = frozenset(rows)

    @property
    def free_count(self) -> int:
        with self._lock:
            return len(self._free)

    def holds(self, key: BlockKey) -> bool:
        return key in self.disk

    def stage(self, keys: Sequence[BlockKey], scope: BlockKey) -> tuple[list[int], list[bytes]]:
        """Read as long a leading run of ``keys`` (written for ``scope``) as spare rows allow; returns
        the rows and the verified checksums of the leading keys that landed (the
        caller owns those rows until :meth:`give_back`; the others are back)."""
        with self._lock:
            n = min(len(keys), len(self._free))
            rows = [self._free.pop() for _ in range(n)]
        reads = [self.disk.read_into(key, self.pool.slot_view(row), scope) for key, row in zip(keys, rows)]
        results = [fut.result() for fut in reads]  # all of them: none may still write a row given back
        sums: list[bytes] = []
        for digest in results:
            if digest is None:
                break  # a failed read ends the usable run (chained keys: later blocks need it)
            sums.append(digest)
        self.give_back(rows[len(sums) :])
        if len(sums) < len(keys):
            logger.debug("store: staged %d of %d disk blocks for a peer", len(sums), len(keys))
        return rows[: len(sums)], sums

    def give_back(self, rows: Sequence[int]) -> None:
        with self._lock:
            self._free.extend(rows)
