"""Definitions of the torch.ops.vllm_pd.* ops: schema, fake (meta) kernel and the real kernel,
which validates its input and runs the backend chosen by vllm_pd.ops.backends.

The ops are opaque to torch.compile (fullgraph works through the fake kernels) and take an
optional `backend` argument, so a forced choice is part of the traced graph.
"""

from __future__ import annotations

import torch

from vllm_pd.ops import backends, validation

NAMESPACE = "vllm_pd"

_SCHEMAS = {
    "mla_decode": "mla_decode(Tensor q, Tensor k_cache, Tensor block_table, Tensor cache_seqlens, "
    "int head_dim_v, float softmax_scale, bool causal, str? backend=None) -> (Tensor, Tensor)",
    "fp8_gemm_nt": "fp8_gemm_nt(Tensor a, Tensor sfa, Tensor b, Tensor sfb, Tensor(a!) d, "
    "Tensor? c=None, str? backend=None) -> ()",
    "m_grouped_fp8_gemm_nt_contiguous": "m_grouped_fp8_gemm_nt_contiguous(Tensor a, Tensor sfa, "
    "Tensor b, Tensor sfb, Tensor(a!) d, Tensor grouped_layout, str? backend=None) -> ()",
    "m_grouped_fp8_gemm_nt_masked": "m_grouped_fp8_gemm_nt_masked(Tensor a, Tensor sfa, Tensor b, "
    "Tensor sfb, Tensor(a!) d, Tensor masked_m, int expected_m, str? backend=None) -> ()",
}


def _mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, backend=None):
    validation.check_mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v)
    args = (q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)
    impl = backends.select("mla_decode", q.device, backend, args)
    return impl.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)


def _mla_decode_fake(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal, backend=None):
    validation.check_mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v)
    b, s_q, h_q, _ = q.shape
    out = q.new_empty((b, s_q, h_q, head_dim_v))
    lse = q.new_empty((b, h_q, s_q), dtype=torch.float32)
    return out, lse


def _fp8_gemm_nt(a, sfa, b, sfb, d, c=None, backend=None):
    validation.check_fp8_gemm_nt(a, sfa, b, sfb, d, c)
    impl = backends.select("fp8_gemm_nt", a.device, backend, (a, sfa, b, sfb, d, c))
    impl.fp8_gemm_nt(a, sfa, b, sfb, d, c)


def _fp8_gemm_nt_fake(a, sfa, b, sfb, d, c=None, backend=None):
    validation.check_fp8_gemm_nt(a, sfa, b, sfb, d, c)


def _contiguous(a, sfa, b, sfb, d, grouped_layout, backend=None):
    validation.check_grouped_contiguous(a, sfa, b, sfb, d, grouped_layout)
    args = (a, sfa, b, sfb, d, grouped_layout)
    impl = backends.select("m_grouped_fp8_gemm_nt_contiguous", a.device, backend, args)
    impl.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, grouped_layout)


def _contiguous_fake(a, sfa, b, sfb, d, grouped_layout, backend=None):
    validation.check_grouped_contiguous(a, sfa, b, sfb, d, grouped_layout)


def _masked(a, sfa, b, sfb, d, masked_m, expected_m, backend=None):
    validation.check_grouped_masked(a, sfa, b, sfb, d, masked_m)
    args = (a, sfa, b, sfb, d, masked_m, expected_m)
    impl = backends.select("m_grouped_fp8_gemm_nt_masked", a.device, backend, args)
    impl.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, expected_m)


def _masked_fake(a, sfa, b, sfb, d, masked_m, expected_m, backend=None):
    validation.check_grouped_masked(a, sfa, b, sfb, d, masked_m)


_IMPLS = {
    "mla_decode": (_mla_decode, _mla_decode_fake),
    "fp8_gemm_nt": (_fp8_gemm_nt, _fp8_gemm_nt_fake),
    "m_grouped_fp8_gemm_nt_contiguous": (_contiguous, _contiguous_fake),
    "m_grouped_fp8_gemm_nt_masked": (_masked, _masked_fake),
}


def _define() -> torch.library.Library:
    lib = torch.library.Library(NAMESPACE, "DEF")  # kept alive by the module: ops live as long as it
    for name, schema in _SCHEMAS.items():
        impl, fake = _IMPLS[name]
        lib.define(schema)
        # ROCm/HIP tensors use the CUDA dispatch key too.
        for key in ("CPU", "CUDA"):
            lib.impl(name, impl, key)
        torch.library.register_fake(f"{NAMESPACE}::{name}", fake, lib=lib)
    return lib


_LIBRARY = _define()
