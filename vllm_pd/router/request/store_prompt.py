"""What the KV store holds of one prompt, per node, as the store master said (routing/store_locations.py asks).

A request carries it (``ParsedRequest.store``) from kv_aware routing, which picks by it, to the flow,
which hints the prefill's store where to fetch the prompt from.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_pd.protocol.block_keys import KeySalt
from vllm_pd.protocol.store_index import NodeInfo
from vllm_pd.protocol.transfer_params import StoreFetch


@dataclass(frozen=True)
class StoreHit:
    """One node's leading blocks of one prompt."""

    node: NodeInfo
    salt: KeySalt
    blocks: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.salt.block_size


@dataclass(frozen=True)
class StorePrompt:
    """What the store master said of one prompt: per node, the leading blocks it holds."""

    num_tokens: int  # the prompt's tokens
    hits: tuple[StoreHit, ...]  # nodes holding >= 1 block
    salts: dict[str, KeySalt]  # instance URL -> its node's salt, for every node that ever named its instance

    def tokens(self, instance_url: str) -> int:
        """Prompt tokens the instance's own store holds as leading full blocks (0 if none or unknown)."""
        return max((h.tokens for h in self.hits if h.node.instance_url == instance_url), default=0)

    def holds_prompt(self, instance_url: str) -> bool:
        """The instance's store holds every full block of the prompt."""
        salt = self.salts.get(instance_url)
        if salt is None:
            return False
        full = self.num_tokens // salt.block_size * salt.block_size
        return full > 0 and self.tokens(instance_url) >= full

    def fetch_hint(self, instance_url: str, held_tokens: int) -> StoreFetch | None:
        """Another node of the instance's salt holding more than ``held_tokens``: where its store
        should fetch the prompt from (the node holding the most), or None."""
        salt = self.salts.get(instance_url)
        if salt is None:
            return None
        best = max(
            (h for h in self.hits if h.salt == salt and h.node.instance_url != instance_url and h.node.endpoint),
            key=lambda h: (h.blocks, h.node.node),
            default=None,
        )
        if best is None or best.tokens <= held_tokens:
            return None
        return StoreFetch(best.node.node, best.node.endpoint, best.blocks)
