"""What a KV cache looks like across tensor-parallel ranks, and how a decode rank takes its
share from prefill ranks of another shape. Pure Python: no torch, no vLLM.

A :class:`KVShape` describes one instance: its TP size, the model's KV heads, and its KV
cache groups (vLLM's hybrid manager keeps one per kind of layer: full attention, a sliding
window, a recurrent state), each with its block size and the format of one rank's block
(``kv_layout.block_format``). Both sides of a transfer exchange theirs (``protocol/kv_shape.py``).

How heads are sharded is vLLM's rule: with TP ``t`` over ``K`` KV heads, rank ``r`` holds
heads ``[r*K/t, (r+1)*K/t)`` when ``t <= K``, else the one head ``r*K // t`` (replicated on
``t/K`` ranks). MLA's latent is one head on every rank (``K = 1``). So decode rank ``d``
needs some heads, each held by one or more prefill ranks; :func:`plan_rank` picks one source
per head (spreading replicas over decode ranks, so a replicated latent is read once per
decode rank, never once per prefill rank) and cuts the heads into :class:`Piece`\\s - runs of
heads from one source, which in a head-major block (``H.N.C``, vLLM's LBHNC) are one
contiguous byte range of the source's block and of ours.

Block sizes may differ too: a token range maps across block boundaries, and per head a
token range is contiguous (``H.N.C``; per row of K and of V where a kernel packs them apart, as
vLLM CPU attention does: :func:`kernel_format`), so decode's block is assembled from spans of
prefill's blocks (:func:`piece_spans` for reads; pushes are re-cut on decode's host,
``block_recut``, and so are reads where only block sizes differ, :func:`whole_block_reads`).
A recurrent state group moves its one state block: whole between equal shapes, else as byte
windows of prefill ranks' state blocks (``state_geometry``: the state's own sharding, which its
group tells, ``KVGroup.state``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_pd.connector.device.state_geometry import StateWindow, state_incompatibility, state_nbytes, state_windows
from vllm_pd.connector.device.tp_shards import holders, rank_heads, shardable
from vllm_pd.errors import ConfigError, ProtocolError
from vllm_pd.protocol.kv_shape import KVGroup, KVShape

# bytes per element of the dtypes vLLM keeps KV in (block_format names them as torch does)
_ITEMSIZE = {
    "bfloat16": 2,
    "float16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
}


@dataclass(frozen=True)
class BlockFormat:
    """A parsed ``kv_layout.block_format``: dtype, and the block's dims outermost first."""

    dtype: str
    dims: tuple[tuple[str, int], ...]
    kernel: str = ""  # how an attention kernel packs a head's tokens ("": as the dims say)

    @classmethod
    def parse(cls, text: str) -> BlockFormat:
        text_dims, _, kernel = text.partition("@")
        dtype, _, rest = text_dims.partition(":")
        dims = []
        for part in rest.split(".") if rest else ():
            name = part.rstrip("0123456789")
            if not name or name == part:
                raise ConfigError(f"block format {text!r}: bad dim {part!r}")
            dims.append((name, int(part[len(name) :])))
        return cls(dtype, tuple(dims), kernel)

    def size(self, name: str) -> int:
        return next((n for d, n in self.dims if d == name), 1)

    @property
    def heads(self) -> int:
        return self.size("H")

    @property
    def tokens(self) -> int:
        return self.size("N")

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE.get(self.dtype, 0)

    @property
    def token_nbytes(self) -> int:
        """One head's bytes of one token (K and V together)."""
        return self.size("C") * self.itemsize

    @property
    def head_nbytes(self) -> int:
        """One head's bytes of a block (its tokens)."""
        return self.tokens * self.token_nbytes

    @property
    def block_nbytes(self) -> int:
        return self.heads * self.head_nbytes

    @property
    def runs(self) -> tuple[tuple[int, int], ...] | None:
        """A head's bytes as runs in memory order, each ``(rows, element bytes)``: ``rows`` rows of
        the block's tokens, a token's element of a row ``element bytes`` wide; per row a token range
        is one byte range. None: a kernel's packing we do not know (not re-cut by tokens)."""
        if not self.kernel:
            return ((1, self.token_nbytes),)
        if self.kernel == CPU_VEC_KERNEL and self.size("C") % 2 == 0:
            # vLLM CPU attention ("vec" ISA) views a head's [N, 2 x head size] as [2N, head size]:
            # K transposed ([head size, N], token innermost), then V ([N, head size])
            head_size = self.size("C") // 2
            return ((head_size, self.itemsize), (1, head_size * self.itemsize))
        return None

    @property
    def head_major(self) -> bool:
        """Heads outermost, then tokens, then content, nothing else (vLLM's LBHNC; one-head
        formats like MLA's), packed as :attr:`runs` says: a run of heads is one byte range, and per
        head (and row of a run) a run of tokens."""
        names = [d for d, _ in self.dims]
        return self.itemsize > 0 and self.runs is not None and names in (["H", "N", "C"], ["N", "C"], ["H", "C"], ["C"])


