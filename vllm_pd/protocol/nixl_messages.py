"""NIXL's messages: where a region's blocks lie (the handshake), what a PUSH and a FETCH frame carry.

The NIXL transport moves block bytes by one-sided NIXL reads and writes; its requests travel on
the stream transports' frames (frames.py) with these msgpack payloads (array-like): a PUSH
names the sender's blocks and their digests, which the receiver READs; a FETCH names the
requester's blocks (and, for parts of blocks, where each part starts on both sides), which the
owner WRITEs. A FETCH with ``frames.FLAG_CANCEL`` withdraws an earlier one. Where each region's
blocks lie (:class:`RegionLayout`) travels in the handshake, one per registered region, in the
dialler's HELLO; the transport: transport/nixl.py, its descriptors: transport/nixl_regions.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
import numpy as np

from vllm_pd.errors import TransferCorrupted

DRAM, VRAM = "DRAM", "VRAM"  # NIXL's names of host and GPU memory


class RegionLayout(msgspec.Struct, frozen=True, array_like=True):
    """Block 0's spans and the distance between blocks, of one registered region.

    A region's blocks are equally spaced: block ``b``'s byte spans are block 0's shifted by
    ``b * stride``, so this says where every block is, on this side and, sent in the
    handshake, for the peer. Made from a region by ``transport.nixl_regions.region_layout``.
    """

    mem: str  # DRAM | VRAM
    device: int  # GPU index (0 for DRAM)
    base: int  # address of block 0's first byte
    stride: int  # bytes from block b to block b + 1
    num_blocks: int
    offsets: tuple[int, ...]  # block 0's spans, relative to base, in wire order
    lengths: tuple[int, ...]

    @property
    def block_nbytes(self) -> int:
        return sum(self.lengths)

    @property
    def extent(self) -> tuple[int, int]:
        """(address, nbytes) of the memory every block lies in: what gets registered."""
        end = max(o + n for o, n in zip(self.offsets, self.lengths, strict=True))
        return self.base, (self.num_blocks - 1) * self.stride + end

    def check_ids(self, block_ids: Sequence[int] | np.ndarray, what: str) -> np.ndarray:
        """``block_ids`` as an int64 array; ValueError naming ``what`` on an id out of range."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_blocks):
            bad = int(ids[(ids < 0) | (ids >= self.num_blocks)][0])
            raise ValueError(f"block id {bad} out of range for {what} ({self.num_blocks} blocks)")
        return ids

    def spans(self, ids: np.ndarray) -> np.ndarray:
        """Addresses of the blocks' spans, shape (spans per block, len(ids)): row j holds
        every block's j-th span (j-major, so consecutive blocks sit side by side)."""
        offsets = np.asarray(self.offsets, dtype=np.int64)
        return self.base + ids[None, :] * self.stride + offsets[:, None]

    def wire_offsets(self) -> np.ndarray:
        """Where each span of a block starts in the block's wire bytes."""
        lengths = np.asarray(self.lengths, dtype=np.int64)
        return np.concatenate([[0], np.cumsum(lengths)[:-1]])


class PushPayload(msgspec.Struct, array_like=True):
    block_ids: bytes  # u32: the sender's blocks, in the order of the frame's positions
    digests: bytes  # one per block (empty without a checksum)
    timeout_s: float
    window_offset: int = 0  # where in each block the frame's block_nbytes start (a window of it)
    windowed: bool = False


class FetchPayload(msgspec.Struct, array_like=True):
    block_ids: bytes  # u32: the requester's blocks the owner writes, in the order of the frame's ids
    timeout_s: float
    # parts of blocks (FetchSpans), u64 each: where each id's part starts at the owner and at the
    # requester, and its length; empty: whole blocks
    src_offsets: bytes = b""
    dst_offsets: bytes = b""
    lengths: bytes = b""

    def spans(self, count: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(source offsets, destination offsets, lengths) of a fetch of parts; None: whole blocks."""
        if not self.lengths:
            return None
        arrays = tuple(
            np.frombuffer(b, dtype=np.uint64).astype(np.int64)
            for b in (self.src_offsets, self.dst_offsets, self.lengths)
        )
        if any(len(a) != count for a in arrays) or (arrays[2] <= 0).any():
            raise TransferCorrupted(f"fetch of parts: {[len(a) for a in arrays]} offsets and lengths for {count} ids")
        return arrays  # type: ignore[return-value]
