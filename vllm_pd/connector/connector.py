"""``PDConnector``: the facade vLLM instantiates, once per role and process.

The scheduler role (EngineCore process) delegates to
:class:`~vllm_pd.connector.scheduler.PDConnectorScheduler`, the worker role (each
worker process) to :class:`~vllm_pd.connector.worker.worker.PDConnectorWorker`.

Roles: ``kv_producer`` serves prefill legs (``do_remote_decode``), ``kv_consumer``
serves decode legs (``do_remote_prefill``), ``kv_both`` either, per request.

It supports vLLM's hybrid KV cache manager (``SupportsHMA``): a model with sliding-window and
full-attention layers keeps one KV cache group per kind and moves each group's blocks
(``kv_geometry``, ``layer_groups``); a model with a recurrent state (Mamba, linear attention)
moves its state after the prompt's last token but one, and decode computes the last
(``scheduler.PDConnectorScheduler.on_new_request``).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

from vllm_pd.connector.config import PDConnectorConfig, needs_layer_hooks
from vllm_pd.connector.device.kv_geometry import CPU_VEC_KERNEL
from vllm_pd.connector.device.kv_layout import TRANSFER_LAYOUT
from vllm_pd.connector.metadata import PDConnectorMetadata, PDHandshake, PDWorkerMeta
from vllm_pd.connector.scheduler import PDConnectorScheduler, kv_cache_groups
from vllm_pd.connector.stats import PDConnectorStats, PDPromMetrics
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.groups import StoreGroup, why_not_stored
from vllm_pd.connector.store_bridge import StoreBridgeScheduler, StoreBridgeWorker
from vllm_pd.connector.store_group_bridge import GroupStoreBridgeScheduler, GroupStoreBridgeWorker
from vllm_pd.connector.worker.worker import PDConnectorWorker
from vllm_pd.protocol.kv_shape import KVGroup, encode_shape
from vllm_pd.protocol.transfer_params import asks_remote_decode, asks_remote_prefill
from vllm_pd.vllm_logging import vllm_logger

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

logger = vllm_logger(__name__)


def total_kv_heads(vllm_config: VllmConfig) -> int:
    """The model's KV heads before TP sharding; 1 for MLA (one latent, on every rank)."""
    model_config = vllm_config.model_config
    if model_config is None:
        return 0
    if model_config.use_mla:
        return 1
    return int(model_config.get_total_num_kv_heads())


def attention_kernel(vllm_config: VllmConfig) -> str:
    """How vLLM's attention kernel packs a head's tokens in our blocks (``kv_geometry.kernel_format``):
    "" where the tensor's dims say it (GPU backends, MLA). vLLM CPU attention packs per ISA
    (``cpu_attn._get_attn_isa``, private: its choice for x86 is repeated here): "vec" (x86 without
    AMX for bf16, blocks and heads of 32k) keeps K transposed, then V; any other ISA is named but
    its packing is not known, so its blocks are not re-cut by tokens."""
    import platform

    import torch
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if not current_platform.is_cpu() or model_config is None or model_config.use_mla:
        return ""
    amx = torch.cpu._is_amx_tile_supported() and model_config.dtype == torch.bfloat16
    vec = (
        platform.machine().lower() in ("x86_64", "amd64")
        and not amx
        and vllm_config.cache_config.block_size % 32 == 0
        and model_config.get_head_size() % 32 == 0
    )
    return CPU_VEC_KERNEL if vec else "cpu-" + ("amx" if amx else "other")


def groups_store(
    store_config: StoreConfig, groups: tuple[KVGroup, ...], kv_cache_config: KVCacheConfig | None
) -> tuple[StoreConfig | None, tuple[StoreGroup, ...]]:
    """The store's settings and groups for a model with several KV cache groups: None where the
    store cannot keep them (with a warning saying why), and no master (store_group_bridge.py)."""
    reason = why_not_stored(groups)
    if reason or kv_cache_config is None:
        logger.warning(
            "PD connector: the KV store is off for this model: it has %d KV cache groups (%s) and %s",
            len(groups),
            ", ".join(g.kind for g in groups),
            reason or "no KV cache config",
        )
        return None, ()
    if store_config.master:
        logger.warning(
            "PD connector: KV store master %s not used: this model has %d KV cache groups, and the master "
            "and the router look up whole prefixes of one group; the store stays local (CPU, disk)",
            store_config.master,
            len(groups),
        )
    layers = [g.layer_names for g in kv_cache_config.kv_cache_groups]
    return dataclasses.replace(store_config, master=None), tuple(
        StoreGroup.of(g, names) for g, names in zip(groups, layers)
    )


