"""TLS for the tcp transport (and so for the store's node-to-node fetches): where the wire leaves
the host, the KV on it can be encrypted.

Certificates come from files (``TlsSettings``: this side's certificate and key, and the CA that
signed the deployment's certificates); both ends present one and check the other's against that
CA (mutual TLS, TLS 1.3 only). Host names are not checked: endpoints are addresses, and what
makes a peer one of ours is its certificate's CA (and, with a secret, the handshake that follows
inside TLS).

:class:`TlsSocket` is what the stream code reads and writes instead of the socket. It drives
an ``ssl.SSLObject`` through memory BIOs so that one thread can block reading the raw socket
while another writes (an ``SSLSocket`` must not be used by two threads at once), and it offers
the calls the framing uses (``recv_into`` with MSG_WAITALL / MSG_DONTWAIT, ``sendmsg``). Every
byte is copied into and out of OpenSSL's buffers: the zero-copy send of plain tcp does not
survive encryption (its cost: docs/benchmarks/security.md, "Authenticated KV plane").

RDMA (the nixl transport) cannot be encrypted here: UCX moves the bytes between registered
memory without us. Run it on an isolated network, or encrypt below it (IPsec, or MACsec on
the fabric).
"""

from __future__ import annotations

import socket
import ssl
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_pd.errors import ConfigError

RAW_CHUNK = 256 << 10  # raw bytes read from the socket at a time
WRITE_CHUNK = 1 << 20  # plaintext handed to OpenSSL at a time (its output is sent before the next)


@dataclass(frozen=True)
class TlsSettings:
    """This side's certificate and key, and the deployment's CA (files, PEM)."""

    cert_file: str
    key_file: str
    ca_file: str

    @classmethod
    def from_keys(cls, cert: str | None, key: str | None, ca: str | None, prefix: str) -> TlsSettings | None:
        """Settings from three optional keys (``prefix`` names them in errors): all or none."""
        given = {"tls_cert": cert, "tls_key": key, "tls_ca": ca}
        if not any(given.values()):
            return None
        missing = [k for k, v in given.items() if not v]
        if missing:
            raise ConfigError(f"{prefix}{missing[0]}: TLS needs tls_cert, tls_key and tls_ca together")
        settings = cls(str(cert), str(key), str(ca))
        try:
            settings.context(server=True)  # a bad file stops start-up, naming its key
        except ConfigError as e:
            raise ConfigError(f"{prefix}{e}") from None
        return settings

    def context(self, server: bool) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server else ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3  # no renegotiation: reads never need a write
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_REQUIRED  # both ways: the dialler shows a certificate too
        loads: tuple[tuple[str, Callable[[], None]], ...] = (
            ("tls_ca", lambda: ctx.load_verify_locations(cafile=self.ca_file)),
            ("tls_cert", lambda: ctx.load_cert_chain(self.cert_file, self.key_file)),
        )
        for key, load in loads:
            try:
                load()
            except (OSError, ssl.SSLError) as e:
                raise ConfigError(f"{key}: {self.ca_file if key == 'tls_ca' else self.cert_file}: {e}") from None
        return ctx


class TlsSocket:
    """A connected socket with TLS on it, usable by one reading and one writing thread at once."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, server: bool) -> None:
        self._sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self._obj = context.wrap_bio(self._in, self._out, server_side=server)
        self._ssl_lock = threading.Lock()  # the SSLObject and its BIOs
        self._send_lock = threading.Lock()  # the raw socket's send order (taken before _ssl_lock)
        self.family = sock.family

    def handshake(self) -> None:
        """The TLS handshake (blocking, within the socket's timeout); ssl.SSLError if it fails."""
        while True:
            try:
                with self._ssl_lock:
                    self._obj.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._feed(self._sock.recv(RAW_CHUNK))
        self._flush()

    # -- what the framing calls ------------------------------------------------------------------

    def recv_into(self, buffer: Any, nbytes: int = 0, flags: int = 0) -> int:
        view = memoryview(buffer).cast("B")
        want = nbytes or len(view)
        got = 0
        while got < want:
            k: int
            try:
                with self._ssl_lock:
                    k = int(self._obj.read(want - got, view[got:want]))  # typeshed: bytes without a buffer
            except ssl.SSLWantReadError:
                k = -1
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return got  # the peer closed
            if k > 0:
                got += k
                if not flags & socket.MSG_WAITALL:
                    return got
                continue
            if k == 0:
                return got
            self._try_flush()  # what reading made OpenSSL answer (rare in TLS 1.3), if no writer is sending
            raw = self._sock.recv(RAW_CHUNK, flags & socket.MSG_DONTWAIT) if not got else self._sock.recv(RAW_CHUNK)
            self._feed(raw)
        return got

    def recv(self, nbytes: int) -> bytes:
        buf = bytearray(nbytes)
        n = self.recv_into(buf)
        return bytes(buf[:n])

    def sendmsg(self, buffers: Sequence[Any]) -> int:
        total = 0
        with self._send_lock:
            for buf in buffers:
                view = memoryview(buf).cast("B")
                for start in range(0, len(view), WRITE_CHUNK):
                    with self._ssl_lock:
                        self._obj.write(view[start : start + WRITE_CHUNK])
                        data = self._out.read()
                    self._sock.sendall(data)
                total += len(view)
            with self._ssl_lock:
                data = self._out.read()
            if data:
                self._sock.sendall(data)
        return total

    def sendall(self, data: bytes) -> None:
        self.sendmsg([data])

    # -- the rest is the raw socket's ---------------------------------------------------------------

    def settimeout(self, value: float | None) -> None:
        self._sock.settimeout(value)

    def getsockopt(self, *args: Any) -> Any:
        return self._sock.getsockopt(*args)

    def setsockopt(self, *args: Any) -> None:
        self._sock.setsockopt(*args)

    def fileno(self) -> int:
        return self._sock.fileno()

    def shutdown(self, how: int) -> None:
        self._sock.shutdown(how)

    def close(self) -> None:
        self._sock.close()

    # -- internals ------------------------------------------------------------------------------------

    def _feed(self, raw: bytes) -> None:
        with self._ssl_lock:
            if raw:
                self._in.write(raw)
            else:
                self._in.write_eof()

    def _flush(self) -> None:
        with self._send_lock:
            with self._ssl_lock:
                data = self._out.read()
            if data:
                self._sock.sendall(data)

    def _try_flush(self) -> None:
        # never wait for the send lock here: a writer blocked on a full socket holds it, and the
        # peer may be waiting for us to read before it reads
        if self._send_lock.acquire(blocking=False):
            try:
                with self._ssl_lock:
                    data = self._out.read()
                if data:
                    self._sock.sendall(data)
            finally:
                self._send_lock.release()
