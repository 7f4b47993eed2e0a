"""Each ops backend on production shapes against the PyTorch reference, for a GPU check.

DeepSeek-V3 MLA decode (h_q 128, head_dim 576 / 512, page 64, batch 1-128, context 1K-32K) and
DeepGEMM's FP8 GEMM shapes. A case builds its inputs on the device, runs the op through
torch.ops.vllm_pd (validation and backend choice included) and compares it with
vllm_pd.ops.reference there; it hands back the kernel alone (`Case.run`: the backend's
function on the case's inputs, no validation, no host sync, capturable in a CUDA graph) and
the bytes and FLOPs the op must move and do, so benchmarks/gpu_check.py can time it and
report a fraction of HBM bandwidth or TFLOP/s. Built for CUDA; runs on CPU too (small shapes).

    for backend, why_not in backends_to_check(device).items():
        for shape in MLA_SHAPES:
            case = mla_case(backend, shape, device)   # case.ok, case.detail, case.run, case.bytes
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import vllm_pd.ops.library  # noqa: F401  (defines torch.ops.vllm_pd)
from vllm_pd.ops import backends, reference
from vllm_pd.ops.testing import LSE_TOL, OUT_TOL, flash_mla_mismatch, fp8_operands, mla_inputs

CHECKED_BACKENDS = ("triton", "native")
GEMM_DIFF_TOL = 1e-3  # DeepGEMM's calc_diff bound (its tests hold it against the unquantised product)
MLA_BATCHES = (1, 8, 32, 128)
MLA_CONTEXTS = (1024, 4096, 16384, 32768)
# DeepGEMM's tests/generators.py enumerate_normal: m x (n, k) of DeepSeek-V3's linear layers
GEMM_MS = (1, 64, 128, 4096)
GEMM_NKS = ((2112, 7168), (576, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))


@dataclass(frozen=True)
class MlaShape:
    batch: int
    context: int  # tokens of the longest sequence; see seqlens
    h_q: int = 128
    s_q: int = 1
    dim: int = 576
    dim_v: int = 512
    page: int = 64

    def seqlens(self) -> list[int]:
        """Lengths differ like a real decode batch's: sequence i is `context - (37 i mod page)`
        tokens long, so most last blocks are partly filled (their tails are NaN, see mla_inputs)."""
        return [max(0, self.context - (37 * i) % self.page) for i in range(self.batch)]


@dataclass(frozen=True)
class GemmShape:
    m: int
    n: int
    k: int


MLA_SHAPES = tuple(MlaShape(b, context) for b in MLA_BATCHES for context in MLA_CONTEXTS)
GEMM_SHAPES = tuple(GemmShape(m, n, k) for m in GEMM_MS for n, k in GEMM_NKS)


@dataclass(frozen=True)
class Case:
    op: str
    backend: str
    shape: MlaShape | GemmShape
    ok: bool  # within the vendor library's own test tolerance against the reference
    detail: str  # what failed; "" when ok
    error: float  # MLA: max |out - reference|; GEMM: DeepGEMM's calc_diff
    bytes: int  # the least the op must move through memory (FlashMLA's formula for MLA)
    flops: int
    run: Callable[[], object]  # the kernel alone on this case's inputs (they stay alive with it)


def backends_to_check(device: torch.device) -> dict[str, str | None]:
    """For each of CHECKED_BACKENDS: None when it runs both ops on `device`, else why it cannot."""
    ops = ("mla_decode", "fp8_gemm_nt")
    result: dict[str, str | None] = {}
    for name in CHECKED_BACKENDS:
        reasons = [r for r in (backends.unavailable_reason(name, op, device) for op in ops) if r]
        result[name] = "; ".join(dict.fromkeys(reasons)) or None
    return result


def mla_bytes_flops(shape: MlaShape, element_size: int = 2) -> tuple[int, int]:
    """FlashMLA's test formulas over the real lengths: q, the KV read once, out; 2 FLOPs per MAC."""
    tokens = sum(shape.seqlens())
    rows = shape.s_q * shape.h_q
    moved = element_size * (tokens * shape.dim + shape.batch * rows * (shape.dim + shape.dim_v))
    return moved, 2 * rows * tokens * (shape.dim + shape.dim_v)


def mla_case(
    backend: str,
    shape: MlaShape,
    device: torch.device,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    causal: bool = True,
) -> Case:
    q, cache, table, lens = mla_inputs(
        shape.seqlens(), shape.s_q, shape.h_q, shape.page, dtype, seed=seed, dim=shape.dim, device=device
    )
    args = (q, cache, table, lens, shape.dim_v, shape.dim**-0.5, causal)
    out, lse = torch.ops.vllm_pd.mla_decode(*args, backend)
    ref_out, ref_lse = reference.mla_decode(*args)
    mismatch = [
        m
        for m in (
            flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL),
            flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL),
        )
        if m
    ]
    finite = torch.isfinite(ref_out)
    error = float((out.float() - ref_out.float())[finite].abs().max()) if finite.any() else 0.0
    impl = backends.select("mla_decode", q.device, backend, args)
    moved, flops = mla_bytes_flops(shape, q.element_size())
    return Case(
        "mla_decode",
        backend,
        shape,
        not mismatch,
        "; ".join(mismatch),
        error,
        moved,
        flops,
        functools.partial(impl.mla_decode, *args),
    )


def gemm_bytes_flops(shape: GemmShape, out_dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    """FP8 a and b, their fp32 scales and d once each."""
    kb, nb = -(-shape.k // 128), -(-shape.n // 128)
    out_size = torch.empty(0, dtype=out_dtype).element_size()
    moved = shape.m * shape.k + shape.n * shape.k + 4 * (shape.m * kb + nb * kb) + out_size * shape.m * shape.n
    return moved, 2 * shape.m * shape.n * shape.k


def fp8_gemm_case(
    backend: str,
    shape: GemmShape,
    device: torch.device,
    fp8: torch.dtype = torch.float8_e4m3fn,
    out_dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> Case:
    a, sfa, b, sfb = fp8_operands(shape.m, shape.n, shape.k, fp8, seed=seed, device=device)
    d = torch.empty(shape.m, shape.n, dtype=out_dtype, device=device)
    ref = torch.empty(shape.m, shape.n, dtype=torch.float32, device=device)
    torch.ops.vllm_pd.fp8_gemm_nt(a, sfa, b, sfb, d, None, backend)
    reference.fp8_gemm_nt(a, sfa, b, sfb, ref, None)
    diff = reference.calc_diff(d, ref)
    ok = diff < GEMM_DIFF_TOL  # False for NaN too
    impl = backends.select("fp8_gemm_nt", a.device, backend, (a, sfa, b, sfb, d, None))
    moved, flops = gemm_bytes_flops(shape, out_dtype)
    return Case(
        "fp8_gemm_nt",
        backend,
        shape,
        ok,
        "" if ok else f"calc_diff {diff:.3g} >= {GEMM_DIFF_TOL}",
        diff,
        moved,
        flops,
        functools.partial(impl.fp8_gemm_nt, a, sfa, b, sfb, d, None),
    )
