"""The cross-memory HELLOs: what two same-host processes tell each other before one reads the other's memory.

The shm transport's handshake (transport/shm.py) has two more HELLO frames (frames.py, ``Kind.HELLO``)
after the two of hello_frame.py where the acceptor would read the dialler's memory (Linux cross-memory
attach, transport/cross_memory.py):

3. dialler -> acceptor :class:`CrossMemoryOffer`: where its probe token is (:class:`MemoryProbe`), or
   nothing where it grants no reads;
4. acceptor -> dialler :class:`CrossMemoryAnswer`: whether its probe read the token back.

The NIXL transport's dialler announces a :class:`MemoryProbe` in its HELLO's channel too (``cross_memory``).
JSON objects, both ends build and read them here: a key a peer does not know is ignored, a missing or
malformed field reads as "no reads" (the connection keeps the rings), bytes that are not JSON are a
ProtocolError. They follow the deployment-secret handshake (auth_handshake.py), which carries
PROTOCOL_VERSION: a peer of another version never reaches them, and a change to them bumps it (version.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_pd.errors import ProtocolError


@dataclass(frozen=True)
class MemoryProbe:
    """What a peer needs to probe (and then read) a process's memory: who it is and where its token is."""

    pid: int
    boot: str  # the host's boot id: a pid of another host or boot means nothing here
    address: int  # of the token, in the announcing process
    token: bytes  # 16 random bytes the reader must read back

    def to_wire(self) -> dict[str, Any]:
        return {"pid": self.pid, "boot": self.boot, "probe": self.address, "token": self.token.hex()}

    @classmethod
    def from_wire(cls, info: Any) -> MemoryProbe | None:
        """The probe ``info`` announces, or None where it is none (not an object, a field missing or malformed)."""
        if not isinstance(info, dict):
            return None
        try:
            pid, address, token = int(info["pid"]), int(info["probe"]), bytes.fromhex(info["token"])
        except (KeyError, TypeError, ValueError):
            return None
        boot = info.get("boot")
        return cls(pid, boot if isinstance(boot, str) else "", address, token)


def _decode_object(payload: bytes, what: str) -> Any:
    """The JSON in ``payload`` (any JSON value); ProtocolError where it is not JSON."""
    try:
        return msgspec.json.decode(payload)
    except msgspec.DecodeError as e:
        raise ProtocolError(f"{what}: not JSON ({e})") from None


@dataclass(frozen=True)
class CrossMemoryOffer:
    """HELLO 3, dialler -> acceptor: read my memory, here is my probe (None: no reads granted)."""

    probe: MemoryProbe | None

    def encode(self) -> bytes:
        return msgspec.json.encode({"cross_memory": self.probe.to_wire() if self.probe is not None else None})

    @classmethod
    def decode(cls, payload: bytes) -> CrossMemoryOffer:
        info = _decode_object(payload, "cross-memory offer")
        return cls(MemoryProbe.from_wire(info.get("cross_memory")) if isinstance(info, dict) else None)


@dataclass(frozen=True)
class CrossMemoryAnswer:
    """HELLO 4, acceptor -> dialler: whether the acceptor's probe of the dialler's memory worked."""

    reads_you: bool

    def encode(self) -> bytes:
        return msgspec.json.encode({"reads_you": self.reads_you})

    @classmethod
    def decode(cls, payload: bytes) -> CrossMemoryAnswer:
        info = _decode_object(payload, "cross-memory answer")
        return cls(isinstance(info, dict) and info.get("reads_you") is True)
