"""Authenticated sessions over the store master's ZMQ sockets (protocol/auth_handshake.py).

ZMQ hides connections behind peer identities, so the handshake runs as messages: the peer's
``HELLO`` -> our ``CHALLENGE`` -> its ``PROOF`` -> our ``PROOF``; from then on each request
from that identity is sealed with the session's key and its sequence number (a replayed,
injected or altered one fails), and so is each reply. A message that is neither part of a
handshake nor sealed in a live session gets ``REFUSED`` and nothing else: no index entry,
no node, no answer to a lookup - logged (once per identity) and counted.

:class:`ListenerSessions` is the master's side (a bounded table of peers mid-handshake and
of live sessions, oldest dropped first: a flood of handshakes cannot grow it);
:class:`DiallerSession` a client's (MasterLink), which runs the handshake on a fresh socket.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TypeVar

from vllm_pd.errors import AuthFailed
from vllm_pd.protocol.auth_handshake import (
    REFUSED,
    SEALED_MAGIC,
    DeploymentSecret,
    DiallerHandshake,
    ListenerHandshake,
    MessageSeal,
    Service,
    is_handshake_hello,
)
from vllm_pd.vllm_logging import vllm_logger

_V = TypeVar("_V")

logger = vllm_logger(__name__)

MAX_PENDING = 1024  # peers between HELLO and PROOF
MAX_SESSIONS = 4096  # authenticated peers (a node reconnecting gets a new identity and session)


class _Session:
    def __init__(self, receive: MessageSeal, send: MessageSeal) -> None:
        self.receive, self.send = receive, send


class ListenerSessions:
    """The master's sessions: turns each incoming message into a reply and, where it is a sealed
    request of a live session, the request to answer."""

    def __init__(self, secret: DeploymentSecret) -> None:
        self._secret = secret
        self._pending: OrderedDict[bytes, ListenerHandshake] = OrderedDict()
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        self.refused = 0

    @property
    def live(self) -> int:
        return len(self._sessions)

    def receive(self, ident: bytes, data: bytes) -> tuple[bytes | None, tuple[int, bytes] | None]:
        """(what to send back now, the sealed request's (seq, payload) to answer); the answer to a
        request goes out through :meth:`seal`."""
        try:
            if is_handshake_hello(data):
                return self._hello(ident, data), None
            shake = self._pending.pop(ident, None)
            if shake is not None:
                ours, keys = shake.verify(data)
                self._remember(
                    self._sessions, ident, _Session(MessageSeal(keys.receive), MessageSeal(keys.send)), MAX_SESSIONS
                )
                return ours, None
            session = self._sessions.get(ident)
            if session is None:
                raise AuthFailed(
                    "no session: the peer did not authenticate (no deployment secret?)"
                    if not data.startswith(SEALED_MAGIC)
                    else "a sealed message outside any session"
                )
            request = session.receive.open(data)
            self._sessions.move_to_end(ident)
            return None, request
        except AuthFailed as e:
            self._refuse(ident, e)
            return REFUSED, None

    def seal(self, ident: bytes, seq: int, reply: bytes) -> bytes | None:
        """``reply`` to request ``seq`` of ``ident``'s session, sealed (None: the session is gone)."""
        session = self._sessions.get(ident)
        return None if session is None else session.send.seal(seq, reply)

    def _hello(self, ident: bytes, data: bytes) -> bytes:
        shake = ListenerHandshake(self._secret, Service.STORE_MASTER)
        challenge = shake.challenge(data)
        self._sessions.pop(ident, None)  # a peer starting over drops what it had
        self._remember(self._pending, ident, shake, MAX_PENDING)
        return challenge

    @staticmethod
    def _remember(table: OrderedDict[bytes, _V], ident: bytes, value: _V, limit: int) -> None:
        table[ident] = value
        table.move_to_end(ident)
        while len(table) > limit:
            table.popitem(last=False)

    def _refuse(self, ident: bytes, error: AuthFailed) -> None:
        self.refused += 1
        self._pending.pop(ident, None)
        self._sessions.pop(ident, None)
        # an unauthenticated peer retries: log its first refusals, then every 100th
        if self.refused <= 10 or self.refused % 100 == 0:
            logger.warning(
                "store master: refused a message from peer %s: %s (%d refused so far)", ident.hex(), error, self.refused
            )


class DiallerSession:
    """A client's session with the master: the handshake on a fresh socket (``exchange`` sends a
    message and returns the reply, or None on a timeout), then sealed requests and replies."""

    def __init__(self, secret: DeploymentSecret, exchange: Callable[[bytes], bytes | None]) -> None:
        shake = DiallerHandshake(secret, Service.STORE_MASTER)
        challenge = _answer(exchange(shake.hello()))
        keys = shake.finish(_answer(exchange(shake.proof(challenge))))
        self._send, self._receive = MessageSeal(keys.send), MessageSeal(keys.receive)

    def seal(self, seq: int, request: bytes) -> bytes:
        return self._send.seal(seq, request)

    def open(self, data: bytes) -> tuple[int, bytes]:
        """(seq, payload) of a sealed reply; AuthFailed if the master refused or the seal is wrong."""
        return self._receive.open(_answer(data))


def _answer(data: bytes | None) -> bytes:
    if data is None:
        raise TimeoutError("no answer from the store master")
    if data == REFUSED:
        raise AuthFailed("the store master refused us: it has another deployment secret")
    return data
