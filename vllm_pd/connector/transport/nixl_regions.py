"""Where a region's blocks lie, as the descriptors NIXL moves.

A region's blocks are equally spaced: block ``b``'s byte spans are block 0's spans
shifted by ``b * stride`` (the tensor's stride along its block dimension), so one
``RegionLayout`` (protocol/nixl_messages.py: block 0's spans and the stride; made here by
:func:`region_layout`) says where every block is, on this side and, sent in the handshake,
for the peer. A block's wire bytes are its bytes in memory order (``MemoryRegion.blocks``):
one span in every vLLM 0.32 layout that keeps a block of a layer together (LBHNC, LBNHC,
BLHNC, BLNHC, with or without kernel blocks), one per head where heads lie outside blocks
(LHBNC, BHLNC).

A transfer pairs the two sides' spans of each block (:func:`block_pairs`, cut where either
side's span ends, so the sides' layouts may differ as long as their wire bytes mean the
same), then merges pairs that continue each other on both sides into one descriptor: a
run of blocks adjacent on both sides becomes one descriptor per span of a block, since
every descriptor costs the NIC (or NVLink) a work request. The regions of one process are
registered as the fewest spans of memory that hold them (:func:`registrations`): vLLM 0.32
keeps every layer in one buffer, and block-outermost layouts interleave the layers.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np

from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.connector.transport.checksum import block_digest, running_digest
from vllm_pd.protocol.frames import Checksum
from vllm_pd.protocol.nixl_messages import DRAM, VRAM, RegionLayout


def region_layout(region: MemoryRegion) -> RegionLayout:
    """The layout of ``region`` (what the handshake tells the peer); ValueError for memory NIXL cannot register."""
    t = region.tensor
    if t.device.type == "cpu":
        mem, device = DRAM, 0
    elif t.device.type == "cuda":
        mem, device = VRAM, t.get_device()
    else:
        raise ValueError(f"region {region.name!r}: NIXL registers cpu or cuda tensors, got {t.device}")
    if t.numel() == 0 or any(s < 0 for s in t.stride()):
        raise ValueError(f"region {region.name!r}: needs a non-empty tensor with non-negative strides")
    base = t.data_ptr()
    spans = region.block_spans(0)
    return RegionLayout(
        mem,
        device,
        base,
        t.stride(region.block_dim) * t.element_size(),
        region.num_blocks,
        tuple(a - base for a, _ in spans),
        tuple(n for _, n in spans),
    )


def merge_pairs(
    local: np.ndarray, remote: np.ndarray, lengths: np.ndarray, segment: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge pairs of spans (``local[k]`` <-> ``remote[k]``, ``lengths[k]`` bytes) that continue
    the previous pair on both sides and lie in the same local ``segment`` (a registration:
    NIXL refuses a descriptor that crosses two). Returns (local, remote, lengths) merged."""
    local, remote, lengths = (np.asarray(a, dtype=np.int64).reshape(-1) for a in (local, remote, lengths))
    if len(local) == 0:
        return local, remote, lengths
    starts = np.ones(len(local), dtype=bool)
    starts[1:] = (local[1:] != local[:-1] + lengths[:-1]) | (remote[1:] != remote[:-1] + lengths[:-1])
    if segment is not None:
        starts[1:] |= segment[1:] != segment[:-1]
    first = np.flatnonzero(starts)
    return local[first], remote[first], np.add.reduceat(lengths, first)


