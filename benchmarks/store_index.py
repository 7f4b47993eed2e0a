"""Index speed: longest-prefix lookup of a 128K-token prompt and batched insert
rate, RadixIndex vs a plain dict-of-hash-chains baseline in the same run.

    python3 benchmarks/store_index.py
"""

from __future__ import annotations

import random
import statistics
import time

from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.protocol.block_keys import KeySalt, chain_keys

TOKENS = 128 * 1024
BLOCK = 16


def best(fn, repeat: int = 7) -> tuple[float, float]:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def dict_longest_prefix(index: dict, chain) -> int:
    n = 0
    for key in chain:  # the baseline walks the chain until the first miss
        if key not in index:
            break
        n += 1
    return n


def main() -> None:
    salt = KeySalt("bench", "bfloat16", "cpu", BLOCK, 32)
    rng = random.Random(0)
    prompt = [rng.randrange(128000) for _ in range(TOKENS)]
    t_hash, t_hash_med = best(lambda: chain_keys(prompt, salt), 5)
    chain = chain_keys(prompt, salt)
    print(f"prompt: {TOKENS} tokens = {len(chain)} blocks of {BLOCK}")
    print(
        f"hashing the chain (blake3, both indexes need it): {t_hash * 1e3:.1f} ms (median {t_hash_med * 1e3:.1f})"
        f" = {TOKENS / t_hash / 1e6:.1f} M tokens/s"
    )

    radix, plain = RadixIndex(), {}
    # background load: 2000 other conversations of 64 blocks
    others = [[rng.randbytes(16) for _ in range(64)] for _ in range(2000)]
    for c in others:
        radix.insert_chain(c)
        plain.update(dict.fromkeys(c))
    radix.insert_chain(chain)
    plain.update(dict.fromkeys(chain))
    print("\n| lookup (hit length) | RadixIndex (binary search) | dict of hash chains (walk) | speed-up |")
    print("|---|---|---|---|")
    for hit in (len(chain), len(chain) // 2, 16):
        probe = chain[:hit] + [rng.randbytes(16) for _ in range(len(chain) - hit)]
        assert radix.longest_prefix(probe) == dict_longest_prefix(plain, probe) == hit
        r, _ = best(lambda: radix.longest_prefix(probe), 50)
        d, _ = best(lambda: dict_longest_prefix(plain, probe), 50)
        print(f"| {hit} of {len(chain)} blocks | {r * 1e6:.1f} us | {d * 1e6:.1f} us | {d / r:.0f}x |")

    print("\n| insert | RadixIndex | dict baseline | ratio |")
    print("|---|---|---|---|")
    fresh = [[rng.randbytes(16) for _ in range(64)] for _ in range(1000)]

    def radix_batch():
        idx = RadixIndex()
        idx.insert_batch((None, c) for c in fresh)

    def dict_batch():
        d: dict = {}
        for c in fresh:
            d.update(dict.fromkeys(c))

    n = sum(len(c) for c in fresh)
    r, _ = best(radix_batch, 5)
    d, _ = best(dict_batch, 5)
    print(
        f"| batched, 1000 chains x 64 keys | {n / r / 1e6:.2f} M keys/s | {n / d / 1e6:.2f} M keys/s | {d / r:.2f}x |"
    )
    r, _ = best(lambda: RadixIndex().insert_chain(chain), 5)
    d, _ = best(lambda: dict.fromkeys(chain), 5)
    print(
        f"| one 128K-token chain (8192 keys) | {len(chain) / r / 1e6:.2f} M keys/s "
        f"| {len(chain) / d / 1e6:.2f} M keys/s | {d / r:.2f}x |"
    )


if __name__ == "__main__":
    main()
