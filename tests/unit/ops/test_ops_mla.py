"""mla_decode numerics against the pure-PyTorch reference, with FlashMLA's own tolerances."""

from __future__ import annotations

import pytest
import torch

import vllm_pd.ops.library  # noqa: F401
from vllm_pd.ops import native, reference
from vllm_pd.ops.flash_mla_api import flash_mla_with_kvcache, get_mla_metadata
from vllm_pd.ops.testing import LSE_TOL, OUT_TOL, flash_mla_mismatch, mla_inputs

SCALE = 0.1352  # vLLM passes the model's scale, never 576 ** -0.5
KERNEL_ENV = "VLLM_PD_MLA_CPU_KERNEL"


def test_native_library_is_built():
    assert native.load_error() is None, native.load_error()


def _check(out, lse, ref_out, ref_lse):
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL) is None, flash_mla_mismatch(
        "out", out.float(), ref_out.float(), **OUT_TOL
    )
    lse_mismatch = flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL)
    assert lse_mismatch is None, lse_mismatch


CASES = [
    # seqlens, s_q, h_q, block_size: lengths 0 and 1, block boundaries (63/64/65), varlen
    ([0, 1, 63, 64, 65, 200], 1, 16, 64),
    ([1, 2, 17, 33], 2, 8, 16),  # s_q > seq_len: the first causal query sees nothing
    ([300, 5], 1, 128, 64),
    ([40, 16, 0], 3, 4, 16),
]


def _amx_unavailable() -> str | None:
    """None when the AMX kernel can run here, else why not (asked of the kernel itself)."""
    q, cache, table, lens = mla_inputs([1], 1, 1, 16, torch.bfloat16)
    mp = pytest.MonkeyPatch()
    mp.setenv(KERNEL_ENV, "amx")
    try:
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        mp.undo()
    return None


@pytest.fixture(params=["amx", "portable"])
def kernel(request, monkeypatch):
    """Runs a bf16 test once per CPU kernel, forced through VLLM_PD_MLA_CPU_KERNEL."""
    if request.param == "amx" and (why := _amx_unavailable()) is not None:
        pytest.skip(f"AMX kernel cannot run on this machine: {why}")
    monkeypatch.setenv(KERNEL_ENV, request.param)
    return request.param


