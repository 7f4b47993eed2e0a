"""CPU benchmark of the vllm_pd ops: each C++ kernel against the PyTorch reference, and MLA
decode as a fraction of the memory bandwidth measured in the same run.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/ops_cpu.py [--threads N] [--only mla|gemm]

MLA decode is memory-bound on purpose (one latent KV head shared by all query heads): its
figure is KV bytes read / time, set beside torch's memcpy rate (bytes copied / time) on the
same threads; the target is >= 0.6 x memcpy. The default CPU kernel (AMX where the CPU has it)
is set beside the portable one (VLLM_PD_MLA_CPU_KERNEL=portable) and, when vLLM is installed,
vLLM's own CPU kernel (torch.ops._C) on the same cache.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable

import torch

import vllm_pd.ops.library  # noqa: F401
from vllm_pd.ops import reference
from vllm_pd.ops.testing import fp8_operands


def bench(fn: Callable[[], object], min_time: float = 0.3, max_iters: int = 100) -> float:
    """Median seconds per call after one warm-up."""
    fn()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < max_iters and (time.perf_counter() - start < min_time or len(times) < min(3, max_iters)):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return times[len(times) // 2]


def memcpy_gbps(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    return nbytes / bench(lambda: dst.copy_(src)) / 1e9


def read_gbps(nbytes: int = 256 << 20) -> float:
    """Read-only rate (a float32 sum): a stricter peer than memcpy, which moves each byte twice."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    return nbytes / bench(lambda: src.sum()) / 1e9


