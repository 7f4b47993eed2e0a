"""Ahead-of-time compilation of every GPU variant of the Triton kernels, without a GPU.

The interpreter (the only way to run the kernels on CPU) runs the CPU-safe variants only:
fp32 dots and stores, no FP8 MMA. This module compiles the variants a GPU launches (FP8
`tl.dot`, bf16 / fp16 stores, bf16 MMA) to PTX and cubin for a target such as Hopper
(`GPUTarget("cuda", 90, 32)` = sm_90a), with Triton's own compiler and the ptxas its wheel
ships. The launches are described by the backend's own builders on meta tensors, so what is
compiled here is what the backend launches on the GPU for the same shapes.

    from triton.backends.compiler import GPUTarget
    for variant in hopper_variants():
        compiled = compile_variant(variant, GPUTarget("cuda", 90, 32))
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from vllm_pd.ops import triton_backend as tb
from vllm_pd.ops import triton_kernels as tk

HOPPER = GPUTarget("cuda", 90, 32)
# DeepSeek-V3 MLA decode: 128 query heads, 576-wide latent KV (512 NoPE + 64 RoPE), page 64;
# s_q 2 is the MTP decode step, where the causal mask applies.
MLA_HEADS, MLA_DIM, MLA_DIM_V, MLA_PAGE = 128, 576, 512, 64
GEMM_M, GEMM_N, GEMM_K = 128, 2112, 7168  # a DeepGEMM shape; the sizes only set divisibility hints
GEMM_GROUPS = 4
_MMA = re.compile(r"\b(?:wgmma\.mma_async|mma\.sync)\.\S+")


@dataclass(frozen=True)
class Variant:
    """One kernel specialisation: `name` says which, `launch` is the backend's launch of it."""

    name: str
    launch: tb.Launch
    fp8_dot: bool


@dataclass(frozen=True)
class Compiled:
    name: str
    seconds: float
    ptx: str = field(repr=False)
    cubin_bytes: int
    shared_bytes: int
    mma: frozenset[str]  # the MMA instructions in the PTX, e.g. wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def mla_variants() -> list[Variant]:
    """Every launch the backend makes on a GPU for DeepSeek-V3 MLA decode (q dtype x causal)."""
    variants = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for s_q in (1, 2):
            blocks = 4
            q = _meta(1, s_q, MLA_HEADS, MLA_DIM, dtype=dtype)
            cache = _meta(blocks, MLA_PAGE, 1, MLA_DIM, dtype=dtype)
            table, lens = _meta(1, blocks, dtype=torch.int32), _meta(1, dtype=torch.int32)
            out = _meta(1, s_q, MLA_HEADS, MLA_DIM_V, dtype=dtype)
            lse = _meta(1, MLA_HEADS, s_q, dtype=torch.float32)
            launch = tb.mla_decode_launch(
                q, cache, table, lens, out, lse, MLA_DIM_V, MLA_DIM**-0.5, True, interpreted=False
            )
            name = f"mla_decode[{tb.TRITON_DTYPES[dtype]}, causal={launch.constexprs['CAUSAL']}]"
            variants.append(Variant(name, launch, fp8_dot=False))
    return variants


def _gemm_operands(mode: int, fp8: torch.dtype, out: torch.dtype, with_c: bool) -> tuple:
    m, n, k, g = GEMM_M, GEMM_N, GEMM_K, GEMM_GROUPS
    kb, nb = triton.cdiv(k, 128), triton.cdiv(n, 128)
    c = _meta(m, n, dtype=torch.float32) if with_c else None
    if mode == tk.MODE_MASKED:
        return (
            _meta(g, m, k, dtype=fp8),
            _meta(g, m, kb, dtype=torch.float32),
            _meta(g, n, k, dtype=fp8),
            _meta(g, nb, kb, dtype=torch.float32),
            _meta(g, m, n, dtype=out),
            None,
            None,
            _meta(g, dtype=torch.int32),
            g,
            m,
        )
    groups = g if mode == tk.MODE_CONTIGUOUS else None
    b = _meta(g, n, k, dtype=fp8) if groups else _meta(n, k, dtype=fp8)
    sfb = _meta(g, nb, kb, dtype=torch.float32) if groups else _meta(nb, kb, dtype=torch.float32)
    layout = _meta(m, dtype=torch.int32) if groups else None
    return (
        _meta(m, k, dtype=fp8),
        _meta(m, kb, dtype=torch.float32),
        b,
        sfb,
        _meta(m, n, dtype=out),
        c,
        layout,
        None,
        1,
        m,
    )


