"""The listening side of a stream transport: one accepted connection.

The reader thread lands PUSHed blocks straight into the sink's destinations
(in arrival order, so pushes land in the order they were sent), reads the layers
of a PLAN from the sender's memory as they become ready, answers NOTIFY
through the sink and queues FETCH reads; a writer thread sends ACK / DATA /
REPLY frames, so a long DATA send never stalls the next push.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_pd.connector.transport.base import BlockBatch, BlockSink
from vllm_pd.connector.transport.checksum import block_digest
from vllm_pd.connector.transport.cross_memory import PeerMemory
from vllm_pd.connector.transport.layer_plan import ReadyPacer
from vllm_pd.connector.transport.regions import FetchGrants, RegisteredRegions
from vllm_pd.connector.transport.wire import BlockChannel, Wire
from vllm_pd.errors import AuthFailed, PeerClosed, ProtocolError, TransferCorrupted, TransportError
from vllm_pd.protocol.frames import (
    DIGEST_NBYTES,
    FLAG_HAS_REPLY,
    FLAG_LAST,
    FLAG_QUIET,
    Checksum,
    Frame,
    Kind,
    Status,
    decode_fetch_spans,
)
from vllm_pd.protocol.layer_plan import PlanFrame
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# How often a layer plan's progress is read while a layer is due: every ~50-100 us for the
# plan's last layer, the one decode's first token waits for; every ~0.5 ms for the others,
# whose reads only have to keep up with the sender (a poll costs the receiver's core ~25 us).
# Between layers the pacer sleeps longer still.
PLAN_POLL_S = 50e-6
PLAN_POLL_LAZY_S = 500e-6
# Longest single sleep before a layer is due: a closed session is noticed within it.
PLAN_QUIET_SLICE_S = 0.005

# Answers and fetches queued for the writer: a peer that keeps asking without reading the
# answers (they back up behind a full socket) is cut off here instead of growing the queue.
MAX_QUEUED_JOBS = 4096

Job = Callable[[], None]


class ServeSession:
    def __init__(
        self,
        wire: Wire,
        channel: BlockChannel,
        peer: str,
        sink: BlockSink,
        regions: RegisteredRegions,
        grants: FetchGrants,
        checksum: Checksum,
        on_end: Callable[[ServeSession], None],
        on_violation: Callable[[str, BaseException], None] | None = None,
    ) -> None:
        self.wire = wire
        self.peer = peer
        self._channel = channel
        self._sink = sink
        self._regions = regions
        self._grants = grants
        self._checksum = checksum
        self._on_end = on_end
        # the peer broke the protocol (a bad seal, a malformed or oversized frame): log and count it
        self._on_violation = on_violation
        self.serving: set[str] = set()  # transfer ids whose DATA is being sent now
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._queued = 0  # jobs put and not yet run (the reader adds, the writer takes)
        self._queued_lock = threading.Lock()
        self._closed = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name=f"pd-serve-reader {peer}", daemon=True)
        self._writer = threading.Thread(target=self._write_loop, name=f"pd-serve-writer {peer}", daemon=True)

    def start(self) -> None:
        self._writer.start()
        self._reader.start()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._jobs.put(None)
        self.wire.close()

    def join(self, timeout: float) -> None:
        for t in (self._reader, self._writer):
            if t is not threading.current_thread() and t.is_alive():
                t.join(timeout)

    # -- reader ----------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while not self._closed.is_set():
                frame = self.wire.reader.read_frame()
                if frame.kind is Kind.PUSH:
                    self._on_push(frame)
                elif frame.kind is Kind.PLAN:
                    self._on_plan(frame)
                elif frame.kind is Kind.FETCH:
                    self._on_fetch(frame)
                elif frame.kind is Kind.NOTIFY:
                    self._on_notify(frame)
                elif frame.kind is Kind.CREDIT:
                    self._channel.on_credit(frame)
                else:
                    raise TransferCorrupted(f"unexpected {frame.kind.name} frame from {self.peer}")
        except (AuthFailed, TransferCorrupted) as e:
            if not self._closed.is_set():
                if self._on_violation is not None:
                    self._on_violation(self.peer, e)
                else:
                    logger.warning("closing the connection with %s: %s", self.peer, e)
        except (OSError, TransportError) as e:
            if not self._closed.is_set():
                logger.debug("session with %s ended: %s", self.peer, e)
        finally:
            self.close()
            self._channel.close()
            self._on_end(self)

    def _ack(self, frame: Frame, status: Status, text: str = "") -> None:
        ack = Frame(Kind.ACK, req_id=frame.req_id, status=status, payload=text.encode())
        self._queue(lambda: self.wire.send_frame(ack))

    def _on_push(self, frame: Frame) -> None:
        batch = BlockBatch(
            transfer_id=frame.transfer_id,
            layer=frame.layer,
            positions=tuple(frame.ids),
            block_nbytes=frame.block_nbytes,
            last=bool(frame.flags & FLAG_LAST),
            peer=self.peer,
        )
        if any(n != frame.block_nbytes for n in frame.lengths):
            self._channel.drop_blocks(self.wire, frame)
            self._ack(
                frame,
                Status.CORRUPTED,
                f"block lengths {sorted(set(frame.lengths))} differ from block_nbytes {frame.block_nbytes}",
            )
            return
        views = self._claim(batch)
        if isinstance(views, tuple):
            self._channel.drop_blocks(self.wire, frame)
            self._ack(frame, *views)
            return
        ok = False
        try:
            ok = self._channel.recv_blocks(self.wire, frame, views)
        finally:
            # Also on a dead peer mid-batch: the sink learns the batch failed.
            self._landed(batch, ok)
        if ok:
            if not frame.flags & FLAG_QUIET:  # a quiet push is covered by the next answer
                self._ack(frame, Status.OK)
        else:
            self._ack(frame, Status.CORRUPTED, f"push {frame.transfer_id!r} layer {frame.layer}: checksum mismatch")

    def _claim(self, batch: BlockBatch) -> list[memoryview] | tuple[Status, str]:
        """The sink's destinations for ``batch``, or why there are none (status, text)."""
        try:
            dests = self._sink.destinations(batch)
        except Exception as e:
            logger.exception("sink.destinations failed for %s", batch.transfer_id)
            return Status.ERROR, f"sink failed: {e}"
        if dests is None:
            return Status.REJECTED, f"sink rejected transfer {batch.transfer_id!r}"
        views = [memoryview(d).cast("B") for d in dests]
        n = len(batch.positions)
        if len(views) != n or any(len(v) != batch.block_nbytes or v.readonly for v in views):
            return Status.REJECTED, (
                f"push of {n} blocks of {batch.block_nbytes} bytes does not fit the "
                f"sink's {len(views)} destinations of {sorted({len(v) for v in views})} "
                "bytes (or they are read-only)"
            )
        return views

    # -- layer plans: the blocks are read from the sender's memory (layer_plan.py) ---------

    def _on_plan(self, frame: Frame) -> None:
        memory = self._channel.peer_memory
        try:
            plan = PlanFrame.parse(frame.payload, frame.count)
        except TransferCorrupted as e:
            self._ack(frame, Status.CORRUPTED, str(e))
            return
        if memory is None:
            self._ack(frame, Status.REJECTED, "layer plan from a peer whose memory we cannot read")
            return
        batches = [
            BlockBatch(
                frame.transfer_id,
                layer,
                tuple(frame.ids),
                frame.block_nbytes,
                last=bool(frame.flags & FLAG_LAST),
                peer=self.peer,
            )
            for layer in plan.layers
        ]
        deadline = time.monotonic() + plan.timeout_s
        pacer = ReadyPacer()
        k = 0
        try:
            for k, batch in enumerate(batches):
                status, text = self._land_plan_layer(memory, plan, k, batch, frame.checksum, deadline, pacer)
                if status is not Status.OK:
                    self._ack(frame, status, text)
                    break
            else:
                self._ack(frame, Status.OK)
                return
        finally:
            for later in batches[k + 1 :]:
                self._landed(later, False)  # the sink stops waiting for them

    def _land_plan_layer(
        self,
        memory: PeerMemory,
        plan: PlanFrame,
        k: int,
        batch: BlockBatch,
        checksum: Checksum,
        deadline: float,
        pacer: ReadyPacer,
    ) -> tuple[Status, str]:
        # Polled, not signalled: a wake-up per layer is what the plan saves the sender's core.
        # A dead sender fails the read (PeerClosed) and ends the session.
        try:
            quiet = pacer.quiet_until()
            poll_s = PLAN_POLL_S if k == len(plan.layers) - 1 else PLAN_POLL_LAZY_S
            while memory.read_u64(plan.progress) <= k:
                if self._closed.is_set():
                    raise PeerClosed("session closed")
                now = time.monotonic()
                if now > deadline:
                    self._landed(batch, False)
                    return Status.ERROR, (
                        f"layer {batch.layer} of {batch.transfer_id!r} not ready within {plan.timeout_s:.1f}s"
                    )
                if quiet is not None and now < quiet:
                    time.sleep(min(quiet - now, PLAN_QUIET_SLICE_S))
                else:
                    time.sleep(poll_s)
            pacer.seen(time.monotonic())
        except BaseException:
            self._landed(batch, False)
            raise
        views = self._claim(batch)
        if isinstance(views, tuple):
            self._landed(batch, False)
            return views
        ok = False
        try:
            memory.read_into(views, plan.addresses[k])
            digests = memory.read(plan.digests_address(k), DIGEST_NBYTES * len(views))
            ok = b"".join(block_digest(checksum, v) for v in views) == digests
        except TransferCorrupted as e:
            logger.warning("layer plan %r layer %d: %s", batch.transfer_id, batch.layer, e)
        finally:
            self._landed(batch, ok)
        if not ok:
            return Status.CORRUPTED, f"push {batch.transfer_id!r} layer {batch.layer}: checksum mismatch"
        return Status.OK, ""

    def _landed(self, batch: BlockBatch, ok: bool) -> None:
        try:
            self._sink.landed(batch, ok)
        except Exception:
            logger.exception("sink.landed failed for %s", batch.transfer_id)

    def _on_fetch(self, frame: Frame) -> None:
        layer, ids = frame.layer, frame.ids
        local_ids, why = self._grants.lookup(frame.transfer_id, ids)
        if why is not None:
            self._ack(frame, Status.REJECTED, why)
            return
        try:
            views = self._regions.views(layer, local_ids)
            nbytes = self._regions.block_nbytes[layer]
            if frame.payload:  # parts of blocks: each within ours
                views = self._parts(frame, views, nbytes)
            elif frame.block_nbytes != nbytes:
                raise ProtocolError(f"block_nbytes {frame.block_nbytes} != local {nbytes} for layer {layer}")
        except ValueError as e:
            self._ack(frame, Status.REJECTED, str(e))
            return
        self._queue(lambda: self._serve_fetch(frame, views))

    def _parts(self, frame: Frame, views: list[Any], block_nbytes: int) -> list[Any]:
        """The parts of ``views`` a FETCH of parts of blocks asks for (ValueError if outside them)."""
        try:
            offsets, lengths = decode_fetch_spans(frame.payload, frame.count)
        except TransferCorrupted as e:
            raise ProtocolError(str(e)) from None
        for o, n in zip(offsets, lengths, strict=True):
            if n <= 0 or o + n > block_nbytes:
                raise ProtocolError(f"part [{o}, {o + n}) is not inside a block of {block_nbytes} bytes")
        return [v[o : o + n] for v, o, n in zip(views, offsets, lengths, strict=True)]

    def _serve_fetch(self, frame: Frame, views: Sequence[memoryview]) -> None:
        # Checked again here: the grant may have been revoked while queued.
        why = self._grants.begin_serve(frame.transfer_id, frame.ids)
        if why is not None:
            self.wire.send_frame(Frame(Kind.ACK, req_id=frame.req_id, status=Status.REJECTED, payload=why.encode()))
            return
        self.serving.add(frame.transfer_id)
        try:
            data = Frame(
                Kind.DATA,
                req_id=frame.req_id,
                checksum=self._checksum,
                layer=frame.layer,
                block_nbytes=frame.block_nbytes,
                transfer_id=frame.transfer_id,
                ids=frame.ids,
                lengths=tuple(len(v) for v in views),
            )
            self._channel.send_blocks(self.wire, data, views)
        finally:
            self.serving.discard(frame.transfer_id)
            self._grants.end_serve(frame.transfer_id)

    def _on_notify(self, frame: Frame) -> None:
        try:
            reply = self._sink.on_notify(self.peer, frame.payload)
        except Exception as e:
            logger.exception("sink.on_notify failed")
            self._ack(frame, Status.ERROR, f"on_notify failed: {e}")
            return
        out = Frame(
            Kind.REPLY,
            req_id=frame.req_id,
            flags=FLAG_HAS_REPLY if reply is not None else 0,
            payload=bytes(reply or b""),
        )
        self._queue(lambda: self.wire.send_frame(out))

    # -- writer ----------------------------------------------------------------------

    def _queue(self, job: Job) -> None:
        """Hand ``job`` to the writer (reader thread); TransferCorrupted if the peer has too many
        outstanding (the read loop then closes the connection)."""
        with self._queued_lock:
            if self._queued >= MAX_QUEUED_JOBS:
                raise TransferCorrupted(f"{self._queued} requests outstanding: the peer does not read its answers")
            self._queued += 1
        self._jobs.put(job)

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except (OSError, TransportError) as e:
                logger.debug("send to %s failed: %s", self.peer, e)
                self.close()
                return
            finally:
                with self._queued_lock:
                    self._queued -= 1
