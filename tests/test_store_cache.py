import pytest

from vllm_pd.connector.store.trace import TraceConfig, generate
from vllm_pd.connector.store.two_level_cache import LruCache, TwoLevelCache


def always(_):
    return True


def test_lru_baseline_evicts_least_recent_leaf_first():
    c = LruCache(3)
    assert c.admit(["a", "b", "c"], always) == (["a", "b", "c"], [])
    admitted, evicted = c.admit(["x"], always)
    assert admitted == ["x"] and evicted == ["c"]  # the chain's leaf is the least recent


def test_two_level_promotion_and_capacity():
    c = TwoLevelCache(4)
    c.admit(["a", "b"], always)
    assert c.level("a") == "history"
    c.hit(["a", "b"])
    assert c.level("a") == c.level("b") == "active"
    c.admit(["x", "y", "z"], always)
    assert len(c) == 4 and "a" in c  # history paid for the new chain; the re-used prefix stayed


def test_two_level_frequency_gate_and_ghost_adaptation():
    c = TwoLevelCache(4, initial_history_fraction=0.5)
    c.admit(["a", "b"], always)
    c.hit(["a", "b"])
    c.admit(["x"], always)
    c.admit(["y"], always)
    assert len(c) == 4
    c.admit(["z"], always)  # history is at its target: x (used once) loses to active's b (used twice)
    assert "x" not in c and {"a", "b", "y", "z"} <= {k for k in ("a", "b", "x", "y", "z") if k in c}
    before = c.history_target
    c.admit(["x"], always)  # x comes back soon after eviction: history was too small
    assert c.history_target > before


def test_pins_are_respected():
    full = TwoLevelCache(2)
    full.admit(["p", "q"], always)
    assert full.admit(["r"], lambda k: False) == ([], [])  # everything pinned: nothing admitted, nothing lost
    assert "p" in full and "q" in full


def test_bad_capacity():
    with pytest.raises(ValueError):
        TwoLevelCache(0)


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
