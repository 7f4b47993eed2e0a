"""FP8 block-scaled GEMMs (DeepGEMM semantics) against the dequantised reference: calc_diff < 1e-3."""

from __future__ import annotations

import pytest
import torch

import vllm_pd.ops.library  # noqa: F401
from vllm_pd.ops import deep_gemm_api as deep_gemm
from vllm_pd.ops import reference
from vllm_pd.ops.reference import calc_diff
from vllm_pd.ops.testing import fp8_operands

FP8 = [torch.float8_e4m3fn, torch.float8_e4m3fnuz]
TOL = 1e-3


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("m,n,k", [(1, 128, 128), (33, 256, 384), (70, 192, 200), (0, 128, 256), (5, 64, 7168)])
def test_fp8_gemm_nt(fp8, m, n, k):
    a, sfa, b, sfb = fp8_operands(m, n, k, fp8)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    ref = torch.empty_like(d)
    deep_gemm.fp8_gemm_nt((a, sfa), (b, sfb), d, backend="native")
    reference.fp8_gemm_nt(a, sfa, b, sfb, ref, None)
    assert calc_diff(d, ref) < TOL
    # and against the unquantised-weights product DeepGEMM's tests use, loosely
    if m:
        exact = reference.dequant_token(a, sfa) @ reference.dequant_block(b, sfb).t()
        assert calc_diff(d, exact) < TOL


def test_fp8_gemm_nt_accumulates_c_and_reads_mn_major_scales():
    a, sfa, b, sfb = fp8_operands(12, 256, 256)
    c = torch.randn(12, 256)
    sfa_mn_major = sfa.t().contiguous().t()  # DeepGEMM's TMA layout: stride(-2) == 1
    d = torch.empty(12, 256)
    ref = torch.empty_like(d)
    deep_gemm.fp8_gemm_nt((a, sfa_mn_major), (b, sfb), d, c=c, backend="native")
    reference.fp8_gemm_nt(a, sfa, b, sfb, ref, c)
    assert calc_diff(d, ref) < 1e-6


@pytest.mark.parametrize("fp8", FP8)
def test_grouped_contiguous(fp8):
    groups, n, k = 3, 128, 256
    sizes = [128, 0, 256]  # group 1 has no rows; rows are padded to 128 like DeepGEMM's layout
    layout = []
    for g, s in enumerate(sizes):
        real = max(0, s - 17)
        layout += [g] * real + [-1] * (s - real)
    m = len(layout)
    a, sfa, _, _ = fp8_operands(m, n, k, fp8)
    _, _, b, sfb = fp8_operands(n, n, k, fp8, groups=groups, seed=1)
    grouped = torch.tensor(layout, dtype=torch.int32)
    d = torch.full((m, n), 7.0, dtype=torch.bfloat16)
    ref = torch.empty_like(d)
    deep_gemm.m_grouped_fp8_gemm_nt_contiguous((a, sfa), (b, sfb), d, grouped, backend="native")
    reference.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, ref, grouped)
    assert calc_diff(d, ref) < TOL
    assert torch.all(d[grouped == -1] == 0)


@pytest.mark.parametrize("fp8", FP8)
def test_grouped_masked(fp8):
    groups, m_max, n, k = 4, 48, 128, 384
    a, sfa, b, sfb = fp8_operands(m_max, n, k, fp8, groups=groups)
    masked_m = torch.tensor([0, 1, 48, 20], dtype=torch.int32)
    d = torch.full((groups, m_max, n), 7.0, dtype=torch.bfloat16)
    ref = d.clone()
    deep_gemm.m_grouped_fp8_gemm_nt_masked((a, sfa), (b, sfb), d, masked_m, 32, backend="native")
    reference.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, ref, masked_m)
    for g, rows in enumerate(masked_m.tolist()):
        if rows:
            assert calc_diff(d[g, :rows], ref[g, :rows]) < TOL
        assert torch.all(d[g, rows:] == 7.0)  # rows past masked_m are left alone


def test_bad_group_id_is_an_error():
    a, sfa, _, _ = fp8_operands(4, 128, 128)
    _, _, b, sfb = fp8_operands(128, 128, 128, groups=2)
    d = torch.empty(4, 128, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="grouped_layout"):
        deep_gemm.m_grouped_fp8_gemm_nt_contiguous(
            (a, sfa), (b, sfb), d, torch.tensor([0, 1, 2, 0], dtype=torch.int32), backend="native"
        )
