"""Test-data generators and the vendor libraries' own accuracy checks (used by tests and benchmarks)."""

from __future__ import annotations

import torch

from vllm_pd.ops.reference import per_block_cast_to_fp8, per_token_cast_to_fp8

# FlashMLA dense decode (tests/test_flash_mla_dense_decoding.py): out and lse tolerances.
OUT_TOL = dict(abs_tol=8e-4, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
LSE_TOL = dict(abs_tol=1e-6, rel_tol=8.01 / 65536, cos_diff_tol=5e-6)
BAD_BLOCK = 2147480000  # FlashMLA's marker for block-table entries past a sequence's end


def flash_mla_mismatch(name: str, ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float,
                       cos_diff_tol: float) -> str | None:
    """FlashMLA's check_is_allclose: None when `ans` passes, otherwise what failed.

    NaN / +inf / -inf positions must match; each finite element passes if abs_err < abs_tol or
    rel_err < rel_tol; the cosine difference over the finite elements must be < cos_diff_tol."""
    ans, ref = ans.double(), ref.double()
    for what, fn in (("nan", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        if not torch.equal(fn(ans), fn(ref)):
            return f"{name}: {what} positions differ"
    finite = torch.isfinite(ref)
    a, r = ans[finite], ref[finite]
    if a.numel() == 0:
        return None
    abs_err = (a - r).abs()
    rel_err = abs_err / r.abs().clamp(min=1e-12)
    bad = ~((abs_err < abs_tol) | (rel_err < rel_tol))
    if bad.any():
        i = int(bad.nonzero()[0])
        return f"{name}: {int(bad.sum())} elements off, e.g. {a[i].item()} vs {r[i].item()}"
    denominator = (a * a + r * r).sum().clamp(min=1e-12)
    cos_diff = float(1 - 2 * (a * r).sum() / denominator)
    if cos_diff >= cos_diff_tol:
        return f"{name}: cosine difference {cos_diff:.3g} >= {cos_diff_tol}"
    return None


def mla_inputs(seqlens: list[int], s_q: int, h_q: int, block_size: int, dtype: torch.dtype,
               seed: int = 0, dim: int = 576) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA-style data: q, k ~ randn/10 clamped to [-1, 1]; blocks in random order; every
    unused cache slot is NaN and unused block-table entries are out of range, so a kernel that
    reads past a sequence shows it."""
    g = torch.Generator().manual_seed(seed)
    b = len(seqlens)
    per_seq = [max(1, -(-n // block_size)) for n in seqlens]
    max_blocks = max(per_seq)
    num_blocks = sum(per_seq) + 2
    q = (torch.randn(b, s_q, h_q, dim, generator=g) / 10).clamp(-1, 1).to(dtype)
    cache = torch.full((num_blocks, block_size, 1, dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=g).int()
    table = torch.full((b, max_blocks), BAD_BLOCK, dtype=torch.int32)
    used = 0
    for i, n in enumerate(seqlens):
        ids = order[used: used + per_seq[i]]
        used += per_seq[i]
        table[i, : len(ids)] = ids
        if n:
            kv = (torch.randn(n, dim, generator=g) / 10).clamp(-1, 1).to(dtype)
            flat = cache[ids.long()].view(-1, dim)
            flat[:n] = kv
            cache[ids.long()] = flat.view(len(ids), block_size, 1, dim)
    return q, cache, table, torch.tensor(seqlens, dtype=torch.int32)


def fp8_operands(m: int, n: int, k: int, dtype: torch.dtype = torch.float8_e4m3fn, groups: int | None = None,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM-style quantised operands: a [(G,) m, k] 1x128-scaled, b [(G,) n, k] 128x128-scaled."""
    g = torch.Generator().manual_seed(seed)
    if groups is None:
        a, sfa = per_token_cast_to_fp8(torch.randn(m, k, generator=g), dtype)
        b, sfb = per_block_cast_to_fp8(torch.randn(n, k, generator=g), dtype)
        return a, sfa, b, sfb
    pairs_a = [per_token_cast_to_fp8(torch.randn(m, k, generator=g), dtype) for _ in range(groups)]
    pairs_b = [per_block_cast_to_fp8(torch.randn(n, k, generator=g), dtype) for _ in range(groups)]
    return (torch.stack([p[0] for p in pairs_a]), torch.stack([p[1] for p in pairs_a]),
            torch.stack([p[0] for p in pairs_b]), torch.stack([p[1] for p in pairs_b]))
