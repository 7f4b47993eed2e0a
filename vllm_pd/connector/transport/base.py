"""The one transport interface.

A transport moves whole KV blocks, as opaque bytes, between *registered memory
regions* of two processes. A region is one KV layer's paged cache: a tensor whose
first dimension is the block index, each block ``block_nbytes`` bytes that travel in
memory order (vLLM 0.32's per-layer ``[num_blocks, heads, block_size, K|V]`` view in
its LBHNC layout is one contiguous page per block; on GPU a region is a device pointer
+ stride, which is what RDMA / CUDA IPC / NIXL register).

Two data operations, each per region (= per layer) and asynchronous, so the
connector can start layer i while layer i+1 computes and wait per layer:

* ``push``  - send local blocks to a peer, tagged ``(transfer_id, layer)`` and the
  blocks' positions in the request; the peer's :class:`BlockSink` decides where
  they land (a staging buffer, or final blocks). One-sided WRITE on RDMA.
* ``fetch`` - ask a peer for blocks of one of *its* registered regions and land
  them straight into local blocks. One-sided READ on RDMA.

plus ``notify``, a small control message (release, abort) with an optional reply.

Either may move part of each block instead of all of it - a run of heads of a head-major
block, when prefill and decode shard heads differently, or per head a run of tokens, when
their block sizes differ (``kv_geometry``): a push takes one :class:`BlockWindow` of every
block it sends, a fetch a :class:`FetchSpans` (one source range and destination offset per
block id, ids repeating).

Every completion is a :class:`concurrent.futures.Future` resolving to ``None`` or
failing with a :class:`~vllm_pd.errors.TransportError`. Each block
travels with its length and a checksum; the receiving side verifies both before
reporting success, so a corrupt or truncated block is a failed future, never
silently wrong KV.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # torch is imported where tensors are used: the proxy sends releases without it
    import torch


@dataclass(frozen=True)
class MemoryRegion:
    """A registered span of local memory: one layer's paged KV cache.

    ``block_dim`` is the dimension of ``tensor`` that indexes blocks (0 for vLLM 0.32's
    views, grouped into manager blocks by ``kv_layout.manager_blocks``; 1 in the older
    FlashAttention ``[2, num_blocks, ...]``). A block's bytes on the wire are its bytes in
    memory order (:attr:`blocks`): one contiguous span where the layout keeps a block of a
    layer in one (vLLM's LBHNC, LBNHC, BLHNC, BLNHC), else one span per run (LHBNC and
    BHLNC: one per head). Both sides must use the same layout and shape
    (``kv_layout.block_format``): the same bytes then mean the same thing.
    """

    name: str
    tensor: torch.Tensor
    block_dim: int = 0

    @cached_property
    def blocks(self) -> torch.Tensor:
        """The tensor as ``[num_blocks, ...]`` with each block's dims in memory order, outermost
        first (a view): ``blocks[b]``'s elements in index order are block b's bytes in memory order."""
        t = self.tensor.movedim(self.block_dim, 0) if self.block_dim else self.tensor
        # dims of one element first (their stride means nothing), then by falling stride
        inner = sorted(range(1, t.dim()), key=lambda d: (t.shape[d] != 1, -t.stride(d)))
        return t.permute(0, *inner)

    @property
    def num_blocks(self) -> int:
        return int(self.tensor.shape[self.block_dim])

    @cached_property
    def block_nbytes(self) -> int:
        return int(self.blocks[0].numel() * self.tensor.element_size())

    @property
    def block_contiguous(self) -> bool:
        """Each block is one contiguous page, blocks back to back (what stream transports need)."""
        return bool(self.blocks.is_contiguous())

    def block_spans(self, block_id: int) -> list[tuple[int, int]]:
        """(address, nbytes) of the contiguous byte spans of one block, in wire (= memory) order:
        one span per block wherever the layout allows. What RDMA-style transports (NIXL) turn
        into descriptors."""
        return tensor_spans(self.blocks[block_id])

    def block_view(self, block_id: int) -> memoryview:
        """Zero-copy byte view of one block (CPU tensors, :attr:`block_contiguous`)."""
        import torch

        return memoryview(self.blocks[block_id].view(torch.uint8).numpy()).cast("B")


def tensor_spans(t: torch.Tensor) -> list[tuple[int, int]]:
    """(address, nbytes) of the maximal contiguous runs of ``t``'s elements, in index order."""
    size, stride = list(t.shape), list(t.stride())
    inner, run = len(size), 1  # the longest suffix of dims laid out densely
    while inner > 0 and (size[inner - 1] == 1 or stride[inner - 1] == run):
        run *= size[inner - 1]
        inner -= 1
    offsets = [0]  # every index combination of the outer dims, in row-major order
    for n, st in zip(size[:inner], stride[:inner]):
        offsets = [o + i * st for o in offsets for i in range(n)]
    elem = t.element_size()
    return [(t.data_ptr() + o * elem, run * elem) for o in offsets]


