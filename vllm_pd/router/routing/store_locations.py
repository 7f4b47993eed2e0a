"""Where the KV store holds a prompt: the store master as kv_aware's second location source.

vLLM's KV events (kv_locations.py) tell which instance's *prefix cache* holds
a prompt; with the KV store on (vllm_pd.connector.store) a prompt's blocks
also sit in the nodes' stores, which any instance loads from its own store and
fetches from another node's. The store master knows which node holds which
keys; since protocol version 2 each node also tells it its key salt and the
URL the proxy knows its instance by (``store.instance_url``). So the proxy
computes, per distinct salt, the store keys of the exact prompt tokens with
the request's extra keys (LoRA adapter, cache salt: kv_extra_keys.py;
block_keys.chain_keys, the store's own function) and asks the master how many
leading blocks each node holds.

Everything runs on the tokenize worker thread (kv_routing.py), never on the
event loop, and is best effort: each call waits at most ``timeout_s``; a master
that does not answer is logged once and retried with a growing back-off
(MasterLink), and meanwhile routing goes on with the KV events alone. Stale
information only costs a recompute: a hint naming a node that lost the blocks
ends in a failed, checksum-verified fetch, and the prefill computes them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from vllm_pd.connector.store.master_client import MasterLink
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, RequestExtraKeys, chain_keys
from vllm_pd.protocol.store_index import NodeInfo
from vllm_pd.router.request.store_prompt import StoreHit, StorePrompt

logger = logging.getLogger(__name__)

NODES_REFRESH_S = 1.0  # node list age after which a request refreshes it first (one tiny call a second at most)
TIMEOUT_S = 0.1  # per master call; the tokenize thread serves every request, so keep it short


class StoreLocations:
    """The proxy's view of the KV store through its master. One thread calls it (the tokenize worker)."""

    def __init__(
        self,
        address: str,
        timeout_s: float = TIMEOUT_S,
        refresh_s: float = NODES_REFRESH_S,
        retry_after_s: float = 2.0,
        secret: DeploymentSecret | None = None,
    ) -> None:
        self.link = MasterLink(
            address, timeout_s, retry_after_s, what="kv_aware routes by KV events only", secret=secret
        )
        self.refresh_s = refresh_s
        self._nodes: list[NodeInfo] = []
        self._nodes_at = float("-inf")
        # instance URL -> its store's salt, kept when its node drops off the master (a restarted master,
        # a node that missed heartbeats under load): a hint to that instance still needs it
        self._salts: dict[str, KeySalt] = {}

    def locate(self, token_ids: Sequence[int], extra_keys: RequestExtraKeys = NO_EXTRA_KEYS) -> StorePrompt | None:
        """Per node, how much of the prompt (with its ``extra_keys``) its store holds; None when the
        master is down."""
        if not self.link.available or not self._refresh():
            return None
        # a node without instance_url is no routing target, but its blocks can still be fetched
        nodes = [n for n in self._nodes if n.salt is not None]
        hits: list[StoreHit] = []
        for salt in dict.fromkeys(n.salt for n in nodes if n.salt is not None):
            n = len(token_ids) // salt.block_size
            keys = chain_keys(token_ids, salt, extra_keys=extra_keys.encoded(0, n, salt.block_size))
            if not keys:
                continue
            held = self.link.holders(keys)
            if held is None:
                return None
            hits.extend(StoreHit(n, salt, held[n.node]) for n in nodes if n.salt == salt and held.get(n.node, 0) > 0)
        return StorePrompt(len(token_ids), tuple(hits), dict(self._salts))

    def _refresh(self) -> bool:
        """The node list, refreshed when older than refresh_s. False: the master did not answer."""
        now = time.monotonic()
        if now - self._nodes_at < self.refresh_s:
            return True
        nodes = self.link.nodes()
        if nodes is None:
            self._nodes_at = float("-inf")  # asked again as soon as the master is retried
            return False
        self._nodes, self._nodes_at = nodes, now
        self._salts.update({n.instance_url: n.salt for n in nodes if n.instance_url and n.salt is not None})
        return True

    @property
    def nodes(self) -> list[NodeInfo]:
        return list(self._nodes)

    def close(self) -> None:
        self.link.close()
