"""The transport logic shared by tcp and shm: everything but where bytes travel.

Subclasses say how to listen, how to dial an endpoint and which BlockChannel
carries block bytes; requests, answers, checks, grants and timeouts live here,
in :class:`PeerLink` (dialling side) and :class:`ServeSession` (listening side).
"""

from __future__ import annotations

import abc
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import msgspec

from vllm_pd.connector.transport.base import (
    BlockBatch,
    BlockSink,
    BlockWindow,
    FetchSpans,
    MemoryRegion,
    Transport,
)
from vllm_pd.connector.transport.checksum import parse_checksum
from vllm_pd.connector.transport.layer_plan import LayerPlan
from vllm_pd.connector.transport.link_security import LinkSecurity
from vllm_pd.connector.transport.peer_link import PeerLink, PendingOp, settle
from vllm_pd.connector.transport.regions import FetchGrants, RegisteredRegions
from vllm_pd.connector.transport.serve_session import ServeSession
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.connector.transport.wire import BlockChannel, Wire, configure_socket
from vllm_pd.errors import AuthFailed, ConfigError, PeerClosed, TransferCorrupted, TransferRejected, TransportError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.frames import FLAG_LAST, FLAG_QUIET, Checksum, Frame, Kind, encode_fetch_spans
from vllm_pd.protocol.hello_frame import HelloPayload
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


# Connections accepted and not through their handshake yet: beyond this many the oldest is cut
# (an outsider opening connections and saying nothing cannot pile up threads; a member's
# handshake takes milliseconds, so it is never the oldest for long).
MAX_PENDING_HANDSHAKES = 64

# A deadline fires up to this late: ops answered long before their deadline still sit in
# the heap, and a wake-up per op would land on the core that computes, so the timer wakes
# once per window and expires everything due by then.
TIMER_SLACK_S = 0.05