# vLLM CPU attention's "vec" ISA (x86 without AMX, blocks of 32k tokens): kernel_format's tag
CPU_VEC_KERNEL = "cpu-vec"


def kernel_format(block_format: str, kernel: str) -> str:
    """``block_format`` as an attention kernel packs a head's tokens (``kernel`` "" : as is), e.g.
    ``bfloat16:H2.N32.C128@cpu-vec``. Formats of other kernels never match: blocks are re-cut
    only between packings :attr:`BlockFormat.runs` knows."""
    return f"{block_format}@{kernel}" if kernel else block_format


@dataclass(frozen=True)
class Piece:
    """A run of heads decode rank takes from one prefill rank: ``heads`` heads starting at
    head slot ``src_head`` of the source's block and ``dst_head`` of ours."""

    source: int  # prefill TP rank
    src_head: int
    dst_head: int
    heads: int

    def src_window(self, fmt: BlockFormat) -> tuple[int, int]:
        """(offset, nbytes) of this piece in a block of the source's head-major ``fmt``."""
        return self.src_head * fmt.head_nbytes, self.heads * fmt.head_nbytes

    def dst_window(self, fmt: BlockFormat) -> tuple[int, int]:
        """(offset, nbytes) of this piece in a block of our head-major ``fmt``."""
        return self.dst_head * fmt.head_nbytes, self.heads * fmt.head_nbytes


def head_pieces(kv_heads: int, remote_tp: int, local_tp: int, rank: int) -> list[Piece]:
    """The pieces decode rank ``rank`` of ``local_tp`` takes from prefill ranks of ``remote_tp``.
    Each head from one prefill rank: of the ranks holding it, the ``rank``-th in turn (a
    replicated head's readers spread over its holders)."""
    mine = rank_heads(kv_heads, local_tp, rank)
    pieces: list[Piece] = []
    for h in mine:
        have = holders(kv_heads, remote_tp, h)
        source = have[rank % len(have)]
        src_head = h - rank_heads(kv_heads, remote_tp, source).start
        dst_head = h - mine.start
        last = pieces[-1] if pieces else None
        if last is not None and last.source == source and last.src_head + last.heads == src_head:
            pieces[-1] = Piece(source, last.src_head, last.dst_head, last.heads + 1)
        else:
            pieces.append(Piece(source, src_head, dst_head, 1))
    return pieces


@dataclass(frozen=True)
class GroupPlan:
    """How one KV cache group's blocks of decode rank ``rank`` come from prefill's: pieces (runs of
    heads), or a recurrent state's byte windows (``windows``, no pieces)."""

    remote: KVGroup
    local: KVGroup
    pieces: tuple[Piece, ...]
    windows: tuple[StateWindow, ...] = ()

    @property
    def sources(self) -> tuple[int, ...]:
        """The prefill ranks this group reads from, in order of first use."""
        return tuple(dict.fromkeys([p.source for p in self.pieces] + [w.source for w in self.windows]))

    @property
    def remote_format(self) -> BlockFormat:
        return BlockFormat.parse(self.remote.block_format)

    @property
    def local_format(self) -> BlockFormat:
        return BlockFormat.parse(self.local.block_format)

    @property
    def identity(self) -> bool:
        """Whole blocks of one prefill rank become whole blocks here, one for one."""
        return (
            len(self.pieces) == 1
            and self.remote.block_size == self.local.block_size
            and self.remote.block_format == self.local.block_format
            and self.pieces[0].src_head == 0
            and self.pieces[0].dst_head == 0
        )


@dataclass(frozen=True)
class RankPlan:
    """Everything decode rank ``rank`` takes from a prefill instance."""

    rank: int
    groups: tuple[GroupPlan, ...]

    @property
    def sources(self) -> tuple[int, ...]:
        """The prefill ranks this rank reads from."""
        return tuple(sorted({s for g in self.groups for s in g.sources}))

    @property
    def identity(self) -> bool:
        """Prefill rank ``rank``'s blocks are ours, byte for byte (the equal-shape case)."""
        return all(g.identity for g in self.groups) and self.sources == (self.rank,)

    def staging_key(self, transfer_id: str, source: int) -> str:
        """What pushes of ``source``'s pieces land under here: the transfer id where one prefill
        rank feeds us, else one key per source (each pushing peer stages apart)."""
        return transfer_id if len(self.sources) == 1 else f"{transfer_id}{SOURCE_MARK}{source}"


