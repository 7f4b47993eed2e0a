"""mla_decode numerics against the pure-PyTorch reference, with FlashMLA's own tolerances."""

from __future__ import annotations

import pytest
import torch

import vllm_pd.ops.library  # noqa: F401
from vllm_pd.ops import native, reference
from vllm_pd.ops.flash_mla_api import flash_mla_with_kvcache, get_mla_metadata
from vllm_pd.ops.testing import LSE_TOL, OUT_TOL, flash_mla_mismatch, mla_inputs

SCALE = 0.1352  # vLLM passes the model's scale, never 576 ** -0.5


def test_native_library_is_built():
    assert native.load_error() is None, native.load_error()


def _check(out, lse, ref_out, ref_lse):
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    assert lse.shape == ref_lse.shape and lse.dtype == torch.float32
    assert flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL) is None, \
        flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL)
    assert flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL) is None, flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL)


CASES = [
    # seqlens, s_q, h_q, block_size: lengths 0 and 1, block boundaries (63/64/65), varlen
    ([0, 1, 63, 64, 65, 200], 1, 16, 64),
    ([1, 2, 17, 33], 2, 8, 16),  # s_q > seq_len: the first causal query sees nothing
    ([300, 5], 1, 128, 64),
    ([40, 16, 0], 3, 4, 16),
]


@pytest.mark.parametrize("seqlens,s_q,h_q,block_size", CASES)
@pytest.mark.parametrize("causal", [True, False])
def test_native_matches_reference_bf16(seqlens, s_q, h_q, block_size, causal):
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
    ref_out, _ = reference.mla_decode(q, cache, table, lens, 512, 576 ** -0.5, False)
    torch.testing.assert_close(out, ref_out)


def test_out_of_range_block_is_an_error():
    q, cache, table, lens = mla_inputs([20], 1, 4, 16, torch.bfloat16)
    table[0, 1] = 10_000
    with pytest.raises(RuntimeError, match="block_table"):
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
    lens[0] = 10_000
    with pytest.raises(RuntimeError, match="cache_seqlens"):
        torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, SCALE, True, "native")
