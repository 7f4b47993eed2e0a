"""vLLM's prefix-cache block hashes of a prompt, as the proxy computes them without vLLM.

Block hashes follow ``vllm.v1.core.kv_cache_utils.hash_block_tokens``:
``h[i] = H((h[i-1], tuple(block_i), extra_i))`` with ``h[-1] = NONE_HASH =
H(seed)``; ``H`` is vLLM's ``--prefix-caching-hash-algo``: ``sha256`` (pickle,
vLLM 0.32's default) or ``sha256_cbor``. The seed is ``PYTHONHASHSEED`` when
set, else vLLM's fixed ``"vllm-none-hash"``: with both algorithms the hashes
are the same in every process, so the servers and the proxy must simply agree
on the algorithm and on PYTHONHASHSEED. (The xxhash algorithms seed randomly
per process unless PYTHONHASHSEED is set; they are not supported here.)
``extra_i`` are block i's extra keys (the LoRA adapter, the cache salt on
block 0), as kv_extra_keys.py derives them from the body: the same tuples
vLLM hashes, so the proxy's hashes (and the store keys, store_locations.py)
of an adapter's or a salted request are the instances' own.
"""

from __future__ import annotations

import hashlib
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_pd.errors import ConfigError
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, BlockExtraKeys, RequestExtraKeys

HASH_ALGOS = ("sha256", "sha256_cbor")
VLLM_DEFAULT_SEED = "vllm-none-hash"  # vllm.v1.core.kv_cache_utils.DEFAULT_NONE_HASH_SEED
BlockHash = int  # the low 64 bits of vLLM's block hash (what VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES publishes)


def external_hash(h: bytes | int) -> BlockHash:
    """vLLM's hash in the form the index keys on, whether an event carried bytes or an int
    (``maybe_convert_block_hash``: big-endian, low 64 bits)."""
    if isinstance(h, int):
        return h & ((1 << 64) - 1)
    return int.from_bytes(h[-8:], "big")


def _sha256_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def _sha256_cbor(obj: Any) -> bytes:
    import cbor2  # a vLLM dependency; only this algorithm needs it

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


class VllmBlockHasher:
    """vLLM's prefix-cache block hashes of a token sequence (full blocks only)."""

    def __init__(self, algo: str = "sha256", seed: str | None = None) -> None:
        if algo not in HASH_ALGOS:
            raise ConfigError(f"kv_hash_algo: {algo!r} is not one of {HASH_ALGOS}")
        self.algo = algo
        self._fn: Callable[[Any], bytes] = _sha256_pickle if algo == "sha256" else _sha256_cbor
        self.seed = seed if seed is not None else os.environ.get("PYTHONHASHSEED", VLLM_DEFAULT_SEED)
        self.none_hash = self._fn(self.seed)

    def hashes(
        self,
        token_ids: Sequence[int],
        block_size: int,
        parent: bytes | None = None,
        extra_keys: Sequence[BlockExtraKeys] | None = None,
    ) -> list[bytes]:
        """Full vLLM hashes (bytes) of each full block; ``parent`` continues a chain;
        ``extra_keys[i]``: block i's extra keys (None: no block has any)."""
        out: list[bytes] = []
        prev = parent if parent else self.none_hash
        for i, start in enumerate(range(0, len(token_ids) // block_size * block_size, block_size)):
            extra = extra_keys[i] if extra_keys is not None else None
            prev = self._fn((prev, tuple(token_ids[start : start + block_size]), extra))
            out.append(prev)
        return out


@dataclass
class PromptBlocks:
    """One request's prompt tokens, its extra keys and, per block size asked for, its block hashes."""

    token_ids: list[int]
    hasher: VllmBlockHasher
    _by_size: dict[int, list[BlockHash]]
    extra_keys: RequestExtraKeys = NO_EXTRA_KEYS

    def hashes(self, block_size: int) -> list[BlockHash]:
        got = self._by_size.get(block_size)
        if got is None:
            n = len(self.token_ids) // block_size
            extra = self.extra_keys.blocks(0, n, block_size)
            got = [external_hash(h) for h in self.hasher.hashes(self.token_ids, block_size, extra_keys=extra)]
            self._by_size[block_size] = got
        return got