def gemm_variants(target: GPUTarget) -> tuple[list[Variant], dict[str, str]]:
    """Every FP8 GEMM launch the backend makes on `target`, and the FP8 types it refuses there (why)."""
    variants: list[Variant] = []
    refused: dict[str, str] = {}
    modes = {tk.MODE_PLAIN: "fp8_gemm_nt", tk.MODE_CONTIGUOUS: "contiguous", tk.MODE_MASKED: "masked"}
    for fp8 in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        reason = tb.fp8_rejection(fp8, target)
        if reason is not None:
            refused[str(fp8)] = reason
            continue
        for mode, op in modes.items():
            for with_c in (False, True) if mode == tk.MODE_PLAIN else (False,):
                for out in (torch.bfloat16, torch.float16, torch.float32):
                    a, sfa, b, sfb, d, c, layout, masked_m, groups, m = _gemm_operands(mode, fp8, out, with_c)
                    launch = tb.fp8_gemm_launch(
                        mode, a, sfa, b, sfb, d, c, layout, masked_m, groups, m, fp8_dot=True, interpreted=False
                    )
                    name = f"{op}[{tb.TRITON_DTYPES[fp8]} -> {tb.TRITON_DTYPES[out]}{', c' if with_c else ''}]"
                    variants.append(Variant(name, launch, fp8_dot=True))
    return variants, refused


def hopper_variants() -> tuple[list[Variant], dict[str, str]]:
    gemms, refused = gemm_variants(HOPPER)
    return mla_variants() + gemms, refused


def _arg_type(value: Any) -> tuple[str, bool]:
    """Triton's signature type of a runtime argument and whether it is a multiple of 16, as the
    JIT specialises it (pointers from torch's allocator are 16-byte aligned; an int equal to 1
    becomes a constexpr, see source_of)."""
    if isinstance(value, torch.Tensor):
        return "*" + tb.TRITON_DTYPES[value.dtype], True
    if isinstance(value, bool):
        return "u1", False
    if isinstance(value, int):
        return ("i32" if -(2**31) <= value < 2**31 else "i64"), value % 16 == 0
    if isinstance(value, float):
        return "fp32", False
    raise TypeError(f"no Triton type for kernel argument {value!r}")


def source_of(launch: tb.Launch) -> ASTSource:
    """The compiler input the JIT builds when `launch` runs (same signature, constants, hints)."""
    names = launch.kernel.arg_names
    runtime = [n for n in names if n not in launch.constexprs]
    if len(runtime) != len(launch.args):
        raise ValueError(f"{launch.kernel.__name__}: {len(launch.args)} arguments for {runtime}")
    constexprs = dict(launch.constexprs)
    signature = {n: "constexpr" for n in constexprs}
    attrs = {}
    for name, value in zip(runtime, launch.args):
        if type(value) is int and value == 1:
            constexprs[name] = 1
            signature[name] = "constexpr"
            continue
        signature[name], aligned = _arg_type(value)
        if aligned:
            attrs[(names.index(name),)] = [["tt.divisibility", 16]]
    return ASTSource(launch.kernel, {n: signature[n] for n in names}, constexprs, attrs)


def compile_variant(variant: Variant, target: GPUTarget = HOPPER) -> Compiled:
    """PTX and cubin of `variant` for `target`, with Triton's default launch options (4 warps,
    3 stages, as the backend launches). Raises triton's CompilationError when it cannot."""
    start = time.perf_counter()
    kernel = triton.compile(source_of(variant.launch), target=target)
    seconds = time.perf_counter() - start
    ptx = kernel.asm["ptx"]
    return Compiled(
        variant.name,
        seconds,
        ptx,
        len(kernel.asm.get("cubin", b"")),
        int(kernel.metadata.shared),
        frozenset(_MMA.findall(ptx)),
    )
