"""vllm_pd.ops.numerics, the entry points benchmarks/gpu_check.py calls on a GPU, rehearsed on
CPU with the native (C++) and reference backends on small shapes. The Triton backend's cases
run in the interpreter (tests/support/ops_triton_cases.py)."""

from __future__ import annotations

import pytest
import torch

from vllm_pd.ops import native, numerics
from vllm_pd.ops.numerics import GemmShape, MlaShape

CPU = torch.device("cpu")
SMALL_MLA = MlaShape(batch=3, context=300, h_q=16)
SMALL_GEMM = GemmShape(m=8, n=256, k=384)


def test_shapes_are_deepseek_and_deepgemm():
    assert {(s.h_q, s.dim, s.dim_v, s.page, s.s_q) for s in numerics.MLA_SHAPES} == {(128, 576, 512, 64, 1)}
    assert {s.batch for s in numerics.MLA_SHAPES} == {1, 8, 32, 128}
    assert {s.context for s in numerics.MLA_SHAPES} == {1024, 4096, 16384, 32768}
    assert GemmShape(4096, 7168, 16384) in numerics.GEMM_SHAPES and len(numerics.GEMM_SHAPES) == 28
    lens = MlaShape(8, 1024).seqlens()
    assert max(lens) == 1024 and len(set(lens)) == 8 and min(lens) > 1024 - 64


def test_backends_to_check_says_why_not():
    found = numerics.backends_to_check(CPU)
    assert found["native"] is None  # the C++ kernels
    assert "TRITON_INTERPRET" in found["triton"]


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_mla_case(backend):
    case = numerics.mla_case(backend, SMALL_MLA, CPU)
    assert case.ok, case.detail
    assert case.error < 1e-3 and case.op == "mla_decode" and case.backend == backend
    tokens = sum(SMALL_MLA.seqlens())
    assert case.bytes == 2 * (tokens * 576 + 3 * 16 * (576 + 512))
    assert case.flops == 2 * 16 * tokens * (576 + 512)
    out, lse = case.run()  # the kernel alone, again, on the same inputs
    assert out.shape == (3, 1, 16, 512) and lse.shape == (3, 16, 1)


@pytest.mark.parametrize("backend", ["native", "reference"])
def test_fp8_gemm_case(backend):
    case = numerics.fp8_gemm_case(backend, SMALL_GEMM, CPU)
    assert case.ok and case.error < 1e-5, case.detail
    assert case.flops == 2 * 8 * 256 * 384
    assert case.bytes == 8 * 384 + 256 * 384 + 4 * (8 * 3 + 2 * 3) + 2 * 8 * 256
    assert case.run() is None


def test_a_wrong_kernel_fails_its_case(monkeypatch):
    """Negative control: a kernel 2 % off is reported, with what was off."""
    real_mla, real_gemm = native.mla_decode, native.fp8_gemm_nt

    def off_mla(*args):
        out, lse = real_mla(*args)
        return out * 1.02, lse

    def off_gemm(a, sfa, b, sfb, d, c):
        real_gemm(a, sfa, b, sfb, d, c)
        d.mul_(1.1)

    monkeypatch.setattr(native, "mla_decode", off_mla)
    monkeypatch.setattr(native, "fp8_gemm_nt", off_gemm)
    mla = numerics.mla_case("native", SMALL_MLA, CPU)
    assert not mla.ok and mla.detail.startswith("out:"), mla.detail
    gemm = numerics.fp8_gemm_case("native", SMALL_GEMM, CPU)
    assert not gemm.ok and "calc_diff" in gemm.detail, gemm.detail
