"""Pure-PyTorch references for the vllm_pd ops: the test oracle and the last-resort backend.

They follow the upstream test references: FlashMLA's ``reference_torch`` (dense decode) and
DeepGEMM's ``per_token_cast_to_fp8`` / ``per_block_cast_to_fp8`` / ``calc_diff``.
"""

from __future__ import annotations

import math

import torch

FP8_BLOCK = 128  # DeepGEMM's scaling granularity: 1x128 activations, 128x128 weights


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max  # e4m3fn 448, e4m3fnuz 240


def mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged MQA decode. q [b, s_q, h_q, d], k_cache [nb, bs, h_kv, d] -> out, lse [b, h_q, s_q].

    A query row that can attend to no key gets out = 0 and lse = +inf (FlashMLA's convention).
    """
    b, s_q, h_q, d = q.shape
    block_size, h_kv = k_cache.shape[1], k_cache.shape[2]
    out = torch.zeros(b, s_q, h_q, head_dim_v, dtype=q.dtype, device=q.device)
    lse = torch.full((b, h_q, s_q), math.inf, dtype=torch.float32, device=q.device)
    group = h_q // h_kv  # query head j reads KV head j // group
    lens = cache_seqlens.tolist()
    for i in range(b):
        seq_len = int(lens[i])
        if seq_len == 0:
            continue
        n_blocks = (seq_len + block_size - 1) // block_size
        kv = k_cache[block_table[i, :n_blocks].long()].reshape(-1, h_kv, d)[:seq_len].float()  # [L, h_kv, d]
        qi = q[i].float().reshape(s_q, h_kv, group, d)
        # [h_kv, group, s_q, L]: each KV head is read once, not copied for every query head
        scores = torch.einsum("skgd,lkd->kgsl", qi, kv) * softmax_scale
        if causal and s_q > 1:
            # query j sees keys 0 .. L - s_q + j (the queries are the last s_q tokens)
            keep = torch.ones(s_q, seq_len, dtype=torch.bool, device=q.device).tril(seq_len - s_q)
            scores = scores.masked_fill(~keep, -math.inf)
        row_lse = torch.logsumexp(scores, dim=-1)  # [h_kv, group, s_q]
        probs = torch.exp(scores - row_lse.unsqueeze(-1)).nan_to_num(0.0)
        o = torch.einsum("kgsl,lkd->skgd", probs, kv[..., :head_dim_v]).reshape(s_q, h_q, head_dim_v)
        row_lse = row_lse.reshape(h_q, s_q)
        empty = torch.isneginf(row_lse)  # [h_q, s_q]
        lse[i] = torch.where(empty, math.inf, row_lse)
        out[i] = o.masked_fill(empty.t().unsqueeze(-1), 0.0).to(q.dtype)
    return out, lse


def per_token_cast_to_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 quantisation: x [m, k] -> (fp8 [m, k], fp32 scales [m, ceil(k/128)])."""
    m, k = x.shape
    pad = (-k) % FP8_BLOCK
    xp = torch.nn.functional.pad(x.float(), (0, pad)).view(m, (k + pad) // FP8_BLOCK, FP8_BLOCK)
    sf = xp.abs().amax(dim=2).clamp(min=1e-4) / fp8_max(dtype)
    q = (xp / sf.unsqueeze(2)).to(dtype).view(m, k + pad)[:, :k]
    return q.contiguous(), sf


def per_block_cast_to_fp8(
    x: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn
) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 quantisation: x [n, k] -> (fp8 [n, k], fp32 scales [ceil(n/128), ceil(k/128)])."""
    n, k = x.shape
    pn, pk = (-n) % FP8_BLOCK, (-k) % FP8_BLOCK
    xp = torch.nn.functional.pad(x.float(), (0, pk, 0, pn))
    xv = xp.view(xp.shape[0] // FP8_BLOCK, FP8_BLOCK, xp.shape[1] // FP8_BLOCK, FP8_BLOCK)
    sf = xv.abs().amax(dim=(1, 3)).clamp(min=1e-4) / fp8_max(dtype)
    q = (xv / sf[:, None, :, None]).to(dtype).view_as(xp)[:n, :k]
    return q.contiguous(), sf


def dequant_token(a: torch.Tensor, sfa: torch.Tensor) -> torch.Tensor:
    k = a.shape[-1]
    return a.float() * sfa.float().repeat_interleave(FP8_BLOCK, dim=-1)[..., :k]


def dequant_block(b: torch.Tensor, sfb: torch.Tensor) -> torch.Tensor:
    n, k = b.shape[-2:]
    sf = sfb.float().repeat_interleave(FP8_BLOCK, dim=-2).repeat_interleave(FP8_BLOCK, dim=-1)
    return b.float() * sf[..., :n, :k]


def fp8_gemm_nt(
    a: torch.Tensor,
    sfa: torch.Tensor,
    b: torch.Tensor,
    sfb: torch.Tensor,
    d: torch.Tensor,
    c: torch.Tensor | None,
) -> None:
    """d = c + dequant(a) @ dequant(b).T, in fp32, written into d."""
    out = dequant_token(a, sfa) @ dequant_block(b, sfb).t()
    if c is not None:
        out = out + c.float()
    d.copy_(out)


def m_grouped_fp8_gemm_nt_contiguous(
    a: torch.Tensor,
    sfa: torch.Tensor,
    b: torch.Tensor,
    sfb: torch.Tensor,
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
) -> None:
    """Row i uses expert grouped_layout[i]; rows marked -1 (padding) are written as 0."""
    a32 = dequant_token(a, sfa)
    out = torch.zeros(d.shape, dtype=torch.float32, device=d.device)
    layout = grouped_layout.long()
    for g in range(b.shape[0]):
        rows = (layout == g).nonzero().flatten()
        if rows.numel():
            out[rows] = a32[rows] @ dequant_block(b[g], sfb[g]).t()
    d.copy_(out)


def m_grouped_fp8_gemm_nt_masked(
    a: torch.Tensor,
    sfa: torch.Tensor,
    b: torch.Tensor,
    sfb: torch.Tensor,
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int = 0,
) -> None:
    """Group g computes its first masked_m[g] rows; rows past that are left as they were."""
    for g, m in enumerate(masked_m.tolist()):
        if m > 0:
            out = dequant_token(a[g, :m], sfa[g, :m]) @ dequant_block(b[g], sfb[g]).t()
            d[g, :m] = out.to(d.dtype)


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's similarity metric: 1 - 2<x,y> / (|x|^2 + |y|^2)."""
    x, y = x.double(), y.double()
    denominator = (x * x + y * y).sum()
    if denominator == 0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denominator)
