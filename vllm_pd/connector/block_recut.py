"""Pushed blocks of prefill's block size re-cut into decode's, on the host (torch, no vLLM).

A head-major block (``H.N.C``, vLLM's LBHNC) holds per head a run of tokens. Prefill pushes
a piece of its blocks (a run of heads, ``kv_geometry.Piece``) as rows of its own block size;
decode needs the same heads in blocks of another size. Per head the tokens are contiguous
across both, so the rows are viewed as ``[heads, tokens, C]``, the token range decode's
blocks cover is taken, and cut again into decode's blocks. Runs on a load's thread, on host
rows (pushes land in host memory), before the one host-to-device copy that places them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def recut_rows(rows: Sequence[torch.Tensor], heads: int, remote_block_size: int, local_block_size: int,
               first_token: int, num_local: int, token_nbytes: int,
               alloc: Callable[[int], torch.Tensor] | None = None) -> torch.Tensor:
    """Prefill's rows (consecutive block positions, the first holding token ``first_token``'s
    block's start: ``rows[0]`` is the block at ``first_token // remote_block_size``) as
    ``num_local`` rows of decode's block size starting at token ``first_token``: ``[num_local,
    heads * local_block_size * token_nbytes]`` bytes (``alloc``: where, e.g. pinned memory).
    Tokens past prefill's rows are zeros (past the prompt, never read)."""
    if not rows:
        raise ValueError("no rows to re-cut")
    k = len(rows)
    remote = torch.stack([r.reshape(-1) for r in rows]).view(k, heads, remote_block_size, token_nbytes)
    by_head = remote.permute(1, 0, 2, 3).reshape(heads, k * remote_block_size, token_nbytes)
    offset = first_token - (first_token // remote_block_size) * remote_block_size
    want = num_local * local_block_size
    take = max(0, min(want, k * remote_block_size - offset))
    nbytes = num_local * heads * local_block_size * token_nbytes
    flat = alloc(nbytes) if alloc is not None else torch.empty(nbytes, dtype=torch.uint8)
    out = flat.view(num_local, heads, local_block_size, token_nbytes)
    tokens = out.permute(1, 0, 2, 3)  # [heads, num_local, N, C]: a view of out
    if take < want:
        out.zero_()
    for j in range(num_local):  # per decode block: one strided copy of every head's tokens
        lo, hi = j * local_block_size, min((j + 1) * local_block_size, take)
        if hi > lo:
            tokens[:, j, :hi - lo].copy_(by_head[:, offset + lo:offset + hi])
    return out.view(num_local, -1)
