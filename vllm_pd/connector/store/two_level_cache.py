"""Replacement policy for the CPU tier: an "active" and a "history" level.

- history: blocks stored but not re-used yet (a new conversation's turn);
- active: blocks that were re-used (a prefix hit), or that won a place by
  being used more often than active's least recent block.

Peers' lesson (kv-stores.md §5): on multi-turn traffic most reuse is *one*
re-access by the next turn, so a fixed small probation level (SLRU 20/80) loses
2-3x hit rate against LRU. Here the split is not fixed: ghost lists remember
keys recently evicted from each level (keys only, no bytes), and a miss on a
ghost moves the target size of history up or down (ARC's rule). What leaves
history competes with active's least recent block on access frequency
(W-TinyLFU's admission filter, the policy LMCache's own study picked), so when
the cache is too small for every live conversation it keeps a stable set of
them instead of cycling all of them out the way LRU does. Both levels evict leaf-first through
the ``evictable`` callback (the radix index decides), and each level is ordered
so a block's parent is more recent than the block (callers touch chains last
key first), so the least recent entry is almost always a leaf.

Policy only: it tracks keys, the owner moves bytes and frees slots.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Hashable

Key = Hashable

SCAN_LIMIT = 64  # entries examined per eviction before a level is declared stuck (all pinned)


class LruCache:
    """Plain LRU of one level, leaf-first: the baseline the two-level cache must beat."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self._order: OrderedDict[Key, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def hit(self, chain: Sequence[Key]) -> None:
        for key in reversed(chain):
            if key in self._order:
                self._order.move_to_end(key)

    def admit(self, chain: Sequence[Key], evictable: Callable[[Key], bool]) -> tuple[list[Key], list[Key]]:
        self.hit(chain)
        new = [k for k in chain if k not in self._order]
        in_chain = set(chain)
        evicted: list[Key] = []
        admitted = 0
        while admitted < len(new):  # root first, so a partial admission is still a prefix
            if len(self._order) + admitted >= self.capacity:
                victim = _pop_victim(self._order, lambda k: k not in in_chain and evictable(k))
                if victim is None:
                    break
                evicted.append(victim)
            admitted += 1
        for key in reversed(new[:admitted]):  # leaf least recent
            self._order[key] = None
        return new[:admitted], evicted

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)


