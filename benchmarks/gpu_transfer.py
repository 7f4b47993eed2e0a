"""The connector's GPU data path measured: transfer rate, overlap and forward slowdown.

Runs tests/support/gpu_harness.py (prefill and decode processes, the connector's worker on a KV
cache built as vLLM 0.32 allocates it for an attention backend, a synthetic forward per
layer) and prints, per transport and mode, beside the limits measured in the same run on the same device:

* KV rate, from a run whose forward only writes the KV (no compute, so the forward does
  not bound it): bytes landed / (first layer handed to the sender -> last layer in
  decode's blocks), beside pinned host<->device copy bandwidth (cudaMemcpy D2H and H2D)
  and a device-to-device copy (on the CPU: a memcpy). Targets (GPU): host-staged >= 0.8 x pinned
  D2H/H2D; NIXL VRAM->VRAM on one host >= 0.8 x device-to-device.
* hidden (from the run with the synthetic forward): 1 - (decode's last layer landed - prefill's forward
  complete) / (that landed - first layer sent), the share of the transfer behind the forward. Target >= 90 %.
* slowdown: prefill's step with the sends / the same step without, alternated per
  request so the host's drift cancels. Target <= 3 %.

Usage: python3 benchmarks/gpu_transfer.py [--device cuda|cpu|standin] [--transports tcp shm]
           [--backends FLASH_ATTN FLASHMLA] [--kv-layout LBHNC] [--layers 0] [--blocks 32]
           [--block-size 0] [--hidden 4096] [--rounds 5]
(MLA backends get a DeepSeek-V3 shape, the others a Llama-3-8B one; 0 = the model's own.)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.support import vllm_kv_cache as replay
from tests.support.gpu_harness import HarnessSpec, run


def copy_gbps(device: str, nbytes: int, kind: str) -> float:
    """GB/s of one copy of ``nbytes``: d2h / h2d (pinned host) or d2d; on CPU a memcpy."""
    if device != "cuda":
        a, b = torch.zeros(nbytes, dtype=torch.uint8), torch.ones(nbytes, dtype=torch.uint8)
        return _best(lambda: a.copy_(b), nbytes, sync=lambda: None)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    other = (
        torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        if kind == "d2d"
        else torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    )
    src, dst = {"d2h": (dev, other), "h2d": (other, dev), "d2d": (dev, other)}[kind]
    return _best(lambda: dst.copy_(src, non_blocking=True), nbytes, sync=torch.cuda.synchronize)


def _best(fn, nbytes: int, sync) -> float:
    best = float("inf")
    for _ in range(7):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--transports", nargs="+", default=["tcp", "shm"])
    ap.add_argument("--backends", nargs="+", default=["FLASH_ATTN"], choices=sorted(replay.BACKENDS))
    ap.add_argument("--kv-layout", default="", help="vLLM's KV cache layout (default: what vLLM resolves with us)")
    ap.add_argument("--layers", type=int, default=0, help="0: the model's (32 / 61)")
    ap.add_argument("--blocks", type=int, default=32, help="blocks per request")
    ap.add_argument("--block-size", type=int, default=0, help="0: the model's (16 / 64)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    print(
        f"device {args.device} ({torch.cuda.get_device_name() if args.device == 'cuda' else 'host'}), "
        f"{args.blocks} blocks per request, hidden {args.hidden}"
    )
    for backend in args.backends:
        model = "deepseek-v3" if replay.BACKENDS[backend].mla else "llama3-8b"
        spec0 = HarnessSpec(
            device=args.device,
            backend=backend,
            kv_layout=args.kv_layout,
            model=model,
            layers=args.layers,
            num_blocks=4 * args.blocks,
            block_size=args.block_size,
            blocks_per_request=args.blocks,
            hidden=args.hidden,
            rounds=args.rounds,
            host_staging_bytes=1 << 30,
        )
        nbytes = spec0.request_nbytes()
        kinds = ("d2h", "h2d", "d2d") if args.device == "cuda" else ("memcpy",)
        limits = {k: copy_gbps(args.device, nbytes, k) for k in kinds}
        m = spec0.kv_model()
        print(
            f"\n{backend} {spec0.layout().name}, {model} ({m.num_layers} layers, {m.block_size}-token blocks): "
            f"{nbytes / 2**20:.1f} MiB of KV per request; limits (same run): "
            + ", ".join(f"{k} {v:.2f} GB/s" for k, v in limits.items())
        )
        for transport in args.transports:
            bare = run(HarnessSpec(**{**spec0.__dict__, "transport": transport, "hidden": 0}))
            full = run(HarnessSpec(**{**spec0.__dict__, "transport": transport}))
            if bare.errors or full.errors:
                print(f"  {transport}: FAILED {(bare.errors or full.errors)[0].splitlines()[0]}")
                continue
            for mode in spec0.modes:
                _report(
                    transport,
                    mode,
                    [r for r in bare.requests if r.mode == mode],
                    [r for r in full.requests if r.mode == mode],
                    limits,
                )


def _report(transport: str, mode: str, bare: list, full: list, limits: dict[str, float]) -> None:
    f = transfer_figures(bare, full)
    peers = ", ".join(f"{f['gbps'] / v:.2f} x {k}" for k, v in limits.items())
    print(
        f"  {transport:5s} {mode:4s}: exact {f['exact']}, KV {f['gbps']:6.2f} GB/s = {peers}; "
        f"hidden {f['hidden'] * 100:5.1f} % (target >= 90), "
        f"forward slowdown {f['slowdown'] * 100:+.1f} % (target <= 3)"
    )


def transfer_figures(bare: list, full: list) -> dict[str, float | bool]:
    """One mode's figures (see the module docstring) from its requests of the run without compute
    (``bare``) and with it (``full``): exact, gbps, hidden (a share), slowdown (a share)."""
    return {
        "exact": all(r.exact and r.load_ok for r in bare + full),
        "gbps": statistics.median(r.nbytes / max(1e-9, r.landed_at - r.first_save_at) for r in bare) / 1e9,
        "hidden": statistics.median(
            1 - max(0.0, r.landed_at - r.forward_end_at) / max(1e-9, r.landed_at - r.first_save_at) for r in full
        ),
        "slowdown": statistics.median(r.forward_s / r.baseline_forward_s for r in full) - 1,
    }


if __name__ == "__main__":
    main()