def block_pairs(
    local: RegionLayout, local_ids: np.ndarray, remote: RegionLayout, remote_ids: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The descriptors that move block ``local_ids[i]`` <-> ``remote_ids[i]`` for every i:
    (local addresses, remote addresses, lengths), merged. Each block's wire bytes are cut
    where a span ends on either side; ValueError if the two sides' blocks differ in size."""
    if local.block_nbytes != remote.block_nbytes:
        raise ValueError(f"blocks of {local.block_nbytes} bytes here, {remote.block_nbytes} at the peer")
    cuts = np.union1d(local.wire_offsets(), remote.wire_offsets())  # where each piece starts in a block
    pieces = np.diff(np.append(cuts, local.block_nbytes))
    return merge_pairs(
        _piece_addresses(local, local_ids, cuts).reshape(-1),
        _piece_addresses(remote, remote_ids, cuts).reshape(-1),
        np.repeat(pieces, len(local_ids)),
    )


def _piece_addresses(lay: RegionLayout, ids: np.ndarray, cuts: np.ndarray) -> np.ndarray:
    """Addresses of the pieces starting at wire offsets ``cuts`` of blocks ``ids``: (pieces, len(ids))."""
    starts = lay.wire_offsets()
    span = np.searchsorted(starts, cuts, side="right") - 1  # the span each piece lies in
    addresses: np.ndarray = lay.spans(np.asarray(ids, dtype=np.int64))[span] + (cuts - starts[span])[:, None]
    return addresses


def registrations(layouts: Sequence[RegionLayout]) -> list[tuple[str, int, int, int]]:
    """(mem, device, address, nbytes) of the fewest spans of memory that hold every layout's
    extent: overlapping or touching extents of the same memory become one."""
    out: list[tuple[str, int, int, int]] = []
    for mem, device, start, end in sorted((lay.mem, lay.device, lay.extent[0], sum(lay.extent)) for lay in layouts):
        if out and out[-1][:2] == (mem, device) and start <= out[-1][2] + out[-1][3]:
            first = out[-1][2]
            out[-1] = (mem, device, first, max(end, first + out[-1][3]) - first)
        else:
            out.append((mem, device, start, end - start))
    return out


class BlockRef:
    """One block of a local region, where a byte view cannot say it (several spans, GPU
    memory): ``len()`` is its byte count, as the stream machinery asks of a block."""

    __slots__ = ("layer", "block_id", "nbytes", "offset")

    def __init__(self, layer: int, block_id: int, nbytes: int, offset: int = 0) -> None:
        self.layer, self.block_id, self.nbytes, self.offset = layer, block_id, nbytes, offset

    def __len__(self) -> int:
        return self.nbytes


class NixlRegions:
    """This side's regions as NIXL sees them: layouts, block checks, host digests."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        self.layouts = [region_layout(r) for r in regions]
        self.block_nbytes = [lay.block_nbytes for lay in self.layouts]
        self.num_blocks = [lay.num_blocks for lay in self.layouts]
        self._tensors = [r.tensor for r in regions]  # the registered memory stays alive with us
        # Host bytes of each DRAM region's extent, for checksums (None: GPU memory).
        self._host: list[np.ndarray | None] = [
            # a ctypes array exports the buffer protocol; numpy's stubs do not list it
            np.frombuffer((ctypes.c_char * lay.extent[1]).from_address(lay.base), dtype=np.uint8)  # type: ignore[call-overload]
            if lay.mem == DRAM
            else None
            for lay in self.layouts
        ]
        self.registrations = registrations(self.layouts)
        host = [(start, start + n) for mem, _, start, n in self.registrations if mem == DRAM]
        self._host_starts = np.array([s for s, _ in host], dtype=np.int64)
        self._host_ends = np.array([e for _, e in host], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.layouts)

    @property
    def has_vram(self) -> bool:
        return any(lay.mem == VRAM for lay in self.layouts)

    def layout(self, layer: int) -> RegionLayout:
        if not 0 <= layer < len(self.layouts):
            raise ValueError(f"layer {layer} not registered ({len(self.layouts)} regions)")
        return self.layouts[layer]

    def check_ids(self, layer: int, block_ids: Sequence[int]) -> np.ndarray:
        return self.layout(layer).check_ids(block_ids, f"layer {layer}")

    def views(self, layer: int, block_ids: Sequence[int]) -> list[BlockRef]:
        """The blocks, checked (ValueError on a bad layer or id); what a served fetch reads."""
        ids = self.check_ids(layer, block_ids)
        nbytes = self.block_nbytes[layer]
        return [BlockRef(layer, int(b), nbytes) for b in ids]

    def digests(self, layer: int, ids: np.ndarray, checksum: Checksum) -> bytes:
        """One digest per block, taken over its bytes in wire order (b"" without a checksum)."""
        host = self._host[layer]
        if checksum is Checksum.NONE or host is None:
            return b""
        lay = self.layouts[layer]
        spans = self.spans_relative(layer, ids)
        if len(lay.lengths) == 1:
            n = lay.lengths[0]
            return b"".join(block_digest(checksum, host[s : s + n]) for s in spans[0].tolist())
        out = []
        for i in range(len(ids)):
            d = running_digest(checksum)
            for j, n in enumerate(lay.lengths):
                start = int(spans[j, i])
                d.update(host[start : start + n])
            out.append(d.digest())
        return b"".join(out)

    def part_digests(
        self, layer: int, ids: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, checksum: Checksum
    ) -> bytes:
        """One digest per part (bytes ``[offsets[i], offsets[i] + lengths[i])`` of block ``ids[i]``,
        a layout of one span a block), b"" without a checksum or on a GPU."""
        host = self._host[layer]
        if checksum is Checksum.NONE or host is None:
            return b""
        starts = (self.spans_relative(layer, np.asarray(ids, dtype=np.int64))[0] + offsets).tolist()
        return b"".join(block_digest(checksum, host[s : s + n]) for s, n in zip(starts, lengths.tolist(), strict=True))

    def spans_relative(self, layer: int, ids: np.ndarray) -> np.ndarray:
        lay = self.layouts[layer]
        return lay.spans(ids) - lay.base

    def host_segments(self, addresses: np.ndarray, nbytes: int | np.ndarray) -> np.ndarray:
        """For each buffer at ``addresses`` (``nbytes`` long, one length or one each): the
        index of the DRAM registration holding it whole (so already registered), or -1."""
        if not len(self._host_starts):
            return np.full(len(addresses), -1, dtype=np.int64)
        k = np.maximum(np.searchsorted(self._host_starts, addresses, side="right") - 1, 0)
        inside = (addresses >= self._host_starts[k]) & (addresses + nbytes <= self._host_ends[k])
        return np.where(inside, k, -1)
