"""Where the store's committed and in-flight blocks are: the one owner of the
radix index, the CPU tier's replacement policy and its slot numbers, the puts
in flight (reserved, not yet committed) and the disk tier's acknowledgements.

The scheduler side (scheduler_side.py) plans loads and saves through it; the
worker side only executes plans and reports what landed, so placement
decisions never race. Invariants kept here: a slot is used by exactly one
cached key (cache size == used slots); a block is in the index only once
every TP rank committed it; a pending key is never a victim (not indexed).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import cast

from vllm_pd.connector.store.adaptive_cache import AdaptiveCache, shadow_sample_rate
from vllm_pd.connector.store.cpu_pool import SlotAllocator
from vllm_pd.connector.store.master_client import MasterClient
from vllm_pd.connector.store.plans import SaveResult, StoreReport
from vllm_pd.connector.store.radix import RadixIndex
from vllm_pd.protocol.block_keys import BlockKey
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass(slots=True)
class Location:
    """Where a committed block's bytes are (value of a radix node)."""

    slot: int | None = None  # CPU pool slot (None: only on disk)
    on_disk: bool = False  # every rank has it on disk
    disk_writing: bool = False  # write-through in flight: the slot must stay
    staging: bool = False  # slot being filled from disk by a load
    scope: BlockKey = b""  # what the block was written for (block_keys.RequestExtraKeys.scope); loads compare it


@dataclass(slots=True)
class PendingPut:
    request_id: str
    slot: int
    parent: BlockKey | None
    scope: BlockKey
    acks: int = 0


