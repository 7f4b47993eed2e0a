"""Local registered regions and the fetch grants that guard them."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import numpy as np

from vllm_pd.connector.transport.base import MemoryRegion


class RegisteredRegions:
    """The layers' paged caches as byte rows, for zero-copy block views."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        import torch  # here, not at import: the proxy's release path loads this module without torch

        self._rows: list[np.ndarray] = []
        self.block_nbytes: list[int] = []
        self.num_blocks: list[int] = []
        for r in regions:
            t = r.blocks
            if t.device.type != "cpu":
                # device KV reaches a stream transport through the connector's pinned staging
                raise ValueError(f"region {r.name!r}: stream transports need host memory, got {t.device}")
            if t.dim() < 1 or not r.block_contiguous:
                raise ValueError(f"region {r.name!r}: its blocks must be contiguous pages, back to back")
            rows = t.view(torch.uint8).view(r.num_blocks, r.block_nbytes)  # a view: never a copy
            self._rows.append(rows.numpy())
            self.block_nbytes.append(r.block_nbytes)
            self.num_blocks.append(r.num_blocks)
        # A block's view is made once: a push runs on the forward's thread, where making
        # views anew cost ~20 us per layer (cold caches after a layer's compute).
        self._views: list[list[memoryview | None]] = [[None] * n for n in self.num_blocks]

    def __len__(self) -> int:
        return len(self._rows)

    def views(self, layer: int, block_ids: Sequence[int]) -> list[memoryview]:
        """Byte views of ``block_ids`` of ``layer``; ValueError on a bad id."""
        if not 0 <= layer < len(self._rows):
            raise ValueError(f"layer {layer} not registered ({len(self._rows)} regions)")
        rows, n, cache = self._rows[layer], self.num_blocks[layer], self._views[layer]
        out = []
        for b in block_ids:
            if not 0 <= b < n:
                raise ValueError(f"block id {b} out of range for layer {layer} ({n} blocks)")
            v = cache[b]
            if v is None:
                v = cache[b] = memoryview(rows[b])
            out.append(v)
        return out


class FetchGrants:
    """Which blocks peers may read, per transfer id.

    A revoke waits until reads of that transfer that are already sending have
    finished, so that once ``revoke`` returns no byte of those blocks leaves
    this process (the connector may then reuse them).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        # transfer id -> {block id peers ask for: registered block id that holds its bytes}
        self._grants: dict[str, dict[int, int]] = {}
        self._serving: dict[str, int] = {}

    def grant(self, transfer_id: str, block_ids: Sequence[int], served_from: Sequence[int] | None = None) -> None:
        with self._cond:
            self._grants[transfer_id] = dict(zip(block_ids, served_from if served_from is not None else block_ids))

    def check(self, transfer_id: str, block_ids: Sequence[int]) -> str | None:
        """None if the read is allowed, else why not."""
        return self.lookup(transfer_id, block_ids)[1]

    def lookup(self, transfer_id: str, block_ids: Sequence[int]) -> tuple[list[int], str | None]:
        """(the registered ids holding ``block_ids``' bytes, None) if the read is allowed,
        else ([], why not)."""
        with self._cond:
            granted = self._grants.get(transfer_id)
        if granted is None:
            return [], f"transfer {transfer_id!r} is not granted for fetch (unknown or released)"
        extra = set(block_ids) - granted.keys()
        if extra:
            return [], f"transfer {transfer_id!r}: blocks {sorted(extra)[:8]} are not granted"
        return [granted[b] for b in block_ids], None

    def begin_serve(self, transfer_id: str, block_ids: Sequence[int]) -> str | None:
        """Check again and mark the read in flight (None = go ahead)."""
        with self._cond:
            why = self.check(transfer_id, block_ids)
            if why is None:
                self._serving[transfer_id] = self._serving.get(transfer_id, 0) + 1
            return why

    def end_serve(self, transfer_id: str) -> None:
        with self._cond:
            left = self._serving[transfer_id] - 1
            if left:
                self._serving[transfer_id] = left
            else:
                del self._serving[transfer_id]
                self._cond.notify_all()

    def revoke(self, transfer_id: str, wait: float) -> bool:
        """Drop the grant; True once no read of it is in flight (False: still
        in flight after ``wait`` seconds)."""
        deadline = time.monotonic() + wait
        with self._cond:
            self._grants.pop(transfer_id, None)
            while transfer_id in self._serving:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def transfer_ids(self) -> list[str]:
        """The transfers granted now."""
        with self._cond:
            return list(self._grants)

    def serving(self, transfer_id: str) -> bool:
        with self._cond:
            return transfer_id in self._serving
