"""A layer plan's wire: the PLAN frame's payload and the progress area the receiver polls.

A plan says once, as a step starts, which blocks of which layers the sender will push and
where they lie in its memory; the receiver reads each layer itself (cross-memory reads) once
the sender's progress area says it is ready (transport/layer_plan.py: why, and both sides).

Payload of a PLAN frame (frames.py; ids = the blocks' positions, block_nbytes, checksum):
``progress address u64 | timeout ms u32 | layer count u32 | layer u32 x L |
block address u64 x (L x count)``. The progress area, in the sender's memory:
``ready layers u64 | digest x (L x count)`` (layer k's digests after layer k-1's).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_pd.errors import TransferCorrupted
from vllm_pd.protocol.frames import DIGEST_NBYTES

_HEAD = struct.Struct("<QII")
READY_NBYTES = 8  # the progress area's count of ready layers, u64


def progress_nbytes(layers: int, count: int) -> int:
    """Bytes of the progress area of a plan of ``layers`` layers x ``count`` blocks."""
    return READY_NBYTES + DIGEST_NBYTES * layers * count


def digests_offset(k: int, count: int) -> int:
    """Where the plan's ``k``-th layer's digests start in the progress area."""
    return READY_NBYTES + DIGEST_NBYTES * k * count


def encode_plan(progress: int, timeout_s: float, layers: Sequence[int], addresses: Sequence[int]) -> bytes:
    """A PLAN frame's payload: ``addresses`` per layer, per block (layer-major)."""
    return b"".join(
        (
            _HEAD.pack(progress, max(1, int(timeout_s * 1000)), len(layers)),
            struct.pack(f"<{len(layers)}I", *layers),
            struct.pack(f"<{len(addresses)}Q", *addresses),
        )
    )


@dataclass(frozen=True)
class PlanFrame:
    """Receiver side: a PLAN frame's payload, parsed and bounds-checked."""

    progress: int
    timeout_s: float
    layers: tuple[int, ...]
    addresses: tuple[tuple[int, ...], ...]  # per layer, per block

    @classmethod
    def parse(cls, payload: bytes, count: int) -> PlanFrame:
        try:
            progress, timeout_ms, n_layers = _HEAD.unpack_from(payload, 0)
            off = _HEAD.size
            layers = struct.unpack_from(f"<{n_layers}I", payload, off)
            off += 4 * n_layers
            flat = struct.unpack_from(f"<{n_layers * count}Q", payload, off)
            off += 8 * n_layers * count
        except struct.error as e:
            raise TransferCorrupted(f"PLAN payload: {e}") from None
        if off != len(payload) or not n_layers or not count:
            raise TransferCorrupted(f"PLAN payload of {len(payload)} bytes for {n_layers} layers x {count} blocks")
        addresses = tuple(flat[i * count : (i + 1) * count] for i in range(n_layers))
        return cls(progress, timeout_ms / 1000, layers, addresses)

    def digests_address(self, k: int) -> int:
        return self.progress + digests_offset(k, len(self.addresses[0]))
