"""Checksum cost on one core, beside memcpy of the same bytes in the same run.

For each size: memcpy (torch ``copy_``), crc32c fused with the copy (``copy_crc32c``, what the
shm ring does), crc32c alone (what tcp does next to the kernel's copy), blake3 and zlib.crc32, and
the session-keyed BLAKE3 a deployment secret puts on every block (checksum.BlockCheck: copy and
hash through the ring's python path, and hash alone).
Sizes: a 256 KiB block (in cache) and 64 MiB (memory-bound, like a layer's KV).

Usage: python3 benchmarks/checksum.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import zlib
from collections.abc import Callable

import blake3
import torch

from vllm_pd.connector.transport.checksum import BlockCheck, BlockStream
from vllm_pd.ops import native

SIZES = (256 << 10, 64 << 20)


def _rate(fn: Callable[[], object], nbytes: int, rounds: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(rounds):
            fn()
        best = min(best, time.perf_counter() - t0)
    return rounds * nbytes / best / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    torch.set_num_threads(1)
    if native.load_error() is not None:
        print(native.load_error(), file=sys.stderr)
        return 2
    from vllm_pd import _C as c

    print(f"# one core, best of {args.repeats}; crc32c via SSE4.2: {c.crc32c_hardware()}")
    for nbytes in SIZES:
        src = torch.empty(nbytes, dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        dst.copy_(src)
        s, d = src.numpy(), dst.numpy()
        rounds = max(1, (256 << 20) // nbytes)
        keyed = BlockCheck.keyed(os.urandom(32), b"a frame")
        memcpy = _rate(lambda: dst.copy_(src), nbytes, rounds, args.repeats)
        cases = {
            "copy+crc32c (fused)": lambda: c.copy_crc32c(d, s),
            "crc32c": lambda: c.crc32c(s),
            "blake3": lambda: blake3.blake3(s).digest(8),
            "zlib.crc32": lambda: zlib.crc32(s),
            "keyed blake3": lambda: keyed.digest(0, s),
            "copy+keyed blake3 (ring)": lambda: BlockStream(keyed, [d]).drain(s),
        }
        line = [f"{nbytes >> 10} KiB: memcpy {memcpy:.2f} GB/s"]
        for name, fn in cases.items():
            gbs = _rate(fn, nbytes, rounds, args.repeats)
            line.append(f"{name} {gbs:.2f} GB/s = {gbs / memcpy:.2f} x memcpy")
        print("; ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