def mla_kernel() -> str:
    """The kernel the op picks by default here: amx when forcing it works, else portable."""
    q = torch.zeros(1, 1, 1, 576, dtype=torch.bfloat16)
    cache = torch.zeros(1, 16, 1, 576, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    try:
        with forced_kernel("amx"):
            torch.ops.vllm_pd.mla_decode(q, cache, table, lens, 512, 1.0, True, "native")
    except RuntimeError:
        return "portable"
    return "amx"


class forced_kernel:
    """Sets VLLM_PD_MLA_CPU_KERNEL for a block (read by the C++ op at every call)."""

    def __init__(self, kernel: str) -> None:
        self.kernel = kernel

    def __enter__(self) -> None:
        self.before = os.environ.get("VLLM_PD_MLA_CPU_KERNEL")
        os.environ["VLLM_PD_MLA_CPU_KERNEL"] = self.kernel

    def __exit__(self, *exc: object) -> None:
        if self.before is None:
            del os.environ["VLLM_PD_MLA_CPU_KERNEL"]
        else:
            os.environ["VLLM_PD_MLA_CPU_KERNEL"] = self.before


def mla_case(
    batch: int, seq_len: int, h_q: int, block_size: int, memcpy: float, read: float, kernel: str, peers: bool = True
) -> None:
    dim, dim_v = 576, 512
    blocks_per_seq = seq_len // block_size
    # normal_ in place: a float32 randn of the big case would need 4x its memory
    cache = torch.empty(batch * blocks_per_seq, block_size, 1, dim, dtype=torch.bfloat16).normal_(0, 0.1)
    table = torch.randperm(batch * blocks_per_seq, dtype=torch.int32).view(batch, blocks_per_seq)
    lens = torch.full((batch,), seq_len, dtype=torch.int32)
    q = (torch.randn(batch, 1, h_q, dim) / 10).bfloat16()
    args = (q, cache, table, lens, dim_v, 0.1352, True)
    kv_bytes = batch * seq_len * dim * 2
    t_native = bench(lambda: torch.ops.vllm_pd.mla_decode(*args, "native"))
    gbps = kv_bytes / t_native / 1e9
    print(
        f"mla_decode b={batch} L={seq_len} h_q={h_q} block={block_size} ({kv_bytes / 1e6:.0f} MB KV): "
        f"native ({kernel}) {t_native * 1e3:.2f} ms = {gbps:.1f} GB/s = {gbps / memcpy:.2f} x memcpy "
        f"(target >= 0.6) = {gbps / read:.2f} x read, "
        f"{4 * batch * seq_len * h_q * (dim + dim_v) / t_native / 1e9:.0f} GFLOP/s"
    )
    if not peers:
        return
    if kernel != "portable":
        with forced_kernel("portable"):
            t_port = bench(lambda: torch.ops.vllm_pd.mla_decode(*args, "native"), min_time=0.0, max_iters=3)
        print(
            f"    portable kernel {t_port * 1e3:.1f} ms = {kv_bytes / t_port / 1e9:.2f} GB/s "
            f"({kernel} is {t_port / t_native:.1f}x faster)"
        )
    t_ref = bench(lambda: reference.mla_decode(*args), min_time=0.0, max_iters=1)
    print(f"    reference (PyTorch) {t_ref * 1e3:.1f} ms ({t_ref / t_native:.1f}x slower)")
    try:
        from vllm import _custom_ops as vllm_ops
    except Exception:  # vLLM absent: no peer
        return
    if block_size != 16:
        return
    out = torch.empty(batch, h_q, dim_v, dtype=torch.bfloat16)
    q3, cache3 = q[:, 0].contiguous(), cache.squeeze(2)
    t_vllm = bench(lambda: vllm_ops.mla_decode_kvcache_cpu(out, q3, cache3, 0.1352, table, lens))
    print(
        f"    peer: vLLM's CPU mla_decode_kvcache {t_vllm * 1e3:.2f} ms = {kv_bytes / t_vllm / 1e9:.1f} GB/s "
        f"(native is {t_vllm / t_native:.2f}x its speed)"
    )


def gemm_case(m: int, n: int, k: int, fp8: torch.dtype) -> None:
    a, sfa, b, sfb = fp8_operands(m, n, k, fp8)
    d = torch.empty(m, n, dtype=torch.bfloat16)
    t_native = bench(lambda: torch.ops.vllm_pd.fp8_gemm_nt(a, sfa, b, sfb, d, None, "native"))
    t_ref = bench(lambda: reference.fp8_gemm_nt(a, sfa, b, sfb, d, None), min_time=0.2, max_iters=5)
    flops = 2 * m * n * k
    print(
        f"fp8_gemm_nt {str(fp8).split('.')[-1]} m={m} n={n} k={k}: native {t_native * 1e3:.2f} ms "
        f"({flops / t_native / 1e9:.1f} GFLOP/s, weights {n * k / t_native / 1e9:.2f} GB/s); "
        f"reference {t_ref * 1e3:.2f} ms = native is {t_ref / t_native:.2f}x the reference's speed"
    )


def grouped_cases() -> None:
    groups, m_per, n, k = 4, 128, 512, 1024
    layout = torch.arange(groups, dtype=torch.int32).repeat_interleave(m_per)
    a, sfa, _, _ = fp8_operands(groups * m_per, n, k)
    _, _, b, sfb = fp8_operands(n, n, k, groups=groups)
    d = torch.empty(groups * m_per, n, dtype=torch.bfloat16)
    t_native = bench(lambda: torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, layout, "native"))
    t_ref = bench(
        lambda: reference.m_grouped_fp8_gemm_nt_contiguous(a, sfa, b, sfb, d, layout), min_time=0.2, max_iters=5
    )
    print(
        f"m_grouped contiguous G={groups} m={m_per}/group n={n} k={k}: native {t_native * 1e3:.2f} ms, "
        f"reference {t_ref * 1e3:.2f} ms = native is {t_ref / t_native:.2f}x the reference's speed"
    )
    a, sfa, b, sfb = fp8_operands(64, n, k, groups=groups)
    masked = torch.tensor([64, 3, 17, 40], dtype=torch.int32)
    d = torch.empty(groups, 64, n, dtype=torch.bfloat16)
    t_native = bench(lambda: torch.ops.vllm_pd.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked, 32, "native"))
    t_ref = bench(lambda: reference.m_grouped_fp8_gemm_nt_masked(a, sfa, b, sfb, d, masked), min_time=0.2, max_iters=5)
    print(
        f"m_grouped masked G={groups} m_max=64 masked_m={masked.tolist()} n={n} k={k}: "
        f"native {t_native * 1e3:.2f} ms, "
        f"reference {t_ref * 1e3:.2f} ms = native is {t_ref / t_native:.2f}x the reference's speed"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--only", choices=("mla", "gemm"), help="run only the MLA decode or only the FP8 GEMM cases")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {args.threads} threads; no GPU in this run")
    if args.only != "gemm":
        memcpy = memcpy_gbps()
        read = read_gbps()
        print(f"memcpy (torch copy_, 256 MB): {memcpy:.1f} GB/s; read-only (float32 sum, 256 MB): {read:.1f} GB/s")
        kernel = mla_kernel()
        for batch, seq_len, h_q, block in ((16, 4096, 16, 64), (64, 1024, 16, 16), (1, 16384, 16, 64)):
            mla_case(batch, seq_len, h_q, block, memcpy, read, kernel)
        # 604 MB: more than this host's L3, so the KV surely comes from DRAM
        mla_case(32, 16384, 16, 64, memcpy, read, kernel, peers=False)
        print(f"memcpy again after the MLA cases: {memcpy_gbps():.1f} GB/s, read-only {read_gbps():.1f} GB/s")
    if args.only == "mla":
        return
    for m in (1, 16, 128):
        gemm_case(m, 2112, 7168, torch.float8_e4m3fn)
    gemm_case(16, 2112, 7168, torch.float8_e4m3fnuz)
    grouped_cases()


if __name__ == "__main__":
    main()