class BlockPlacement:
    def __init__(self, num_slots: int, world_size: int, disk_enabled: bool, disk_served: bool = False) -> None:
        self.index = RadixIndex()
        self.cache = AdaptiveCache(num_slots, sample_rate=shadow_sample_rate(num_slots))
        self.slots = SlotAllocator(num_slots)
        self.world_size = world_size
        self.disk_enabled = disk_enabled
        self.disk_served = disk_served  # the workers stage disk blocks for peers (config.disk_serve_bytes)
        self.master: MasterClient | None = None  # set by the owner once built (it needs servable_chains)
        self.pending: dict[BlockKey, PendingPut] = {}
        self.disk_acks: dict[BlockKey, int] = {}
        # on disk, parent not indexed yet: key -> (parent, scope)
        self.disk_orphans: dict[BlockKey, tuple[BlockKey | None, BlockKey]] = {}
        self.stats = {
            "hit_blocks": 0,
            "remote_blocks": 0,
            "saved_blocks": 0,
            "evicted_blocks": 0,
            "load_failures": 0,
            "scope_mismatches": 0,
        }

    def location(self, key: BlockKey) -> Location:
        """The Location of an indexed key."""
        node = self.index.get(key)
        if node is None:
            raise KeyError(key)
        location: Location = node.value
        return location

    # -- puts: reserve -> (worker writes) -> commit ----------------------------------------

    def reserve(
        self,
        request_id: str,
        new: Sequence[BlockKey],
        parent: BlockKey | None,
        guard: set[BlockKey],
        scope: BlockKey,
    ) -> tuple[list[BlockKey], list[int]]:
        """Phase one of a put: room in the CPU tier and a slot for each of ``new``
        (a chain below ``parent``, written for ``scope``), as long a prefix of it as fits;
        invisible to lookups until committed. ``guard``: keys that must not be evicted for it."""
        admitted = self._admit(new, guard)
        if not admitted:
            return [], []
        slots = self.slots.alloc(len(admitted))
        if slots is None:  # cannot happen while cache size == used slots; refuse rather than corrupt
            logger.error("store: slot accounting out of sync; not storing %d blocks of %s", len(admitted), request_id)
            for key in admitted:
                self.cache.remove(key)
            return [], []
        prev = parent
        for key, slot in zip(admitted, slots):
            self.pending[key] = PendingPut(request_id, slot, prev, scope)
            prev = key
        return admitted, slots

    def apply_saves(self, saves: Iterable[SaveResult]) -> None:
        """Commit the keys every rank wrote; drop those a rank failed."""
        for result in saves:
            for key in result.committed:
                pending = self.pending.get(key)
                if pending is None or pending.request_id != result.request_id:
                    continue
                pending.acks += 1
                if pending.acks >= self.world_size:
                    self._commit(key, self.pending.pop(key))
            for key in result.failed:
                pending = self.pending.get(key)
                if pending is not None and pending.request_id == result.request_id:
                    self.discard_pending(key, self.pending.pop(key))

    # -- disk tier -------------------------------------------------------------------------

    def stage_from_disk(self, keys: Sequence[BlockKey], guard: set[BlockKey]) -> dict[BlockKey, int]:
        """Pool slots for disk-only ``keys`` about to be loaded (they are promoted
        to the CPU tier); as long a prefix as fits."""
        admitted = self._admit(keys, guard)
        staged = dict(zip(admitted, self.slots.alloc(len(admitted)) or []))
        for key, slot in staged.items():
            loc = self.location(key)
            loc.slot, loc.staging = slot, True
        return staged

    def landed_from_disk(self, key: BlockKey) -> None:
        node = self.index.get(key)
        if node is not None:
            node.value.staging = False
            if self.master is not None and not self.disk_served:  # back in a CPU slot: fetchable again
                self.master.inserted(key, node.parent.key if node.parent is not None else None)

    def apply_disk(self, report: StoreReport) -> None:
        for key, parent, scope in report.disk_committed:
            acks = self.disk_acks.get(key, 0) + 1
            if acks < self.world_size:
                self.disk_acks[key] = acks
                continue
            self.disk_acks.pop(key, None)
            node = self.index.get(key)
            if node is not None:
                node.value.on_disk, node.value.disk_writing = True, False
            else:
                self.disk_orphans[key] = (parent, scope)
        for key in report.disk_failed:
            node = self.index.get(key)
            if node is not None:
                node.value.disk_writing = False
        for key in report.disk_evicted:
            self.disk_acks.pop(key, None)
            self.disk_orphans.pop(key, None)
            node = self.index.get(key)
            if node is None:
                continue
            node.value.on_disk = False
            if node.value.slot is None or node.value.staging:
                self.remove_subtree(key)
        if self.disk_orphans:
            self._adopt_disk_blocks()

    # -- the rest ---------------------------------------------------------------------------

    def _commit(self, key: BlockKey, pending: PendingPut) -> None:
        loc = Location(slot=pending.slot, disk_writing=self.disk_enabled, scope=pending.scope)
        if not self.index.insert_chain([key], pending.parent, [loc]):
            self.discard_pending(key, pending)  # parent gone meanwhile: unreachable
            return
        self.stats["saved_blocks"] += 1
        if self.master is not None:
            self.master.inserted(key, pending.parent)

    def discard_pending(self, key: BlockKey, pending: PendingPut) -> None:
        self.cache.remove(key)
        self.slots.free([pending.slot])

    def unstage(self, key: BlockKey, slot: int) -> None:
        node = self.index.get(key)
        if node is not None and node.value.slot == slot:
            node.value.slot, node.value.staging = None, False
        self.cache.remove(key)
        self.slots.free([slot])

    def _admit(self, chain: Sequence[BlockKey], guard: set[BlockKey]) -> list[BlockKey]:
        """Room in the CPU tier for as long a prefix of ``chain`` as fits, evicting unguarded keys."""
        # the cache holds any Hashable; every key in it came from here, a BlockKey
        admitted, _ = self.cache.admit(
            chain,
            lambda k: k not in guard and self.evictable(cast(BlockKey, k)),
            lambda k: self.drop_one(cast(BlockKey, k)),
        )
        return cast("list[BlockKey]", admitted)

    def evictable(self, key: BlockKey) -> bool:
        node = self.index.get(key)
        if node is None:  # pending: being written
            return False
        loc: Location = node.value
        if loc.disk_writing or loc.staging:
            return False
        if node.pins:
            self.index.expire_pins()
            if node.pins:
                return False
        return loc.on_disk or not node.children

    def servable_chains(self) -> list[tuple[BlockKey, BlockKey | None]]:
        """What the master may advertise of this node: every committed block,
        parents first (peers fetch CPU slots, and disk blocks staged for them by
        the holder's worker: disk_staging.py, unless disk_serve_bytes is 0)."""
        if self.disk_served:
            return self.index.chains()
        return [
            (key, parent)
            for key, parent in self.index.chains()
            if self.location(key).slot is not None and not self.location(key).staging
        ]

    def drop_one(self, key: BlockKey) -> None:
        """The cache evicted ``key`` from the CPU tier (at once: its parent may be the next victim)."""
        node = self.index.get(key)
        if node is None:
            return
        loc: Location = node.value
        if loc.slot is not None:
            self.slots.free([loc.slot])
            loc.slot = None
        self.stats["evicted_blocks"] += 1
        if self.master is not None and not (loc.on_disk and self.disk_served):
            self.master.removed(key)  # served from disk, it stays advertised
        if not loc.on_disk:
            self.index.remove_leaf(key)

    def remove_subtree(self, key: BlockKey) -> None:
        for node in self.index.remove_subtree(key):
            loc: Location = node.value
            if loc.slot is not None and not loc.staging:
                self.cache.remove(node.key)
                self.slots.free([loc.slot])
            # a staging slot is freed by its load's result (unstage)
            self.stats["evicted_blocks"] += 1
            if self.master is not None:
                self.master.removed(node.key)  # type: ignore[arg-type]

    def _adopt_disk_blocks(self) -> None:
        """Index blocks found on disk (restart) once their parent is indexed."""
        progress = True
        while progress and self.disk_orphans:
            progress = False
            for key, (parent, scope) in list(self.disk_orphans.items()):
                if key in self.index:
                    loc = self.index.get(key).value  # type: ignore[union-attr]
                    loc.on_disk, loc.disk_writing = True, False
                elif parent is None or parent in self.index:
                    self.index.insert_chain([key], parent, [Location(on_disk=True, scope=scope)])
                    if self.master is not None and self.disk_served:  # a restarted node serves its disk
                        self.master.inserted(key, parent)
                else:
                    continue
                del self.disk_orphans[key]
                progress = True
