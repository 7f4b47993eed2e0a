"""NIXL transport: block bytes move by NIXL (UCX) one-sided reads and writes between
the two processes' registered regions; requests and answers travel on a TCP control
connection - the stream transports' framing, links and sessions (stream.py), so order,
quiet pushes, timeouts, grants and failures behave as on tcp. Endpoint: ``nixl://host:port``
(the control port).

Regions are registered with this process's NIXL agent where they are: host memory as
DRAM, CUDA tensors as VRAM (nothing is staged through host memory). Agent metadata and
every region's layout travel in our own handshake (no etcd, no NIXL side channel): the
dialler's HELLO carries them, the accepting side loads them and reads a probe token from
the dialler's memory with NIXL - which also sets up UCX's connection - before it answers.
On each connection the *accepting* side posts every transfer; the dialler's memory is the
target:

* push - the PUSH message names the sender's blocks (and their checksums); the receiver
  asks its sink for destinations, registers those not inside its own regions, and READs
  the blocks from the sender's registered regions into them, then verifies and answers.
  One message and one READ: the alternative (the receiver registers the destinations and
  sends their keys back, the sender WRITEs and says done) costs one more round trip plus a
  metadata export and import (docs/benchmarks/transfer.md, "NIXL transport (CPU)"). Not yet
  measured on GPUs: a GPU sender's blocks are then READ into the sink's host buffers, and
  on one host UCX's cuda_ipc is slow to READ (vLLM issue #52607).
* fetch - the FETCH message names the requester's destination blocks; the owner checks its
  grant, WRITEs its blocks into the requester's regions (WRITE: the fast direction of
  cuda_ipc on one host) and answers once the WRITE completed, with the checksums. The owner
  controls when its bytes leave, so a revoke (``allow_fetch(transfer_id, None)``) waits for the
  WRITEs in flight and nothing is read from its blocks after it returns. A fetch whose
  deadline passes while the owner has it is cancelled, not dropped: the requester sends a
  cancel and waits up to ``revoke_wait`` more for the owner's answer (so no WRITE lands in
  blocks it has handed back), then cuts the connection.

Checksums (``checksum``, crc32c by default) are taken by the side that owns host memory:
the sender/owner digests its blocks, the receiver verifies the landed bytes before
``landed(ok=True)`` / resolving the fetch. GPU regions cannot be digested on the host:
the transport then falls back to ``checksum="none"`` (one warning) and relies on the
link's own integrity checks (RDMA ICRC, NVLink CRC). Lengths are always checked.

No NIXL progress thread (see nixl_agent.py): the thread that posted a transfer polls it,
and a dialler whose memory the peer accesses through messages (UCX's connection set-up;
tcp between hosts) progresses its agent while its requests are outstanding
(``target_progress``: "auto" = unless the handshake found one-sided access - same host,
cross-memory attach allowed and host memory -; "always"; "never" for RDMA links).
``push_layers`` returns None (layer plans are shm's).
"""

from __future__ import annotations

import base64
import os
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import msgspec
import numpy as np

from vllm_pd.connector.transport import cross_memory
from vllm_pd.connector.transport.base import BlockBatch, BlockWindow, FetchSpans, MemoryRegion
from vllm_pd.connector.transport.checksum import block_digest
from vllm_pd.connector.transport.nixl_agent import LocalAgent, ProgressPump
from vllm_pd.connector.transport.nixl_regions import BlockRef, NixlRegions, block_pairs, merge_pairs
from vllm_pd.connector.transport.peer_link import PeerLink, PendingOp, settle
from vllm_pd.connector.transport.serve_session import ServeSession
from vllm_pd.connector.transport.stream import DeadlineTimer
from vllm_pd.connector.transport.tcp import TcpTransport
from vllm_pd.connector.transport.wire import Wire
from vllm_pd.errors import (
    ConfigError,
    PeerClosed,
    ProtocolError,
    TransferCorrupted,
    TransferRejected,
    TransferTimeout,
    TransportError,
)
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.frames import FLAG_CANCEL, FLAG_LAST, FLAG_QUIET, Checksum, Frame, Kind, Status
from vllm_pd.protocol.nixl_messages import DRAM, FetchPayload, PushPayload, RegionLayout
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