@dataclass(frozen=True)
class BlockWindow:
    """Bytes ``[offset, offset + nbytes)`` of every block a push sends (in wire order)."""

    offset: int
    nbytes: int

    def check(self, block_nbytes: int) -> None:
        """ValueError unless the window lies inside blocks of ``block_nbytes``."""
        if self.offset < 0 or self.nbytes <= 0 or self.offset + self.nbytes > block_nbytes:
            raise ValueError(
                f"window [{self.offset}, {self.offset + self.nbytes}) is not inside a block of {block_nbytes} bytes"
            )


@dataclass(frozen=True)
class FetchSpans:
    """Part of each block of a fetch: bytes ``[src_offsets[i], src_offsets[i] + lengths[i])``
    of the peer's block ``remote_block_ids[i]`` land at ``dst_offsets[i]`` of our block
    ``local_block_ids[i]`` (block ids may repeat, one entry per span)."""

    src_offsets: tuple[int, ...]
    dst_offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if not len(self.src_offsets) == len(self.dst_offsets) == len(self.lengths):
            raise ValueError("FetchSpans: one source offset, destination offset and length per span")

    def __len__(self) -> int:
        return len(self.lengths)

    def check(self, src_block_nbytes: int, dst_block_nbytes: int | None = None) -> None:
        """ValueError unless every span lies inside blocks of these sizes (the destination's
        unchecked where None)."""
        for s, d, n in zip(self.src_offsets, self.dst_offsets, self.lengths, strict=True):
            if (
                s < 0
                or d < 0
                or n <= 0
                or s + n > src_block_nbytes
                or (dst_block_nbytes is not None and d + n > dst_block_nbytes)
            ):
                raise ValueError(
                    f"span of {n} bytes at {s} -> {d} is not inside blocks of {src_block_nbytes} "
                    f"-> {dst_block_nbytes} bytes"
                )


@dataclass(frozen=True)
class BlockBatch:
    """What a push carries besides the bytes: enough for the sink to place them."""

    transfer_id: str
    layer: int  # index of the region in registration order (same model on both sides)
    positions: tuple[int, ...]  # each block's index within the request (0 = first block)
    block_nbytes: int
    last: bool = False  # the sender will push no more batches for this transfer
    peer: str = ""  # who pushed it (the sender's endpoint, set by the receiving transport): for per-peer bounds


class LayerPush(Protocol):
    """What ``Transport.push_layers`` returns: mark layers ready in order, await the future."""

    future: Future[None] | None  # resolves once the peer landed every layer (or failed)

    def ready(self, k: int) -> None:
        """The k-th of the push's layers is written and final: the peer may take it."""


class BlockSink(Protocol):
    """Receiving side of ``push`` and ``notify``; implemented by the connector worker.

    Called from the transport's I/O threads: implementations must be thread-safe
    and must not block for long.
    """

    def destinations(self, batch: BlockBatch) -> Sequence[memoryview] | None:
        """Writable views, one per block of ``batch`` (``block_nbytes`` each),
        or ``None`` to reject the batch (the sender's future fails with
        TransferRejected)."""

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        """The batch's bytes are in ``destinations`` and verified (ok), or not."""

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        """A control message from a peer; the return value is the reply.
        ``peer`` is the sender's own endpoint (what its ``start`` returned), so
        the sink can push or notify back."""


