"""Replacement policies for the CPU tier: plain leaf-first LRU (the baseline)
and LRU with reuse-weighted ageing (what the store runs, see adaptive_cache.py).

Both keep one invariant that makes leaf-first eviction exact: every cached
block is at least as recent as each of its cached children. Callers touch a
chain root last (``hit``), and ``admit`` touches the chain's cached part after
storing its new keys, so the least recent entry of an order is a leaf unless it
is pinned. Victims are handed to ``on_evict`` at once, so the owner can drop
them from its index before the next victim is chosen (a parent whose last
child just left is a leaf again): without that, one admission could evict only
one block per chain and stopped early when the oldest entries were parents.

Policy only: they track keys; the owner moves bytes and frees slots.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence

from vllm_pd.errors import StoreError

Key = Hashable
Evictable = Callable[[Key], bool]
OnEvict = Callable[[Key], None] | None

SCAN_LIMIT = 64  # entries examined per order before it is declared stuck (all pinned)
MAX_LEVEL = 5  # reuse counts above this share the last level


class LruCache:
    """Plain leaf-first LRU of one level: the baseline the store's policy must not lose to."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise StoreError(f"capacity must be > 0, got {capacity}")
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

    def admit(
        self, chain: Sequence[Key], evictable: Evictable, on_evict: OnEvict = None
    ) -> tuple[list[Key], list[Key]]:
        """Store the keys of ``chain`` not cached yet; returns (admitted, evicted).
        Admitted keys are a prefix of the uncached part: admission stops early
        only when every candidate victim is pinned. Keys of ``chain`` are never victims."""
        new = [k for k in chain if k not in self._order]
        in_chain = set(chain)
        evicted: list[Key] = []
        admitted = 0
        while admitted < len(new):  # root first, so a partial admission is still a prefix
            if len(self._order) + admitted >= self.capacity:
                victim = _peek_victim(self._order, lambda k: k not in in_chain and evictable(k))
                if victim is None:
                    break
                del self._order[victim]
                evicted.append(victim)
                if on_evict is not None:
                    on_evict(victim)
            admitted += 1
        for key in reversed(new[:admitted]):  # leaf least recent
            self._order[key] = None
        self.hit(chain)
        return new[:admitted], evicted

    def remove(self, key: Key) -> None:
        self._order.pop(key, None)


class ReuseAgedCache:
    """LRU where a block's age counts ``base ** reuses`` times.

    A block's level is how often it was re-used (prefix hits) while cached,
    capped at MAX_LEVEL; each level is an LRU order and the victim is the
    level head with the largest weighted age (now - last use) * base**level.
    base = 1 is exactly leaf-first LRU; a smaller base keeps often re-used
    blocks (shared system prompts) longer against the stream of new ones,
    which wins when the cache is small and loses when it is large enough for
    recency alone (adaptive_cache.py picks base online).
    """

    def __init__(self, capacity: int, base: float = 1.0) -> None:
        if capacity <= 0:
            raise StoreError(f"capacity must be > 0, got {capacity}")
        self.capacity = capacity
        self.base = 1.0
        self._weights: tuple[float, ...] = ()
        self.set_base(base)
        self._levels: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(MAX_LEVEL + 1)]
        self._where: dict[Key, int] = {}  # key -> level
        self._reuses: dict[Key, int] = {}
        self._stamp: dict[Key, int] = {}
        self._clock = itertools.count(1)
        self._now = 0

    def set_base(self, base: float) -> None:
        if not 0.0 < base <= 1.0:
            raise StoreError(f"base must be in (0, 1], got {base}")
        self.base = base
        self._weights = tuple(base**i for i in range(MAX_LEVEL + 1))

    def __len__(self) -> int:
        return len(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def level(self, key: Key) -> int | None:
        return self._where.get(key)

    def hit(self, chain: Sequence[Key]) -> None:
        """``chain`` (a matched prefix) is being re-used, root last."""
        where, reuses = self._where, self._reuses
        placed: list[tuple[Key, int]] = []
        for key in reversed(chain):
            if key in where:
                n = reuses[key] = reuses[key] + 1
                placed.append((key, n if n < MAX_LEVEL else MAX_LEVEL))
        self._place(placed)

    def admit(
        self, chain: Sequence[Key], evictable: Evictable, on_evict: OnEvict = None
    ) -> tuple[list[Key], list[Key]]:
        """As :meth:`LruCache.admit`; new keys enter level 0."""
        new = [k for k in chain if k not in self._where]
        in_chain = set(chain)
        can_evict = lambda k: k not in in_chain and evictable(k)  # noqa: E731
        evicted: list[Key] = []
        admitted = 0
        while admitted < len(new):
            if len(self._where) + admitted >= self.capacity:
                victim = self._victim(can_evict)
                if victim is None:
                    break
                self.remove(victim)
                evicted.append(victim)
                if on_evict is not None:
                    on_evict(victim)
            admitted += 1
        for key in new[:admitted]:
            self._reuses[key] = 0
        self._place([(key, 0) for key in reversed(new[:admitted])])
        fresh = set(new)
        where = self._where
        # the cached part: touched after the new keys (parents more recent)
        self._place([(key, where[key]) for key in reversed(chain) if key in where and key not in fresh])
        return new[:admitted], evicted

    def remove(self, key: Key) -> None:
        """Forget ``key`` (evicted, or its bytes were lost)."""
        level = self._where.pop(key, None)
        if level is not None:
            del self._levels[level][key]
            del self._reuses[key], self._stamp[key]

    def _place(self, placed: list[tuple[Key, int]]) -> None:
        """Put each key at the recent end of its level, in order (the hot path: locals bound once)."""
        if not placed:
            return
        levels, where, stamp, clock = self._levels, self._where, self._stamp, self._clock
        now = self._now
        for key, level in placed:
            old = where.get(key)
            if old == level:
                levels[level].move_to_end(key)
            else:
                if old is not None:
                    del levels[old][key]
                levels[level][key] = None
                where[key] = level
            now = stamp[key] = next(clock)
        self._now = now

    def _victim(self, evictable: Evictable) -> Key | None:
        best: Key | None = None
        best_score = -1.0
        for level, order in enumerate(self._levels):
            if not order:
                continue
            key = _peek_victim(order, evictable)
            if key is None:
                continue
            score = (self._now - self._stamp[key]) * self._weights[level]
            if score > best_score:
                best, best_score = key, score
        return best


def _peek_victim(order: OrderedDict[Key, None], evictable: Evictable) -> Key | None:
    for i, key in enumerate(order):
        if i >= SCAN_LIMIT:
            return None
        if evictable(key):
            return key
    return None
