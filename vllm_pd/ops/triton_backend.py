"""The "triton" backend: launches vllm_pd.ops.triton_kernels for the op arguments.

CPU tensors run the same kernels in Triton's interpreter, which Triton fixes when it is
imported: TRITON_INTERPRET=1 must be set before `import triton`. Slow, for tests only, so
"triton" is never chosen automatically for CPU tensors.

Each launch is first described as a `Launch` (kernel, grid, arguments, constexprs) by
`mla_decode_launch` / `fp8_gemm_launch`; the backend runs it and vllm_pd.ops.triton_aot
compiles the very same description for a GPU target without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.runtime.interpreter import InterpretedFunction

from vllm_pd.ops import triton_kernels as tk

BLOCK_H = 16
BLOCK_N = 16
GEMM_BLOCK_M, GEMM_BLOCK_N, GEMM_BLOCK_K = 64, 128, 128
GEMM_OPS = ("fp8_gemm_nt", "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nt_masked")
# Triton's names of the torch dtypes the kernels take (triton/_utils.py spells them the same).
TRITON_DTYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.int32: "i32",
    torch.float8_e4m3fn: "fp8e4nv",
    torch.float8_e4m3fnuz: "fp8e4b8",
}


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `kernel[grid](*args, **constexprs)`."""

    kernel: Any  # a triton JITFunction (InterpretedFunction under TRITON_INTERPRET=1)
    grid: tuple[int, ...]
    args: tuple[Any, ...]  # the runtime arguments, in the kernel's order
    constexprs: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.constexprs)


def _interpreted() -> bool:
    """True when TRITON_INTERPRET=1 was set as the kernels were defined."""
    return isinstance(tk.mla_decode_kernel, InterpretedFunction)


@functools.cache
def device_target(index: int) -> GPUTarget:
    """The Triton target of CUDA/ROCm device `index` (what Triton compiles for when it launches there)."""
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip is not None:
        return GPUTarget("hip", props.gcnArchName.split(":")[0], getattr(props, "warp_size", 64))
    return GPUTarget("cuda", props.major * 10 + props.minor, 32)


@functools.cache
def supported_fp8(target: GPUTarget) -> tuple[str, ...]:
    """The FP8 types Triton accepts at all (loads included) when compiling for `target`."""
    return tuple(triton.compiler.make_backend(target).parse_options({}).supported_fp8_dtypes)


def fp8_rejection(dtype: torch.dtype, target: GPUTarget) -> str | None:
    """Why the FP8 GEMM kernel cannot take `dtype` operands on `target`; None when it can.

    NVIDIA has no e4m3fnuz (AMD's FP8: bias 8, no negative zero) in its MMA or anywhere else,
    so Triton refuses the type for CUDA targets; a converted copy would silently round the
    fnuz values below 2^-6, so the kernel refuses instead of converting."""
    name = TRITON_DTYPES[dtype]
    allowed = supported_fp8(target)
    if name in allowed:
        return None
    where = f"{target.backend} arch {target.arch}"
    if dtype == torch.float8_e4m3fnuz and target.backend == "cuda":
        return (
            f"float8_e4m3fnuz is AMD's FP8 format and {where} has no e4m3fnuz type or MMA: quantize "
            "with float8_e4m3fn on NVIDIA GPUs (the native backend decodes either format in software)"
        )
    return f"Triton takes no {dtype} on {where} (it takes {', '.join(allowed)} there)"


def unavailable_reason(op: str, device: torch.device) -> str | None:
    if device.type == "cpu" and not _interpreted():
        return "CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before triton is imported"
    if device.type == "cuda" and _interpreted():
        return "the kernels were defined in interpreter mode (TRITON_INTERPRET=1)"
    return None


def target_of(device: torch.device) -> GPUTarget | None:
    """The target the kernels compile for on `device`; None in the interpreter (CPU tensors)."""
    if device.type != "cuda" or _interpreted():
        return None
    return device_target(device.index if device.index is not None else torch.cuda.current_device())


def rejects(op: str, args: tuple) -> str | None:
    """Operands these kernels do not take on this device (see fp8_rejection)."""
    if op not in GEMM_OPS:
        return None
    target = target_of(args[0].device)
    return None if target is None else fp8_rejection(args[0].dtype, target)


def _store_dtype(dtype: torch.dtype, interpreted: bool) -> torch.dtype:
    # The interpreter truncates fp32 -> bf16/fp16 stores instead of rounding to nearest like
    # GPUs do, so there the kernels store fp32 and torch rounds.
    return torch.float32 if interpreted else dtype


