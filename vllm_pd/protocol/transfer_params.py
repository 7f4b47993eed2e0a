"""The ``kv_transfer_params`` protocol between proxy, prefill and decode: every key, one place.

It is vLLM's standard PD flow (the one NixlConnector and vLLM's example proxies
speak), so those proxies work with this connector unchanged:

* proxy -> prefill (:class:`RemoteDecodeRequest`): ``{"do_remote_decode": true, ...}``;
  optionally ``"transfer_mode": "push"`` and ``"decode_endpoint": "tcp://host:port"``
  (ours: prefill then writes each layer's KV to decode while it computes the next one).
* prefill -> proxy (:class:`RemotePrefill`), passed verbatim to decode by the proxy.
* proxy -> decode, sent beside the prefill leg (:class:`AwaitedPrefill`): our proxy
  sends both legs at once, so decode's API work and scheduling overlap prefill's
  compute. It names the transfer itself: the same ``transfer_id`` in both legs is the
  transfer's id on prefill and decode alike. Prefill pushes under it (push mode) and,
  once its forward is done, announces its :class:`RemotePrefill` to decode, which
  checks it is the same prompt (``connector/step_specs.py``'s ``LocalPrompt``) before using a byte (and, in pull
  mode, reads the KV then).
* proxy -> prefill, in the prefill leg (:class:`StoreFetch`, ``"store_fetch"``): another
  node's KV store holds a longer prefix of the prompt than the prefill instance does; its
  store fetches those blocks from that node instead of asking the store master itself (a
  hint: a node that lost them costs a failed, verified fetch and a recompute).
* release: whoever drops prefill's KV (decode when done, the proxy when no decode will
  run) tells every TP rank of prefill (:meth:`RemotePrefill.release_endpoints`).

A transfer has one name, its ``transfer_id``: the proxy's where the proxy names it,
else prefill's request id. It travels as vLLM's ``remote_request_id`` in prefill's answer.

Parsing is strict: params that ask for something but are malformed raise
:class:`TransferParamsError` naming the key (also ``transfer_key``, version 1's second
name of a transfer, which is refused rather than ignored); the ``from_params`` helpers of the
connector's side log that and fall back (decode recomputes, which is always correct).

This module imports neither torch nor vLLM: the proxy imports it.
"""

from __future__ import annotations

import array
import sys
from typing import Annotated, Any, Literal, TypeVar, get_args

import msgspec

from vllm_pd.errors import ProtocolError
from vllm_pd.protocol.kv_shape import KVShape
from vllm_pd.protocol.version import PROTOCOL_VERSION
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

TransferMode = Literal["push", "pull"]
LoadMode = Literal["auto", "async", "layerwise"]

# vLLM's standard keys (NixlConnector's)
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
# ours: marks params produced by this connector, and which version of them (version.PROTOCOL_VERSION)
PROTOCOL_KEY = "vllm_pd"
# ours, on a decode leg: the load mode this request asks for instead of the instance's
LOAD_MODE = "load_mode"
# ours, on a prefill leg: the store node to fetch the prompt's leading blocks from (StoreFetch)
STORE_FETCH = "store_fetch"

# the key version 1 named a proxy-chosen transfer by: refused by name, never silently ignored
_RETIRED_TRANSFER_KEY = "transfer_key"

