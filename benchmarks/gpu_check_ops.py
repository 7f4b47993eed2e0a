"""gpu_check's ops steps: MLA decode and the FP8 GEMMs, numerics against the reference and speed.

* MLA: DeepSeek-V3 decode shapes (h_q 128, d 576 / dv 512, page 64, bf16, one query token, causal as
  vLLM passes it) over a grid of batch 1-128 and context 1K-32K (varlen: each sequence between half
  and all of the context), checked with FlashMLA's tolerances; speed as KV bytes read per second
  over the HBM bandwidth measured in the same run (a device-to-device copy, bytes read + written).
  Goal: >= 0.6 x HBM.
* FP8: DeepGEMM's shapes (normal, grouped contiguous, grouped masked; 1x128 / 128x128 scales),
  checked with DeepGEMM's calc_diff < 1e-3 against the dequantised reference; TFLOP/s beside a
  bf16 torch.matmul (torch.bmm for the grouped ones) of the same shape. Goal: >= 1.0 x bf16.

Each backend (triton, native; on CPU the Triton interpreter) is a step of its own, so a kernel that
breaks its CUDA context or hangs costs its own figures and nothing else. On
``cpu`` / ``standin`` the shapes are cut down: the figures mean nothing there, the code paths do.
The calls into vllm_pd.ops live in :class:`OpCalls` alone: numerics through torch.ops.vllm_pd (what
FlashMLA's and DeepGEMM's APIs call, validation included), timing of the backend's kernel alone.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

import vllm_pd.ops.library  # noqa: F401  (defines torch.ops.vllm_pd)
from vllm_pd.ops import backends, reference
from vllm_pd.ops.testing import BAD_BLOCK, LSE_TOL, OUT_TOL, flash_mla_mismatch

BACKENDS = ("triton", "native")
H_Q, D, DV, PAGE = 128, 576, 512, 64
SCALE = 0.1352  # vLLM passes the model's own scale, not 576 ** -0.5
FP8_TOL = 1e-3
MLA_GOAL, FP8_GOAL = 0.6, 1.0
# (batch, context): every batch and context end of the range, not the full product
MLA_GRID = {"full": [(1, 1024), (1, 32768), (32, 32768), (64, 4096), (128, 1024), (128, 8192)],
            "small": [(1, 70), (2, 150)]}
# (groups, m, n, k): groups 0 = the plain GEMM; m is rows per group (masked: the most rows)
FP8_GRID = {"full": {"normal": [(0, 128, 2112, 7168), (0, 128, 24576, 1536), (0, 128, 7168, 16384),
                                (0, 4096, 2112, 7168), (0, 4096, 24576, 1536), (0, 4096, 7168, 16384),
                                (0, 4096, 4096, 7168)],
                     "contiguous": [(4, 2048, 4096, 7168), (8, 1024, 7168, 2048)],
                     "masked": [(1, 1024, 4096, 7168), (4, 256, 7168, 2048)]},
            "small": {"normal": [(0, 64, 256, 512)], "contiguous": [(2, 128, 256, 256)],
                      "masked": [(2, 64, 256, 256)]}}


@dataclass(frozen=True)
class OpCalls:
    """The one place gpu_check calls vllm_pd.ops: one backend, forced."""

    backend: str
    device: torch.device

    def checked(self, op: str, *args: Any) -> Any:
        """Through torch.ops.vllm_pd (what FlashMLA's / DeepGEMM's APIs call): validation and all."""
        return getattr(torch.ops.vllm_pd, op)(*args, self.backend)

    def kernel(self, op: str, *args: Any) -> Any:
        """The backend's kernel alone (no validation, no dispatch): what is timed."""
        return getattr(backends.select(op, self.device, self.backend, args), op)(*args)

    def unavailable(self, op: str) -> str | None:
        return backends.unavailable_reason(self.backend, op, self.device)


def median_s(fn: Callable[[], object], device: torch.device, budget_s: float = 0.3, max_reps: int = 20) -> float:
    """Median seconds per call after one warm-up: CUDA events on a GPU, the host clock elsewhere."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < max_reps and (len(times) < 2 or time.perf_counter() - started < budget_s):
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def copy_gbps(device: torch.device, nbytes: int) -> float:
    """A device-to-device copy's rate, bytes read + written per second (the HBM ceiling)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 256)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_s(lambda: dst.copy_(src), device) / 1e9


