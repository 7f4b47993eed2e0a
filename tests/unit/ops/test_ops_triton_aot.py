"""Every GPU variant of the Triton kernels compiles for Hopper (sm_90a) here, without a GPU.

The interpreter run (test_ops_triton.py) covers only the CPU-safe variants: fp32 dots and
stores, no FP8 MMA. These tests compile what a GPU launches - FP8 `tl.dot`, bf16 / fp16
stores, bf16 MMA - with Triton's compiler for GPUTarget("cuda", 90, 32) and the ptxas of the
Triton wheel, on DeepSeek-V3 MLA decode and DeepGEMM shapes, and look at the PTX; only running
the cubin needs a GPU (one test mocks the device's target to check the op path's fnuz refusal).
They must not run with TRITON_INTERPRET=1 (the kernels would be interpreter objects)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the ops' triton backend does not exist here")

from triton.backends.compiler import GPUTarget
from triton.compiler import CompilationError

from vllm_pd.ops import backends
from vllm_pd.ops import triton_aot as aot
from vllm_pd.ops import triton_backend as tb
from vllm_pd.ops import triton_kernels as tk
from vllm_pd.ops.backends import OpBackendError
from vllm_pd.ops.testing import fp8_operands

HOPPER_SMEM = 227 * 1024  # the most shared memory an sm_90 CTA can opt in to
VARIANTS, REFUSED = aot.hopper_variants()


@pytest.fixture(scope="module", autouse=True)
def fresh_triton_cache(tmp_path_factory):
    """A real compile each run, not a hit in ~/.triton/cache."""
    patch = pytest.MonkeyPatch()
    patch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton-cache")))
    yield
    patch.undo()


def test_variants_cover_every_gpu_switch():
    names = [v.name for v in VARIANTS]
    assert not tb._interpreted(), "TRITON_INTERPRET=1 is set: these tests compile for a GPU"
    mla = [v.launch.constexprs for v in VARIANTS if v.launch.kernel is tk.mla_decode_kernel]
    assert {(c["DOT_F32"], c["CAUSAL"]) for c in mla} == {(False, False), (False, True), (True, False), (True, True)}
    assert all(c["D"] == 576 and c["DV"] == 512 and c["PAGE"] == 64 for c in mla)
    gemm = [v.launch.constexprs for v in VARIANTS if v.launch.kernel is tk.fp8_gemm_kernel]
    assert {(c["MODE"], c["HAS_C"]) for c in gemm} == {(0, False), (0, True), (1, False), (2, False)}
    assert all(c["FP8_DOT"] and not c["DOT_F32"] for c in gemm)
    assert len(mla) == 6 and len(gemm) == 12 and len(set(names)) == len(names), names


@pytest.mark.parametrize("variant", VARIANTS, ids=[v.name for v in VARIANTS])
def test_compiles_for_sm90a(variant):
    compiled = aot.compile_variant(variant, aot.HOPPER)
    assert compiled.cubin_bytes > 0
    assert ".target sm_90a" in compiled.ptx
    assert compiled.shared_bytes <= HOPPER_SMEM, compiled.shared_bytes
    # bf16 / fp16 outputs are rounded (to nearest) and stored as such on GPUs, not as fp32
    out = variant.launch.args[4]
    rounding = {torch.bfloat16: "cvt.rn.bf16x2.f32", torch.float16: "cvt.rn.f16x2.f32"}.get(out.dtype)
    assert rounding is None or rounding in compiled.ptx, out.dtype
    if variant.fp8_dot:  # Hopper's FP8 tensor cores, not an upcast
        assert any(i.startswith("wgmma.mma_async") and i.endswith(".e4m3.e4m3") for i in compiled.mma), compiled.mma
        return
    operand = {torch.bfloat16: ".bf16.bf16", torch.float16: ".f16.f16", torch.float32: ".tf32.tf32"}
    assert any(operand[out.dtype] in i for i in compiled.mma), compiled.mma


def test_fnuz_is_refused_for_nvidia_and_kept_for_rocm():
    assert list(REFUSED) == ["torch.float8_e4m3fnuz"]
    reason = REFUSED["torch.float8_e4m3fnuz"]
    assert "float8_e4m3fnuz" in reason and "quantize with float8_e4m3fn" in reason, reason
    assert tb.fp8_rejection(torch.float8_e4m3fn, aot.HOPPER) is None
    assert "float8_e4m3fn" in tb.fp8_rejection(torch.float8_e4m3fn, GPUTarget("cuda", 80, 32))  # A100: no e4m3
    assert tb.fp8_rejection(torch.float8_e4m3fnuz, GPUTarget("hip", "gfx942", 64)) is None  # MI300
    assert not any("fp8e4b8" in v.name for v in VARIANTS)


def test_fnuz_would_not_compile_for_hopper():
    """Negative control: what the guard prevents. Without it the backend handed fnuz operands
    to an FP8 dot on NVIDIA, and the first launch failed inside Triton's compiler."""
    a, sfa, b, sfb, d, c, layout, masked_m, groups, m = aot._gemm_operands(
        tk.MODE_PLAIN, torch.float8_e4m3fnuz, torch.bfloat16, False
    )
    launch = tb.fp8_gemm_launch(
        tk.MODE_PLAIN, a, sfa, b, sfb, d, c, layout, masked_m, groups, m, fp8_dot=True, interpreted=False
    )
    with pytest.raises(CompilationError, match="fp8e4b8"):
        aot.compile_variant(aot.Variant("fnuz", launch, fp8_dot=True), aot.HOPPER)


def test_forced_triton_refuses_fnuz_on_an_nvidia_gpu(monkeypatch):
    """The op path: backend selection asks the Triton backend, which refuses fnuz on an NVIDIA
    target with the reason. The GPU is mocked (CPU tensors, a Hopper target)."""
    monkeypatch.setattr(tb, "unavailable_reason", lambda op, device: None)
    monkeypatch.setattr(tb, "target_of", lambda device: aot.HOPPER)
    for op in tb.GEMM_OPS:
        a, sfa, b, sfb = fp8_operands(8, 128, 128, torch.float8_e4m3fnuz)
        with pytest.raises(OpBackendError, match="float8_e4m3fnuz is AMD's FP8 format"):
            backends.select(op, a.device, "triton", (a, sfa, b, sfb, torch.empty(8, 128)))
    a, sfa, b, sfb = fp8_operands(8, 128, 128, torch.float8_e4m3fn)
    assert backends.select("fp8_gemm_nt", a.device, "triton", (a, sfa, b, sfb, torch.empty(8, 128), None)) is tb
