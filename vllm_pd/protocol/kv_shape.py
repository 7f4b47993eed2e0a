"""An instance's KV cache shape as the two sides of a transfer tell each other.

A :class:`KVShape` says what one instance's KV cache looks like across its TP ranks: TP
size, the model's KV heads, its KV cache groups (each a :class:`KVGroup`: kind, block size,
the format of one rank's block) and the group of each layer. Prefill's travels in its
``kv_transfer_params`` (``transfer_params.RemotePrefill.shape``); decode's answers prefill's
:class:`ShapeQuery` (a control message), msgpack-encoded (:func:`encode_shape`). What the
fields mean and how decode takes its share of another shape: ``connector/device/kv_geometry.py``.

A recurrent state group (Mamba, linear attention) also tells how its state block is sharded over
TP ranks (:class:`StateLayout`, made from vLLM's state shapes by ``connector/state_layout.py``): a
state is sharded unlike attention's heads, and decode of another TP needs that to take its share.
"""

from __future__ import annotations

from typing import Literal

import msgspec

GroupKind = Literal["full", "window", "state"]


class StateSegment(msgspec.Struct, frozen=True):
    """A run of a state row sharded by one rule: ``shards`` units of the whole model (heads,
    groups), each ``unit_nbytes`` bytes of the row; a rank holds vLLM's share of the units
    (``kv_geometry.rank_heads``: a window of them, or the one unit it replicates), consecutively."""

    shards: int
    unit_nbytes: int


class StatePart(msgspec.Struct, frozen=True):
    """One state tensor of a layer (e.g. Mamba's conv state, then its SSM state): ``rows`` rows one
    after the other, each row the concatenation of its segments' shares on the rank."""

    dtype: str  # the tensor's dtype, as torch names it
    rows: int
    segments: tuple[StateSegment, ...]


class StateLayout(msgspec.Struct, frozen=True):
    """How one layer's state block is sharded over TP ranks, whole-model sizes: its parts one after
    the other (vLLM packs a layer's state tensors into one page). Equal on every TP size of a model."""

    kind: str  # which vLLM state it describes (e.g. "mamba2"), for the reason of a refusal
    parts: tuple[StatePart, ...]


class KVGroup(msgspec.Struct, frozen=True):
    """One KV cache group of an instance, as one TP rank holds it."""

    kind: GroupKind
    block_size: int  # tokens per block the scheduler hands out
    block_format: str  # kv_layout.block_format of its layers' blocks on one rank
    window: int = 0  # sliding window in tokens (kind "window")
    state: StateLayout | None = None  # kind "state": how its block is sharded (None: not known)


class KVShape(msgspec.Struct, frozen=True):
    """What one instance's KV cache looks like across its TP ranks."""

    tp_size: int
    kv_heads: int  # KV heads of the whole model (1: MLA's latent, on every rank)
    groups: tuple[KVGroup, ...]
    layer_groups: tuple[int, ...]  # the group of each layer, in layer order

    def group_of(self, layer: int) -> KVGroup:
        return self.groups[self.layer_groups[layer]]


class ShapeQuery(msgspec.Struct, tag="shape_query", frozen=True):
    """Prefill -> decode (a control message), before pushing to it or announcing to it: decode
    answers with its msgpack-encoded :class:`KVShape`."""

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)


def encode_shape(shape: KVShape) -> bytes:
    return msgspec.msgpack.encode(shape)


def decode_shape(data: bytes) -> KVShape:
    """msgspec.DecodeError / ValidationError if ``data`` is not a shape."""
    return msgspec.msgpack.decode(data, type=KVShape)
