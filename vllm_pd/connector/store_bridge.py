"""Wires the KV block store (vllm_pd.connector.store) into PDConnector.

Enabled by ``kv_connector_extra_config["store"]`` (a dict of StoreConfig keys).
Works on any role: on a new request without a remote prefill, the store's
longest committed prefix is reported to vLLM as external tokens (a sync load
that the worker lands layer by layer before each attention layer); when a
request finishes, its computed blocks are saved asynchronously and vLLM keeps
them until the copy is done (``request_finished`` -> True, then
``finished_sending``), jointly with the PD transfer when prefill holds the same
blocks for decode.

A request's store keys carry vLLM's own extra keys of each block
(``request_extra_keys``: LoRA adapter, cache salt, multimodal inputs, prompt
embeddings, from vLLM's ``generate_block_hash_extra_keys``), so requests that
differ only in those never share KV (protocol/block_keys.py says why the keys are not
vLLM's block hashes themselves).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata

from vllm_pd.connector.device.kv_device import KVDevice
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.groups import owner
from vllm_pd.connector.store.master_client import RemoteHit
from vllm_pd.connector.store.plans import StorePlan, StoreReport
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, RequestExtraKeys
from vllm_pd.protocol.transfer_params import StoreFetch
from vllm_pd.vllm_logging import vllm_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = vllm_logger(__name__)


def make_salt(
    vllm_config: VllmConfig, num_layers: int, block_nbytes: int, kv_format: str = "", group: str = ""
) -> KeySalt:
    """``kv_format``: what a block's bytes mean (kv_layout.block_format): stores of other layouts
    hold other bytes for the same prompt, so their keys differ. ``group``: the KV cache group's
    identity (store/groups.py) where the model has several, "" where it has one."""
    from vllm.platforms import current_platform

    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    layout = f"{current_platform.device_type}:{block_nbytes}B/block" + (f":{kv_format}" if kv_format else "")
    return KeySalt(
        model=f"{mc.model}@{mc.revision or ''}",
        dtype=f"{mc.dtype}/{cc.cache_dtype}",
        kv_layout=layout,
        block_size=cc.block_size,
        num_layers=num_layers,
        tp_size=pc.tensor_parallel_size,
        pp_size=pc.pipeline_parallel_size,
        extra=group,
    )


def request_extra_keys(request: Request) -> RequestExtraKeys:
    """The request's extra keys, block by block exactly as vLLM's prefix cache derives them.

    vLLM's function is asked only for requests that have something it keys on (an adapter,
    a cache salt, multimodal inputs, prompt embeddings); for any other it returns None for
    every block (tests/unit/store/test_store_bridge.py checks that on vLLM's own Request)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    lora = request.lora_request
    if lora is None and not request.cache_salt and not request.mm_features and request.prompt_embeds is None:
        return NO_EXTRA_KEYS

    def per_block(start: int, end: int) -> tuple[Any, ...] | None:
        # start_mm_idx 0 is exact for any block: inputs that end before it are skipped
        keys: tuple[Any, ...] | None = generate_block_hash_extra_keys(request, start, end, 0)[0]
        return keys

    return RequestExtraKeys(
        lora=(lora.lora_name, lora.lora_path) if lora is not None else None,
        cache_salt=request.cache_salt,
        per_block=per_block,
        varies_by_block=bool(request.mm_features) or request.prompt_embeds is not None,
    )


@dataclass
class StoreStepMeta:
    """Rides in PDConnectorMetadata."""

    plan: StorePlan = field(default_factory=StorePlan)
    missing_block_ids: list[int] = field(default_factory=list)  # vanished between match and alloc
    # request -> owners of its blocks ("store", and "pd" when prefill also holds them)
    held: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # several KV cache groups (store_group_bridge.py): groups 1.. plans, the async loads started
    # (request -> the groups loading it) and the requests whose load already failed
    group_plans: list[StorePlan] = field(default_factory=list)
    loads: dict[str, tuple[int, ...]] = field(default_factory=dict)
    failed_loads: list[str] = field(default_factory=list)


class StoreWorkerMeta(KVConnectorWorkerMetadata):
    def __init__(self, report: StoreReport, group_reports: tuple[StoreReport, ...] = ()) -> None:
        self.report = report
        self.group_reports = group_reports  # groups 1.. of a model with several KV cache groups

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, StoreWorkerMeta)
        return StoreWorkerMeta(
            self.report.aggregate(other.report),
            tuple(a.aggregate(b) for a, b in zip(self.group_reports, other.group_reports)),
        )


