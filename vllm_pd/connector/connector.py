"""``PDConnector``: the facade vLLM instantiates, once per role and process.

The scheduler role (EngineCore process) delegates to
:class:`~vllm_pd.connector.scheduler.PDConnectorScheduler`, the worker role (each
worker process) to :class:`~vllm_pd.connector.worker.PDConnectorWorker`.

Roles: ``kv_producer`` serves prefill legs (``do_remote_decode``), ``kv_consumer``
serves decode legs (``do_remote_prefill``), ``kv_both`` either, per request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.metadata import PDConnectorMetadata, PDHandshake, PDWorkerMeta
from vllm_pd.connector.scheduler import PDConnectorScheduler
from vllm_pd.connector.stats import PDConnectorStats, PDPromMetrics
from vllm_pd.connector.transfer_params import asks_remote_decode, asks_remote_prefill
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store_bridge import StoreBridgeScheduler, StoreBridgeWorker
from vllm_pd.connector.worker import PDConnectorWorker
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


def block_dim(kv_layer: torch.Tensor, num_blocks: int | None) -> int:
    """The dimension of a layer's KV tensor that indexes blocks, read from vLLM's layout:
    the one of size ``num_blocks`` (vLLM's CPU and MLA layouts: 0; FlashAttention's
    ``[2, num_blocks, ...]``: 1, which also settles the tie when num_blocks == 2)."""
    shape = tuple(kv_layer.shape)
    dims = [d for d, n in enumerate(shape) if n == num_blocks] if num_blocks else [0]
    if not dims:
        raise ValueError(f"KV cache layer of shape {shape} has no dimension of {num_blocks} blocks")
    if len(dims) > 1 and shape[0] == 2 and 1 in dims:
        return 1
    return dims[0]


class PDConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        self.config = PDConnectorConfig.from_extra_config(ktc.kv_connector_extra_config)
        self.is_producer = bool(ktc.is_kv_producer)
        self.is_consumer = bool(ktc.is_kv_consumer)
        if self.is_consumer and ktc.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy=%r: a failed KV transfer fails the request; "
                           "set \"kv_load_failure_policy\": \"recompute\" to recompute it instead",
                           ktc.kv_load_failure_policy)
        self._scheduler: PDConnectorScheduler | None = None
        self._worker: PDConnectorWorker | None = None
        store_config = StoreConfig.from_dict(self.config.store) if self.config.store is not None else None
        self._store_scheduler: StoreBridgeScheduler | None = None
        self._store_worker: StoreBridgeWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self._scheduler = PDConnectorScheduler(vllm_config, self.config, str(ktc.engine_id))
            if store_config is not None:
                self._store_scheduler = StoreBridgeScheduler(vllm_config, store_config)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self._worker = PDConnectorWorker(
                self.config,
                block_size=vllm_config.cache_config.block_size,
                tp_rank=get_tensor_model_parallel_rank(),
                base_port=int(ktc.kv_port),
                is_producer=self.is_producer,
                is_consumer=self.is_consumer,
                tp_size=vllm_config.parallel_config.tensor_parallel_size,
                stats=PDConnectorStats(rank=get_tensor_model_parallel_rank()),
            )
            if store_config is not None:
                self._store_worker = StoreBridgeWorker(store_config, vllm_config, get_tensor_model_parallel_rank())

    # ---- worker side ----------------------------------------------------------------------------
    @property
    def worker(self) -> PDConnectorWorker:
        assert self._worker is not None
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        num_blocks = self._kv_cache_config.num_blocks if self._kv_cache_config is not None else None
        dims = {name: block_dim(t, num_blocks) for name, t in kv_caches.items()}
        self.worker.register_kv_caches(kv_caches, dims)
        if self._store_worker is not None:
            self._store_worker.register_kv_caches(kv_caches, self.config.bind_host, self.worker.host,
                                                  block_dims=dims, device=self.worker.device)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        w = self.worker
        handshake = PDHandshake(endpoint=w.endpoint, host=w.host, port=w.port,
                                num_layers=len(w.regions), block_nbytes=w.regions[0].block_nbytes)
        if self._store_worker is not None:
            handshake.store_endpoint = self._store_worker.endpoint
        return handshake

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, PDConnectorMetadata)
        self.worker.begin_step(connector_metadata)
        if self._store_worker is not None:
            self._store_worker.begin_step(connector_metadata.store)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
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
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=recvd,
                                          failed_recving=failed)

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
            self._store_scheduler.on_handshake(first.num_layers, first.block_nbytes,
                                               ",".join(store_endpoints) if all(store_endpoints) else "")

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self.scheduler.note_request(request.request_id)
        if self._store_scheduler is not None and not asks_remote_prefill(request.kv_transfer_params):
            hit = self._store_scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
            if hit:
                return hit, False  # sync load: the worker lands it layer by layer before each layer
        if not self.is_consumer:
            return 0, False
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        if self._store_scheduler is not None:
            self._store_scheduler.update_state_after_alloc(request, blocks.get_block_ids()[0], num_external_tokens)
        if asks_remote_decode(request.kv_transfer_params) and not self.is_producer:
            return
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = self.scheduler.build_connector_meta(scheduler_output)
        if self._store_scheduler is not None:
            meta.store = self._store_scheduler.build_meta()
        return meta

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        self.scheduler.note_sent(connector_output.finished_sending or set())
        if connector_output.invalid_block_ids:
            self.scheduler.forget_failed_blocks(connector_output.invalid_block_ids)
        meta = connector_output.kv_connector_worker_meta
        if not isinstance(meta, PDWorkerMeta):
            return
        if meta.announced:
            self.scheduler.note_announced(meta.announced)
        if self._store_scheduler is not None:
            self._store_scheduler.update_connector_output(meta.store)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = self.scheduler.request_finished(request, block_ids)
        if self._store_scheduler is not None:
            delay = self._store_scheduler.request_finished(request, block_ids, pd_holds=delay) or delay
        return delay, params

    def has_pending_push_work(self) -> bool:
        return self._scheduler is not None and self._scheduler.has_pending_work()

    # ---- class-level hooks ----------------------------------------------------------------------
    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Our ``save_kv_layer`` (prefill's per-layer send) and ``wait_for_layer_load`` (decode's
        layer-wise load) do real work between layers; replayed FULL CUDA graphs would skip them
        and attention would read KV that has not landed. PIECEWISE graphs run them."""
        return True

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> PDConnectorStats | None:
        return PDConnectorStats(data=dict(data)) if data is not None else PDConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> PDPromMetrics:
        return PDPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
