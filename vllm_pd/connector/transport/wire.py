"""One connected socket of a stream transport and the data path beside it.

A :class:`Wire` is the control stream: frames (protocol/frames.py, read and written by frame_io.py) written under one
lock so that the two threads that may write (the writer, and on shm the reader
waking a sender that waits for ring slots) never interleave bytes. A :class:`BlockChannel` moves
block bytes: over the socket itself (tcp) or through shared memory (shm).
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios
import threading
from collections.abc import Sequence
from typing import Any, Protocol

from vllm_pd.connector.transport.checksum import BlockCheck
from vllm_pd.connector.transport.cross_memory import PeerMemory
from vllm_pd.connector.transport.frame_io import FrameReader, send_buffers
from vllm_pd.errors import ProtocolError, TransferCorrupted
from vllm_pd.protocol.auth_handshake import SessionKeys, StreamSeal
from vllm_pd.protocol.frames import DIGEST_NBYTES, Checksum, Frame

SOCKET_BUFFER_NBYTES = 8 << 20
# Blocks hashed then handed to the kernel in one sendmsg: large enough to keep
# syscalls few, small enough that the bytes are still in cache when sent.
SEND_GROUP_NBYTES = 1 << 20
# A frames-only connection's reader polls this long for the next frame of a burst: about one
# 2 MiB ring slot's copy, so a reader that drains faster than its sender fills stays awake.
FRAME_SPIN_S = 0.0003


def configure_socket(sock: socket.socket, buffer_nbytes: int = SOCKET_BUFFER_NBYTES) -> None:
    sock.settimeout(None)
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, buffer_nbytes)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, buffer_nbytes)


def unsent_nbytes(sock: socket.socket) -> int:
    """Bytes in the socket's send queue (not yet acknowledged by the peer's kernel)."""
    queued: int = struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    return queued


class Wire:
    """A connected socket; frames are sent whole under ``lock``.

    ``keys``: the session's keys where the connection authenticated and runs without TLS: each
    frame then carries a seal and the blocks a keyed check (protocol/frames.py, checksum.py)."""

    def __init__(self, sock: socket.socket, frames_only: bool = False, keys: SessionKeys | None = None) -> None:
        self.sock = sock
        self.keys = keys
        self._seal = StreamSeal(keys.send) if keys is not None else None
        # the reading thread's only way to this socket's bytes
        self.reader = FrameReader(
            sock,
            read_ahead=frames_only,
            spin_s=FRAME_SPIN_S if frames_only else 0.0,
            seal=StreamSeal(keys.receive) if keys is not None else None,
        )
        self.lock = threading.Lock()
        self._closed = False
        self.send_buffer_nbytes = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        # Bytes that surely fit the send buffer now: only sends lower it, and it is re-read
        # from the kernel (an ioctl, ~30 us on a cold forward thread) only when short.
        self.room = 0

    def has_room(self, nbytes: int) -> bool:
        """Whether ``nbytes`` more fit half the kernel's send buffer (it counts its own
        overhead too) without waiting for the peer."""
        if nbytes > self.room:
            self.room = self.send_buffer_nbytes // 2 - unsent_nbytes(self.sock)
        return nbytes <= self.room

    def sealed(self, encoded: bytes) -> list[bytes]:
        """An encoded frame as it goes on the wire: with its seal where frames are sealed. Call
        under ``lock``, in send order (the seal counts frames)."""
        return [encoded] if self._seal is None else [encoded, self._seal.tag(encoded)]

    def block_check(self, frame: Frame) -> BlockCheck | None:
        """How ``frame``'s blocks are checked on this connection; None: its checksum is not
        acceptable here (an authenticated connection without TLS takes keyed checks only)."""
        if self.keys is None:
            return BlockCheck(frame.checksum)
        if frame.checksum is not Checksum.BLAKE3_KEYED:
            return None
        return BlockCheck.keyed(self.keys.blocks, frame.encode())

    def send_frame(self, frame: Frame) -> None:
        data = frame.encode()
        with self.lock:
            send_buffers(self.sock, self.sealed(data))
            self.room -= len(data)

    def send_frames(self, frames: Sequence[Frame]) -> None:
        """Several frames in one write (one wake-up of the reader instead of several)."""
        encoded = [f.encode() for f in frames]
        with self.lock:
            data = b"".join(part for e in encoded for part in self.sealed(e))
            send_buffers(self.sock, [data])
            self.room -= len(data)

    def shutdown(self) -> None:
        """Make every blocked send/recv on this socket return now (with an error)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.shutdown()
            self.sock.close()


