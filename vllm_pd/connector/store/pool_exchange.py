"""Node-to-node block fetch: serve this node's CPU pool to peers, fetch from theirs.

The master only says *which* node holds a prefix; the bytes move directly
between the two nodes' CPU pools over the connector's transport (tcp by
default), never through the master. Each worker rank registers its pool as one
transport region whose "block" is one layer of a pool slot, so a fetch per
layer moves that layer of all granted slots with the transport's per-block
length and checksum checks. Two small control messages ride on the
transport's ``notify``:

1. ``GrantBlocks(keys, scope)`` -> the holder answers ``BlocksGranted`` with the slots
   and the commit-time checksums of the longest leading run of ``keys`` it
   still has, in CPU memory or on disk (a disk block is first read and
   verified into a spare pool row, disk_staging.py), *written for ``scope``*
   (the asker's adapter and cache salt, block_keys.RequestExtraKeys.scope: a block of
   another scope under the same key - a collision, a bug - ends the run), and
   grants a fetch of exactly those slots under a fresh transfer id (the grant
   expires after ``grant_ttl_s``).
2. ``fetch`` of those slots into the asker's reserved slots, one transport
   fetch per layer, all queued at once (the region's blocks are (slot, layer)
   rows; the transport checks each one's length and checksum in transit), so
   the asker can copy layer 0 into vLLM while later layers are on the wire.
3. ``ReleaseBlocks(transfer_id)`` -> ``Released(intact)``: the grant ends, and
   the holder says how many leading slots nobody started to overwrite since
   the grant (every writer of a pool slot first drops it from the
   SlotDirectory, which bumps the slot's generation). A slot evicted and
   reused while it was being sent is therefore never counted as fetched; the
   blocks before it still are.
4. The asker re-hashes each intact slot it landed and keeps the leading run whose hash is the
   one the holder claimed: what it commits and advertises is checked by itself, never taken on
   a peer's word (a holder that sends other bytes than it claims - broken, or not ours - costs
   a recompute, not wrong KV in this node and every node that fetches from it).

A peer that is gone, slow or no longer holds the blocks makes ``fetch`` return
fewer (or zero) blocks; the caller recomputes the rest.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import Future

import msgspec

from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.disk_staging import DiskStaging
from vllm_pd.connector.transport import MemoryRegion, Transport, create_transport
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.tls_stream import TlsSettings
from vllm_pd.errors import TransportError
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.block_keys import BlockKey
from vllm_pd.protocol.store_peer import BlocksGranted, GrantBlocks, PeerMessage, ReleaseBlocks, Released
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

POOL_REGION = 0  # the pool is the transport's only region


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(PeerMessage)


class SlotDirectory:
    """Which block key each pool slot holds right now, with its commit-time checksum and the
    scope it was written for.

    Kept by the worker side (it owns the bytes): a slot enters once its copy is
    complete and checksummed, and leaves *before* anything overwrites it
    (``drop_slots``, which also bumps the slot's generation: a grant compares
    generations to learn whether a slot was touched while it was sent). Thread
    safe (the transport's threads read it while the store's threads write)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_key: dict[BlockKey, tuple[int, bytes, BlockKey]] = {}
        self._by_slot: dict[int, BlockKey] = {}
        self._generation: dict[int, int] = {}

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_key)

    def put(self, key: BlockKey, slot: int, digest: bytes, scope: BlockKey) -> None:
        with self._lock:
            old = self._by_slot.pop(slot, None)
            if old is not None:
                self._by_key.pop(old, None)
            prev = self._by_key.pop(key, None)
            if prev is not None:
                self._by_slot.pop(prev[0], None)
            self._by_key[key] = (slot, digest, scope)
            self._by_slot[slot] = key

    def drop_slots(self, slots: Sequence[int]) -> None:
        """``slots`` are about to be overwritten (call before the first byte changes)."""
        with self._lock:
            for slot in slots:
                self._generation[slot] = self._generation.get(slot, 0) + 1
                key = self._by_slot.pop(slot, None)
                if key is not None:
                    self._by_key.pop(key, None)

    def get(self, key: BlockKey, scope: BlockKey) -> tuple[int, bytes, int] | None:
        """(slot, checksum, generation) of ``key`` written for ``scope``, or None if no slot holds it
        (or one holds it for another scope: logged, never served)."""
        with self._lock:
            entry = self._by_key.get(key)
            if entry is not None and entry[2] != scope:
                logger.error(
                    "store: block %s was written for scope %s, a peer asked for %s: not served",
                    key.hex(),
                    entry[2].hex(),
                    scope.hex(),
                )
                return None
            return None if entry is None else (entry[0], entry[1], self._generation.get(entry[0], 0))

    def leading(self, keys: Sequence[BlockKey], scope: BlockKey) -> list[tuple[int, bytes]]:
        """(slot, checksum) of the longest leading run of ``keys`` held for ``scope``."""
        out = []
        for key in keys:
            entry = self.get(key, scope)
            if entry is None:
                break
            out.append((entry[0], entry[1]))
        return out

    def intact(self, granted: Sequence[tuple[int, int | None]]) -> int:
        """How many leading (slot, generation) pairs were not dropped since
        (generation None: a staging row its grant owns, which nobody else writes)."""
        with self._lock:
            n = 0
            for slot, generation in granted:
                if generation is not None and self._generation.get(slot, 0) != generation:
                    break
                n += 1
            return n


