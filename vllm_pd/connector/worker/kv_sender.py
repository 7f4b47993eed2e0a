"""Prefill side of a worker: each layer's KV leaves as the forward computes the next one.

Per step (``begin_step``), the requests whose KV a decode instance takes; per layer
(``save_kv_layer``, on the forward's thread), an event after the layer's write, the
blocks staged where the transport reads them (``KVAccess``: the KV itself, or pinned
host rows copied on the copy stream), and the push queued behind that event
(``SendQueue``). After the forward (``wait_for_save``), a finished prompt is held
for decode's reads - granted once staged, then announced - until decode releases it
or its lease ends (``OutgoingTransfers``). vLLM-free: the GPU harness drives it.

Decode may be of another shape (``kv_geometry``): the first push to (or announcement for)
a decode instance asks it for its shape (``ShapeQuery``, once per instance). Each decode rank
then gets from this rank exactly the pieces its plan takes from us - a run of heads of every
block, pushed as a window of the block under the plan's staging key, in our block size (decode
re-cuts) - and every decode rank hears the announcement from one prefill rank. A decode
whose shape we cannot serve is told nothing but the announcement (it then recomputes at
once) and the refusal is logged and counted. A hybrid model's layers each send their KV
cache group's blocks (``LayerGroups``).

The forward's thread never waits for the device: sends, grants and the release of a
finished transfer run on the ``pd-send`` thread behind the events they need
(``SendQueue``). Only a preempted transfer waits on it (its blocks are reused by the
very step that begins), which is rare. A step replayed as a FULL CUDA graph calls no
``save_kv_layer``: its layers are pushed from ``wait_for_save``, after the forward.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass

import msgspec

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.kv_access import KVAccess, union
from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent
from vllm_pd.connector.device.kv_geometry import announced_ranks, incompatibility, plan_rank
from vllm_pd.connector.step_specs import SendSpec, WorkerStep
from vllm_pd.connector.transport.base import BlockBatch, BlockWindow, LayerPush, Transport
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.outgoing import OutgoingTransfer, OutgoingTransfers
from vllm_pd.connector.worker.send_queue import SendQueue
from vllm_pd.connector.worker.transfer_counters import TransferCounters
from vllm_pd.protocol.control import PrefillDoneMessage
from vllm_pd.protocol.kv_shape import KVShape, ShapeQuery, decode_shape
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


def rank_endpoint(endpoint: str, rank: int) -> str:
    """A peer instance's endpoint for our TP rank: rank r listens on base port + r."""
    if rank == 0:
        return endpoint
    head, port = endpoint.rsplit(":", 1)
    return f"{head}:{int(port) + rank}"


@dataclass(frozen=True)
class _Target:
    """One decode rank this rank pushes to: where, under which staging key, and per KV cache
    group the window of each block it takes from us (None: whole blocks; absent: nothing)."""

    endpoint: str
    key: str
    windows: dict[int, BlockWindow | None]

    @property
    def whole(self) -> bool:
        return all(w is None for w in self.windows.values())


