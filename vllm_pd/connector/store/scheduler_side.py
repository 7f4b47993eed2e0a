"""The store's scheduler-side facade (runs in vLLM's EngineCore process).

It is the single authority over *what* is stored where: the radix index of
committed blocks, the CPU tier's replacement policy and slot numbers, reserved
(in-flight) puts and read leases. The worker side only executes the plans it
is given and reports what landed, so placement decisions never race.

Two-phase put: ``plan_save`` *reserves* slots (keys pending, invisible to
``match``); the worker *writes* and checksums them; ``on_worker_report``
*commits* them into the index once every TP rank reported them. Only committed
blocks are ever counted by ``match`` or handed to ``plan_load``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_pd.connector.store.adaptive_cache import AdaptiveCache
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.cpu_pool import SlotAllocator
from vllm_pd.connector.store.disk_tier import scan
from vllm_pd.connector.store.keys import BlockKey, KeySalt, chain_keys
from vllm_pd.connector.store.master_client import MasterClient, RemoteHit
from vllm_pd.connector.store.plans import LoadOp, SaveOp, StorePlan, StoreReport
from vllm_pd.connector.store.radix import Lease, RadixIndex

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Location:
    """Where a committed block's bytes are (value of a radix node)."""

    slot: int | None = None  # CPU pool slot (None: only on disk)
    on_disk: bool = False  # every rank has it on disk
    disk_writing: bool = False  # write-through in flight: the slot must stay
    staging: bool = False  # slot being filled from disk by a load


@dataclass(slots=True)
class _Pending:
    request_id: str
    slot: int
    parent: BlockKey | None
    acks: int = 0


@dataclass(slots=True)
class _Load:
    lease: Lease
    staging: dict[BlockKey, int] = field(default_factory=dict)