class PoolExchange:
    """One rank's pool on the transport: a BlockSink that serves grants, and the fetching side."""

    def __init__(
        self,
        pool: CpuBlockPool,
        directory: SlotDirectory,
        transport: str = "tcp",
        timeout_s: float = 2.0,
        grant_ttl_s: float = 30.0,
        staging: DiskStaging | None = None,
        secret: DeploymentSecret | None = None,
        tls: TlsSettings | None = None,
    ) -> None:
        self.pool = pool
        self.directory = directory
        self.staging = staging  # None: peers get blocks in CPU slots only
        self.timeout_s = timeout_s
        self.grant_ttl_s = grant_ttl_s
        # with the deployment secret, peers prove it before asking for a grant or a byte
        # and with TLS settings the bytes are encrypted on their way
        self.transport: Transport = create_transport(
            transport, connect_timeout=timeout_s, secret=secret, **({"tls": tls} if tls is not None else {})
        )
        # one transport block per (slot, layer): a fetch of layer 0 of every slot can land
        # (and be copied into vLLM's layer 0) before the later layers arrive
        self.transport.register_regions([MemoryRegion("kv-store-pool", pool.data.view(-1, pool.layer_block_nbytes))])
        self.endpoint = ""
        self._lock = threading.Lock()
        # transfer id -> (expiry (monotonic), granted (slot, generation) pairs, staging rows it owns)
        self._grants: dict[str, tuple[float, list[tuple[int, int | None]], list[int]]] = {}
        self.stats = {"served_blocks": 0, "served_from_disk": 0, "fetched_blocks": 0, "failed_fetches": 0}
        self._served_reported = (0, 0)

    def start(self, bind_host: str, advertised_host: str, port: int = 0) -> str:
        """Serve the pool; returns the endpoint peers fetch from (published via the master)."""
        endpoint = self.transport.start(self, bind_host, port)
        scheme, _, rest = endpoint.partition("://")
        self.endpoint = f"{scheme}://{advertised_host}:{rest.rsplit(':', 1)[1]}"
        return self.endpoint

    # -- BlockSink: the serving side (transport threads) ------------------------------------

    def destinations(self, batch: BlockBatch) -> None:
        return None  # nobody pushes into a store pool: peers fetch

    def landed(self, batch: BlockBatch, ok: bool) -> None:  # pragma: no cover - pushes are rejected
        pass

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        try:
            msg = _decoder.decode(message)
        except msgspec.MsgspecError:
            logger.warning("store: undecodable message from %s ignored", peer)
            return None
        if isinstance(msg, GrantBlocks):
            return _encoder.encode(self._grant(msg.keys, msg.scope))
        if isinstance(msg, ReleaseBlocks):
            return _encoder.encode(Released(self._revoke(msg.transfer_id)))
        return None

    def _grant(self, keys: Sequence[BlockKey], scope: BlockKey) -> BlocksGranted:
        self._expire_grants()
        held, staged = self._held(keys, scope)
        transfer_id = f"store-{uuid.uuid4().hex}"
        slots = [slot for slot, _, _ in held]
        if slots:
            with self._lock:
                self._grants[transfer_id] = (time.monotonic() + self.grant_ttl_s, [(s, g) for s, _, g in held], staged)
            self.transport.allow_fetch(
                transfer_id, [row for layer in range(self.pool.num_layers) for row in self._rows(slots, layer)]
            )
            with self._lock:  # read together by take_served
                self.stats["served_blocks"] += len(slots)
                self.stats["served_from_disk"] += len(staged)
        return BlocksGranted(transfer_id, slots, [digest for _, digest, _ in held])

    def _held(self, keys: Sequence[BlockKey], scope: BlockKey) -> tuple[list[tuple[int, bytes, int | None]], list[int]]:
        """(slot, checksum, generation) of the longest leading run of ``keys`` held for ``scope``
        in a pool slot or on disk (staged into a spare row: generation None), and
        the staging rows used. Runs on the transport's reader thread: a disk read
        delays only this peer's session, which waits for the answer anyway."""
        held: list[tuple[int, bytes, int | None] | None] = []
        on_disk: list[BlockKey] = []
        for key in keys:
            entry = self.directory.get(key, scope)
            if entry is None and (self.staging is None or not self.staging.holds(key)):
                break
            held.append(entry)
            if entry is None:
                on_disk.append(key)
        if not on_disk:
            return held, []  # type: ignore[return-value]
        assert self.staging is not None
        rows, sums = self.staging.stage(on_disk, scope)
        out: list[tuple[int, bytes, int | None]] = []
        staged = iter(zip(rows, sums))
        for found in held:
            if found is None:
                row = next(staged, None)
                if row is None:
                    break  # no spare row left, or the file failed verification: the run ends here
                found = (row[0], row[1], None)
            out.append(found)
        return out, rows

    def _revoke(self, transfer_id: str) -> int:
        """End a grant (once no read of it is sending); returns its intact leading slots."""
        with self._lock:
            grant = self._grants.pop(transfer_id, None)
        if grant is None:
            return 0  # unknown or expired: count nothing
        self.transport.allow_fetch(transfer_id, None)
        if self.staging is not None and grant[2]:
            self.staging.give_back(grant[2])  # no byte of them is being sent any more
        return self.directory.intact(grant[1])

    def _expire_grants(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [transfer_id for transfer_id, (until, _, _) in self._grants.items() if until <= now]
        for transfer_id in old:
            self._revoke(transfer_id)

    def take_served(self) -> tuple[int, int]:
        """(blocks served from the CPU pool, from disk) since the last call (for vLLM's metrics)."""
        with self._lock:
            total, disk = self.stats["served_blocks"], self.stats["served_from_disk"]
            last_total, last_disk = self._served_reported
            self._served_reported = (total, disk)
        return (total - disk) - (last_total - last_disk), disk - last_disk

    @property
    def live_grants(self) -> int:
        with self._lock:
            return len(self._grants)

    # -- the fetching side (the store's load thread) ---------------------------------------

    def fetch(self, peer: str, keys: Sequence[BlockKey], local_slots: Sequence[int], scope: BlockKey) -> list[bytes]:
        """Land ``keys`` (written for ``scope``) from ``peer``'s pool into our ``local_slots`` (reserved by
        the caller, nobody else writes them); returns the commit-time checksums
        of the *leading* keys that landed intact (verified in transit, not
        overwritten at the holder while sent), possibly none. Never raises for
        a peer's fault."""
        return self.start_fetch(peer, keys, local_slots, scope).finish()

    def start_fetch(
        self, peer: str, keys: Sequence[BlockKey], local_slots: Sequence[int], scope: BlockKey
    ) -> PeerFetch:
        """Ask ``peer`` for a grant of ``keys`` (for ``scope``) and start fetching them layer by layer (one
        transport fetch per layer, all queued at once: they land in order);
        returns at once with the handle the loader waits on per layer."""
        if not keys:
            return PeerFetch(self, peer, 0, "", [], [])
        try:
            granted = self._ask(peer, GrantBlocks(list(keys), scope))
            if not isinstance(granted, BlocksGranted) or len(granted.sums) != len(granted.slots):
                raise TransportError(f"bad grant reply from {peer}")
            n = min(len(granted.slots), len(keys), len(local_slots))
            if n == 0:
                return PeerFetch(self, peer, len(keys), "", [], [])
            local = list(local_slots[:n])
            layers: list[Future[None]] = []
            try:
                for layer in range(self.pool.num_layers):
                    layers.append(
                        self.transport.fetch(
                            peer,
                            granted.transfer_id,
                            POOL_REGION,
                            self._rows(granted.slots[:n], layer),
                            self._rows(local_slots[:n], layer),
                            self.timeout_s,
                        )
                    )
            except (TransportError, ValueError) as exc:
                logger.warning("store: fetch of %d blocks from %s failed: %s; recomputing them", n, peer, exc)
                failed = PeerFetch(self, peer, len(keys), granted.transfer_id, [], layers)
                failed.finish()  # waits for the layers already asked for, ends the grant
                return failed
        except (TransportError, msgspec.MsgspecError, TimeoutError, ValueError) as exc:
            logger.warning("store: fetch of %d blocks from %s failed: %s; recomputing them", len(keys), peer, exc)
            return PeerFetch(self, peer, len(keys), "", [], [])
        return PeerFetch(self, peer, len(keys), granted.transfer_id, list(granted.sums[:n]), layers, local)

    def _rows(self, slots: Sequence[int], layer: int) -> list[int]:
        """Transport block ids of ``layer`` of pool ``slots`` (the region is [slot, layer] rows)."""
        layers = self.pool.num_layers
        return [slot * layers + layer for slot in slots]

    def _release_quietly(self, peer: str, transfer_id: str) -> None:
        try:
            self.transport.notify(peer, _encoder.encode(ReleaseBlocks(transfer_id)), self.timeout_s)
        except (TransportError, ValueError):  # the grant expires anyway
            pass

    def _ask(self, peer: str, message: GrantBlocks | ReleaseBlocks) -> PeerMessage:
        reply = self.transport.notify(peer, _encoder.encode(message), self.timeout_s)
        answer: PeerMessage = _decoder.decode(reply.result(timeout=self.timeout_s + 1.0) or b"")
        return answer

    def _count(self, ok: list[bytes], asked: int) -> list[bytes]:
        self.stats["fetched_blocks"] += len(ok)
        if len(ok) < asked:
            self.stats["failed_fetches"] += 1
        return ok

    def close(self) -> None:
        self.transport.close()


class PeerFetch:
    """One node-to-node fetch in flight (:meth:`PoolExchange.start_fetch`).

    ``granted`` blocks were granted; :meth:`layer_landed` blocks until one layer
    of all of them is in our slots (verified in transit), so the loader copies
    layer ``i`` into vLLM while later layers are still on the wire.
    :meth:`finish` waits for every layer, ends the grant and returns the
    checksums of the leading blocks that count (landed, and not overwritten at
    the holder while sent). A block whose layers were already copied but that
    does not count is reported as a load error by the caller: vLLM discards
    that step's output for the request and recomputes the block."""

    def __init__(
        self,
        exchange: PoolExchange,
        peer: str,
        asked: int,
        transfer_id: str,
        sums: list[bytes],
        layers: list[Future[None]],
        local_slots: Sequence[int] = (),
    ) -> None:
        self._exchange = exchange
        self._local_slots = list(local_slots)  # where the granted blocks land here
        self._peer = peer
        self._asked = asked
        self._transfer_id = transfer_id
        self._sums = sums
        self._layers = layers
        self._failed = False
        self._done: list[bytes] | None = None
        self.granted = len(sums) if len(layers) == exchange.pool.num_layers else 0

    def layer_landed(self, layer: int) -> bool:
        """Whether ``layer`` of the granted blocks landed (False once any layer failed)."""
        if not self.granted or self._failed:
            return False
        try:
            self._layers[layer].result(timeout=self._exchange.timeout_s + 1.0)
        except Exception as exc:
            logger.warning("store: fetch of layer %d from %s failed: %s; recomputing", layer, self._peer, exc)
            self._failed = True
        return not self._failed

    def finish(self) -> list[bytes]:
        if self._done is None:
            self._done = self._exchange._count(self._end(), self._asked)
        return self._done

    def _end(self) -> list[bytes]:
        ex = self._exchange
        for f in self._layers:  # every one: none may still write our slots once we return
            try:
                f.result(timeout=ex.timeout_s + 1.0)
            except Exception:
                self._failed = True
        if not self._transfer_id:
            return []
        if self._failed or not self.granted:
            ex._release_quietly(self._peer, self._transfer_id)
            return []
        try:
            released = ex._ask(self._peer, ReleaseBlocks(self._transfer_id))
            if not isinstance(released, Released):
                raise TransportError(f"bad release reply from {self._peer}")
        except (TransportError, msgspec.MsgspecError, TimeoutError, ValueError) as exc:
            logger.warning("store: release at %s failed: %s; recomputing %d blocks", self._peer, exc, self.granted)
            return []
        if released.intact < self.granted:
            logger.warning(
                "store: %d of %d blocks from %s were evicted there while being sent; recomputing them",
                self.granted - released.intact,
                self.granted,
                self._peer,
            )
        return self._verified(self._sums[: released.intact])

    def _verified(self, claimed: list[bytes]) -> list[bytes]:
        """The leading run of ``claimed`` whose landed bytes hash to what the holder claimed."""
        pool = self._exchange.pool
        for i, (slot, want) in enumerate(zip(self._local_slots, claimed)):
            if pool.checksum(slot) != want:
                logger.warning(
                    "store: block %d of %d from %s is not what the holder's checksum says; "
                    "recomputing it and the %d after it",
                    i,
                    len(claimed),
                    self._peer,
                    len(claimed) - i - 1,
                )
                return claimed[:i]
        return claimed
