"""The HELLO frame's payload: what each end of a stream transport's connection says first.

After the deployment-secret handshake (auth_handshake.py) the dialler sends a HELLO frame
(frames.py, ``Kind.HELLO``) and the acceptor answers with one: a JSON object naming the
sender's KV endpoint and what its block channel announces (the shm ring it writes, NIXL's
agent and region layouts; nothing for tcp). Both ends build and read it here
(transport/stream.py, transport/peer_link.py). Keys a peer does not know are ignored; a
missing key reads as its default (the test harnesses' minimal HELLOs rely on it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_pd.errors import ProtocolError


@dataclass(frozen=True)
class HelloPayload:
    """One end's HELLO: its endpoint and its block channel's announcement."""

    endpoint: str = ""  # where the sender serves ("": it serves nothing, a transport that only dials)
    channel: dict[str, Any] = field(default_factory=dict)  # the block channel's ``local_info()``

    def encode(self) -> bytes:
        return msgspec.json.encode({"endpoint": self.endpoint, "channel": self.channel})

    @classmethod
    def decode(cls, payload: bytes) -> HelloPayload:
        """The HELLO in ``payload``; ProtocolError naming what is wrong (not JSON, not an object, a field's type)."""
        try:
            info = msgspec.json.decode(payload)
        except msgspec.DecodeError as e:
            raise ProtocolError(f"HELLO: not JSON ({e})") from None
        if not isinstance(info, dict):
            raise ProtocolError(f"HELLO: not a JSON object (a {type(info).__name__})")
        endpoint = info.get("endpoint", "")
        if not isinstance(endpoint, str):
            raise ProtocolError(f"HELLO: 'endpoint' must be a string, got {type(endpoint).__name__}")
        channel = info.get("channel", {})
        if not isinstance(channel, dict):
            raise ProtocolError(f"HELLO: 'channel' must be an object, got {type(channel).__name__}")
        return cls(endpoint, channel)
