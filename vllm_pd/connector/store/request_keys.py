"""Per-request block keys, hashed once and extended as the request grows.

vLLM asks about a waiting request every step, and a 128K-token prompt costs
~25 ms to hash (blake3 chain), so the scheduler side keeps each request's keys
and hashes only the blocks it has not seen yet. Bounded: the least recently
asked requests are dropped first (their keys are simply hashed again).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, BlockKey, KeySalt, RequestExtraKeys, chain_keys

MAX_REQUESTS = 4096


class RequestKeys:
    def __init__(self, salt: KeySalt) -> None:
        self.salt = salt
        self.block_size = salt.block_size
        self._keys: OrderedDict[str, list[BlockKey]] = OrderedDict()
        self._seen: set[str] = set()  # requests already counted once (see first_ask)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._keys

    def get(
        self,
        token_ids: Sequence[int],
        max_blocks: int | None = None,
        request_id: str | None = None,
        extra_keys: RequestExtraKeys = NO_EXTRA_KEYS,
    ) -> list[BlockKey]:
        """Keys of the full blocks of ``token_ids`` (at most ``max_blocks``) with the request's
        ``extra_keys``; with ``request_id`` they are cached and extended (a request's tokens only
        ever grow, its extra keys never change)."""
        full = len(token_ids) // self.block_size
        n = full if max_blocks is None else min(max_blocks, full)
        if request_id is None:
            return chain_keys(token_ids, self.salt, max_blocks=n, extra_keys=extra_keys.encoded(0, n, self.block_size))
        keys = self._keys.get(request_id, [])
        if len(keys) < n:
            done = len(keys)
            keys = keys + chain_keys(
                token_ids[done * self.block_size : n * self.block_size],
                self.salt,
                parent=keys[-1] if keys else None,
                extra_keys=extra_keys.encoded(done, n - done, self.block_size),
            )
            self._keys[request_id] = keys
            while len(self._keys) > MAX_REQUESTS:
                self._seen.discard(self._keys.popitem(last=False)[0])
        if request_id in self._keys:
            self._keys.move_to_end(request_id)
        return keys[:n]

    def first_ask(self, request_id: str) -> bool:
        """True the first time a request is asked about (vLLM asks every step
        while it waits), until it is forgotten."""
        if request_id in self._seen:
            return False
        self._seen.add(request_id)
        return True

    def forget(self, request_id: str) -> None:
        self._keys.pop(request_id, None)
        self._seen.discard(request_id)
