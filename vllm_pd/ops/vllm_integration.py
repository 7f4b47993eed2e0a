"""Points vLLM at the vllm_pd ops: its MLA backend slots and, on request, its DeepGEMM hooks.

Runs from the vllm.general_plugins hook in every vLLM process, so it only records class paths
(no backend module is imported until vLLM picks the backend) and touches DeepGEMM only when
VLLM_PD_DEEP_GEMM=1.
"""

from __future__ import annotations

import os

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

ENV_DEEP_GEMM = "VLLM_PD_DEEP_GEMM"
CPU_MLA_PATH = "vllm_pd.ops.vllm_mla_backend.PDCpuMLABackend"
GPU_MLA_PATH = "vllm_pd.ops.vllm_mla_backend.PDTritonMLABackend"

# vllm.utils.deep_gemm resolves each DeepGEMM entry point into one of these globals once.
DEEP_GEMM_HOOKS = {
    "_fp8_gemm_nt_impl": "fp8_gemm_nt",
    "_grouped_impl": "m_grouped_fp8_gemm_nt_contiguous",
    "_grouped_masked_impl": "m_grouped_fp8_gemm_nt_masked",
    "_get_mk_alignment_for_contiguous_layout_impl": "get_mk_alignment_for_contiguous_layout",
    "_get_mn_major_tma_aligned_tensor_impl": "get_mn_major_tma_aligned_tensor",
}


def install() -> None:
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CPU_MLA, CPU_MLA_PATH)
    register_backend(AttentionBackendEnum.CUSTOM, GPU_MLA_PATH)
    logger.debug("vllm_pd MLA decode: CPU_MLA -> %s, CUSTOM -> %s", CPU_MLA_PATH, GPU_MLA_PATH)
    if os.environ.get(ENV_DEEP_GEMM) == "1":
        install_deep_gemm_hooks()


def install_deep_gemm_hooks() -> None:
    """Make vllm.utils.deep_gemm's wrappers call our ops instead of DeepGEMM.

    vLLM only takes its DeepGEMM path where `current_platform.support_deep_gemm()` (Hopper and
    Blackwell); its lazy loader keeps whatever is already bound, so binding first wins."""
    import vllm.utils.deep_gemm as vllm_deep_gemm

    from vllm_pd.ops import deep_gemm_api

    for hook, name in DEEP_GEMM_HOOKS.items():
        setattr(vllm_deep_gemm, hook, getattr(deep_gemm_api, name))
    logger.info("vllm_pd: vLLM's DeepGEMM wrappers now run torch.ops.vllm_pd FP8 GEMMs")
