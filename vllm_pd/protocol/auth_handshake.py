"""The handshake every KV-plane connection opens with, and the seals of what follows it.

Every connection between a deployment's processes - the KV transports (tcp, shm, nixl's
control connection), release / probe / announce messages riding on them, the KV store's
node-to-node fetches, and every request to the store master, the proxy's included - proves
that both ends hold the deployment's secret before anything else is read or sent:

1. dialler -> listener ``HELLO``: version, service, the dialler's fresh nonce Nc
2. listener -> dialler ``CHALLENGE``: the listener's fresh nonce Ns
3. dialler -> listener ``PROOF``: HMAC-SHA256(secret, "client" | service | Nc | Ns)
4. listener -> dialler ``PROOF``: HMAC-SHA256(secret, "server" | service | Nc | Ns),
   sent only once the dialler's proof checked out (else the listener closes)

Each message: ``magic "VPDA" | version u8 | kind u8 | service u16 | body`` (the version is the
protocol's, version.PROTOCOL_VERSION). Both nonces are fresh, so a recorded handshake replayed
against either side fails; the proofs name their direction, so one side's proof is never the
other's; the secret itself never crosses the wire. The dialler proves first: an outsider that
connects gets a random nonce and nothing else. Both ends then derive the session's keys from
the secret and both nonces: one per direction that seals every later message (a keyed BLAKE3
tag over an implicit, or for message sockets explicit, sequence number and the message: a byte
injected, replayed, dropped or reordered on the path fails the tag and closes the connection)
and one that keys the blocks' checks (transport/checksum.py, ``BLAKE3_KEYED``: bytes injected
into a block fail it).

No I/O here: the transports run it on their sockets (transport/link_security.py), the store
master on its ZMQ sockets (store/master_sessions.py). Where the secret comes from and who may
listen without one: connector/deployment_secret.py. Torch-free (the proxy and the store master
import it).
"""

from __future__ import annotations

import hmac
import secrets
import struct
from dataclasses import dataclass
from enum import IntEnum

from vllm_pd.errors import AuthFailed
from vllm_pd.protocol.version import PROTOCOL_VERSION

HANDSHAKE_MAGIC = b"VPDA"
NONCE_NBYTES = 32
PROOF_NBYTES = 32
KEY_NBYTES = 32
TAG_NBYTES = 16
SEALED_MAGIC = b"VPDS"  # a sealed message on a message socket (the store master's)
# a message socket's whole answer to a message that is neither a handshake nor sealed in a session
REFUSED = b"VPDR"

_HEAD = struct.Struct("<4sBBH")  # magic, version, message kind, service
_SEQ = struct.Struct("<Q")
_LABEL = b"vllm-pd auth v1"  # the proofs' label (domain separation), not a version


class Service(IntEnum):
    """What a connection is for; bound into every proof, so one service's handshake is no other's."""

    KV = 1  # transports: KV blocks and control messages between instances, store peers, releases
    STORE_MASTER = 2  # the KV store's master index


class _Kind(IntEnum):
    HELLO = 1
    CHALLENGE = 2
    PROOF = 3


HELLO_NBYTES = _HEAD.size + NONCE_NBYTES
CHALLENGE_NBYTES = _HEAD.size + NONCE_NBYTES
PROOF_MESSAGE_NBYTES = _HEAD.size + PROOF_NBYTES


@dataclass(frozen=True)
class DeploymentSecret:
    """The deployment's shared secret; ``source`` says where it came from (never its value)."""

    value: bytes
    source: str

    def __repr__(self) -> str:
        return f"DeploymentSecret(from {self.source})"


# -- the handshake -------------------------------------------------------------------------------------


def _pack(kind: _Kind, service: Service, body: bytes) -> bytes:
    return _HEAD.pack(HANDSHAKE_MAGIC, PROTOCOL_VERSION, int(kind), int(service)) + body