def mla_decode_launch(
    q, k_cache, block_table, cache_seqlens, out, lse, head_dim_v, softmax_scale, causal, interpreted: bool
) -> Launch:
    b, s_q, h_q, d = q.shape
    rows = s_q * h_q
    return Launch(
        tk.mla_decode_kernel,
        (b, triton.cdiv(rows, BLOCK_H)),
        (
            q,
            k_cache,
            block_table,
            cache_seqlens,
            out,
            lse,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k_cache.stride(0),
            k_cache.stride(1),
            block_table.stride(0),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            h_q,
            s_q,
            rows,
            float(softmax_scale),
        ),
        dict(
            D=d,
            DV=head_dim_v,
            BLOCK_DV=triton.next_power_of_2(head_dim_v),
            BLOCK_DR=max(16, triton.next_power_of_2(max(d - head_dim_v, 1))),
            PAGE=k_cache.shape[1],
            CAUSAL=bool(causal and s_q > 1),
            BLOCK_H=BLOCK_H,
            BLOCK_N=BLOCK_N,
            DOT_F32=interpreted or q.dtype == torch.float32,  # the interpreter's dot is only right in fp32
        ),
    )


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    b, s_q, h_q, d = q.shape
    out = q.new_empty((b, s_q, h_q, head_dim_v), dtype=_store_dtype(q.dtype, _interpreted()))
    lse = torch.empty((b, h_q, s_q), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    mla_decode_launch(
        q, k_cache, block_table, cache_seqlens, out, lse, head_dim_v, softmax_scale, causal, _interpreted()
    )()
    return out.to(q.dtype), lse


def fp8_gemm_launch(
    mode, a, sfa, b, sfb, d, c, layout, masked_m, groups, m, fp8_dot: bool, interpreted: bool
) -> Launch:
    """`fp8_dot`: FP8 MMA (the operands' type must be one the target supports natively);
    otherwise e4m3 tiles are widened to bf16 (exact) or, in the interpreter, fp32."""
    n, k = b.shape[-2], b.shape[-1]
    dummy = d  # stands in for absent pointer arguments; never read
    three = a.dim() == 3
    return Launch(
        tk.fp8_gemm_kernel,
        (triton.cdiv(m, GEMM_BLOCK_M), triton.cdiv(n, GEMM_BLOCK_N), groups),
        (
            a,
            sfa,
            b,
            sfb,
            d,
            c if c is not None else dummy,
            layout if layout is not None else dummy,
            masked_m if masked_m is not None else dummy,
            m,
            n,
            k,
            a.stride(0) if three else 0,
            a.stride(-2),
            b.stride(0) if b.dim() == 3 else 0,
            b.stride(-2),
            sfa.stride(0) if three else 0,
            sfa.stride(-2),
            sfa.stride(-1),
            sfb.stride(0) if sfb.dim() == 3 else 0,
            sfb.stride(-2),
            sfb.stride(-1),
            d.stride(0) if three else 0,
            d.stride(-2),
            c.stride(0) if c is not None else 0,
        ),
        dict(
            MODE=mode,
            HAS_C=c is not None,
            FP8_DOT=fp8_dot and not interpreted,
            DOT_F32=interpreted,
            BLOCK_M=GEMM_BLOCK_M,
            BLOCK_N=GEMM_BLOCK_N,
            BLOCK_K=GEMM_BLOCK_K,
        ),
    )


def _launch(mode, a, sfa, b, sfb, d, c, layout, masked_m, groups, m):
    interpreted = _interpreted()
    if _store_dtype(d.dtype, interpreted) != d.dtype:
        staged = d.float()
        _launch(mode, a, sfa, b, sfb, staged, c, layout, masked_m, groups, m)
        d.copy_(staged)
        return
    # rejects() has refused every FP8 type a CUDA/ROCm target lacks, so what is left has MMA
    fp8_gemm_launch(mode, a, sfa, b, sfb, d, c, layout, masked_m, groups, m, a.is_cuda, interpreted)()


def fp8_gemm_nt(a, sfa, b, sfb, d, c):
    if a.shape[0]:
        _launch(tk.MODE_PLAIN, a, sfa, b, sfb, d, c, None, None, 1, a.shape[0])


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout):
    if a.shape[0]:
        _launch(tk.MODE_CONTIGUOUS, a, sfa, b, sfb, d, None, grouped_layout, None, 1, a.shape[0])


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m):
    if a.shape[0] and a.shape[1]:
        _launch(tk.MODE_MASKED, a, sfa, b, sfb, d, None, None, masked_m, a.shape[0], a.shape[1])
