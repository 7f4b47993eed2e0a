"""FlashMLA's Python API over torch.ops.vllm_pd.mla_decode, so FlashMLA code runs unchanged:

    from vllm_pd.ops.flash_mla_api import get_mla_metadata, flash_mla_with_kvcache
    meta, num_splits = get_mla_metadata()          # or the 2025 form with tensors
    out, lse = flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, 512, meta, num_splits,
                                      softmax_scale=scale, causal=True)

Both metadata generations are accepted (and ignored: scheduling is the backend's business).
Dense decode only: FP8 KV cache, sparse `indices` and attention sinks raise NotImplementedError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import vllm_pd.ops.library  # noqa: F401  (defines torch.ops.vllm_pd)


@dataclass
class FlashMLASchedMeta:
    """Stands in for FlashMLA's lazily filled scheduling metadata."""


def get_mla_metadata(*args, **kwargs) -> tuple[FlashMLASchedMeta, None]:
    return FlashMLASchedMeta(), None


def flash_mla_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
    tile_scheduler_metadata: object = None,
    num_splits: object = None,
    softmax_scale: float | None = None,
    causal: bool = False,
    is_fp8_kvcache: bool = False,
    indices: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
    backend: str | None = None,
    **unsupported: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns out [b, s_q, h_q, head_dim_v] and softmax_lse [b, h_q, s_q] (natural log, fp32)."""
    if (
        is_fp8_kvcache
        or indices is not None
        or attn_sink is not None
        or any(v is not None for v in unsupported.values())
    ):
        raise NotImplementedError("vllm_pd mla_decode is dense BF16/FP16/FP32 decode only")
    if softmax_scale is None:
        softmax_scale = q.shape[-1] ** -0.5
    return torch.ops.vllm_pd.mla_decode(
        q, k_cache, block_table, cache_seqlens, head_dim_v, float(softmax_scale), causal, backend
    )
