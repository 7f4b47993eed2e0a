"""kv_geometry: which prefill rank's heads a decode rank takes, and the byte spans that re-cut
blocks of one size into another. Checked against a model of the KV itself: every (head,
token) of a prompt gets a distinct value on prefill's ranks, laid out as vLLM shards and pages
it; decode's blocks assembled from the spans must hold exactly its heads' values, token by token."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from vllm_pd.connector.device.kv_geometry import (
    CPU_VEC_KERNEL,
    BlockFormat,
    Span,
    announced_ranks,
    head_pieces,
    incompatibility,
    kernel_format,
    piece_spans,
    plan_rank,
    rank_heads,
    releasers,
    remote_positions,
    whole_block_reads,
    window_positions,
)
from vllm_pd.protocol.kv_shape import KVGroup, KVShape

C = 4  # elements of one head's token (K and V side by side), int32 in the model below


def shape(
    tp: int,
    kv_heads: int,
    block_size: int,
    kinds: tuple[str, ...] = ("full",),
    window: int = 0,
    layout: str = "HNC",
    kernel: str = "",
) -> KVShape:
    """``kernel`` CPU_VEC_KERNEL: each head packed as vLLM CPU attention packs it (K transposed, V)."""
    heads = len(rank_heads(kv_heads, tp, 0))
    dims = {"H": f"H{heads}", "N": f"N{block_size}", "C": f"C{C}"}
    fmt = "int32:" + ".".join(dims[d] for d in layout if not (d == "H" and heads == 1))
    fmt = kernel_format(fmt, kernel)
    groups = tuple(KVGroup(k, block_size, fmt, window if k == "window" else 0) for k in kinds)
    return KVShape(tp, kv_heads, groups, tuple(range(len(groups))))


def test_block_format_parse() -> None:
    f = BlockFormat.parse("bfloat16:H8.N16.C256")
    assert (f.heads, f.tokens, f.token_nbytes, f.head_nbytes, f.block_nbytes) == (8, 16, 512, 8192, 65536)
    assert f.head_major
    mla = BlockFormat.parse("bfloat16:N64.C576")
    assert mla.heads == 1 and mla.head_major
    assert not BlockFormat.parse("bfloat16:N16.H8.C256").head_major  # token-major (LBNHC)
    assert not BlockFormat.parse("bfloat16:K2.H8.N64.C256").head_major  # kernel blocks
    with pytest.raises(ValueError, match="bad dim"):
        BlockFormat.parse("bfloat16:H.N16")


def test_cpu_attention_packs_k_transposed_then_v() -> None:
    """vLLM CPU attention ("vec" ISA) views a head's [N, 2 x head size] as K^T [head size, N],
    then V [N, head size]: re-cut per row of K and per token of V."""
    f = BlockFormat.parse(kernel_format("bfloat16:H2.N32.C128", CPU_VEC_KERNEL))
    assert (f.heads, f.tokens, f.token_nbytes, f.head_nbytes, f.kernel) == (2, 32, 256, 8192, CPU_VEC_KERNEL)
    assert f.runs == ((64, 2), (1, 128)) and f.head_major
    unknown = BlockFormat.parse("bfloat16:H2.N32.C128@cpu-amx")
    assert unknown.runs is None and not unknown.head_major  # not re-cut by tokens
    vec, plain = shape(1, 8, 32, kernel=CPU_VEC_KERNEL), shape(1, 8, 64)
    assert "kernel" in (incompatibility(vec, plain) or "")
    assert incompatibility(vec, shape(2, 8, 64, kernel=CPU_VEC_KERNEL)) is None


@pytest.mark.parametrize(
    "kv_heads, m, n",
    [
        (8, 1, 2),
        (8, 2, 1),
        (8, 2, 4),
        (8, 4, 2),
        (8, 1, 8),
        (8, 8, 1),
        (2, 1, 4),
        (2, 4, 1),
        (2, 4, 8),
        (1, 1, 2),
        (1, 2, 1),
        (1, 4, 2),
        (4, 2, 8),
    ],
)
def test_each_decode_rank_gets_exactly_its_heads_once(kv_heads: int, m: int, n: int) -> None:
    for d in range(n):
        got = []
        for piece in head_pieces(kv_heads, m, n, d):
            held = rank_heads(kv_heads, m, piece.source)
            for i in range(piece.heads):
                assert piece.src_head + i < len(held)
                got.append(held[piece.src_head + i])
                assert piece.dst_head + i == len(got) - 1  # in our slot order
        assert got == list(rank_heads(kv_heads, n, d)), (d, got)


def test_replicated_latent_is_read_once_per_decode_rank_spread_over_prefill_ranks() -> None:
    # MLA: one head on every rank. P4 -> D2: each decode rank reads it from one prefill rank, not four
    assert [[p.source for p in head_pieces(1, 4, 2, d)] for d in range(2)] == [[0], [1]]
    # P1 -> D2: both from the one prefill rank, P2 -> D1: from rank 0 only
    assert [[p.source for p in head_pieces(1, 1, 2, d)] for d in range(2)] == [[0], [0]]
    assert [p.source for p in head_pieces(1, 2, 1, 0)] == [0]


def test_every_prefill_rank_is_released_after_its_readers() -> None:
    p2, d1 = shape(2, 8, 32), shape(1, 8, 32)
    assert releasers(p2, d1) == {0: (0,), 1: (0,)}  # decode's one rank read from both
    assert releasers(d1, p2) == {0: (0, 1)}  # both decode ranks read prefill's one rank
    mla_p2, mla_d1 = shape(2, 1, 32), shape(1, 1, 32)
    assert releasers(mla_p2, mla_d1) == {0: (0,), 1: (0,)}  # rank 1 held a replica nobody read
    assert releasers(shape(4, 8, 16), shape(4, 8, 16)) == {p: (p,) for p in range(4)}


def test_every_decode_rank_hears_one_announcement() -> None:
    for m, n in itertools.product((1, 2, 4), repeat=2):
        heard = sorted(d for p in range(m) for d in announced_ranks(m, n, p))
        assert heard == list(range(n)), (m, n)


def test_incompatibilities_are_named() -> None:
    assert incompatibility(shape(2, 8, 32), shape(1, 8, 64)) is None
    assert "KV heads" in (incompatibility(shape(1, 8, 32), shape(1, 4, 32)) or "")
    assert "groups differ" in (incompatibility(shape(1, 8, 32, ("window", "full"), 64), shape(1, 8, 32)) or "")
    assert "head-major" in (incompatibility(shape(1, 8, 32, layout="NHC"), shape(2, 8, 32, layout="NHC")) or "")
    # equal shapes move whatever the layout
    assert incompatibility(shape(2, 8, 32, layout="NHC"), shape(2, 8, 32, layout="NHC")) is None
    state = KVShape(1, 8, (KVGroup("state", 1024, "int8:C4096"),), (0,))
    assert incompatibility(state, state) is None
    assert "equal shapes only" in (
        incompatibility(state, KVShape(2, 8, (KVGroup("state", 1024, "int8:C2048"),), (0,))) or ""
    )
    other_dtype = KVShape(1, 8, (KVGroup("full", 32, "float16:H8.N32.C4"),), (0,))
    assert "dtype" in (incompatibility(shape(1, 8, 32), other_dtype) or "")


# ---- the spans, against a model of the KV --------------------------------------------------------
def packed_kv(heads: range, tokens: np.ndarray, kernel: str, num_tokens: int) -> np.ndarray:
    """[blocks, H, N * C] int32 for ``tokens`` [blocks, N]: K = head * 1e6 + token * 10 + d + 1, V
    the same + 5e5 (0 past the prompt), packed as ``kernel`` packs a head (K and V side by side, or
    K^T then V)."""
    h = np.array(list(heads)).reshape(1, -1, 1, 1)
    tok = tokens[:, None, :, None]
    d = np.arange(C // 2).reshape(1, 1, 1, -1)
    k = np.where(tok < num_tokens, h * 1_000_000 + tok * 10 + d + 1, 0)
    v = np.where(tok < num_tokens, k + 500_000, 0)
    nb, nh = tokens.shape[0], len(heads)
    if kernel == CPU_VEC_KERNEL:
        packed = np.concatenate([k.transpose(0, 1, 3, 2).reshape(nb, nh, -1), v.reshape(nb, nh, -1)], axis=2)
    else:
        packed = np.concatenate([k, v], axis=3).reshape(nb, nh, -1)
    return packed.astype(np.int32)


def prefill_blocks(s: KVShape, rank: int, num_tokens: int) -> np.ndarray:
    """[blocks, H, N * C] int32 of one prefill rank (packed_kv)."""
    n = s.groups[0].block_size
    nblocks = -(-num_tokens // n)
    tokens = np.arange(nblocks * n).reshape(nblocks, n)
    return packed_kv(
        rank_heads(s.kv_heads, s.tp_size, rank), tokens, BlockFormat.parse(s.groups[0].block_format).kernel, num_tokens
    )


@pytest.mark.parametrize(
    "m, n, nr, nl, first",
    [
        (1, 1, 32, 64, 0),
        (1, 1, 64, 32, 0),
        (1, 1, 16, 64, 0),
        (1, 1, 64, 16, 3),  # block sizes only
        (1, 2, 32, 32, 0),
        (2, 1, 32, 32, 0),
        (2, 4, 32, 32, 1),  # TP only
        (1, 2, 32, 64, 0),
        (2, 1, 64, 32, 2),
        (4, 2, 16, 64, 1),  # both
    ],
)
@pytest.mark.parametrize("kv_heads", [8, 2, 1])
@pytest.mark.parametrize("kernel", ["", CPU_VEC_KERNEL])
def test_spans_assemble_decodes_blocks_from_prefills(
    m: int, n: int, nr: int, nl: int, first: int, kv_heads: int, kernel: str
) -> None:
    num_tokens = 300
    remote, local = shape(m, kv_heads, nr, kernel=kernel), shape(n, kv_heads, nl, kernel=kernel)
    blocks = [prefill_blocks(remote, p, num_tokens) for p in range(m)]
    nlocal = -(-num_tokens // nl) - first
    for d in range(n):
        plan = plan_rank(remote, local, d)
        heads = rank_heads(kv_heads, n, d)
        ours = np.zeros((nlocal, len(heads) * nl * C), dtype=np.int32).view(np.uint8)
        moved = 0
        for piece in plan.groups[0].pieces:
            src = blocks[piece.source].reshape(len(blocks[piece.source]), -1).view(np.uint8)
            for sp in piece_spans(plan.groups[0], piece, first, nlocal, num_tokens):
                ours[sp.dst_index, sp.dst_offset : sp.dst_offset + sp.nbytes] = src[
                    sp.src_index, sp.src_offset : sp.src_offset + sp.nbytes
                ]
                moved += sp.nbytes
        got = ours.view(np.int32).reshape(nlocal, len(heads), -1)
        tokens = np.arange(first * nl, (first + nlocal) * nl).reshape(nlocal, nl)
        want = packed_kv(heads, tokens, kernel, num_tokens)
        valid = np.broadcast_to(packed_kv(range(1), tokens, kernel, num_tokens) != 0, got.shape)  # the prompt's
        assert np.array_equal(got[valid], want[valid]), (d, plan)
        # exactly our heads' bytes of the tokens we load, no more (prefill's partial last block included)
        per_token = len(heads) * C * 4
        loaded = min(-(-num_tokens // nr) * nr, (first + nlocal) * nl) - first * nl
        assert moved == loaded * per_token


def test_equal_block_sizes_move_one_span_per_block() -> None:
    plan = plan_rank(shape(1, 8, 32), shape(2, 8, 32), 1)
    [piece] = plan.groups[0].pieces
    spans = piece_spans(plan.groups[0], piece, 0, 4, 128)
    assert len(spans) == 4 and all(s.src_index == s.dst_index for s in spans)
    assert {(s.src_offset, s.nbytes) for s in spans} == {(4 * 32 * C * 4, 4 * 32 * C * 4)}  # heads 4..7


def test_remote_positions_and_windows() -> None:
    plan = plan_rank(shape(1, 8, 32), shape(1, 8, 64), 0)
    assert remote_positions(plan.groups[0], 1, 2, 300) == range(2, 6)  # tokens 64..191
    assert remote_positions(plan.groups[0], 4, 1, 300) == range(8, 10)  # tokens 256..299: prefill's 8, 9
    # a sliding window's reads start ``window`` tokens before the prompt's last (300 tokens, window
    # 128, blocks of 32 -> tokens 172.. -> blocks 5..9, the ones vLLM 0.32 CPU kept in a probe)
    assert window_positions(KVGroup("window", 32, "x:C1", 128), 300) == 5
    assert window_positions(KVGroup("window", 32, "x:C1", 32), 64) == 1
    assert window_positions(KVGroup("window", 32, "x:C1", 128), 100) == 0
    assert window_positions(KVGroup("full", 32, "x:C1"), 300) == 0
    # a recurrent state: the block of the last token only
    assert window_positions(KVGroup("state", 32, "x:C1"), 300) == 9
    assert window_positions(KVGroup("state", 32, "x:C1"), 288) == 8
    assert window_positions(KVGroup("state", 4096, "x:C1"), 300) == 0


@pytest.mark.parametrize("nr, nl, first_block", [(32, 64, 0), (64, 32, 0), (64, 32, 3), (16, 64, 1)])
@pytest.mark.parametrize("kernel", ["", CPU_VEC_KERNEL])
def test_pushed_rows_are_recut_into_decodes_blocks(nr: int, nl: int, first_block: int, kernel: str) -> None:
    """block_recut, what a push of another block size goes through on decode's host: prefill's
    rows (its block size) become decode's rows of the same heads and tokens."""
    import torch

    from vllm_pd.connector.device.block_recut import recut_rows

    num_tokens, heads = 300, 2
    remote = shape(1, heads, nr, kernel=kernel)
    blocks = prefill_blocks(remote, 0, num_tokens)
    first_token = first_block * nl
    num_local = -(-num_tokens // nl) - first_block
    rows = [torch.from_numpy(b.reshape(-1).view(np.uint8).copy()) for b in blocks[first_token // nr :]]
    runs = BlockFormat.parse(remote.groups[0].block_format).runs
    assert runs is not None
    out = recut_rows(rows, heads, nr, nl, first_token, num_local, runs)
    got = out.numpy().view(np.int32).reshape(num_local, heads, -1)
    tokens = np.arange(first_token, first_token + num_local * nl).reshape(num_local, nl)
    valid = np.broadcast_to(packed_kv(range(1), tokens, kernel, num_tokens) != 0, got.shape)
    assert np.array_equal(got[valid], packed_kv(range(heads), tokens, kernel, num_tokens)[valid])


@pytest.mark.parametrize(
    "nr, nl, first, num_tokens",
    [
        (32, 64, 0, 300),  # prefill's last block partial, ours too
        (32, 64, 2, 300),  # decode's own prefix-cache hit: our first position > 0
        (16, 64, 1, 256),
        (64, 32, 0, 300),  # one prefill block feeds two of ours
        (64, 32, 0, 270),  # prefill's last block straddles our last: that one by spans
        (64, 32, 3, 300),  # prefill's block straddles our first: that one by spans
        (64, 32, 3, 270),
        (64, 16, 1, 300),
        (64, 32, 9, 300),  # our one block inside prefill's: spans only
    ],
)
@pytest.mark.parametrize("kernel", ["", CPU_VEC_KERNEL])
def test_whole_block_reads_recut_to_what_the_spans_assemble(
    nr: int, nl: int, first: int, num_tokens: int, kernel: str
) -> None:
    """Prefill's whole blocks, landed back to back in our blocks as ``whole_block_reads`` says and
    re-cut there (``block_recut``), give decode's blocks byte for byte as the spans per head and row
    (``piece_spans``) do - the rest of our blocks by those spans - and read each prefill block once."""
    import torch

    from vllm_pd.connector.device.block_recut import recut_rows

    heads = 2
    remote, local = shape(1, heads, nr, kernel=kernel), shape(1, heads, nl, kernel=kernel)
    plan = plan_rank(remote, local, 0).groups[0]
    [piece] = plan.pieces
    src = prefill_blocks(remote, 0, num_tokens).reshape(-1 if num_tokens else 0, heads * nr * C).view(np.uint8)
    nlocal = -(-num_tokens // nl) - first
    lb = heads * nl * C * 4

    def assemble(spans: list, into: np.ndarray) -> None:
        for sp in spans:
            into[sp.dst_index, sp.dst_offset : sp.dst_offset + sp.nbytes] = src[
                sp.src_index, sp.src_offset : sp.src_offset + sp.nbytes
            ]

    by_spans = np.zeros((nlocal, lb), dtype=np.uint8)
    assemble(piece_spans(plan, piece, first, nlocal, num_tokens), by_spans)
    reads = whole_block_reads(plan, piece, first, nlocal, num_tokens)
    if first * nl % nr and nlocal == 1:  # our one block inside prefill's: nothing to read whole
        assert reads is None
        return
    assert reads is not None
    assert reads.remote == remote_positions(plan, reads.local.start, len(reads.local), num_tokens)
    assert [sp.src_index for sp in reads.spans if sp.src_offset == 0] == list(reads.remote)  # each read whole, once
    landed = np.full((nlocal, lb), 0xA5, dtype=np.uint8)  # landing rows hold garbage before the read
    assemble(list(reads.spans), landed)
    ours = np.zeros((nlocal, lb), dtype=np.uint8)
    for j in range(nlocal):
        if first + j not in reads.local:
            spans = piece_spans(plan, piece, first + j, 1, num_tokens)
            assemble([Span(s.src_index, s.src_offset, j, s.dst_offset, s.nbytes) for s in spans], ours)
    a, b = reads.local.start - first, reads.local.stop - first
    stream = torch.from_numpy(landed[a:b].reshape(-1)[: len(reads.remote) * heads * nr * C * 4].copy())
    runs = plan.remote_format.runs
    assert runs is not None
    recut = recut_rows(list(stream.view(len(reads.remote), -1)), heads, nr, nl, reads.local.start * nl, b - a, runs)
    ours[a:b] = recut.numpy()
    assert np.array_equal(ours, by_spans)
    ours[a, 7] ^= 1  # negative control: one byte of the re-cut off
    assert not np.array_equal(ours, by_spans)


def test_whole_block_reads_only_for_another_block_size_of_every_head() -> None:
    same_size = plan_rank(shape(1, 8, 32), shape(1, 8, 32), 0)
    assert whole_block_reads(same_size.groups[0], same_size.groups[0].pieces[0], 0, 4, 128) is None
    other_tp = plan_rank(shape(1, 8, 32), shape(2, 8, 64), 1)  # heads 4..7 of prefill's 8: a piece of its blocks
    [piece] = other_tp.groups[0].pieces
    assert whole_block_reads(other_tp.groups[0], piece, 0, 2, 128) is None
    sizes = plan_rank(shape(1, 8, 32), shape(1, 8, 64), 0)
    reads = whole_block_reads(sizes.groups[0], sizes.groups[0].pieces[0], 0, 2, 128)
    assert reads is not None and len(reads.spans) == 4  # four prefill blocks, each one span