class StoreScheduler:
    def __init__(
        self, config: StoreConfig, salt: KeySalt, slot_nbytes: int, world_size: int = 1, endpoint: str = ""
    ) -> None:
        self.config = config
        self.salt = salt
        self.world_size = world_size
        self.block_size = salt.block_size
        num_slots = config.num_slots(slot_nbytes)
        self.index = RadixIndex()
        self.cache = AdaptiveCache(num_slots)
        self._observed: set[str] = set()  # requests whose prompt the cache's shadows saw
        self.slots = SlotAllocator(num_slots)
        self.disk_enabled = config.disk_path is not None
        self._pending: dict[BlockKey, _Pending] = {}
        self._loads: dict[str, _Load] = {}
        self._disk_acks: dict[BlockKey, int] = {}
        self._disk_orphans: dict[BlockKey, BlockKey | None] = {}  # on disk, parent not indexed yet
        self._plan = StorePlan()
        # per-request keys, extended as the request grows (vLLM asks about a
        # waiting request every step; a 128K-token prompt costs ~25 ms to hash)
        self._keys: OrderedDict[str, list[BlockKey]] = OrderedDict()
        self.master: MasterClient | None = None
        if config.master:
            import os
            import socket

            node = config.node_id or f"{socket.gethostname()}:{os.getpid()}"
            self.master = MasterClient(config.master, node, endpoint, self._servable_chains, config.master_timeout_s)
        self.stats = {"hit_blocks": 0, "remote_blocks": 0, "saved_blocks": 0, "evicted_blocks": 0,
                      "load_failures": 0}
        if config.disk_path is not None:
            # index a restarted disk tier now, so the first requests already hit it (the
            # workers' own rebuild reports arrive only after a step and are then no-ops)
            for rank in range(world_size):
                self.on_worker_report(StoreReport(disk_committed=scan(config.disk_path, salt.digest(), rank)))

    # -- queries -------------------------------------------------------------------

    def block_keys(
        self, token_ids: Sequence[int], max_blocks: int | None = None, request_id: str | None = None
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids``; with ``request_id`` the keys
        are cached and extended (a request's tokens only ever grow)."""
        if request_id is None:
            return chain_keys(token_ids, self.salt, max_blocks=max_blocks)
        n = len(token_ids) // self.block_size if max_blocks is None else min(max_blocks, len(token_ids) // self.block_size)
        keys = self._keys.get(request_id, [])
        if len(keys) < n:
            done = len(keys) * self.block_size
            keys = keys + chain_keys(
                token_ids[done:n * self.block_size], self.salt, parent=keys[-1] if keys else None
            )
            self._keys[request_id] = keys
            while len(self._keys) > 4096:
                self._keys.popitem(last=False)
        if request_id in self._keys:
            self._keys.move_to_end(request_id)
        return keys[:n]

    def forget(self, request_id: str) -> None:
        """Drop a request's cached keys (it finished or was aborted)."""
        self._keys.pop(request_id, None)
        self._observed.discard(request_id)

    def match(self, token_ids: Sequence[int], request_id: str | None = None) -> int:
        """Leading tokens of ``token_ids`` whose KV is committed in the store
        (a multiple of the block size). Side-effect free on the store."""
        return self.index.longest_prefix(self.block_keys(token_ids, request_id=request_id)) * self.block_size

    def remote_match(self, token_ids: Sequence[int], request_id: str | None = None) -> RemoteHit | None:
        """Another node holding a longer prefix than this node, per the master
        (None if the master is absent, down or knows nothing longer)."""
        return self.match_with_remote(token_ids, request_id)[1]

    def match_with_remote(
        self, token_ids: Sequence[int], request_id: str | None = None
    ) -> tuple[int, RemoteHit | None]:
        """(tokens to load, the node to fetch the part beyond the local prefix
        from, or None): the local prefix, or a longer one the master says
        another node holds. Only a hint: the fetch verifies, and what does not
        arrive is recomputed (plan_load reports it as missing)."""
        keys = self.block_keys(token_ids, request_id=request_id)
        if request_id is not None and request_id not in self._observed:
            self._observed.add(request_id)  # vLLM asks every step while a request waits: count it once
            self.cache.observe_request(keys)
        local = self.index.longest_prefix(keys)
        if self.master is None or local >= len(keys):
            return local * self.block_size, None
        hit = self.master.lookup(keys)
        if hit is None or hit.blocks <= local or not hit.endpoint:
            return local * self.block_size, None
        return hit.blocks * self.block_size, hit

    # -- loads -----------------------------------------------------------------------

    def plan_load(
        self, request_id: str, token_ids: Sequence[int], start_token: int, num_tokens: int,
        block_ids: Sequence[int], remote: RemoteHit | None = None,
    ) -> tuple[LoadOp | None, list[int]]:
        """Load tokens ``[start_token, start_token + num_tokens)`` (block aligned)
        into vLLM blocks ``block_ids`` (one per block of that range). Returns the
        op (queued for the next plan) and the vLLM block ids that cannot be
        loaded after all (the connector reports them as load errors).

        With ``remote`` (from :meth:`match_with_remote`), the blocks beyond the
        local prefix are fetched from that node: slots are reserved for them
        as for a save (two-phase put), the worker fetches and verifies them,
        and reports them as saved; they commit like any other put."""
        if start_token % self.block_size or num_tokens % self.block_size:
            raise ValueError("start_token and num_tokens must be multiples of the block size")
        first, n = start_token // self.block_size, num_tokens // self.block_size
        if len(block_ids) != n:
            raise ValueError(f"{n} blocks to load but {len(block_ids)} block ids")
        keys = self.block_keys(token_ids, max_blocks=first + n, request_id=request_id)
        local_end = max(first, self.index.longest_prefix(keys))
        usable = keys[first:local_end]
        lease = self.index.pin(usable, self.config.lease_s)
        load = _Load(lease)
        # blocks only on disk need a pool slot to land in (they are promoted)
        disk_only = [k for k in usable if self.index.get(k).value.slot is None]  # type: ignore[union-attr]
        staged: dict[BlockKey, int] = {}
        if disk_only:
            guard = set(keys[: first + len(usable)])
            admitted, _ = self.cache.admit(disk_only, lambda k: k not in guard and self._evictable(k), self._drop_one)
            staged = dict(zip(admitted, self.slots.alloc(len(admitted)) or []))
            for key, slot in staged.items():
                loc = self.index.get(key).value  # type: ignore[union-attr]
                loc.slot, loc.staging = slot, True
        slots: list[int] = []
        from_disk: list[bool] = []
        for i, key in enumerate(usable):
            loc = self.index.get(key).value  # type: ignore[union-attr]
            if loc.slot is None or (loc.staging and key not in staged):
                usable = usable[:i]  # another load is staging it, or no room: stop here
                break
            slots.append(loc.slot)
            from_disk.append(key in staged)
        load.staging = {k: s for k, s in staged.items() if k in set(usable)}
        for key, slot in staged.items():  # staged beyond the cut: give back
            if key not in load.staging:
                self._unstage(key, slot)
        fetched: list[BlockKey] = []
        fetch_slots: list[int] = []
        if remote is not None and first + len(usable) == local_end:  # local part whole: go on remotely
            fetched, fetch_slots = self._reserve_fetch(request_id, keys, local_end, min(first + n, remote.blocks))
        count = len(usable) + len(fetched)
        missing = list(block_ids[count:])
        if not count:
            self.index.release(lease)
            return None, missing
        self._loads[request_id] = load
        self.cache.hit(usable)
        self.stats["hit_blocks"] += len(usable)
        self.stats["remote_blocks"] += len(fetched)
        op = LoadOp(
            request_id, usable + fetched, list(block_ids[:count]), slots + fetch_slots,
            from_disk + [False] * len(fetched),
            from_peer=[False] * len(usable) + [True] * len(fetched) if fetched else [],
            peer=remote.endpoint if remote is not None and fetched else "",
            parent=keys[first - 1] if first else None,
        )
        self._plan.loads.append(op)
        return op, missing

    def _reserve_fetch(
        self, request_id: str, keys: Sequence[BlockKey], start: int, end: int
    ) -> tuple[list[BlockKey], list[int]]:
        """Reserve pool slots for ``keys[start:end]`` to be fetched from a peer
        (phase one of the put; invisible to ``match`` until committed)."""
        new: list[BlockKey] = []
        for key in keys[start:end]:
            if key in self._pending or key in self.index:
                break  # being written by another request (or landed meanwhile): stop the chain here
            new.append(key)
        if not new:
            return [], []
        guard = set(keys[: start + len(new)])
        admitted, _ = self.cache.admit(new, lambda k: k not in guard and self._evictable(k), self._drop_one)
        slots = self.slots.alloc(len(admitted)) if admitted else None
        if not slots:
            for key in admitted:
                self.cache.remove(key)
            return [], []
        prev = keys[start - 1] if start else None
        for key, slot in zip(admitted, slots):
            self._pending[key] = _Pending(request_id, slot, prev)
            prev = key
        return admitted, slots

    # -- saves -----------------------------------------------------------------------

    def plan_save(self, request_id: str, token_ids: Sequence[int], block_ids: Sequence[int]) -> SaveOp | None:
        """Reserve pool slots for the full blocks of ``token_ids`` (whose KV is in
        vLLM blocks ``block_ids``) that the store does not hold yet. The op is
        queued for the next plan; None when there is nothing to save or no room."""
        keys = self.block_keys(token_ids, max_blocks=len(block_ids), request_id=request_id)
        self.forget(request_id)
        self.cache.observe_save(keys)
        m = self.index.longest_prefix(keys)
        new: list[BlockKey] = []
        for key in keys[m:]:
            if key in self._pending:
                break  # another request is writing it; our later blocks would have no parent
            new.append(key)
        if not new:
            return None
        guard = set(keys[: m + len(new)])
        admitted, _ = self.cache.admit(new, lambda k: k not in guard and self._evictable(k), self._drop_one)
        if not admitted:
            return None
        slots = self.slots.alloc(len(admitted))
        if slots is None:  # cannot happen while cache size == used slots; refuse rather than corrupt
            logger.error("store: slot accounting out of sync; not saving %s", request_id)
            for key in admitted:
                self.cache.remove(key)
            return None
        parent = keys[m - 1] if m else None
        prev = parent
        for key, slot in zip(admitted, slots):
            self._pending[key] = _Pending(request_id, slot, prev)
            prev = key
        op = SaveOp(request_id, parent, admitted, list(block_ids[m:m + len(admitted)]), slots)
        self._plan.saves.append(op)
        return op

    def build_plan(self) -> StorePlan:
        """This step's work for the workers (put it into the connector metadata)."""
        plan, self._plan = self._plan, StorePlan()
        if self.master is not None:
            self.master.flush()
        return plan

    # -- reports -----------------------------------------------------------------------

    def on_worker_report(self, report: StoreReport) -> None:
        """Apply one step's (TP-aggregated) worker report."""
        for result in report.saves:
            for key in result.committed:
                pending = self._pending.get(key)
                if pending is None or pending.request_id != result.request_id:
                    continue
                pending.acks += 1
                if pending.acks >= self.world_size:
                    self._commit(key, self._pending.pop(key))
            for key in result.failed:
                pending = self._pending.get(key)
                if pending is not None and pending.request_id == result.request_id:
                    self._discard_pending(key, self._pending.pop(key))
        for result in report.loads:
            load = self._loads.pop(result.request_id, None)
            if load is None:
                continue
            self.index.release(load.lease)
            for key in result.loaded:
                node = self.index.get(key)
                if node is not None and key in load.staging:
                    node.value.staging = False
                    if self.master is not None:  # back in a CPU slot: peers may fetch it again
                        self.master.inserted(key, node.parent.key if node.parent is not None else None)
            for key in result.failed:
                self.stats["load_failures"] += 1
                if key in load.staging:
                    self._unstage(key, load.staging[key])
        for key, parent in report.disk_committed:
            acks = self._disk_acks.get(key, 0) + 1
            if acks < self.world_size:
                self._disk_acks[key] = acks
                continue
            self._disk_acks.pop(key, None)
            node = self.index.get(key)
            if node is not None:
                node.value.on_disk, node.value.disk_writing = True, False
            else:
                self._disk_orphans[key] = parent
        for key in report.disk_failed:
            node = self.index.get(key)
            if node is not None:
                node.value.disk_writing = False
        for key in report.disk_evicted:
            self._disk_acks.pop(key, None)
            self._disk_orphans.pop(key, None)
            node = self.index.get(key)
            if node is None:
                continue
            node.value.on_disk = False
            if node.value.slot is None or node.value.staging:
                self._remove_subtree(key)
        if self._disk_orphans:
            self._adopt_disk_blocks()
        if self.master is not None:
            # publish now: the step that reports the last commits may be the engine's last for a while
            self.master.flush()

    # -- internals ---------------------------------------------------------------------

    def _commit(self, key: BlockKey, pending: _Pending) -> None:
        loc = Location(slot=pending.slot, disk_writing=self.disk_enabled)
        if not self.index.insert_chain([key], pending.parent, [loc]):
            self._discard_pending(key, pending)  # parent gone meanwhile: unreachable
            return
        self.stats["saved_blocks"] += 1
        if self.master is not None:
            self.master.inserted(key, pending.parent)

    def _discard_pending(self, key: BlockKey, pending: _Pending) -> None:
        self.cache.remove(key)
        self.slots.free([pending.slot])

    def _unstage(self, key: BlockKey, slot: int) -> None:
        node = self.index.get(key)
        if node is not None and node.value.slot == slot:
            node.value.slot, node.value.staging = None, False
        self.cache.remove(key)
        self.slots.free([slot])

    def _evictable(self, key: BlockKey) -> bool:
        node = self.index.get(key)
        if node is None:  # pending: being written
            return False
        loc: Location = node.value
        if loc.disk_writing or loc.staging:
            return False
        if node.pins:
            self.index.expire_leases()
            if node.pins:
                return False
        return loc.on_disk or not node.children

    def _servable_chains(self) -> list[tuple[BlockKey, BlockKey | None]]:
        """What the master may advertise of this node: blocks in CPU slots (peers
        fetch from the pool, not from disk), parents first."""
        out = []
        for key, parent in self.index.chains():
            loc: Location = self.index.get(key).value  # type: ignore[union-attr]
            if loc.slot is not None and not loc.staging:
                out.append((key, parent))
        return out

    def _drop_one(self, key: BlockKey) -> None:
        """The cache evicted ``key`` from the CPU tier (at once: its parent may be the next victim)."""
        node = self.index.get(key)
        if node is None:
            return
        loc: Location = node.value
        if loc.slot is not None:
            self.slots.free([loc.slot])
            loc.slot = None
        self.stats["evicted_blocks"] += 1
        if self.master is not None:
            self.master.removed(key)  # peers fetch from CPU slots only, also when it stays on disk here
        if not loc.on_disk:
            self.index.remove_leaf(key)

    def _remove_subtree(self, key: BlockKey) -> None:
        for node in self.index.remove_subtree(key):
            loc: Location = node.value
            if loc.slot is not None and not loc.staging:
                self.cache.remove(node.key)
                self.slots.free([loc.slot])
            # a staging slot is freed by its load's result (_unstage)
            self.stats["evicted_blocks"] += 1
            if self.master is not None:
                self.master.removed(node.key)  # type: ignore[arg-type]

    def _adopt_disk_blocks(self) -> None:
        """Index blocks found on disk (restart) once their parent is indexed."""
        progress = True
        while progress and self._disk_orphans:
            progress = False
            for key, parent in list(self._disk_orphans.items()):
                if key in self.index:
                    loc = self.index.get(key).value  # type: ignore[union-attr]
                    loc.on_disk, loc.disk_writing = True, False
                elif parent is None or parent in self.index:
                    self.index.insert_chain([key], parent, [Location(on_disk=True)])  # not servable to peers
                else:
                    continue
                del self._disk_orphans[key]
                progress = True