class TwoLevelCache:
    """Active/history levels: frequency-gated promotion, ARC-sized history."""

    def __init__(self, capacity: int, initial_history_fraction: float = 0.5, aging_period: float = 3.0) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if not 0.0 <= initial_history_fraction <= 1.0:
            raise ValueError(f"initial_history_fraction must be in [0, 1], got {initial_history_fraction}")
        if aging_period <= 0:
            raise ValueError(f"aging_period must be > 0, got {aging_period}")
        self.capacity = capacity
        self.history: OrderedDict[Key, None] = OrderedDict()
        self.active: OrderedDict[Key, None] = OrderedDict()
        self._ghost_history: OrderedDict[Key, None] = OrderedDict()
        self._ghost_active: OrderedDict[Key, None] = OrderedDict()
        self.history_target = capacity * initial_history_fraction
        # access counts, halved every aging_period * capacity accesses (TinyLFU's
        # reset), so they outlive evictions without growing without bound
        self._freq: dict[Key, int] = {}
        self._accesses = 0
        self._aging_every = max(1, int(aging_period * capacity))

    def __len__(self) -> int:
        return len(self.history) + len(self.active)

    def __contains__(self, key: object) -> bool:
        return key in self.active or key in self.history

    def level(self, key: Key) -> str | None:
        return "active" if key in self.active else "history" if key in self.history else None

    def frequency(self, key: Key) -> int:
        return self._freq.get(key, 0)

    def hit(self, chain: Sequence[Key]) -> None:
        """``chain`` (a matched prefix) is being re-used: promote it, root last."""
        for key in reversed(chain):
            self._count(key)
            if key in self.history:
                del self.history[key]
                self.active[key] = None
            elif key in self.active:
                self.active.move_to_end(key)

    def admit(self, chain: Sequence[Key], evictable: Callable[[Key], bool]) -> tuple[list[Key], list[Key]]:
        """Store the keys of ``chain`` (in chain order) not cached yet; returns
        (admitted, evicted). Admitted keys are a prefix of the uncached part;
        admission stops early when every candidate victim is pinned. Keys of
        ``chain`` are never victims; ``evictable`` must refuse the chain's other
        ancestors when the owner passes only part of a chain.

        New blocks enter history. When room is needed and history is over its
        target, history's least recent block competes with active's least
        recent one: the more frequently used of the two stays (in active), the
        other goes. A block evicted recently and stored again moves the target
        (ARC): history grows when its blocks come back, shrinks when active's do.
        """
        self._touch(chain)
        new = [k for k in chain if k not in self]
        in_chain = set(chain)
        can_evict = lambda k: k not in in_chain and evictable(k)  # noqa: E731
        for key in new:
            self._count(key)
            if key in self._ghost_history:
                step = max(1.0, len(self._ghost_active) / max(1, len(self._ghost_history)))
                self.history_target = min(float(self.capacity), self.history_target + step)
                del self._ghost_history[key]
            elif key in self._ghost_active:
                step = max(1.0, len(self._ghost_history) / max(1, len(self._ghost_active)))
                self.history_target = max(1.0, self.history_target - step)
                del self._ghost_active[key]
        evicted: list[Key] = []
        admitted = 0
        while admitted < len(new):  # root first, so a partial admission is still a prefix
            if len(self) + admitted >= self.capacity:
                victim = self._make_room(can_evict)
                if victim is None:
                    break
                evicted.append(victim)
            admitted += 1
        for key in reversed(new[:admitted]):  # leaf least recent
            self.history[key] = None
        return new[:admitted], evicted

    def remove(self, key: Key) -> None:
        """The owner dropped ``key`` (e.g. its bytes were lost): forget it, no ghost."""
        self.history.pop(key, None)
        self.active.pop(key, None)

    def _touch(self, chain: Sequence[Key]) -> None:
        for key in reversed(chain):
            if key in self.active:
                self.active.move_to_end(key)
            elif key in self.history:
                self.history.move_to_end(key)

    def _count(self, key: Key) -> None:
        self._freq[key] = self._freq.get(key, 0) + 1
        self._accesses += 1
        if self._accesses >= self._aging_every:
            self._accesses = 0
            self._freq = {k: v // 2 for k, v in self._freq.items() if v > 1}

    def _make_room(self, evictable: Callable[[Key], bool]) -> Key | None:
        if self.history and (len(self.history) >= self.history_target or not self.active):
            candidate = _peek_victim(self.history, evictable)
            if candidate is not None:
                victim = _peek_victim(self.active, evictable)
                del self.history[candidate]
                if victim is not None and self.frequency(candidate) > self.frequency(victim):
                    self.active[candidate] = None
                    return self._evict_from(self.active, self._ghost_active, victim)
                self._remember(self._ghost_history, candidate)
                return candidate
        for level, ghosts in ((self.active, self._ghost_active), (self.history, self._ghost_history)):
            victim = _peek_victim(level, evictable)
            if victim is not None:
                return self._evict_from(level, ghosts, victim)
        return None

    def _evict_from(self, level: OrderedDict[Key, None], ghosts: OrderedDict[Key, None], key: Key) -> Key:
        del level[key]
        self._remember(ghosts, key)
        return key

    def _remember(self, ghosts: OrderedDict[Key, None], key: Key) -> None:
        ghosts[key] = None
        while len(ghosts) > self.capacity:
            ghosts.popitem(last=False)


def _peek_victim(order: OrderedDict[Key, None], evictable: Callable[[Key], bool]) -> Key | None:
    for i, key in enumerate(order):
        if i >= SCAN_LIMIT:
            return None
        if evictable(key):
            return key
    return None


def _pop_victim(order: OrderedDict[Key, None], evictable: Callable[[Key], bool]) -> Key | None:
    key = _peek_victim(order, evictable)
    if key is not None:
        del order[key]
    return key
