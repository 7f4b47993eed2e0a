"""Control messages carried by ``Transport.notify`` (tiny, msgspec-encoded)."""

from __future__ import annotations

import msgspec


class ReleaseMessage(msgspec.Struct, tag="release", frozen=True):
    """Decode (or the proxy) -> prefill: the held KV of this transfer is not needed any more."""

    transfer_id: str

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


ControlMessage = ReleaseMessage  # a Union as more kinds appear

_decoder = msgspec.msgpack.Decoder(ControlMessage)


def decode_control(data: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError on anything that is not a known message."""
    return _decoder.decode(data)
