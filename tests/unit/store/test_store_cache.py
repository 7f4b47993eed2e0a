from collections import Counter

import pytest

from vllm_pd.connector.store.adaptive_cache import SAMPLE_RATE, AdaptiveCache, sample_hash, shadow_sample_rate
from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.connector.store.reuse_cache import LruCache, ReuseAgedCache
from vllm_pd.connector.store.trace import TraceConfig, generate


def always(_):
    return True


def test_lru_baseline_evicts_least_recent_leaf_first():
    c = LruCache(3)
    assert c.admit(["a", "b", "c"], always) == (["a", "b", "c"], [])
    admitted, evicted = c.admit(["x"], always)
    assert admitted == ["x"] and evicted == ["c"]  # the chain's leaf is the least recent


def test_evicted_parent_becomes_victim_in_the_same_admission():
    # a long old chain must give up several blocks for one admission: with the index
    # updated at once (on_evict), the parent of an evicted leaf is the next victim
    for cache in (LruCache(4), ReuseAgedCache(4, 0.5)):
        index = RadixIndex()
        for chain in (["a", "b", "c", "d"], ["x", "y", "z"]):
            admitted, _ = cache.admit(chain, index.evictable, index.remove_leaf)
            index.insert_chain(admitted)
        assert sorted(index.keys()) == ["a", "x", "y", "z"] and len(cache) == 4


def test_reuse_weighting_keeps_a_shared_prefix_that_lru_drops():
    # "s" was re-used once; then a stream of new 2-block chains arrives: LRU drops "s"
    # (least recent), base 0.1 ages it ten times slower and drops the newcomers first
    lru, aged = LruCache(4), ReuseAgedCache(4, base=0.1)
    for cache in (lru, aged):
        index = RadixIndex()
        for chain in (["s"], ["n0", "m0"], ["n1", "m1"], ["n2", "m2"]):
            admitted, _ = cache.admit(chain, index.evictable, index.remove_leaf)
            index.insert_chain(admitted)
            if chain == ["s"]:
                cache.hit(["s"])
    assert "s" not in lru and "s" in aged and aged.level("s") == 1


def test_base_one_is_exactly_lru():
    reqs = list(generate(TraceConfig(conversations=60, seed=2)))
    for cap in (40, 200):
        results = []
        for cache in (LruCache(cap), ReuseAgedCache(cap, 1.0)):
            index, hits = RadixIndex(), []
            for r in reqs:
                n = index.longest_prefix(r.prompt)
                cache.hit(r.prompt[:n])
                admitted, _ = cache.admit(r.saved, index.evictable, index.remove_leaf)
                if admitted:
                    start = r.saved.index(admitted[0])
                    index.insert_chain(admitted, r.saved[start - 1] if start else None)
                hits.append(n)
            results.append(hits)
        assert results[0] == results[1]


def test_adaptive_follows_the_shadow_that_hits_most():
    c = AdaptiveCache(4, bases=(1.0, 0.1), half_life=10, margin=0.0)
    assert c.base == 1.0
    c.observe_save(["s"])
    c.observe_request(["s"])
    for i in range(12):  # "s" asked every other request between new 2-block chains: LRU's shadow drops it
        c.observe_request([f"q{i}"])
        c.observe_save([f"n{i}", f"m{i}"])
        if i % 2:
            c.observe_request(["s"])
    assert c.scores[1] > c.scores[0] and c.base == 0.1


def test_pins_are_respected():
    full = AdaptiveCache(2)
    full.admit(["p", "q"], always)
    assert full.admit(["r"], lambda k: False) == ([], [])  # everything pinned: nothing admitted, nothing lost
    assert "p" in full and "q" in full


def test_bad_parameters():
    with pytest.raises(ValueError):
        ReuseAgedCache(0)
    with pytest.raises(ValueError):
        ReuseAgedCache(4, base=0.0)
    with pytest.raises(ValueError):
        AdaptiveCache(4, bases=(0.5, 1.0))


def test_trace_shape():
    reqs = list(generate(TraceConfig(conversations=50, seed=3)))
    assert [r.time_s for r in reqs] == sorted(r.time_s for r in reqs)
    by_conv = {}
    for r in reqs:
        prev = by_conv.get(r.conversation)
        if prev is not None:  # a turn's prompt starts with the previous turn's prompt + reply
            assert r.prompt[: len(prev.saved)] == prev.saved and r.turn == prev.turn + 1
        by_conv[r.conversation] = r
    assert any(r.turn > 0 for r in reqs) and any(r.turn == 0 for r in reqs)


# ---- sampled shadows ------------------------------------------------------------------------

IN = [b"\x00\x00\x00\x00" + bytes([i]) * 12 for i in range(8)]  # hash 0: sampled at any rate
OUT = [b"\xff\xff\xff\xff" + bytes([i]) * 12 for i in range(8)]  # hash 2**32 - 1: never sampled below 1


def test_sampled_shadows_see_only_sampled_keys_in_scaled_caches():
    c = AdaptiveCache(8, sample_rate=0.25)
    assert all(s.policy.capacity == 2 for s in c.shadows)
    c.observe_save([IN[0], OUT[0], IN[1], OUT[1]])
    for shadow in c.shadows:
        assert IN[0] in shadow.policy and IN[1] in shadow.policy
        assert OUT[0] not in shadow.policy and OUT[1] not in shadow.policy
    c.observe_request([IN[0], OUT[0], IN[1]])
    assert c.scores == [8.0] * len(c.bases)  # 2 sampled hits, each standing for 1 / 0.25 blocks


def test_sample_hash_is_process_independent_and_rejects_other_keys():
    assert sample_hash(b"\x01\x00\x00\x00rest") == 1
    assert sample_hash(3) == (3 * 0x9E3779B1) % 2**32
    with pytest.raises(TypeError):
        sample_hash("a str key")
    with pytest.raises(ValueError):
        AdaptiveCache(4, sample_rate=0.0)


@pytest.mark.parametrize("rate", [1.0, SAMPLE_RATE])
def test_sampled_policy_choice_on_the_trace(rate):
    """On the multi-turn trace at a small capacity, where re-use weighting wins
    (benchmarks/store_hit_rate.py), the sampled shadows leave LRU too; at a large
    one, where it loses, they keep the cache on LRU."""
    reqs = list(generate(TraceConfig(conversations=300, seed=0)))
    unique = len({b for r in reqs for b in r.saved})
    used = {}
    for frac in (0.01, 0.2):
        cache, index = AdaptiveCache(int(unique * frac), sample_rate=rate), RadixIndex()
        bases = Counter()
        for r in reqs:
            cache.observe_request(r.prompt)
            n = index.longest_prefix(r.prompt)
            if n:
                cache.hit(r.prompt[:n])
            cache.observe_save(r.saved)
            admitted, _ = cache.admit(r.saved, index.evictable, index.remove_leaf)
            if admitted:
                start = r.saved.index(admitted[0])
                index.insert_chain(admitted, r.saved[start - 1] if start else None)
            bases[cache.base] += 1
        used[frac] = bases.most_common(1)[0][0]
    assert used[0.01] < 1.0 and used[0.2] == 1.0


def test_the_store_samples_large_tiers_only():
    assert shadow_sample_rate(6) == 1.0 and shadow_sample_rate(32) == 1.0
    assert shadow_sample_rate(128) == 0.25 and shadow_sample_rate(4096) == 0.125
    from vllm_pd.connector.store.block_placement import BlockPlacement

    assert BlockPlacement(4096, 1, False).cache.sample_rate == 0.125
