"""The store's scheduler-side facade (runs in vLLM's EngineCore process).

It plans the workers' loads and saves for vLLM's scheduler hooks; *what* is
stored where (index, CPU-tier policy, slots, puts in flight, disk acks) is kept
by one BlockPlacement (block_placement.py), and a request's keys by
RequestKeys (request_keys.py). The worker side only executes the plans it is
given and reports what landed, so placement decisions never race.

Two-phase put: ``plan_save`` *reserves* slots (keys pending, invisible to
``match``); the worker *writes* and checksums them; ``on_worker_report``
*commits* them into the index once every TP rank reported them. Only committed
blocks are ever counted by ``match`` or handed to ``plan_load``.

Isolation: a request's keys carry its extra keys (LoRA adapter, cache salt,
multimodal inputs; protocol/block_keys.py), and every block records the *scope* it was
written for (``RequestExtraKeys.scope``: salt, adapter, cache salt). A load
serves a block only if its scope is the loading request's; a mismatch (a key
collision, or a bug that dropped extra keys) is logged, counted
(``stats["scope_mismatches"]``) and recomputed, never served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_pd.connector.store.block_placement import BlockPlacement
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.disk_tier import scan
from vllm_pd.connector.store.master_client import MasterClient, RemoteHit
from vllm_pd.connector.store.plans import LoadOp, SaveOp, StorePlan, StoreReport
from vllm_pd.connector.store.radix import Pin
from vllm_pd.connector.store.request_keys import RequestKeys
from vllm_pd.errors import StoreError
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, BlockKey, KeySalt, RequestExtraKeys
from vllm_pd.protocol.transfer_params import StoreFetch
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass(slots=True)
class _Load:
    pin: Pin
    staging: dict[BlockKey, int] = field(default_factory=dict)


class StoreScheduler:
    def __init__(
        self,
        config: StoreConfig,
        salt: KeySalt,
        slot_nbytes: int,
        world_size: int = 1,
        endpoint: str = "",
        prefix_closed: bool = True,
    ) -> None:
        """``prefix_closed``: every block is stored with all blocks before it (full attention). A
        sliding-window group's (groups.py) holds runs of blocks whose earlier blocks vLLM freed:
        its index is then asked key by key, never by a prefix search, and it has no master (the
        master and the router look up prefixes)."""
        if not prefix_closed and config.master:
            raise StoreError("a store of a sliding-window group has no master (its blocks are not whole prefixes)")
        self.config = config
        self.prefix_closed = prefix_closed
        self.salt = salt
        self.world_size = world_size
        self.block_size = salt.block_size
        self.placement = BlockPlacement(
            config.num_slots(slot_nbytes),
            world_size,
            config.disk_path is not None,
            disk_served=config.disk_serve_slots(slot_nbytes) > 0,
        )
        # the same objects, named for the bridge, the tests and the benchmarks
        self.index, self.cache, self.slots, self.stats = (
            self.placement.index,
            self.placement.cache,
            self.placement.slots,
            self.placement.stats,
        )
        self.keys = RequestKeys(salt)
        self._loads: dict[str, _Load] = {}
        self._plan = StorePlan()
        self.master: MasterClient | None = None
        self._base_scope = NO_EXTRA_KEYS.scope(salt)
        if config.master:
            import os
            import socket

            node = config.node_id or f"{socket.gethostname()}:{os.getpid()}"
            self.master = MasterClient(
                config.master,
                node,
                endpoint,
                self.placement.servable_chains,
                config.master_timeout_s,
                salt=salt,
                instance_url=config.instance_url or "",
                secret=config.secret,
            )
            self.placement.master = self.master
            self.master.start_heartbeat()
            # announce this node (salt, instance_url) now, not at its first engine step: a router
            # can then tell an instance that never ran a request which node to fetch from
            self.master.flush()
        if config.disk_path is not None:
            # index a restarted disk tier now, so the first requests already hit it (the
            # workers' own rebuild reports arrive only after a step and are then no-ops)
            for rank in range(world_size):
                self.on_worker_report(StoreReport(disk_committed=scan(config.disk_path, salt.digest(), rank)))

    # -- queries -------------------------------------------------------------------

    def block_keys(
        self,
        token_ids: Sequence[int],
        max_blocks: int | None = None,
        request_id: str | None = None,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids`` with the request's ``extra_keys``; with
        ``request_id`` the keys are cached and extended (a request's tokens only ever grow)."""
        return self.keys.get(token_ids, max_blocks, request_id, extra_keys)

    def scope(self, extra_keys: RequestExtraKeys) -> BlockKey:
        """What a block written for a request with ``extra_keys`` records (see the module doc)."""
        return extra_keys.scope(self.salt) if extra_keys else self._base_scope

    def forget(self, request_id: str) -> None:
        """Drop a request's cached keys (it finished or was aborted)."""
        self.keys.forget(request_id)

    def match(
        self, token_ids: Sequence[int], request_id: str | None = None, extra_keys: RequestExtraKeys = NO_EXTRA_KEYS
    ) -> int:
        """Leading tokens of ``token_ids`` whose KV is committed in the store
        (a multiple of the block size). Side-effect free on the store."""
        keys = self.block_keys(token_ids, request_id=request_id, extra_keys=extra_keys)
        return self.index.longest_prefix(keys) * self.block_size

    def held_positions(
        self, token_ids: Sequence[int], request_id: str | None = None, extra_keys: RequestExtraKeys = NO_EXTRA_KEYS
    ) -> list[bool]:
        """Per full block of ``token_ids``: whether its KV is committed here (side-effect free)."""
        keys = self.block_keys(token_ids, request_id=request_id, extra_keys=extra_keys)
        if self.prefix_closed:
            n = self.index.longest_prefix(keys)
            return [True] * n + [False] * (len(keys) - n)
        return [key in self.index for key in keys]

    def remote_match(
        self, token_ids: Sequence[int], request_id: str | None = None, extra_keys: RequestExtraKeys = NO_EXTRA_KEYS
    ) -> RemoteHit | None:
        """Another node holding a longer prefix than this node, per the master
        (None if the master is absent, down or knows nothing longer)."""
        return self.match_with_remote(token_ids, request_id, extra_keys=extra_keys)[1]

    def match_with_remote(
        self,
        token_ids: Sequence[int],
        request_id: str | None = None,
        fetch: StoreFetch | None = None,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> tuple[int, RemoteHit | None]:
        """(tokens to load, the node to fetch the part beyond the local prefix
        from, or None): the local prefix, or a longer one another node holds -
        per ``fetch`` (the proxy's hint: the master is then not asked, so the
        engine's scheduler does not wait for it), else per the master. Only a
        hint either way: the fetch verifies, and what does not arrive is
        recomputed (plan_load reports it as missing)."""
        keys = self.block_keys(token_ids, request_id=request_id, extra_keys=extra_keys)
        if request_id is not None and self.keys.first_ask(request_id):
            self.cache.observe_request(keys)  # once per request, however often vLLM asks
        local = self.index.longest_prefix(keys)
        if self.master is None or local >= len(keys):
            return local * self.block_size, None
        if fetch is not None:
            # our own blocks are in the index already; the hint's count may include the block of
            # the prompt's last token, which is always computed: cap it to the keys asked about
            hit = (
                None
                if fetch.node == self.master.node
                else RemoteHit(fetch.node, fetch.endpoint, min(fetch.blocks, len(keys)))
            )
        else:
            hit = self.master.lookup(keys)
        if hit is None or hit.blocks <= local or not hit.endpoint:
            return local * self.block_size, None
        return hit.blocks * self.block_size, hit

    # -- loads -----------------------------------------------------------------------

    def plan_load(
        self,
        request_id: str,
        token_ids: Sequence[int],
        start_token: int,
        num_tokens: int,
        block_ids: Sequence[int],
        remote: RemoteHit | None = None,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
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
            raise StoreError("start_token and num_tokens must be multiples of the block size")
        first, n = start_token // self.block_size, num_tokens // self.block_size
        if len(block_ids) != n:
            raise StoreError(f"{n} blocks to load but {len(block_ids)} block ids")
        keys = self.block_keys(token_ids, max_blocks=first + n, request_id=request_id, extra_keys=extra_keys)
        scope = self.scope(extra_keys)
        local_end = self._in_scope(keys, first, self._present_from(keys, first), scope)
        usable = keys[first:local_end]
        pin = self.index.pin(usable, self.config.pin_ttl_s)
        load = _Load(pin)
        # blocks only on disk need a pool slot to land in (they are promoted)
        disk_only = [k for k in usable if self.placement.location(k).slot is None]
        staged: dict[BlockKey, int] = {}
        if disk_only:
            staged = self.placement.stage_from_disk(disk_only, set(keys[: first + len(usable)]))
        slots: list[int] = []
        from_disk: list[bool] = []
        for i, key in enumerate(usable):
            loc = self.placement.location(key)
            if loc.slot is None or (loc.staging and key not in staged):
                usable = usable[:i]  # another load is staging it, or no room: stop here
                break
            slots.append(loc.slot)
            from_disk.append(key in staged)
        load.staging = {k: s for k, s in staged.items() if k in set(usable)}
        for key, slot in staged.items():  # staged beyond the cut: give back
            if key not in load.staging:
                self.placement.unstage(key, slot)
        fetched: list[BlockKey] = []
        fetch_slots: list[int] = []
        if remote is not None and first + len(usable) == local_end:  # local part whole: go on remotely
            fetched, fetch_slots = self._reserve_fetch(
                request_id, keys, local_end, min(first + n, remote.blocks), scope
            )
        count = len(usable) + len(fetched)
        missing = list(block_ids[count:])
        if not count:
            self.index.unpin(pin)
            return None, missing
        self._loads[request_id] = load
        self.cache.hit(usable)
        self.stats["hit_blocks"] += len(usable)
        self.stats["remote_blocks"] += len(fetched)
        op = LoadOp(
            request_id,
            usable + fetched,
            list(block_ids[:count]),
            slots + fetch_slots,
            from_disk + [False] * len(fetched),
            from_peer=[False] * len(usable) + [True] * len(fetched) if fetched else [],
            peer=remote.endpoint if remote is not None and fetched else "",
            parent=keys[first - 1] if first else None,
            scope=scope,
        )
        self._plan.loads.append(op)
        return op, missing

    def _present_from(self, keys: Sequence[BlockKey], start: int) -> int:
        """Where the run of indexed ``keys`` from ``start`` ends (``start``: none)."""
        if self.prefix_closed:
            return max(start, self.index.longest_prefix(keys))
        end = start
        while end < len(keys) and keys[end] in self.index:
            end += 1
        return end

    def _in_scope(self, keys: Sequence[BlockKey], start: int, end: int, scope: BlockKey) -> int:
        """Where the run of (indexed) ``keys[start:end]`` written for ``scope`` ends: only the blocks
        a load serves are checked (the ones before ``start`` vLLM already has)."""
        for i in range(start, end):
            found = self.placement.location(keys[i]).scope
            if found != scope:
                self.stats["scope_mismatches"] += 1
                logger.error(
                    "KV store: block %s was written for scope %s, asked for %s: not served (recomputed)",
                    keys[i].hex(),
                    found.hex(),
                    scope.hex(),
                )
                return i
        return end

    def _reserve_fetch(
        self, request_id: str, keys: Sequence[BlockKey], start: int, end: int, scope: BlockKey
    ) -> tuple[list[BlockKey], list[int]]:
        """Reserve pool slots for ``keys[start:end]`` to be fetched from a peer
        (phase one of the put; invisible to ``match`` until committed)."""
        new: list[BlockKey] = []
        for key in keys[start:end]:
            if key in self.placement.pending or key in self.index:
                break  # being written by another request (or landed meanwhile): stop the chain here
            new.append(key)
        if not new:
            return [], []
        parent = keys[start - 1] if start else None
        return self.placement.reserve(request_id, new, parent, set(keys[: start + len(new)]), scope)

    # -- saves -----------------------------------------------------------------------

    def plan_save(
        self,
        request_id: str,
        token_ids: Sequence[int],
        block_ids: Sequence[int],
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
        first_block: int = 0,
    ) -> SaveOp | None:
        """Reserve pool slots for the full blocks of ``token_ids`` (whose KV is in
        vLLM blocks ``block_ids``, by block position) that the store does not hold yet, from
        position ``first_block`` on (a sliding window's earlier blocks are freed). The op is
        queued for the next plan; None when there is nothing to save or no room."""
        keys = self.block_keys(token_ids, max_blocks=len(block_ids), request_id=request_id, extra_keys=extra_keys)
        self.forget(request_id)
        self.cache.observe_save(keys)
        m = self._present_from(keys, first_block)
        new: list[BlockKey] = []
        for key in keys[m:]:
            if key in self.placement.pending or key in self.index:
                break  # another request is writing it (or a run of a window holds it): stop the chain here
            new.append(key)
        if not new:
            return None
        # a window's run hangs off the root where the block before it is not stored (its key still
        # chains every token before it)
        parent = keys[m - 1] if m and keys[m - 1] in self.index else None
        scope = self.scope(extra_keys)
        admitted, slots = self.placement.reserve(request_id, new, parent, set(keys[: m + len(new)]), scope)
        if not admitted:
            return None
        op = SaveOp(request_id, parent, admitted, list(block_ids[m : m + len(admitted)]), slots, scope)
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
        self.placement.apply_saves(report.saves)
        for result in report.loads:
            load = self._loads.pop(result.request_id, None)
            if load is None:
                continue
            self.index.unpin(load.pin)
            for key in result.loaded:
                if key in load.staging:
                    self.placement.landed_from_disk(key)
            for key in result.failed:
                self.stats["load_failures"] += 1
                if key in load.staging:
                    self.placement.unstage(key, load.staging[key])
        self.placement.apply_disk(report)
        if self.master is not None:
            # publish now: the step that reports the last commits may be the engine's last for a while
            self.master.flush()
