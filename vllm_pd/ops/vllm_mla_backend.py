"""vLLM MLA attention backends whose decode (the MQA over the latent cache) runs
torch.ops.vllm_pd.mla_decode; prefill, KV-cache writes and metadata stay vLLM's.

- PDCpuMLABackend takes vLLM's CPU_MLA slot (vLLM's CPU platform only ever picks CPU_MLA or
  AMX_MLA, so the slot is the override point; `--attention-backend CPU_MLA` selects it on
  machines with AMX). Verified end to end on CPU (tests/e2e/test_ops_e2e.py).
- PDTritonMLABackend fills AttentionBackendEnum.CUSTOM on GPUs (`--attention-backend CUSTOM`):
  vLLM's Triton MLA backend with our decode. Written against vLLM 0.32 but not run: no GPU here.
"""

from __future__ import annotations

import torch
from vllm.model_executor.layers.attention.mla_attention import MLACommonMetadata
from vllm.v1.attention.backend import AttentionLayer
from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend, CPUMLAImpl
from vllm.v1.attention.backends.mla.triton_mla import TritonMLABackend, TritonMLAImpl

import vllm_pd.ops.library  # noqa: F401  (defines torch.ops.vllm_pd)
from vllm_pd.ops import backends
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)  # shows in the server log next to vLLM's own backend choice


def _announce(impl: object, device: str) -> None:
    choice = backends.requested_backend(None)
    logger.info(
        "vllm_pd MLA decode: %s runs torch.ops.vllm_pd.mla_decode (backend %s on %s)",
        type(impl).__name__,
        choice,
        device,
    )


def decode_with_vllm_pd(
    impl: CPUMLAImpl | TritonMLAImpl,
    q: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
    kv_c_and_k_pe_cache: torch.Tensor,
    attn_metadata: MLACommonMetadata,
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM hands one query token per decode request: q [B, H, 576], cache [blocks, block, 576]."""
    assert attn_metadata.decode is not None
    if isinstance(q, tuple):
        q = torch.cat(q, dim=-1)
    decode = attn_metadata.decode
    out, lse = torch.ops.vllm_pd.mla_decode(
        q.unsqueeze(1),
        kv_c_and_k_pe_cache.unsqueeze(-2),
        decode.block_table.to(torch.int32),
        decode.seq_lens.to(torch.int32),
        impl.kv_lora_rank,
        impl.scale,
        True,
    )
    return out.squeeze(1), lse.squeeze(-1)


class PDCpuMLAImpl(CPUMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _announce(self, "cpu")

    def forward_mqa(
        self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata, layer: AttentionLayer
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return decode_with_vllm_pd(self, q, kv_c_and_k_pe_cache, attn_metadata)


class PDCpuMLABackend(CPUMLABackend):
    @staticmethod
    def get_impl_cls() -> type[PDCpuMLAImpl]:
        return PDCpuMLAImpl


class PDTritonMLAImpl(TritonMLAImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _announce(self, "cuda")

    def forward_mqa(
        self, q, kv_c_and_k_pe_cache: torch.Tensor, attn_metadata: MLACommonMetadata, layer: AttentionLayer
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return decode_with_vllm_pd(self, q, kv_c_and_k_pe_cache, attn_metadata)


class PDTritonMLABackend(TritonMLABackend):
    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[PDTritonMLAImpl]:
        return PDTritonMLAImpl
