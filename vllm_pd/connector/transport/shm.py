"""Same-host transport: block bytes through POSIX shared memory.

Each connection has two rings in /dev/shm, one per direction, each created by
the side that writes it and announced in the HELLO handshake (their layout: protocol/shm_ring.py). A ring is
``slots`` slots of ``slot_nbytes`` plus a small control area; the TCP connection
(the control channel) carries the frames plus READY (sender filled slot k with n
bytes). The sender fills slot k+1 while the receiver empties slot k, so the two
copies run in parallel on two cores and throughput approaches one memcpy. Each
copy also computes the blocks' checksum on the way (crc32c: checksum.BlockStream,
one native call per slot), and the receiver's copy writes the destination blocks
with non-temporal stores.

Flow control lives in the ring's control area, not on the socket: the receiver
counts the slots it has emptied (``consumed``), the sender reads that count before
filling a slot. Only a sender that finds the ring full asks to be woken: it writes
the count it waits for (``wanted``, half the ring free) and sleeps; the receiver
sends a CREDIT frame (a bare wake-up) when its count reaches that value. Each
control-frame write wakes a thread on the other core (~50-70 us here), so a
credit frame per slot cost more than the bookkeeping it carried. The two stores
and loads are unordered across cores (x86 may reorder a store with a later load),
so a waiting sender also re-checks the count after a bounded wait: a lost wake-up
costs at most that wait, never a stall.

The handshake also probes whether the accepting side can read the dialler's memory
(cross_memory.py): where it can, a step's layer-wise push goes as one layer plan
(layer_plan.py) that the receiver reads from the sender's memory; block bytes of
PUSH / DATA always go through the rings. Plans need a checksum (it catches a
block changed before its read) and x86-64's ordered stores. The dialler says it would
be read; the acceptor's answer names its pid; the dialler lets that pid read it (under
Yama scope 1: only a peer that proved the deployment secret, one at a time) and only then
announces where its probe token is (a third HELLO); the acceptor's fourth says whether
its probe worked.

Each side unlinks the peer's ring name as soon as it has mapped it (and its own
on close), so a killed process leaves nothing in /dev/shm: the memory goes when
the last mapping does. Endpoint: ``shm://127.0.0.1:port``.
"""

from __future__ import annotations

import mmap
import os
import secrets
import socket
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from vllm_pd.connector.transport.checksum import BlockStream
from vllm_pd.connector.transport.cross_memory import (
    READER_GRANTS,
    PeerMemory,
    local_identity,
    memory_probe,
    same_host,
)
from vllm_pd.connector.transport.layer_plan import ORDERED_STORES
from vllm_pd.connector.transport.tcp import TcpTransport, parse_tcp_endpoint
from vllm_pd.connector.transport.wire import Wire
from vllm_pd.errors import ConfigError, PeerClosed, ProtocolError, TransferCorrupted
from vllm_pd.protocol.cross_memory_hello import CrossMemoryAnswer, CrossMemoryOffer
from vllm_pd.protocol.frames import DIGEST_NBYTES, FLAG_TRAILER, Checksum, Frame, Kind
from vllm_pd.protocol.shm_ring import CONSUMED, CONTROL_NBYTES, SEGMENT_PREFIX, WANTED

SHM_DIR = "/dev/shm"
# A waiting sender re-checks ``consumed`` after this long even without a CREDIT (a wake-up
# lost to store/load reordering), doubling up to the cap: no stall, no polling when idle.
RECHECK_FIRST_S = 0.001
RECHECK_MAX_S = 0.05


