"""Replacement policy for the CPU tier: an "active" and a "history" level.

- history: blocks stored but not re-used yet (a new conversation's turn);
- active: blocks that were re-used (a prefix hit), or that come back soon
  after being evicted (a ghost hit).

Peers' lesson (kv-stores.md §5): on multi-turn traffic most reuse is *one*
re-access by the next turn, so a fixed small probation level (SLRU 20/80) loses
2-3x hit rate against LRU. Here the split is not fixed: ghost lists remember
keys recently evicted from each level (keys only, no bytes), and a miss on a
ghost moves the target size of history up or down (ARC's rule). When history
evictions cause misses, history grows toward plain LRU; when active
conversations get evicted, active grows. Both levels evict leaf-first through
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
    """Active/history levels with ARC-style adaptive split and ghost lists."""

    def __init__(self, capacity: int, initial_history_fraction: float = 0.5) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be > 0, got {capacity}")
        if not 0.0 <= initial_history_fraction <= 1.0:
            raise ValueError(f"initial_history_fraction must be in [0, 1], got {initial_history_fraction}")
        self.capacity = capacity
        self.history: OrderedDict[Key, None] = OrderedDict()
        self.active: OrderedDict[Key, None] = OrderedDict()
        self._ghost_history: OrderedDict[Key, None] = OrderedDict()
        self._ghost_active: OrderedDict[Key, None] = OrderedDict()
        self.history_target = capacity * initial_history_fraction

    def __len__(self) -> int:
        return len(self.history) + len(self.active)

    def __contains__(self, key: object) -> bool:
        return key in self.active or key in self.history

    def level(self, key: Key) -> str | None:
        return "active" if key in self.active else "history" if key in self.history else None

    def hit(self, chain: Sequence[Key]) -> None:
        """``chain`` (a matched prefix) is being re-used: promote it, root last."""
        for key in reversed(chain):
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

        A chain's new blocks go to history (measured: sending the blocks that
        extend a hit prefix straight to active lost hit rate at small sizes);
        a block evicted recently and stored again goes to active.
        """
        self._touch(chain)
        new = [k for k in chain if k not in self]
        in_chain = set(chain)
        can_evict = lambda k: k not in in_chain and evictable(k)  # noqa: E731
        to_active = False
        for key in new:  # ghosts adapt the split (ARC): which level lost these blocks?
            if key in self._ghost_history:
                step = max(1.0, len(self._ghost_active) / max(1, len(self._ghost_history)))
                self.history_target = min(float(self.capacity), self.history_target + step)
                del self._ghost_history[key]
                to_active = True
            elif key in self._ghost_active:
                step = max(1.0, len(self._ghost_history) / max(1, len(self._ghost_active)))
                self.history_target = max(0.0, self.history_target - step)
                del self._ghost_active[key]
                to_active = True
        evicted: list[Key] = []
        admitted = 0
        while admitted < len(new):  # root first, so a partial admission is still a prefix
            if len(self) + admitted >= self.capacity:
                victim = self._evict(can_evict, prefer_history=len(self.history) > self.history_target)
                if victim is None:
                    break
                evicted.append(victim)
            admitted += 1
        level = self.active if to_active else self.history
        for key in reversed(new[:admitted]):  # leaf least recent
            level[key] = None
        return new[:admitted], evicted

    def _touch(self, chain: Sequence[Key]) -> None:
        for key in reversed(chain):
            if key in self.active:
                self.active.move_to_end(key)
            elif key in self.history:
                self.history.move_to_end(key)

    def remove(self, key: Key) -> None:
        """The owner dropped ``key`` (e.g. its bytes were lost): forget it, no ghost."""
        self.history.pop(key, None)
        self.active.pop(key, None)

    def _evict(self, evictable: Callable[[Key], bool], prefer_history: bool) -> Key | None:
        first, second = (self.history, self.active) if prefer_history else (self.active, self.history)
        if not first:
            first, second = second, first
        for level in (first, second):
            victim = _pop_victim(level, evictable)
            if victim is not None:
                ghosts = self._ghost_history if level is self.history else self._ghost_active
                ghosts[victim] = None
                while len(ghosts) > self.capacity:
                    ghosts.popitem(last=False)
                return victim
        return None


def _pop_victim(order: OrderedDict[Key, None], evictable: Callable[[Key], bool]) -> Key | None:
    for i, key in enumerate(order):
        if i >= SCAN_LIMIT:
            return None
        if evictable(key):
            del order[key]
            return key
    return None