def _unpack(data: bytes, kind: _Kind, service: Service, nbytes: int) -> bytes:
    if len(data) != _HEAD.size + nbytes:
        raise AuthFailed(f"handshake {kind.name} of {len(data)} bytes, expected {_HEAD.size + nbytes}")
    magic, version, got_kind, got_service = _HEAD.unpack_from(data)
    if magic != HANDSHAKE_MAGIC:
        raise AuthFailed(describe_unauthenticated(data[:4]))
    if version != PROTOCOL_VERSION:
        raise AuthFailed(f"handshake version {version}, this side speaks {PROTOCOL_VERSION}")
    if got_kind != kind or got_service != service:
        raise AuthFailed(
            f"expected handshake {kind.name} for {service.name}, got kind {got_kind} for service {got_service}"
        )
    return data[_HEAD.size :]


def is_handshake_hello(data: bytes) -> bool:
    """Whether ``data`` opens a handshake (a message socket's peer starts a session with it)."""
    return len(data) >= _HEAD.size and data.startswith(HANDSHAKE_MAGIC) and data[5] == _Kind.HELLO


def describe_unauthenticated(first_bytes: bytes) -> str:
    """Why a connection's first bytes are not a handshake (for the log line)."""
    if first_bytes.startswith(b"VPD"):
        return "the peer did not authenticate (it has no deployment secret, or an older vllm-pd)"
    return f"the peer did not authenticate (first bytes {first_bytes[:4]!r}: not vllm-pd)"


def _proof(secret: DeploymentSecret, role: bytes, service: Service, nonce_c: bytes, nonce_s: bytes) -> bytes:
    msg = b"|".join((_LABEL, role, str(int(service)).encode(), nonce_c, nonce_s))
    return hmac.digest(secret.value, msg, "sha256")


@dataclass(frozen=True, repr=False)
class SessionKeys:
    """One connection's keys, from this side's point of view."""

    send: bytes  # seals what this side sends
    receive: bytes  # checks what the peer sends
    blocks: bytes  # keys the blocks' checks (both directions; each block is bound to its frame)

    def __repr__(self) -> str:
        return "SessionKeys(...)"


def _session_keys(
    secret: DeploymentSecret, service: Service, nonce_c: bytes, nonce_s: bytes, dialler: bool
) -> SessionKeys:
    master = _proof(secret, b"session", service, nonce_c, nonce_s)
    c2s, s2c = hmac.digest(master, b"dialler->listener", "sha256"), hmac.digest(master, b"listener->dialler", "sha256")
    blocks = hmac.digest(master, b"blocks", "sha256")
    return SessionKeys(c2s, s2c, blocks) if dialler else SessionKeys(s2c, c2s, blocks)


class DiallerHandshake:
    """The connecting side, without I/O: ``hello()``, ``proof(challenge)``, ``finish(proof)``."""

    def __init__(self, secret: DeploymentSecret, service: Service) -> None:
        self._secret, self._service = secret, service
        self._nonce = secrets.token_bytes(NONCE_NBYTES)
        self._peer_nonce: bytes | None = None

    def hello(self) -> bytes:
        return _pack(_Kind.HELLO, self._service, self._nonce)

    def proof(self, challenge: bytes) -> bytes:
        self._peer_nonce = _unpack(challenge, _Kind.CHALLENGE, self._service, NONCE_NBYTES)
        return _pack(
            _Kind.PROOF, self._service, _proof(self._secret, b"dialler", self._service, self._nonce, self._peer_nonce)
        )

    def finish(self, listener_proof: bytes) -> SessionKeys:
        """The session's keys once the listener proved the secret; AuthFailed otherwise."""
        if self._peer_nonce is None:
            raise AuthFailed("handshake out of order")
        got = _unpack(listener_proof, _Kind.PROOF, self._service, PROOF_NBYTES)
        want = _proof(self._secret, b"listener", self._service, self._nonce, self._peer_nonce)
        if not hmac.compare_digest(got, want):
            raise AuthFailed("the listener's proof is wrong (another deployment's secret)")
        return _session_keys(self._secret, self._service, self._nonce, self._peer_nonce, dialler=True)


