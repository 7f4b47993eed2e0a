"""The store's CPU-tier policy: reuse-weighted LRU whose strength is picked
online by shadow caches, one of which is plain LRU.

No fixed policy wins everywhere on multi-turn chat (benchmarks/store_hit_rate.py):
keeping often re-used blocks longer (ReuseAgedCache, base < 1) gains 1.2-1.5x
LRU's hit rate when the cache holds ~1 % of the traffic's blocks (the shared
system prompts survive the stream of new turns), and loses up to 25 % when it
holds 5-20 % (conversations that ended linger). So the cache runs keys-only
shadow copies of the policy for a few bases, base 1 (= LRU) among them, on the
same requests, and the real cache uses the base whose shadow hit most over a
recent window (exponential decay). Biased towards LRU: the real cache starts as
LRU, leaves it only when another shadow beats the LRU shadow by ``margin``, and
goes back to LRU (no margin) as soon as the LRU shadow does as well as the one
followed *or* as well as the real cache itself did since it left (the real
contents lag the shadow's after a switch). So when re-use weighting gives
nothing the real cache *is* plain LRU.

Shadows hold keys only (no bytes), track their own parent/child counts for
leaf-first eviction, and cost one more dict walk of each chain per base. With
``sample_rate`` < 1 they see only the keys whose hash falls in that fraction
(SHARDS-style spatial sampling: a key is in or out for good, so its re-uses are
all seen) in caches scaled by the same fraction, and their hits count
1 / rate each; the sampled keys of a chain keep their order, so a shadow's
chains stay chains (each sampled key's parent is the previous sampled one).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from vllm_pd.connector.store.reuse_cache import Evictable, Key, OnEvict, ReuseAgedCache
from vllm_pd.errors import StoreError

DEFAULT_BASES = (1.0, 0.5, 0.3, 0.1)
_HASH_SPACE = 1 << 32
# The store samples its shadows at 1/8 (same hit rates to ~1 %, never below LRU, 0.11x
# the cost: docs/benchmarks/store.md), but never below 32 sampled slots: a shadow
# of a few slots would judge by noise.
SAMPLE_RATE = 0.125
MIN_SAMPLED_SLOTS = 32


def shadow_sample_rate(capacity: int) -> float:
    """The sample rate the store uses for a CPU tier of ``capacity`` blocks."""
    return min(1.0, max(SAMPLE_RATE, MIN_SAMPLED_SLOTS / capacity))


def sample_hash(key: Key) -> int:
    """A 32-bit hash of a key that is the same in every process: the first bytes of
    a block key (already a blake3 digest), or a multiplicative hash of an int id
    (the trace's block ids). Never Python's salted ``hash()``."""
    if isinstance(key, bytes):
        return int.from_bytes(key[:4], "little")
    if isinstance(key, int):
        return (key * 0x9E3779B1) & (_HASH_SPACE - 1)
    raise TypeError(f"cannot sample keys of type {type(key).__name__}")


class ShadowCache:
    """A keys-only ReuseAgedCache that serves its own lookups (leaf-first, no pins)."""

    def __init__(self, capacity: int, base: float) -> None:
        self.policy = ReuseAgedCache(capacity, base)
        self._parent: dict[Key, Key | None] = {}
        self._children: Counter[Key] = Counter()

    def lookup(self, chain: Sequence[Key]) -> int:
        """Blocks of ``chain`` this shadow would hit (and records the re-use)."""
        n = 0
        for key in chain:
            if key not in self.policy:
                break
            n += 1
        if n:
            self.policy.hit(chain[:n])
        return n

    def save(self, chain: Sequence[Key]) -> None:
        admitted, _ = self.policy.admit(chain, lambda k: not self._children[k], self._forget)
        if not admitted:
            return
        start = chain.index(admitted[0])
        parent = chain[start - 1] if start else None
        for key in admitted:
            self._parent[key] = parent
            if parent is not None:
                self._children[parent] += 1
            parent = key

    def _forget(self, key: Key) -> None:
        parent = self._parent.pop(key, None)
        self._children.pop(key, None)
        if parent is not None:
            self._children[parent] -= 1


class AdaptiveCache:
    """Drop-in for the owner: ``hit`` / ``admit`` / ``remove`` act on the real
    policy; ``observe_request`` and ``observe_save`` feed the shadows."""

    def __init__(
        self,
        capacity: int,
        bases: Sequence[float] = DEFAULT_BASES,
        half_life: float = 300.0,
        margin: float = 0.05,
        sample_rate: float = 1.0,
    ) -> None:
        if not bases or bases[0] != 1.0:
            raise StoreError(f"bases must start with 1.0 (plain LRU), got {list(bases)}")
        if half_life <= 0 or margin < 0:
            raise StoreError(f"half_life must be > 0 and margin >= 0, got {half_life}, {margin}")
        if not 0.0 < sample_rate <= 1.0:
            raise StoreError(f"sample_rate must be in (0, 1], got {sample_rate}")
        self.capacity = capacity
        self.bases = tuple(bases)
        self.real = ReuseAgedCache(capacity, 1.0)
        self.sample_rate = sample_rate
        self._threshold = int(sample_rate * _HASH_SPACE)
        shadow_capacity = max(1, round(capacity * sample_rate))
        self.shadows = [ShadowCache(shadow_capacity, b) for b in self.bases]
        self.scores = [0.0] * len(self.bases)
        self._decay = 0.5 ** (1.0 / half_life)  # per request
        self._margin = margin
        self.current = 0  # index into bases
        self.real_score = 0.0  # the real cache's own hits, same decay

    @property
    def base(self) -> float:
        return self.real.base

    def __len__(self) -> int:
        return len(self.real)

    def __contains__(self, key: object) -> bool:
        return key in self.real

    def observe_request(self, prompt: Sequence[Key]) -> None:
        """A request asks for ``prompt`` (its full-block keys); call once per request."""
        sampled, weight = self._sampled(prompt), 1.0 / self.sample_rate
        for i, shadow in enumerate(self.shadows):
            self.scores[i] = self.scores[i] * self._decay + shadow.lookup(sampled) * weight
        real = 0
        for key in prompt:
            if key not in self.real:
                break
            real += 1
        self.real_score = self.real_score * self._decay + real
        best = max(range(len(self.bases)), key=lambda i: (self.scores[i], -i))
        if self.current:
            if self.real_score < self.scores[0] or self.scores[0] >= self.scores[self.current]:
                best = 0  # the real cache (or the shadow it follows) lost to LRU: back to LRU, no margin
            elif self.scores[best] <= self.scores[self.current] * (1.0 + self._margin):
                return
        elif self.scores[best] <= self.scores[0] * (1.0 + self._margin):
            return
        if best != self.current:
            if not self.current:
                self.real_score = self.scores[0]  # judged against LRU from here on
            self.current = best
            self.real.set_base(self.bases[best])

    def observe_save(self, chain: Sequence[Key]) -> None:
        """A finished request's whole chain (prompt + output full blocks) is being saved."""
        sampled = self._sampled(chain)
        for shadow in self.shadows:
            shadow.save(sampled)

    def _sampled(self, chain: Sequence[Key]) -> Sequence[Key]:
        if self._threshold >= _HASH_SPACE:
            return chain
        threshold = self._threshold
        return [key for key in chain if sample_hash(key) < threshold]

    def hit(self, chain: Sequence[Key]) -> None:
        self.real.hit(chain)

    def admit(
        self, chain: Sequence[Key], evictable: Evictable, on_evict: OnEvict = None
    ) -> tuple[list[Key], list[Key]]:
        return self.real.admit(chain, evictable, on_evict)

    def remove(self, key: Key) -> None:
        self.real.remove(key)
