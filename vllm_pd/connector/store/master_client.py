"""A node's link to the store master: batched publishes, lookups with a deadline.

Everything here is best effort by design: if the master is slow, gone or
restarted, ``lookup`` returns None (the caller falls back to its local index or
recomputes) and publishes are dropped until the master answers again, at which
point the node republishes a snapshot of its index. Wrong data can never come
from here: a remote hit is only a hint where to fetch, and fetched bytes are
checksum-verified by the transport before they count.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from vllm_pd.connector.store.master_sessions import DiallerSession
from vllm_pd.errors import AuthFailed
from vllm_pd.protocol.auth_handshake import REFUSED, DeploymentSecret
from vllm_pd.protocol.block_keys import BlockKey, KeySalt
from vllm_pd.protocol.store_index import Holders, Lookup, NodeInfo, Nodes, Publish, Reply, Request, Stats
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

BATCH = 256  # keys per publish: ~30x the rate of single inserts, flat beyond (kv-stores.md §6.4)
MAX_BACKOFF_S = 60.0  # a master that stays down is retried at most this rarely


@dataclass(frozen=True)
class RemoteHit:
    node: str
    endpoint: str
    blocks: int


class MasterLink:
    """One DEALER socket to the master: a request, its reply within ``timeout_s``, or None.

    A master that does not answer is retried ever more rarely (doubling from
    ``retry_after_s`` up to MAX_BACKOFF_S), back to normal on the first answer;
    its loss is logged once (``what`` names who falls back to what), its return
    once. With ``secret`` each fresh socket first authenticates (master_sessions.py) and every
    request and reply is sealed; a master that cannot prove the secret counts as down.
    Not thread-safe: one thread calls it (zmq sockets are not shared).
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 0.2,
        retry_after_s: float = 2.0,
        what: str = "local lookups only",
        secret: DeploymentSecret | None = None,
    ) -> None:
        self.address, self.timeout_s, self.retry_after_s, self.what = address, timeout_s, retry_after_s, what
        self._last_contact = float("-inf")
        self._seq = itertools.count(1)
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self.secret = secret
        self._session: DiallerSession | None = None  # the socket's, with a secret
        self._down_until = 0.0
        # each failed call blocks its caller for timeout_s (in a node: the engine's scheduler)
        self._backoff_s = retry_after_s
        self._lost = False  # the loss was logged; the next answer logs the return
        self._encoder, self._decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(Reply)

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def call(self, body: Publish | Lookup | Nodes | Holders | Stats) -> Reply | None:
        """The master's reply, or None (no answer within timeout_s: down for a back-off)."""
        seq = next(self._seq)
        try:
            sock = self._socket()
            request = self._encoder.encode(Request(seq, body))
            sock.send(self._session.seal(seq, request) if self._session is not None else request, zmq.NOBLOCK)
            deadline = time.monotonic() + self.timeout_s
            while (left := deadline - time.monotonic()) > 0:
                if not sock.poll(int(left * 1000) + 1):
                    break
                reply = self._decoder.decode(self._open(sock.recv()))
                if reply.seq == seq:  # older replies arrived after their deadline: skip
                    self._last_contact = time.monotonic()
                    self._backoff_s = self.retry_after_s
                    if self._lost:
                        self._lost = False
                        logger.info("store master %s answers again", self.address)
                    return reply
        except AuthFailed as exc:
            (logger.debug if self._lost else logger.warning)("store master %s: %s", self.address, exc)
        except (zmq.ZMQError, msgspec.DecodeError, TimeoutError) as exc:
            logger.debug("store master call failed: %s", exc)
        wait = min(max(self._backoff_s, self.retry_after_s), MAX_BACKOFF_S)
        # once per outage: a dead master would otherwise log at every retry, for as long as it is down
        log = logger.debug if self._lost else logger.warning
        log("store master %s unreachable; %s, retried in %.0fs", self.address, self.what, wait)
        self._lost = True
        self._down_until = time.monotonic() + wait
        self._backoff_s = min(wait * 2, MAX_BACKOFF_S)
        self._reset()
        return None

    def nodes(self) -> list[NodeInfo] | None:
        """The live nodes with their salts and instance URLs (the proxy's kv_aware); None: no answer."""
        reply = self.call(Nodes())
        return None if reply is None else reply.nodes

    def holders(self, keys: list[BlockKey]) -> dict[str, int] | None:
        """Per node, how many leading ``keys`` it holds (nodes holding none left out); None: no answer."""
        reply = self.call(Holders(keys))
        return None if reply is None else reply.held

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.DEALER)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.setsockopt(zmq.SNDHWM, 64)
            self._sock.connect(self.address)
            if self.secret is not None:  # before any request: raises AuthFailed / TimeoutError
                try:
                    self._session = DiallerSession(self.secret, self._exchange)
                except BaseException:
                    self._reset()  # never a socket without its session
                    raise
        return self._sock

    def _exchange(self, message: bytes) -> bytes | None:
        """One handshake message and its answer (None: none within timeout_s)."""
        assert self._sock is not None
        self._sock.send(message, zmq.NOBLOCK)
        if not self._sock.poll(int(self.timeout_s * 1000) + 1):
            return None
        return self._sock.recv()

    def _open(self, data: bytes) -> bytes:
        """A reply's payload: unsealed in a session; AuthFailed if the master refused us."""
        if self._session is not None:
            return self._session.open(data)[1]
        if data == REFUSED:
            raise AuthFailed(
                "the store master refused us: it requires the deployment secret (VLLM_PD_SECRET or secret_file)"
            )
        return data

    def stats(self) -> dict[str, int] | None:
        """The master's counters (refused messages, live sessions, nodes, keys), or None."""
        reply = self.call(Stats())
        return None if reply is None else dict(reply.stats)

    def _reset(self) -> None:
        self._session = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()


