"""The KV store for a model with several attention KV cache groups (full attention beside
sliding windows, vLLM's hybrid KV cache manager on), wired into PDConnector.

Each group has a store of its own (store/groups.py: its keys name the group; its pool holds its
layers), built beside the others from the same ``store`` settings, each with its share of the
memory and disk. What differs from the one-group store (store_bridge.py):

* A hit is the longest prefix that every group holds whole (``groups.agreed_hit``): a full
  group needs every block before it, a window group the blocks of the window ending there.
* Saves save each group's blocks vLLM still holds when the request finishes (a window's are the
  last ones: vLLM nulls the blocks behind it), never the null block.
* Loads are asynchronous (the request waits for them, ``WAITING_FOR_REMOTE_KVS``): vLLM 0.32
  cannot take failed block ids from a model with several KV cache groups (its scheduler raises),
  so a load fails as a whole request (``failed_recving``) and vLLM computes the prompt again. A
  load fails if any group's blocks vanished since the lookup, vLLM's non-null blocks of a group
  are not the ones the lookup checked, or a block does not load (scope, disk checksum): wrong KV
  is never served, a partial hit is never used.
* No master (node-to-node fetches, kv_aware routing): both look up whole prefixes of one group.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from vllm_pd.connector.device.kv_device import KVDevice
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.groups import NULL_BLOCK, StoreGroup, agreed_hit, first_held, group_config, owner
from vllm_pd.connector.store.plans import StorePlan
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.connector.store_bridge import (
    StoreBridgeScheduler,
    StoreBridgeWorker,
    StoreStepMeta,
    StoreWorkerMeta,
    make_salt,
    request_extra_keys,
)
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.errors import StoreError
from vllm_pd.vllm_logging import vllm_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = vllm_logger(__name__)


class GroupStoreBridgeScheduler(StoreBridgeScheduler):
    loads_async = True

    def __init__(self, vllm_config: VllmConfig, config: StoreConfig, groups: Sequence[StoreGroup]) -> None:
        super().__init__(vllm_config, dataclasses.replace(config, master=None))
        self.groups = tuple(groups)
        self.group_stores: list[StoreScheduler] = []
        # requests a load was planned for: vLLM asks again after a failed load (and a preemption),
        # and a failure that would repeat (a block of another scope stays indexed) must not loop
        self._loaded_once: set[str] = set()
        self._loading: set[str] = set()  # requests whose load has not ended (their blocks are not KV yet)

    def on_handshake(self, num_layers: int, block_nbytes: int, endpoint: str, kv_format: str = "") -> None:
        """``block_nbytes``: every layer's (vLLM's hybrid manager gives all groups one page size;
        the workers check it)."""
        if self.store is not None:
            return
        total = sum(len(g.layers) for g in self.groups)
        world = self.vllm_config.parallel_config.tensor_parallel_size
        self.group_stores = [
            StoreScheduler(
                group_config(self.config, g, total),
                make_salt(self.vllm_config, len(g.layers), block_nbytes, kv_format, g.identity),
                len(g.layers) * block_nbytes,
                world_size=world,
                prefix_closed=g.kind == "full",
            )
            for g in self.groups
        ]
        self.store = self.group_stores[0]
        logger.info(
            "KV store: %d KV cache groups (%s), %d CPU slots each, disk %s",
            len(self.groups),
            ", ".join(f"{g.kind}/{len(g.layers)} layers" for g in self.groups),
            self.store.slots.num_slots,
            self.config.disk_path or "off",
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.store is None or request.request_id in self._loaded_once:
            return 0
        prompt = request.prompt_token_ids or []
        tokens = prompt[: len(prompt) - 1]  # >= 1 token left to compute
        extra_keys = self._request_extra_keys(request)
        present = [s.held_positions(tokens, request.request_id, extra_keys) for s in self.group_stores]
        bs = self.store.block_size
        hit = agreed_hit(self.groups, present, num_computed_tokens // bs) * bs
        if hit <= num_computed_tokens:
            self._matched.pop(request.request_id, None)
            return 0
        self._matched[request.request_id] = (hit, None)
        return hit - num_computed_tokens

    def update_state_after_alloc(
        self, request: Request, block_ids_by_group: Sequence[Sequence[int]], num_external_tokens: int
    ) -> bool:
        """Plan each group's load into the blocks vLLM gave it; a group that cannot load all of them
        fails the request's load (it is recomputed)."""
        matched = self._matched.pop(request.request_id, None)
        if self.store is None or matched is None or num_external_tokens <= 0:
            return False
        hit, _ = matched
        self._loaded_once.add(request.request_id)
        self._loading.add(request.request_id)
        bs = self.store.block_size
        first, end = (hit - num_external_tokens) // bs, hit // bs
        loading: list[int] = []
        whole = len(block_ids_by_group) == len(self.groups)
        for g, (group, store, ids) in enumerate(zip(self.groups, self.group_stores, block_ids_by_group)):
            needed = group.needed(end, first)
            given = [p for p in range(first, min(end, len(ids))) if ids[p] != NULL_BLOCK]
            if given != list(needed):
                logger.warning(
                    "KV store: request %s, KV cache group %d: vLLM gave blocks at positions %s, the hit "
                    "checked %s: its load fails (recomputed)",
                    request.request_id,
                    g,
                    given,
                    list(needed),
                )
                whole = False
                continue
            if not needed:
                continue
            op, missing = store.plan_load(
                request.request_id,
                request.prompt_token_ids or [],
                needed.start * bs,
                len(needed) * bs,
                [ids[p] for p in needed],
                extra_keys=self._request_extra_keys(request),
            )
            if op is not None:
                loading.append(g)
            whole = whole and not missing
        self._meta.loads[request.request_id] = tuple(loading)
        if not whole:
            self._meta.failed_loads.append(request.request_id)
        return True

    def request_finished(self, request: Request, block_ids_by_group: Sequence[Sequence[int]], pd_holds: bool) -> bool:
        """Queue the save of each group's computed blocks vLLM still holds; True if vLLM must keep
        them (every group's) until the saves copied them."""
        self._matched.pop(request.request_id, None)
        self._hints.pop(request.request_id, None)
        self._loaded_once.discard(request.request_id)
        extra_keys = self._extra_keys.pop(request.request_id, None)
        if request.request_id in self._loading:  # aborted while loading: its blocks are not its KV
            self._loading.discard(request.request_id)
            return False
        if self.store is None:
            return False
        if len(block_ids_by_group) != len(self.groups):
            logger.warning(
                "KV store: request %s finished with %d KV cache groups' blocks, not saved",
                request.request_id,
                len(block_ids_by_group),
            )
            return False
        if extra_keys is None:
            extra_keys = request_extra_keys(request)
        n = request.num_computed_tokens
        tokens = list(request.all_token_ids[:n])
        full = n // self.store.block_size
        owners: list[str] = []
        for g, (store, ids) in enumerate(zip(self.group_stores, block_ids_by_group)):
            held = list(ids[:full])
            first = first_held(held)
            if NULL_BLOCK in held[first:]:  # a hole after the first held block: not a window's
                logger.warning("KV store: request %s, group %d: a freed block inside, not saved", request.request_id, g)
            elif store.plan_save(request.request_id, tokens, held, extra_keys, first_block=first) is not None:
                owners.append(owner(g))
            store.forget(request.request_id)
        if not owners:
            return False
        self._meta.held[request.request_id] = (*owners, "pd") if pd_holds else tuple(owners)
        return True

    def loads_finished(self, request_ids: set[str]) -> None:
        self._loading -= request_ids

    def build_meta(self) -> StoreStepMeta | None:
        if self.store is None:
            return None
        meta, self._meta = self._meta, StoreStepMeta()
        meta.plan = self.store.build_plan()
        meta.group_plans = [s.build_plan() for s in self.group_stores[1:]]
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        if self.store is None or not isinstance(worker_meta, StoreWorkerMeta):
            return
        self.store.on_worker_report(worker_meta.report)
        for store, report in zip(self.group_stores[1:], worker_meta.group_reports):
            store.on_worker_report(report)


