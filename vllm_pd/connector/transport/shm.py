"""Same-host transport: block bytes through POSIX shared memory.

Each connection has two rings in /dev/shm, one per direction, each created by
the side that writes it and announced in the HELLO handshake. A ring is
``slots`` slots of ``slot_nbytes``; the TCP connection (the control channel)
carries the frames plus two tiny flow-control frames: READY (sender filled slot
k with n bytes) and CREDIT (receiver emptied slot k; a PUSH's last slot is
credited on its ACK instead, or - a quiet PUSH having no ACK - with the next
answer, or by a CREDIT once half the ring is owed). The sender fills slot k+1 while the receiver
empties slot k, so the two copies run in parallel on two cores and throughput
approaches one memcpy. Each copy also computes the blocks' checksum on the way
(crc32c: checksum.BlockStream, one native call per slot), and the receiver's copy
writes the destination blocks with non-temporal stores.

Each side unlinks the peer's ring name as soon as it has mapped it (and its own
on close), so a killed process leaves nothing in /dev/shm: the memory goes when
the last mapping does. Endpoint: ``shm://127.0.0.1:port``.
"""

from __future__ import annotations

import mmap
import os
import secrets
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_pd.connector.exceptions import PeerClosed, TransferCorrupted
from vllm_pd.connector.transport.checksum import DIGEST_NBYTES, BlockStream, Checksum
from vllm_pd.connector.transport.framing import Frame, Kind, read_frame
from vllm_pd.connector.transport.tcp import TcpTransport, parse_tcp_endpoint
from vllm_pd.connector.transport.wire import Wire

SHM_DIR = "/dev/shm"
SEGMENT_PREFIX = "vllmpd-"
FLAG_TRAILER = 1  # READY: the batch's last; payload = the digests (ids: its last slot, if any)


class ShmRing:
    """``slots`` x ``slot_nbytes`` bytes of shared memory, mapped in this process."""

    def __init__(self, name: str, slots: int, slot_nbytes: int, create: bool) -> None:
        self.name, self.slots, self.slot_nbytes = name, slots, slot_nbytes
        path = os.path.join(SHM_DIR, name)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, slots * slot_nbytes)
            elif os.fstat(fd).st_size != slots * slot_nbytes:
                raise TransferCorrupted(f"shm ring {name}: size differs from the announced one")
            # Never closed explicitly: memoryviews of it may still be in use by a
            # thread that is about to notice the connection died; GC unmaps it.
            self._map = mmap.mmap(fd, slots * slot_nbytes)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8).reshape(slots, slot_nbytes)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class RingCredits:
    """Free slots of the ring this side writes (a semaphore that can say how many)."""

    def __init__(self, slots: int) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._free = slots

    def available(self) -> int:
        return self._free

    def acquire(self) -> None:
        with self._cond:
            while self._free == 0:
                self._cond.wait()
            self._free -= 1

    def release(self, n: int = 1) -> None:
        with self._cond:
            self._free += n
            self._cond.notify(n)


