import pytest

from vllm_pd.connector.store.radix import RadixIndex


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_longest_prefix_and_batched_inserts():
    idx = RadixIndex()
    added = idx.insert_batch([(None, ["a", "b", "c"]), ("b", ["x", "y"]), ("missing", ["z"])])
    assert added == ["a", "b", "c", "x", "y"] and "z" not in idx
    assert idx.longest_prefix(["a", "b", "c", "d"]) == 3
    assert idx.longest_prefix(["a", "b", "x", "y", "q"]) == 4
    assert idx.longest_prefix(["q"]) == 0 and idx.longest_prefix([]) == 0
    assert idx.insert_chain(["a", "b"]) == []  # already there
    long_chain = [f"k{i}" for i in range(8192)]
    idx.insert_chain(long_chain)
    for n in (0, 1, 2, 4095, 8191, 8192):
        assert idx.longest_prefix(long_chain[:n] + ["miss"] * 3) == n


def test_leaf_first_removal_keeps_prefixes_reachable():
    idx = RadixIndex()
    idx.insert_chain(["a", "b", "c"])
    idx.insert_chain(["d"], parent="b")
    assert not idx.evictable("a") and not idx.evictable("b")
    assert idx.evictable("c") and idx.evictable("d")
    with pytest.raises(ValueError):
        idx.remove_leaf("b")
    idx.remove_leaf("c")
    assert idx.longest_prefix(["a", "b", "c"]) == 2
    idx.remove_leaf("d")
    assert idx.evictable("b")
    removed = idx.remove_subtree("a")
    assert [n.key for n in removed] == ["b", "a"] and len(idx) == 0


def test_pins_and_pin_expiry():
    clock = Clock()
    idx = RadixIndex(clock=clock)
    idx.insert_chain(["a", "b"])
    pin = idx.pin(["a", "b", "nope"], ttl_s=10)
    assert pin.keys == ("a", "b") and not idx.evictable("b")
    assert idx.unpin(pin) and idx.evictable("b")
    assert not idx.unpin(pin)  # twice is a no-op
    idx.pin(["b"], ttl_s=10)
    clock.t = 5
    assert not idx.evictable("b")
    clock.t = 11  # the reader died: its pin runs out
    assert idx.evictable("b") and idx.live_pins == 0
