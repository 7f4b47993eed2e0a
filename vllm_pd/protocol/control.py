"""Control messages carried by ``Transport.notify`` (tiny, msgspec-encoded)."""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_pd.protocol.kv_shape import ShapeQuery


class ReleaseMessage(msgspec.Struct, tag="release", frozen=True):
    """Decode (or the proxy) -> prefill: the held KV of this transfer is not needed any more.

    Where several decode ranks read one prefill rank (decode of a larger TP), each says so
    (``releaser``: its TP rank) and prefill frees its blocks once all ``of`` of them did;
    ``releaser`` -1: free them now (the proxy; a decode rank that read nothing)."""

    transfer_id: str
    releaser: int = -1
    of: int = 1

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


class PrefillDoneMessage(msgspec.Struct, tag="prefill_done", frozen=True):
    """Prefill -> decode, after the forward that computed the prompt's last layer:
    what was pushed under ``transfer_id`` (``RemotePrefill.to_params()``), so a decode
    request that was sent before prefill finished can check and claim it."""

    transfer_id: str
    params: dict[str, Any]

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


class PingMessage(msgspec.Struct, tag="ping", frozen=True):
    """Decode -> prefill, when pushed KV stalled: is prefill still there (answered by its
    transport threads, so a busy engine answers too)."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


ControlMessage = ReleaseMessage | PrefillDoneMessage | PingMessage | ShapeQuery

_decoder = msgspec.msgpack.Decoder(ControlMessage)


def decode_control(data: bytes) -> ControlMessage:
    """Raises msgspec.DecodeError on anything that is not a known message."""
    message: ControlMessage = _decoder.decode(data)
    return message
