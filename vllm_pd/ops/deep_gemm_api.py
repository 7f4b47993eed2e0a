"""DeepGEMM's FP8 GEMM API over torch.ops.vllm_pd.*, so DeepGEMM code runs unchanged:

    from vllm_pd.ops import deep_gemm_api as deep_gemm
    deep_gemm.fp8_gemm_nt((a, sfa), (b, sfb), d, c=None)       # d = c + a @ b.T
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, grouped_layout)
    deep_gemm.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, expected_m)

Recipe (1, 128, 128) with fp32 scales, for e4m3fn and e4m3fnuz. Any sfa strides are accepted
(DeepGEMM's MN-major TMA-aligned layout included). Layout knobs (compiled_dims,
disable_ue8m0_cast) are accepted and ignored; packed UE8M0 scales (SM100) are rejected.
"""

from __future__ import annotations

import torch

import vllm_pd.ops.library  # noqa: F401  (defines torch.ops.vllm_pd)
from vllm_pd.ops.reference import per_block_cast_to_fp8, per_token_cast_to_fp8  # noqa: F401

_MK_ALIGNMENT = 128
_RECIPE = (1, 128, 128)

Pair = tuple[torch.Tensor, torch.Tensor]


def _check_recipe(recipe: tuple[int, int, int] | None) -> None:
    if recipe is not None and tuple(recipe) != _RECIPE:
        raise NotImplementedError(f"only recipe {_RECIPE} is supported, got {recipe}")


def fp8_gemm_nt(
    a: Pair,
    b: Pair,
    d: torch.Tensor,
    c: torch.Tensor | None = None,
    recipe=None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    backend: str | None = None,
) -> None:
    _check_recipe(recipe)
    torch.ops.vllm_pd.fp8_gemm_nt(a[0], a[1], b[0], b[1], d, c, backend)


def m_grouped_fp8_gemm_nt_contiguous(
    a: Pair,
    b: Pair,
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
    recipe=None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    backend: str | None = None,
    **_layout_hints: object,
) -> None:
    _check_recipe(recipe)
    torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_contiguous(a[0], a[1], b[0], b[1], d, grouped_layout, backend)


def m_grouped_fp8_gemm_nt_masked(
    a: Pair,
    b: Pair,
    d: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    recipe=None,
    compiled_dims: str = "nk",
    disable_ue8m0_cast: bool = False,
    backend: str | None = None,
) -> None:
    _check_recipe(recipe)
    torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_masked(a[0], a[1], b[0], b[1], d, masked_m, int(expected_m), backend)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked  # the name older vLLM resolves


def get_mk_alignment_for_contiguous_layout() -> int:
    """Rows of each group in the contiguous layout are padded to this multiple."""
    return _MK_ALIGNMENT


def get_mn_major_tma_aligned_tensor(sf: torch.Tensor) -> torch.Tensor:
    """Our kernels read scales through strides, so any layout is already fine."""
    return sf