TARGET_PROGRESS = ("auto", "always", "never")
# Room a request needs in the socket's send buffer to go out from the caller's thread.
CONTROL_ROOM = 64 << 10


def _u32(ids: np.ndarray) -> bytes:
    return np.asarray(ids, dtype=np.uint32).tobytes()


@dataclass
class NixlSide:
    """What every connection of one transport shares."""

    target_progress: str
    connect_timeout: float
    agent: LocalAgent | None = None  # None: a client that only notifies (no regions)
    regions: NixlRegions | None = None
    region_handles: list[Any] = field(default_factory=list)  # the regions' registrations (none while unregistered)
    pump: ProgressPump | None = None


class NixlChannel:
    """The data path of one control connection: NIXL transfers instead of bytes on the socket."""

    frames_only = False  # (no block byte travels on the socket, but its readers need not spin for the next frame)
    peer_memory = None
    peer_reads_us = False  # no layer plans

    def __init__(self, side: NixlSide, dialler: bool) -> None:
        self._side = side
        self._dialler = dialler
        # dialler: whether to progress our agent while a request is out (until the handshake says)
        self.needs_target_progress = True
        self._pumping = False
        self._peer: str | None = None  # accepting side: the dialler's agent, loaded
        self._peer_layouts: list[RegionLayout] = []
        self._one_sided = False

    # -- handshake ------------------------------------------------------------------------

    def local_info(self) -> dict[str, Any]:
        agent, regions = self._side.agent, self._side.regions
        if not self._dialler:
            return {"agent": agent.name if agent else "", "one_sided": self._one_sided}
        if agent is None or regions is None:
            return {}
        if not self._pumping and self._side.pump is not None:
            self._pumping = True  # the peer sets up UCX's connection to us before it answers
            self._side.pump.hold()
        address, token = agent.probe
        return {
            "agent": agent.name,
            "metadata": base64.b64encode(agent.metadata()).decode(),
            "probe": address,
            "token": token.hex(),
            "layers": [msgspec.to_builtins(lay) for lay in regions.layouts],
            "cross_memory": cross_memory.local_info(),
        }

    def attach(self, remote: dict[str, Any]) -> None:
        if self._dialler:
            mode = self._side.target_progress
            self.needs_target_progress = mode == "always" or (mode == "auto" and not remote.get("one_sided"))
            self._stop_pumping()
            return
        agent = self._side.agent
        if agent is None or not remote.get("metadata"):
            self._one_sided = True  # a client that only notifies: nothing of it is accessed
            return
        try:
            metadata = base64.b64decode(remote["metadata"])
            layouts = msgspec.convert(remote["layers"], list[RegionLayout])
            address, token = int(remote["probe"]), bytes.fromhex(remote["token"])
        except (KeyError, TypeError, ValueError, msgspec.ValidationError) as e:
            raise TransferCorrupted(f"nixl handshake: bad HELLO ({e})") from None
        self._peer = agent.load_peer(metadata)
        got = agent.read_probe(self._peer, address, time.monotonic() + self._side.connect_timeout)
        if got[: len(token)] != token:
            raise TransferCorrupted("nixl handshake: the probe read back another token")
        self._peer_layouts = layouts
        self._one_sided = (
            agent.cma
            and all(lay.mem == DRAM for lay in layouts)
            and cross_memory.PeerMemory.probe(remote.get("cross_memory")) is not None
        )

    def finish_handshake(self, wire: Wire) -> None:
        pass

    # -- BlockChannel -----------------------------------------------------------------------

    def fits_now(self, wire: Wire, nbytes: int) -> bool:
        return wire.has_room(nbytes + CONTROL_ROOM)

    def send_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> None:
        raise TypeError("nixl moves no block bytes on the control connection")

    def recv_blocks(self, wire: Wire, frame: Frame, views: Sequence[Any]) -> bool:
        if frame.kind is Kind.PUSH:
            return self._read_pushed(frame, views)
        return self._verify_fetched(frame, views)

    def drop_blocks(self, wire: Wire, frame: Frame) -> None:
        pass  # nothing of a refused request is on the socket

    def on_credit(self, frame: Frame) -> None:
        raise ProtocolError("CREDIT frame on a nixl connection")

    def close(self) -> None:
        self._stop_pumping()
        peer, self._peer = self._peer, None
        if peer is not None and self._side.agent is not None:
            self._side.agent.unload_peer(peer)

    # -- the transfers (accepting side) -------------------------------------------------------

    def _read_pushed(self, frame: Frame, views: Sequence[memoryview]) -> bool:
        """READ a pushed batch from the sender's regions into the sink's ``views``; True if
        every block's checksum matched."""
        agent, regions, peer = self._side.agent, self._side.regions, self._peer
        if agent is None or regions is None or peer is None:
            raise TransferRejected("push over nixl from a peer without a NIXL agent")
        payload = _decode(frame.payload, PushPayload)
        layout = self._peer_layout(frame.layer)
        ids = _peer_ids(layout, payload.block_ids, "the sender's")
        n = len(views)
        dests = np.array([cross_memory.address_of(v) for v in views], dtype=np.int64)
        if payload.windowed:
            # a window of each block: one span of the sender's (head-major pages are one span a block)
            end = payload.window_offset + frame.block_nbytes
            if len(ids) != n or len(layout.lengths) != 1 or payload.window_offset < 0 or end > layout.block_nbytes:
                raise TransferCorrupted(
                    f"push of a window [{payload.window_offset}, {end}) of {len(ids)} blocks of "
                    f"{layout.block_nbytes} bytes in {len(layout.lengths)} span(s), announced "
                    f"as {n}"
                )
            local, remote = dests, layout.spans(ids)[0] + payload.window_offset
            lengths = np.full(n, frame.block_nbytes, dtype=np.int64)
            inside = regions.host_segments(dests, frame.block_nbytes)
        else:
            if len(ids) != n or layout.block_nbytes != frame.block_nbytes:
                raise TransferCorrupted(
                    f"push of {len(ids)} blocks of {layout.block_nbytes} bytes announced as {n} of {frame.block_nbytes}"
                )
            local = (dests[None, :] + layout.wire_offsets()[:, None]).reshape(-1)
            remote = layout.spans(ids).reshape(-1)
            lengths = np.repeat(np.asarray(layout.lengths, dtype=np.int64), n)
            inside = np.tile(regions.host_segments(dests, layout.block_nbytes), len(layout.lengths))
        local, remote, lengths = merge_pairs(local, remote, lengths, inside)
        # destinations outside our regions (the sink's staging) are registered for this READ
        fresh = regions.host_segments(local, lengths) < 0
        handle = agent.register(local[fresh], lengths[fresh], DRAM, 0) if fresh.any() else None
        try:
            agent.transfer(
                "READ",
                local,
                lengths,
                DRAM,
                0,
                remote,
                layout.mem,
                layout.device,
                peer,
                time.monotonic() + payload.timeout_s,
            )
        finally:
            if handle is not None:
                agent.deregister(handle)
        if frame.checksum is Checksum.NONE:
            return True
        return bool(b"".join(block_digest(frame.checksum, v) for v in views) == payload.digests)

    def write_fetched(self, frame: Frame, checksum: Checksum) -> tuple[bytes, tuple[int, ...]]:
        """WRITE the blocks (or parts) a FETCH asks for into the requester's regions; their
        digests and lengths."""
        agent, regions, peer = self._side.agent, self._side.regions, self._peer
        if agent is None or regions is None or peer is None:
            raise TransferRejected("fetch over nixl from a peer without a NIXL agent")
        payload = _decode(frame.payload, FetchPayload)
        layout, theirs = regions.layout(frame.layer), self._peer_layout(frame.layer)
        own = regions.check_ids(frame.layer, frame.ids)
        dest = _peer_ids(theirs, payload.block_ids, "the requester's")
        if len(dest) != len(own):
            raise TransferCorrupted(f"fetch of {len(own)} blocks into {len(dest)}")
        parts = payload.spans(len(own))
        if parts is not None:
            src_off, dst_off, part_lengths = parts
            if len(layout.lengths) != 1 or len(theirs.lengths) != 1:
                raise TransferRejected(f"layer {frame.layer}: parts of blocks move between blocks of one span each")
            if ((src_off + part_lengths) > layout.block_nbytes).any() or (
                (dst_off + part_lengths) > theirs.block_nbytes
            ).any():
                raise TransferRejected(f"layer {frame.layer}: a part lies outside the blocks")
            digests = regions.part_digests(frame.layer, own, src_off, part_lengths, checksum)
            sizes = tuple(part_lengths.tolist())
            local, remote, lengths = merge_pairs(
                layout.spans(own)[0] + src_off, theirs.spans(dest)[0] + dst_off, part_lengths
            )
        else:
            if theirs.block_nbytes != layout.block_nbytes:
                raise TransferRejected(
                    f"layer {frame.layer}: the requester's blocks are {theirs.block_nbytes} "
                    f"bytes, ours {layout.block_nbytes}"
                )
            digests = regions.digests(frame.layer, own, checksum)
            sizes = (layout.block_nbytes,) * len(own)
            local, remote, lengths = block_pairs(layout, own, theirs, dest)
        agent.transfer(
            "WRITE",
            local,
            lengths,
            layout.mem,
            layout.device,
            remote,
            theirs.mem,
            theirs.device,
            peer,
            time.monotonic() + payload.timeout_s,
        )
        return digests, sizes

    # -- dialling side -------------------------------------------------------------------------

    def _verify_fetched(self, frame: Frame, views: Sequence[Any]) -> bool:
        """The owner's WRITE has landed: check our blocks against its digests."""
        regions = self._side.regions
        if frame.checksum is Checksum.NONE or not views or regions is None:
            return True
        layer = views[0].layer
        if regions.layouts[layer].mem != DRAM:
            return True  # GPU memory: the link's integrity checks are all there is
        ids = np.array([v.block_id for v in views], dtype=np.int64)
        if any(v.offset or v.nbytes != regions.block_nbytes[layer] for v in views):
            offsets = np.array([v.offset for v in views], dtype=np.int64)
            lengths = np.array([v.nbytes for v in views], dtype=np.int64)
            return regions.part_digests(layer, ids, offsets, lengths, frame.checksum) == frame.payload
        return regions.digests(layer, ids, frame.checksum) == frame.payload

    def _peer_layout(self, layer: int) -> RegionLayout:
        if not 0 <= layer < len(self._peer_layouts):
            raise TransferCorrupted(f"layer {layer}: the peer registered {len(self._peer_layouts)} regions")
        return self._peer_layouts[layer]

    def _stop_pumping(self) -> None:
        if self._pumping and self._side.pump is not None:
            self._pumping = False
            self._side.pump.release()


