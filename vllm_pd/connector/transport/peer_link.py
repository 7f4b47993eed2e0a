"""The dialling side of a stream transport: one persistent connection to a peer.

A :class:`PeerLink` sends requests in submission order (so pushes land in order)
and, per connection, runs a reader thread that completes requests from the
peer's ACK / DATA / REPLY frames. A lost connection fails every request of the
link with PeerClosed; the next request reconnects.

A request is sent by the submitting thread itself when nothing is queued before
it and its bytes fit the connection now (the kernel's send buffer, or free shm
ring slots), else by the link's writer thread (which also connects). On a 1-core
prefill instance the submitting thread is the forward's: handing each layer's push
to another thread cost two thread switches per layer on the core that computes.
Quiet pushes (FLAG_QUIET) get no answer of their own: the answer to a later
request on the same connection covers them, since the peer handles requests in
order and answers a failure at once.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from vllm_pd.connector.transport.link_security import LinkSecurity
from vllm_pd.connector.transport.wire import BlockChannel, Wire, configure_socket
from vllm_pd.errors import (
    AuthFailed,
    PeerClosed,
    PeerUnreachable,
    ProtocolError,
    TransferCorrupted,
    TransferRejected,
    TransferTimeout,
    TransportError,
)
from vllm_pd.protocol.frames import FLAG_HAS_REPLY, FLAG_QUIET, Frame, Kind, Status
from vllm_pd.protocol.hello_frame import HelloPayload
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass(eq=False)
class PendingOp:
    """One request awaiting its answer."""

    frame: Frame  # what to send (req_id set)
    future: Future[Any]
    deadline: float  # time.monotonic()
    send_views: list[memoryview] = field(default_factory=list)  # PUSH source blocks
    recv_views: list[memoryview] = field(default_factory=list)  # FETCH destinations
    state: str = "queued"  # queued -> sending -> sent -> receiving
    timed_out: bool = False
    seq: int = 0  # position in the connection's send order (0: not sent yet)
    keep: Any = None  # memory the peer reads until the op settles (a layer plan's progress area)

    @property
    def req_id(self) -> int:
        return self.frame.req_id

    @property
    def quiet(self) -> bool:
        return bool(self.frame.flags & FLAG_QUIET)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.send_views)


def settle(future: Future[Any], result: Any = None, error: BaseException | None = None) -> None:
    """Resolve a future once; later attempts (a race with a timeout) are no-ops."""
    if future.done():
        return
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except Exception:  # InvalidStateError: settled concurrently
        pass


_STATUS_ERRORS: dict[Status, type[TransportError]] = {
    Status.REJECTED: TransferRejected,
    Status.CORRUPTED: TransferCorrupted,
    Status.ERROR: TransportError,
}


class PeerLink:
    def __init__(
        self,
        endpoint: str,
        address: Any,
        family: int,
        make_channel: Callable[[], BlockChannel],
        hello_payload: Callable[[BlockChannel], bytes],
        connect_timeout: float,
        security: LinkSecurity | None = None,
    ) -> None:
        self.endpoint = endpoint
        self._security = security or LinkSecurity(None)
        self._address = address
        self._family = family
        self._make_channel = make_channel
        self._hello_payload = hello_payload
        self._connect_timeout = connect_timeout
        self._lock = threading.Lock()
        self._pending: dict[int, PendingOp] = {}
        self._queue: queue.SimpleQueue[PendingOp | None] = queue.SimpleQueue()
        self._queued = 0  # ops handed to the writer thread and not sent yet
        self._send_lock = threading.Lock()  # one sender at a time; held across a whole op
        self._seq = 0
        self._quiet: deque[PendingOp] = deque()  # sent quiet ops, in send order
        self._wire: Wire | None = None
        self._channel: BlockChannel | None = None
        self._closed = False
        self._writer = threading.Thread(target=self._write_loop, name=f"pd-link-writer {endpoint}", daemon=True)
        self._writer.start()

    # -- called by the transport ---------------------------------------------------

    @property
    def channel(self) -> BlockChannel | None:
        """The current connection's channel (None: not connected yet)."""
        return self._channel

    def submit(self, op: PendingOp) -> None:
        with self._lock:
            if self._closed:
                settle(op.future, error=PeerClosed(f"transport closed ({self.endpoint})"))
                return
            self._pending[op.req_id] = op
            wire, channel = self._wire, self._channel
            inline = (
                wire is not None and channel is not None and self._queued == 0 and channel.fits_now(wire, op.nbytes)
            )
            if inline:
                op.state = "sending"
            else:
                self._queued += 1
        if inline:
            assert wire is not None and channel is not None
            self._send(op, wire, channel)
        else:
            self._queue.put(op)

    def expire(self, op: PendingOp) -> None:
        """The op's deadline passed (timer thread)."""
        with self._lock:
            if self._pending.get(op.req_id) is not op:
                return
            if op.state == "receiving" or (op.state == "sending" and op.send_views):
                # Its block bytes are moving right now; abort the connection so that the
                # moving thread stops touching the op's memory, then it settles it.
                op.timed_out = True
                wire = self._wire
            else:
                # Nothing of its own in flight (a control frame, however late its sender
                # thread is): it fails alone. Aborting here cost every other transfer on
                # the link when a starved thread sat on a NOTIFY past its deadline.
                del self._pending[op.req_id]
                wire = None
        if wire is not None:
            wire.shutdown()
        elif not op.timed_out:
            settle(op.future, error=TransferTimeout(f"{op.frame.kind.name} to {self.endpoint} timed out"))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            wire = self._wire
        self._queue.put(None)
        if wire is not None:
            self._lost(wire, PeerClosed(f"transport closed ({self.endpoint})"))
        self._fail_all(PeerClosed(f"transport closed ({self.endpoint})"))
        self._writer.join(timeout=5)

    # -- writer thread -------------------------------------------------------------

    def _write_loop(self) -> None:
        while (op := self._queue.get()) is not None:
            try:
                self._write_queued(op)
            finally:
                with self._lock:
                    self._queued -= 1

    def _write_queued(self, op: PendingOp) -> None:
        with self._lock:
            if self._pending.get(op.req_id) is not op:
                return  # timed out while queued
            op.state = "sending"
            wire, channel = self._wire, self._channel
        if wire is None or channel is None:
            try:
                # Bounded by the op's own deadline too: expire() cannot cut a connect.
                wire, channel = self._connect(min(self._connect_timeout, max(op.deadline - time.monotonic(), 0.01)))
            except (OSError, TransportError) as e:
                self._pop_and_fail(
                    op,
                    TransferTimeout(f"{op.frame.kind.name} to {self.endpoint} timed out while connecting: {e}")
                    if op.timed_out or time.monotonic() >= op.deadline
                    else PeerUnreachable(f"cannot connect to {self.endpoint}: {e}"),
                )
                return
            if op.timed_out:
                self._pop_and_fail(op, TransferTimeout(f"{op.frame.kind.name} to {self.endpoint} timed out"))
                return
        self._send(op, wire, channel)

    def _send(self, op: PendingOp, wire: Wire, channel: BlockChannel) -> None:
        with self._send_lock:
            with self._lock:
                if self._pending.get(op.req_id) is not op or self._wire is not wire:
                    # timed out, or its connection died while it waited for the lock
                    if self._pending.get(op.req_id) is op:
                        del self._pending[op.req_id]
                        settle(op.future, error=PeerClosed(f"connection to {self.endpoint} lost"))
                    return
                # numbered before the first byte leaves: the answer may come back before
                # the send call returns
                self._seq += 1
                op.seq = self._seq
                if op.quiet:
                    self._quiet.append(op)
            try:
                if op.send_views:
                    channel.send_blocks(wire, op.frame, op.send_views)
                else:
                    wire.send_frame(op.frame)
            except (OSError, TransportError) as e:
                self._lost(wire, e)
                return
            with self._lock:
                if op.state == "sending":
                    op.state = "sent"

    def _connect(self, timeout: float) -> tuple[Wire, BlockChannel]:
        sock = socket.socket(self._family, socket.SOCK_STREAM)
        try:
            sock.settimeout(timeout)
            sock.connect(self._address)
            configure_socket(sock)
            sock.settimeout(timeout)
            try:
                conn, keys = self._security.dial(sock)
            except AuthFailed as e:
                logger.warning("connection to %s refused: %s", self.endpoint, e)
                raise
            channel = self._make_channel()
            wire = Wire(conn, channel.frames_only, keys)
            try:
                wire.send_frame(Frame(Kind.HELLO, payload=self._hello_payload(channel)))
                reply = wire.reader.read_frame()
                if reply.kind is not Kind.HELLO:
                    raise TransferRejected(f"expected HELLO from {self.endpoint}, got {reply.kind.name}")
                try:
                    hello = HelloPayload.decode(reply.payload)
                except ProtocolError as e:
                    raise TransferCorrupted(f"{self.endpoint}: {e}") from None
                channel.attach(hello.channel)
                channel.finish_handshake(wire)
                conn.settimeout(None)
            except BaseException:
                channel.close()
                raise
        except BaseException:
            sock.close()
            raise
        with self._lock:
            if self._closed:
                wire.close()
                channel.close()
                raise PeerClosed("transport closed")
            self._wire, self._channel = wire, channel
        threading.Thread(
            target=self._read_loop,
            args=(wire, channel),
            name=f"pd-link-reader {self.endpoint}",
            daemon=True,
        ).start()
        return wire, channel

    # -- reader thread ---------------------------------------------------------------

    def _read_loop(self, wire: Wire, channel: BlockChannel) -> None:
        try:
            while True:
                frame = wire.reader.read_frame()
                if frame.kind is Kind.CREDIT:
                    channel.on_credit(frame)
                elif frame.kind is Kind.DATA:
                    self._on_data(wire, channel, frame)
                elif frame.kind in (Kind.ACK, Kind.REPLY):
                    self._on_answer(frame)
                else:
                    raise TransferCorrupted(f"unexpected {frame.kind.name} frame from {self.endpoint}")
        except (AuthFailed, TransferCorrupted) as e:
            self._security.violated(self.endpoint, e)
            self._lost(wire, e)
        except (OSError, TransportError) as e:
            self._lost(wire, e)
        finally:
            channel.close()

    def _on_answer(self, frame: Frame) -> None:
        with self._lock:
            op = self._pending.pop(frame.req_id, None)
            covered = self._covered_by(op) if op is not None else []
        for q in covered:
            settle(q.future, None)
        if op is None:
            return  # already timed out
        if frame.status is not Status.OK:
            text = frame.payload.decode(errors="replace")
            settle(op.future, error=_STATUS_ERRORS[frame.status](f"{self.endpoint}: {text}"))
        elif frame.kind is Kind.REPLY:
            settle(op.future, frame.payload if frame.flags & FLAG_HAS_REPLY else None)
        else:
            settle(op.future, None)

    def _on_data(self, wire: Wire, channel: BlockChannel, frame: Frame) -> None:
        with self._lock:
            op = self._pending.get(frame.req_id)
            if op is not None:
                op.state = "receiving"
        if op is None:
            channel.drop_blocks(wire, frame)
            return
        views = op.recv_views
        if len(frame.ids) != len(views) or any(n != len(v) for n, v in zip(frame.lengths, views, strict=False)):
            channel.drop_blocks(wire, frame)
            self._pop_and_fail(
                op,
                TransferCorrupted(
                    f"fetch from {self.endpoint}: got {len(frame.ids)} blocks of lengths "
                    f"{sorted(set(frame.lengths))}, expected {len(views)} of {len(views[0]) if views else 0}"
                ),
            )
            return
        ok = channel.recv_blocks(wire, frame, views)
        self._pop_and_fail(
            op,
            None
            if ok
            else TransferCorrupted(
                f"fetch {frame.transfer_id!r} layer {frame.layer} from {self.endpoint}: checksum mismatch"
            ),
        )

    def _covered_by(self, answered: PendingOp) -> list[PendingOp]:
        """Quiet ops sent before ``answered``: the peer handled them without failure
        (a failure is answered at once, so it came before this answer). Under _lock."""
        covered = []
        while self._quiet and self._quiet[0].seq < answered.seq:
            q = self._quiet.popleft()
            if self._pending.get(q.req_id) is q:
                del self._pending[q.req_id]
                covered.append(q)
        return covered

    # -- failure -------------------------------------------------------------------

    def _pop_and_fail(self, op: PendingOp, error: BaseException | None) -> None:
        """Settle ``op`` (error None: success, which covers the quiet ops sent before it)."""
        with self._lock:
            self._pending.pop(op.req_id, None)
            covered = self._covered_by(op) if error is None and op.seq else []
        for q in covered:
            settle(q.future, None)
        settle(op.future, error=error)

    def _lost(self, wire: Wire, error: BaseException) -> None:
        """The connection broke: every request of this link fails."""
        with self._lock:
            if self._wire is wire:
                self._wire = None
                self._channel = None
        wire.close()
        self._fail_all(error)

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            ops = list(self._pending.values())
            self._pending.clear()
            self._quiet.clear()
        for op in ops:
            if op.timed_out:
                settle(
                    op.future,
                    error=TransferTimeout(f"{op.frame.kind.name} to {self.endpoint} timed out (connection aborted)"),
                )
            else:
                settle(op.future, error=PeerClosed(f"connection to {self.endpoint} lost: {error}"))