class MasterClient(MasterLink):
    """A store node's side: publishes its index in batches, asks for the longest remote prefix.

    The engine's scheduler thread publishes once per step (``flush``); an idle engine makes no
    steps, so :meth:`start_heartbeat` keeps its keys alive on the master from a thread of its own
    (else the master drops them after ``node_ttl_s`` and a chat's next turn, minutes later, finds
    them nowhere).
    """

    def __init__(
        self,
        address: str,
        node: str,
        endpoint: str,
        snapshot: Callable[[], list[tuple[BlockKey, BlockKey | None]]],
        timeout_s: float = 0.2,
        retry_after_s: float = 2.0,
        heartbeat_s: float = 5.0,
        salt: KeySalt | None = None,
        instance_url: str = "",
        secret: DeploymentSecret | None = None,
    ) -> None:
        super().__init__(address, timeout_s, retry_after_s, secret=secret)
        self.node, self.endpoint, self.heartbeat_s = node, endpoint, heartbeat_s
        self.salt, self.instance_url = salt, instance_url  # published with each snapshot
        self._snapshot = snapshot
        self._need_snapshot = True
        self._inserts: list[tuple[BlockKey, BlockKey | None]] = []
        self._removes: list[BlockKey] = []
        # one sender at a time: the engine's flush, or the idle heartbeat (which never waits for it)
        self._sending = threading.Lock()
        self._heartbeat: threading.Thread | None = None
        self._stopping = threading.Event()

    def inserted(self, key: BlockKey, parent: BlockKey | None) -> None:
        self._inserts.append((key, parent))

    def removed(self, key: BlockKey) -> None:
        self._removes.append(key)

    def flush(self, force: bool = False) -> bool:
        """Publish queued changes (call once per step). False: master unreachable."""
        with self._sending:
            return self._flush(force)

    def _flush(self, force: bool = False) -> bool:
        if not self.available:
            self._inserts.clear()
            self._removes.clear()
            self._need_snapshot = True
            return False
        if self._need_snapshot:
            self._inserts, self._removes = [], []
            msgs = [
                Publish(
                    self.node,
                    self.endpoint,
                    self._snapshot(),
                    [],
                    snapshot=True,
                    salt=self.salt,
                    instance_url=self.instance_url,
                )
            ]
        elif self._inserts or self._removes or force or time.monotonic() - self._last_contact >= self.heartbeat_s:
            # changes, or a heartbeat: keeps our keys alive on the master and tells us if it restarted
            msgs = [
                Publish(self.node, self.endpoint, self._inserts[i : i + BATCH], [])
                for i in range(0, len(self._inserts), BATCH)
            ]
            msgs.append(Publish(self.node, self.endpoint, [], self._removes))
            self._inserts, self._removes = [], []
        else:
            return True
        for msg in msgs:
            reply = self.call(msg)
            if reply is None:
                self._need_snapshot = True
                return False
            if not reply.known:  # master restarted and lost us
                self._need_snapshot = True
                return self._flush()
        self._need_snapshot = False
        return True

    def start_heartbeat(self) -> None:
        """Beat every ``heartbeat_s`` from a daemon thread while the engine does not publish."""
        if self._heartbeat is None:
            link = MasterLink(
                self.address, self.timeout_s, self.retry_after_s, what="idle heartbeats paused", secret=self.secret
            )
            self._heartbeat = threading.Thread(
                target=self._beat_while_idle, args=(link,), daemon=True, name="store-master-heartbeat"
            )
            self._heartbeat.start()

    def _beat_while_idle(self, link: MasterLink) -> None:
        try:
            while not self._stopping.wait(self.heartbeat_s / 2):
                if time.monotonic() - self._last_contact >= self.heartbeat_s and link.available:
                    self.beat(link)
        finally:
            link.close()

    def beat(self, link: MasterLink) -> bool:
        """One idle heartbeat over ``link`` (a socket of the calling thread): the node's index whole
        if the master lost it (restarted), else an empty publish. Skipped (False) while the engine
        is publishing, which is a heartbeat too. Changes the engine queued stay queued: a snapshot
        only adds what its next flush sends again, and the master applies both alike."""
        if not self._sending.acquire(blocking=False):
            return False
        try:
            for _ in range(2):
                if self._need_snapshot:
                    try:
                        chains = self._snapshot()
                    except Exception:  # the engine changed the index while it was read: it is not idle
                        return False
                    msg = Publish(
                        self.node,
                        self.endpoint,
                        chains,
                        [],
                        snapshot=True,
                        salt=self.salt,
                        instance_url=self.instance_url,
                    )
                else:
                    msg = Publish(self.node, self.endpoint, [], [])
                reply = link.call(msg)
                if reply is None:
                    return False
                self._last_contact = time.monotonic()
                if reply.known or msg.snapshot:
                    self._need_snapshot = False
                    return True
                self._need_snapshot = True  # the master restarted: send the index whole
            return False
        finally:
            self._sending.release()

    def stop_heartbeat(self) -> None:
        self._stopping.set()
        if self._heartbeat is not None:
            self._heartbeat.join(self.timeout_s + 1.0)
            self._heartbeat = None

    def close(self) -> None:
        self.stop_heartbeat()
        super().close()

    def lookup(self, keys: Sequence[BlockKey]) -> RemoteHit | None:
        """Longest prefix of ``keys`` held by another node, or None (also when the master is down)."""
        if not keys or not self.available:
            return None
        reply = self.call(Lookup(list(keys), exclude=self.node))
        if reply is None or reply.node is None or reply.endpoint is None or reply.blocks <= 0:
            return None
        return RemoteHit(reply.node, reply.endpoint, reply.blocks)
