"""Frames (protocol/frames.py) on a socket: exact reads, a buffered reader, vectored writes.

What a stream transport's connection reads and writes with; the frames' layout is the
protocol's. An authenticated connection without TLS checks each frame's seal as it reads it
(:class:`FrameReader`, ``seal``).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Sequence

from vllm_pd.errors import PeerClosed
from vllm_pd.protocol.auth_handshake import TAG_NBYTES, StreamSeal
from vllm_pd.protocol.frames import HEADER_NBYTES, Frame, decode_header, decode_rest

# sendmsg takes at most IOV_MAX (1024 on Linux) buffers per call.
MAX_IOV = 512


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from the socket; PeerClosed on end of stream."""
    while len(view):
        # MSG_WAITALL: one syscall (and one trip through Python) per block.
        n = sock.recv_into(view, 0, socket.MSG_WAITALL)
        if n == 0:
            raise PeerClosed("connection closed by peer (end of stream)")
        view = view[n:]


def recv_exact(sock: socket.socket, n: int) -> bytearray:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return buf


def read_frame(sock: socket.socket) -> Frame:
    h = decode_header(recv_exact(sock, HEADER_NBYTES))
    return decode_rest(h, recv_exact(sock, h.rest_nbytes) if h.rest_nbytes else b"")


# Enough for any usual frame (a PUSH of 1000 blocks is ~12 KiB) and several small ones.
READ_BUFFER_NBYTES = 64 << 10


class FrameReader:
    """Frames and the bytes that follow them, read from one socket through a buffer.

    ``read_ahead``: one recv takes whatever has arrived - on shm usually a PUSH and its READY
    together - where exact reads cost a syscall per header and per variable part (four per
    shm push). Without it (tcp, where block bytes follow the frames: reading ahead would
    copy them once more) each read takes exactly the frame's bytes. Either way every read
    of this socket after the handshake goes through here: ``read_into`` and ``discard``
    hand out buffered bytes first. One reading thread per socket.

    ``spin_s`` > 0: while frames come in a burst (the last wait for one was shorter than
    ``spin_s``), wait for the next one by polling the socket for up to ``spin_s`` before
    sleeping in recv. A sleeping reader costs its *sender* a cross-core wake-up per message
    (~50-70 us of the sender's core here, more than the rest of a shm push's bookkeeping);
    a reader that is already awake costs it nothing. Outside bursts (gaps longer than
    ``spin_s``, e.g. a prefill's layers) it never polls, so an idle link costs no CPU.
    """

    def __init__(
        self,
        sock: socket.socket,
        buffer_nbytes: int = READ_BUFFER_NBYTES,
        read_ahead: bool = False,
        spin_s: float = 0.0,
        seal: StreamSeal | None = None,
    ) -> None:
        self.sock = sock
        self.seal = seal  # checks each frame's seal (an authenticated connection without TLS)
        self.read_ahead = read_ahead
        self.spin_s = spin_s
        self._bursting = False  # the last wait for bytes was shorter than spin_s
        self._buf = bytearray(buffer_nbytes)
        self._view = memoryview(self._buf)
        self._start = 0  # buffered, not yet consumed: _buf[_start:_end]
        self._end = 0

    def read_frame(self) -> Frame:
        head = self._take(HEADER_NBYTES)
        h = decode_header(head)
        if self.seal is None:
            return decode_rest(h, self._take(h.rest_nbytes) if h.rest_nbytes else b"")
        header = bytes(head)  # the buffer's view is reused by the next take
        rest = bytes(self._take(h.rest_nbytes)) if h.rest_nbytes else b""
        self.seal.check(self._take(TAG_NBYTES), header, rest)
        return decode_rest(h, rest)

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (buffered bytes first, then straight from the socket)."""
        k = min(self._end - self._start, len(view))
        if k:
            view[:k] = self._view[self._start : self._start + k]
            self._start += k
            view = view[k:]
        if len(view):
            recv_exact_into(self.sock, view)

    def discard(self, nbytes: int) -> None:
        k = min(self._end - self._start, nbytes)
        self._start += k
        if nbytes > k:
            discard(self.sock, nbytes - k)

    def _take(self, n: int) -> memoryview | bytearray:
        """The next ``n`` bytes; a view into the buffer, valid until the next call."""
        if n > len(self._buf):  # a large variable part (a big NOTIFY): read it whole
            whole = bytearray(n)
            self.read_into(memoryview(whole))
            return whole
        have = self._end - self._start
        if have < n:
            if len(self._buf) - self._start < n:  # not room behind: move the partial frame to the front
                self._buf[:have] = bytes(self._view[self._start : self._end])
                self._start, self._end = 0, have
            while self._end - self._start < n:
                limit = len(self._buf) if self.read_ahead else self._start + n
                got = self._recv_some(self._view[self._end : limit])
                if got == 0:
                    raise PeerClosed("connection closed by peer (end of stream)")
                self._end += got
        out = self._view[self._start : self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return out

    def _recv_some(self, view: memoryview) -> int:
        if self.spin_s <= 0:
            return self.sock.recv_into(view)
        t0 = time.perf_counter()
        if self._bursting:
            while time.perf_counter() - t0 < self.spin_s:
                try:
                    return self.sock.recv_into(view, 0, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
        got = self.sock.recv_into(view)
        self._bursting = time.perf_counter() - t0 < self.spin_s
        return got


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send all buffers in order with as few sendmsg calls as possible (no copies)."""
    bufs = [memoryview(b).cast("B") if not isinstance(b, memoryview) else b for b in buffers]
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i : i + MAX_IOV])
        while sent:
            if sent >= len(bufs[i]):
                sent -= len(bufs[i])
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0
        while i < len(bufs) and len(bufs[i]) == 0:
            i += 1


def discard(sock: socket.socket, nbytes: int) -> None:
    """Read and drop ``nbytes`` (blocks we refused), keeping the stream in sync."""
    scratch = memoryview(bytearray(min(nbytes, 1 << 20) or 1))
    while nbytes:
        n = min(nbytes, len(scratch))
        recv_exact_into(sock, scratch[:n])
        nbytes -= n
