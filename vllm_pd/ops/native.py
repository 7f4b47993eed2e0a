"""The "native" backend: the compiled kernels of vllm_pd._C (C++ on CPU; CUDA/HIP when built).

The extension registers torch.ops.vllm_pd_C.*; the device a kernel exists for is asked of the
dispatcher, so one module serves the CPU build and the GPU builds alike.
"""

from __future__ import annotations

import functools
import importlib

import torch

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@functools.cache
def load_error() -> str | None:
    """None when vllm_pd._C is loaded, otherwise why it could not be."""
    try:
        importlib.import_module("vllm_pd._C")
    except ImportError as e:  # not built (e.g. a source checkout without build_ext --inplace)
        logger.debug("vllm_pd._C unavailable: %s", e)
        return f"vllm_pd._C is not built ({e})"
    return None


def unavailable_reason(op: str, device: torch.device) -> str | None:
    error = load_error()
    if error is not None:
        return error
    key = "CPU" if device.type == "cpu" else "CUDA"
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"vllm_pd_C::{op}", key):
        return f"vllm_pd._C has no {key} kernel for {op} (built without {device.type} sources)"
    return None


def mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal):
    return torch.ops.vllm_pd_C.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)


def fp8_gemm_nt(a, sfa, b, sfb, d, c):
    torch.ops.vllm_pd_C.fp8_gemm_nt(a, sfa, b, sfb, d, c)


def m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout):
    torch.ops.vllm_pd_C.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout)


def m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m):
    torch.ops.vllm_pd_C.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m)
