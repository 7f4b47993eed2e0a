"""A store node's fetch from another node's CPU pool: the control messages, on ``Transport.notify``.

1. ``GrantBlocks(keys, scope)`` asker -> holder; the holder answers ``BlocksGranted`` (the slots
   and commit-time checksums of the longest leading run of ``keys`` it holds for ``scope``, and
   the transfer id a fetch of exactly those slots is granted under);
2. the asker fetches those slots over the transport (its frames: frames.py);
3. ``ReleaseBlocks(transfer_id)`` -> ``Released(intact)``: the grant ends; ``intact`` leading slots
   were not overwritten since the grant.

msgpack, tagged (:data:`PeerMessage`). Who sends and serves them, and why each step:
connector/store/pool_exchange.py.
"""

from __future__ import annotations

import msgspec

from vllm_pd.protocol.block_keys import BlockKey


class GrantBlocks(msgspec.Struct, tag="grant"):
    """Asker -> holder: grant me a fetch of the longest leading run of ``keys`` you hold for ``scope``."""

    keys: list[BlockKey]
    scope: BlockKey


class BlocksGranted(msgspec.Struct, tag="granted"):
    transfer_id: str
    slots: list[int]  # of the leading keys held, in order (may be empty)
    sums: list[bytes]  # commit-time checksums of those slots' bytes


class ReleaseBlocks(msgspec.Struct, tag="release"):
    transfer_id: str


class Released(msgspec.Struct, tag="released"):
    intact: int  # leading granted slots not overwritten (not even started) since the grant


PeerMessage = GrantBlocks | BlocksGranted | ReleaseBlocks | Released
