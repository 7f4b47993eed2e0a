"""The store master: the cluster-wide index of which node holds which prefix.

One small process (``vllm-pd store-master``). Nodes publish committed block
keys in batches (with each key's parent) and withdraw evicted ones; anyone asks
"which node holds the longest prefix of this key chain". Only metadata passes
through here; block bytes move node to node over the connector's transports.

pyzmq (ROUTER socket, msgpack via msgspec) rather than HTTP: keys are binary,
requests are tiny and frequent (one publish per engine step per node, one
lookup per new request), and a zmq round trip costs tens of microseconds with
no web framework or event loop in the engine process. With a deployment secret every peer -
node, proxy, tool - proves it first and each request and reply is sealed (master_sessions.py):
``Nodes`` and ``Holders`` answer no outsider, and no outsider publishes. Nodes that stop
publishing/heartbeating for ``node_ttl_s`` are dropped with all their keys, so
a dead node's blocks are never advertised for long; a node that finds a
master without its keys (restart) republishes a snapshot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import msgspec
import zmq

from vllm_pd.connector.store.master_sessions import ListenerSessions
from vllm_pd.protocol.auth_handshake import REFUSED, DeploymentSecret, is_handshake_hello
from vllm_pd.protocol.block_keys import BlockKey, KeySalt
from vllm_pd.protocol.store_index import Holders, NodeInfo, Nodes, Publish, Reply, Request, Stats
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass
class _Node:
    endpoint: str
    last_seen: float
    keys: set[BlockKey] = field(default_factory=set)
    salt: KeySalt | None = None
    instance_url: str = ""


class MasterIndex:
    """The master's state, separate from the socket loop so it is testable directly."""

    def __init__(self, node_ttl_s: float = 30.0) -> None:
        self.node_ttl_s = node_ttl_s
        self._owners: dict[BlockKey, set[str]] = {}
        self._nodes: dict[str, _Node] = {}

    def publish(self, msg: Publish, now: float) -> bool:
        """Apply a batch; returns whether the node was known before (False = resync needed)."""
        node = self._nodes.get(msg.node)
        known = node is not None
        if node is None or msg.snapshot:
            if node is not None:
                self._drop_node(msg.node)
            node = self._nodes[msg.node] = _Node(msg.endpoint, now)
        node.endpoint, node.last_seen = msg.endpoint, now
        if msg.snapshot:
            node.salt, node.instance_url = msg.salt, msg.instance_url
        for key, _parent in msg.inserts:
            self._owners.setdefault(key, set()).add(msg.node)
            node.keys.add(key)
        for key in msg.removes:
            owners = self._owners.get(key)
            if owners is not None:
                owners.discard(msg.node)
                if not owners:
                    del self._owners[key]
            node.keys.discard(key)
        return known or msg.snapshot

    def lookup(self, keys: list[BlockKey], exclude: str | None, now: float) -> tuple[str | None, str | None, int]:
        self.expire(now)
        alive = set(self._owners.get(keys[0], ())) - {exclude} if keys else set()
        n = 0
        best: str | None = None
        while alive and n < len(keys):
            nxt = alive & self._owners.get(keys[n], set())
            if not nxt:
                break
            alive = nxt
            best = min(alive)  # deterministic among equals
            n += 1
        if best is None:
            return None, None, 0
        return best, self._nodes[best].endpoint, n

    def holders(self, keys: list[BlockKey], now: float) -> dict[str, int]:
        """Node -> how many leading keys of ``keys`` it holds (a node holding none is left out)."""
        self.expire(now)
        alive = set(self._owners.get(keys[0], ())) if keys else set()
        held: dict[str, int] = {}
        n = 0
        while alive and n < len(keys):
            alive &= self._owners.get(keys[n], set())
            n += 1
            held.update(dict.fromkeys(alive, n))
        return held

    def nodes(self, now: float) -> list[NodeInfo]:
        """The live nodes, name order."""
        self.expire(now)
        return [
            NodeInfo(name, node.endpoint, node.instance_url, node.salt) for name, node in sorted(self._nodes.items())
        ]

    def answer(self, req: Request, now: float, counters: dict[str, int] | None = None) -> Reply:
        """The reply to one request (``counters``: the serving loop's, for Stats)."""
        body = req.body
        if isinstance(body, Stats):
            return Reply(req.seq, stats={"nodes": len(self._nodes), "keys": self.num_keys, **(counters or {})})
        if isinstance(body, Publish):
            return Reply(req.seq, known=self.publish(body, now))
        if isinstance(body, Nodes):
            return Reply(req.seq, nodes=self.nodes(now))
        if isinstance(body, Holders):
            return Reply(req.seq, held=self.holders(body.keys, now))
        node, endpoint, n = self.lookup(body.keys, body.exclude, now)
        return Reply(req.seq, node=node, endpoint=endpoint, blocks=n)

    def expire(self, now: float) -> None:
        for name in [n for n, node in self._nodes.items() if now - node.last_seen > self.node_ttl_s]:
            logger.info("store master: node %s silent for > %.0fs; dropping its keys", name, self.node_ttl_s)
            self._drop_node(name)

    def _drop_node(self, name: str) -> None:
        node = self._nodes.pop(name)
        for key in node.keys:
            owners = self._owners.get(key)
            if owners is not None:
                owners.discard(name)
                if not owners:
                    del self._owners[key]

    @property
    def num_keys(self) -> int:
        return len(self._owners)


def serve(
    bind: str, node_ttl_s: float = 30.0, stop_after_s: float | None = None, secret: DeploymentSecret | None = None
) -> None:
    """Answer requests on ``bind`` (e.g. ``tcp://0.0.0.0:7700``) until interrupted; with ``secret``
    only peers that proved it, in sealed sessions."""
    index = MasterIndex(node_ttl_s)
    sessions = ListenerSessions(secret) if secret is not None else None
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(bind)
    decoder, encoder = msgspec.msgpack.Decoder(Request), msgspec.msgpack.Encoder()
    logger.info("store master listening on %s", sock.getsockopt_string(zmq.LAST_ENDPOINT))
    deadline = None if stop_after_s is None else time.monotonic() + stop_after_s
    try:
        while deadline is None or time.monotonic() < deadline:
            if not sock.poll(500):
                continue
            try:
                ident, payload = sock.recv_multipart()
            except ValueError:  # not [identity, message]
                continue
            seq = None
            if sessions is not None:
                now_reply, request = sessions.receive(ident, payload)
                if now_reply is not None:
                    sock.send_multipart([ident, now_reply])
                if request is None:
                    continue
                seq, payload = request
            elif is_handshake_hello(payload):
                logger.warning(
                    "store master: a peer authenticates with a deployment secret, but this master "
                    "has none (give it --secret-file or VLLM_PD_SECRET)"
                )
                sock.send_multipart([ident, REFUSED])
                continue
            try:
                req = decoder.decode(payload)
            except msgspec.DecodeError:
                logger.warning("store master: undecodable request dropped")
                continue
            counters = {"refused": sessions.refused, "sessions": sessions.live} if sessions is not None else {}
            reply = encoder.encode(index.answer(req, time.monotonic(), counters))
            if sessions is not None and seq is not None:
                sealed = sessions.seal(ident, seq, reply)
                if sealed is None:
                    continue
                reply = sealed
            sock.send_multipart([ident, reply])
    finally:
        sock.close()
