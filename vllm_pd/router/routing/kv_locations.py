"""Which instance holds which prompt blocks, learnt from vLLM's own KV events.

vLLM publishes every block its prefix cache gains or drops
(``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:PORT"}'``): ZMQ PUB multipart messages ``(topic, seq as
8-byte big-endian, msgpack KVEventBatch)``, a batch being ``[ts, [event, ...],
dp_rank]`` and each event a map tagged ``type`` = BlockStored / BlockRemoved /
AllBlocksCleared. The batches are decoded generically (msgpack to Python
objects), not through vLLM's classes: the proxy does not import vLLM, and
fields vLLM adds later are ignored.

The index is a hint, never a promise: a missed event (a sequence gap, a
restarted server) makes it forget that instance's blocks, and a block it still
believes in but vLLM evicted only means the chosen instance recomputes. Blocks
whose extra keys hold a multimodal input or prompt embeddings are not kept:
the proxy never hashes such requests (kv_extra_keys.py), so they could never
match. A LoRA adapter's or a salted request's blocks are kept: their hashes
carry the adapter and salt, and so do the proxy's for such a request.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vllm_pd.router.request.block_hashes import BlockHash, PromptBlocks, VllmBlockHasher, external_hash

logger = logging.getLogger(__name__)

MAX_BLOCKS_PER_INSTANCE = 4_000_000  # ~ 4M x 8 B keys; beyond it the instance's index is reset


@dataclass
class _Held:
    blocks: set[BlockHash] = field(default_factory=set)
    block_size: int | None = None
    next_seq: int | None = None


def _hashable_here(block_extra: Any) -> bool:
    """A block's extra keys as vLLM publishes them (untagged: the adapter's name and the cache salt
    as bare strings, a multimodal input as an (identifier, offset) pair, prompt embeddings as a
    digest): whether the proxy can hash a request with them (strings only)."""
    return block_extra is None or (
        isinstance(block_extra, (list, tuple)) and all(isinstance(k, str) for k in block_extra)
    )


class KvLocations:
    """Per instance, the prefix-cache blocks its KV events announced. Thread-safe: the
    subscriber thread applies events while the event loop reads."""

    def __init__(self, hasher: VllmBlockHasher) -> None:
        self.hasher = hasher
        self._held: dict[str, _Held] = {}
        self._lock = threading.Lock()
        self._checked_hash = False
        self.hash_mismatch = False  # the servers hash blocks differently than configured here

    def apply_message(self, instance: str, seq: int, payload: bytes) -> None:
        """One published message; a gap in ``seq`` drops what was known (events were missed)."""
        try:
            batch = msgspec.msgpack.decode(payload)
            events = batch[1]
        except (msgspec.DecodeError, IndexError, TypeError, KeyError):
            logger.warning("undecodable KV event batch from %s dropped", instance)
            return
        with self._lock:
            held = self._held.setdefault(instance, _Held())
            if held.next_seq is not None and seq != held.next_seq:
                logger.info(
                    "KV events from %s: expected seq %d, got %d; forgetting its blocks", instance, held.next_seq, seq
                )
                held.blocks.clear()
            held.next_seq = seq + 1
            for event in events:
                if isinstance(event, dict):
                    self._apply(held, event)
            if len(held.blocks) > MAX_BLOCKS_PER_INSTANCE:
                held.blocks.clear()

    def _apply(self, held: _Held, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "BlockStored":
            extra = event.get("extra_keys") or ()
            if any(not _hashable_here(k) for k in extra):
                return
            hashes = event.get("block_hashes") or []
            held.block_size = event.get("block_size") or held.block_size
            plain = event.get("lora_name") is None and not any(extra)
            if (
                not self._checked_hash
                and plain
                and event.get("parent_block_hash") is None
                and hashes
                and held.block_size
            ):
                self._check_hash(hashes[0], event.get("token_ids") or [], held.block_size)
            held.blocks.update(external_hash(h) for h in hashes)
        elif kind == "BlockRemoved":
            held.blocks.difference_update(external_hash(h) for h in event.get("block_hashes") or [])
        elif kind == "AllBlocksCleared":
            held.blocks.clear()

    def _check_hash(self, first: bytes | int, token_ids: list[int], block_size: int) -> None:
        """A first block carries its tokens: recompute its hash once to catch a mismatched
        --prefix-caching-hash-algo or PYTHONHASHSEED (routing would silently never hit)."""
        if len(token_ids) < block_size:
            return
        self._checked_hash = True
        mine = self.hasher.hashes(token_ids[:block_size], block_size)[0]
        if external_hash(mine) != external_hash(first):
            self.hash_mismatch = True
            logger.warning(
                "vLLM's block hashes differ from the proxy's (kv_hash_algo=%s, seed %r): start the "
                "servers with --prefix-caching-hash-algo %s and the same PYTHONHASHSEED as the proxy; "
                "until then kv_aware routes by load only",
                self.hasher.algo,
                self.hasher.seed,
                self.hasher.algo,
            )

    def forget(self, instance: str) -> None:
        with self._lock:
            self._held.pop(instance, None)

    def cached_tokens(self, instance: str, blocks: PromptBlocks) -> int:
        """Prompt tokens the instance holds as a leading run of full blocks (0 if unknown)."""
        held = self._held.get(instance)
        if held is None or not held.block_size:
            return 0
        n = 0
        with self._lock:
            for h in blocks.hashes(held.block_size):
                if h not in held.blocks:
                    break
                n += 1
        return n * held.block_size

    def holds_prompt(self, instance: str, blocks: PromptBlocks | None) -> bool:
        """Whether the instance holds every full block of the prompt (the tail it computes itself)."""
        size = self.block_size(instance)
        if blocks is None or not size:
            return False
        full = len(blocks.token_ids) // size * size
        return full > 0 and self.cached_tokens(instance, blocks) >= full

    def block_size(self, instance: str) -> int | None:
        held = self._held.get(instance)
        return held.block_size if held else None

    def instances(self) -> Iterable[str]:
        with self._lock:
            return list(self._held)
