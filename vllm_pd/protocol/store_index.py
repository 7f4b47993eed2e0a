"""The store master's messages: what nodes, the proxy and tools ask the cluster's block index.

A :class:`Request` (msgpack, ``seq`` and one tagged body) goes to the master's ZMQ socket and a
:class:`Reply` comes back, sealed in a session where a deployment secret is set
(auth_handshake.py's ``MessageSeal``). Nodes ``Publish`` the block keys they committed (with each
key's parent) and withdraw evicted ones; anyone asks which node holds the longest prefix of a key
chain (``Lookup``), how many leading keys each node holds (``Holders``), the live nodes (``Nodes``)
or the master's counters (``Stats``). Every reply carries the protocol's version. The master that
answers: connector/store/master.py; its client: connector/store/master_client.py.
"""

from __future__ import annotations

import msgspec

from vllm_pd.protocol.block_keys import BlockKey, KeySalt
from vllm_pd.protocol.version import PROTOCOL_VERSION


class Publish(msgspec.Struct, tag="publish"):
    node: str
    endpoint: str  # where peers fetch this node's blocks (transport endpoint)
    inserts: list[tuple[BlockKey, BlockKey | None]] = []
    removes: list[BlockKey] = []
    snapshot: bool = False  # inserts are the node's whole index: forget its older keys
    # with a snapshot (they never change for a node): what its keys are salted with, and the
    # URL of its vLLM instance as the proxy knows it ("" = not routable by the proxy)
    salt: KeySalt | None = None
    instance_url: str = ""


class Lookup(msgspec.Struct, tag="lookup"):
    keys: list[BlockKey]
    exclude: str | None = None  # the asking node (it knows its own blocks)


class Nodes(msgspec.Struct, tag="nodes"):
    """The live nodes, with what a router needs to compute their keys and reach their instances."""


class Holders(msgspec.Struct, tag="holders"):
    """Per node, how many leading keys of ``keys`` it holds (not only the best node's)."""

    keys: list[BlockKey]


class Stats(msgspec.Struct, tag="stats"):
    """The master's counters (``refused``: messages from peers that did not authenticate)."""


class NodeInfo(msgspec.Struct, frozen=True):
    node: str
    endpoint: str
    instance_url: str = ""
    salt: KeySalt | None = None


class Reply(msgspec.Struct):
    seq: int
    ok: bool = True
    node: str | None = None
    endpoint: str | None = None
    blocks: int = 0  # leading keys held by ``node``
    known: bool = True  # False: the master has no record of the publishing node (restarted): resync
    nodes: list[NodeInfo] = []  # answer to Nodes
    held: dict[str, int] = {}  # answer to Holders: node -> leading keys held (nodes holding none left out)
    stats: dict[str, int] = {}  # answer to Stats
    version: int = PROTOCOL_VERSION


class Request(msgspec.Struct):
    seq: int
    body: Publish | Lookup | Nodes | Holders | Stats