class Transport(abc.ABC):
    """One implementation per file: tcp.py, shm.py; later cuda_ipc, nixl, deepep."""

    name: str = ""
    #: registers device (GPU) memory itself; else device KV reaches it through pinned host staging
    device_memory: bool = False

    @abc.abstractmethod
    def register_regions(self, regions: Sequence[MemoryRegion]) -> None:
        """Declare the local memory peers may fetch from or push into (all layers,
        in layer order). Called once, before ``start``."""

    def unregister_regions(self) -> None:
        """The registered memory is about to lose its physical pages, to get new ones at the same
        addresses later (vLLM's sleep mode): drop whatever ties the transport to the old pages, and
        neither serve nor move it until :meth:`restore_regions`. Transfers have ended (vLLM drains
        them first). Idempotent."""

    def restore_regions(self) -> None:
        """The registered memory is mapped again, at the same addresses: serve it again. Idempotent."""

    @abc.abstractmethod
    def start(self, sink: BlockSink, host: str, port: int) -> str:
        """Start serving (port 0 = any free port); returns this side's endpoint
        string, which peers pass to ``push``/``fetch``/``notify``."""

    @abc.abstractmethod
    def push(
        self,
        peer: str,
        batch: BlockBatch,
        block_ids: Sequence[int],
        timeout: float,
        answer: bool = True,
        window: BlockWindow | None = None,
    ) -> Future[None]:
        """Send local blocks ``block_ids`` of region ``batch.layer`` to ``peer`` (``window``: only
        those bytes of each block; ``batch.block_nbytes`` is then the window's size).
        The source blocks must stay untouched until the future resolves. Batches
        to one peer land in the order they were pushed. A push that times out
        after its bytes left may still land at the peer: abort it with notify.

        ``answer=False``: the peer answers only a failure; the push succeeds when a
        later answered request to the same peer succeeds (pushes of one forward step
        but its last cost the sender no answer each). Its future stays pending until
        then (or its timeout), so the caller must follow it with an answered push."""

    def push_layers(
        self,
        peer: str,
        transfer_id: str,
        layers: Sequence[int],
        positions: Sequence[int],
        block_ids: Sequence[int],
        timeout: float,
        last: bool = False,
        window: BlockWindow | None = None,
    ) -> LayerPush | None:
        """Announce, before a forward, a push of blocks ``block_ids`` (at ``positions``) of
        every region in ``layers``, which the peer takes itself as each layer is marked
        ready: one message per step instead of one per layer (the peer's sink sees one
        ``landed`` per layer, as with ``push``). None where this transport cannot do it for
        ``peer`` (then push layer by layer). Same contract for the source blocks as ``push``."""
        return None

    @abc.abstractmethod
    def fetch(
        self,
        peer: str,
        transfer_id: str,
        layer: int,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout: float,
        spans: FetchSpans | None = None,
    ) -> Future[None]:
        """Read blocks ``remote_block_ids`` of the peer's region ``layer`` into our
        region ``layer`` at ``local_block_ids`` (``spans``: only those parts, one per id). The
        peer serves the read only if ``transfer_id`` is one it holds and every id in
        ``remote_block_ids`` is in its grant (see :meth:`allow_fetch`); else TransferRejected."""

    @abc.abstractmethod
    def notify(self, peer: str, message: bytes, timeout: float) -> Future[bytes | None]:
        """Deliver a small control message; resolves to the peer's reply."""

    @abc.abstractmethod
    def allow_fetch(
        self, transfer_id: str, block_ids: Sequence[int] | None, served_from: Sequence[int] | None = None
    ) -> None:
        """Grant (a list) or revoke (None) peers' reads of our blocks for
        ``transfer_id``; reads of anything else are rejected, so a late reader of
        freed (reused) blocks gets an error, never another request's KV. A revoke
        returns once no read of ``transfer_id`` is still sending (a stalled reader
        is disconnected after the transport's ``revoke_wait``).

        ``served_from``: where the granted blocks' bytes are, when not in the registered
        blocks of the same ids (device KV staged in pinned host rows): peers still ask
        for ``block_ids``, the ids they know, and are served ``served_from[i]``."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving, fail every pending future with PeerClosed, free resources."""

    @property
    def refused_connections(self) -> int:
        """Connections refused so far because they did not prove the deployment secret."""
        return 0

    @property
    def broken_connections(self) -> int:
        """Authenticated connections closed so far for breaking the protocol (a bad seal, a
        malformed or oversized frame)."""
        return 0
