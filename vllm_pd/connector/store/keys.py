"""Block keys: chained content hashes of token-id blocks, salted with the KV format.

``key[i] = blake3(key[i-1] || token_ids[i*B:(i+1)*B] as little-endian u32)``
truncated to 16 bytes, with ``key[-1]`` = the salt digest. A key therefore names
its whole prefix: two sequences share ``key[i]`` only if their first ``i+1``
blocks are equal *and* their KV was produced under the same salt (model, dtype,
KV layout, block size, parallel layout). blake3 over fixed byte encodings keeps
keys identical across processes and machines; Python's ``hash()`` is salted
per process (PYTHONHASHSEED), the most reported "0 hits" bug of peer stores.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np

KEY_BYTES = 16  # 128 bits: collision odds ~2^-64 even at 2^32 stored blocks

BlockKey = bytes  # KEY_BYTES long


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
    extra: str = ""  # LoRA name, cache_salt namespace, ... ("" = none)

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.num_layers <= 0:
            raise ValueError(f"num_layers must be > 0, got {self.num_layers}")
        if self.tp_size <= 0 or self.pp_size <= 0:
            raise ValueError(f"tp_size/pp_size must be > 0, got {self.tp_size}/{self.pp_size}")

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
        raise ValueError(f"token_ids must be 1-D, got shape {arr.shape}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= 1 << 32):
        raise ValueError("token ids must be in [0, 2^32)")
    return arr.astype("<u4").tobytes()


def chain_keys(
    token_ids: Sequence[int] | np.ndarray,
    salt: KeySalt,
    parent: BlockKey | None = None,
    max_blocks: int | None = None,
) -> list[BlockKey]:
    """Keys of the full blocks of ``token_ids`` (a partial tail block has no key).

    ``parent`` continues an existing chain (``token_ids`` then start at a block
    boundary after it); default: the salt root. ``max_blocks`` stops early.
    """
    data = token_bytes(token_ids)
    step = salt.block_size * 4
    n = len(data) // step
    if max_blocks is not None:
        n = min(n, max_blocks)
    prev = salt.digest() if parent is None else parent
    keys: list[BlockKey] = []
    hasher = blake3.blake3
    for start in range(0, n * step, step):
        prev = hasher(prev + data[start:start + step]).digest(length=KEY_BYTES)
        keys.append(prev)
    return keys
