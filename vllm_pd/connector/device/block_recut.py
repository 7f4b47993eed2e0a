"""Pushed blocks of prefill's block size re-cut into decode's, on the host (torch, no vLLM).

A head-major block (``H.N.C``, vLLM's LBHNC) holds per head a run of tokens (or, packed for a
kernel, runs of rows of tokens: vLLM CPU attention keeps K transposed, then V -
``kv_geometry.BlockFormat.runs``). Prefill pushes a piece of its blocks (a run of heads,
``kv_geometry.Piece``) as rows of its own block size; decode needs the same heads in blocks of
another size. Per head and row the tokens are contiguous across both, so each run is viewed as
``[heads, rows, tokens, element]``, the token range decode's blocks cover is taken, and cut
again into decode's blocks. Runs on a load's thread, on host
rows (pushes land in host memory), before the one host-to-device copy that places them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def recut_rows(
    rows: Sequence[torch.Tensor],
    heads: int,
    remote_block_size: int,
    local_block_size: int,
    first_token: int,
    num_local: int,
    runs: Sequence[tuple[int, int]],
    alloc: Callable[[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Prefill's rows (consecutive block positions, the first holding token ``first_token``'s
    block's start: ``rows[0]`` is the block at ``first_token // remote_block_size``) as
    ``num_local`` rows of decode's block size starting at token ``first_token``: ``[num_local,
    heads x local_block_size x token bytes]`` bytes (``alloc``: where, e.g. pinned memory). A
    head's bytes are ``runs`` (``kv_geometry.BlockFormat.runs``: (rows, element bytes) each, per
    row the tokens contiguous). Tokens past prefill's rows are zeros (past the prompt, never read)."""
    if not rows:
        raise ValueError("no rows to re-cut")
    k = len(rows)
    token_nbytes = sum(r * e for r, e in runs)
    remote = torch.stack([r.reshape(-1) for r in rows]).view(k, heads, remote_block_size * token_nbytes)
    offset = first_token - (first_token // remote_block_size) * remote_block_size
    want = num_local * local_block_size
    take = max(0, min(want, k * remote_block_size - offset))
    nbytes = num_local * heads * local_block_size * token_nbytes
    flat = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8)
    out = flat.view(num_local, heads, local_block_size * token_nbytes)
    if take < want:
        out.zero_()
    at = 0  # a run's offset per token of a block
    for run_rows, e in runs:
        src = remote[:, :, at * remote_block_size : (at + run_rows * e) * remote_block_size]
        # [heads, rows, tokens of all k blocks, e]: per head and row, the tokens in order
        by_row = (
            src.reshape(k, heads, run_rows, remote_block_size, e)
            .permute(1, 2, 0, 3, 4)
            .reshape(heads, run_rows, k * remote_block_size, e)
        )
        dst = out[:, :, at * local_block_size : (at + run_rows * e) * local_block_size].view(
            num_local, heads, run_rows, local_block_size, e
        )
        for j in range(num_local):  # per decode block: one strided copy of every head's rows' tokens
            lo, hi = j * local_block_size, min((j + 1) * local_block_size, take)
            if hi > lo:
                dst[j, :, :, : hi - lo].copy_(by_row[:, :, offset + lo : offset + hi])
        at += run_rows * e
    return out.view(num_local, -1)