# a staging key of one prefill rank's pieces of a transfer: "<transfer id>#src<rank>"
SOURCE_MARK = "#src"


def transfer_of_key(key: str) -> str:
    """The transfer a staging key (:meth:`RankPlan.staging_key`) belongs to."""
    head, mark, rank = key.rpartition(SOURCE_MARK)
    return head if mark and rank.isdigit() else key


def incompatibility(remote: KVShape, local: KVShape) -> str | None:
    """Why decode (``local``) cannot take prefill's (``remote``) KV, or None if it can."""
    if remote.kv_heads != local.kv_heads:
        return f"prefill's model has {remote.kv_heads} KV heads, ours {local.kv_heads}"
    if not (shardable(remote.kv_heads, remote.tp_size) and shardable(local.kv_heads, local.tp_size)):
        return f"{remote.kv_heads} KV heads do not shard over prefill TP {remote.tp_size} and decode TP {local.tp_size}"
    if remote.layer_groups != local.layer_groups or len(remote.groups) != len(local.groups):
        return (
            f"KV cache groups differ: prefill's {len(remote.groups)} over its layers, ours "
            f"{len(local.groups)} (is the hybrid KV cache manager on for one side only?)"
        )
    same_tp = remote.tp_size == local.tp_size
    for i, (r, lo) in enumerate(zip(remote.groups, local.groups, strict=True)):
        why = _group_incompatibility(r, lo, same_tp, remote, local)
        if why is not None:
            return f"KV cache group {i} ({lo.kind}): {why}"
    return None


def _group_incompatibility(r: KVGroup, lo: KVGroup, same_tp: bool, remote: KVShape, local: KVShape) -> str | None:
    if r.kind != lo.kind or r.window != lo.window:
        return f"prefill's is {r.kind} (window {r.window}), ours {lo.kind} (window {lo.window})"
    try:
        rf, lf = BlockFormat.parse(r.block_format), BlockFormat.parse(lo.block_format)
    except ValueError as e:
        return str(e)
    if r.kind == "state" and r.state is not None and lo.state is not None and r.state != lo.state:
        # blocks of equal size may hold another state layout (vLLM's conv state "SD" or "DS"): never moved whole
        return state_incompatibility(r.state, lo.state, remote.tp_size, local.tp_size)
    if r.block_format == lo.block_format and r.block_size == lo.block_size and same_tp:
        return None  # the equal shape: whole blocks, one for one
    if r.kind == "state":
        return _state_group_incompatibility(r, lo, rf, lf, remote.tp_size, local.tp_size)
    if rf.dtype != lf.dtype or rf.token_nbytes != lf.token_nbytes:
        return f"prefill's blocks are {r.block_format}, ours {lo.block_format} (another dtype or head size)"
    if rf.kernel != lf.kernel:
        return (
            f"prefill's blocks are packed for attention kernel {rf.kernel or '(plain)'}, ours for "
            f"{lf.kernel or '(plain)'}: not re-cut"
        )
    if not (rf.head_major and lf.head_major):
        return (
            f"blocks laid out as {r.block_format} (prefill) and {lo.block_format} (ours): only head-major "
            "blocks (LBHNC) are re-cut across TP or block sizes"
        )
    if rf.tokens != r.block_size or lf.tokens != lo.block_size:
        return f"a block of {r.block_size} / {lo.block_size} tokens is split into kernel blocks"
    if rf.heads != len(rank_heads(remote.kv_heads, remote.tp_size, 0)) or lf.heads != len(
        rank_heads(local.kv_heads, local.tp_size, 0)
    ):
        return f"blocks of {rf.heads} (prefill) / {lf.heads} (ours) heads do not shard {local.kv_heads} KV heads"
    return None


def _state_group_incompatibility(
    r: KVGroup, lo: KVGroup, rf: BlockFormat, lf: BlockFormat, remote_tp: int, local_tp: int
) -> str | None:
    """Why a recurrent state group of another shape cannot be cut into ours, or None."""
    why = state_incompatibility(r.state, lo.state, remote_tp, local_tp)
    if why is not None:
        return f"{why}: prefill TP {remote_tp}, {r.block_format}; ours TP {local_tp}, {lo.block_format}"
    assert r.state is not None
    sizes = (state_nbytes(r.state, remote_tp), state_nbytes(r.state, local_tp))
    if sizes != (rf.block_nbytes, lf.block_nbytes) or not (rf.itemsize and lf.itemsize):
        return (
            f"its shard layout gives state blocks of {sizes[0]} (prefill) / {sizes[1]} (ours) bytes, "
            f"the blocks are {r.block_format} / {lo.block_format}"
        )
    return None


