"""Test-data generators and the vendor libraries' own accuracy checks (used by tests and benchmarks)."""

from __future__ import annotations

import torch

from vllm_pd.ops.reference import per_block_cast_to_fp8, per_token_cast_to_fp8

# FlashMLA dense decode (tests/test_flash_mla_dense_decoding.py): out and lse tolerances.
OUT_TOL = dict(abs_tol=8e-4, rel_tol=2.01 / 128, cos_diff_tol=5e-6)
LSE_TOL = dict(abs_tol=1e-6, rel_tol=8.01 / 65536, cos_diff_tol=5e-6)
BAD_BLOCK = 2147480000  # FlashMLA's marker for block-table entries past a sequence's end


def flash_mla_mismatch(
    name: str, ans: torch.Tensor, ref: torch.Tensor, abs_tol: float, rel_tol: float, cos_diff_tol: float
) -> str | None:
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


def mla_inputs(
    seqlens: list[int],
    s_q: int,
    h_q: int,
    block_size: int,
    dtype: torch.dtype,
    seed: int = 0,
    dim: int = 576,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashMLA-style data: q, k ~ randn/10 clamped to [-1, 1]; blocks in random order; every
    unused cache slot is NaN and unused block-table entries are out of range, so a kernel that
    reads past a sequence shows it. Built on `device` (DeepSeek-sized caches are gigabytes)."""
    g = torch.Generator(device=device).manual_seed(seed)
    b = len(seqlens)
    per_seq = [max(1, -(-n // block_size)) for n in seqlens]
    max_blocks, used = max(per_seq), sum(per_seq)
    num_blocks = used + 2
    q = torch.randn(b, s_q, h_q, dim, generator=g, device=device).div_(10).clamp_(-1, 1).to(dtype)
    cache = torch.randn(num_blocks, block_size, 1, dim, generator=g, device=device).div_(10).clamp_(-1, 1).to(dtype)
    order = torch.randperm(num_blocks, generator=g, device=device)
    counts = torch.tensor(per_seq, device=device)
    cols = torch.arange(max_blocks, device=device)
    owned = cols[None, :] < counts[:, None]  # [b, max_blocks]: sequence i owns its first counts[i] entries
    first = torch.cumsum(counts, 0) - counts
    table = torch.where(owned, order[(first[:, None] + cols[None, :]).clamp(max=used - 1)], BAD_BLOCK)
    lens = torch.tensor(seqlens, dtype=torch.int32, device=device)
    offsets = torch.arange(block_size, device=device)
    position = cols[:, None] * block_size + offsets[None, :]  # [max_blocks, block_size]
    stale = owned[:, :, None] & (position[None] >= lens[:, None, None])
    # Counted per slot rather than boolean-indexed, so no data-dependent shape (FakeTensor-safe);
    # entries a sequence does not own point at one extra slot past the cache.
    flat = cache.view(-1, dim)
    slots = torch.where(owned[:, :, None], table[:, :, None] * block_size + offsets, flat.shape[0])
    marks = torch.zeros(flat.shape[0] + 1, dtype=torch.int32, device=device)
    marks.index_put_((slots.flatten(),), stale.flatten().to(torch.int32), accumulate=True)
    flat.masked_fill_(marks[:-1, None] > 0, float("nan"))
    cache[order[used:]] = float("nan")  # the spare blocks nobody owns
    return q, cache, table.to(torch.int32), lens


def fp8_operands(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.float8_e4m3fn,
    groups: int | None = None,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """DeepGEMM-style quantised operands: a [(G,) m, k] 1x128-scaled, b [(G,) n, k] 128x128-scaled."""
    g = torch.Generator(device=device).manual_seed(seed)

    def randn(rows: int) -> torch.Tensor:
        return torch.randn(rows, k, generator=g, device=device)

    if groups is None:
        a, sfa = per_token_cast_to_fp8(randn(m), dtype)
        b, sfb = per_block_cast_to_fp8(randn(n), dtype)
        return a, sfa, b, sfb
    pairs_a = [per_token_cast_to_fp8(randn(m), dtype) for _ in range(groups)]
    pairs_b = [per_block_cast_to_fp8(randn(n), dtype) for _ in range(groups)]
    return (
        torch.stack([p[0] for p in pairs_a]),
        torch.stack([p[1] for p in pairs_a]),
        torch.stack([p[0] for p in pairs_b]),
        torch.stack([p[1] for p in pairs_b]),
    )
