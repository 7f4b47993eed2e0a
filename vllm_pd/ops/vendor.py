"""The "vendor" backend: FlashMLA and DeepGEMM themselves, when importable (CUDA tensors only).

API generations are probed, not assumed, because vendor forks lag upstream:
- FlashMLA: the 2026 API has `get_mla_metadata()` without arguments (lazy FlashMLASchedMeta);
  the 2025 one, still used by Hygon DCU / AMD / MetaX forks, takes (cache_seqlens,
  num_q_tokens_per_head_k, num_heads_k[, num_heads_q, ...]) and returns (metadata, num_splits).
  The pip package `flash_mla` (also the DCU wheels' name) is tried first, then vLLM's vendored
  copy (vllm.third_party.flashmla, needs vllm._flashmla_C).
- DeepGEMM: `fp8_gemm_nt` / `m_grouped_fp8_gemm_nt_*` (2025-06 and later) or the first names
  `gemm_fp8_fp8_bf16_nt` / `m_grouped_gemm_fp8_fp8_bf16_nt_*`.
None of this can run without a GPU; tests drive the adapters with stand-in modules.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

FLASH_MLA_MODULES = ("flash_mla", "vllm.third_party.flashmla.flash_mla_interface")


@dataclass(frozen=True)
class FlashMLA:
    module: ModuleType
    lazy_metadata: bool  # 2026 API: get_mla_metadata() takes no arguments


@dataclass(frozen=True)
class DeepGemm:
    module: ModuleType
    gemm: Callable | None
    contiguous: Callable | None
    masked: Callable | None
    legacy: bool  # first-generation names: no `c`, no disable_ue8m0_cast
    align_sfa: Callable | None  # makes sfa MN-major and TMA-aligned, as DeepGEMM requires


def _import(name: str) -> ModuleType | None:
    try:
        if name.startswith("vllm.third_party.flashmla"):
            importlib.import_module("vllm._flashmla_C")
        return importlib.import_module(name)
    except Exception as e:  # a CUDA-less import can raise anything (AssertionError in DeepGEMM)
        logger.debug("vendor module %s unavailable: %s", name, e)
        return None


def probe_flash_mla(module: ModuleType) -> FlashMLA | None:
    get_meta = getattr(module, "get_mla_metadata", None)
    if get_meta is None or not hasattr(module, "flash_mla_with_kvcache"):
        return None
    try:
        params = inspect.signature(get_meta).parameters.values()
        positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
        required = [p for p in params if p.default is p.empty and p.kind in positional]
        lazy = len(required) == 0
    except (TypeError, ValueError):  # a compiled function: the 2025 API was the compiled one
        lazy = False
    return FlashMLA(module, lazy)


def probe_deep_gemm(module: ModuleType) -> DeepGemm:
    def first(*names: str) -> Callable | None:
        return next((getattr(module, n) for n in names if hasattr(module, n)), None)

    modern = hasattr(module, "fp8_gemm_nt")
    return DeepGemm(
        module=module,
        gemm=first("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt"),
        contiguous=first("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"),
        masked=first(
            "m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked", "m_grouped_gemm_fp8_fp8_bf16_nt_masked"
        ),
        legacy=not modern,
        align_sfa=first("get_mn_major_tma_aligned_tensor", "get_col_major_tma_aligned_tensor"),
    )


@functools.cache
def flash_mla() -> FlashMLA | None:
    for name in FLASH_MLA_MODULES:
        module = _import(name)
        if module is not None and (found := probe_flash_mla(module)) is not None:
            return found
    return None


@functools.cache
def deep_gemm() -> DeepGemm | None:
    module = _import("deep_gemm")
    return probe_deep_gemm(module) if module is not None else None


def unavailable_reason(op: str, device: torch.device) -> str | None:
    if device.type != "cuda":
        return "FlashMLA and DeepGEMM need CUDA/ROCm tensors"
    if op == "mla_decode":
        return None if flash_mla() is not None else f"none of {FLASH_MLA_MODULES} is importable"
    lib = deep_gemm()
    if lib is None:
        return "deep_gemm is not importable"
    fn = {
        "fp8_gemm_nt": lib.gemm,
        "m_grouped_fp8_gemm_nt_contiguous": lib.contiguous,
        "m_grouped_fp8_gemm_nt_masked": lib.masked,
    }[op]
    return None if fn is not None else f"this deep_gemm has no {op}"


def rejects(op: str, args: tuple) -> str | None:
    """Shapes the vendor kernels do not take; the op then runs on the next backend."""
    if op == "mla_decode":
        q, k_cache, _, _, head_dim_v = args[:5]
        if q.dtype not in (torch.bfloat16, torch.float16):
            return f"FlashMLA takes bf16/fp16, not {q.dtype}"
        if k_cache.shape[1] != 64 or q.shape[-1] != 576 or head_dim_v != 512:
            return "FlashMLA dense decode needs block_size 64, head_dim 576, head_dim_v 512"
        return None
    a, b, d = args[0], args[2], args[4]
    n, k = b.shape[-2], b.shape[-1]
    if n % 64 or k % 128:
        return f"DeepGEMM needs N % 64 == 0 and K % 128 == 0 (N={n}, K={k})"
    lib = deep_gemm()
    if op == "fp8_gemm_nt":
        c = args[5]
        if lib is not None and lib.legacy and c is not None:
            return "this deep_gemm predates the `c` operand"
        if d.dtype != (torch.float32 if c is not None else torch.bfloat16):
            return "DeepGEMM writes bf16 d (fp32 d when c is given)"
    elif d.dtype != torch.bfloat16:
        return "DeepGEMM grouped GEMMs write bf16 d"
    if a.dtype == torch.float8_e4m3fnuz and torch.version.hip is None:
        return "e4m3fnuz needs a ROCm/DCU build"
    return None


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    lib = flash_mla()
    if lib.lazy_metadata:
        meta, splits = lib.module.get_mla_metadata()
    else:
        s_q, h_q, h_kv = q.shape[1], q.shape[2], k_cache.shape[2]
        wanted = {"num_heads_q": h_q}
        params = _parameters(lib.module.get_mla_metadata)
        extra = {k: v for k, v in wanted.items() if k in params}
        meta, splits = lib.module.get_mla_metadata(cache_seqlens, s_q * h_q // h_kv, h_kv, **extra)
    return lib.module.flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        meta,
        splits,
        softmax_scale=softmax_scale,
        causal=causal,
    )


def _parameters(fn: Callable) -> set[str]:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return set()


def _sfa(lib: DeepGemm, sfa: torch.Tensor) -> torch.Tensor:
    return lib.align_sfa(sfa) if lib.align_sfa is not None else sfa


def fp8_gemm_nt(a, sfa, b, sfb, d, c):
    lib = deep_gemm()
    if lib.legacy:
        lib.gemm((a, _sfa(lib, sfa)), (b, sfb), d)
    else:
        lib.gemm((a, _sfa(lib, sfa)), (b, sfb), d, c=c, disable_ue8m0_cast=True)


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout):
    lib = deep_gemm()
    kwargs = {} if lib.legacy else {"disable_ue8m0_cast": True}
    lib.contiguous((a, _sfa(lib, sfa)), (b, sfb), d, grouped_layout, **kwargs)


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m):
    lib = deep_gemm()
    kwargs = {} if lib.legacy else {"disable_ue8m0_cast": True}
    lib.masked((a, _sfa(lib, sfa)), (b, sfb), d, masked_m, expected_m, **kwargs)
