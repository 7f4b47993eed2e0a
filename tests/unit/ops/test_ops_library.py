"""Op registration (opcheck, torch.compile), input validation and run-time backend choice."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import vllm_pd.ops.library  # noqa: F401
from vllm_pd.ops import backends, reference, vendor
from vllm_pd.ops.backends import OpBackendError
from vllm_pd.ops.testing import fp8_operands, mla_inputs
from vllm_pd.ops.validation import OpInputError


def _mla_args():
    q, cache, table, lens = mla_inputs([3, 20], 2, 4, 16, torch.bfloat16)
    return q, cache, table, lens, 512, 0.1, True


def _gemm_args():
    a, sfa, b, sfb = fp8_operands(8, 128, 256)
    return a, sfa, b, sfb, torch.empty(8, 128, dtype=torch.bfloat16), None


def _contiguous_args():
    a, sfa, _, _ = fp8_operands(8, 128, 128)
    _, _, b, sfb = fp8_operands(128, 128, 128, groups=2)
    layout = torch.tensor([0] * 4 + [1] * 3 + [-1], dtype=torch.int32)
    return a, sfa, b, sfb, torch.empty(8, 128, dtype=torch.bfloat16), layout


def _masked_args():
    a, sfa, b, sfb = fp8_operands(8, 128, 128, groups=2)
    return a, sfa, b, sfb, torch.zeros(2, 8, 128, dtype=torch.bfloat16), torch.tensor([3, 8], dtype=torch.int32), 8


OPS = {
    "mla_decode": _mla_args,
    "fp8_gemm_nt": _gemm_args,
    "m_grouped_fp8_gemm_nt_contiguous": _contiguous_args,
    "m_grouped_fp8_gemm_nt_masked": _masked_args,
}


# opcheck's test_schema runs arithmetic on every input, which torch has no FP8 CPU kernel for
# ("mul_cpu_reduced_float" not implemented for Float8_e4m3fn); the GEMMs' mutation contract
# is checked by test_gemm_ops_mutate_only_d instead.
FP8_SAFE_CHECKS = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name", list(OPS))
@pytest.mark.parametrize("backend", ["native", "reference"])
def test_opcheck(name, backend):
    op = getattr(torch.ops.vllm_pd, name).default
    checks = None if name == "mla_decode" else FP8_SAFE_CHECKS
    torch.library.opcheck(op, OPS[name]() + (backend,), test_utils=checks or torch.library._OPCHECK_DEFAULT_UTILS)


@pytest.mark.parametrize("name", [n for n in OPS if n != "mla_decode"])
def test_gemm_ops_mutate_only_d(name):
    args = OPS[name]()
    before = [
        a.view(torch.uint8).clone()
        if isinstance(a, torch.Tensor) and a.element_size() == 1
        else (a.clone() if isinstance(a, torch.Tensor) else a)
        for a in args
    ]
    getattr(torch.ops.vllm_pd, name)(*args)
    for i, (a, b) in enumerate(zip(args, before)):
        if i == 4 or not isinstance(a, torch.Tensor):
            continue
        now = a.view(torch.uint8) if a.element_size() == 1 else a
        assert torch.equal(now, b), f"argument {i} of {name} was modified"
    assert not torch.equal(args[4], before[4])


def test_torch_compile_fullgraph():
    q, cache, table, lens, dv, scale, causal = _mla_args()
    a, sfa, b, sfb, d, _ = _gemm_args()

    def step(q, cache, table, lens, a, sfa, b, sfb, d):
        out, lse = torch.ops.vllm_pd.mla_decode(q, cache, table, lens, dv, scale, causal)
        torch.ops.vllm_pd.fp8_gemm_nt(a, sfa, b, sfb, d)
        return out.float().sum(-1) * 2, lse, d * 1

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(q, cache, table, lens, a, sfa, b, sfb, d.clone())
    want = step(q, cache, table, lens, a, sfa, b, sfb, d.clone())
    for x, y in zip(got, want):
        torch.testing.assert_close(x, y, equal_nan=True)


def test_fake_kernels_give_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) if isinstance(t, torch.Tensor) else t for t in _mla_args()]
        out, lse = torch.ops.vllm_pd.mla_decode(*args)
    assert out.shape == (2, 2, 4, 512) and out.dtype == torch.bfloat16
    assert lse.shape == (2, 4, 2) and lse.dtype == torch.float32


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "q dtype"),
        (lambda a: a.__setitem__(0, a[0][0]), "q must be"),
        (lambda a: a.__setitem__(1, a[1].expand(-1, -1, 2, -1)), "one latent KV head"),
        (lambda a: a.__setitem__(1, a[1].half()), "k_cache dtype"),
        (lambda a: a.__setitem__(1, a[1][..., :512]), "k_cache head_dim"),
        (lambda a: a.__setitem__(2, a[2].long()), "block_table"),
        (lambda a: a.__setitem__(3, a[3][:1]), "cache_seqlens"),
        (lambda a: a.__setitem__(4, 600), "head_dim_v"),
        (lambda a: a.__setitem__(0, a[0].transpose(-1, -2).contiguous().transpose(-1, -2)), "q's last dimension"),
    ],
)
def test_mla_bad_input_names_the_argument(change, match):
    args = list(_mla_args())
    change(args)
    with pytest.raises(OpInputError, match=match):
        torch.ops.vllm_pd.mla_decode(*args)


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda a: a.__setitem__(0, a[0].float()), "a dtype"),
        (lambda a: a.__setitem__(2, a[2].to(torch.float8_e4m3fnuz)), "share one fp8 dtype"),
        (lambda a: a.__setitem__(1, a[1].to(torch.int32)), "sfa must be float32"),
        (lambda a: a.__setitem__(3, a[3][:, :1]), "sfb must have shape"),
        (lambda a: a.__setitem__(2, a[2][:, :128]), "b has K=128"),
        (lambda a: a.__setitem__(4, a[4].to(torch.int8)), "d dtype"),
        (lambda a: a.__setitem__(4, a[4].t()), "d must have shape"),
        (lambda a: a.__setitem__(5, torch.zeros(8, 128, dtype=torch.bfloat16)), "c must be float32"),
    ],
)
def test_gemm_bad_input_names_the_argument(change, match):
    args = list(_gemm_args())
    change(args)
    with pytest.raises(OpInputError, match=match):
        torch.ops.vllm_pd.fp8_gemm_nt(*args)


def test_grouped_bad_input():
    args = list(_contiguous_args())
    args[5] = args[5].long()
    with pytest.raises(OpInputError, match="grouped_layout must be int32"):
        torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_contiguous(*args)
    args = list(_masked_args())
    args[5] = torch.tensor([1], dtype=torch.int32)
    with pytest.raises(OpInputError, match="masked_m must be int32"):
        torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_masked(*args)


def test_auto_backend_on_cpu_is_native():
    assert backends.select("mla_decode", torch.device("cpu")).__name__ == "vllm_pd.ops.native"


def test_backend_forced_by_env(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "reference")
    assert backends.select("fp8_gemm_nt", torch.device("cpu")) is reference
    monkeypatch.setenv(backends.ENV_VAR, "fastest")
    with pytest.raises(OpBackendError, match="VLLM_PD_OPS_BACKEND='fastest'"):
        backends.select("fp8_gemm_nt", torch.device("cpu"))


def test_forced_backend_that_cannot_run_is_an_error(monkeypatch):
    with pytest.raises(OpBackendError, match="'vendor' cannot run mla_decode on cpu: FlashMLA and DeepGEMM need CUDA"):
        torch.ops.vllm_pd.mla_decode(*_mla_args(), "vendor")
    from vllm_pd.ops import triton_backend

    monkeypatch.setattr(triton_backend, "_interpreted", lambda: False)
    with pytest.raises(OpBackendError, match="TRITON_INTERPRET=1"):
        torch.ops.vllm_pd.fp8_gemm_nt(*_gemm_args(), "triton")


def test_register_is_idempotent_and_cheap(monkeypatch):
    import vllm_pd.ops as ops

    calls = []
    monkeypatch.setattr(ops, "_registered", False)
    stub = types.SimpleNamespace(install=lambda: calls.append(1))
    # `from vllm_pd.ops import vllm_integration` finds the package attribute first once
    # another test imported the real module, so stub both places
    monkeypatch.setitem(sys.modules, "vllm_pd.ops.vllm_integration", stub)
    monkeypatch.setattr(ops, "vllm_integration", stub, raising=False)
    ops.register()
    ops.register()
    assert calls == [1]


# --- vendor probing: no GPU here, so stand-in modules with the vendors' signatures -------------


def _flash_mla_2026():
    mod = types.ModuleType("flash_mla")
    mod.get_mla_metadata = lambda *args, **kwargs: ("sched", None)

    def flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits=None,
        softmax_scale=None,
        causal=False,
        **kw,
    ):
        assert tile_scheduler_metadata == "sched" and num_splits is None
        return reference.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

    mod.flash_mla_with_kvcache = flash_mla_with_kvcache
    return mod


def _flash_mla_2025():
    mod = types.ModuleType("flash_mla")
    seen = {}

    def get_mla_metadata(cache_seqlens, num_heads_per_head_k, num_heads_k, num_heads_q=None):
        seen.update(per_k=num_heads_per_head_k, k=num_heads_k, q=num_heads_q)
        return torch.zeros(4, 8, dtype=torch.int32), torch.zeros(cache_seqlens.numel() + 1, dtype=torch.int32)

    def flash_mla_with_kvcache(
        q,
        k_cache,
        block_table,
        cache_seqlens,
        head_dim_v,
        tile_scheduler_metadata,
        num_splits,
        softmax_scale=None,
        causal=False,
    ):
        assert tile_scheduler_metadata.shape == (4, 8)
        return reference.mla_decode(q, k_cache, block_table, cache_seqlens, head_dim_v, softmax_scale, causal)

    mod.get_mla_metadata, mod.flash_mla_with_kvcache, mod.seen = get_mla_metadata, flash_mla_with_kvcache, seen
    return mod


@pytest.mark.parametrize("make,lazy", [(_flash_mla_2026, True), (_flash_mla_2025, False)])
def test_vendor_flash_mla_generations(monkeypatch, make, lazy):
    mod = make()
    probed = vendor.probe_flash_mla(mod)
    assert probed is not None and probed.lazy_metadata is lazy
    monkeypatch.setattr(vendor, "flash_mla", lambda: probed)
    q, cache, table, lens = mla_inputs([5, 70], 2, 16, 64, torch.bfloat16)
    out, lse = vendor.mla_decode(q, cache, table, lens, 512, 0.1, True)
    ref_out, ref_lse = reference.mla_decode(q, cache, table, lens, 512, 0.1, True)
    assert torch.equal(out, ref_out)
    if not lazy:
        assert mod.seen == {"per_k": 32, "k": 1, "q": 16}
    assert vendor.rejects("mla_decode", (q, cache[:, :16], table, lens, 512)) is not None
    assert vendor.rejects("mla_decode", (q, cache, table, lens, 512)) is None


def test_vendor_deep_gemm_names(monkeypatch):
    calls = []
    legacy = types.ModuleType("deep_gemm")
    legacy.gemm_fp8_fp8_bf16_nt = lambda a, b, d: calls.append(("legacy", d.shape))
    legacy.get_col_major_tma_aligned_tensor = lambda sf: sf.t().contiguous().t()
    modern = types.ModuleType("deep_gemm")
    modern.fp8_gemm_nt = lambda a, b, d, c=None, disable_ue8m0_cast=False: calls.append(("modern", disable_ue8m0_cast))
    modern.fp8_m_grouped_gemm_nt_masked = lambda *a, **k: calls.append(("masked", k))
    for mod in (legacy, modern):
        probed = vendor.probe_deep_gemm(mod)
        monkeypatch.setattr(vendor, "deep_gemm", lambda probed=probed: probed)
        vendor.fp8_gemm_nt(*_gemm_args())
    assert calls == [("legacy", (8, 128)), ("modern", True)]
    assert vendor.probe_deep_gemm(legacy).legacy and vendor.probe_deep_gemm(modern).masked is not None
    args = _gemm_args()
    assert "N % 64" in vendor.rejects("fp8_gemm_nt", (args[0], args[1], args[2][:100], args[3], args[4], None))