def _decode(payload: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.msgpack.decode(payload, type=kind)
    except msgspec.DecodeError as e:
        raise TransferCorrupted(f"bad {kind.__name__}: {e}") from None


def _peer_ids(layout: RegionLayout, raw: bytes, whose: str) -> np.ndarray:
    if len(raw) % 4:
        raise TransferCorrupted(f"{whose} block ids: {len(raw)} bytes")
    try:
        return layout.check_ids(np.frombuffer(raw, dtype=np.uint32), f"{whose} layer")
    except ValueError as e:
        raise TransferCorrupted(str(e)) from None


class NixlServeSession(ServeSession):
    """ServeSession whose fetches are WRITEs into the requester's regions (and can be cancelled)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._cancel_lock = threading.Lock()
        self._cancelled: set[int] = set()  # req_ids of FETCHes withdrawn before we served them

    def _on_fetch(self, frame: Frame) -> None:
        if frame.flags & FLAG_CANCEL:
            with self._cancel_lock:
                self._cancelled.add(frame.req_id)
            return
        super()._on_fetch(frame)

    def _parts(self, frame: Frame, views: list[Any], block_nbytes: int) -> list[Any]:
        """Parts are read from the FETCH's own payload when it is served (write_fetched)."""
        return views

    def _serve_fetch(self, frame: Frame, views: Sequence[Any]) -> None:
        why = self._grants.begin_serve(frame.transfer_id, frame.ids)
        if why is not None:
            self._answer(frame, Status.REJECTED, why)
            return
        self.serving.add(frame.transfer_id)
        try:
            with self._cancel_lock:
                cancelled = frame.req_id in self._cancelled
                self._cancelled.discard(frame.req_id)
            if cancelled or self._closed.is_set():
                self._answer(frame, Status.REJECTED, "cancelled by the requester (past its deadline)")
                return
            assert isinstance(self._channel, NixlChannel)
            try:
                digests, sizes = self._channel.write_fetched(frame, self._checksum)
            except TransferRejected as e:
                self._answer(frame, Status.REJECTED, str(e))
                return
            except PeerClosed:
                raise  # the requester is gone: so is this session
            except TransportError as e:
                self._answer(frame, Status.ERROR, str(e))
                return
            self.wire.send_frame(
                Frame(
                    Kind.DATA,
                    req_id=frame.req_id,
                    checksum=self._checksum if digests else Checksum.NONE,
                    layer=frame.layer,
                    block_nbytes=frame.block_nbytes,
                    transfer_id=frame.transfer_id,
                    ids=frame.ids,
                    lengths=sizes,
                    payload=digests,
                )
            )
        finally:
            with self._cancel_lock:
                self._cancelled.discard(frame.req_id)  # a cancel that came while we served it
            self.serving.discard(frame.transfer_id)
            self._grants.end_serve(frame.transfer_id)

    def _answer(self, frame: Frame, status: Status, text: str) -> None:
        """An ACK sent now (we are the writer thread)."""
        self.wire.send_frame(Frame(Kind.ACK, req_id=frame.req_id, status=status, payload=text.encode()))


class NixlPeerLink(PeerLink):
    """PeerLink whose fetches, once at the owner, are cancelled at their deadline rather than
    dropped: the owner may be WRITEing into our blocks, so the fetch settles only once it has
    answered (or after ``cancel_wait`` more, by cutting the connection)."""

    def __init__(self, *args: Any, timer: DeadlineTimer, cancel_wait: float, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._timer = timer
        self._cancel_wait = cancel_wait
        self._cancelled: set[int] = set()

    def expire(self, op: PendingOp) -> None:
        if op.frame.kind is not Kind.FETCH:
            super().expire(op)
            return
        with self._lock:
            at_owner = self._pending.get(op.req_id) is op and op.state == "sent"
            wire = self._wire
            first = op.req_id not in self._cancelled
            if at_owner and wire is not None:
                if first:
                    self._cancelled.add(op.req_id)
                    op.deadline = time.monotonic() + self._cancel_wait
                else:
                    op.timed_out = True  # _lost fails it with TransferTimeout
        if not at_owner or wire is None:
            super().expire(op)
        elif first:
            try:
                wire.send_frame(
                    Frame(Kind.FETCH, req_id=op.req_id, flags=FLAG_CANCEL, transfer_id=op.frame.transfer_id)
                )
            except OSError:
                pass  # the connection is going: losing it fails the fetch
            self._timer.add(self, op)
        else:
            logger.warning(
                "fetch %r from %s: no answer %.1fs after its cancel; closing the connection",
                op.frame.transfer_id,
                self.endpoint,
                self._cancel_wait,
            )
            wire.shutdown()

    def _on_answer(self, frame: Frame) -> None:
        with self._lock:
            cancelled = frame.req_id in self._cancelled
            self._cancelled.discard(frame.req_id)
            op = self._pending.pop(frame.req_id, None) if cancelled and frame.status is not Status.OK else None
            covered = self._covered_by(op) if op is not None else []
        for q in covered:
            settle(q.future, None)
        if op is not None:
            settle(
                op.future,
                error=TransferTimeout(f"FETCH to {self.endpoint} timed out: {frame.payload.decode(errors='replace')}"),
            )
        elif not cancelled or frame.status is Status.OK:
            super()._on_answer(frame)

    def _on_data(self, wire: Wire, channel: Any, frame: Frame) -> None:
        with self._lock:
            self._cancelled.discard(frame.req_id)
        super()._on_data(wire, channel, frame)

    def _fail_all(self, error: BaseException) -> None:
        super()._fail_all(error)
        with self._lock:
            self._cancelled.clear()


class NixlTransport(TcpTransport):
    """Transport moving blocks with NIXL; see the module docstring."""

    name = "nixl"
    scheme = "nixl"
    device_memory = True  # registers VRAM itself: GPU KV is not staged through host memory
    keyed_blocks = False  # blocks move by RDMA, which we cannot key; the control connection is sealed

    def __init__(
        self,
        checksum: str = "crc32c",
        connect_timeout: float = 5.0,
        revoke_wait: float = 5.0,
        target_progress: str = "auto",
        secret: DeploymentSecret | None = None,
    ) -> None:
        if target_progress not in TARGET_PROGRESS:
            raise ConfigError(f"target_progress: {target_progress!r} is not one of {list(TARGET_PROGRESS)}")
        super().__init__(checksum=checksum, connect_timeout=connect_timeout, revoke_wait=revoke_wait, secret=secret)
        self._side = NixlSide(target_progress, connect_timeout)

    def register_regions(self, regions: Sequence[MemoryRegion]) -> None:
        if self._side.regions is not None:
            raise RuntimeError("register_regions called twice")
        kv = NixlRegions(regions)
        if kv.has_vram and self._checksum is not Checksum.NONE:
            logger.warning(
                "transport nixl: checksum %r cannot be taken of GPU memory on the host; blocks go "
                "unchecked (checksum 'none'), relying on the link's integrity (RDMA ICRC, NVLink CRC)",
                self._checksum.name.lower(),
            )
            self._checksum = Checksum.NONE
        agent = LocalAgent(f"vllm-pd-{os.getpid()}-{secrets.token_hex(4)}", host_only=not kv.has_vram)
        try:
            handles = agent.register_spans(kv.registrations)
        except BaseException:
            agent.close()
            raise
        self._side.agent, self._side.regions, self._side.pump = agent, kv, ProgressPump(agent.progress)
        self._side.region_handles = handles
        self._regions = kv  # type: ignore[assignment]  # what ServeSession checks fetches against

    def unregister_regions(self) -> None:
        """Also deregister the regions from NIXL: its registration (the NIC's, for RDMA) pins the
        old physical pages. The links closed first make peers drop our agent, keys and all."""
        super().unregister_regions()
        agent, handles = self._side.agent, self._side.region_handles
        self._side.region_handles = []
        for handle in handles:
            assert agent is not None
            agent.deregister(handle)

    def restore_regions(self) -> None:
        """Register the regions again (the new pages): peers dialled from now on get our agent's
        new metadata in the handshake."""
        agent, kv = self._side.agent, self._side.regions
        if agent is not None and kv is not None and not self._side.region_handles:
            self._side.region_handles = agent.register_spans(kv.registrations)
        super().restore_regions()

    # -- endpoints -------------------------------------------------------------------------------

    def _listen(self, host: str, port: int) -> tuple[socket.socket, str]:
        sock, endpoint = super()._listen(host, port)
        return sock, f"{self.scheme}://{endpoint.removeprefix('tcp://')}"

    def _dial_address(self, endpoint: str) -> tuple[int, Any]:
        if not endpoint.startswith("nixl://"):
            raise ConfigError(f"bad nixl endpoint {endpoint!r} (expected nixl://host:port)")
        return super()._dial_address(f"tcp://{endpoint.removeprefix('nixl://')}")

    def _new_channel(self) -> NixlChannel:
        return NixlChannel(self._side, dialler=False)

    # -- Transport ------------------------------------------------------------------------------

    def push(
        self,
        peer: str,
        batch: BlockBatch,
        block_ids: Sequence[int],
        timeout: float,
        answer: bool = True,
        window: BlockWindow | None = None,
    ) -> Future[None]:
        regions = self._kv()
        if len(block_ids) != len(batch.positions):
            raise ValueError(f"push: {len(block_ids)} block ids but {len(batch.positions)} positions")
        ids = regions.check_ids(batch.layer, block_ids)
        full = regions.block_nbytes[batch.layer]
        if window is not None:
            window.check(full)
            if len(regions.layout(batch.layer).lengths) != 1:
                raise ValueError(f"push: a window of layer {batch.layer}'s blocks, which lie in several spans")
        expected = window.nbytes if window is not None else full
        if batch.block_nbytes != expected:
            raise ValueError(f"push: batch.block_nbytes {batch.block_nbytes} != the {expected} bytes sent per block")
        if window is not None:
            offsets = np.full(len(ids), window.offset, dtype=np.int64)
            digests = regions.part_digests(
                batch.layer, ids, offsets, np.full(len(ids), window.nbytes, dtype=np.int64), self._checksum
            )
        else:
            digests = regions.digests(batch.layer, ids, self._checksum)
        frame = Frame(
            Kind.PUSH,
            req_id=next(self._req_ids),
            checksum=self._checksum if digests else Checksum.NONE,
            flags=(FLAG_LAST if batch.last else 0) | (0 if answer else FLAG_QUIET),
            layer=batch.layer,
            block_nbytes=batch.block_nbytes,
            transfer_id=batch.transfer_id,
            ids=tuple(batch.positions),
            lengths=(batch.block_nbytes,) * len(ids),
            payload=msgspec.msgpack.encode(
                PushPayload(_u32(ids), digests, timeout, window.offset if window is not None else 0, window is not None)
            ),
        )
        return self._request(peer, frame, timeout)

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
    ) -> None:
        return None

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
        regions = self._kv()
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"fetch: {len(remote_block_ids)} remote but {len(local_block_ids)} local ids")
        blocks = regions.views(layer, local_block_ids)
        local_ids = _u32(regions.check_ids(layer, local_block_ids))
        if spans is None:
            payload = FetchPayload(local_ids, timeout)
        else:
            if len(spans) != len(blocks):
                raise ValueError(f"fetch: {len(spans)} spans for {len(blocks)} block ids")
            spans.check(1 << 62, regions.block_nbytes[layer])
            blocks = [
                BlockRef(b.layer, b.block_id, n, d)
                for b, d, n in zip(blocks, spans.dst_offsets, spans.lengths, strict=True)
            ]
            payload = FetchPayload(
                local_ids,
                timeout,
                *(
                    np.asarray(a, dtype=np.uint64).tobytes()
                    for a in (spans.src_offsets, spans.dst_offsets, spans.lengths)
                ),
            )
        frame = Frame(
            Kind.FETCH,
            req_id=next(self._req_ids),
            layer=layer,
            block_nbytes=regions.block_nbytes[layer],
            transfer_id=transfer_id,
            ids=tuple(remote_block_ids),
            payload=msgspec.msgpack.encode(payload),
        )
        return self._request(peer, frame, timeout, blocks)

    # -- internals -------------------------------------------------------------------------------

    def _kv(self) -> NixlRegions:
        if self._side.regions is None:
            raise RuntimeError("register_regions must be called first")
        return self._side.regions

    def _request(self, peer: str, frame: Frame, timeout: float, blocks: list[BlockRef] | None = None) -> Future[Any]:
        """Submit a request the peer serves by accessing our memory: our agent is progressed
        until it is answered where the link needs that (see NixlChannel.needs_target_progress)."""
        future = self._submit(peer, frame, timeout, recv_views=blocks)  # type: ignore[arg-type]
        pump = self._side.pump
        if pump is not None and not future.done():
            link = self._links.get(peer)
            channel = link.channel if link is not None else None
            if channel is None or getattr(channel, "needs_target_progress", True):
                pump.hold()
                future.add_done_callback(lambda _: pump.release())
        return future

    def _new_link(self, peer: str, address: Any, family: int) -> PeerLink:
        return NixlPeerLink(
            peer,
            address,
            family,
            lambda: NixlChannel(self._side, dialler=True),
            self._hello,
            self._connect_timeout,
            timer=self._timer,
            cancel_wait=self._revoke_wait,
            security=self._security,
        )

    def _new_session(self, wire: Wire, channel: Any, peer: str) -> ServeSession:
        assert self._sink is not None and self._regions is not None
        return NixlServeSession(
            wire,
            channel,
            peer,
            self._sink,
            self._regions,
            self._grants,
            self._checksum,
            self._session_ended,
            on_violation=self._security.violated,
        )

    def _after_close(self) -> None:
        if self._side.pump is not None:
            self._side.pump.stop()
        if self._side.agent is not None:
            self._side.agent.close()
            self._side.agent = None
