"""Worker side of the PD connector (runs in each vLLM worker process).

Prefill: ``save_kv_layer`` pushes layer i's blocks while layer i+1 computes;
after the step, finished prompts are granted to decode's reads (pull mode, and
the fallback of push mode) until decode releases them or the lease ends.

Decode: each load runs as a :class:`LoadJob` off the model's thread; in async
mode the request waits off-batch until it is reported finished, in layer-wise
mode the forward waits per layer in ``wait_for_layer_load``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import torch

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.control import PrefillDoneMessage, ReleaseMessage, decode_control
from vllm_pd.connector.load_job import LoadJob
from vllm_pd.connector.metadata import PDConnectorMetadata, PDHandshake, SendSpec
from vllm_pd.connector.outgoing import OutgoingTransfers
from vllm_pd.connector.push_staging import PushStaging
from vllm_pd.connector.stats import PDConnectorStats
from vllm_pd.connector.transfer_params import RemotePrefill
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, LayerPush, MemoryRegion
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# An idle engine keeps stepping while transfers are pending; waiting this long for
# a transfer event in such an empty step keeps the idle CPU near zero.
IDLE_WAIT_S = 0.005


def advertised_host(config: PDConnectorConfig) -> str:
    if config.host != "auto":
        return config.host
    env = os.environ.get("VLLM_HOST_IP")
    if env:
        return env
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class PDConnectorWorker:
    def __init__(self, config: PDConnectorConfig, block_size: int, tp_rank: int, base_port: int,
                 is_producer: bool, is_consumer: bool, tp_size: int = 1) -> None:
        self.config = config
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.base_port = base_port
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        # the transport's default checksum (crc32c, fused with the copies) unless turned off
        self.transport = create_transport(config.transport, **({} if config.checksum else {"checksum": "none"}))
        self.regions: list[MemoryRegion] = []
        self._layer_index: dict[str, int] = {}
        self.outgoing = OutgoingTransfers(config.lease_s)
        self.staging = PushStaging(config.staging_bytes, ttl_s=config.lease_s)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="pd-load")
        self._jobs: dict[str, LoadJob] = {}
        # jobs of decode legs sent beside their prefill leg, parked (no thread) until prefill
        # announces the push: a thread each would let slow prefills block every other load
        self._awaiting: dict[str, LoadJob] = {}
        self._awaiting_lock = threading.Lock()
        self._announced: set[str] = set()  # announcements not yet reported to the scheduler (under the lock)
        self._awaited_keys: list[str] = []  # decode legs the scheduler holds back until announced
        self._step_jobs: list[LoadJob] = []
        self._step_sends: list[SendSpec] = []
        self._step_plans: dict[int, LayerPush] = {}  # id(spec) -> its layers' push, made as the step starts
        self._idle = False
        self.stats = PDConnectorStats(rank=tp_rank)
        self.endpoint = ""
        self.host = ""
        self.port = 0

    # ---- set-up ---------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.regions = [MemoryRegion(name, t) for name, t in kv_caches.items()]
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.transport.register_regions(self.regions)
        port = self.base_port + self.tp_rank if self.base_port else 0
        self.endpoint = self.transport.start(self, self.config.bind_host, port)
        self.host = advertised_host(self.config)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        # peers reach us by the advertised host, not the bind address
        self.endpoint = f"{self.endpoint.split('://', 1)[0]}://{self.host}:{self.port}"
        r0 = self.regions[0]
        logger.info("PD connector worker %d: %d layers of %d blocks x %d bytes, KV endpoint %s",
                    self.tp_rank, len(self.regions), r0.num_blocks, r0.block_nbytes, self.endpoint)

    def handshake(self) -> PDHandshake:
        return PDHandshake(endpoint=self.endpoint, host=self.host, port=self.port,
                           num_layers=len(self.regions), block_nbytes=self.regions[0].block_nbytes)

    # ---- BlockSink (transport threads) ----------------------------------------------------------
    def destinations(self, batch: BlockBatch):  # noqa: ANN201 - see BlockSink
        if not self.is_consumer or not 0 <= batch.layer < len(self.regions):
            return None
        if batch.block_nbytes != self.regions[batch.layer].block_nbytes:
            logger.warning("push of transfer %s has %d-byte blocks, ours are %d: rejected",
                           batch.transfer_id, batch.block_nbytes, self.regions[batch.layer].block_nbytes)
            return None
        return self.staging.destinations(batch)

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        self.staging.landed(batch, ok)

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        try:
            msg = decode_control(message)
        except msgspec.MsgspecError:
            logger.warning("unknown control message from %s ignored", peer)
            return b"unknown"
        if isinstance(msg, ReleaseMessage):
            self.outgoing.release(msg.transfer_id)
        elif self.is_consumer:
            with self._awaiting_lock:
                abandoned = self.staging.announce(msg.transfer_key, msg.params)
                job = self._awaiting.pop(msg.transfer_key, None)
                if not abandoned:
                    self._announced.add(msg.transfer_key)
            if abandoned:
                self._release_announced(msg.params)
            if job is not None:
                self._pool.submit(self._run_job, job)
            self.outgoing.changed.set()  # an idle step reports it to the scheduler at once
        return b"ok"

    def _release_announced(self, params: dict) -> None:
        remote = RemotePrefill.from_params(params)
        if remote is not None:
            self._release(remote)

    # ---- each step ------------------------------------------------------------------------------
    def begin_step(self, meta: PDConnectorMetadata) -> None:
        """Bookkeeping of a step's metadata, before its forward writes any block."""
        self._idle = meta.idle
        self._awaited_keys = meta.awaited_keys
        for tid in meta.preempted_transfers:
            # the blocks are about to be reused: pushes and reads of them must end first
            # (the grant comes back when the request's prompt is computed again)
            self.outgoing.wait_pushes(tid, timeout=self.config.transfer_timeout_s)
            self.transport.allow_fetch(tid, None)
        for fs in meta.finished_sends:
            self.outgoing.finish(fs.transfer_id, fs.held)
        self._step_sends = [s for s in meta.sends if self.is_producer]
        self._step_plans = {}
        for spec in self._step_sends:
            if spec.push_endpoint is not None:
                # Pushed KV is announced as its last forward starts: decode may then run its own
                # forward beside ours, taking each layer as it lands (a layer-wise load).
                self._announce(spec)
                self._plan_push(spec)
        self._step_jobs = [
            LoadJob(spec, self.transport, self.regions, self.staging, self.tp_rank,
                    self.config.transfer_timeout_s, self.config.push_wait_s, tp_size=self.tp_size)
            for spec in meta.loads
        ]
        for rel in meta.remote_releases:
            self._release(rel.remote)
        for key in meta.abandoned_pushes:
            announced = self.staging.abandon(key)
            if announced is not None:
                self._release_announced(announced)
        for req_id in meta.cancelled_loads:
            job = self._jobs.get(req_id)
            if job is not None:
                self._unpark(job, cancel=True)

    def start_loads(self) -> None:
        """Called by vLLM after it zeroed this step's new blocks, so nothing overwrites what lands."""
        for job in self._step_jobs:
            if job.spec.request_id in self._jobs:
                continue
            self._jobs[job.spec.request_id] = job
            if job.remote is None and not job.spec.layerwise:
                with self._awaiting_lock:
                    if not self.staging.is_announced(job.spec.transfer_key):
                        self._awaiting[job.spec.transfer_key] = job
                        continue
            self._pool.submit(self._run_job, job)

    def _unpark(self, job: LoadJob, cancel: bool) -> None:
        """Run a parked job now: it fails at once (cancelled, or past its deadline) unless announced."""
        with self._awaiting_lock:
            if self._awaiting.pop(job.spec.transfer_key, None) is None:
                return  # announced meanwhile: already running
            job.cancelled = cancel
        self._pool.submit(self._run_job, job)

    def _run_job(self, job: LoadJob) -> None:
        job.run()
        self.outgoing.changed.set()  # wakes an idle step waiting in get_finished

    def _release(self, remote: RemotePrefill) -> None:
        """Tell this rank's share of prefill's ranks that ``remote``'s KV is not needed."""
        message = ReleaseMessage(remote.transfer_id).encode()
        for peer in remote.release_endpoints(self.tp_rank, self.tp_size):
            try:
                self.transport.notify(peer, message, timeout=5.0)
            except Exception as e:  # noqa: BLE001 - the lease frees it anyway
                logger.warning("release of %s at %s failed: %s", remote.transfer_id, peer, e)

    def _peer_for_rank(self, endpoint: str) -> str:
        """Peers of TP rank r listen on base port + r."""
        if self.tp_rank == 0:
            return endpoint
        head, port = endpoint.rsplit(":", 1)
        return f"{head}:{int(port) + self.tp_rank}"

    def wait_for_layer_load(self, layer_name: str) -> None:
        if not self._step_jobs:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for job in self._step_jobs:
            if job.spec.layerwise:
                job.layer_done[i].wait(timeout=self.config.transfer_timeout_s + 5.0)

    def _push_blocks(self, spec: SendSpec) -> tuple[tuple[int, ...], list[int]]:
        """(positions, block ids) of what this step computes of ``spec``'s prompt."""
        end_block = -(-spec.end_token // self.block_size)
        positions = tuple(range(spec.first_block, end_block))
        return positions, [spec.block_ids[p] for p in positions]

    def _plan_push(self, spec: SendSpec) -> None:
        """All of the step's layers pushed as one plan the peer reads from our memory, where
        the transport can (same host): the forward then only marks each layer ready."""
        positions, block_ids = self._push_blocks(spec)
        if not positions:
            return
        try:
            plan = self.transport.push_layers(
                self._peer_for_rank(spec.push_endpoint), spec.transfer_key or spec.transfer_id,
                range(len(self.regions)), positions, block_ids, timeout=self.config.transfer_timeout_s,
                last=spec.prefill_done)
        except Exception as e:  # noqa: BLE001 - pushed layer by layer instead
            logger.warning("layer plan of %s failed to start: %s", spec.transfer_id, e)
            return
        if plan is None or plan.future is None:
            return
        self._step_plans[id(spec)] = plan
        n = len(block_ids) * len(self.regions)
        self.stats.record_push(n, n * self.regions[0].block_nbytes)
        self.outgoing.add_push(spec.transfer_id, plan.future)

    def save_kv_layer(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        for spec in self._step_sends:
            if spec.push_endpoint is None:
                continue
            plan = self._step_plans.get(id(spec))
            if plan is not None:
                plan.ready(i)
                continue
            positions, block_ids = self._push_blocks(spec)
            if not positions:
                continue
            batch = BlockBatch(spec.transfer_key or spec.transfer_id, i, positions, self.regions[i].block_nbytes,
                               last=spec.prefill_done)
            try:
                # Only the step's last layer is answered: that answer covers the earlier
                # layers (a failure is answered at once), so decode's kernel wakes the
                # prefill core once per step, not once per layer.
                fut = self.transport.push(self._peer_for_rank(spec.push_endpoint), batch, block_ids,
                                          timeout=self.config.transfer_timeout_s,
                                          answer=i == len(self.regions) - 1)
            except Exception as e:  # noqa: BLE001 - decode falls back to pulling
                logger.warning("push of %s failed to start: %s", spec.transfer_id, e)
                continue
            self.stats.record_push(len(block_ids), len(block_ids) * batch.block_nbytes)
            self.outgoing.add_push(spec.transfer_id, fut)

    def wait_for_save(self) -> None:
        for spec in self._step_sends:
            if spec.prefill_done:
                n = -(-spec.num_prompt_tokens // self.block_size)
                self.transport.allow_fetch(spec.transfer_id, list(spec.block_ids[:n]))
                self.outgoing.mark_computed(spec.transfer_id)
                if spec.push_endpoint is None:
                    self._announce(spec)  # decode reads it now: reads were just granted
        self._step_sends = []
        self._step_plans = {}

    def _announce(self, spec: SendSpec) -> None:
        """Tell the waiting decode where its KV is (or is being pushed to)."""
        if spec.announcement is None or spec.announce_endpoint is None:
            return
        message = PrefillDoneMessage(spec.transfer_key or spec.transfer_id, spec.announcement).encode()
        try:
            self.transport.notify(self._peer_for_rank(spec.announce_endpoint), message,
                                  timeout=self.config.transfer_timeout_s)
        except Exception as e:  # noqa: BLE001 - decode times out and recomputes; our lease frees the KV
            logger.warning("announcing the KV of %s failed: %s", spec.transfer_id, e)

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        sent, recvd, failed = self._collect()
        if self._idle and not (sent or recvd) and (self.outgoing.pending() or self._jobs or self._awaited_keys):
            self.outgoing.changed.wait(IDLE_WAIT_S)
            sent, recvd, failed = self._collect()
        self.stats.set_gauges(held=self.outgoing.held(), loading=len(self._jobs),
                              staged_bytes=self.staging.used_bytes)
        return sent, recvd, failed

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        self.outgoing.changed.clear()
        sent: set[str] = set()
        for t in self.outgoing.take_reportable():
            if t.granted:
                self.transport.allow_fetch(t.transfer_id, None)  # waits for reads in flight
            sent.add(t.transfer_id)
            if t.first_push_at is not None and t.computed_at is not None and t.last_push_done_at is not None:
                self.stats.record_push_overlap(tail_s=max(0.0, t.last_push_done_at - t.computed_at),
                                               span_s=t.last_push_done_at - t.first_push_at)
        self.stats.expired = self.outgoing.expired_total
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
                logger.warning("KV load for request %s failed (%s): decode recomputes the prompt",
                               req_id, job.error)
        self.staging.expire()
        return sent, recvd, failed

    def take_announced(self) -> frozenset[str]:
        """Transfer keys announced since the last call, for the scheduler's layer-wise choice."""
        with self._awaiting_lock:
            keys = frozenset(self._announced)
            self._announced.clear()
        return keys

    def block_ids_with_load_errors(self) -> set[int]:
        """Layer-wise loads that failed: vLLM recomputes these blocks."""
        bad: set[int] = set()
        for job in self._step_jobs:
            if not job.spec.layerwise:
                continue
            job.done.wait(timeout=self.config.transfer_timeout_s + 5.0)
            self._jobs.pop(job.spec.request_id, None)
            self.stats.record_load(job)
            if not job.ok:
                logger.warning("layer-wise KV load for %s failed (%s): its blocks are recomputed",
                               job.spec.request_id, job.error)
                bad.update(job.spec.local_block_ids)
        return bad

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