def plan_rank(remote: KVShape, local: KVShape, rank: int) -> RankPlan:
    """What decode rank ``rank`` takes from prefill; ValueError where :func:`incompatibility` says."""
    why = incompatibility(remote, local)
    if why is not None:
        raise ProtocolError(why)
    heads = head_pieces(local.kv_heads, remote.tp_size, local.tp_size, rank)
    groups = []
    for r, lo in zip(remote.groups, local.groups, strict=True):
        same_tp = remote.tp_size == local.tp_size
        if r.block_format == lo.block_format and same_tp and (r.kind != "state" or r.block_size == lo.block_size):
            # equal shapes: our rank's whole blocks are its namesake's (also for replicated heads)
            fmt = BlockFormat.parse(lo.block_format)
            groups.append(GroupPlan(r, lo, (Piece(rank, 0, 0, fmt.heads),)))
        elif r.kind == "state":
            assert lo.state is not None  # incompatibility said so
            groups.append(GroupPlan(r, lo, (), state_windows(lo.state, remote.tp_size, local.tp_size, rank)))
        else:
            groups.append(GroupPlan(r, lo, tuple(heads)))
    return RankPlan(rank, tuple(groups))


def releasers(remote: KVShape, local: KVShape) -> dict[int, tuple[int, ...]]:
    """For each prefill rank, the decode ranks that release it: those that read from it, or
    (a rank nobody reads, e.g. a replica) decode rank ``p % n``. Every prefill rank that held a
    share is released, and only after every decode rank reading it is done with it."""
    readers: dict[int, list[int]] = {p: [] for p in range(remote.tp_size)}
    for d in range(local.tp_size):
        for p in plan_rank(remote, local, d).sources:
            readers[p].append(d)
    return {p: tuple(ds) if ds else (p % local.tp_size,) for p, ds in readers.items()}


def announced_ranks(remote_tp: int, local_tp: int, rank: int) -> range:
    """The decode ranks prefill rank ``rank`` announces a transfer to: every decode rank hears
    from exactly one prefill rank (``d % remote_tp``)."""
    return range(rank, local_tp, remote_tp) if rank < local_tp or remote_tp <= local_tp else range(0)


@dataclass(frozen=True)
class Span:
    """Bytes ``[src_offset, src_offset + nbytes)`` of prefill's block ``src_index`` (into the
    transfer's remote block ids) land at ``dst_offset`` of our block ``dst_index``."""

    src_index: int
    src_offset: int
    dst_index: int
    dst_offset: int
    nbytes: int


