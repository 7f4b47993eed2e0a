"""The listening side of a stream transport: one accepted connection.

The reader thread lands PUSHed blocks straight into the sink's destinations
(in arrival order, so pushes land in the order they were sent), answers NOTIFY
through the sink and queues FETCH reads; a writer thread sends ACK / DATA /
REPLY frames, so a long DATA send never stalls the next push.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Sequence

from vllm_pd.connector.exceptions import TransportError
from vllm_pd.connector.transport.base import BlockBatch, BlockSink
from vllm_pd.connector.transport.framing import (
    FLAG_HAS_REPLY,
    FLAG_LAST,
    FLAG_QUIET,
    Checksum,
    Frame,
    Kind,
    Status,
)
from vllm_pd.connector.transport.regions import FetchGrants, RegisteredRegions
from vllm_pd.connector.transport.wire import BlockChannel, Wire

logger = logging.getLogger(__name__)

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
    ) -> None:
        self.wire = wire
        self.peer = peer
        self._channel = channel
        self._sink = sink
        self._regions = regions
        self._grants = grants
        self._checksum = checksum
        self._on_end = on_end
        self.serving: set[str] = set()  # transfer ids whose DATA is being sent now
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
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
                elif frame.kind is Kind.FETCH:
                    self._on_fetch(frame)
                elif frame.kind is Kind.NOTIFY:
                    self._on_notify(frame)
                elif frame.kind is Kind.CREDIT:
                    self._channel.on_credit(frame)
                else:
                    raise TransportError(f"unexpected {frame.kind.name} frame from {self.peer}")
        except (OSError, TransportError) as e:
            if not self._closed.is_set():
                logger.debug("session with %s ended: %s", self.peer, e)
        finally:
            self.close()
            self._channel.close()
            self._on_end(self)

    def _ack(self, frame: Frame, status: Status, text: str = "") -> None:
        ack = Frame(Kind.ACK, req_id=frame.req_id, status=status, payload=text.encode())
        self._jobs.put(lambda: self.wire.send_frame(ack))

    def _on_push(self, frame: Frame) -> None:
        batch = BlockBatch(
            transfer_id=frame.transfer_id, layer=frame.layer, positions=tuple(frame.ids),
            block_nbytes=frame.block_nbytes, last=bool(frame.flags & FLAG_LAST),
        )
        if any(n != frame.block_nbytes for n in frame.lengths):
            self._channel.drop_blocks(self.wire, frame)
            self._ack(frame, Status.CORRUPTED, f"block lengths {sorted(set(frame.lengths))} "
                      f"differ from block_nbytes {frame.block_nbytes}")
            return
        try:
            dests = self._sink.destinations(batch)
        except Exception as e:
            logger.exception("sink.destinations failed for %s", batch.transfer_id)
            self._channel.drop_blocks(self.wire, frame)
            self._ack(frame, Status.ERROR, f"sink failed: {e}")
            return
        if dests is None:
            self._channel.drop_blocks(self.wire, frame)
            self._ack(frame, Status.REJECTED, f"sink rejected transfer {frame.transfer_id!r}")
            return
        views = [memoryview(d).cast("B") for d in dests]
        if len(views) != frame.count or any(len(v) != frame.block_nbytes or v.readonly for v in views):
            self._channel.drop_blocks(self.wire, frame)
            self._ack(frame, Status.REJECTED, f"push of {frame.count} blocks of {frame.block_nbytes} "
                      f"bytes does not fit the sink's {len(views)} destinations of "
                      f"{sorted({len(v) for v in views})} bytes (or they are read-only)")
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
            self._ack(frame, Status.CORRUPTED, f"push {frame.transfer_id!r} layer {frame.layer}: "
                      "checksum mismatch")

    def _landed(self, batch: BlockBatch, ok: bool) -> None:
        try:
            self._sink.landed(batch, ok)
        except Exception:
            logger.exception("sink.landed failed for %s", batch.transfer_id)

    def _on_fetch(self, frame: Frame) -> None:
        layer, ids = frame.layer, frame.ids
        try:
            views = self._regions.views(layer, ids)
            if frame.block_nbytes != self._regions.block_nbytes[layer]:
                raise ValueError(f"block_nbytes {frame.block_nbytes} != local "
                                 f"{self._regions.block_nbytes[layer]} for layer {layer}")
        except ValueError as e:
            self._ack(frame, Status.REJECTED, str(e))
            return
        why = self._grants.check(frame.transfer_id, ids)
        if why is not None:
            self._ack(frame, Status.REJECTED, why)
            return
        self._jobs.put(lambda: self._serve_fetch(frame, views))

    def _serve_fetch(self, frame: Frame, views: Sequence[memoryview]) -> None:
        # Checked again here: the grant may have been revoked while queued.
        why = self._grants.begin_serve(frame.transfer_id, frame.ids)
        if why is not None:
            self.wire.send_frame(Frame(Kind.ACK, req_id=frame.req_id, status=Status.REJECTED,
                                       payload=why.encode()))
            return
        self.serving.add(frame.transfer_id)
        try:
            data = Frame(
                Kind.DATA, req_id=frame.req_id, checksum=self._checksum, layer=frame.layer,
                block_nbytes=frame.block_nbytes, transfer_id=frame.transfer_id, ids=frame.ids,
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
        out = Frame(Kind.REPLY, req_id=frame.req_id, flags=FLAG_HAS_REPLY if reply is not None else 0,
                    payload=bytes(reply or b""))
        self._jobs.put(lambda: self.wire.send_frame(out))

    # -- writer ----------------------------------------------------------------------

    def _write_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                job()
            except (OSError, TransportError) as e:
                logger.debug("send to %s failed: %s", self.peer, e)
                self.close()
                return