# what NixlConnector's proxies send on the prefill leg besides do_remote_decode
_NIXL_PREFILL_LEG = {
    DO_REMOTE_PREFILL: False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_Count = Annotated[int, msgspec.Meta(ge=0)]
_Positive = Annotated[int, msgspec.Meta(gt=0)]
_Name = Annotated[str, msgspec.Meta(min_length=1)]


class TransferParamsError(ProtocolError):
    """``kv_transfer_params`` that ask for a transfer but cannot be used; the message names the key."""


_S = TypeVar("_S", bound=msgspec.Struct)


def _convert(params: dict[str, Any], cls: type[_S], what: str) -> _S:
    if _RETIRED_TRANSFER_KEY in params:
        raise TransferParamsError(
            f"kv_transfer_params ({what}): `{_RETIRED_TRANSFER_KEY}` is not accepted any more; "
            f"the proxy names the transfer with `transfer_id` (protocol {PROTOCOL_VERSION})"
        )
    try:
        return msgspec.convert(params, cls)
    except msgspec.ValidationError as e:
        # msgspec names the key: "Expected `int`, got `str` - at `$.remote_port`"
        raise TransferParamsError(f"kv_transfer_params ({what}): {e}") from None


def _require_ours(params: dict[str, Any], what: str) -> None:
    version = params.get(PROTOCOL_KEY)
    if version == PROTOCOL_VERSION:
        return
    if isinstance(version, int) and not isinstance(version, bool):
        side = "an older" if version < PROTOCOL_VERSION else "a newer"
        raise TransferParamsError(
            f"kv_transfer_params ({what}): made by {side} vllm-pd ({PROTOCOL_KEY}={version}, "
            f"ours {PROTOCOL_VERSION}): run the same vllm-pd version on prefill and decode"
        )
    raise TransferParamsError(
        f"kv_transfer_params ({what}): {PROTOCOL_KEY}={version!r}, "
        f"expected {PROTOCOL_VERSION} (made by another connector or version?)"
    )


class RemoteDecodeRequest(msgspec.Struct, frozen=True, omit_defaults=True):
    """The prefill leg's ask (proxy -> prefill): keep the prompt's KV for a remote decode."""

    # None: the prefill instance's default_mode; push needs decode_endpoint (else it is pull)
    mode: TransferMode | None = msgspec.field(default=None, name="transfer_mode")
    decode_endpoint: _Name | None = None  # decode's KV endpoint of TP rank 0: push and announce there
    # the transfer's id, chosen by the proxy: a decode leg waits for prefill's announcement of it.
    # "": prefill names the transfer by its request id, and no decode leg waits
    transfer_id: str = ""

    def __post_init__(self) -> None:
        if self.transfer_id and self.decode_endpoint is None:
            raise TransferParamsError("transfer_id needs decode_endpoint (where to announce the KV)")

    @property
    def push_endpoint(self) -> str | None:
        """Where prefill pushes each layer (None: decode pulls). Of a :meth:`resolve`\\d ask."""
        return self.decode_endpoint if self.mode == "push" else None

    @property
    def announce_endpoint(self) -> str | None:
        """Where prefill announces the KV once computed (None: no decode leg waits for it)."""
        return self.decode_endpoint if self.transfer_id else None

    def resolve(self, default_mode: TransferMode) -> RemoteDecodeRequest:
        """This ask with the mode prefill will use: ``default_mode`` where the proxy did not say,
        and pull where there is no decode endpoint to push to."""
        mode = self.mode or default_mode
        if mode == "push" and self.decode_endpoint is None:
            mode = "pull"
        return msgspec.structs.replace(self, mode=mode)

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {DO_REMOTE_DECODE: True, **_NIXL_PREFILL_LEG}
        params.update(msgspec.to_builtins(self))
        return params

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemoteDecodeRequest | None:
        """None unless the params ask for a remote decode; TransferParamsError if malformed."""
        if not params or not params.get(DO_REMOTE_DECODE):
            return None
        return _convert(params, cls, "prefill leg")


class RemotePrefill(msgspec.Struct, frozen=True):
    """Prefill's answer (prefill -> proxy -> decode): where a decode instance finds a prompt's KV."""

    # the transfer's id: the proxy's (RemoteDecodeRequest.transfer_id), else prefill's request id
    transfer_id: _Name = msgspec.field(name="remote_request_id")
    engine_id: str = msgspec.field(name="remote_engine_id")
    endpoint: _Name = msgspec.field(name="remote_endpoint")  # prefill's KV endpoint of TP rank 0
    host: str = msgspec.field(name="remote_host")
    port: int = msgspec.field(name="remote_port")
    block_ids: tuple[_Count, ...] = msgspec.field(name="remote_block_ids")  # the prompt's blocks, in order
    num_tokens: _Count = msgspec.field(name="remote_num_tokens")  # prompt tokens whose KV prefill computed
    block_size: _Positive
    mode: TransferMode = msgspec.field(name="transfer_mode")  # push: the KV was (being) written to decode
    tp_size: _Positive = 1  # prefill's tensor-parallel size: each rank holds its own shard of the KV
    endpoints: tuple[_Name, ...] = msgspec.field(default=(), name="remote_endpoints")  # per TP rank
    prompt_hash: str = ""  # of the prompt token ids: decode checks it is the same prompt
    # what a block's bytes mean on prefill's side (kv_layout.block_format): decode checks it is its own
    kv_format: str = ""
    # prefill's KV shape (TP, heads, KV cache groups): decode takes its share from it (kv_shape)
    shape: KVShape | None = msgspec.field(default=None, name="kv_shape")
    # every KV cache group's blocks, where there are several (a hybrid model; block_ids is group 0's)
    group_block_ids: tuple[tuple[_Count, ...], ...] = msgspec.field(default=(), name="remote_group_block_ids")

    def __post_init__(self) -> None:
        if len(self.block_ids) < -(-self.num_tokens // self.block_size):
            raise TransferParamsError(
                f"remote_block_ids: {len(self.block_ids)} blocks cannot hold "
                f"{self.num_tokens} tokens of {self.block_size}"
            )
        if self.endpoints and len(self.endpoints) != self.tp_size:
            raise TransferParamsError(f"remote_endpoints: {len(self.endpoints)} endpoints for tp_size {self.tp_size}")
        if not self.endpoints and self.tp_size != 1:
            raise TransferParamsError(f"remote_endpoints: missing, needed for tp_size {self.tp_size}")
        if self.shape is not None and self.shape.tp_size != self.tp_size:
            raise TransferParamsError(f"kv_shape: tp_size {self.shape.tp_size} != tp_size {self.tp_size}")
        if self.group_block_ids and (self.shape is None or len(self.group_block_ids) != len(self.shape.groups)):
            raise TransferParamsError(
                f"remote_group_block_ids: {len(self.group_block_ids)} groups, kv_shape has "
                f"{len(self.shape.groups) if self.shape is not None else 'none'}"
            )

    def group_blocks(self, group: int) -> tuple[int, ...]:
        """Prefill's blocks of KV cache group ``group``, in prompt order."""
        return self.group_block_ids[group] if self.group_block_ids else self.block_ids

    @property
    def rank_endpoints(self) -> tuple[str, ...]:
        """Prefill's KV endpoint of each TP rank, rank order."""
        return self.endpoints or (self.endpoint,)

    def endpoint_for_rank(self, rank: int) -> str:
        return self.rank_endpoints[rank]

    def release_endpoints(self, rank: int = 0, tp_size: int = 1) -> tuple[str, ...]:
        """The prefill ranks a releaser's TP rank ``rank`` of ``tp_size`` tells to free this KV.

        The ranks of one releaser together reach every prefill rank exactly once: rank r
        releases prefill ranks r, r + tp_size, ... So the proxy (one process) releases all;
        a decode instance of prefill's TP size releases rank by rank, each after its own load."""
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank {rank} is not one of tp_size {tp_size}")
        return self.rank_endpoints[rank::tp_size]

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = msgspec.to_builtins(self)
        # lists, as JSON gives them back (to_builtins keeps tuples)
        params.update(
            {
                "remote_block_ids": list(self.block_ids),
                "remote_endpoints": list(self.endpoints),
                "remote_group_block_ids": [list(g) for g in self.group_block_ids],
                DO_REMOTE_PREFILL: True,
                DO_REMOTE_DECODE: False,
                PROTOCOL_KEY: PROTOCOL_VERSION,
            }
        )
        if self.shape is None:
            params.pop("kv_shape", None)
        return params

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """None unless the params name a remote prefill; TransferParamsError if malformed or not ours."""
        if not params or not params.get(DO_REMOTE_PREFILL):
            return None
        _require_ours(params, "prefill's answer")
        return _convert(params, cls, "prefill's answer")

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> RemotePrefill | None:
        """:meth:`parse`, logging malformed params and returning None for them: decode then
        computes the prompt itself, which is slower but always correct."""
        try:
            return cls.parse(params)
        except TransferParamsError as e:
            logger.warning("%s: the prompt is recomputed", e)
            return None


class AwaitedPrefill(msgspec.Struct, frozen=True, omit_defaults=True):
    """The decode leg sent beside the prefill leg (proxy -> decode): prefill announces its
    :class:`RemotePrefill` of ``transfer_id`` once computed. ``prefill_endpoints``: the KV
    endpoint(s) of the prefill instance the proxy sent the prefill leg to, where it knows them;
    decode probes it while the announcement is late (one that does not answer is given up on)."""

    transfer_id: _Name
    mode: TransferMode = msgspec.field(name="transfer_mode")
    prefill_endpoints: tuple[_Name, ...] = ()

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = msgspec.to_builtins(self)
        params.update({DO_REMOTE_PREFILL: True, DO_REMOTE_DECODE: False, PROTOCOL_KEY: PROTOCOL_VERSION})
        return params

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> AwaitedPrefill | None:
        """None unless these are awaited-prefill params (ours, naming no prefill request yet);
        TransferParamsError if malformed."""
        if (
            not params
            or not params.get(DO_REMOTE_PREFILL)
            or PROTOCOL_KEY not in params
            or "remote_request_id" in params
        ):
            return None
        _require_ours(params, "awaited prefill")
        return _convert(params, cls, "awaited prefill")


class StoreFetch(msgspec.Struct, frozen=True):
    """Where the proxy saw the prompt's KV in another node's store (proxy -> prefill).

    ``blocks``: the leading full blocks of the prompt that ``node`` holds, per the store
    master when the proxy asked; ``endpoint``: that node's store endpoint(s) (comma-separated
    per TP rank, as the master lists them)."""

    node: _Name
    endpoint: _Name
    blocks: _Positive

    def to_params(self) -> dict[str, Any]:
        return {STORE_FETCH: msgspec.to_builtins(self)}

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> StoreFetch | None:
        """The hint in ``params``, or None (none given, or malformed: logged, the store then asks
        its master itself as without a hint)."""
        raw = (params or {}).get(STORE_FETCH)
        if raw is None:
            return None
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as e:
            logger.warning("kv_transfer_params.%s ignored: %s", STORE_FETCH, e)
            return None


def parse_decode_leg(params: dict[str, Any] | None) -> RemotePrefill | AwaitedPrefill | None:
    """Where a decode leg's prompt KV comes from: prefill's answer, a prefill still computing
    (announced later), or nowhere (None: decode computes it). TransferParamsError if malformed."""
    awaited = AwaitedPrefill.parse(params)
    return awaited if awaited is not None else RemotePrefill.parse(params)


def requested_load_mode(params: dict[str, Any] | None, default: LoadMode) -> LoadMode:
    """The load mode a decode leg asks for (``load_mode``), else ``default``."""
    mode = (params or {}).get(LOAD_MODE, default)
    if mode not in get_args(LoadMode):
        logger.warning(
            "kv_transfer_params.%s=%r is not one of %s: using %s", LOAD_MODE, mode, list(get_args(LoadMode)), default
        )
        return default
    return mode  # type: ignore[no-any-return]


def asks_remote_decode(params: dict[str, Any] | None) -> bool:
    """The request is a prefill leg: its KV is for a decode elsewhere."""
    return bool(params and params.get(DO_REMOTE_DECODE))


def asks_remote_prefill(params: dict[str, Any] | None) -> bool:
    """The request is a decode leg whose prompt KV comes from a prefill elsewhere (not yet loaded)."""
    return bool(params and params.get(DO_REMOTE_PREFILL))


def mark_remote_prefill_taken(params: dict[str, Any]) -> None:
    """vLLM asks the connector about a request again (after its load, on preemption): a
    decode leg's params are marked so the remote prefill is taken only once."""
    params[DO_REMOTE_PREFILL] = False


def prompt_hash(token_ids: list[int] | tuple[int, ...]) -> str:
    """Deterministic digest of a prompt's token ids (same on every machine and process)."""
    ids = array.array("q", token_ids)
    if sys.byteorder != "little":
        ids.byteswap()  # the digest is of little-endian int64s everywhere
    # imported here, not at the top: the GPU data path imports this module, and a bare GPU
    # machine (benchmarks/gpu_check.py) has no blake3; only the scheduler side hashes prompts
    import blake3

    return blake3.blake3(ids.tobytes()).hexdigest()[:32]
