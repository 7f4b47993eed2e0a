"""Instance selection policies, one per role.

Each policy picks one of the eligible candidates; the pool has already removed
unhealthy, draining and breaker-open instances.
"""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import OrderedDict
from typing import TYPE_CHECKING, Protocol

from vllm_pd.errors import ConfigError
from vllm_pd.router.pool.instance_pool import Instance

if TYPE_CHECKING:
    from vllm_pd.router.request.request_body import ParsedRequest
    from vllm_pd.router.routing.kv_locations import KvLocations


class Policy(Protocol):
    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance: ...


class RoundRobin:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance:
        return candidates[next(self._counter) % len(candidates)]


def _load(inst: Instance, role: str) -> tuple[int, int]:
    # requests first, tokens break ties (a long prompt weighs more than a short one)
    return (inst.outstanding[role] + inst.outstanding[_other(role)], inst.outstanding_tokens[role])


def _other(role: str) -> str:
    return "decode" if role == "prefill" else "prefill"


class LeastOutstanding:
    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance:
        best = min(_load(c, role) for c in candidates)
        tied = [c for c in candidates if _load(c, role) == best]
        # rotate among ties so equal instances share the load
        return tied[next(self._counter) % len(tied)]


class PowerOfTwo:
    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance:
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(candidates, 2)
        return a if _load(a, role) <= _load(b, role) else b


class PrefixAware:
    """Same prompt prefix -> same prefill instance (where its prefix cache is).

    The prompt is cut into fixed-size character chunks; each chained chunk
    hash remembers the instance that last prefilled it. The longest remembered
    prefix wins unless that instance is much busier than the least busy one.
    Memory is bounded: at most ``max_entries`` chunk hashes (LRU).
    """

    def __init__(
        self, chunk_chars: int = 256, max_chunks: int = 64, max_entries: int = 200_000, imbalance: int = 4
    ) -> None:
        self.chunk_chars = chunk_chars
        self.max_chunks = max_chunks
        self.max_entries = max_entries
        self.imbalance = imbalance
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._fallback = LeastOutstanding()

    def _chunk_hashes(self, prompt_key: str) -> list[bytes]:
        hashes, h = [], b""
        data = prompt_key.encode("utf-8", "surrogatepass")
        step = self.chunk_chars
        for start in range(0, min(len(data), step * self.max_chunks), step):
            h = hashlib.blake2b(h + data[start : start + step], digest_size=16).digest()
            hashes.append(h)
        return hashes

    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance:
        hashes = self._chunk_hashes(prompt_key)
        by_url = {c.url: c for c in candidates}
        least = min(c.outstanding[role] for c in candidates)
        chosen = None
        for h in reversed(hashes):
            url = self._owner.get(h)
            if url in by_url and by_url[url].outstanding[role] <= least + self.imbalance:
                chosen = by_url[url]
                break
        if chosen is None:
            chosen = self._fallback.choose(candidates, role, prompt_key, tokens)
        for h in hashes:
            self._owner[h] = chosen.url
            self._owner.move_to_end(h)
        while len(self._owner) > self.max_entries:
            self._owner.popitem(last=False)
        return chosen

    def __len__(self) -> int:
        return len(self._owner)


def held_tokens(locations: KvLocations, instance: str, req: ParsedRequest) -> int:
    """Prompt tokens the instance will not compute: the longer of what its prefix cache holds (KV
    events) and what its own KV store holds (the store master), as leading full blocks.

    A store-held token is counted as free like a cached one, not as a fraction of a computed one:
    loading it is a copy from the CPU pool, small against a forward pass (docs/benchmarks/store.md,
    "Store", end to end: two thirds of the prompt tokens loaded from the store halve TTFT), and a
    finer weight would need measuring per deployment."""
    if req.blocks is None:
        return 0
    cached = locations.cached_tokens(instance, req.blocks)
    return max(cached, req.store.tokens(instance)) if req.store is not None else cached


class KvAware:
    """The instance where the prompt's KV already is, weighed against its queued work.

    Cost of an instance, in tokens it must compute before this prompt is done:
    the prompt tokens it does not hold (:func:`held_tokens`: vLLM's KV events,
    kv_locations.py, and its own KV store per the store master,
    store_locations.py) plus ``load_weight`` x the prompt tokens already queued on
    it for this role. Lowest cost wins; ties go to the least loaded. Without a
    prompt's blocks (not tokenizable exactly) it is least-outstanding. Blocks
    only *another* node's store holds count for no candidate: the chosen one is
    told to fetch them (pd_flow.py), whichever it is.
    """

    def __init__(self, locations: KvLocations, load_weight: float = 1.0) -> None:
        self.locations = locations
        self.load_weight = load_weight
        self._fallback = LeastOutstanding()

    def choose(self, candidates: list[Instance], role: str, prompt_key: str, tokens: int) -> Instance:
        return self._fallback.choose(candidates, role, prompt_key, tokens)

    def choose_for(self, candidates: list[Instance], role: str, req: ParsedRequest) -> Instance:
        if req.blocks is None or len(candidates) == 1:
            return self.choose(candidates, role, req.prompt_key, req.prompt_tokens)
        tokens = len(req.blocks.token_ids)
        costs = {
            c.url: tokens - held_tokens(self.locations, c.url, req) + self.load_weight * c.outstanding_tokens[role]
            for c in candidates
        }
        best = min(costs.values())
        return self._fallback.choose([c for c in candidates if costs[c.url] == best], role, req.prompt_key, tokens)


def make_policy(name: str, locations: KvLocations | None = None, load_weight: float = 1.0) -> Policy:
    if name == "kv_aware":
        if locations is None:
            raise ConfigError("kv_aware needs a KV location index (the proxy's tokenizer and kv_events)")
        return KvAware(locations, load_weight)
    policies: dict[str, type[Policy]] = {
        "round_robin": RoundRobin,
        "least_outstanding": LeastOutstanding,
        "power_of_two": PowerOfTwo,
        "prefix_aware": PrefixAware,
    }
    return policies[name]()
