"""Hot and cold radix trees vs the store's one tree, on the multi-turn chat trace.

    python3 benchmarks/store_trees.py [--conversations 1500] [--fraction 0.05]

The seed design keeps a hot tree (recently used prefixes) and a cold one (the
rest). In the store, what is hot is decided by the replacement policy
(AdaptiveCache: re-used blocks, level >= 1 = hot, new ones = cold); the index only says
where a key's bytes are. So two trees cannot change the hit rate - the same
policy keeps the same keys - they can only change the index's cost. This
replays the trace through the one-tree store index and counts what a two-tree
index would have to do on top: a second lookup whenever the hot tree does not
cover the whole hit, and a move (detach from cold + insert into hot) for every
key the policy promotes from level 0 (new) to a re-used level. Moves and lookups are then
timed on the real RadixIndex, so the overhead is in measured microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from store_hit_rate import serve  # benchmarks/ is the script's own folder

from vllm_pd.connector.store.adaptive_cache import AdaptiveCache
from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.connector.store.trace import TraceConfig, generate


def replay(requests, capacity: int) -> dict[str, float]:
    index = RadixIndex()
    cache = AdaptiveCache(capacity)
    moves = 0
    real_hit = cache.real.hit

    def counting_hit(chain) -> None:
        # every key leaving level 0 is a hot-tree insert
        nonlocal moves
        moves += sum(1 for k in chain if cache.real.level(k) == 0)
        real_hit(chain)

    cache.real.hit = counting_hit  # type: ignore[method-assign]
    hit = total = second_lookups = 0
    lookup_s = 0.0
    for req in requests:
        t0 = time.perf_counter()
        index.longest_prefix(req.prompt)
        lookup_s += time.perf_counter() - t0

        def count_second_lookup(n: int, prompt=req.prompt) -> None:
            # a two-tree lookup walks the hot tree first and continues in the cold one
            # unless the whole hit is hot
            nonlocal second_lookups
            if any(not cache.real.level(k) for k in prompt[:n]):
                second_lookups += 1

        hit += serve(index, cache, req, count_second_lookup)
        total += len(req.prompt)
    return {
        "requests": len(requests),
        "hit_rate": hit / total,
        "moves": moves,
        "second_lookups": second_lookups,
        "lookup_us": 1e6 * lookup_s / len(requests),
    }


def time_move(chain_len: int = 64, rounds: int = 2000) -> float:
    """Microseconds to move one key between two trees (remove a leaf, insert it under its parent)."""
    cold, hot = RadixIndex(), RadixIndex()
    keys = [i.to_bytes(16, "little") for i in range(1, chain_len + 1)]
    cold.insert_chain(keys)
    hot.insert_chain(keys[:-1])
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        cold.remove_leaf(keys[-1])
        hot.insert_chain([keys[-1]], keys[-2])
        t1 = time.perf_counter()
        hot.remove_leaf(keys[-1])
        cold.insert_chain([keys[-1]], keys[-2])
        samples.append((t1 - t0) * 1e6)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--conversations", type=int, default=1500)
    ap.add_argument("--fractions", default="0.01,0.05,0.2")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    reqs = list(generate(TraceConfig(conversations=args.conversations, seed=args.seed)))
    unique = len({b for r in reqs for b in r.saved})
    move_us = time_move()
    print(
        f"trace seed {args.seed}: {len(reqs)} requests, {unique} unique blocks; one move between trees "
        f"(remove leaf + insert) = {move_us:.2f} us on RadixIndex"
    )
    print(
        "| capacity | hit rate (both) | lookup, one tree | second lookups | moves / request | "
        "two trees: extra index time / request |"
    )
    print("|---|---|---|---|---|---|")
    for frac in (float(f) for f in args.fractions.split(",")):
        cap = max(16, int(unique * frac))
        r = replay(reqs, cap)
        extra = (r["second_lookups"] * r["lookup_us"] + r["moves"] * move_us) / r["requests"]
        print(
            f"| {frac:.0%} ({cap}) | {r['hit_rate']:.1%} | {r['lookup_us']:.2f} us | "
            f"{r['second_lookups'] / r['requests']:.0%} of requests | {r['moves'] / r['requests']:.1f} | "
            f"+{extra:.1f} us (= {extra / r['lookup_us']:.1f}x the one-tree lookup) |"
        )


if __name__ == "__main__":
    main()
