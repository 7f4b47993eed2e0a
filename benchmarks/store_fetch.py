"""Node-to-node block fetch of the store beside a bare transport fetch of the same bytes.

    python3 benchmarks/store_fetch.py [--slots 32] [--slot-mib 1] [--rounds 20]

Two store pools (PoolExchange, TCP transport on loopback) in one process. The
store's fetch = lease round trip (notify) + transport fetch (per-block length
and blake3 checksum) + release round trip (answers whether a slot was
overwritten meanwhile). Its peer, measured in the same run on the same pools,
rounds alternating with it (a loaded machine slows both alike): the
transport's fetch alone of the same slots under a standing grant. Also the
latency of fetching one slot (what a short prefix costs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.keys import KeySalt, chain_keys
from vllm_pd.connector.store.pool_exchange import POOL_REGION, PoolExchange, SlotDirectory


def exchange(slots: int, layers: int, layer_nbytes: int) -> PoolExchange:
    pool = CpuBlockPool(slots, layers, layer_nbytes)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8))
    ex = PoolExchange(pool, SlotDirectory(), timeout_s=30.0)
    ex.start("127.0.0.1", "127.0.0.1")
    return ex


def timed_pair(first, second, rounds: int) -> tuple[float, float]:  # noqa: ANN001
    """Median seconds of ``first`` and of ``second``, run alternately."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(samples[0]), statistics.median(samples[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=32, help="slots per fetch")
    ap.add_argument("--slot-mib", type=float, default=1.0, help="bytes of one block, all layers (8 KiB/token x 128)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    args = ap.parse_args()
    layer_nbytes = int(args.slot_mib * (1 << 20)) // args.layers
    n = args.slots
    holder, asker = exchange(2 * n, args.layers, layer_nbytes), exchange(2 * n, args.layers, layer_nbytes)
    keys = chain_keys(list(range(n * 4)), KeySalt("bench", "bf16", "cpu", 4, args.layers))
    for i, key in enumerate(keys):
        holder.directory.put(key, n + i, holder.pool.checksum(n + i))
    local = list(range(n))
    remote = list(range(n, 2 * n))
    nbytes = n * holder.pool.slot_nbytes
    try:
        def store_fetch() -> None:
            if len(asker.fetch(holder.endpoint, keys, local)) != n:
                raise SystemExit("store fetch failed")

        store_fetch()
        assert torch.equal(asker.pool.data[:n], holder.pool.data[n:])
        holder.transport.allow_fetch("bench-standing", remote)
        def bare_fetch(count: int) -> None:
            asker.transport.fetch(holder.endpoint, "bench-standing", POOL_REGION, remote[:count], local[:count],
                                  30.0).result()

        store, bare = timed_pair(store_fetch, lambda: bare_fetch(n), args.rounds)
        one, one_bare = timed_pair(lambda: asker.fetch(holder.endpoint, keys[:1], local[:1]),
                                   lambda: bare_fetch(1), args.rounds)
    finally:
        holder.close()
        asker.close()
    print(f"{n} slots x {holder.pool.slot_nbytes / (1 << 20):.2f} MiB = {nbytes / (1 << 20):.0f} MiB per fetch, "
          f"median of {args.rounds}")
    print(f"store fetch (lease + fetch + release/intact check): {nbytes / store / 1e9:.2f} GB/s "
          f"= {bare / store:.2f} x bare transport fetch ({nbytes / bare / 1e9:.2f} GB/s)")
    print(f"one slot: store {one * 1e3:.2f} ms vs bare transport {one_bare * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
