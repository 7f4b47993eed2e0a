"""Prefill side of a worker: each layer's KV leaves as the forward computes the next one.

Per step (``begin_step``), the requests whose KV a decode instance takes; per layer
(``save_kv_layer``, on the forward's thread), an event after the layer's write, the
blocks staged where the transport reads them (``KVAccess``: the KV itself, or pinned
host rows copied on the copy stream), and the push queued behind that event
(``SendQueue``). After the forward (``wait_for_save``), a finished prompt is held
for decode's reads - granted once staged, then announced - until decode releases it
or its lease ends (``OutgoingTransfers``). vLLM-free: the GPU harness drives it.

The forward's thread never waits for the device: sends, grants and the release of a
finished transfer run on the ``pd-send`` thread behind the events they need
(``SendQueue``). Only a preempted transfer waits on it (its blocks are reused by the
very step that begins), which is rare. A step replayed as a FULL CUDA graph calls no
``save_kv_layer``: its layers are pushed from ``wait_for_save``, after the forward.
"""

from __future__ import annotations

import functools
import threading


from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.control import PrefillDoneMessage
from vllm_pd.connector.kv_access import KVAccess
from vllm_pd.connector.kv_device import COMPLETED, DeviceEvent
from vllm_pd.connector.outgoing import OutgoingTransfer, OutgoingTransfers
from vllm_pd.connector.send_queue import SendQueue
from vllm_pd.connector.step_specs import SendSpec, WorkerStep
from vllm_pd.connector.transfer_counters import TransferCounters
from vllm_pd.connector.transport.base import BlockBatch, LayerPush, Transport
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """A peer instance's endpoint for our TP rank: rank r listens on base port + r."""
    if rank == 0:
        return endpoint
    head, port = endpoint.rsplit(":", 1)
    return f"{head}:{int(port) + rank}"