class ShmRing:
    """``slots`` x ``slot_nbytes`` bytes of shared memory and the ring's control counters,
    mapped in this process."""

    def __init__(self, name: str, slots: int, slot_nbytes: int, create: bool) -> None:
        self.name, self.slots, self.slot_nbytes = name, slots, slot_nbytes
        path = os.path.join(SHM_DIR, name)
        data_nbytes = slots * slot_nbytes
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, data_nbytes + CONTROL_NBYTES)  # zero-filled: counters start at 0
            elif os.fstat(fd).st_size != data_nbytes + CONTROL_NBYTES:
                raise TransferCorrupted(f"shm ring {name}: size differs from the announced one")
            # Never closed explicitly: memoryviews of it may still be in use by a
            # thread that is about to notice the connection died; GC unmaps it.
            self._map = mmap.mmap(fd, data_nbytes + CONTROL_NBYTES)
        finally:
            os.close(fd)
        self.array = np.frombuffer(self._map, dtype=np.uint8, count=data_nbytes).reshape(slots, slot_nbytes)
        # Aligned 8-byte loads and stores: atomic on x86-64.
        self.control = np.frombuffer(self._map, dtype=np.uint64, count=CONTROL_NBYTES // 8, offset=data_nbytes)

    def unlink(self) -> None:
        try:
            os.unlink(os.path.join(SHM_DIR, self.name))
        except FileNotFoundError:
            pass


class ShmChannel:
    """Block bytes of one connection through two shared-memory rings."""

    frames_only = True  # block bytes go through the rings

    # Test-only fault injection: called with each filled slot before READY.
    fault_hook: Any = None

    def __init__(self, slots: int, slot_nbytes: int, cross_memory: bool = True, authenticated: bool = False) -> None:
        self._cross_memory = cross_memory
        self._authenticated = authenticated  # the peer proved the deployment secret
        self._peer_memory: PeerMemory | None = None  # reads of the peer's memory, if it can be read
        self._peer_reads_us = False  # the peer's probe of our memory worked
        self._peer_wants_reads = False  # acceptor: the dialler offered to be read
        self._reader: Any = None  # dialler: the acceptor's identity, if it would read us
        self._granted_pid: int | None = None  # dialler: the reader our ptrace grant names
        self._tx = ShmRing(f"{SEGMENT_PREFIX}{os.getpid()}-{secrets.token_hex(6)}", slots, slot_nbytes, create=True)
        self._rx: ShmRing | None = None
        # Slots are filled strictly round-robin across messages and emptied in READY
        # order, so ``produced - consumed < slots`` means slot ``produced % slots`` is free.
        self._produced = 0  # slots of _tx filled (one sending thread at a time: PeerLink's send lock)
        self._consumed = 0  # slots of _rx emptied (only the reading thread)
        self._wake = threading.Condition(threading.Lock())
        self._closed = False

    def fits_now(self, wire: Wire, nbytes: int) -> bool:
        return -(-nbytes // self._tx.slot_nbytes) <= self._free_slots()

    @property
    def peer_memory(self) -> PeerMemory | None:
        return self._peer_memory

    @property
    def peer_reads_us(self) -> bool:
        return self._peer_reads_us

    def local_info(self) -> dict[str, Any]:
        info: dict[str, Any] = {"ring": self._tx.name, "slots": self._tx.slots, "slot_nbytes": self._tx.slot_nbytes}
        if self._cross_memory:
            # the dialler's HELLO goes first: it offers to be read; the acceptor answers who reads
            info["reader" if self._peer_wants_reads else "plans"] = local_identity()
        return info

    def attach(self, remote_info: dict[str, Any]) -> None:
        try:
            name, slots, slot_nbytes = remote_info["ring"], remote_info["slots"], remote_info["slot_nbytes"]
        except KeyError as e:
            raise TransferCorrupted(f"shm handshake without {e}") from None
        if not str(name).startswith(SEGMENT_PREFIX) or "/" in str(name):
            raise TransferCorrupted(f"shm handshake: bad ring name {name!r}")
        self._rx = ShmRing(str(name), int(slots), int(slot_nbytes), create=False)
        self._rx.unlink()  # both sides map it now; the name is no longer needed
        if self._cross_memory:
            self._peer_wants_reads = same_host(remote_info.get("plans"))  # acceptor
            self._reader = remote_info.get("reader")  # dialler

    def finish_handshake(self, wire: Wire) -> None:
        """Rounds 3 and 4 (module docstring): the dialler grants the acceptor reads of its
        memory and says where its probe token is; the acceptor probes and says whether it worked."""
        try:
            self._cross_memory_rounds(wire)
        except ProtocolError as e:
            raise TransferCorrupted(f"shm handshake: {e}") from None

    def _cross_memory_rounds(self, wire: Wire) -> None:
        if self._reader is not None:  # dialler, and the acceptor would read us
            pid = self._reader.get("pid") if same_host(self._reader) else None
            grant = READER_GRANTS.grant(pid, self._authenticated) if isinstance(pid, int) else None
            if grant == "granted":
                self._granted_pid = pid
            wire.send_frame(Frame(Kind.HELLO, payload=CrossMemoryOffer(memory_probe() if grant else None).encode()))
            self._peer_reads_us = CrossMemoryAnswer.decode(wire.reader.read_frame().payload).reads_you
            if not self._peer_reads_us:
                self._revoke()
        elif self._peer_wants_reads:  # acceptor, and it offered to read the dialler
            offer = CrossMemoryOffer.decode(wire.reader.read_frame().payload)
            self._peer_memory = PeerMemory.probe(offer.probe)
            wire.send_frame(Frame(Kind.HELLO, payload=CrossMemoryAnswer(self._peer_memory is not None).encode()))

    def _revoke(self) -> None:
        pid, self._granted_pid = self._granted_pid, None
        if pid is not None:
            READER_GRANTS.revoke(pid)

    # -- sending -------------------------------------------------------------------

    def send_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> None:
        tx = self._tx
        # Each block is hashed by the copy that puts it in the ring: one read of it.
        check = wire.block_check(frame)
        if check is None:
            raise TransferCorrupted(f"{frame.checksum.name} blocks on a connection that takes keyed checks only")
        stream = BlockStream(check, views)
        # Control frames go out together where they can: the header with the first READY,
        # the digests with the last, so a batch that fits a slot is one write and one
        # wake-up of the receiver (per-batch overhead is what small per-layer pushes pay).
        pending: list[Frame] = [frame]
        while True:
            ids: tuple[int, ...] = ()  # the slot just filled (none for a batch of no bytes)
            lengths: tuple[int, ...] = ()
            if not stream.done:
                self._wait_for_slot()
                slot = self._produced % tx.slots
                n = stream.fill(tx.array[slot])
                if self.fault_hook is not None:
                    self.fault_hook(tx.array[slot, :n])
                self._produced += 1
                ids, lengths = (slot,), (n,)
            if stream.done:
                pending.append(
                    Frame(Kind.READY, flags=FLAG_TRAILER, ids=ids, lengths=lengths, payload=stream.digests())
                )
                break
            pending.append(Frame(Kind.READY, ids=ids, lengths=lengths))
            wire.send_frames(pending)
            pending = []
        wire.send_frames(pending)

    def _free_slots(self) -> int:
        return self._tx.slots - (self._produced - int(self._tx.control[CONSUMED]))

    def _wait_for_slot(self) -> None:
        if self._closed:
            raise PeerClosed("shm channel closed")
        if self._free_slots() > 0:
            return
        # Woken once half the ring is free, not per slot: one CREDIT per several slots.
        ctl = self._tx.control
        ctl[WANTED] = self._produced - self._tx.slots + max(1, self._tx.slots // 2)
        wait = RECHECK_FIRST_S
        with self._wake:
            while self._free_slots() <= 0:
                if self._closed:
                    raise PeerClosed("shm channel closed")
                self._wake.wait(wait)
                wait = min(2 * wait, RECHECK_MAX_S)

    def on_credit(self, frame: Frame) -> None:
        with self._wake:
            self._wake.notify_all()

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
        # verified is exactly what landed in the destination. Unkeyed blocks on a connection that
        # takes keyed ones only are drained and fail.
        check = wire.block_check(frame)
        stream = BlockStream(check, views) if views is not None and check is not None else None
        expected, got = sum(frame.lengths), 0
        while True:
            f = wire.reader.read_frame()
            if f.kind is Kind.CREDIT:
                self.on_credit(f)
                continue
            if f.kind is not Kind.READY:
                raise TransferCorrupted(f"expected READY in a block stream, got {f.kind.name}")
            if f.ids:  # a filled slot (the trailer may carry the last one)
                slot, n = f.ids[0], f.lengths[0]
                if slot != self._consumed % rx.slots or n > rx.slot_nbytes:
                    raise TransferCorrupted(
                        f"READY for slot {slot} of {n} bytes: expected slot "
                        f"{self._consumed % rx.slots} of <= {rx.slot_nbytes}"
                    )
                if got + n > expected:
                    raise TransferCorrupted("more block bytes than the frame announced")
                if stream is not None:
                    stream.drain(rx.array[slot, :n])
                got += n
                self._slot_emptied(wire)
            if f.flags & FLAG_TRAILER:
                break
        if got != expected:
            raise TransferCorrupted(f"block stream ended after {got} of {expected} bytes")
        if len(f.payload) != DIGEST_NBYTES * len(frame.lengths):
            raise TransferCorrupted("trailer has the wrong number of digests")
        if views is not None and check is None:
            return False
        if stream is None or frame.checksum is Checksum.NONE:
            return True
        return stream.digests() == f.payload

    def _slot_emptied(self, wire: Wire) -> None:
        """Count the slot free for the sender; wake it if it waits for this count."""
        assert self._rx is not None
        ctl = self._rx.control
        self._consumed += 1
        ctl[CONSUMED] = self._consumed
        if int(ctl[WANTED]) == self._consumed:
            wire.send_frame(Frame(Kind.CREDIT))

    def close(self) -> None:
        self._closed = True
        self._revoke()
        self._tx.unlink()
        with self._wake:
            self._wake.notify_all()


class ShmTransport(TcpTransport):
    """Stream transport whose block bytes go through /dev/shm (same host only)."""

    name = "shm"
    scheme = "shm"

    def __init__(self, slots: int = 4, slot_nbytes: int = 4 << 20, cross_memory: bool = True, **options: Any) -> None:
        if options.get("tls") is not None:
            raise ConfigError("tls: only the tcp transport encrypts (shm's bytes never leave the host)")
        super().__init__(**options)
        # layer plans need a checksum (it catches a block that changed before its read) and
        # stores that reach other cores in program order
        self._cross_memory = bool(cross_memory) and self._checksum is not Checksum.NONE and ORDERED_STORES
        if slots < 2:
            raise ConfigError(f"slots must be >= 2 (pipelining), got {slots}")
        if slot_nbytes < 4096:
            raise ConfigError(f"slot_nbytes must be >= 4096, got {slot_nbytes}")
        self._slots, self._slot_nbytes = slots, slot_nbytes

    def _listen(self, host: str, port: int) -> tuple[socket.socket, str]:
        sock, endpoint = super()._listen(host, port)
        return sock, "shm://" + endpoint.removeprefix("tcp://")

    def _dial_address(self, endpoint: str) -> tuple[int, Any]:
        if not endpoint.startswith("shm://"):
            raise ConfigError(f"bad shm endpoint {endpoint!r} (expected shm://host:port)")
        return super()._dial_address("tcp://" + endpoint.removeprefix("shm://"))

    def _new_channel(self) -> ShmChannel:
        return ShmChannel(
            self._slots, self._slot_nbytes, self._cross_memory, authenticated=self._security.secret is not None
        )


__all__ = ["ShmChannel", "ShmRing", "ShmTransport", "parse_tcp_endpoint"]
