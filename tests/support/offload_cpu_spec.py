"""vLLM's OffloadingConnector on vLLM CPU: its CPU tier with a host copy engine.

vLLM 0.32's ``CPUOffloadingSpec.get_worker`` refuses to run off CUDA/XPU ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"): its copy engine is CUDA streams, events and a
swap-blocks kernel between device KV and pinned host chunks. Everything else of the connector - its
scheduler side (block hashes, lookups, store/load decisions, the LRU pool manager), its worker side
(canonical KV views, job bookkeeping), its stats and metrics - is vLLM's own and runs unchanged. This
spec swaps only the copy engine: the same (device block -> host chunk) copies, done by the CPU at
submit time. Selected with ``"spec_name": "HostCopyOffloadingSpec", "spec_module_path":
"tests.support.offload_cpu_spec"`` in the connector's extra config. One block per chunk (vLLM's default).
"""

from __future__ import annotations

import time

import torch
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

# an OffloadingConnector child of MultiConnector on vLLM CPU: 64 MiB of host chunks
OFFLOAD = {
    "kv_connector": "OffloadingConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "spec_name": "HostCopyOffloadingSpec",
        "spec_module_path": "tests.support.offload_cpu_spec",
        "cpu_bytes_to_use": 64 << 20,
    },
}


class HostCopyWorker(OffloadingWorker):
    """Copies between the KV cache's blocks and host chunks, synchronously, per layer tensor."""

    def __init__(self, kv_caches: CanonicalKVCaches, num_chunks: int) -> None:
        self.device = [t.tensor.view(torch.int8).view(-1, t.page_size_bytes) for t in kv_caches.tensors]
        self.host = [torch.zeros(num_chunks, t.page_size_bytes, dtype=torch.int8) for t in kv_caches.tensors]
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, src: LoadStoreSpec, dst: LoadStoreSpec, to_host: bool) -> bool:
        device_spec = src if to_host else dst
        assert isinstance(device_spec, GPULoadStoreSpec)
        assert len(device_spec.group_sizes) == 1, "one KV cache group"
        src_ids = torch.from_numpy(src.block_ids.astype("int64"))  # type: ignore[attr-defined]
        dst_ids = torch.from_numpy(dst.block_ids.astype("int64"))  # type: ignore[attr-defined]
        assert len(src_ids) == len(dst_ids), "one block per chunk"
        start, nbytes = time.monotonic(), 0
        for device, host in zip(self.device, self.host):
            a, b = (device, host) if to_host else (host, device)
            b.index_copy_(0, dst_ids, a.index_select(0, src_ids))
            nbytes += len(src_ids) * a.shape[1]
        self.done.append(TransferResult(job_id, True, nbytes, time.monotonic() - start))
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        return self._copy(job_id, src_spec, dst_spec, to_host=False)

    def get_finished(self) -> list[TransferResult]:
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submitted


class HostCopyOffloadingSpec(CPUOffloadingSpec):
    """vLLM's CPU offloading spec, its copy engine on the CPU (see the module docstring)."""

    def _uses_shared_region(self) -> bool:
        return False

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        assert self.blocks_per_chunk == 1, "HostCopyWorker copies one block per chunk"
        if self._worker is None:
            self._worker = HostCopyWorker(kv_caches, self.num_chunks)  # type: ignore[assignment]
        return self._worker  # type: ignore[return-value]
