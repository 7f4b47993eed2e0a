"""Triton-kernel cases; run by test_ops_triton.py under TRITON_INTERPRET=1 (small shapes: slow)."""

from __future__ import annotations

import os

import pytest
import torch

assert os.environ.get("TRITON_INTERPRET") == "1", "run through tests/unit/ops/test_ops_triton.py"

import vllm_pd.ops.library  # noqa: E402,F401
from vllm_pd.ops import reference  # noqa: E402
from vllm_pd.ops.reference import calc_diff  # noqa: E402
from vllm_pd.ops.testing import LSE_TOL, OUT_TOL, flash_mla_mismatch, fp8_operands, mla_inputs  # noqa: E402


@pytest.mark.parametrize(
    "seqlens,s_q,h_q,block_size,causal",
    [
        ([0, 1, 17, 33], 1, 16, 16, True),
        ([1, 40], 2, 4, 16, True),  # first causal query of the 1-token sequence sees nothing
        ([64, 65], 1, 20, 64, False),  # rows across two programs, block boundary
    ],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mla_decode(seqlens, s_q, h_q, block_size, causal, dtype):
    q, cache, table, lens = mla_inputs(seqlens, s_q, h_q, block_size, dtype)
    args = (q, cache, table, lens, 512, 0.1352, causal)
    out, lse = torch.ops.vllm_pd.mla_decode(*args, "triton")
    ref_out, ref_lse = reference.mla_decode(*args)
    assert flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL) is None, flash_mla_mismatch(
        "out", out.float(), ref_out.float(), **OUT_TOL
    )
    lse_mismatch = flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL)
    assert lse_mismatch is None, lse_mismatch


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e4m3fnuz])
def test_fp8_gemm_nt(fp8):
    a, sfa, b, sfb = fp8_operands(70, 192, 200, fp8)
    c = torch.randn(70, 192)
    d, ref = torch.empty(70, 192), torch.empty(70, 192)
    torch.ops.vllm_pd.fp8_gemm_nt(a, sfa, b, sfb, d, c, "triton")
    reference.fp8_gemm_nt(a, sfa, b, sfb, ref, c)
    assert calc_diff(d, ref) < 1e-3


def test_grouped_contiguous():
    layout = torch.tensor([0] * 100 + [-1] * 28 + [1] * 128, dtype=torch.int32)
    a, sfa, _, _ = fp8_operands(256, 128, 128)
    _, _, b, sfb = fp8_operands(128, 128, 128, groups=2, seed=2)
    d = torch.full((256, 128), 3.0, dtype=torch.bfloat16)
    ref = torch.empty_like(d)
    torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, layout, "triton")
    reference.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, ref, layout)
    assert calc_diff(d, ref) < 1e-3 and torch.all(d[layout == -1] == 0)


def test_grouped_masked():
    a, sfa, b, sfb = fp8_operands(40, 128, 256, groups=3)
    masked_m = torch.tensor([0, 40, 7], dtype=torch.int32)
    d = torch.full((3, 40, 128), 3.0, dtype=torch.bfloat16)
    ref = d.clone()
    torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked_m, 16, "triton")
    reference.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, ref, masked_m)
    assert calc_diff(d[1], ref[1]) < 1e-3 and calc_diff(d[2, :7], ref[2, :7]) < 1e-3
    assert torch.all(d[0] == 3.0) and torch.all(d[2, 7:] == 3.0)


def test_numerics_cases_run_the_triton_backend():
    """vllm_pd.ops.numerics (what gpu_check calls on a GPU) through the Triton backend."""
    from vllm_pd.ops import numerics

    cpu = torch.device("cpu")
    assert numerics.backends_to_check(cpu)["triton"] is None
    mla = numerics.mla_case("triton", numerics.MlaShape(batch=2, context=70, h_q=16), cpu)
    assert mla.ok, mla.detail
    gemm = numerics.fp8_gemm_case("triton", numerics.GemmShape(m=8, n=128, k=256), cpu)
    assert gemm.ok, gemm.detail
    gemm.run()
