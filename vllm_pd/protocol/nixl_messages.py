"""NIXL's payloads on its control connection: what a PUSH and a FETCH frame carry.

The NIXL transport moves block bytes by one-sided NIXL reads and writes; its requests travel on
the stream transports' frames (frames.py) with these msgpack payloads (array-like): a PUSH
names the sender's blocks and their digests, which the receiver READs; a FETCH names the
requester's blocks (and, for parts of blocks, where each part starts on both sides), which the
owner WRITEs. A FETCH with ``frames.FLAG_CANCEL`` withdraws an earlier one. Where each region's
blocks lie travels in the handshake (transport/nixl_regions.py); the transport: transport/nixl.py.
"""

from __future__ import annotations

import msgspec
import numpy as np

from vllm_pd.errors import TransferCorrupted


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