class BlockChannel(Protocol):
    """How the block bytes of PUSH/DATA frames travel between the two ends."""

    # Only frames travel on the socket (shm): its reader may read ahead and, in a burst,
    # poll for the next frame (a message is small there, and the sender's wake-up of a
    # sleeping reader a large part of its cost).
    frames_only: bool

    def local_info(self) -> dict[str, Any]:
        """Sent to the other end in HELLO (shm: the ring this side writes)."""

    def attach(self, remote_info: dict[str, Any]) -> None:
        """Connect to what the other end announced in its HELLO."""

    def finish_handshake(self, wire: Wire) -> None:
        """More of the handshake after both HELLOs, where the channel needs it (shm: who may
        read whose memory); both ends call it, the dialler after ``attach``, the acceptor after
        sending its HELLO."""

    def fits_now(self, wire: Wire, nbytes: int) -> bool:
        """Whether a message with ``nbytes`` of blocks can be sent now without waiting for
        the peer (so the thread that submits it may send it itself)."""

    @property
    def peer_memory(self) -> PeerMemory | None:
        """Reads of the peer's memory, where the handshake's probe allowed them (shm)."""

    @property
    def peer_reads_us(self) -> bool:
        """Whether the peer's probe of our memory worked: it may take layer plans."""

    def send_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> None:
        """Send ``frame`` followed by the bytes of ``views`` and their digests."""

    def recv_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> bool:
        """Receive the blocks announced by ``frame`` into ``views``; True if every
        digest matched."""

    def drop_blocks(self, wire: Wire, frame: Frame) -> None:
        """Consume (and discard) the blocks announced by ``frame``."""

    def on_credit(self, frame: Frame) -> None:
        """A CREDIT frame from the other end: it has emptied what we wait for (shm)."""

    def close(self) -> None:
        """Free the channel's resources (shm: unlink segments)."""


class SocketChannel:
    """Block bytes on the socket itself: zero-copy sendmsg / recv_into."""

    frames_only = False

    def local_info(self) -> dict[str, Any]:
        return {}

    def attach(self, remote_info: dict[str, Any]) -> None:
        pass

    def finish_handshake(self, wire: Wire) -> None:
        pass

    def fits_now(self, wire: Wire, nbytes: int) -> bool:
        return wire.has_room(nbytes + 4096)  # + frame and digests

    peer_memory = None  # another host, as far as a socket knows
    peer_reads_us = False

    def send_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> None:
        digests: list[bytes] = []
        check = _sender_check(wire, frame)
        with wire.lock:
            wire.room -= frame.data_nbytes + 4096
            group: list[bytes | memoryview] = [*wire.sealed(frame.encode())]
            group_nbytes = 0
            for i, view in enumerate(views):
                digests.append(check.digest(i, view))
                group.append(view)
                group_nbytes += len(view)
                if group_nbytes >= SEND_GROUP_NBYTES:
                    send_buffers(wire.sock, group)
                    group, group_nbytes = [], 0
            group.append(b"".join(digests))
            send_buffers(wire.sock, group)

    def recv_blocks(self, wire: Wire, frame: Frame, views: Sequence[memoryview]) -> bool:
        check = wire.block_check(frame)
        if check is None:  # unkeyed blocks on a connection that takes keyed ones only
            self.drop_blocks(wire, frame)
            return False
        digests = [_recv_and_digest(wire.reader, v, check, i) for i, v in enumerate(views)]
        trailer = bytearray(DIGEST_NBYTES * len(views))
        wire.reader.read_into(memoryview(trailer))
        if check.checksum is Checksum.NONE:
            return True
        return b"".join(digests) == bytes(trailer)

    def drop_blocks(self, wire: Wire, frame: Frame) -> None:
        wire.reader.discard(frame.data_nbytes)

    def on_credit(self, frame: Frame) -> None:
        raise ProtocolError("CREDIT frame on a socket channel")

    def close(self) -> None:
        pass


def _recv_and_digest(reader: FrameReader, view: memoryview, check: BlockCheck, index: int) -> bytes:
    reader.read_into(view)
    return check.digest(index, view)


def _sender_check(wire: Wire, frame: Frame) -> BlockCheck:
    """How the blocks this side sends in ``frame`` are checked (the transport chose the frame's
    checksum for this kind of connection: a mismatch is a bug, never sent)."""
    check = wire.block_check(frame)
    if check is None:
        raise TransferCorrupted(f"{frame.checksum.name} blocks on a connection that takes keyed checks only")
    return check