class ShmChannel:
    """Block bytes of one connection through two shared-memory rings."""

    # Test-only fault injection: called with each filled slot before READY.
    fault_hook: Any = None

    def __init__(self, slots: int, slot_nbytes: int) -> None:
        self._tx = ShmRing(f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", slots, slot_nbytes,
                           create=True)
        self._rx: ShmRing | None = None
        self._credits = RingCredits(slots)
        # Slots are filled strictly round-robin across messages and emptied in
        # READY order, so holding a credit means the next slot is free.
        self._next_slot = 0
        self._closed = False
        # The last slot of a received PUSH is credited on the PUSH's ACK, not by a CREDIT
        # frame of its own: one message (and one wake-up of the sender) fewer per batch.
        self._owed: tuple[int, ...] = ()

    def fits_now(self, wire: Wire, nbytes: int) -> bool:
        return -(-nbytes // self._tx.slot_nbytes) <= self._credits.available()

    def local_info(self) -> dict[str, Any]:
        return {"ring": self._tx.name, "slots": self._tx.slots, "slot_nbytes": self._tx.slot_nbytes}

    def attach(self, remote_info: dict[str, Any]) -> None:
        try:
            name, slots, slot_nbytes = remote_info["ring"], remote_info["slots"], remote_info["slot_nbytes"]
        except KeyError as e:
            raise TransferCorrupted(f"shm handshake without {e}") from None
        if not str(name).startswith(SEGMENT_PREFIX) or "/" in str(name):
            raise TransferCorrupted(f"shm handshake: bad ring name {name!r}")
        self._rx = ShmRing(str(name), int(slots), int(slot_nbytes), create=False)
        self._rx.unlink()  # both sides map it now; the name is no longer needed

    # -- sending -------------------------------------------------------------------

    def send_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> None:
        tx = self._tx
        # Each block is hashed by the copy that puts it in the ring: one read of it.
        stream = BlockStream(frame.checksum, views)
        slot = self._next_slot
        # Control frames go out together where they can: the header with the first READY,
        # the digests with the last one, so a batch that fits a slot is one write and one
        # wake-up of the receiver (per-batch overhead is what small per-layer pushes pay).
        pending: list[Frame] = [frame]
        while True:
            ids: tuple[int, ...] = ()  # the slot just filled (none for a batch of no bytes)
            lengths: tuple[int, ...] = ()
            if not stream.done:
                self._take_credit()
                n = stream.fill(tx.array[slot])
                if self.fault_hook is not None:
                    self.fault_hook(tx.array[slot, :n])
                ids, lengths, slot = (slot,), (n,), (slot + 1) % tx.slots
            if stream.done:
                pending.append(Frame(Kind.READY, flags=FLAG_TRAILER, ids=ids, lengths=lengths,
                                     payload=stream.digests()))
                break
            pending.append(Frame(Kind.READY, ids=ids, lengths=lengths))
            wire.send_frames(pending)
            pending = []
        self._next_slot = slot
        wire.send_frames(pending)

    def _take_credit(self) -> None:
        self._credits.acquire()
        if self._closed:
            self._credits.release()  # wake the next waiter too
            raise PeerClosed("shm channel closed")

    def on_credit(self, frame: Frame) -> None:
        if frame.ids:
            self._credits.release(len(frame.ids))

    def take_owed_credits(self) -> tuple[int, ...]:
        owed, self._owed = self._owed, ()
        return owed

    # -- receiving -----------------------------------------------------------------

    def recv_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> bool:
        return self._receive(wire, frame, views)

    def drop_blocks(self, wire: Wire, frame: Frame) -> None:
        self._receive(wire, frame, None)

    def _receive(self, wire: Wire, frame: Frame, views: Sequence[memoryview] | None) -> bool:
        rx = self._rx
        if rx is None:
            raise PeerClosed("shm channel not attached")
        # The bytes are hashed as they leave the ring (the copy reads them once), so what is
        # verified is exactly what landed in the destination.
        stream = BlockStream(frame.checksum, views) if views is not None else None
        expected, got = sum(frame.lengths), 0
        while True:
            f = read_frame(wire.sock)
            if f.kind is Kind.CREDIT:
                self.on_credit(f)
                continue
            if f.kind is not Kind.READY:
                raise TransferCorrupted(f"expected READY in a block stream, got {f.kind.name}")
            if f.ids:  # a filled slot (the trailer may carry the last one)
                slot, n = f.ids[0], f.lengths[0]
                if not 0 <= slot < rx.slots or n > rx.slot_nbytes:
                    raise TransferCorrupted(f"READY for slot {slot} of {n} bytes is out of the ring")
                if got + n > expected:
                    raise TransferCorrupted("more block bytes than the frame announced")
                if stream is not None:
                    stream.drain(rx.array[slot, :n])
                got += n
                if f.flags & FLAG_TRAILER and frame.kind is Kind.PUSH:
                    self._owed += (slot,)  # the session's next ACK carries it
                    if len(self._owed) >= max(1, rx.slots // 2):  # quiet pushes: do not starve the sender
                        wire.send_frame(Frame(Kind.CREDIT, ids=self.take_owed_credits()))
                else:
                    wire.send_frame(Frame(Kind.CREDIT, ids=(slot,)))
            if f.flags & FLAG_TRAILER:
                break
        if got != expected:
            raise TransferCorrupted(f"block stream ended after {got} of {expected} bytes")
        if len(f.payload) != DIGEST_NBYTES * len(frame.lengths):
            raise TransferCorrupted("trailer has the wrong number of digests")
        if stream is None or frame.checksum is Checksum.NONE:
            return True
        return stream.digests() == f.payload

    def close(self) -> None:
        self._closed = True
        self._tx.unlink()
        self._credits.release(self._tx.slots + 1)


class ShmTransport(TcpTransport):
    """Stream transport whose block bytes go through /dev/shm (same host only)."""

    name = "shm"
    scheme = "shm"

    def __init__(self, slots: int = 4, slot_nbytes: int = 4 << 20, **options: Any) -> None:
        super().__init__(**options)
        if slots < 2:
            raise ValueError(f"slots must be >= 2 (pipelining), got {slots}")
        if slot_nbytes < 4096:
            raise ValueError(f"slot_nbytes must be >= 4096, got {slot_nbytes}")
        self._slots, self._slot_nbytes = slots, slot_nbytes

    def _listen(self, host: str, port: int):
        sock, endpoint = super()._listen(host, port)
        return sock, "shm://" + endpoint.removeprefix("tcp://")

    def _dial_address(self, endpoint: str):
        if not endpoint.startswith("shm://"):
            raise ValueError(f"bad shm endpoint {endpoint!r} (expected shm://host:port)")
        return super()._dial_address("tcp://" + endpoint.removeprefix("shm://"))

    def _new_channel(self) -> ShmChannel:
        return ShmChannel(self._slots, self._slot_nbytes)


__all__ = ["ShmChannel", "ShmRing", "ShmTransport", "parse_tcp_endpoint"]