class KVSender:
    def __init__(
        self,
        config: PDConnectorConfig,
        transport: Transport,
        access: KVAccess,
        num_layers: int,
        block_size: int,
        rank: int,
        stats: TransferCounters,
        changed: threading.Event,
        groups: LayerGroups | None = None,
    ) -> None:
        self.config = config
        self.transport = transport
        self.access = access
        self.num_layers = num_layers
        self.block_size = block_size
        self.rank = rank
        self.stats = stats
        self.groups = groups or LayerGroups(None, num_layers, block_size)
        self.sends = SendQueue()
        self._changed = changed  # wakes an idle step waiting for transfer events (the worker's)
        self.outgoing = OutgoingTransfers(config.lease_s, changed)
        self._step_sends: list[SendSpec] = []
        self._step_pushes: list[SendSpec] = []  # of the step's sends, those pushed layer by layer
        self._step_saved = False  # a save_kv_layer ran this step (none does in a replayed FULL graph)
        self._step_plans: dict[int, LayerPush] = {}  # id(spec) -> its layers' push, made as the step starts
        self._step_targets: dict[int, list[_Target]] = {}  # id(spec) -> the decode ranks it goes to
        self._decode_shapes: dict[str, KVShape | None] = {}  # decode endpoint -> its shape (None: not told)
        self._refused: set[str] = set()  # decode endpoints whose shape we cannot serve (logged once)
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
        self._step_targets = {}
        for spec in self._step_pushes:
            # Pushed KV is announced as its last forward starts: decode may then run its own
            # forward beside ours, taking each layer as it lands (a layer-wise load).
            self._announce(spec)
            self._step_targets[id(spec)] = self._targets(spec.transfer_id, spec.push_endpoint or "")
            self._plan_push(spec)

    # ---- decode's shape -------------------------------------------------------------------------
    def _decode_shape(self, endpoint: str) -> KVShape | None:
        """Decode's KV shape (asked once per instance, at its rank 0); None where it does not say
        (an older peer, or none of ours: pushed and announced rank to rank, as between equal shapes)."""
        if endpoint in self._decode_shapes:
            return self._decode_shapes[endpoint]
        shape: KVShape | None = None
        try:
            reply = self.transport.notify(endpoint, ShapeQuery().encode(), timeout=self.config.peer_probe_s).result(
                timeout=self.config.peer_probe_s + 1.0
            )
            shape = decode_shape(reply) if reply else None
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.warning(
                "decode at %s answered its KV shape with something else (an older vllm-pd?): pushing "
                "and announcing rank to rank",
                endpoint,
            )
        except Exception as e:
            logger.warning(
                "decode at %s did not tell its KV shape (%s): pushing and announcing rank to rank", endpoint, e
            )
            return None  # asked again next time
        self._decode_shapes[endpoint] = shape
        return shape

    def _targets(self, transfer_id: str, endpoint: str) -> list[_Target]:
        """The decode ranks this rank pushes ``transfer_id`` to, and what each takes."""
        local = self.groups.shape
        remote = self._decode_shape(endpoint) if local is not None else None
        if local is None or remote is None or remote == local:
            return [
                _Target(rank_endpoint(endpoint, self.rank), transfer_id, dict.fromkeys(range(self.groups.num_groups)))
            ]
        why = incompatibility(local, remote)
        if why is not None:
            self._refuse(endpoint, why)
            return []
        targets = []
        for d in range(remote.tp_size):
            plan = plan_rank(local, remote, d)
            if self.rank not in plan.sources:
                continue
            windows: dict[int, BlockWindow | None] = {}
            for g, gp in enumerate(plan.groups):
                mine = [p for p in gp.pieces if p.source == self.rank]
                if not mine:
                    continue
                # one run of heads from each source (kv_geometry.head_pieces merges them)
                windows[g] = None if gp.identity else BlockWindow(*mine[0].src_window(gp.remote_format))
            targets.append(_Target(rank_endpoint(endpoint, d), plan.staging_key(transfer_id, self.rank), windows))
        return targets

    def _refuse(self, endpoint: str, why: str) -> None:
        self.stats.record_shape_refused()
        if endpoint not in self._refused:
            self._refused.add(endpoint)
            logger.warning(
                "decode at %s cannot take our KV (%s): nothing is pushed to it; it recomputes", endpoint, why
            )

    # ---- pushes ---------------------------------------------------------------------------------
    def _push_blocks(self, spec: SendSpec, group: int) -> tuple[tuple[int, ...], list[int]]:
        """(positions, block ids) of what this step computes of ``spec``'s prompt in ``group``."""
        positions = tuple(self.groups.send_positions(spec, group))
        ids = spec.group_blocks(group)
        return positions, [ids[p] for p in positions]

    def _plan_push(self, spec: SendSpec) -> None:
        """All of the step's layers pushed as one plan the peer reads from our memory, where
        the transport can (same host, one decode rank of whole blocks, one KV cache group): the
        forward then only marks each layer ready."""
        targets = self._step_targets.get(id(spec), [])
        if len(targets) != 1 or not targets[0].whole or self.groups.num_groups != 1:
            return
        target = targets[0]
        positions, block_ids = self._push_blocks(spec, 0)
        if not positions:
            return
        send_ids = self.access.send_ids(spec.transfer_id, block_ids)
        if send_ids is None:
            return  # no staging room: each layer finds none either, and decode reads what we hold
        try:
            plan = self.transport.push_layers(
                target.endpoint,
                target.key,
                range(self.num_layers),
                positions,
                send_ids,
                timeout=self.config.transfer_timeout_s,
                last=spec.prefill_done,
            )
        except Exception as e:
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
        group = self.groups.group(layer)
        positions, block_ids = self._push_blocks(spec, group)
        targets = [t for t in self._step_targets.get(id(spec), []) if group in t.windows]
        if not positions or not targets:
            return
        staged = self.access.stage_send(spec.transfer_id, layer, block_ids, written)
        if staged is None:
            return  # no staging room: decode reads the layer from what we hold
        send_ids, ready = staged
        plan = self._step_plans.get(id(spec))
        if plan is not None:
            self.sends.after(ready, lambda: plan.ready(layer))
            return
        # Only the step's last layer is answered: that answer covers the earlier layers (a
        # failure is answered at once), so decode's kernel wakes our core once per step.
        answer = layer == self.num_layers - 1
        for target in targets:
            window = target.windows[group]
            nbytes = window.nbytes if window is not None else self.access.regions[layer].block_nbytes
            batch = BlockBatch(target.key, layer, positions, nbytes, last=spec.prefill_done)
            fut = self.sends.future_after(
                ready,
                functools.partial(
                    self.transport.push,
                    target.endpoint,
                    batch,
                    send_ids,
                    timeout=self.config.transfer_timeout_s,
                    answer=answer,
                    window=window,
                ),
            )
            self.stats.record_push(len(block_ids), len(block_ids) * nbytes)
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
        self._step_sends, self._step_pushes, self._step_plans, self._step_targets = [], [], {}, {}
        for spec in done:
            by_layer = self.groups.held_blocks(spec)
            held = self.access.stage_hold(spec.transfer_id, by_layer, written)
            self.outgoing.mark_computed(spec.transfer_id)
            if held is None:
                logger.warning("no host staging room to hold the KV of %s: decode recomputes it", spec.transfer_id)
                continue
            served_from, ready = held
            self.sends.after(ready, functools.partial(self._grant, spec, union(by_layer), served_from))

    def _grant(self, spec: SendSpec, blocks: list[int], served_from: list[int]) -> None:
        """The prompt's KV is final where decode reads it: allow the reads, then say so."""
        self.transport.allow_fetch(spec.transfer_id, blocks, served_from if served_from != blocks else None)
        if spec.push_endpoint is None:
            self._announce(spec)  # decode reads it now: reads were just granted

    def _announce(self, spec: SendSpec) -> None:
        """Tell the waiting decode ranks this rank announces to where their KV is (or is being
        pushed to): every decode rank hears it from one prefill rank."""
        if spec.announcement is None or spec.announce_endpoint is None:
            return
        message = PrefillDoneMessage(spec.transfer_id, spec.announcement).encode()
        local = self.groups.shape
        remote = self._decode_shape(spec.announce_endpoint) if local is not None else None
        ranks = (
            announced_ranks(local.tp_size, remote.tp_size, self.rank)
            if local is not None and remote is not None
            else range(self.rank, self.rank + 1)
        )
        for d in ranks:
            try:
                self.transport.notify(
                    rank_endpoint(spec.announce_endpoint, d), message, timeout=self.config.transfer_timeout_s
                )
            except Exception as e:
                logger.warning("announcing the KV of %s failed: %s", spec.transfer_id, e)

    def release(self, transfer_id: str, releaser: int = -1, of: int = 1) -> None:
        """Decode is done with the transfer (a control message, on a transport thread)."""
        self.outgoing.release(transfer_id, releaser, of)

    def collect(self) -> set[str]:
        """Requests whose blocks vLLM may free now (their transfers' reads revoked, staging given back)."""
        for t in self.outgoing.take_reportable():
            if t.first_push_at is not None and t.computed_at is not None and t.last_push_done_at is not None:
                self.stats.record_push_overlap(
                    tail_s=max(0.0, t.last_push_done_at - t.computed_at), span_s=t.last_push_done_at - t.first_push_at
                )
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
            self._changed.set()  # an idle step reports it at once

    def pending(self) -> bool:
        """Transfers still held, sending, or being released."""
        with self._retire_lock:
            retiring = self._retiring > 0 or bool(self._retired)
        return retiring or self.outgoing.pending() > 0

    def close(self) -> None:
        self.sends.close()