class StoreBridgeScheduler:
    # loads land layer by layer in the step that computes the rest (vLLM's sync external load)
    loads_async = False

    def __init__(self, vllm_config: VllmConfig, config: StoreConfig) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.store: StoreScheduler | None = None  # built once the workers' handshake says the block size
        # request -> (tokens the store holds, the node holding those beyond the local prefix)
        self._matched: dict[str, tuple[int, RemoteHit | None]] = {}
        self._hints: dict[str, StoreFetch | None] = {}  # request -> the proxy's store_fetch hint
        self._extra_keys: dict[str, RequestExtraKeys] = {}  # request -> its extra keys, derived once
        self._meta = StoreStepMeta()

    def on_handshake(self, num_layers: int, block_nbytes: int, endpoint: str, kv_format: str = "") -> None:
        """``endpoint``: where peers fetch this node's blocks (store endpoints of
        the TP ranks, comma-separated; "" when no master is configured); ``kv_format``: the
        workers' block format (see make_salt). Once: vLLM >= 0.33 hands the handshake again after
        a sleep mode wake-up, and the store's pool outlived the sleep."""
        if self.store is not None:
            return
        salt = make_salt(self.vllm_config, num_layers, block_nbytes, kv_format)
        world = self.vllm_config.parallel_config.tensor_parallel_size
        self.store = StoreScheduler(self.config, salt, num_layers * block_nbytes, world_size=world, endpoint=endpoint)
        logger.info(
            "KV store: %d CPU slots of %d bytes, disk %s",
            self.store.slots.num_slots,
            num_layers * block_nbytes,
            self.config.disk_path or "off",
        )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if self.store is None:
            return 0
        prompt = request.prompt_token_ids or []
        # >= 1 token left to compute; the master is asked only beyond the local prefix
        hit, remote = self.store.match_with_remote(
            prompt[: len(prompt) - 1],
            request_id=request.request_id,
            fetch=self._fetch_hint(request),
            extra_keys=self._request_extra_keys(request),
        )
        if hit <= num_computed_tokens:
            self._matched.pop(request.request_id, None)
            return 0
        self._matched[request.request_id] = (hit, remote)
        return hit - num_computed_tokens

    def _request_extra_keys(self, request: Request) -> RequestExtraKeys:
        got = self._extra_keys.get(request.request_id)
        if got is None:
            got = self._extra_keys[request.request_id] = request_extra_keys(request)
        return got

    def _fetch_hint(self, request: Request) -> StoreFetch | None:
        """The proxy's store_fetch hint, parsed once per request (vLLM asks again every step it waits)."""
        if request.request_id not in self._hints:
            self._hints[request.request_id] = StoreFetch.from_params(request.kv_transfer_params)
        return self._hints[request.request_id]

    def update_state_after_alloc(
        self, request: Request, block_ids_by_group: Sequence[Sequence[int]], num_external_tokens: int
    ) -> bool:
        """True if the store serves this request's external tokens (the blocks of its one group)."""
        block_ids = block_ids_by_group[0]
        matched = self._matched.pop(request.request_id, None)
        if self.store is None or matched is None or num_external_tokens <= 0:
            return False
        hit, remote = matched
        start = hit - num_external_tokens
        bs = self.store.block_size
        blocks = block_ids[start // bs : hit // bs]
        _, missing = self.store.plan_load(
            request.request_id,
            request.prompt_token_ids or [],
            start,
            num_external_tokens,
            blocks,
            remote=remote,
            extra_keys=self._request_extra_keys(request),
        )
        self._meta.missing_block_ids.extend(missing)
        return True

    def request_finished(self, request: Request, block_ids_by_group: Sequence[Sequence[int]], pd_holds: bool) -> bool:
        """Queue the save of the request's computed blocks; True if vLLM must keep them for it."""
        block_ids = block_ids_by_group[0]
        self._matched.pop(request.request_id, None)
        self._hints.pop(request.request_id, None)
        extra_keys = self._extra_keys.pop(request.request_id, None)
        if self.store is None:
            return False
        if extra_keys is None:
            extra_keys = request_extra_keys(request)
        n = request.num_computed_tokens
        op = self.store.plan_save(request.request_id, list(request.all_token_ids[:n]), block_ids, extra_keys)
        self.store.forget(request.request_id)
        if op is None:
            return False
        self._meta.held[request.request_id] = ("store", "pd") if pd_holds else ("store",)
        return True

    def loads_finished(self, request_ids: set[str]) -> None:
        """vLLM's finished_recving of a step (async loads only: none here)."""

    def build_meta(self) -> StoreStepMeta | None:
        if self.store is None:
            return None
        meta, self._meta = self._meta, StoreStepMeta()
        meta.plan = self.store.build_plan()
        return meta

    def update_connector_output(self, worker_meta: Any) -> None:
        if self.store is not None and isinstance(worker_meta, StoreWorkerMeta):
            self.store.on_worker_report(worker_meta.report)


class StoreBridgeWorker:
    def __init__(self, config: StoreConfig, vllm_config: VllmConfig, tp_rank: int) -> None:
        self.config = config
        self.vllm_config = vllm_config
        self.tp_rank = tp_rank
        self.store: StoreWorker | None = None
        self.endpoint = ""  # where peers fetch this rank's pool ("" = not served)
        self._layer_index: dict[str, int] = {}
        self._owners: dict[str, set[str]] = {}
        self._pd_done_early: set[str] = set()
        self._missing: set[int] = set()

    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        bind_host: str,
        advertised_host: str,
        block_dims: dict[str, int] | None = None,
        device: KVDevice | None = None,
        kv_format: str = "",
    ) -> None:
        """``block_dims`` / ``device`` / ``kv_format``: as the connector worker read them from
        vLLM's layout (default: blocks along dim 0, the device of the tensors, no format)."""
        tensors = list(kv_caches.values())
        dims = [(block_dims or {}).get(name, 0) for name in kv_caches]
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        block_nbytes = MemoryRegion("layer0", tensors[0], dims[0]).block_nbytes
        salt = make_salt(self.vllm_config, len(tensors), block_nbytes, kv_format)
        self.store = StoreWorker(self.config, salt, tensors, rank=self.tp_rank, block_dims=dims, device=device)
        if self.config.master:  # other nodes learn of our blocks: let them fetch them
            self.endpoint = self.store.serve_peers(bind_host, advertised_host)

    def begin_step(self, meta: StoreStepMeta | None) -> None:
        if self.store is None or meta is None:
            return
        for req_id, owners in meta.held.items():
            self._owners[req_id] = set(owners)
        self._missing.update(meta.missing_block_ids)
        self._plan: StorePlan | None = meta.plan

    def start(self) -> None:
        plan = getattr(self, "_plan", None)
        if self.store is not None and plan:
            self.store.execute(plan)
        self._plan = None

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if self.store is not None and i is not None:
            self.store.wait_layer(i)

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(async loads that ended, those of them that failed): none here, loads are layer-wise."""
        return set(), set()

    def merge_finished(self, pd_sent: set[str]) -> set[str]:
        """finished_sending = PD's, except requests the store still copies; plus the store's done ones."""
        out = set()
        for req_id in pd_sent:
            owners = self._owners.get(req_id)
            if owners is None:
                out.add(req_id)
                continue
            owners.discard("pd")
            if not owners:
                del self._owners[req_id]
                out.add(req_id)
        for group, store in enumerate(self.stores()):
            saved, loaded = store.take_finished()
            self._loads_ended(group, loaded)
            for req_id in saved:
                owners = self._owners.get(req_id)
                if owners is None:
                    continue
                owners.discard(owner(group))
                if not owners:
                    del self._owners[req_id]
                    out.add(req_id)
        return out

    def stores(self) -> list[StoreWorker]:
        """The store of each KV cache group (one here)."""
        return [self.store] if self.store is not None else []

    def _loads_ended(self, group: int, request_ids: set[str]) -> None:
        """Loads of ``group`` that ended (layer-wise here: vLLM waited for them in its forward)."""

    def load_errors(self) -> set[int]:
        bad, self._missing = self._missing, set()
        if self.store is not None:
            bad |= self.store.take_load_errors()
        return bad

    def take_served(self) -> tuple[int, int]:
        """(blocks this rank served to peers from its CPU pool, from its disk) since the last call."""
        if self.store is None or self.store.exchange is None:
            return 0, 0
        return self.store.exchange.take_served()

    def worker_meta(self) -> StoreWorkerMeta | None:
        if self.store is None:
            return None
        report = self.store.report()
        return StoreWorkerMeta(report) if report else None

    def shutdown(self) -> None:
        for store in self.stores():
            store.close()
