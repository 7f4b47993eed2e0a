"""How a stream transport's connections prove they belong to the deployment, before anything else.

:class:`LinkSecurity` is one transport's side of it: with TLS settings (tcp only) ``dial`` and
``accept`` first run TLS on a freshly connected socket (tls_stream.py); with a deployment
secret they then run the challenge-response of protocol/auth_handshake.py (before the transports' HELLO,
before a shm ring or a NIXL agent is touched) and return the session's keys - None under TLS,
which already seals what follows. A peer that fails either is closed by the caller, with a log
line and a count (``refused``). A frame that breaks the protocol later on an authenticated
connection (a bad seal, a malformed or oversized frame) also closes it, logged and counted
(``violations``). Without either nothing is exchanged (loopback-only deployments).
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import Any

from vllm_pd.connector.transport.frame_io import recv_exact
from vllm_pd.connector.transport.tls_stream import TlsSettings, TlsSocket
from vllm_pd.errors import AuthFailed, PeerClosed
from vllm_pd.protocol.auth_handshake import (
    CHALLENGE_NBYTES,
    HANDSHAKE_MAGIC,
    HELLO_NBYTES,
    PROOF_MESSAGE_NBYTES,
    DeploymentSecret,
    DiallerHandshake,
    ListenerHandshake,
    Service,
    SessionKeys,
    describe_unauthenticated,
)
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


class LinkSecurity:
    """The deployment secret of one transport, and what its connections refused."""

    def __init__(
        self, secret: DeploymentSecret | None, service: Service = Service.KV, tls: TlsSettings | None = None
    ) -> None:
        self.secret = secret
        self.service = service
        self.tls = tls
        self._contexts = {side: tls.context(server=side) for side in (True, False)} if tls is not None else {}
        self._lock = threading.Lock()
        self.refused = 0  # connections that did not authenticate (cumulative)
        self.violations = 0  # authenticated connections closed for breaking the protocol (cumulative)

    @property
    def seals(self) -> bool:
        """Whether frames carry seals and blocks keyed checks (a secret, and no TLS to do it)."""
        return self.secret is not None and self.tls is None

    def dial(self, sock: socket.socket) -> tuple[Any, SessionKeys | None]:
        """Secure a socket we connected (its timeout set): (what to read and write instead of it,
        the session's keys where frames are sealed); AuthFailed if the listener fails TLS or
        does not prove the secret."""
        conn = self._tls(sock, server=False)
        if self.secret is None:
            return conn, None
        shake = DiallerHandshake(self.secret, self.service)
        conn.sendall(shake.hello())
        challenge = _read_handshake(conn, CHALLENGE_NBYTES)
        conn.sendall(shake.proof(challenge))
        try:
            keys = shake.finish(_read_handshake(conn, PROOF_MESSAGE_NBYTES))
        except (PeerClosed, ConnectionError):
            raise AuthFailed(
                "the listener closed the connection: it refused our proof (another deployment's secret?)"
            ) from None
        return conn, keys if self.seals else None

    def accept(self, sock: socket.socket) -> tuple[Any, SessionKeys | None]:
        """Secure a socket we accepted (its timeout set), as :meth:`dial`; AuthFailed if the
        dialler fails TLS or does not prove the secret (the caller closes it and calls :meth:`refuse`)."""
        conn = self._tls(sock, server=True)
        if self.secret is None:
            return conn, None
        shake = ListenerHandshake(self.secret, self.service)
        conn.sendall(shake.challenge(_read_handshake(conn, HELLO_NBYTES)))
        ours, keys = shake.verify(_read_handshake(conn, PROOF_MESSAGE_NBYTES))
        conn.sendall(ours)
        return conn, keys if self.seals else None

    def _tls(self, sock: socket.socket, server: bool) -> Any:
        if self.tls is None:
            return sock
        conn = TlsSocket(sock, self._contexts[server], server)
        try:
            conn.handshake()
        except ssl.SSLError as e:
            raise AuthFailed(f"TLS: {e.reason or e}") from None
        return conn

    def refuse(self, who: Any, error: BaseException) -> None:
        """A connection that did not authenticate: logged, counted (the caller closes it)."""
        with self._lock:
            self.refused += 1
        logger.warning("refused a connection from %s: %s", who, error)

    def violated(self, who: Any, error: BaseException) -> None:
        """An authenticated connection broke the protocol: logged, counted (the caller closes it)."""
        with self._lock:
            self.violations += 1
        logger.warning("closing the connection with %s: %s", who, error)


def _read_handshake(sock: Any, nbytes: int) -> bytes:
    """One handshake message; AuthFailed naming what came instead (a peer without the secret
    speaks frames right away)."""
    head = bytes(recv_exact(sock, len(HANDSHAKE_MAGIC)))
    if head != HANDSHAKE_MAGIC:
        raise AuthFailed(describe_unauthenticated(head))
    return head + bytes(recv_exact(sock, nbytes - len(head)))
