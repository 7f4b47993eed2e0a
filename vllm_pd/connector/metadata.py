"""What the scheduler side tells the worker side each step (and the handshake).

vLLM serialises these between the EngineCore and worker processes; plain
dataclasses of builtins keep that cheap and safe.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from vllm_pd.connector.step_specs import (
    FinishedSend,
    LoadSpec,
    RemoteRelease,
    SendSpec,
    WorkerStep,
)

__all__ = [
    "FinishedSend",
    "LoadSpec",
    "PDConnectorMetadata",
    "PDHandshake",
    "PDWorkerMeta",
    "RemoteRelease",
    "SendSpec",
    "WorkerStep",
]


@dataclass
class PDConnectorMetadata(WorkerStep, KVConnectorMetadata):
    """A :class:`WorkerStep` as vLLM carries it from the scheduler to the workers."""


@dataclass
class PDHandshake(KVConnectorHandshakeMetadata):
    """Worker -> scheduler at start-up: where this worker's KV endpoint is."""

    endpoint: str
    host: str
    port: int
    num_layers: int
    block_nbytes: int
    store_endpoint: str = ""  # where other nodes fetch this worker's KV store blocks ("" = none)
    kv_format: str = ""  # what a block's bytes mean (kv_layout.block_format): peers must match it
    kv_shape: bytes = b""  # the rank's kv_geometry.KVShape, msgpack (b"": not known)


class PDWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler after each step: prefill announcements that arrived, and the store's report."""

    def __init__(self, announced: frozenset[str] = frozenset(), store: Any = None) -> None:
        self.announced = announced
        self.store = store

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, PDWorkerMeta)
        # a rank that has not seen an announcement yet waits for it in its own load job
        store = (
            self.store
            if other.store is None
            else other.store
            if self.store is None
            else self.store.aggregate(other.store)
        )
        return PDWorkerMeta(self.announced | other.announced, store)
