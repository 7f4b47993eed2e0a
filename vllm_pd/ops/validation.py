"""Shape, dtype and layout checks shared by every backend and by the fake (meta) kernels.

They look only at metadata, never at values, so they also run on FakeTensors under
torch.compile. Value checks (sequence lengths against the block table, group ids) are done
by the kernels that read the values anyway.
"""

from __future__ import annotations

import torch

from vllm_pd.errors import OpsError

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e4m3fnuz)
MLA_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 128


class OpInputError(OpsError, ValueError):
    """An op argument has the wrong dtype, shape, layout or device; the message names it."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise OpInputError(message)


def _ceil(x: int, y: int) -> int:
    return (x + y - 1) // y


def _same_device(op: str, **tensors: torch.Tensor | None) -> None:
    named = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = named[0]
    for name, t in named[1:]:
        _require(
            t.device == first.device,
            f"{op}: {name} is on {t.device} but {first_name} is on {first.device}",
        )


def check_mla_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: torch.Tensor,
    cache_seqlens: torch.Tensor,
    head_dim_v: int,
) -> None:
    op = "mla_decode"
    _require(q.dim() == 4, f"{op}: q must be [batch, s_q, h_q, head_dim], got shape {tuple(q.shape)}")
    _require(q.dtype in MLA_DTYPES, f"{op}: q dtype {q.dtype} is not one of bf16, fp16, fp32")
    _require(q.stride(-1) == 1, f"{op}: q's last dimension must be contiguous (stride {q.stride(-1)})")
    _require(
        k_cache.dim() == 4 and k_cache.shape[2] == 1,
        f"{op}: k_cache must be [num_blocks, block_size, 1, head_dim] (one latent KV head), "
        f"got shape {tuple(k_cache.shape)}",
    )
    _require(k_cache.dtype == q.dtype, f"{op}: k_cache dtype {k_cache.dtype} differs from q dtype {q.dtype}")
    _require(
        k_cache.shape[3] == q.shape[3],
        f"{op}: k_cache head_dim {k_cache.shape[3]} differs from q head_dim {q.shape[3]}",
    )
    _require(k_cache.stride(-1) == 1, f"{op}: k_cache's last dimension must be contiguous")
    _require(
        0 < head_dim_v <= q.shape[3],
        f"{op}: head_dim_v {head_dim_v} must be in (0, head_dim={q.shape[3]}]",
    )
    batch = q.shape[0]
    _require(
        block_table.dtype == torch.int32 and block_table.dim() == 2 and block_table.shape[0] == batch,
        f"{op}: block_table must be int32 [batch={batch}, max_blocks], "
        f"got {block_table.dtype} {tuple(block_table.shape)}",
    )
    _require(
        cache_seqlens.dtype == torch.int32 and tuple(cache_seqlens.shape) == (batch,),
        f"{op}: cache_seqlens must be int32 [batch={batch}], got {cache_seqlens.dtype} {tuple(cache_seqlens.shape)}",
    )
    _same_device(op, q=q, k_cache=k_cache, block_table=block_table, cache_seqlens=cache_seqlens)


def _check_fp8_operand(op: str, name: str, x: torch.Tensor, dims: int) -> None:
    _require(
        x.dtype in FP8_DTYPES,
        f"{op}: {name} dtype {x.dtype} is not float8_e4m3fn or float8_e4m3fnuz",
    )
    _require(x.dim() == dims, f"{op}: {name} must be {dims}-D, got shape {tuple(x.shape)}")
    _require(x.stride(-1) == 1, f"{op}: {name} must be K-major (last stride 1)")


def _check_scales(op: str, name: str, sf: torch.Tensor, shape: tuple[int, ...]) -> None:
    _require(
        sf.dtype == torch.float32,
        f"{op}: {name} must be float32 scales (packed UE8M0 int32 scales are not supported), got {sf.dtype}",
    )
    _require(tuple(sf.shape) == shape, f"{op}: {name} must have shape {shape}, got {tuple(sf.shape)}")


def _check_out(op: str, d: torch.Tensor, shape: tuple[int, ...]) -> None:
    _require(d.dtype in OUT_DTYPES, f"{op}: d dtype {d.dtype} is not bf16, fp16 or fp32")
    _require(tuple(d.shape) == shape, f"{op}: d must have shape {shape}, got {tuple(d.shape)}")
    _require(d.stride(-1) == 1, f"{op}: d's last dimension must be contiguous")


def check_fp8_gemm_nt(
    a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor, c: torch.Tensor | None
) -> None:
    op = "fp8_gemm_nt"
    _check_fp8_operand(op, "a", a, 2)
    _check_fp8_operand(op, "b", b, 2)
    _require(a.dtype == b.dtype, f"{op}: a ({a.dtype}) and b ({b.dtype}) must share one fp8 dtype")
    (m, k), n = a.shape, b.shape[0]
    _require(b.shape[1] == k, f"{op}: b has K={b.shape[1]} but a has K={k}")
    _check_scales(op, "sfa", sfa, (m, _ceil(k, BLOCK)))
    _check_scales(op, "sfb", sfb, (_ceil(n, BLOCK), _ceil(k, BLOCK)))
    _check_out(op, d, (m, n))
    if c is not None:
        _require(
            c.dtype == torch.float32 and tuple(c.shape) == (m, n),
            f"{op}: c must be float32 [{m}, {n}], got {c.dtype} {tuple(c.shape)}",
        )
    _same_device(op, a=a, sfa=sfa, b=b, sfb=sfb, d=d, c=c)


def check_grouped_contiguous(
    a: torch.Tensor,
    sfa: torch.Tensor,
    b: torch.Tensor,
    sfb: torch.Tensor,
    d: torch.Tensor,
    grouped_layout: torch.Tensor,
) -> None:
    op = "m_grouped_fp8_gemm_nt_contiguous"
    _check_fp8_operand(op, "a", a, 2)
    _check_fp8_operand(op, "b", b, 3)
    _require(a.dtype == b.dtype, f"{op}: a ({a.dtype}) and b ({b.dtype}) must share one fp8 dtype")
    (m, k), (groups, n) = a.shape, b.shape[:2]
    _require(b.shape[2] == k, f"{op}: b has K={b.shape[2]} but a has K={k}")
    _check_scales(op, "sfa", sfa, (m, _ceil(k, BLOCK)))
    _check_scales(op, "sfb", sfb, (groups, _ceil(n, BLOCK), _ceil(k, BLOCK)))
    _check_out(op, d, (m, n))
    _require(
        grouped_layout.dtype == torch.int32 and tuple(grouped_layout.shape) == (m,),
        f"{op}: grouped_layout must be int32 [{m}], got {grouped_layout.dtype} {tuple(grouped_layout.shape)}",
    )
    _same_device(op, a=a, sfa=sfa, b=b, sfb=sfb, d=d, grouped_layout=grouped_layout)


def check_grouped_masked(
    a: torch.Tensor, sfa: torch.Tensor, b: torch.Tensor, sfb: torch.Tensor, d: torch.Tensor, masked_m: torch.Tensor
) -> None:
    op = "m_grouped_fp8_gemm_nt_masked"
    _check_fp8_operand(op, "a", a, 3)
    _check_fp8_operand(op, "b", b, 3)
    _require(a.dtype == b.dtype, f"{op}: a ({a.dtype}) and b ({b.dtype}) must share one fp8 dtype")
    (groups, m, k), n = a.shape, b.shape[1]
    _require(b.shape[0] == groups, f"{op}: b has {b.shape[0]} groups but a has {groups}")
    _require(b.shape[2] == k, f"{op}: b has K={b.shape[2]} but a has K={k}")
    _check_scales(op, "sfa", sfa, (groups, m, _ceil(k, BLOCK)))
    _check_scales(op, "sfb", sfb, (groups, _ceil(n, BLOCK), _ceil(k, BLOCK)))
    _check_out(op, d, (groups, m, n))
    _require(
        masked_m.dtype == torch.int32 and tuple(masked_m.shape) == (groups,),
        f"{op}: masked_m must be int32 [{groups}], got {masked_m.dtype} {tuple(masked_m.shape)}",
    )
    _same_device(op, a=a, sfa=sfa, b=b, sfb=sfb, d=d, masked_m=masked_m)