class ListenerHandshake:
    """The accepting side, without I/O: ``challenge(hello)``, then ``verify(proof)``."""

    def __init__(self, secret: DeploymentSecret, service: Service) -> None:
        self._secret, self._service = secret, service
        self._nonce = secrets.token_bytes(NONCE_NBYTES)
        self._peer_nonce: bytes | None = None

    def challenge(self, hello: bytes) -> bytes:
        self._peer_nonce = _unpack(hello, _Kind.HELLO, self._service, NONCE_NBYTES)
        return _pack(_Kind.CHALLENGE, self._service, self._nonce)

    def verify(self, dialler_proof: bytes) -> tuple[bytes, SessionKeys]:
        """(our proof to send back, the session's keys); AuthFailed if the dialler's proof is wrong."""
        if self._peer_nonce is None:
            raise AuthFailed("handshake out of order")
        got = _unpack(dialler_proof, _Kind.PROOF, self._service, PROOF_NBYTES)
        want = _proof(self._secret, b"dialler", self._service, self._peer_nonce, self._nonce)
        if not hmac.compare_digest(got, want):
            raise AuthFailed("the dialler's proof is wrong (no or another deployment's secret)")
        ours = _pack(
            _Kind.PROOF, self._service, _proof(self._secret, b"listener", self._service, self._peer_nonce, self._nonce)
        )
        return ours, _session_keys(self._secret, self._service, self._peer_nonce, self._nonce, dialler=False)


# -- sealing what follows the handshake ------------------------------------------------------------------


def seal_tag(key: bytes, seq: int, *parts: bytes | bytearray | memoryview) -> bytes:
    """The tag of message number ``seq`` made of ``parts``."""
    import blake3  # here: the GPU data path imports this module, and a bare GPU machine has no blake3

    h = blake3.blake3(_SEQ.pack(seq), key=key)
    for part in parts:
        h.update(part)
    return h.digest(TAG_NBYTES)


class StreamSeal:
    """Tags of one direction of a stream: message ``n`` is tagged with ``n`` (never on the wire),
    so a message injected, replayed, dropped or reordered fails. One thread at a time per seal
    (the wire's send lock; its single reader)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self._seq = 0

    def tag(self, *parts: bytes | bytearray | memoryview) -> bytes:
        tag = seal_tag(self._key, self._seq, *parts)
        self._seq += 1
        return tag

    def check(self, tag: bytes | bytearray | memoryview, *parts: bytes | bytearray | memoryview) -> None:
        if not hmac.compare_digest(bytes(tag), self.tag(*parts)):
            raise AuthFailed("a message's seal is wrong (injected, replayed or altered on the way)")


class MessageSeal:
    """Seals of one direction on a message socket (ZMQ): ``VPDS | seq u64 | payload | tag``.
    The sequence number travels; :meth:`open` refuses one not above the last it accepted."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.last_seq = -1

    def seal(self, seq: int, payload: bytes) -> bytes:
        head = SEALED_MAGIC + _SEQ.pack(seq)
        return head + payload + seal_tag(self._key, seq, payload)

    def open(self, data: bytes) -> tuple[int, bytes]:
        """(seq, payload) of a sealed message; AuthFailed if its tag is wrong or it was seen before."""
        head = len(SEALED_MAGIC) + _SEQ.size
        if len(data) < head + TAG_NBYTES or not data.startswith(SEALED_MAGIC):
            raise AuthFailed("not a sealed message")
        (seq,) = _SEQ.unpack_from(data, len(SEALED_MAGIC))
        payload, tag = data[head:-TAG_NBYTES], data[-TAG_NBYTES:]
        if not hmac.compare_digest(tag, seal_tag(self._key, seq, payload)):
            raise AuthFailed("a message's seal is wrong (injected or altered on the way)")
        if seq <= self.last_seq:
            raise AuthFailed(f"message {seq} replayed (last accepted: {self.last_seq})")
        self.last_seq = seq
        return seq, payload


__all__ = [
    "CHALLENGE_NBYTES",
    "HELLO_NBYTES",
    "PROOF_MESSAGE_NBYTES",
    "REFUSED",
    "TAG_NBYTES",
    "DeploymentSecret",
    "DiallerHandshake",
    "ListenerHandshake",
    "MessageSeal",
    "Service",
    "SessionKeys",
    "StreamSeal",
    "describe_unauthenticated",
    "is_handshake_hello",
]
