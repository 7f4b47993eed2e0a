"""Node-to-node block fetch of the store beside a bare transport fetch of the same bytes.

    python3 benchmarks/store_fetch.py [--slots 32] [--slot-mib 1] [--rounds 20]

Two store pools (PoolExchange, TCP transport on loopback) in one process. The
store's fetch = grant round trip (notify) + one transport fetch per layer, all
queued at once (per-block length and checksum) + release round trip (answers
whether a slot was overwritten meanwhile). Its peer, measured in the same run
on the same pools, rounds alternating with it (a loaded machine slows both
alike): one transport fetch of the same bytes under a standing grant. Also
when the first layer has landed (what the forward's first layer waits for
since the fetch is layer-wise; before, it waited for the whole fetch), and the
latency of fetching one slot (what a short prefix costs).

Step emulation (``--forward-ms``, torch on one thread like a server pinned to
one core): a forward of ``--layers`` equal matmul layers taking
``--forward-ms`` in all, after a fetch of the prefix, two ways alternating:
whole fetch (all layers + release), then per layer copy + forward (what the
loader did before) vs per layer: wait for that layer's bytes, copy, forward
(now), the release after the last layer.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.store_disk import drop_from_page_cache
from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.disk_staging import DiskStaging
from vllm_pd.connector.store.disk_tier import DiskTier
from vllm_pd.connector.store.pool_exchange import POOL_REGION, PoolExchange, SlotDirectory
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, chain_keys

SCOPE = NO_EXTRA_KEYS.scope(KeySalt("bench", "bf16", "cpu", 4, 1))  # what the blocks were written for


def exchange(slots: int, layers: int, layer_nbytes: int, disk_dir: str | None = None) -> PoolExchange:
    """A pool of ``slots``; with ``disk_dir`` also a disk tier served through as many spare rows."""
    spare = slots if disk_dir is not None else 0
    pool = CpuBlockPool(slots + spare, layers, layer_nbytes)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8))
    staging = None
    if disk_dir is not None:
        salt = KeySalt("bench", "bf16", "cpu", 4, layers)
        disk = DiskTier(disk_dir, salt.digest(), 0, capacity_bytes=4 * (slots + spare) * pool.slot_nbytes)
        staging = DiskStaging(pool, disk, range(slots, slots + spare))
    ex = PoolExchange(pool, SlotDirectory(), timeout_s=30.0, staging=staging)
    ex.start("127.0.0.1", "127.0.0.1")
    return ex


def timed_pair(first, second, rounds: int) -> tuple[float, float]:
    """Median seconds of ``first`` and of ``second``, run alternately."""
    samples: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, out in ((first, samples[0]), (second, samples[1])):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return statistics.median(samples[0]), statistics.median(samples[1])


class Forward:
    """A stand-in for one layer of a forward pass: matmuls calibrated to ``layer_ms``."""

    def __init__(self, layer_ms: float) -> None:
        self.a = torch.randn(256, 256)
        for _ in range(20):  # warm-up: the first products pay one-off costs
            torch.mm(self.a, self.a)
        t0 = time.perf_counter()
        for _ in range(20):
            torch.mm(self.a, self.a)
        one = (time.perf_counter() - t0) / 20
        self.repeat = max(1, round(layer_ms / 1e3 / one))

    def layer(self) -> None:
        for _ in range(self.repeat):
            torch.mm(self.a, self.a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--slots", type=int, default=32, help="slots per fetch")
    ap.add_argument("--slot-mib", type=float, default=1.0, help="bytes of one block, all layers (8 KiB/token x 128)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--forward-ms", type=float, default=40.0, help="emulated forward of the uncached part")
    args = ap.parse_args()
    torch.set_num_threads(1)
    layer_nbytes = int(args.slot_mib * (1 << 20)) // args.layers
    n = args.slots
    tmp = tempfile.TemporaryDirectory(prefix="store-fetch-bench-")
    holder = exchange(2 * n, args.layers, layer_nbytes, disk_dir=tmp.name)
    asker = exchange(2 * n, args.layers, layer_nbytes)
    keys = chain_keys(list(range(n * 4)), KeySalt("bench", "bf16", "cpu", 4, args.layers))
    for i, key in enumerate(keys):
        holder.directory.put(key, n + i, holder.pool.checksum(n + i), SCOPE)
    # the same bytes under other keys on the holder's disk only (served through its spare rows)
    salt = KeySalt("bench", "bf16", "cpu", 4, args.layers)
    disk_keys = chain_keys(list(range(10**6, 10**6 + n * 4)), salt)
    assert holder.staging is not None
    for i, key in enumerate(disk_keys):
        holder.staging.disk.write(key, disk_keys[i - 1] if i else None, holder.pool.slot_view(n + i), SCOPE).result()
    disk_files = [p for p in Path(tmp.name).rglob("*") if p.is_file()]
    local = list(range(n))
    layers = args.layers
    remote = list(range(n, 2 * n))
    # the pool region's blocks are (slot, layer) rows: slot s, layer l = row s * layers + l
    remote_rows = [s * layers + layer for s in remote for layer in range(layers)]
    local_rows = [s * layers + layer for s in local for layer in range(layers)]
    nbytes = n * holder.pool.slot_nbytes
    try:

        def store_fetch() -> None:
            if len(asker.fetch(holder.endpoint, keys, local, SCOPE)) != n:
                raise SystemExit("store fetch failed")

        store_fetch()
        assert torch.equal(asker.pool.data[:n], holder.pool.data[n : 2 * n])
        holder.transport.allow_fetch("bench-standing", remote_rows)

        def bare_fetch(count: int) -> None:
            asker.transport.fetch(
                holder.endpoint,
                "bench-standing",
                POOL_REGION,
                remote_rows[: count * layers],
                local_rows[: count * layers],
                30.0,
            ).result()

        first_layer: list[float] = []

        def store_fetch_layers() -> None:
            t0 = time.perf_counter()
            fetch = asker.start_fetch(holder.endpoint, keys, local, SCOPE)
            if not fetch.layer_landed(0):
                raise SystemExit("store fetch failed")
            first_layer.append(time.perf_counter() - t0)
            if len(fetch.finish()) != n:
                raise SystemExit("store fetch failed")

        store, bare = timed_pair(store_fetch_layers, lambda: bare_fetch(n), args.rounds)
        forward = Forward(args.forward_ms / layers)
        kv = [torch.zeros(n, layer_nbytes, dtype=torch.uint8) for _ in range(layers)]

        def step_whole_fetch_first() -> None:
            if len(asker.fetch(holder.endpoint, keys, local, SCOPE)) != n:
                raise SystemExit("store fetch failed")
            for layer in range(layers):
                asker.pool.load_layer(layer, local, kv[layer], local)
                forward.layer()

        def step_layer_wise() -> None:
            fetch = asker.start_fetch(holder.endpoint, keys, local, SCOPE)
            for layer in range(layers):
                if not fetch.layer_landed(layer):
                    raise SystemExit("store fetch failed")
                asker.pool.load_layer(layer, local, kv[layer], local)
                forward.layer()
            if len(fetch.finish()) != n:
                raise SystemExit("store fetch failed")

        def forward_only() -> None:
            for _ in range(layers):
                forward.layer()

        before, after = timed_pair(step_whole_fetch_first, step_layer_wise, args.rounds)
        fwd, _ = timed_pair(forward_only, lambda: None, args.rounds)

        def from_disk() -> None:
            if len(asker.fetch(holder.endpoint, disk_keys, local, SCOPE)) != n:
                raise SystemExit("store fetch from the holder's disk failed")

        from_disk()
        assert torch.equal(asker.pool.data[:n], holder.pool.data[n : 2 * n])
        disk_warm, pool_again = timed_pair(from_disk, store_fetch, args.rounds)
        cold = []
        for _ in range(max(3, args.rounds // 4)):
            drop_from_page_cache(disk_files)
            t0 = time.perf_counter()
            from_disk()
            cold.append(time.perf_counter() - t0)
        disk_cold = statistics.median(cold)
        one, one_bare = timed_pair(
            lambda: asker.fetch(holder.endpoint, keys[:1], local[:1], SCOPE), lambda: bare_fetch(1), args.rounds
        )
    finally:
        holder.close()
        asker.close()
        if holder.staging is not None:
            holder.staging.disk.close()
        tmp.cleanup()
    print(
        f"{n} slots x {holder.pool.slot_nbytes / (1 << 20):.2f} MiB = {nbytes / (1 << 20):.0f} MiB per fetch, "
        f"median of {args.rounds}"
    )
    print(
        f"store fetch (grant + fetch + release/intact check): {nbytes / store / 1e9:.2f} GB/s "
        f"= {bare / store:.2f} x bare transport fetch ({nbytes / bare / 1e9:.2f} GB/s)"
    )
    layer0 = statistics.median(first_layer)
    print(
        f"first layer landed after {layer0 * 1e3:.2f} ms = {layer0 / store:.2f} x the whole store fetch "
        f"({store * 1e3:.2f} ms): what the forward's layer 0 waits for"
    )
    print(f"one slot: store {one * 1e3:.2f} ms vs bare transport {one_bare * 1e3:.2f} ms")
    print(
        f"from the holder's disk (staged + verified there, then sent): page cache warm "
        f"{nbytes / disk_warm / 1e9:.2f} GB/s = {pool_again / disk_warm:.2f} x from its CPU pool "
        f"({nbytes / pool_again / 1e9:.2f} GB/s); cold {nbytes / disk_cold / 1e9:.2f} GB/s"
    )
    print(
        f"step = fetch + {layers}-layer forward ({fwd * 1e3:.1f} ms alone, one thread): layer-wise "
        f"{after * 1e3:.1f} ms vs whole fetch first {before * 1e3:.1f} ms = {after / before:.2f} x "
        f"(saves {(before - after) * 1e3:.1f} ms; the fetch alone takes {store * 1e3:.1f} ms)"
    )


if __name__ == "__main__":
    main()
