"""What the store's scheduler side tells its worker side each step, and what
the worker reports back (msgspec Structs: they ride inside the connector's
KVConnectorMetadata and KVConnectorWorkerMetadata, pickled by vLLM).
"""

from __future__ import annotations

import msgspec

from vllm_pd.protocol.block_keys import BlockKey


class SaveOp(msgspec.Struct, frozen=True):
    """Copy vLLM blocks ``block_ids`` into pool ``slots`` as ``keys`` (a chain
    hanging off ``parent``; None = root), then write them to disk if enabled,
    recording ``scope`` (what the blocks were written for: block_keys.RequestExtraKeys.scope)."""

    request_id: str
    parent: BlockKey | None
    keys: list[BlockKey]
    block_ids: list[int]
    slots: list[int]
    scope: BlockKey


class LoadOp(msgspec.Struct, frozen=True):
    """Copy ``keys`` into vLLM blocks ``block_ids``, layer by layer. A key with
    ``from_disk`` is first read (and verified) from disk into its ``slots`` entry;
    a key with ``from_peer`` is first fetched from another node (``peer``: its
    store endpoints, one per TP rank, comma-separated) into its reserved slot,
    and reported back as a save (two-phase put: it commits once it landed)."""

    request_id: str
    keys: list[BlockKey]
    block_ids: list[int]
    slots: list[int]
    from_disk: list[bool]
    from_peer: list[bool] = []  # empty: none
    peer: str = ""
    parent: BlockKey | None = None  # parent of keys[0] (fetched blocks are written to disk with it)
    scope: BlockKey = b""  # the loading request's: disk reads verify it, fetched blocks record it


class StorePlan(msgspec.Struct):
    saves: list[SaveOp] = []
    loads: list[LoadOp] = []

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads)


class SaveResult(msgspec.Struct, frozen=True):
    request_id: str
    committed: list[BlockKey]  # bytes in the pool, checksummed
    failed: list[BlockKey]


class LoadResult(msgspec.Struct, frozen=True):
    request_id: str
    loaded: list[BlockKey]
    failed: list[BlockKey]  # and every key after the first failure is unusable too
    failed_block_ids: list[int]  # vLLM blocks whose KV must be recomputed


class StoreReport(msgspec.Struct):
    """Worker -> scheduler, once per step; ``aggregate`` merges TP ranks' reports."""

    saves: list[SaveResult] = []
    loads: list[LoadResult] = []
    disk_committed: list[tuple[BlockKey, BlockKey | None, BlockKey]] = []  # (key, parent, scope)
    disk_evicted: list[BlockKey] = []  # gone from disk (capacity, corrupt file)
    disk_failed: list[BlockKey] = []  # write-through to disk did not happen
    ranks: int = 1  # how many worker reports were merged into this one

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.disk_committed or self.disk_evicted or self.disk_failed)

    def aggregate(self, other: StoreReport) -> StoreReport:
        return StoreReport(
            saves=self.saves + other.saves,
            loads=self.loads + other.loads,
            disk_committed=self.disk_committed + other.disk_committed,
            disk_evicted=self.disk_evicted + other.disk_evicted,
            disk_failed=self.disk_failed + other.disk_failed,
            ranks=self.ranks + other.ranks,
        )