class PDConnector(KVConnectorBase_V1, SupportsHMA):
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = PDConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        if self.is_consumer and ktc.kv_load_failure_policy != "recompute":
            logger.warning(
                "kv_load_failure_policy=%r: a failed KV transfer fails the request; "
                'set "kv_load_failure_policy": "recompute" to recompute it instead',
                ktc.kv_load_failure_policy,
            )
        self._scheduler: PDConnectorScheduler | None = None
        self._worker: PDConnectorWorker | None = None
        store_config = (
            dataclasses.replace(
                StoreConfig.from_dict(self.config.store), secret=self.config.secret, tls=self.config.tls
            )
            if self.config.store is not None
            else None
        )
        self._store_scheduler: StoreBridgeScheduler | None = None
        self._store_worker: StoreBridgeWorker | None = None
        groups = kv_cache_groups(kv_cache_config, vllm_config.cache_config.block_size, vllm_config)
        store_groups: tuple[StoreGroup, ...] = ()
        if store_config is not None and len(groups) > 1:
            store_config, store_groups = groups_store(store_config, groups, kv_cache_config)
        elif store_config is not None and groups[0].kind == "state":
            logger.warning("PD connector: the KV store is off for this model: %s", why_not_stored(groups))
            store_config = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PDConnectorScheduler(vllm_config, self.config, str(ktc.engine_id), kv_cache_config)
            if store_config is not None:
                self._store_scheduler = (
                    GroupStoreBridgeScheduler(vllm_config, store_config, store_groups)
                    if store_groups
                    else StoreBridgeScheduler(vllm_config, store_config)
                )
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            layer_groups = (
                {name: g for g, group in enumerate(kv_cache_config.kv_cache_groups) for name in group.layer_names}
                if kv_cache_config is not None
                else {}
            )
            self._worker = PDConnectorWorker(
                self.config,
                block_size=vllm_config.cache_config.block_size,
                tp_rank=get_tensor_model_parallel_rank(),
                base_port=int(ktc.kv_port),
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                stats=PDConnectorStats(rank=get_tensor_model_parallel_rank()),
                kv_heads=total_kv_heads(vllm_config) if layer_groups else 0,
                groups=groups,
                layer_groups=layer_groups,
                kernel=attention_kernel(vllm_config),
            )
            if store_config is not None:
                rank = get_tensor_model_parallel_rank()
                self._store_worker = (
                    GroupStoreBridgeWorker(store_config, vllm_config, rank, store_groups)
                    if store_groups
                    else StoreBridgeWorker(store_config, vllm_config, rank)
                )

    # ---- worker side ----------------------------------------------------------------------------
    @property
    def worker(self) -> PDConnectorWorker:
        assert self._worker is not None
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """vLLM 0.32's per-layer ``[B, H, N, C]`` views in the layout it resolved (kv_layout.py):
        the worker groups kernel blocks into the scheduler's blocks and moves each block's bytes
        in memory order; the store takes the same grouped views."""
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        self.worker.register_kv_caches(kv_caches, num_blocks, kv_layout=self._vllm_config.cache_config.kv_cache_layout)
        if self._store_worker is not None:
            blocks = {r.name: r.tensor for r in self.worker.regions}
            self._store_worker.register_kv_caches(
                blocks,
                self.config.bind_host,
                self.worker.host,
                device=self.worker.device,
                kv_format=self.worker.kv_format,
            )

    def unregister_kv_caches(self) -> None:
        """vLLM >= 0.33, sleep mode: the KV cache's pages are freed next (see the worker's)."""
        self.worker.unregister_kv_caches()

    def restore_kv_caches(self) -> None:
        """vLLM >= 0.33, wake-up: the KV cache is mapped again at the same addresses. vLLM then
        collects the handshake again and hands it to the scheduler side."""
        self.worker.restore_kv_caches()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        w = self.worker
        handshake = PDHandshake(
            endpoint=w.endpoint,
            host=w.host,
            port=w.port,
            num_layers=len(w.regions),
            block_nbytes=w.regions[0].block_nbytes,
            kv_format=w.kv_format,
            kv_shape=encode_shape(w.shape) if w.shape is not None else b"",
        )
        if self._store_worker is not None:
            handshake.store_endpoint = self._store_worker.endpoint
        return handshake

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, PDConnectorMetadata)
        self.worker.begin_step(connector_metadata)
        if self._store_worker is not None:
            self._store_worker.begin_step(connector_metadata.store)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_loads()
        if self._store_worker is not None:
            self._store_worker.start()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)
        if self._store_worker is not None:
            self._store_worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, recvd, failed = self.worker.get_finished()
        if self._store_worker is not None:
            sent = self._store_worker.merge_finished(sent)
            loaded, load_failed = self._store_worker.finished_loads()
            recvd, failed = recvd | loaded, failed | load_failed
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad = self.worker.block_ids_with_load_errors()
        if self._store_worker is not None:
            bad |= self._store_worker.load_errors()
        return bad

    def build_connector_worker_meta(self) -> PDWorkerMeta | None:
        announced = self.worker.take_announced()
        store = self._store_worker.worker_meta() if self._store_worker is not None else None
        return PDWorkerMeta(announced, store) if announced or store is not None else None

    def get_kv_connector_stats(self) -> PDConnectorStats | None:
        if self._worker is None:
            return None
        if self._store_worker is not None:
            self._worker.stats.record_store_served(*self._store_worker.take_served())
        stats = self._worker.stats.take()
        assert stats is None or isinstance(stats, PDConnectorStats)
        return stats

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
        if self._store_worker is not None:
            self._store_worker.shutdown()

    # ---- scheduler side -------------------------------------------------------------------------
    @property
    def scheduler(self) -> PDConnectorScheduler:
        assert self._scheduler is not None
        return self._scheduler

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        self.scheduler.bind_kv_cache_manager(kv_cache_manager)

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        by_rank = {r: m for r, m in metadata.items() if isinstance(m, PDHandshake)}
        self.scheduler.set_handshake(by_rank)
        if self._store_scheduler is not None and by_rank:
            first = by_rank[min(by_rank)]
            store_endpoints = [by_rank[r].store_endpoint for r in sorted(by_rank)]
            self._store_scheduler.on_handshake(
                first.num_layers,
                first.block_nbytes,
                ",".join(store_endpoints) if all(store_endpoints) else "",
                kv_format=self.scheduler.kv_format,
            )

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.scheduler.note_request(request.request_id)
        if self._store_scheduler is not None and not asks_remote_prefill(request.kv_transfer_params):
            hit = self._store_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
            if hit:
                # one group: a sync load the worker lands layer by layer before each layer; several:
                # an async one (store_group_bridge.py says why)
                return hit, self._store_scheduler.loads_async
        if not self.is_consumer:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        """Our loads land the request's own blocks of every KV cache group that transfers KV."""
        assert self._kv_cache_config is not None
        return tuple(self._kv_cache_config.transfer_group_ids)

    def on_new_request(self, request: Request) -> None:
        if self.is_producer:
            self.scheduler.on_new_request(request)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._store_scheduler is not None:
            self._store_scheduler.update_state_after_alloc(request, blocks.get_block_ids(), num_external_tokens)
        if asks_remote_decode(request.kv_transfer_params) and not self.is_producer:
            return
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        if self._store_scheduler is not None:
            meta.store = self._store_scheduler.build_meta()
        return meta

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler.note_sent(connector_output.finished_sending or set())
        if self._store_scheduler is not None and connector_output.finished_recving:
            self._store_scheduler.loads_finished(connector_output.finished_recving)
        if connector_output.invalid_block_ids:
            self.scheduler.forget_failed_blocks(connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, PDWorkerMeta):
            return
        if meta.announced:
            self.scheduler.note_announced(meta.announced)
        if self._store_scheduler is not None:
            self._store_scheduler.update_connector_output(meta.store)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Without the hybrid KV cache manager: one KV cache group."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """SupportsHMA: every KV cache group's blocks, held together until decode took them."""
        delay, params = self.scheduler.request_finished(request, block_ids)
        if self._store_scheduler is not None:
            delay = self._store_scheduler.request_finished(request, block_ids, pd_holds=delay) or delay
        return delay, params

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- class-level hooks ----------------------------------------------------------------------
    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """vLLM >= 0.33: every transport lets go of the KV cache and takes it back
        (unregister_kv_caches / restore_kv_caches). A peer holds our memory's registration (nixl)
        only on a connection we dialled, and those are closed at both ends of the sleep."""
        return True

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        """LBHNC, where the attention backends accept it (vLLM falls back to their first choice,
        with a warning, where not; ``VLLM_KV_CACHE_LAYOUT`` overrides both): a block of a layer
        is one contiguous page (one NIXL descriptor per block, or per run of adjacent blocks),
        and a head subset of a block is contiguous too. vLLM's own default, LBNHC, is as
        contiguous but token-major. MLA has one head: every layer-compact layout is the same
        there, so we leave vLLM its choice (as NixlConnector does)."""
        model_config = vllm_config.model_config
        if model_config is not None and model_config.use_mla:
            return None
        return TRANSFER_LAYOUT.name

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """PIECEWISE CUDA graphs where a layer-wise load may run inside the forward (a replayed
        FULL graph would skip ``wait_for_layer_load`` and attention would read KV that has not
        landed); FULL graphs kept for a decode that loads whole requests before its step
        (``config.needs_layer_hooks``). A bad setting raises here, naming its key."""
        return needs_layer_hooks(PDConnectorConfig.from_extra_config(extra_config))

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDConnectorStats | None:
        return PDConnectorStats(data=dict(data)) if data is not None else PDConnectorStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