class GroupStoreBridgeWorker(StoreBridgeWorker):
    def __init__(
        self, config: StoreConfig, vllm_config: VllmConfig, tp_rank: int, groups: Sequence[StoreGroup]
    ) -> None:
        super().__init__(dataclasses.replace(config, master=None), vllm_config, tp_rank)
        self.groups = tuple(groups)
        self.group_stores: list[StoreWorker] = []
        self._group_layers: dict[str, tuple[int, int]] = {}  # layer -> (group, its index in the group)
        self._group_plans: list[StorePlan] = []
        self._loading: dict[str, set[int]] = {}  # request -> groups whose load has not ended
        self._doomed: set[str] = set()  # loading requests of which a group's load failed

    def stores(self) -> list[StoreWorker]:
        return list(self.group_stores)

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        bind_host: str,
        advertised_host: str,
        block_dims: dict[str, int] | None = None,
        device: KVDevice | None = None,
        kv_format: str = "",
    ) -> None:
        dims = {name: (block_dims or {}).get(name, 0) for name in kv_caches}
        nbytes = {name: MemoryRegion(name, t, dims[name]).block_nbytes for name, t in kv_caches.items()}
        if len(set(nbytes.values())) != 1:
            raise StoreError(f"KV store: the KV cache groups' blocks differ in bytes ({sorted(set(nbytes.values()))})")
        block_nbytes = next(iter(nbytes.values()))
        total = sum(len(g.layers) for g in self.groups)
        for g, group in enumerate(self.groups):
            self.group_stores.append(
                StoreWorker(
                    group_config(self.config, group, total),
                    make_salt(self.vllm_config, len(group.layers), block_nbytes, kv_format, group.identity),
                    [kv_caches[name] for name in group.layers],
                    rank=self.tp_rank,
                    block_dims=[dims[name] for name in group.layers],
                    device=device,
                )
            )
            self._group_layers.update({name: (g, i) for i, name in enumerate(group.layers)})
        self.store = self.group_stores[0]

    def begin_step(self, meta: StoreStepMeta | None) -> None:
        super().begin_step(meta)
        if self.store is None or meta is None:
            return
        self._group_plans = [meta.plan, *meta.group_plans]
        for req_id, groups in meta.loads.items():
            self._loading[req_id] = set(groups)
        self._doomed.update(meta.failed_loads)

    def start(self) -> None:
        self._plan = None
        plans, self._group_plans = self._group_plans, []
        for store, plan in zip(self.group_stores, plans):
            if plan:
                store.execute(plan)

    def wait_for_layer_load(self, layer_name: str) -> None:
        found = self._group_layers.get(layer_name)
        if found is not None:
            self.group_stores[found[0]].wait_layer(found[1])

    def _loads_ended(self, group: int, request_ids: set[str]) -> None:
        self._doomed |= self.group_stores[group].take_failed_loads()
        for req_id in request_ids:
            waiting = self._loading.get(req_id)
            if waiting is not None:
                waiting.discard(group)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(loads that ended in every group, those that failed in some): call after merge_finished."""
        ended = {r for r, waiting in self._loading.items() if not waiting}
        for req_id in ended:
            del self._loading[req_id]
        failed = ended & self._doomed
        self._doomed -= ended
        return ended, failed

    def load_errors(self) -> set[int]:
        """None by block id (vLLM 0.32 refuses them for several groups): failed loads go by request."""
        self._missing = set()
        for store in self.group_stores:
            store.take_load_errors()
        return set()

    def worker_meta(self) -> StoreWorkerMeta | None:
        if self.store is None:
            return None
        reports = [s.report() for s in self.group_stores]
        if not any(reports):
            return None
        return StoreWorkerMeta(reports[0], tuple(reports[1:]))
