"""Prefix hit rate of the store's CPU-tier policy (AdaptiveCache) vs plain
leaf-first LRU of the same size, on synthetic multi-turn chat
(vllm_pd/connector/store/trace.py), several seeds x capacities side by side.

Both policies run over the real RadixIndex with leaf-first eviction (victims
leave the index at once); a request hits the longest cached prefix of its
prompt blocks, then its prompt + reply blocks are stored. Hit rate = hit
blocks / prompt blocks.

    python3 benchmarks/store_hit_rate.py [--seeds 3] [--conversations 800] [--sample-rate R]   # ~1 min

The shadow caches see a hash-sampled fraction of the keys (adaptive_cache.py):
by default the store's own choice for each capacity (``shadow_sample_rate``,
1/8 here), ``--sample-rate 1`` for unsampled shadows (~4 min); LRU is the
same either way. With a rate < 1 it also prints what the shadows cost per
request on the scheduler thread (observe_request + observe_save, 16-byte keys
like the store's, warm caches) unsampled and sampled, measured in the same run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import Counter
from collections.abc import Callable

from vllm_pd.connector.store.adaptive_cache import SAMPLE_RATE, AdaptiveCache, shadow_sample_rate
from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.connector.store.reuse_cache import LruCache
from vllm_pd.connector.store.trace import TraceConfig, TraceRequest, generate


def serve(index: RadixIndex, cache, req: TraceRequest, on_hit: Callable[[int], None] | None = None) -> int:
    """One request: hit the longest cached prefix of its prompt, then store prompt + reply.
    Returns the hit length; ``on_hit(n)`` sees the cache just before the hit is recorded."""
    adaptive = isinstance(cache, AdaptiveCache)
    if adaptive:
        cache.observe_request(req.prompt)
    n = index.longest_prefix(req.prompt)
    if n:
        if on_hit is not None:
            on_hit(n)
        cache.hit(req.prompt[:n])
    if adaptive:
        cache.observe_save(req.saved)
    admitted, _ = cache.admit(req.saved, index.evictable, index.remove_leaf)
    if admitted:
        start = req.saved.index(admitted[0])
        index.insert_chain(admitted, req.saved[start - 1] if start else None)
    return n


def simulate(requests: list[TraceRequest], cache) -> float:
    index = RadixIndex()
    hit = sum(serve(index, cache, req) for req in requests)
    return hit / sum(len(req.prompt) for req in requests)


def shadow_cost_ms(blocks: int, rate: float, rounds: int = 30) -> float:
    """Median ms of observe_request + observe_save of a ``blocks``-key request whose
    first half repeats the previous request's (a turn growing a conversation)."""
    cache = AdaptiveCache(4 * blocks, sample_rate=rate)
    history = [os.urandom(16) for _ in range(blocks // 2)]
    samples = []
    for _ in range(rounds):
        prompt = history + [os.urandom(16) for _ in range(blocks - len(history))]
        t0 = time.perf_counter()
        cache.observe_request(prompt)
        cache.observe_save(prompt)
        samples.append(time.perf_counter() - t0)
        history = prompt[: blocks // 2]
    return 1e3 * statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=800)
    ap.add_argument("--arrival-rate", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--fractions", default="0.005,0.01,0.02,0.05,0.1,0.2,0.5")
    ap.add_argument(
        "--sample-rate",
        type=float,
        default=None,
        help="fraction of keys the shadow caches see (default: the store's choice per capacity)",
    )
    args = ap.parse_args()
    rate = SAMPLE_RATE if args.sample_rate is None else args.sample_rate
    if rate < 1.0:
        for blocks in (128, 8192):
            full, sampled = shadow_cost_ms(blocks, 1.0), shadow_cost_ms(blocks, rate)
            print(
                f"shadows, {blocks}-block request: {sampled:.3f} ms sampled at {rate:g} "
                f"vs {full:.3f} ms unsampled = {sampled / full:.2f} x"
            )
        print()
    fractions = [float(f) for f in args.fractions.split(",")]
    t0 = time.perf_counter()
    ratios: dict[float, list[float]] = {f: [] for f in fractions}
    print("| seed | capacity (blocks) | of unique | LRU | ours | ours / LRU | base used most |")
    print("|---|---|---|---|---|---|---|")
    for seed in range(args.seeds):
        reqs = list(generate(TraceConfig(conversations=args.conversations, arrival_rate=args.arrival_rate, seed=seed)))
        unique = len({b for r in reqs for b in r.saved})
        for frac in fractions:
            cap = max(16, int(unique * frac))
            lru = simulate(reqs, LruCache(cap))
            cache = AdaptiveCache(
                cap, sample_rate=shadow_sample_rate(cap) if args.sample_rate is None else args.sample_rate
            )
            used: Counter[float] = Counter()
            index = RadixIndex()
            hit = 0
            for req in reqs:
                hit += serve(index, cache, req)
                used[cache.base] += 1
            ours = hit / sum(len(r.prompt) for r in reqs)
            ratio = ours / lru if lru else float("inf")
            ratios[frac].append(ratio)
            print(
                f"| {seed} | {cap} | {frac:.1%} | {lru:.1%} | {ours:.1%} | {ratio:.3f}x "
                f"| {used.most_common(1)[0][0]} |",
                flush=True,
            )
        print(
            f"<!-- seed {seed}: {len(reqs)} requests, {unique} unique blocks, "
            f"infinite-cache hit {simulate(reqs, LruCache(10**9)):.1%} -->",
            flush=True,
        )
    print()
    print("| capacity | worst ours / LRU | best | over seeds |")
    print("|---|---|---|---|")
    for frac, rs in ratios.items():
        print(f"| {frac:.1%} | {min(rs):.3f}x | {max(rs):.3f}x | {len(rs)} |")
    print(f"\n({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
