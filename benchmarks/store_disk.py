"""Disk tier throughput beside a raw sequential file of the same bytes, same run.

    python3 benchmarks/store_disk.py [--total-mib 256] [--block-kib 256 1024 4096] [--dir /tmp]

For each block size (a block = one KV block of one rank, all layers: 1 MiB is
128 tokens at 8 KiB of KV per token), the same random bytes go through

* the disk tier (store/disk_tier.py): ``write`` of every block (one file each,
  header + payload to ``*.tmp`` then ``os.replace``, on the tier's I/O threads;
  checksum given, as the worker passes the one it computed when saving), then
  ``read_into`` of every block (header check + read + blake3 verification);
* a raw sequential file: one ``open``, the same blocks written in order, then
  read back in order into one buffer (no header, no checksum, no rename).

Writes are timed up to ``os.sync()`` (bytes on the device, both alike); reads
are cold (``posix_fadvise(DONTNEED)`` drops the files from the page cache
first) and warm (page cache). Rounds alternate tier and raw, the median is
printed. The tier's figure is printed as a fraction of the raw one.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from vllm_pd.connector.store.cpu_pool import checksum
from vllm_pd.connector.store.disk_tier import DiskTier
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, chain_keys

SALT = KeySalt("bench-disk", "bfloat16", "cpu", 16, 8)
SCOPE = NO_EXTRA_KEYS.scope(SALT)


def drop_from_page_cache(paths: list[Path]) -> None:
    """Cold reads: write back and evict these files' pages (clean pages only are evicted)."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(root: Path, block: int, count: int, rounds: int) -> dict[str, float]:
    payloads = [memoryview(os.urandom(block)) for _ in range(count)]
    sums = [checksum(p) for p in payloads]
    keys = chain_keys(list(range(count * SALT.block_size)), SALT)
    dst = [memoryview(bytearray(block)) for _ in range(count)]
    raw_path = root / "raw.bin"
    raw_dst = bytearray(block * count)
    samples: dict[str, list[float]] = {k: [] for k in ("tier_w", "raw_w", "tier_rc", "raw_rc", "tier_rw", "raw_rw")}
    for r in range(rounds):
        tier_dir = root / f"tier{r}"
        tier = DiskTier(tier_dir, SALT.digest(), 0, capacity_bytes=4 * block * count)
        try:

            def tier_write() -> None:
                futures = [tier.write(k, None, p, SCOPE, s) for k, p, s in zip(keys, payloads, sums)]
                if not all(f.result() for f in futures):
                    raise SystemExit("disk tier write failed")
                os.sync()

            def raw_write() -> None:
                with open(raw_path, "wb") as f:
                    for p in payloads:
                        f.write(p)
                os.sync()

            def tier_read() -> None:
                futures = [tier.read_into(k, d) for k, d in zip(keys, dst)]
                if not all(f.result() is not None for f in futures):
                    raise SystemExit("disk tier read failed verification")

            def raw_read() -> None:
                with open(raw_path, "rb") as f:
                    view = memoryview(raw_dst)
                    for i in range(count):
                        f.readinto(view[i * block : (i + 1) * block])

            samples["tier_w"].append(timed(tier_write))
            samples["raw_w"].append(timed(raw_write))
            drop_from_page_cache([p for p in tier.dir.rglob("*") if p.is_file()] + [raw_path])
            samples["tier_rc"].append(timed(tier_read))
            samples["raw_rc"].append(timed(raw_read))
            samples["tier_rw"].append(timed(tier_read))
            samples["raw_rw"].append(timed(raw_read))
            if bytes(dst[-1]) != bytes(payloads[-1]) or raw_dst[-block:] != bytes(payloads[-1]):
                raise SystemExit("read back different bytes")
        finally:
            tier.close()
            for path in sorted(tier_dir.rglob("*"), reverse=True):
                path.unlink() if path.is_file() else path.rmdir()
            raw_path.unlink(missing_ok=True)
    nbytes = block * count
    return {k: nbytes / statistics.median(v) / 1e9 for k, v in samples.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--total-mib", type=int, default=256, help="bytes per round and block size")
    ap.add_argument("--block-kib", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="where the files go (default: a temp dir)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="store-disk-bench-", dir=args.dir) as tmp:
        print(f"{args.total_mib} MiB per round, median of {args.rounds} rounds, files in {tmp}")
        print("| block | write (to device) | cold read | warm read (page cache) |")
        print("|---|---|---|---|")
        for kib in args.block_kib:
            block = kib << 10
            g = measure(Path(tmp), block, (args.total_mib << 20) // block, args.rounds)
            cells = [
                f"tier {g['tier_' + k]:.2f} GB/s = {g['tier_' + k] / g['raw_' + k]:.2f} x raw ({g['raw_' + k]:.2f})"
                for k in ("w", "rc", "rw")
            ]
            print(f"| {kib} KiB | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
