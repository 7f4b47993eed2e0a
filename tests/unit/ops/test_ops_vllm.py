"""The vLLM hooks: our MLA backend in vLLM's CPU_MLA slot (decode through torch.ops.vllm_pd)
and vLLM's DeepGEMM wrappers bound to our FP8 GEMMs."""

from __future__ import annotations

import types

import pytest
import torch

from vllm_pd.ops import reference, vllm_integration
from vllm_pd.ops.testing import fp8_operands, mla_inputs


@pytest.fixture
def clean_overrides():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    yield AttentionBackendEnum
    AttentionBackendEnum.CPU_MLA.clear_override()
    AttentionBackendEnum.CUSTOM.clear_override()


def test_install_registers_backends(clean_overrides):
    enum = clean_overrides
    vllm_integration.install()
    assert enum.CPU_MLA.get_path() == vllm_integration.CPU_MLA_PATH
    assert enum.CUSTOM.get_path() == vllm_integration.GPU_MLA_PATH
    backend = enum.CPU_MLA.get_class()
    assert backend.get_name() == "CPU_MLA" and backend.get_impl_cls().__name__ == "PDCpuMLAImpl"


def test_backend_decode_matches_reference():
    from vllm_pd.ops.vllm_mla_backend import decode_with_vllm_pd

    q, cache, table, lens = mla_inputs([5, 33, 16], 1, 16, 16, torch.bfloat16)
    impl = types.SimpleNamespace(kv_lora_rank=512, scale=0.125)
    decode = types.SimpleNamespace(block_table=table.long(), seq_lens=lens.long())
    out, lse = decode_with_vllm_pd(
        impl, (q[:, 0, :, :512], q[:, 0, :, 512:]), cache.squeeze(2), types.SimpleNamespace(decode=decode)
    )
    ref_out, ref_lse = reference.mla_decode(q, cache, table, lens, 512, 0.125, True)
    assert out.shape == (3, 16, 512) and lse.shape == (3, 16)
    torch.testing.assert_close(out, ref_out[:, 0], rtol=0.016, atol=1e-3)


def test_deep_gemm_hooks_route_vllm_wrappers_to_our_ops(monkeypatch):
    import vllm.utils.deep_gemm as vdg

    for hook in vllm_integration.DEEP_GEMM_HOOKS:
        monkeypatch.setattr(vdg, hook, None)
    vllm_integration.install_deep_gemm_hooks()
    a, sfa, b, sfb = fp8_operands(16, 128, 256)
    d, ref = torch.empty(16, 128, dtype=torch.bfloat16), torch.empty(16, 128, dtype=torch.bfloat16)
    vdg.fp8_gemm_nt((a, sfa), (b, sfb), d)  # vLLM's own wrapper, as its linear layers call it
    reference.fp8_gemm_nt(a, sfa, b, sfb, ref, None)
    assert reference.calc_diff(d, ref) < 1e-3
    assert vdg.get_mk_alignment_for_contiguous_layout() == [128, 128]
