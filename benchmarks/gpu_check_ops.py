"""gpu_check's ops steps: MLA decode and the FP8 GEMMs, numerics against the reference and speed.

* MLA: DeepSeek-V3 decode shapes (h_q 128, d 576 / dv 512, page 64, bf16, one query token, causal)
  over a grid of batch 1-128 and context 1K-32K, through vllm_pd.ops.numerics (FlashMLA's
  tolerances, inputs built on the device, NaN past every sequence); speed as the bytes the op must
  move (FlashMLA's formula) per second over the HBM bandwidth measured in the same run (a
  device-to-device copy, bytes read + written). Goal: >= 0.6 x HBM.
* FP8: DeepGEMM's shapes with 1x128 / 128x128 scales - the plain GEMM through
  vllm_pd.ops.numerics, the grouped ones (contiguous, masked) here - checked with DeepGEMM's
  calc_diff < 1e-3 against the dequantised reference; TFLOP/s beside a bf16 torch.matmul (torch.bmm
  for the grouped ones) of the same shape. Goal: >= 1.0 x bf16.

What is timed is the backend's kernel alone (no validation, no dispatch), with CUDA events on a
GPU. Each backend (triton, native; on CPU the Triton interpreter) is a step of its own, so a
kernel that breaks its CUDA context or hangs costs its own figures and nothing else. On ``cpu`` /
``standin`` the shapes are cut down: the figures mean nothing there, the code paths do.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_pd.ops import backends, numerics, reference
from vllm_pd.ops.numerics import GemmShape, MlaShape
from vllm_pd.ops.testing import fp8_operands

MLA_GOAL, FP8_GOAL = 0.6, 1.0
# (batch, context): both ends of the ranges and FlashMLA's headline point (128 x 32K), not the
# whole product; about 12 M KV tokens in all
MLA_GRID = {
    "full": [(1, 1024), (1, 32768), (32, 16384), (64, 4096), (128, 1024), (128, 32768)],
    "small": [(1, 70), (2, 150)],
}
# (groups, m, n, k), groups 0 = the plain GEMM; m is rows per group (masked: the most rows of a group)
FP8_GRID = {
    "full": {
        "normal": [
            (0, 128, 2112, 7168),
            (0, 128, 24576, 1536),
            (0, 128, 7168, 16384),
            (0, 4096, 2112, 7168),
            (0, 4096, 24576, 1536),
            (0, 4096, 7168, 16384),
            (0, 4096, 4096, 7168),
        ],
        "contiguous": [(4, 2048, 4096, 7168), (8, 1024, 7168, 2048)],
        "masked": [(1, 1024, 4096, 7168), (4, 256, 7168, 2048)],
    },
    "small": {"normal": [(0, 64, 256, 512)], "contiguous": [(2, 128, 256, 256)], "masked": [(2, 64, 256, 256)]},
}
_FP8_OPS = {
    "normal": "fp8_gemm_nt",
    "contiguous": "m_grouped_fp8_gemm_nt_contiguous",
    "masked": "m_grouped_fp8_gemm_nt_masked",
}


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


def mla(backend: str, device: torch.device, size: str) -> dict[str, Any]:
    """An ops_mla step: numerics and speed of ``backend`` on each grid point."""
    hbm = copy_gbps(device, (1 << 30) if device.type == "cuda" else (64 << 20))
    why = backends.unavailable_reason(backend, "mla_decode", device)
    rows: list[dict[str, Any]] = []
    for index, (batch, context) in enumerate(MLA_GRID[size]):
        row: dict[str, Any] = {"backend": backend, "batch": batch, "context": context}
        rows.append(row)
        if why is not None:
            row["error"] = f"unavailable: {why}"
            continue
        _guarded(row, lambda: row.update(_mla_point(backend, MlaShape(batch, context), device, index, hbm)))
        _release(device)
    return _verdict(rows, "x_hbm", MLA_GOAL, f"x HBM ({hbm:.0f} GB/s copy)", "best", {"hbm_gbps": hbm})


def _mla_point(backend: str, shape: MlaShape, device: torch.device, seed: int, hbm: float) -> dict[str, Any]:
    case = numerics.mla_case(backend, shape, device, seed=seed)
    seconds = median_s(case.run, device)
    return dict(
        ok=case.ok,
        mismatch=case.detail or None,
        max_abs_error=case.error,
        ms=seconds * 1e3,
        gbps=case.bytes / seconds / 1e9,
        x_hbm=case.bytes / seconds / 1e9 / hbm,
        tflops=case.flops / seconds / 1e12,
    )


def fp8(backend: str, device: torch.device, size: str) -> dict[str, Any]:
    """An ops_fp8 step: numerics and TFLOP/s of ``backend`` beside a bf16 matmul of each shape."""
    rows: list[dict[str, Any]] = []
    for kind, shapes in FP8_GRID[size].items():
        why = backends.unavailable_reason(backend, _FP8_OPS[kind], device)
        for index, (groups, m, n, k) in enumerate(shapes):
            row: dict[str, Any] = {"backend": backend, "kind": kind, "groups": groups, "m": m, "n": n, "k": k}
            rows.append(row)
            if why is not None:
                row["error"] = f"unavailable: {why}"
                continue
            _guarded(row, lambda: row.update(_fp8_point(backend, kind, groups, m, n, k, device, index)))
            _release(device)
    return _verdict(rows, "x_bf16", FP8_GOAL, "x bf16 matmul TFLOP/s", "median", {})


def _fp8_point(
    backend: str, kind: str, groups: int, m: int, n: int, k: int, device: torch.device, seed: int
) -> dict[str, Any]:
    count = max(1, groups)
    g = torch.Generator(device=device).manual_seed(seed)
    a_bf = torch.randn(count, m, k, generator=g, device=device, dtype=torch.bfloat16)
    b_bf = torch.randn(count, k, n, generator=g, device=device, dtype=torch.bfloat16)
    bf16_flops = 2.0 * count * m * n * k
    bf16_s = median_s(
        (lambda: torch.matmul(a_bf[0], b_bf[0])) if kind == "normal" else (lambda: torch.bmm(a_bf, b_bf)), device
    )
    if kind == "normal":
        case = numerics.fp8_gemm_case(backend, GemmShape(m, n, k), device, seed=seed)
        ok, diff, run, flops = case.ok, case.error, case.run, float(case.flops)
    else:
        grouped = _grouped_case(kind, groups, m, n, k, device, seed)
        diff = grouped.diff(backend)
        ok, run, flops = diff < numerics.GEMM_DIFF_TOL, lambda: grouped.kernel(backend), grouped.flops
    seconds = median_s(run, device)
    return dict(
        ok=ok,
        calc_diff=diff,
        ms=seconds * 1e3,
        tflops=flops / seconds / 1e12,
        bf16_tflops=bf16_flops / bf16_s / 1e12,
        x_bf16=(flops / seconds) / (bf16_flops / bf16_s),
    )


@dataclass
class _GroupedCase:
    """A grouped FP8 GEMM (DeepGEMM's m_grouped_* API), which vllm_pd.ops.numerics does not cover."""

    op: str
    args: Callable[[torch.Tensor], tuple[Any, ...]]  # the op's arguments, writing into the given output
    out: torch.Tensor  # where the timed runs write
    ref: torch.Tensor  # the reference, fp32
    valid: torch.Tensor | None  # the rows written (masked: each group's first masked_m); None: all
    flops: float

    def diff(self, backend: str) -> float:
        """calc_diff against the reference of the op (torch.ops.vllm_pd, validated) written into a
        NaN-poisoned output; inf if a row it must write stays NaN or a row it must leave alone does not."""
        out = torch.full_like(self.out, float("nan"))
        getattr(torch.ops.vllm_pd, self.op)(*self.args(out), backend)
        if self.valid is None:
            got, want = out, self.ref
        elif not bool(out[~self.valid].isnan().all()):
            return math.inf
        else:
            got, want = out[self.valid], self.ref[self.valid]
        return math.inf if bool(got.isnan().any()) else reference.calc_diff(got, want)

    def kernel(self, backend: str) -> None:
        """The backend's kernel alone, into ``out``."""
        args = self.args(self.out)
        getattr(backends.select(self.op, self.out.device, backend, args), self.op)(*args)


def _grouped_case(kind: str, groups: int, m: int, n: int, k: int, device: torch.device, seed: int) -> _GroupedCase:
    a3, sfa3, b, sfb = fp8_operands(m, n, k, groups=groups, seed=seed, device=device)
    d = torch.empty(groups * m, n, dtype=torch.bfloat16, device=device)
    ref = torch.zeros(groups * m, n, device=device)
    if kind == "contiguous":
        a, sfa = a3.reshape(groups * m, k), sfa3.reshape(groups * m, -1)
        layout = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m)
        reference.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, ref, layout)
        return _GroupedCase(
            "m_grouped_fp8_gemm_nt_contiguous",
            lambda out: (a, sfa, b, sfb, out, layout),
            d,
            ref,
            None,
            2.0 * groups * m * n * k,
        )
    masked_m = torch.randint(m // 2, m + 1, (groups,), generator=torch.Generator().manual_seed(seed)).int()
    rows, ref3 = masked_m.to(device), ref.view(groups, m, n)
    reference.m_grouped_fp8_gemm_nt_masked(a3, sfa3, b, sfb, ref3, rows, m)
    valid = torch.arange(m, device=device)[None, :] < rows[:, None]  # [groups, m]
    return _GroupedCase(
        "m_grouped_fp8_gemm_nt_masked",
        lambda out: (a3, sfa3, b, sfb, out, rows, m),
        d.view(groups, m, n),
        ref3,
        valid,
        2.0 * int(masked_m.sum()) * n * k,
    )


def _guarded(row: dict[str, Any], work: Callable[[], None]) -> None:
    """Run one grid point; an exception is that point's error (the next point still runs, unless it
    left the CUDA context broken: then every later point says so too)."""
    try:
        work()
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"[:500]


def _verdict(
    rows: list[dict[str, Any]], figure: str, goal: float, unit: str, how: str, extra: dict[str, Any]
) -> dict[str, Any]:
    """The step's result: failed if the backend is missing or a check fails. The key figure is the
    backend's ``how`` ("best": the largest, the memory-bound point; "median") over its grid points."""
    failed = [r for r in rows if "error" in r or not r.get("ok")]
    values: dict[str, list[float]] = {}
    for r in rows:
        if figure in r:
            values.setdefault(r["backend"], []).append(r[figure])
    summary = {b: max(v) if how == "best" else statistics.median(v) for b, v in values.items()}
    key = f"{how} " + ", ".join(f"{b} {v:.2f}" for b, v in summary.items()) + f" {unit}" if summary else "no figure"
    detail = "; ".join(
        f"{r['backend']} {_shape(r)}: {r.get('error') or r.get('mismatch') or 'diff too large'}" for r in failed[:4]
    )
    return {
        "status": "failed" if failed else "ok",
        "key": key,
        "goal": f">= {goal} {unit.split(' (')[0]}",
        "goal_met": bool(summary) and max(summary.values()) >= goal,
        "detail": detail,
        "rows": rows,
        **extra,
    }


def _shape(row: dict[str, Any]) -> str:
    if "context" in row:
        return f"b{row['batch']} x {row['context']}"
    return f"{row['kind']} g{row['groups']} {row['m']}x{row['n']}x{row['k']}"


def _release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
