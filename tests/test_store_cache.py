import pytest

from vllm_pd.connector.store.adaptive_cache import AdaptiveCache
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
