"""Block keys: chained content hashes of token-id blocks and their extra keys, salted with the KV format.

``key[i] = blake3(key[i-1] || token_ids[i*B:(i+1)*B] as little-endian u32 || extra(i))``
truncated to 16 bytes, with ``key[-1]`` = the salt digest. ``extra(i)`` is block
i's *extra keys*, the very set vLLM's prefix cache hashes with a block's tokens
(``vllm.v1.core.kv_cache_utils.generate_block_hash_extra_keys``): the LoRA
adapter ``("lora", name, path)`` on every block of an adapter's request,
``("mm", identifier, offset)`` for each multimodal input in the block,
``("cache_salt", salt)`` on block 0, ``("prompt_embeds", digest)``; encoded as
canonical msgpack, and empty for a block without any (so keys of plain requests
are what they always were). A key therefore names its whole prefix: two
sequences share ``key[i]`` only if their first ``i+1`` blocks are equal, with
equal extra keys, *and* their KV was produced under the same salt (model,
dtype, KV layout, block size, parallel layout): requests of two adapters, two
cache salts or two images never share a block.

Why not vLLM's own block hashes (``Request.block_hashes``): they chain from
``NONE_HASH``, which is random per process for the xxhash algorithms unless
PYTHONHASHSEED is set, and follows PYTHONHASHSEED for every algorithm; the
default ``sha256`` hashes a pickle (the bytes of Python's pickler); they exist
only with prefix caching on or a connector, at the scheduler's hash block size
(not always the KV block size); and they carry no model or KV format, so a
salt would have to be hashed over them anyway. The store's keys must be equal
on every node of a cluster, across restarts (the disk tier) and in the proxy,
so they are our own blake3 over fixed encodings, with vLLM's extra keys in
them. Python's ``hash()`` is salted per process (PYTHONHASHSEED), the most
reported "0 hits" bug of peer stores.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import blake3
import msgspec
import numpy as np

from vllm_pd.errors import StoreError

KEY_BYTES = 16  # 128 bits: collision odds ~2^-64 even at 2^32 stored blocks

BlockKey = bytes  # KEY_BYTES long

# One block's extra keys as vLLM derives them (generate_block_hash_extra_keys): a tuple of
# tagged tuples of str / int / bytes, or None when the block has none.
BlockExtraKeys = tuple[Any, ...] | None


@dataclass(frozen=True)
class KeySalt:
    """Everything besides the tokens that decides the bytes of a KV block."""

    model: str
    dtype: str  # KV cache dtype, e.g. "bfloat16", "fp8_e4m3"
    kv_layout: str  # e.g. "cpu:[blocks,heads,block_size,2*head]" or "flash:[2,blocks,...]"
    block_size: int  # tokens per block
    num_layers: int
    tp_size: int = 1
    pp_size: int = 1
    extra: str = ""  # anything else that changes every block of this node ("" = none); a request's
    # adapter, cache salt and multimodal inputs are its extra keys (RequestExtraKeys), not the salt's

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise StoreError(f"block_size must be > 0, got {self.block_size}")
        if self.num_layers <= 0:
            raise StoreError(f"num_layers must be > 0, got {self.num_layers}")
        if self.tp_size <= 0 or self.pp_size <= 0:
            raise StoreError(f"tp_size/pp_size must be > 0, got {self.tp_size}/{self.pp_size}")

    def digest(self) -> BlockKey:
        """The chain's root: a fixed, field-named text encoding (no repr of floats/None)."""
        text = "\x1f".join(
            f"{name}={getattr(self, name)}"
            for name in ("model", "dtype", "kv_layout", "block_size", "num_layers", "tp_size", "pp_size", "extra")
        )
        return blake3.blake3(b"vllm-pd/kv-block/v1\x00" + text.encode()).digest(length=KEY_BYTES)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian u32 bytes; ids outside [0, 2^32) are an error."""
    arr = np.asarray(token_ids, dtype=np.int64)
    if arr.ndim != 1:
        raise StoreError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise StoreError("token ids must be in [0, 2^32)")
    return arr.astype("<u4").tobytes()


def extra_key_bytes(extra: BlockExtraKeys) -> bytes:
    """A block's extra keys as hashed into its key: b"" for none, else canonical msgpack
    (a tuple is an array, str / int / bytes are themselves; anything else is a TypeError,
    never a silently different encoding)."""
    if extra is None:
        return b""
    return msgspec.msgpack.encode(extra)


@dataclass(frozen=True)
class RequestExtraKeys:
    """What besides its tokens decides a request's KV: its LoRA adapter, its cache salt and,
    through ``per_block``, its multimodal inputs (any extra key vLLM derives).

    ``per_block(start, end)``: the extra keys of the block of tokens [start, end), where the
    caller has vLLM's Request (the engine: vLLM's own generate_block_hash_extra_keys). Without
    it (the proxy, which has only the body) they are derived here from ``lora`` and
    ``cache_salt`` exactly as vLLM does for a request without multimodal inputs or prompt
    embeddings (tests/unit/store/test_store_key_extras.py compares both on real vLLM Requests).
    ``varies_by_block`` False: every block after the first has the extra keys of the second
    (no multimodal input, no prompt embeddings: only the adapter is left after block 0), so
    ``encoded`` asks ``per_block`` twice, not once per block (a 128K-token prompt has 8K)."""

    lora: tuple[str, str] | None = None  # (name, path) as vLLM's LoRARequest has them
    cache_salt: str | None = None
    per_block: Callable[[int, int], BlockExtraKeys] | None = None
    varies_by_block: bool = False

    def block(self, index: int, block_size: int) -> BlockExtraKeys:
        start = index * block_size
        if self.per_block is not None:
            return self.per_block(start, start + block_size)
        keys: list[tuple[str, ...]] = [("lora", *self.lora)] if self.lora is not None else []
        if index == 0 and self.cache_salt:  # vLLM: the first block only (the chain carries it on)
            keys.append(("cache_salt", self.cache_salt))
        return tuple(keys) if keys else None

    def blocks(self, first: int, count: int, block_size: int) -> list[BlockExtraKeys] | None:
        """Extra keys of blocks ``first .. first + count - 1``; None when the request has none."""
        if not self:
            return None
        return [self.block(i, block_size) for i in range(first, first + count)]

    def encoded(self, first: int, count: int, block_size: int) -> list[bytes] | None:
        """``blocks`` as chain_keys hashes them (extra_key_bytes); None when the request has none."""
        if not self:
            return None
        if self.varies_by_block:
            return [extra_key_bytes(e) for e in self.blocks(first, count, block_size) or []]
        later = extra_key_bytes(self.block(1, block_size))
        return [extra_key_bytes(self.block(0, block_size)) if i == 0 else later for i in range(first, first + count)]

    def scope(self, salt: KeySalt) -> BlockKey:
        """Names the adapter and cache salt a block was written for, under ``salt``: recorded with
        every stored block and compared on every lookup (defence in depth: keys already differ)."""
        ident = msgspec.msgpack.encode((self.lora, self.cache_salt or None))
        return blake3.blake3(b"vllm-pd/kv-scope/v1\x00" + salt.digest() + ident).digest(length=KEY_BYTES)

    def __bool__(self) -> bool:
        return self.lora is not None or bool(self.cache_salt) or self.per_block is not None


NO_EXTRA_KEYS = RequestExtraKeys()


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    salt: KeySalt,
    parent: BlockKey | None = None,
    max_blocks: int | None = None,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (a partial tail block has no key).

    ``parent`` continues an existing chain (``token_ids`` then start at a block
    boundary after it); default: the salt root. ``max_blocks`` stops early.
    ``extra_keys[i]``: block i's extra keys, encoded (RequestExtraKeys.encoded; None: no block
    has any).
    """
    data = token_bytes(token_ids)
    step = salt.block_size * 4
    n = len(data) // step
    if max_blocks is not None:
        n = min(n, max_blocks)
    if extra_keys is not None and len(extra_keys) < n:
        raise StoreError(f"extra keys for {len(extra_keys)} blocks, {n} blocks to hash")
    prev = salt.digest() if parent is None else parent
    keys: list[BlockKey] = []
    hasher = blake3.blake3
    for i, start in enumerate(range(0, n * step, step)):
        extra = extra_keys[i] if extra_keys is not None else b""
        prev = hasher(prev + data[start : start + step] + extra).digest(length=KEY_BYTES)
        keys.append(prev)
    return keys