class KVSender:
    def __init__(self, config: PDConnectorConfig, transport: Transport, access: KVAccess, num_layers: int,
                 block_size: int, rank: int, stats: TransferCounters) -> None:
        self.config = config
        self.transport = transport
        self.access = access
        self.num_layers = num_layers
        self.block_size = block_size
        self.rank = rank
        self.stats = stats
        self.sends = SendQueue()
        self.outgoing = OutgoingTransfers(config.lease_s)
        self._step_sends: list[SendSpec] = []
        self._step_pushes: list[SendSpec] = []  # of the step's sends, those pushed layer by layer
        self._step_saved = False  # a save_kv_layer ran this step (none does in a replayed FULL graph)
        self._step_plans: dict[int, LayerPush] = {}  # id(spec) -> its layers' push, made as the step starts
        self._retire_lock = threading.Lock()
        self._retiring = 0  # finished transfers queued for release behind the sends before them
        self._retired: set[str] = set()  # their requests, released: vLLM may free the blocks

    def begin_step(self, meta: WorkerStep) -> None:
        for transfer_id in meta.preempted_transfers:
            # the blocks are about to be reused: pushes and reads of them must end first
            # (the grant comes back when the request's prompt is computed again)
            self.sends.drain(self.config.transfer_timeout_s)
            self.outgoing.wait_pushes(transfer_id, timeout=self.config.transfer_timeout_s)
            self.transport.allow_fetch(transfer_id, None)
            self.access.release(transfer_id)
        for fs in meta.finished_sends:
            self.outgoing.finish(fs.transfer_id, fs.request_id, fs.held)
        self._step_sends = list(meta.sends)
        self._step_pushes = [spec for spec in self._step_sends if spec.push_endpoint is not None]
        self._step_saved = False
        self._step_plans = {}
        for spec in self._step_pushes:
            # Pushed KV is announced as its last forward starts: decode may then run its own
            # forward beside ours, taking each layer as it lands (a layer-wise load).
            self._announce(spec)
            self._plan_push(spec)

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
        send_ids = self.access.send_ids(spec.transfer_id, block_ids)
        if send_ids is None:
            return  # no staging room: each layer finds none either, and decode reads what we hold
        try:
            plan = self.transport.push_layers(
                rank_endpoint(spec.push_endpoint or "", self.rank), spec.transfer_id,
                range(self.num_layers), positions, send_ids, timeout=self.config.transfer_timeout_s,
                last=spec.prefill_done)
        except Exception as e:  # noqa: BLE001 - pushed layer by layer instead
            logger.warning("layer plan of %s failed to start: %s", spec.transfer_id, e)
            return
        if plan is None or plan.future is None:
            return
        self._step_plans[id(spec)] = plan
        n = len(block_ids) * self.num_layers
        self.stats.record_push(n, n * self.access.regions[0].block_nbytes)
        self.outgoing.add_push(spec.transfer_id, plan.future)

    def save_kv_layer(self, layer: int) -> None:
        """Layer ``layer``'s KV write is launched: its blocks leave once it is done."""
        if not self._step_pushes:
            return
        self._step_saved = True
        written = self.access.record_compute()
        for spec in self._step_pushes:
            self._push_layer(spec, layer, written)

    def _push_layer(self, spec: SendSpec, layer: int, written: DeviceEvent) -> None:
        positions, block_ids = self._push_blocks(spec)
        if not positions:
            return
        staged = self.access.stage_send(spec.transfer_id, layer, block_ids, written)
        if staged is None:
            return  # no staging room: decode reads the layer from what we hold
        send_ids, ready = staged
        plan = self._step_plans.get(id(spec))
        if plan is not None:
            self.sends.after(ready, lambda: plan.ready(layer))
            return
        block_nbytes = self.access.regions[layer].block_nbytes
        batch = BlockBatch(spec.transfer_id, layer, positions, block_nbytes,
                           last=spec.prefill_done)
        peer = rank_endpoint(spec.push_endpoint or "", self.rank)
        # Only the step's last layer is answered: that answer covers the earlier layers (a
        # failure is answered at once), so decode's kernel wakes our core once per step.
        answer = layer == self.num_layers - 1
        fut = self.sends.future_after(ready, lambda: self.transport.push(
            peer, batch, send_ids, timeout=self.config.transfer_timeout_s, answer=answer))
        self.stats.record_push(len(block_ids), len(block_ids) * block_nbytes)
        self.outgoing.add_push(spec.transfer_id, fut)

    def wait_for_save(self) -> None:
        """The step's forward is launched: hold each finished prompt for decode's reads."""
        done = [spec for spec in self._step_sends if spec.prefill_done]
        # a replayed FULL graph ran no save_kv_layer: its layers leave after the whole forward
        replayed = [] if self._step_saved else self._step_pushes
        written = self.access.record_compute() if done or replayed else COMPLETED
        for spec in replayed:
            for layer in range(self.num_layers):
                self._push_layer(spec, layer, written)
        self._step_sends, self._step_pushes, self._step_plans = [], [], {}
        for spec in done:
            blocks = list(spec.block_ids[:-(-spec.num_prompt_tokens // self.block_size)])
            held = self.access.stage_hold(spec.transfer_id, blocks, written)
            self.outgoing.mark_computed(spec.transfer_id)
            if held is None:
                logger.warning("no host staging room to hold the KV of %s: decode recomputes it", spec.transfer_id)
                continue
            served_from, ready = held
            self.sends.after(ready, functools.partial(self._grant, spec, blocks, served_from))

    def _grant(self, spec: SendSpec, blocks: list[int], served_from: list[int]) -> None:
        """The prompt's KV is final where decode reads it: allow the reads, then say so."""
        self.transport.allow_fetch(spec.transfer_id, blocks, served_from if served_from != blocks else None)
        if spec.push_endpoint is None:
            self._announce(spec)  # decode reads it now: reads were just granted

    def _announce(self, spec: SendSpec) -> None:
        """Tell the waiting decode where its KV is (or is being pushed to)."""
        if spec.announcement is None or spec.announce_endpoint is None:
            return
        message = PrefillDoneMessage(spec.transfer_id, spec.announcement).encode()
        try:
            self.transport.notify(rank_endpoint(spec.announce_endpoint, self.rank), message,
                                  timeout=self.config.transfer_timeout_s)
        except Exception as e:  # noqa: BLE001 - decode times out and recomputes; our lease frees the KV
            logger.warning("announcing the KV of %s failed: %s", spec.transfer_id, e)

    def release(self, transfer_id: str) -> None:
        """Decode is done with the transfer (a control message, on a transport thread)."""
        self.outgoing.release(transfer_id)

    def collect(self) -> set[str]:
        """Requests whose blocks vLLM may free now (their transfers' reads revoked, staging given back)."""
        for t in self.outgoing.take_reportable():
            if t.first_push_at is not None and t.computed_at is not None and t.last_push_done_at is not None:
                self.stats.record_push_overlap(tail_s=max(0.0, t.last_push_done_at - t.computed_at),
                                               span_s=t.last_push_done_at - t.first_push_at)
            # behind every send queued so far - a grant still queued behind its copy must not
            # re-open reads after the revoke - on the send thread if one is queued (the next
            # collect reports it), never waiting here for the device; at once on the CPU
            with self._retire_lock:
                self._retiring += 1
            self.sends.after(COMPLETED, functools.partial(self._retire, t))
        with self._retire_lock:
            sent, self._retired = self._retired, set()
        self.stats.expired = self.outgoing.expired_total
        return sent

    def _retire(self, t: OutgoingTransfer) -> None:
        """Revoke reads of a finished transfer and give back its staging; then vLLM may free it."""
        try:
            if t.granted:
                self.transport.allow_fetch(t.transfer_id, None)  # waits for reads in flight
            self.access.release(t.transfer_id)
        finally:
            with self._retire_lock:
                self._retiring -= 1
                self._retired.add(t.request_id)
            self.outgoing.changed.set()  # an idle step reports it at once

    def pending(self) -> bool:
        """Transfers still held, sending, or being released."""
        with self._retire_lock:
            retiring = self._retiring > 0 or bool(self._retired)
        return retiring or self.outgoing.pending() > 0

    def close(self) -> None:
        self.sends.close()