class DeadlineTimer:
    """One thread that expires pending ops at their deadlines."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, PeerLink, PendingOp]] = []
        self._seq = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="pd-transport-timer", daemon=True)
        self._thread.start()

    def add(self, link: PeerLink, op: PendingOp) -> None:
        with self._cond:
            heapq.heappush(self._heap, (op.deadline, next(self._seq), link, op))
            if self._heap[0][3] is op:
                self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap.clear()
            self._cond.notify()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopped and (not self._heap or self._heap[0][0] > time.monotonic()):
                    self._cond.wait(self._heap[0][0] - time.monotonic() + TIMER_SLACK_S if self._heap else None)
                if self._stopped:
                    return
                _, _, link, op = heapq.heappop(self._heap)
            if not op.future.done():
                link.expire(op)


class StreamTransport(Transport):
    """A Transport over one persistent stream connection per peer."""

    scheme = ""
    # block bytes travel where an outsider might write them (the socket, a shm ring): with a
    # deployment secret they get the session's keyed check (nixl: RDMA, which we cannot key)
    keyed_blocks = True

    def __init__(
        self,
        checksum: str = "crc32c",
        connect_timeout: float = 5.0,
        revoke_wait: float = 5.0,
        secret: DeploymentSecret | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        self._checksum = parse_checksum(checksum)
        self._security = LinkSecurity(secret, tls=tls)
        # what PUSH and DATA blocks are checked with (layer plans: the blocks are read from the
        # authenticated peer's own memory, by the kernel; they keep the configured checksum)
        self._data_checksum = Checksum.BLAKE3_KEYED if self._security.seals and self.keyed_blocks else self._checksum
        if connect_timeout <= 0:
            raise ConfigError(f"connect_timeout must be > 0, got {connect_timeout}")
        self._connect_timeout = connect_timeout
        self._revoke_wait = revoke_wait
        self._regions: RegisteredRegions | None = None
        self._grants = FetchGrants()
        self._sink: BlockSink | None = None
        self._endpoint = ""
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._lock = threading.Lock()
        self._links: dict[str, PeerLink] = {}
        self._sessions: set[ServeSession] = set()
        self._handshaking: dict[socket.socket, None] = {}  # accepted, not through the handshake (oldest first)
        self._req_ids = itertools.count(1)
        self._timer = DeadlineTimer()
        self._closed = False
        self._unregistered = False  # between unregister_regions and restore_regions

    # -- what a subclass provides --------------------------------------------------

    @abc.abstractmethod
    def _listen(self, host: str, port: int) -> tuple[socket.socket, str]:
        """Bound, listening socket and this side's endpoint string."""

    @abc.abstractmethod
    def _dial_address(self, endpoint: str) -> tuple[int, Any]:
        """(address family, address) of a peer endpoint; ValueError if malformed."""

    @abc.abstractmethod
    def _new_channel(self) -> BlockChannel:
        """A fresh data channel for one connection."""

    # -- Transport -------------------------------------------------------------------

    def register_regions(self, regions: Sequence[MemoryRegion]) -> None:
        if self._regions is not None:
            raise RuntimeError("register_regions called twice")
        self._regions = RegisteredRegions(regions)

    def start(self, sink: BlockSink, host: str, port: int) -> str:
        if self._regions is None:
            raise RuntimeError("register_regions must be called before start")
        if self._listener is not None:
            raise RuntimeError("start called twice")
        self._sink = sink
        self._listener, self._endpoint = self._listen(host, port)
        self._acceptor = threading.Thread(target=self._accept_loop, name="pd-transport-accept", daemon=True)
        self._acceptor.start()
        logger.info("%s transport serving at %s", self.name, self._endpoint)
        return self._endpoint

    def push(
        self,
        peer: str,
        batch: BlockBatch,
        block_ids: Sequence[int],
        timeout: float,
        answer: bool = True,
        window: BlockWindow | None = None,
    ) -> Future[None]:
        regions = self._require_regions()
        if len(block_ids) != len(batch.positions):
            raise ValueError(f"push: {len(block_ids)} block ids but {len(batch.positions)} positions")
        views = _windowed(regions.views(batch.layer, block_ids), regions.block_nbytes[batch.layer], window)
        expected = window.nbytes if window is not None else regions.block_nbytes[batch.layer]
        if batch.block_nbytes != expected:
            raise ValueError(f"push: batch.block_nbytes {batch.block_nbytes} != the {expected} bytes sent per block")
        frame = Frame(
            Kind.PUSH,
            req_id=next(self._req_ids),
            checksum=self._data_checksum,
            flags=(FLAG_LAST if batch.last else 0) | (0 if answer else FLAG_QUIET),
            layer=batch.layer,
            block_nbytes=batch.block_nbytes,
            transfer_id=batch.transfer_id,
            ids=tuple(batch.positions),
            lengths=tuple(len(v) for v in views),
        )
        return self._submit(peer, frame, timeout, send_views=views)

    def push_layers(
        self,
        peer: str,
        transfer_id: str,
        layers: Sequence[int],
        positions: Sequence[int],
        block_ids: Sequence[int],
        timeout: float,
        last: bool = False,
        window: BlockWindow | None = None,
    ) -> LayerPlan | None:
        regions = self._require_regions()
        if not layers or not block_ids or self._unregistered:
            return None
        if len(block_ids) != len(positions):
            raise ValueError(f"push_layers: {len(block_ids)} block ids but {len(positions)} positions")
        full = regions.block_nbytes[layers[0]]
        if any(regions.block_nbytes[layer] != full for layer in layers):
            return None
        nbytes = window.nbytes if window is not None else full
        try:
            channel = self._link(peer).channel
        except TransportError:
            return None  # push() reports it
        if channel is None or not channel.peer_reads_us:
            # not connected yet (the first push connects), or the peer cannot read us (tcp; the
            # probe failed; shm without a checksum or ordered stores)
            return None
        plan = LayerPlan(
            self._checksum, layers, [_windowed(regions.views(layer, block_ids), full, window) for layer in layers]
        )
        frame = Frame(
            Kind.PLAN,
            req_id=next(self._req_ids),
            checksum=self._checksum,
            flags=FLAG_LAST if last else 0,
            block_nbytes=nbytes,
            transfer_id=transfer_id,
            ids=tuple(positions),
            payload=plan.payload(timeout),
        )
        plan.future = self._submit(peer, frame, timeout, keep=plan)
        return plan

    def fetch(
        self,
        peer: str,
        transfer_id: str,
        layer: int,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        timeout: float,
        spans: FetchSpans | None = None,
    ) -> Future[None]:
        regions = self._require_regions()
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"fetch: {len(remote_block_ids)} remote but {len(local_block_ids)} local ids")
        views = regions.views(layer, local_block_ids)
        payload = b""
        if spans is not None:
            if len(spans) != len(views):
                raise ValueError(f"fetch: {len(spans)} spans for {len(views)} block ids")
            spans.check(MAX_SPAN_SOURCE, regions.block_nbytes[layer])
            views = [v[d : d + n] for v, d, n in zip(views, spans.dst_offsets, spans.lengths, strict=True)]
            payload = encode_fetch_spans(spans.src_offsets, spans.lengths)
        # block_nbytes: our blocks' size, which the peer checks against its own (whole blocks), or 0 (parts)
        frame = Frame(
            Kind.FETCH,
            req_id=next(self._req_ids),
            layer=layer,
            block_nbytes=0 if spans is not None else regions.block_nbytes[layer],
            transfer_id=transfer_id,
            ids=tuple(remote_block_ids),
            payload=payload,
        )
        return self._submit(peer, frame, timeout, recv_views=views)

    def notify(self, peer: str, message: bytes, timeout: float) -> Future[bytes | None]:
        frame = Frame(Kind.NOTIFY, req_id=next(self._req_ids), payload=bytes(message))
        return self._submit(peer, frame, timeout)

    def allow_fetch(
        self, transfer_id: str, block_ids: Sequence[int] | None, served_from: Sequence[int] | None = None
    ) -> None:
        if block_ids is not None:
            self._grants.grant(transfer_id, block_ids, served_from)
            return
        if not self._grants.revoke(transfer_id, self._revoke_wait):
            # A reader stalls mid-read: cut its connection so no byte of these
            # blocks is sent after we return (the blocks may be reused).
            logger.warning(
                "revoke of %r: a read still in flight after %.1fs; closing the serving connections",
                transfer_id,
                self._revoke_wait,
            )
            with self._lock:
                sessions = [s for s in self._sessions if transfer_id in s.serving]
            for s in sessions:
                s.close()
            self._grants.revoke(transfer_id, self._revoke_wait)

    def unregister_regions(self) -> None:
        """Revoke every grant left (a read of memory being unmapped must not start) and close the
        connections we dialled: the peers on their other end drop what our handshake told them
        (nixl: our memory registration), and a later request dials anew."""
        with self._lock:
            if self._unregistered:
                return
            self._unregistered = True
        self._close_links()
        granted = self._grants.transfer_ids()
        if granted:
            logger.warning(
                "%s transport: KV unregistered while %d transfers still granted: revoked", self.name, len(granted)
            )
        for transfer_id in granted:
            self.allow_fetch(transfer_id, None)

    def restore_regions(self) -> None:
        """Also close the connections dialled meanwhile (control messages): their handshake told
        the peer about memory that was not registered then."""
        with self._lock:
            if not self._unregistered:
                return
            self._unregistered = False
        self._close_links()

    def _close_links(self) -> None:
        with self._lock:
            links = list(self._links.values())
            self._links.clear()
        for link in links:
            link.close()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, sessions = list(self._links.values()), list(self._sessions)
            self._links.clear()
        if self._listener is not None:
            try:
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for link in links:
            link.close()
        for s in sessions:
            s.close()
        for s in sessions:
            s.join(timeout=5)
        if self._acceptor is not None:
            self._acceptor.join(timeout=5)
        self._timer.stop()
        self._after_close()

    def _after_close(self) -> None:
        """Subclass hook: release transport-wide resources."""

    # -- internals -------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def refused_connections(self) -> int:
        return self._security.refused

    @property
    def broken_connections(self) -> int:
        return self._security.violations

    def _require_regions(self) -> RegisteredRegions:
        if self._regions is None:
            raise RuntimeError("register_regions must be called first")
        return self._regions

    def _submit(
        self,
        peer: str,
        frame: Frame,
        timeout: float,
        send_views: list[memoryview] | None = None,
        recv_views: list[memoryview] | None = None,
        keep: Any = None,
    ) -> Future[Any]:
        future: Future[Any] = Future()
        future.set_running_or_notify_cancel()  # not cancellable: bytes may be moving
        op = PendingOp(frame, future, time.monotonic() + timeout, send_views or [], recv_views or [], keep=keep)
        if self._unregistered and frame.kind is not Kind.NOTIFY:  # control messages (releases) still go
            settle(future, error=TransferRejected(f"{frame.kind.name}: the KV cache is unregistered (vLLM sleeps)"))
            return future
        try:
            link = self._link(peer)
        except TransportError as e:
            settle(future, error=e)
            return future
        self._timer.add(link, op)
        link.submit(op)
        return future

    def _link(self, peer: str) -> PeerLink:
        with self._lock:
            if self._closed:
                raise PeerClosed("transport is closed")
            link = self._links.get(peer)
            if link is None:
                family, address = self._dial_address(peer)
                link = self._new_link(peer, address, family)
                self._links[peer] = link
            return link

    def _new_link(self, peer: str, address: Any, family: int) -> PeerLink:
        """The dialling side of a connection to ``peer`` (a subclass's own kind of link)."""
        return PeerLink(
            peer, address, family, self._new_channel, self._hello, self._connect_timeout, security=self._security
        )

    def _new_session(self, wire: Wire, channel: BlockChannel, peer: str) -> ServeSession:
        """The serving side of an accepted connection (a subclass's own kind of session)."""
        assert self._sink is not None and self._regions is not None
        return ServeSession(
            wire,
            channel,
            peer,
            self._sink,
            self._regions,
            self._grants,
            self._data_checksum,
            self._session_ended,
            on_violation=self._security.violated,
        )

    def _hello(self, channel: BlockChannel) -> bytes:
        return HelloPayload(self._endpoint, channel.local_info()).encode()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return  # listener closed
            with self._lock:
                self._handshaking[sock] = None
                oldest = None
                if len(self._handshaking) > MAX_PENDING_HANDSHAKES:
                    # out of the count now, not when its thread sees the cut: a busy host would
                    # otherwise cut the same socket again and let the others pile up
                    oldest = next(iter(self._handshaking))
                    del self._handshaking[oldest]
            if oldest is not None:
                logger.warning(
                    "%s: over %d connections in their handshake; cutting the oldest",
                    self.scheme,
                    MAX_PENDING_HANDSHAKES,
                )
                _cut(oldest)
            threading.Thread(
                target=self._open_session, args=(sock, addr), daemon=True, name="pd-transport-handshake"
            ).start()

    def _open_session(self, sock: socket.socket, addr: Any) -> None:
        try:
            self._handshake(sock, addr)
        finally:
            with self._lock:
                self._handshaking.pop(sock, None)

    def _handshake(self, sock: socket.socket, addr: Any) -> None:
        channel: BlockChannel | None = None
        try:
            configure_socket(sock)
            sock.settimeout(self._connect_timeout)
            # both ends prove the deployment secret before a byte of anything else is read
            # (and before a shm ring or a NIXL peer is set up for the connection)
            conn, keys = self._security.accept(sock)
            channel = self._new_channel()
            wire = Wire(conn, channel.frames_only, keys)
            frame = wire.reader.read_frame()
            if frame.kind is not Kind.HELLO:
                raise TransferCorrupted(f"expected HELLO, got {frame.kind.name}")
            hello = HelloPayload.decode(frame.payload)
            channel.attach(hello.channel)
            wire.send_frame(Frame(Kind.HELLO, payload=self._hello(channel)))
            channel.finish_handshake(wire)
            conn.settimeout(None)
        except AuthFailed as e:
            self._security.refuse(f"{self.scheme} {addr}", e)
            _close_quietly(channel, sock)
            return
        except (OSError, TransportError, msgspec.DecodeError, ValueError) as e:
            logger.warning("%s handshake with %s failed: %s", self.scheme, addr, e)
            _close_quietly(channel, sock)
            return
        session = self._new_session(wire, channel, hello.endpoint or f"{self.scheme}://{addr}")
        with self._lock:
            if self._closed:
                session.close()
                channel.close()
                return
            self._sessions.add(session)
        session.start()

    def _session_ended(self, session: ServeSession) -> None:
        with self._lock:
            self._sessions.discard(session)


# the peer checks a part against its own blocks: here only that it is a part of something
MAX_SPAN_SOURCE = 1 << 62


def _windowed(views: list[memoryview], block_nbytes: int, window: BlockWindow | None) -> list[memoryview]:
    """``window`` of each block's view (all of each, without one)."""
    if window is None:
        return views
    window.check(block_nbytes)
    return [v[window.offset : window.offset + window.nbytes] for v in views]


def _cut(sock: socket.socket) -> None:
    """Make a blocked handshake's reads fail now (its thread closes the socket)."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _close_quietly(channel: BlockChannel | None, sock: socket.socket) -> None:
    if channel is not None:
        channel.close()
    sock.close()
