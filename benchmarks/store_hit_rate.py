"""Prefix hit rate of the store's two-level cache vs plain LRU of the same size,
on synthetic multi-turn chat (vllm_pd/connector/store/trace.py).

Both policies run over the real RadixIndex with leaf-first eviction; a request
hits the longest cached prefix of its prompt blocks, then its prompt + reply
blocks are stored. Hit rate = hit blocks / prompt blocks.

    python3 benchmarks/store_hit_rate.py [--conversations 3000]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.connector.store.trace import TraceConfig, generate
from vllm_pd.connector.store.two_level_cache import LruCache, TwoLevelCache


def serve(index: RadixIndex, cache, req, on_hit: Callable[[int], None] | None = None) -> int:
    """One request: hit the longest cached prefix of its prompt, then store prompt + reply.
    Returns the hit length; ``on_hit(n)`` sees the cache just before the hit is recorded."""
    n = index.longest_prefix(req.prompt)
    if n:
        if on_hit is not None:
            on_hit(n)
        cache.hit(req.prompt[:n])
    admitted, evicted = cache.admit(req.saved, index.evictable)
    for key in evicted:
        index.remove_leaf(key)
    if admitted:
        start = req.saved.index(admitted[0])
        index.insert_chain(admitted, req.saved[start - 1] if start else None)
    return n


def simulate(requests, cache) -> float:
    index = RadixIndex()
    hit = sum(serve(index, cache, req) for req in requests)
    return hit / sum(len(req.prompt) for req in requests)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--arrival-rate", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--fractions", default="0.005,0.01,0.02,0.05,0.1,0.2,0.5")
    args = ap.parse_args()
    print("| seed | capacity (blocks) | of unique | LRU | two-level | ratio |")
    print("|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        cfg = TraceConfig(conversations=args.conversations, arrival_rate=args.arrival_rate, seed=seed)
        reqs = list(generate(cfg))
        unique = len({b for r in reqs for b in r.saved})
        inf = simulate(reqs, LruCache(10 ** 9))
        t0 = time.perf_counter()
        for frac in (float(f) for f in args.fractions.split(",")):
            cap = max(16, int(unique * frac))
            lru = simulate(reqs, LruCache(cap))
            ours = simulate(reqs, TwoLevelCache(cap))
            print(f"| {seed} | {cap} | {frac:.0%} | {lru:.1%} | {ours:.1%} | {ours / lru if lru else float('inf'):.2f}x |")
        print(f"<!-- seed {seed}: {len(reqs)} requests, {unique} unique blocks, infinite-cache hit {inf:.1%}, "
              f"{time.perf_counter() - t0:.1f}s -->")


if __name__ == "__main__":
    main()
