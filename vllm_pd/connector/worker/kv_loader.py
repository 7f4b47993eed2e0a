"""Decode side of a worker: land a remote prefill's KV in our blocks.

Prefill's pushes land in :class:`PushStaging` (transport threads, through the
worker's ``BlockSink``); each request's load runs as a :class:`LoadJob` off the
model's thread. An async load is reported finished once its bytes are in our
blocks; a layer-wise load's forward waits per layer (``wait_for_layer``): on the
host until the layer's copy is launched, then on the compute stream for the copy
itself. Decode legs sent beside their prefill leg are parked until prefill
announces its KV. vLLM-free: the GPU harness drives it.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.kv_access import KVAccess
from vllm_pd.connector.device.kv_device import KVDevice
from vllm_pd.connector.step_specs import WorkerStep
from vllm_pd.connector.transport.base import MemoryRegion, Transport
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.connector.worker.release import DecodeRelease
from vllm_pd.connector.worker.transfer_counters import TransferCounters
from vllm_pd.protocol.transfer_params import RemotePrefill
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


class KVLoader:
    def __init__(
        self,
        config: PDConnectorConfig,
        transport: Transport,
        access: KVAccess,
        device: KVDevice,
        regions: list[MemoryRegion],
        rank: int,
        tp_size: int,
        stats: TransferCounters,
        release: DecodeRelease,
        changed: threading.Event,
        groups: LayerGroups | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.access = access
        self.device = device
        self.regions = regions
        self.rank = rank
        self.tp_size = tp_size
        self.stats = stats
        self._release = release  # every release this rank sends, its jobs' too
        self.groups = groups or LayerGroups(None, len(regions), 1)
        self._changed = changed  # wakes an idle step waiting for transfer events
        self.staging = PushStaging(
            config.staging_bytes, ttl_s=config.lease_s, peer_capacity_bytes=config.staging_peer_limit
        )
        self.staging.alloc = device.host_empty
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pd-load")
        self._jobs: dict[str, LoadJob] = {}
        # jobs of decode legs sent beside their prefill leg, parked (no thread) until prefill
        # announces the push: a thread each would let slow prefills block every other load
        self._awaiting: dict[str, LoadJob] = {}
        self._awaiting_lock = threading.Lock()
        self._announced: set[str] = set()  # announcements not yet reported to the scheduler (under the lock)
        self.awaited_transfers: list[str] = []  # of decode legs the scheduler holds back until announced
        self._step_jobs: list[LoadJob] = []

    # ---- transport threads --------------------------------------------------------------------
    def announce(self, transfer_id: str, params: dict[str, Any]) -> None:
        """Prefill announced the KV of ``transfer_id``: start the load parked for it."""
        with self._awaiting_lock:
            abandoned = self.staging.announce(transfer_id, params)
            job = self._awaiting.pop(transfer_id, None)
            if not abandoned:
                self._announced.add(transfer_id)
        if abandoned:
            self._release_announced(params)
        if job is not None:
            self._pool.submit(self._run_job, job)
        self._changed.set()  # an idle step reports it to the scheduler at once

    def _release_announced(self, params: dict[str, Any]) -> None:
        remote = RemotePrefill.from_params(params)
        if remote is not None:
            self._release.never_read(remote)

    # ---- each step ----------------------------------------------------------------------------
    def begin_step(self, meta: WorkerStep) -> None:
        self.awaited_transfers = meta.awaited_transfers
        self._step_jobs = [
            LoadJob(
                spec,
                self.transport,
                self.regions,
                self.staging,
                self.access,
                self.rank,
                self.config.transfer_timeout_s,
                self.config.push_wait_s,
                tp_size=self.tp_size,
                probe_s=self.config.peer_probe_s,
                groups=self.groups,
                host_alloc=self.device.host_empty,
                release=self._release,
            )
            for spec in meta.loads
        ]
        for rel in meta.remote_releases:
            if rel.refused:
                self.stats.record_shape_refused()
            self._release.never_read(rel.remote)
        for transfer_id in meta.abandoned_pushes:
            announced = self.staging.abandon(transfer_id)
            if announced is not None:
                self._release_announced(announced)
        for req_id in meta.cancelled_loads:
            job = self._jobs.get(req_id)
            if job is not None:
                self._unpark(job, cancel=True)

    def start_loads(self) -> None:
        """Called by vLLM after it launched the zeroing of this step's new blocks: what lands is
        copied in after that (an event on the compute stream), so nothing overwrites it."""
        zeroed = self.access.record_compute() if self._step_jobs else None
        for job in self._step_jobs:
            if job.spec.request_id in self._jobs:
                continue
            assert zeroed is not None
            job.blocks_ready = zeroed
            self._jobs[job.spec.request_id] = job
            if job.remote is None and not job.spec.layerwise:
                with self._awaiting_lock:
                    if not self.staging.is_announced(job.spec.transfer_id):
                        self._awaiting[job.spec.transfer_id] = job
                        continue
            self._pool.submit(self._run_job, job)

    def _unpark(self, job: LoadJob, cancel: bool) -> None:
        """Run a parked job now: it fails at once (cancelled, or past its deadline) unless announced."""
        with self._awaiting_lock:
            if self._awaiting.pop(job.spec.transfer_id, None) is None:
                return  # announced meanwhile: already running
            job.cancelled = cancel
        self._pool.submit(self._run_job, job)

    def _run_job(self, job: LoadJob) -> None:
        job.run()
        self._changed.set()

    def wait_for_layer(self, layer: int) -> None:
        """The forward is about to read ``layer``: order it after that layer's landing."""
        if not self._step_jobs:
            return
        stream = self.device.compute_stream()
        for job in self._step_jobs:
            if job.spec.layerwise:
                job.layer_done[layer].wait(timeout=self.config.transfer_timeout_s + 5.0)
                # the layer's copy into our blocks may still run on the copy stream
                self.device.wait(stream, job.layer_events[layer])

    # ---- reporting ----------------------------------------------------------------------------
    def job(self, request_id: str) -> LoadJob | None:
        """The running (or parked) load of ``request_id``."""
        return self._jobs.get(request_id)

    @property
    def busy(self) -> bool:
        return bool(self._jobs or self.awaited_transfers)

    @property
    def loading(self) -> int:
        return len(self._jobs)

    def collect(self) -> tuple[set[str], set[str]]:
        """(finished receiving, failed receiving) among the async loads."""
        if self._awaiting:
            now = time.monotonic()
            for job in [j for j in list(self._awaiting.values()) if now - j.started > self.config.transfer_timeout_s]:
                self._unpark(job, cancel=False)
        recvd: set[str] = set()
        failed: set[str] = set()
        for req_id, job in list(self._jobs.items()):
            if not job.done.is_set() or job.spec.layerwise:
                continue  # layer-wise loads are synchronous: errors go by block id
            del self._jobs[req_id]
            recvd.add(req_id)
            self.stats.record_load(job)
            if not job.ok:
                failed.add(req_id)
                logger.warning("KV load for request %s failed (%s): decode recomputes the prompt", req_id, job.error)
        self.staging.expire()
        return recvd, failed

    def take_announced(self) -> frozenset[str]:
        """Transfer ids announced since the last call, for the scheduler's layer-wise choice."""
        with self._awaiting_lock:
            transfer_ids = frozenset(self._announced)
            self._announced.clear()
        return transfer_ids

    def block_ids_with_load_errors(self) -> set[int]:
        """Layer-wise loads that failed: vLLM recomputes these blocks."""
        bad: set[int] = set()
        for job in self._step_jobs:
            if not job.spec.layerwise:
                continue
            # settled, not done: its last copies may still run (the forward already waits for them
            # on the compute stream); the forward's thread never waits for the device
            job.settled.wait(timeout=self.config.transfer_timeout_s + 5.0)
            self._jobs.pop(job.spec.request_id, None)
            self.stats.record_load(job)
            if not job.ok:
                logger.warning(
                    "layer-wise KV load for %s failed (%s): its blocks are recomputed", job.spec.request_id, job.error
                )
                bad.update(job.spec.all_local_block_ids)
        return bad

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