@pytest.mark.parametrize("seqlens,s_q,h_q,block_size", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_native_matches_reference_bf16(seqlens, s_q, h_q, block_size, causal, kernel):
    q, cache, table, lens = mla_inputs(seqlens, s_q, h_q, block_size, torch.bfloat16)
    args = (q, cache, table, lens, 512, SCALE, causal)
    out, lse = torch.ops.vllm_pd.mla_decode(*args, "native")
    _check(out, lse, *reference.mla_decode(*args))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_native_other_dtypes(dtype):
    q, cache, table, lens = mla_inputs([5, 70], 2, 16, 16, dtype, seed=3)
    args = (q, cache, table, lens, 512, SCALE, True)
    out, lse = torch.ops.vllm_pd.mla_decode(*args, "native")
    _check(out, lse, *reference.mla_decode(*args))


def test_empty_rows_follow_flash_mla_convention():
    q, cache, table, lens = mla_inputs([0, 1], 2, 4, 16, torch.bfloat16)
    out, lse = torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
    assert torch.all(out[0] == 0) and torch.all(torch.isposinf(lse[0]))
    # sequence 1 has one token and two causal queries: query 0 sees nothing, query 1 sees it
    assert torch.all(out[1, 0] == 0) and torch.all(torch.isposinf(lse[1, :, 0]))
    assert torch.isfinite(lse[1, :, 1]).all()
    expected = cache[table[1, 0], 0, 0, :512].float().expand(4, 512)
    torch.testing.assert_close(out[1, 1].float(), expected, rtol=0.016, atol=1e-5)


def test_flash_mla_api_runs_flash_mla_code_unchanged():
    q, cache, table, lens = mla_inputs([10, 90], 1, 16, 64, torch.bfloat16)
    meta, num_splits = get_mla_metadata()
    out, lse = flash_mla_with_kvcache(q, cache, table, lens, 512, meta, num_splits, softmax_scale=SCALE, causal=True)
    _check(out, lse, *reference.mla_decode(q, cache, table, lens, 512, SCALE, True))
    # the 2025 signature (tensor metadata) is accepted as well
    meta, num_splits = get_mla_metadata(lens, 16, 1)
    out2, _ = flash_mla_with_kvcache(q, cache, table, lens, 512, meta, num_splits, softmax_scale=SCALE, causal=True)
    assert torch.equal(out, out2)
    with pytest.raises(NotImplementedError):
        flash_mla_with_kvcache(q, cache, table, lens, 512, meta, None, is_fp8_kvcache=True)


def test_default_scale_is_head_dim_rsqrt():
    q, cache, table, lens = mla_inputs([9], 1, 4, 16, torch.float32)
    out, _ = flash_mla_with_kvcache(q, cache, table, lens, 512, None, None)
    ref_out, _ = reference.mla_decode(q, cache, table, lens, 512, 576**-0.5, False)
    torch.testing.assert_close(out, ref_out)


def test_out_of_range_block_is_an_error():
    q, cache, table, lens = mla_inputs([20], 1, 4, 16, torch.bfloat16)
    table[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
    lens[0] = 10_000
    with pytest.raises(RuntimeError, match="cache_seqlens"):
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")


# Long and uneven sequences: cut into 256-token splits spread over the threads and merged by LSE;
# block sizes that are not whole 16-token tiles make the AMX kernel copy rows instead of reading
# them in place; q * 8 sharpens the softmax so running maxima change between chunks.
SPLIT_CASES = [
    ([1000, 37, 0, 513, 2049], 1, 16, 64, 1.0),
    ([777, 300], 2, 8, 16, 8.0),
    ([650, 129], 1, 32, 24, 1.0),
    ([300, 5, 90], 3, 16, 1, 8.0),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,block_size,q_gain", SPLIT_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_splits_and_odd_blocks_match_reference(seqlens, s_q, h_q, block_size, q_gain, threads, kernel):
    q, cache, table, lens = mla_inputs(seqlens, s_q, h_q, block_size, torch.bfloat16, seed=7)
    q = (q.float() * q_gain).bfloat16()
    args = (q, cache, table, lens, 512, SCALE, True)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out, lse = torch.ops.vllm_pd.mla_decode(*args, "native")
    finally:
        torch.set_num_threads(before)
    _check(out, lse, *reference.mla_decode(*args))


def test_strided_cache_rows(kernel):
    """A cache whose token rows are wider than head_dim (a view) is read through its strides."""
    q, cache, table, lens = mla_inputs([70, 33], 1, 16, 16, torch.bfloat16, seed=5)
    wide = torch.full((*cache.shape[:3], 640), float("nan"), dtype=cache.dtype)
    wide[..., :576] = cache
    view = wide[..., :576]
    assert view.stride(1) == 640
    args = (q, view, table, lens, 512, SCALE, True)
    _check(
        *torch.ops.vllm_pd.mla_decode(*args, "native"), *reference.mla_decode(q, cache, table, lens, 512, SCALE, True)
    )


def test_kernel_choice_is_validated(monkeypatch):
    q, cache, table, lens = mla_inputs([3], 1, 4, 16, torch.bfloat16)
    monkeypatch.setenv(KERNEL_ENV, "fastest")
    with pytest.raises(RuntimeError, match=KERNEL_ENV):
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
    if _amx_unavailable() is None:  # AMX handles bf16 only: forcing it on fp16 is an error, not a fallback
        monkeypatch.setenv(KERNEL_ENV, "amx")
        q16, c16 = q.half(), cache.half()
        with pytest.raises(RuntimeError, match="needs bf16"):
            torch.ops.vllm_pd.mla_decode(q16, c16, table, lens, 512, SCALE, True, "native")


@pytest.mark.parametrize("dim,dim_v", [(576, 480), (320, 96)])
def test_other_head_dims(dim, dim_v, kernel):
    """An odd number of 32-column output slices (480, 96) takes the AMX kernel's unpaired step."""
    q, cache, table, lens = mla_inputs([150, 7], 2, 16, 64, torch.bfloat16, seed=11, dim=dim)
    args = (q, cache, table, lens, dim_v, SCALE, True)
    _check(*torch.ops.vllm_pd.mla_decode(*args, "native"), *reference.mla_decode(*args))
