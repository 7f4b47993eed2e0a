"""How a stream transport's connections prove they belong to the deployment, before anything else.

:class:`LinkSecurity` is one transport's side of it: with a deployment secret, ``dial`` and
``accept`` run the challenge-response of auth_protocol.py on a freshly connected socket
(before the transports' HELLO, before a shm ring or a NIXL agent is touched) and return the
session's keys; a peer that fails it is closed by the caller, with a log line and a count
(``refused``). A frame that breaks the protocol later on an authenticated connection (a bad
seal, a malformed or oversized frame) also closes it, logged and counted (``violations``).
Without a secret both return None and nothing is exchanged (loopback-only deployments).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

from vllm_pd.connector.auth_protocol import (
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
from vllm_pd.connector.exceptions import AuthFailed, PeerClosed
from vllm_pd.connector.transport.framing import recv_exact
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


class LinkSecurity:
    """The deployment secret of one transport, and what its connections refused."""

    def __init__(self, secret: DeploymentSecret | None, service: Service = Service.KV) -> None:
        self.secret = secret
        self.service = service
        self._lock = threading.Lock()
        self.refused = 0  # connections that did not authenticate (cumulative)
        self.violations = 0  # authenticated connections closed for breaking the protocol (cumulative)

    @property
    def seals(self) -> bool:
        """Whether frames carry seals and blocks keyed checks (a secret; TLS would make them moot)."""
        return self.secret is not None

    def dial(self, sock: socket.socket) -> SessionKeys | None:
        """Authenticate a socket we connected (its timeout set); AuthFailed if the listener does not
        prove the secret."""
        if self.secret is None:
            return None
        shake = DiallerHandshake(self.secret, self.service)
        sock.sendall(shake.hello())
        challenge = _read_handshake(sock, CHALLENGE_NBYTES)
        sock.sendall(shake.proof(challenge))
        try:
            return shake.finish(_read_handshake(sock, PROOF_MESSAGE_NBYTES))
        except (PeerClosed, ConnectionError):
            raise AuthFailed("the listener closed the connection: it refused our proof (another "
                             "deployment's secret?)") from None

    def accept(self, sock: socket.socket) -> SessionKeys | None:
        """Authenticate a socket we accepted (its timeout set); AuthFailed if the dialler does not
        prove the secret (the caller closes it and calls :meth:`refuse`)."""
        if self.secret is None:
            return None
        shake = ListenerHandshake(self.secret, self.service)
        sock.sendall(shake.challenge(_read_handshake(sock, HELLO_NBYTES)))
        ours, keys = shake.verify(_read_handshake(sock, PROOF_MESSAGE_NBYTES))
        sock.sendall(ours)
        return keys

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


def _read_handshake(sock: socket.socket, nbytes: int) -> bytes:
    """One handshake message; AuthFailed naming what came instead (a peer without the secret
    speaks frames right away)."""
    head = bytes(recv_exact(sock, len(HANDSHAKE_MAGIC)))
    if head != HANDSHAKE_MAGIC:
        raise AuthFailed(describe_unauthenticated(head))
    return head + bytes(recv_exact(sock, nbytes - len(head)))