def piece_spans(plan: GroupPlan, piece: Piece, first_position: int, num_positions: int, num_tokens: int) -> list[Span]:
    """The spans that carry ``piece`` of our blocks at positions ``[first_position,
    first_position + num_positions)`` (``dst_index`` counts from ``first_position``) from prefill's
    blocks (``src_index``: prefill's block position), for a prompt of ``num_tokens`` tokens. Per
    head a token range is one span; spans that continue each other on both sides merge (equal
    block sizes: a piece is one span per block)."""
    rf, lf = plan.remote_format, plan.local_format
    nr, nl = plan.remote.block_size, plan.local.block_size
    runs = _rows_of_runs(rf)
    end = min(-(-num_tokens // nr) * nr, (first_position + num_positions) * nl)
    spans: list[Span] = []
    for j in range(first_position, first_position + num_positions):
        lo_tok, hi_tok = j * nl, min((j + 1) * nl, end)
        for k in range(lo_tok // nr, -(-hi_tok // nr)) if hi_tok > lo_tok else ():
            a, b = max(lo_tok, k * nr), min(hi_tok, (k + 1) * nr)
            for i, (run_offset, row, e) in itertools.product(range(piece.heads), runs):
                src = (piece.src_head + i) * rf.head_nbytes + run_offset * nr + row * nr * e + (a - k * nr) * e
                dst = (piece.dst_head + i) * lf.head_nbytes + run_offset * nl + row * nl * e + (a - j * nl) * e
                n = (b - a) * e
                last = spans[-1] if spans else None
                if (
                    last is not None
                    and last.src_index == k
                    and last.dst_index == j - first_position
                    and last.src_offset + last.nbytes == src
                    and last.dst_offset + last.nbytes == dst
                ):
                    spans[-1] = Span(k, last.src_offset, last.dst_index, last.dst_offset, last.nbytes + n)
                else:
                    spans.append(Span(k, src, j - first_position, dst, n))
    return spans


@dataclass(frozen=True)
class WholeBlockReads:
    """Prefill's whole blocks at positions ``remote`` read back to back, as one byte stream, into our
    blocks at positions ``local`` (``spans``: ``dst_index`` counts from the read's first position),
    then re-cut there (``block_recut``) - instead of a span per head and row of every block."""

    local: range
    remote: range
    spans: tuple[Span, ...]


def whole_block_reads(
    plan: GroupPlan, piece: Piece, first_position: int, num_positions: int, num_tokens: int
) -> WholeBlockReads | None:
    """How our positions ``[first_position, first_position + num_positions)`` take ``piece`` from
    prefill's whole blocks, or None where they cannot: only block sizes differ (the piece is every
    head of both sides' blocks, the packing is known), and our positions hold the whole blocks
    that cover them. The re-cut positions start where a block of each side starts and end where
    they both end or prefill's blocks do (the prompt's end); the rest (at most a block at either
    end, where prefill's block is larger than ours and straddles our first or last) is left to
    :func:`piece_spans`."""
    rf, lf = plan.remote_format, plan.local_format
    nr, nl = plan.remote.block_size, plan.local.block_size
    if (
        nr == nl
        or rf.runs is None
        or not (piece.heads == rf.heads == lf.heads and piece.src_head == 0 and piece.dst_head == 0)
        or rf.runs != lf.runs
    ):
        return None
    stop = first_position + num_positions
    remote_end = -(-num_tokens // nr) * nr  # prefill's blocks end here
    start = next((j for j in range(first_position, stop) if j * nl % nr == 0), stop)
    end = next((j for j in range(stop, start, -1) if j * nl % nr == 0 or j * nl >= remote_end), start)
    remote = remote_positions(plan, start, end - start, num_tokens)
    if not remote:
        return None
    rb, lb = rf.block_nbytes, lf.block_nbytes
    spans = []
    for t, k in enumerate(remote):
        at, stream_end = t * rb, (t + 1) * rb
        while at < stream_end:  # cut where our blocks end
            n = min(stream_end, (at // lb + 1) * lb) - at
            spans.append(Span(k, at - t * rb, start - first_position + at // lb, at % lb, n))
            at += n
    return WholeBlockReads(range(start, end), remote, tuple(spans))


def _rows_of_runs(fmt: BlockFormat) -> list[tuple[int, int, int]]:
    """Every row of a head's runs: (its run's offset per token of the block, the row in the run,
    element bytes)."""
    out, offset = [], 0
    for rows, e in fmt.runs or ((1, fmt.token_nbytes),):
        out += [(offset, row, e) for row in range(rows)]
        offset += rows * e
    return out


def remote_positions(plan: GroupPlan, first_position: int, num_positions: int, num_tokens: int) -> range:
    """Prefill's block positions whose tokens land in our positions ``[first_position,
    first_position + num_positions)``."""
    nr, nl = plan.remote.block_size, plan.local.block_size
    end = min(-(-num_tokens // nr) * nr, (first_position + num_positions) * nl)
    start = first_position * nl
    return range(start // nr, -(-end // nr)) if end > start else range(0)


def window_positions(group: KVGroup, num_tokens: int) -> int:
    """First block position of a group whose KV decode reads after a prompt of ``num_tokens``:
    a sliding window's first token, ``window`` before the last prompt token (which decode may
    compute again); a recurrent state's last block, which holds the state after the last token
    (vLLM keeps the running state in the block of the last computed token and nulls the ones
    before); full attention: 0. vLLM frees a window's blocks behind the computed tokens less
    ``window - 1`` while the prompt computes, so these blocks are never freed before its end."""
    if group.kind == "state":
        return max(0, -(-num_tokens // group.block_size) - 1)
    if group.kind != "window" or not group.window:
        return 0
    return max(0, num_tokens - group.window) // group.block_size


def same_shape(remote: KVShape | None, local: KVShape | None) -> bool:
    return remote is not None and local is not None and remote == local


def group_positions(groups: Sequence[KVGroup], num_tokens: int) -> list[range]:
    """Per group, the block positions of a prompt of ``num_tokens`` that hold KV to move."""
    return [range(window_positions(g, num_tokens), -(-num_tokens // g.block_size)) for g in groups]
