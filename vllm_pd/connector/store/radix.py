"""Radix index over block keys: longest cached prefix, batched inserts,
leaf-first removal, pins with deadlines.

Because a block key hashes its parent key (protocol/block_keys.py), the tree over keys is
already prefix-compressed by content: a key has exactly one possible parent.
The index keeps the invariant "a node's parent is in the index" (inserts hang
chains off present nodes; only leaves are removed, or whole subtrees), so
presence is prefix-closed along any chain and the longest cached prefix of a
chain is found by *binary search* over the chain's keys: O(log n) dict probes
instead of the O(n) walk of a dict-of-hash-chains index.

Pins keep a node (and so its ancestors, which are not leaves) from removal
while it is being read or written. Each pin has a deadline, so a reader that
dies cannot pin a block forever (Mooncake/LMCache lesson); an expired pin is
dropped the next time pins are consulted.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_pd.errors import StoreError
from vllm_pd.protocol.block_keys import BlockKey


class RadixNode:
    """One block key. A plain slotted class: inserts create one per key, and a
    dataclass with a default_factory costs several times more per node."""

    __slots__ = ("key", "parent", "children", "pins", "value")

    def __init__(self, key: BlockKey | None, parent: RadixNode | None, value: Any = None) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[BlockKey, RadixNode] = {}
        self.pins = 0
        self.value = value  # owner's payload (e.g. where the block's bytes are)


@dataclass(frozen=True)
class Pin:
    """Keys kept from removal together, until :meth:`RadixIndex.unpin` or the deadline."""

    pin_id: int
    keys: tuple[BlockKey, ...]
    deadline: float  # time.monotonic()


class RadixIndex:
    """Not thread-safe: one owner (the store's scheduler side) drives it."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._root = RadixNode(key=None, parent=None)
        self._nodes: dict[BlockKey, RadixNode] = {}
        self._pins: dict[int, Pin] = {}
        self._pin_nodes: dict[int, list[RadixNode]] = {}  # the very nodes pinned
        self._pin_ids = itertools.count(1)
        self._clock = clock

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, key: object) -> bool:
        return key in self._nodes

    def get(self, key: BlockKey) -> RadixNode | None:
        return self._nodes.get(key)

    def keys(self) -> Iterable[BlockKey]:
        return self._nodes.keys()

    def chains(self) -> list[tuple[BlockKey, BlockKey | None]]:
        """Every ``(key, parent)``, parents first (a snapshot to republish)."""
        out: list[tuple[BlockKey, BlockKey | None]] = []
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            out.append((node.key, node.parent.key if node.parent is not None else None))  # type: ignore[arg-type]
            stack.extend(node.children.values())
        return out

    # -- lookup -------------------------------------------------------------

    def longest_prefix(self, chain: Sequence[BlockKey]) -> int:
        """How many leading keys of ``chain`` (a chain from the root) are present."""
        nodes = self._nodes
        lo, hi = 0, len(chain)  # answer in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if chain[mid - 1] in nodes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # -- insert -------------------------------------------------------------

    def insert_chain(
        self, chain: Sequence[BlockKey], parent: BlockKey | None = None, values: Sequence[Any] | None = None
    ) -> list[BlockKey]:
        """Insert ``chain`` below ``parent`` (None = root), skipping keys already
        present; returns the newly inserted keys. If ``parent`` is absent nothing
        is inserted (the chain would be unreachable)."""
        if parent is None:
            node = self._root
        else:
            found = self._nodes.get(parent)
            if found is None:
                return []
            node = found
        added: list[BlockKey] = []
        nodes = self._nodes
        for i, key in enumerate(chain):
            child = node.children.get(key)
            if child is None:
                child = RadixNode(key, node, None if values is None else values[i])
                node.children[key] = child
                nodes[key] = child
                added.append(key)
            node = child
        return added

    def insert_batch(self, items: Iterable[tuple[BlockKey | None, Sequence[BlockKey]]]) -> list[BlockKey]:
        """Many ``(parent, chain)`` inserts in one call (one report, one publish)."""
        added: list[BlockKey] = []
        for parent, chain in items:
            added.extend(self.insert_chain(chain, parent))
        return added

    # -- removal --------------------------------------------------------------

    def is_leaf(self, key: BlockKey) -> bool:
        node = self._nodes.get(key)
        return node is not None and not node.children

    def evictable(self, key: BlockKey) -> bool:
        """A leaf with no live pin: removing it keeps every cached prefix reachable."""
        node = self._nodes.get(key)
        if node is None or node.children:
            return False
        if node.pins:
            self.expire_pins()
        return node.pins == 0

    def remove_leaf(self, key: BlockKey) -> RadixNode:
        node = self._nodes.get(key)
        if node is None:
            raise KeyError(key)
        if node.children or node.pins:
            raise StoreError(f"block {key!r} is not an unpinned leaf")
        return self._detach(node)

    def remove_subtree(self, key: BlockKey) -> list[RadixNode]:
        """Drop ``key`` and everything below it (its bytes are gone, so nothing
        below is reachable by a prefix match any more). Returns removed nodes,
        deepest first. Pinned nodes are removed too: their readers' pins hold the
        bytes, not the index entry, and they must handle their own completion."""
        node = self._nodes.get(key)
        if node is None:
            return []
        removed: list[RadixNode] = []
        stack = [node]
        order: list[RadixNode] = []
        while stack:
            n = stack.pop()
            order.append(n)
            stack.extend(n.children.values())
        for n in reversed(order):
            n.children.clear()
            removed.append(self._detach(n))
        return removed

    def _detach(self, node: RadixNode) -> RadixNode:
        assert node.key is not None and node.parent is not None
        del node.parent.children[node.key]
        del self._nodes[node.key]
        return node

    # -- pins ------------------------------------------------------------------

    def pin(self, keys: Sequence[BlockKey], ttl_s: float) -> Pin:
        """Pin present ``keys`` until :meth:`unpin` or ``ttl_s`` passes."""
        nodes = [self._nodes[k] for k in keys if k in self._nodes]
        for node in nodes:
            node.pins += 1
        pin = Pin(next(self._pin_ids), tuple(n.key for n in nodes), self._clock() + ttl_s)  # type: ignore[misc]
        self._pins[pin.pin_id] = pin
        self._pin_nodes[pin.pin_id] = nodes
        return pin

    def unpin(self, pin: Pin | int) -> bool:
        """Unpin a pin's keys; False if it already expired or was unpinned."""
        pin_id = pin if isinstance(pin, int) else pin.pin_id
        if self._pins.pop(pin_id, None) is None:
            return False
        for node in self._pin_nodes.pop(pin_id):
            node.pins -= 1  # a node removed meanwhile is unreachable; harmless
        return True

    def expire_pins(self) -> list[Pin]:
        now = self._clock()
        expired = [pin for pin in self._pins.values() if pin.deadline <= now]
        for pin in expired:
            self.unpin(pin.pin_id)
        return expired

    @property
    def live_pins(self) -> int:
        return len(self._pins)