def mla_case(batch: int, context: int, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """FlashMLA-style inputs made on ``device`` (the conventions of vllm_pd.ops.testing.mla_inputs, which
    builds on the host: too slow for 128 x 8K): q, KV ~ randn/10 clamped; blocks in random order; every
    slot no sequence owns is NaN and block-table entries past a sequence are out of range."""
    g = torch.Generator().manual_seed(seed)
    lens = [context] + torch.randint(context // 2, context + 1, (batch - 1,), generator=g).tolist()
    per_seq = [max(1, -(-n // PAGE)) for n in lens]
    num_blocks = sum(per_seq) + 2
    order = torch.randperm(num_blocks, generator=g).int()
    table = torch.full((batch, max(per_seq)), BAD_BLOCK, dtype=torch.int32)
    used = 0
    for i, k in enumerate(per_seq):
        table[i, :k] = order[used:used + k]
        used += k
    dg = torch.Generator(device=device).manual_seed(seed)
    q = (torch.randn(batch, 1, H_Q, D, generator=dg, device=device) / 10).clamp(-1, 1).bfloat16()
    cache = (torch.randn(num_blocks, PAGE, 1, D, generator=dg, device=device) / 10).clamp(-1, 1).bfloat16()
    cache[order[used:].long().to(device)] = float("nan")  # the spare blocks
    for i, n in enumerate(lens):
        if n % PAGE:
            cache[int(table[i, per_seq[i] - 1]), n % PAGE:] = float("nan")  # past the sequence's end
    return q, cache, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


def mla(backend: str, device: torch.device, size: str) -> dict[str, Any]:
    """An ops_mla step: numerics and speed of ``backend`` on each grid point."""
    hbm = copy_gbps(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    calls = OpCalls(backend, device)
    why = calls.unavailable("mla_decode")
    rows: list[dict[str, Any]] = []
    for index, (batch, context) in enumerate(MLA_GRID[size]):
        row: dict[str, Any] = {"backend": backend, "batch": batch, "context": context}
        rows.append(row)
        if why is not None:
            row["error"] = f"unavailable: {why}"
            continue
        _guarded(row, lambda: row.update(_mla_point(calls, batch, context, index, hbm)))
        _release(device)
    return _verdict(rows, "x_hbm", MLA_GOAL, f"x HBM ({hbm:.0f} GB/s copy)", "best", {"hbm_gbps": hbm})


def _mla_point(calls: OpCalls, batch: int, context: int, seed: int, hbm: float) -> dict[str, Any]:
    q, cache, table, lens = mla_case(batch, context, calls.device, seed)
    args = (q, cache, table, lens, DV, SCALE, True)
    ref_out, ref_lse = reference.mla_decode(*args)
    out, lse = calls.checked("mla_decode", *args)
    mismatch = (flash_mla_mismatch("out", out.float(), ref_out.float(), **OUT_TOL)
                or flash_mla_mismatch("lse", lse, ref_lse, **LSE_TOL))
    seconds = median_s(lambda: calls.kernel("mla_decode", *args), calls.device)
    kv_tokens = int(lens.sum())
    nbytes = 2 * (kv_tokens * D + batch * H_Q * (D + DV))  # FlashMLA's: q, the KV once, out (bf16)
    flops = 2 * H_Q * kv_tokens * (D + DV)
    return dict(ok=mismatch is None, mismatch=mismatch, ms=seconds * 1e3, gbps=nbytes / seconds / 1e9,
                x_hbm=nbytes / seconds / 1e9 / hbm, tflops=flops / seconds / 1e12)


def fp8(backend: str, device: torch.device, size: str) -> dict[str, Any]:
    """An ops_fp8 step: numerics and TFLOP/s of ``backend`` beside a bf16 matmul of each shape."""
    calls = OpCalls(backend, device)
    rows: list[dict[str, Any]] = []
    for kind, shapes in FP8_GRID[size].items():
        why = calls.unavailable(_FP8_OPS[kind])
        for index, (groups, m, n, k) in enumerate(shapes):
            row: dict[str, Any] = {"backend": backend, "kind": kind, "groups": groups, "m": m, "n": n, "k": k}
            rows.append(row)
            if why is not None:
                row["error"] = f"unavailable: {why}"
                continue
            _guarded(row, lambda: row.update(_fp8_point(calls, kind, groups, m, n, k, index)))
            _release(device)
    return _verdict(rows, "x_bf16", FP8_GOAL, "x bf16 matmul TFLOP/s", "median", {})


def _fp8_point(calls: OpCalls, kind: str, groups: int, m: int, n: int, k: int, seed: int) -> dict[str, Any]:
    case = _gemm_case(kind, groups, m, n, k, calls.device, seed)
    bf16_s = median_s(case.bf16, calls.device)
    diff = case.diff(calls)
    seconds = median_s(lambda: calls.kernel(case.op, *case.args(case.out)), calls.device)
    return dict(ok=diff < FP8_TOL, calc_diff=diff, ms=seconds * 1e3, tflops=case.flops / seconds / 1e12,
                bf16_tflops=case.bf16_flops / bf16_s / 1e12, x_bf16=(case.flops / seconds) / (case.bf16_flops / bf16_s))


def _guarded(row: dict[str, Any], work: Callable[[], None]) -> None:
    """Run one grid point; an exception is that point's error (the next point still runs, unless it
    left the CUDA context broken: then every later point says so too)."""
    try:
        work()
    except Exception as e:  # noqa: BLE001 - recorded in the row, reported by the step
        row["error"] = f"{type(e).__name__}: {e}"[:500]


_FP8_OPS = {"normal": "fp8_gemm_nt", "contiguous": "m_grouped_fp8_gemm_nt_contiguous",
            "masked": "m_grouped_fp8_gemm_nt_masked"}


@dataclass
class _GemmCase:
    op: str
    args: Callable[[torch.Tensor], tuple[Any, ...]]  # the op's arguments, writing into the given output
    out: torch.Tensor  # where the timed runs write
    ref: torch.Tensor  # the reference, fp32
    valid: torch.Tensor | None  # the rows written (masked: each group's first masked_m); None: all
    flops: float
    bf16: Callable[[], object]  # a bf16 torch.matmul / bmm of the same shape
    bf16_flops: float

    def diff(self, calls: OpCalls) -> float:
        """calc_diff against the reference of the op written into a NaN-poisoned output; inf if a row it
        must write stays NaN or a row it must leave alone (masked) does not."""
        out = torch.full_like(self.out, float("nan"))
        calls.checked(self.op, *self.args(out))
        if self.valid is None:
            got, want = out, self.ref
        elif not bool(out[~self.valid].isnan().all()):
            return math.inf
        else:
            got, want = out[self.valid], self.ref[self.valid]
        return math.inf if bool(got.isnan().any()) else reference.calc_diff(got, want)


def _gemm_case(kind: str, groups: int, m: int, n: int, k: int, device: torch.device, seed: int) -> _GemmCase:
    """DeepGEMM-style operands made on ``device`` (1x128 and 128x128 scales) and the reference."""
    g = torch.Generator(device=device).manual_seed(seed)
    count = max(1, groups)
    a, sfa = reference.per_token_cast_to_fp8(torch.randn(count * m, k, generator=g, device=device))
    bs = [reference.per_block_cast_to_fp8(torch.randn(n, k, generator=g, device=device)) for _ in range(count)]
    a_bf = torch.randn(count, m, k, generator=g, device=device, dtype=torch.bfloat16)
    b_bf = torch.randn(count, k, n, generator=g, device=device, dtype=torch.bfloat16)
    flops = 2.0 * count * m * n * k
    d = torch.empty(count * m, n, dtype=torch.bfloat16, device=device)
    ref = torch.zeros(count * m, n, device=device)
    if kind == "normal":
        b, sfb = bs[0]
        reference.fp8_gemm_nt(a, sfa, b, sfb, ref, None)
        return _GemmCase("fp8_gemm_nt", lambda out: (a, sfa, b, sfb, out, None), d, ref, None, flops,
                         lambda: torch.matmul(a_bf[0], b_bf[0]), flops)
    b, sfb = torch.stack([x[0] for x in bs]), torch.stack([x[1] for x in bs])
    if kind == "contiguous":
        layout = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m)
        reference.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, ref, layout)
        return _GemmCase("m_grouped_fp8_gemm_nt_contiguous", lambda out: (a, sfa, b, sfb, out, layout), d, ref,
                         None, flops, lambda: torch.bmm(a_bf, b_bf), flops)
    a3, sfa3, ref3 = a.view(groups, m, k), sfa.view(groups, m, -1), ref.view(groups, m, n)
    masked_m = torch.randint(m // 2, m + 1, (groups,), generator=torch.Generator().manual_seed(seed)).int()
    rows = masked_m.to(device)
    reference.m_grouped_fp8_gemm_nt_masked(a3, sfa3, b, sfb, ref3, rows, m)
    valid = torch.arange(m, device=device)[None, :] < rows[:, None]  # [groups, m]
    return _GemmCase("m_grouped_fp8_gemm_nt_masked", lambda out: (a3, sfa3, b, sfb, out, rows, m),
                     d.view(groups, m, n), ref3, valid, 2.0 * int(masked_m.sum()) * n * k,
                     lambda: torch.bmm(a_bf, b_bf), flops)


def _verdict(rows: list[dict[str, Any]], figure: str, goal: float, unit: str, how: str,
             extra: dict[str, Any]) -> dict[str, Any]:
    """The step's result: failed if the backend is missing or a check fails. The key figure is the
    backend's ``how`` ("best": the largest, the memory-bound point; "median") over its grid points."""
    failed = [r for r in rows if "error" in r or not r.get("ok")]
    values: dict[str, list[float]] = {}
    for r in rows:
        if figure in r:
            values.setdefault(r["backend"], []).append(r[figure])
    summary = {b: max(v) if how == "best" else statistics.median(v) for b, v in values.items()}
    key = f"{how} " + ", ".join(f"{b} {v:.2f}" for b, v in summary.items()) + f" {unit}" if summary else "no figure"
    detail = "; ".join(f"{r['backend']} {_shape(r)}: {r.get('error') or r.get('mismatch') or 'diff too large'}"
                       for r in failed[:4])
    return {"status": "failed" if failed else "ok", "key": key, "goal": f">= {goal} {unit.split(' (')[0]}",
            "goal_met": bool(summary) and max(summary.values()) >= goal, "detail": detail, "rows": rows, **extra}


def _shape(row: dict[str, Any]) -> str:
    if "context" in row:
        return f"b{row['batch']} x {row['context']}"
    return f"{row['kind']} g{row['groups']} {row['m']}x{row['n']}x{row['k']}"


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
