"""The ``kv_transfer_params`` protocol between proxy, prefill and decode.

It is vLLM's standard PD flow (the one NixlConnector and vLLM's example proxies
speak), so those proxies work with this connector unchanged:

* proxy -> prefill: ``{"do_remote_decode": true, ...}``; optionally
  ``"transfer_mode": "push"`` and ``"decode_endpoint": "tcp://host:port"`` (ours:
  prefill then writes each layer's KV to decode while it computes the next one).
* prefill -> proxy (response), passed verbatim to decode by the proxy:
  :meth:`RemotePrefill.to_params`.

Our proxy sends both legs at once, so decode's API work and scheduling
overlap prefill's compute: it names the transfer with a ``transfer_key`` in both
legs (:func:`awaited_prefill_params` on the decode leg) and gives prefill decode's
endpoint; prefill pushes under that key (push mode) and, once its forward is
done, announces its :class:`RemotePrefill` to decode (``PrefillDoneMessage``),
which checks it is the same prompt before using a byte (and, in pull mode,
reads the KV then).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import blake3
import numpy as np

from vllm_pd.connector.config import TransferMode
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

PROTOCOL_KEY = "vllm_pd"  # marks params produced by this connector
PROTOCOL_VERSION = 1


@dataclass(frozen=True)
class RemoteDecodeRequest:
    """What the proxy asked of a prefill instance."""

    mode: TransferMode
    decode_endpoint: str | None  # where to push (push mode)
    transfer_key: str = ""  # names the transfer on decode (proxy-chosen); "" = prefill's request id
    # a decode leg waits there for prefill's announcement (sent beside this leg)
    announce_endpoint: str | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any] | None, default_mode: TransferMode) -> "RemoteDecodeRequest | None":
        if not params or not params.get("do_remote_decode"):
            return None
        endpoint = params.get("decode_endpoint")
        mode = params.get("transfer_mode") or default_mode
        if mode not in ("push", "pull"):
            logger.warning("kv_transfer_params.transfer_mode %r unknown; using pull", mode)
            mode = "pull"
        if mode == "push" and not isinstance(endpoint, str):
            # no decode endpoint to push to: decode pulls instead
            mode = "pull"
        key = params.get("transfer_key")
        key = key if isinstance(key, str) and isinstance(endpoint, str) else ""
        return cls(mode=mode, decode_endpoint=endpoint if mode == "push" else None,
                   transfer_key=key, announce_endpoint=endpoint if key else None)


@dataclass(frozen=True)
class RemotePrefill:
    """Where a decode instance finds a prompt's KV, as prefill reported it."""

    transfer_id: str  # the prefill instance's request id
    engine_id: str
    endpoint: str  # prefill's KV endpoint of TP rank 0 (fetch from here, send release here)
    host: str
    port: int
    block_ids: tuple[int, ...]  # prefill's blocks holding the prompt, in order
    num_tokens: int  # prompt tokens whose KV prefill computed
    block_size: int
    mode: TransferMode  # push: the KV was (being) written to our staging memory
    tp_size: int = 1
    endpoints: tuple[str, ...] = ()  # per TP rank; () = (endpoint,)
    prompt_hash: str = ""  # of the prompt token ids: decode checks it is the same prompt
    transfer_key: str = ""  # the pushed blocks' name on decode; "" = transfer_id

    @property
    def staging_key(self) -> str:
        return self.transfer_key or self.transfer_id

    def endpoint_for_rank(self, rank: int) -> str:
        eps = self.endpoints or (self.endpoint,)
        return eps[rank]

    def to_params(self) -> dict[str, Any]:
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.transfer_id,
            "remote_host": self.host,
            "remote_port": self.port,
            "remote_block_ids": list(self.block_ids),
            "remote_num_tokens": self.num_tokens,
            "tp_size": self.tp_size,
            "transfer_mode": self.mode,
            "remote_endpoint": self.endpoint,
            "block_size": self.block_size,
            "remote_endpoints": list(self.endpoints),
            "prompt_hash": self.prompt_hash,
            "transfer_key": self.transfer_key,
            PROTOCOL_KEY: PROTOCOL_VERSION,
        }

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> "RemotePrefill | None":
        """Parse decode-side params; None if they are not a remote prefill of ours.

        Malformed params are logged and ignored: decode then computes the prompt
        itself, which is slower but always correct.
        """
        if not params or not params.get("do_remote_prefill"):
            return None
        if params.get(PROTOCOL_KEY) != PROTOCOL_VERSION:
            logger.warning("kv_transfer_params without %s=%d (from another connector?): ignored",
                           PROTOCOL_KEY, PROTOCOL_VERSION)
            return None
        try:
            block_ids = tuple(int(b) for b in params["remote_block_ids"])
            rp = cls(
                transfer_id=str(params["remote_request_id"]),
                engine_id=str(params["remote_engine_id"]),
                endpoint=str(params["remote_endpoint"]),
                host=str(params["remote_host"]),
                port=int(params["remote_port"]),
                block_ids=block_ids,
                num_tokens=int(params["remote_num_tokens"]),
                block_size=int(params["block_size"]),
                mode=params.get("transfer_mode", "pull"),
                tp_size=int(params.get("tp_size", 1)),
                endpoints=tuple(str(e) for e in params.get("remote_endpoints") or ()),
                prompt_hash=str(params.get("prompt_hash", "")),
                transfer_key=str(params.get("transfer_key") or ""),
            )
        except (KeyError, TypeError, ValueError) as e:
            logger.warning("malformed kv_transfer_params %r (%s): decode recomputes the prompt", params, e)
            return None
        if rp.mode not in ("push", "pull") or rp.num_tokens < 0 or rp.block_size <= 0:
            logger.warning("invalid kv_transfer_params %r: decode recomputes the prompt", params)
            return None
        if len(rp.block_ids) < -(-rp.num_tokens // rp.block_size):
            logger.warning("kv_transfer_params name too few blocks for %d tokens: recompute", rp.num_tokens)
            return None
        return rp


@dataclass(frozen=True)
class LocalPrompt:
    """What decode knows of a request's prompt, to check remote KV is really for it."""

    prompt_hash: str
    num_tokens: int
    block_size: int
    tp_size: int

    def mismatch(self, remote: RemotePrefill) -> str | None:
        """Why ``remote``'s KV cannot be used for this prompt, or None if it can."""
        if remote.block_size != self.block_size:
            return f"block size {remote.block_size} != ours {self.block_size}"
        if remote.tp_size != self.tp_size:
            return f"prefill TP {remote.tp_size} != ours {self.tp_size}"
        if remote.prompt_hash and remote.prompt_hash != self.prompt_hash:
            return "prompt differs from the one prefill computed"
        return None


@dataclass(frozen=True)
class AwaitedPrefill:
    """Decode leg sent while prefill still computes: prefill announces its KV under ``transfer_key``."""

    transfer_key: str

    @classmethod
    def from_params(cls, params: dict[str, Any] | None) -> "AwaitedPrefill | None":
        if (not params or not params.get("do_remote_prefill") or params.get(PROTOCOL_KEY) != PROTOCOL_VERSION
                or "remote_request_id" in params):
            return None
        key = params.get("transfer_key")
        if params.get("transfer_mode") not in ("push", "pull") or not isinstance(key, str) or not key:
            logger.warning("kv_transfer_params %r name no prefill and no transfer_key: decode recomputes", params)
            return None
        return cls(key)


def awaited_prefill_params(transfer_key: str, mode: TransferMode) -> dict[str, Any]:
    """The decode leg's ``kv_transfer_params`` when it is sent beside the prefill leg."""
    return {"do_remote_prefill": True, "do_remote_decode": False, "transfer_mode": mode,
            "transfer_key": transfer_key, PROTOCOL_KEY: PROTOCOL_VERSION}


def prompt_hash(token_ids: "list[int] | tuple[int, ...]") -> str:
    """Deterministic digest of a prompt's token ids (same on every machine)."""
    return blake3.blake3(np.asarray(token_ids, dtype=np.int64).tobytes()).hexdigest()[:32]
