"""The "triton" backend: launches vllm_pd.ops.triton_kernels for the op arguments.

CPU tensors run the same kernels in Triton's interpreter, which Triton fixes when it is
imported: TRITON_INTERPRET=1 must be set before `import triton`. Slow, for tests only, so
"triton" is never chosen automatically for CPU tensors.
"""

from __future__ import annotations

import torch
import triton
from triton.runtime.interpreter import InterpretedFunction

from vllm_pd.ops import triton_kernels as tk

BLOCK_H = 16
BLOCK_N = 16
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 128, 128


def _interpreted() -> bool:
    """True when TRITON_INTERPRET=1 was set as the kernels were defined."""
    return isinstance(tk.mla_decode_kernel, InterpretedFunction)


def unavailable_reason(op: str, device: torch.device) -> str | None:
    if device.type == "cpu" and not _interpreted():
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
    if device.type == "cuda" and _interpreted():
        return "the kernels were defined in interpreter mode (TRITON_INTERPRET=1)"
    return None


def _store_dtype(dtype: torch.dtype) -> torch.dtype:
    # The interpreter truncates fp32 -> bf16/fp16 stores instead of rounding to nearest like
    # GPUs do, so there the kernels store fp32 and torch rounds.
    return torch.float32 if _interpreted() else dtype


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    b, s_q, h_q, d = q.shape
    rows = s_q * h_q
    out = q.new_empty((b, s_q, h_q, head_dim_v), dtype=_store_dtype(q.dtype))
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    grid = (b, triton.cdiv(rows, BLOCK_H))
    tk.mla_decode_kernel[grid](
        q, k_cache, block_table, cache_seqlens, out, lse,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1),
        block_table.stride(0),
        out.stride(0), out.stride(1), out.stride(2),
        h_q, s_q, rows, float(softmax_scale),
        D=d, DV=head_dim_v,
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
        BLOCK_DR=max(16, triton.next_power_of_2(max(d - head_dim_v, 1))),
        PAGE=k_cache.shape[1], CAUSAL=bool(causal and s_q > 1), BLOCK_H=BLOCK_H, BLOCK_N=BLOCK_N,
        DOT_F32=_interpreted() or q.dtype == torch.float32,
    )
    return out.to(q.dtype), lse


def _fp8_dot(a: torch.Tensor) -> bool:
    # Native FP8 MMA: Hopper for e4m3fn, ROCm for e4m3fnuz; the interpreter upcasts to bf16.
    return a.is_cuda and not _interpreted()


def _launch(mode, a, sfa, b, sfb, d, c, layout, masked_m, groups, m):
    if _store_dtype(d.dtype) != d.dtype:
        staged = d.float()
        _launch(mode, a, sfa, b, sfb, staged, c, layout, masked_m, groups, m)
        d.copy_(staged)
        return
    n, k = b.shape[-2], b.shape[-1]
    dummy = d  # stands in for absent pointer arguments; never read
    grid = (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N), groups)
    three = a.dim() == 3
    tk.fp8_gemm_kernel[grid](
        a, sfa, b, sfb, d, c if c is not None else dummy,
        layout if layout is not None else dummy, masked_m if masked_m is not None else dummy,
        m, n, k,
        a.stride(0) if three else 0, a.stride(-2), b.stride(0) if b.dim() == 3 else 0, b.stride(-2),
        sfa.stride(0) if three else 0, sfa.stride(-2), sfa.stride(-1),
        sfb.stride(0) if sfb.dim() == 3 else 0, sfb.stride(-2), sfb.stride(-1),
        d.stride(0) if three else 0, d.stride(-2), c.stride(0) if c is not None else 0,
        MODE=mode, HAS_C=c is not None, FP8_DOT=_fp8_dot(a), DOT_F32=_interpreted(),
        BLOCK_M=GEMM_BLOCK_M, BLOCK_N=GEMM_BLOCK_N, BLOCK_K=GEMM_BLOCK_K,
    )


def fp8_gemm_nt(a, sfa, b, sfb, d, c):
    if a.shape[0]:
        _launch(tk.MODE_PLAIN, a, sfa, b, sfb, d, c, None, None, 1, a.shape[0])


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout):
    if a.shape[0]:
        _launch(tk.MODE_CONTIGUOUS, a, sfa, b, sfb, d, None, grouped_layout, None, 1, a.shape[0])


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m):
    if a.shape[0] and a.shape[1]:
        _launch(tk.MODE_MASKED, a, sfa, b, sfb, d, None, None, masked_m, a.shape[0], a.shape[1])
