"""Custom ops: MLA paged decode (FlashMLA semantics) and DeepGEMM-style block-scaled FP8 GEMMs.

torch.ops.vllm_pd.{mla_decode, fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous,
m_grouped_fp8_gemm_nt_masked}; FlashMLA- and DeepGEMM-shaped Python APIs in flash_mla_api and
deep_gemm_api; backend choice in backends (VLLM_PD_OPS_BACKEND=vendor|native|triton|reference).
"""

from __future__ import annotations

import os

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

ENV_VLLM_INTEGRATION = "VLLM_PD_VLLM_OPS"  # "0" leaves vLLM's own MLA backend and DeepGEMM path
_registered = False


def register() -> None:
    """Called by vllm_pd.register() in every vLLM process: cheap and idempotent.

    Makes vLLM's CPU rotary embedding correct for MLA models (see cpu_rope), and points vLLM's
    MLA backend slot and DeepGEMM hooks at our ops; the ops themselves (and the C++ library) load
    lazily on first use of the backend."""
    global _registered
    if _registered:
        return
    _registered = True
    # a correctness fix of vLLM's own CPU kernel, not one of our ops: always on
    from vllm_pd.ops import cpu_rope

    cpu_rope.install()
    if os.environ.get(ENV_VLLM_INTEGRATION, "1") == "0":
        logger.info("%s=0: vLLM keeps its own MLA backend and DeepGEMM path", ENV_VLLM_INTEGRATION)
        return
    from vllm_pd.ops import vllm_integration

    vllm_integration.install()
