"""Correct rotary embedding for MLA models on vLLM's CPU backend.

vLLM 0.32's CPU kernel ``torch.ops._C.rotary_embedding`` reads query and key as 2-D
``[tokens, heads * head_size]``: it takes the head count from ``size(-1) / head_size`` and
the token stride from ``stride(-2)``. The CUDA kernel also takes 3-D ``[tokens, heads,
head_size]``, and DeepSeek-V2's MLA passes exactly that, as strided views (``q_pe`` a slice
of q, ``k_pe`` a slice of the latent projection). On CPU, for a batch of more than one token:

- ``k_pe`` [T, 1, 64] with token stride 576 is walked with stride 64: rows after the first
  stay unrotated, and the rotation lands in other tokens' ``kv_c`` instead;
- ``q_pe`` [T, H, 64] is taken for T*H tokens of one head, with positions read past the end.

A single-token step is rotated right (``k_pe``) or nearly so, a prefill is not, so the KV a
prefill writes differs from what the same tokens get in a decode step. That is why a decode
instance that recomputes the last prompt token after loading prefill's KV diverged from a
plain instance (and why a plain instance disagrees with itself across batch shapes).

``install()`` wraps ``vllm._custom_ops.rotary_embedding`` (what every ``RotaryEmbedding
.forward_cpu`` calls, looked up at call time) so that CPU query/key of any other shape go to the
kernel as 2-D rows - a view when the strides allow, else a copy written back - and leaves
the 2-D calls (Llama-style models) and non-CPU tensors on the kernel's own path untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

_installed = False


def _kernel_rows(t: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, bool]:
    """``t`` as [num_tokens, heads * head_size] rows with unit stride inside a row, as the CPU
    kernel reads it; True when the rows are a copy that must be written back."""
    if t.dim() == 2 and t.stride(-1) == 1:
        return t, False
    try:
        rows = t.view(num_tokens, -1)
        if rows.stride(-1) == 1:
            return rows, False
    except RuntimeError:  # strides that no view can express: copy
        pass
    return t.reshape(num_tokens, -1).contiguous(), True


def stride_safe(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` (in-place rotary embedding) made correct for CPU query/key of any layout."""

    def rotary_embedding(
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor | None,
        head_size: int,
        cos_sin_cache: torch.Tensor,
        is_neox: bool,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        if query.device.type != "cpu":
            return kernel(positions, query, key, head_size, cos_sin_cache, is_neox, *args, **kwargs)
        n = positions.numel()
        q_rows, q_copied = _kernel_rows(query, n)
        k_rows, k_copied = (None, False) if key is None else _kernel_rows(key, n)
        kernel(positions, q_rows, k_rows, head_size, cos_sin_cache, is_neox, *args, **kwargs)
        if q_copied:
            query.copy_(q_rows.view(query.shape))
        if k_copied:
            assert key is not None and k_rows is not None
            key.copy_(k_rows.view(key.shape))
        return None

    rotary_embedding.__wrapped__ = kernel  # type: ignore[attr-defined]
    return rotary_embedding


def install() -> None:
    """Idempotent; only swaps the Python entry point (the C++ op itself is unchanged)."""
    global _installed
    if _installed:
        return
    import vllm._custom_ops as vllm_ops

    if not hasattr(vllm_ops, "rotary_embedding"):
        logger.warning("vllm._custom_ops has no rotary_embedding: CPU rotary fix not installed")
        return
    vllm_ops.rotary_embedding = stride_safe(vllm_ops.rotary_embedding)
    _installed = True
    logger.debug("vllm_pd: vLLM's CPU rotary embedding now takes 3-D / strided query and key")
