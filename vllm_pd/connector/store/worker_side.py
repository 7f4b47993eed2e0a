"""The store's worker-side facade (runs in each vLLM worker process).

It owns the bytes: the CPU pool and the disk tier of this rank. It executes the
plans of :class:`~vllm_pd.connector.store.scheduler_side.StoreScheduler` on
background threads (saves on one, loads on another, disk I/O on the disk
tier's own threads) and reports what landed through :meth:`StoreWorker.report`
(send it to the scheduler side in KVConnectorWorkerMetadata).

Loads are layer-wise: :meth:`start_loads` returns at once; a thread copies
layer 0 of every op, then layer 1, ...; :meth:`wait_layer` orders the forward
after layer ``i``'s copy, so the forward pass of layer ``i`` overlaps the copy
of layer ``i+1``. The copies run where the KV lives (pool_copies.py): at once
on CPU; on a GPU on copy streams, the forward waiting with a stream wait, and
a save committing its blocks only once their device-to-host copy completed.
A block read from disk is checksum-verified before any layer of it is copied;
a failure makes that block and every later block of the request a load error
(vLLM recomputes them), never wrong KV.

With a master configured, :meth:`serve_peers` puts the pool on the transport
(pool_exchange.py): peers fetch committed slots directly (and blocks this rank
holds only on disk, staged into spare pool rows: disk_staging.py), and loads
marked ``from_peer`` fetch theirs from another node layer by layer (one
transport fetch per layer, all queued at once): layer ``i``'s copy waits for
layer ``i``'s bytes only, not for the whole fetch.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from vllm_pd.connector.device.kv_device import DeviceEvent, KVDevice, kv_device_for
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.disk_staging import DiskStaging
from vllm_pd.connector.store.disk_tier import DiskTier
from vllm_pd.connector.store.plans import LoadOp, LoadResult, SaveOp, SaveResult, StorePlan, StoreReport
from vllm_pd.connector.store.pool_copies import PoolCopies, pool_copies
from vllm_pd.connector.store.pool_exchange import PeerFetch, PoolExchange, SlotDirectory
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.errors import StoreError
from vllm_pd.protocol.block_keys import KeySalt
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


@dataclass(slots=True)
class _Staged:
    """A load op after its local part is in the pool: the fetch of its peer part runs."""

    local: int  # leading blocks usable from this node (pool, verified disk reads)
    remote: list[int]  # indices of the op's blocks fetched from a peer (a suffix)
    fetch: PeerFetch | None = None
    settled: bool = False


class StoreWorker:
    def __init__(
        self,
        config: StoreConfig,
        salt: KeySalt,
        kv_caches: Sequence[torch.Tensor],
        rank: int = 0,
        block_dims: Sequence[int] | None = None,
        device: KVDevice | None = None,
    ) -> None:
        """``block_dims``: each layer's block dimension in vLLM's layout (default 0; see
        ``MemoryRegion``); ``device``: where the KV lives (default: read from the tensors)."""
        self.config = config
        self.rank = rank
        if len(kv_caches) != salt.num_layers:
            raise StoreError(f"salt says {salt.num_layers} layers, got {len(kv_caches)} KV caches")
        dims = list(block_dims) if block_dims is not None else [0] * len(kv_caches)
        if len(dims) != len(kv_caches):
            raise StoreError(f"{len(dims)} block dimensions for {len(kv_caches)} KV cache layers")
        self.regions = [MemoryRegion(f"store-kv-{i}", t, d) for i, (t, d) in enumerate(zip(kv_caches, dims))]
        nbytes = {r.block_nbytes for r in self.regions}
        if len(nbytes) != 1:
            raise StoreError(f"layers have different block sizes in bytes: {sorted(nbytes)}")
        self.device = device or kv_device_for(kv_caches)
        on_host = all(t.device.type == "cpu" for t in kv_caches)
        if self.device.host_accessible and not on_host:
            raise StoreError(
                f"store: KV cache on {kv_caches[0].device} but given the host device {type(self.device).__name__}"
            )
        layer_nbytes = nbytes.pop()
        slot_nbytes = layer_nbytes * len(kv_caches)
        # rows past the scheduler's slots stage disk blocks for peers (disk_staging.py)
        self.num_slots = config.num_slots(slot_nbytes)
        bounce_rows = 0 if self.device.host_accessible else config.bounce_rows(slot_nbytes)
        self.pool = CpuBlockPool(self.num_slots + config.disk_serve_slots(slot_nbytes), len(kv_caches), layer_nbytes)
        self.copies: PoolCopies = pool_copies(self.pool, self.regions, self.device, bounce_rows)
        self.disk = (
            DiskTier(config.disk_path, salt.digest(), rank, config.disk_bytes, config.disk_io_threads)
            if config.disk_path
            else None
        )
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="kv-store-save")
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="kv-store-load")
        self._lock = threading.Lock()
        self._saves: list[SaveResult] = []
        self._loads: list[LoadResult] = []
        self._disk_failed: list[bytes] = []
        self._saved_requests: set[str] = set()
        self._loaded_requests: set[str] = set()
        self._load_errors: set[int] = set()
        self._failed_loads: set[str] = set()  # requests with a block that did not load
        self._save_futures: list[Future[None]] = []
        self._disk_futures: list[Future[bool]] = []
        # per layer: futures of the loads started so far, each the event of the layer's copy
        self._layer_futures: list[list[Future[DeviceEvent]]] = [[] for _ in kv_caches]
        self.directory = SlotDirectory()  # what each pool slot holds, for peers' fetches
        self.exchange: PoolExchange | None = None

    def serve_peers(self, bind_host: str, advertised_host: str) -> str:
        """Serve this rank's pool to other nodes; returns the endpoint to publish."""
        if self.exchange is None:
            spare = range(self.num_slots, self.pool.num_slots)
            staging = DiskStaging(self.pool, self.disk, spare) if self.disk is not None and spare else None
            self.exchange = PoolExchange(
                self.pool,
                self.directory,
                timeout_s=self.config.fetch_timeout_s,
                grant_ttl_s=self.config.pin_ttl_s,
                staging=staging,
                secret=self.config.secret,
                tls=self.config.tls,
            )
            self.exchange.start(bind_host, advertised_host)
        return self.exchange.endpoint

    @property
    def slot_nbytes(self) -> int:
        return self.pool.slot_nbytes

    def execute(self, plan: StorePlan) -> None:
        """Start a step's plan (call in ``start_load_kv``)."""
        if plan.loads:
            self.start_loads(plan.loads)
        if plan.saves:
            self.start_saves(plan.saves)

    # -- saves ---------------------------------------------------------------------

    def start_saves(self, ops: Sequence[SaveOp]) -> None:
        """Copy out in the background. vLLM must not reuse the source blocks until
        the request shows up in :meth:`take_finished` (or :meth:`wait_saves` returned).
        Call on the forward's thread: the copies follow what it launched so far."""
        written = self.copies.mark_forward()
        for op in ops:
            self._save_futures.append(self._saver.submit(self._save, op, written))

    def _save(self, op: SaveOp, written: DeviceEvent) -> None:
        self.directory.drop_slots(op.slots)  # before a byte changes: peers stop getting them
        try:
            # returns once the bytes are in the pool: nothing below may publish them earlier
            self.copies.save(op.slots, op.block_ids, after=written)
            sums = [self.pool.checksum(s) for s in op.slots]
            for key, slot, digest in zip(op.keys, op.slots, sums):
                self.directory.put(key, slot, digest, op.scope)
            result = SaveResult(op.request_id, list(op.keys), [])
        except Exception:
            logger.exception("store: saving %s failed", op.request_id)
            sums, result = [], SaveResult(op.request_id, [], list(op.keys))
        with self._lock:
            self._saves.append(result)
            self._saved_requests.add(op.request_id)
        if self.disk is not None and result.committed:
            self._write_through(op.parent, op.keys, op.slots, sums, op.scope)

    def _write_through(
        self, parent: bytes | None, keys: Sequence[bytes], slots: Sequence[int], sums: Sequence[bytes], scope: bytes
    ) -> None:
        assert self.disk is not None
        parents = [parent, *keys[:-1]]
        for i in reversed(range(len(keys))):  # leaf first: parents are the most recent on disk
            fut = self.disk.write(keys[i], parents[i], self.pool.slot_view(slots[i]), scope, sums[i])
            fut.add_done_callback(functools.partial(self._disk_written, keys[i]))
            with self._lock:
                self._disk_futures = [f for f in self._disk_futures if not f.done()] + [fut]

    def _disk_written(self, key: bytes, fut: Future[bool]) -> None:
        if fut.exception() is not None or not fut.result():
            with self._lock:
                self._disk_failed.append(key)

    def wait_saves(self) -> None:
        """Block until every started save has been copied out of vLLM's blocks."""
        futures, self._save_futures = self._save_futures, []
        for f in futures:
            f.result()

    def wait_disk(self) -> None:
        """Block until every started write-through to disk ended (tests, shutdown)."""
        self.wait_saves()
        with self._lock:
            futures, self._disk_futures = self._disk_futures, []
        for f in futures:
            f.exception()

    # -- loads -----------------------------------------------------------------------

    def start_loads(self, ops: Sequence[LoadOp]) -> None:
        """Call on the forward's thread after vLLM prepared the step's blocks (``start_load_kv``)."""
        futures: list[Future[DeviceEvent]] = [Future() for _ in self.regions]
        for layer, f in enumerate(futures):
            self._layer_futures[layer].append(f)
        self._loader.submit(self._load, list(ops), futures, self.copies.mark_forward())

    def _load(self, ops: list[LoadOp], layer_futures: list[Future[DeviceEvent]], prepared: DeviceEvent) -> None:
        staged: list[_Staged] = []
        try:
            self.copies.begin_loads(after=prepared)
            for op in ops:
                staged.append(self._stage(op))
            for layer in range(len(self.regions)):
                slots: list[int] = []
                block_ids: list[int] = []
                for op, st in zip(ops, staged):
                    n = st.local
                    if st.fetch is not None and st.fetch.layer_landed(layer):  # waits for this layer only
                        n += st.fetch.granted
                    slots += op.slots[:n]
                    block_ids += op.block_ids[:n]
                placed = self.copies.load_layer(layer, slots, block_ids) if slots else self.copies.fence()
                if layer < len(layer_futures) - 1:
                    layer_futures[layer].set_result(placed)
            usable = [self._settle(op, st) for op, st in zip(ops, staged)]
        except Exception:
            logger.exception("store: load failed")
            usable = [0] * len(ops)
            for i, op in enumerate(ops):  # reserved slots must always be committed or given back
                st = staged[i] if i < len(staged) else _Staged(0, [j for j, p in enumerate(op.from_peer) if p])
                self._settle(op, st, failed=True)
        # recorded before the last layer is released: vLLM asks for load errors right
        # after its forward, which waits for every layer
        with self._lock:
            for op, n in zip(ops, usable):
                self._loads.append(LoadResult(op.request_id, op.keys[:n], op.keys[n:], op.block_ids[n:]))
                self._load_errors.update(op.block_ids[n:])
                self._loaded_requests.add(op.request_id)
                if n < len(op.keys):
                    self._failed_loads.add(op.request_id)
        # a failed load still orders the forward after every copy it launched: a late copy
        # must not overwrite what vLLM recomputes in those blocks
        placed = self.copies.fence()
        for f in layer_futures:
            if not f.done():
                f.set_result(placed)

    def _stage(self, op: LoadOp) -> _Staged:
        """Read the op's disk blocks into their slots and start fetching its peer
        blocks (layer by layer, not waited for here)."""
        usable = len(op.keys)
        remote = [i for i, p in enumerate(op.from_peer) if p]
        reads = []
        for i, (slot, from_disk) in enumerate(zip(op.slots, op.from_disk)):
            if from_disk:
                if self.disk is None:
                    usable = min(usable, i)
                    break
                self.directory.drop_slots([slot])
                reads.append((i, self.disk.read_into(op.keys[i], self.pool.slot_view(slot), op.scope)))
        for i, fut in reads:  # wait for all: no read may still write a slot the scheduler frees
            digest = fut.result()
            if digest is not None:
                self.directory.put(op.keys[i], op.slots[i], digest, op.scope)
            else:
                usable = min(usable, i)
        if not remote:
            return _Staged(usable, [])
        staged = _Staged(min(usable, remote[0]), remote)
        if usable >= remote[0]:
            staged.fetch = self._start_fetch(op, remote)
        return staged

    def _start_fetch(self, op: LoadOp, remote: list[int]) -> PeerFetch | None:
        """Start fetching the op's peer blocks (a suffix of it) into their reserved slots."""
        peers = op.peer.split(",")
        slots = [op.slots[i] for i in remote]
        self.directory.drop_slots(slots)
        if self.exchange is None or len(peers) <= self.rank:
            logger.warning("store: no peer endpoint for rank %d (%r); recomputing", self.rank, op.peer)
            return None
        return self.exchange.start_fetch(peers[self.rank], [op.keys[i] for i in remote], slots, op.scope)

    def _settle(self, op: LoadOp, st: _Staged, failed: bool = False) -> int:
        """End the op's fetch (commit what landed intact, give back the rest);
        returns how many leading blocks of the op are usable. Once per op."""
        if st.settled:
            return 0
        st.settled = True
        if not st.remote:
            return st.local
        sums = st.fetch.finish() if st.fetch is not None else []  # waits: nothing writes the slots after
        if failed:
            sums = []
        self._fetched(op, st.remote, sums)
        return st.local + len(sums)

    def _fetched(self, op: LoadOp, remote: list[int], sums: list[bytes]) -> None:
        """Report fetched blocks as saved here (the scheduler commits them), the rest as failed."""
        keys = [op.keys[i] for i in remote]
        slots = [op.slots[i] for i in remote]
        got = len(sums)
        for key, slot, digest in zip(keys, slots, sums):
            self.directory.put(key, slot, digest, op.scope)
        with self._lock:
            self._saves.append(SaveResult(op.request_id, keys[:got], keys[got:]))
        if self.disk is not None and got:
            parent = op.keys[remote[0] - 1] if remote[0] else op.parent
            self._write_through(parent, keys[:got], slots[:got], sums, op.scope)

    def wait_layer(self, layer: int) -> None:
        """Order the forward's reads of ``layer`` after every load started so far: on the host
        until the layer's copies are launched, then with a stream wait for the copies."""
        futures, self._layer_futures[layer] = self._layer_futures[layer], []
        for f in futures:
            self.copies.wait(f.result())

    # -- reporting ---------------------------------------------------------------------

    def report(self) -> StoreReport:
        """What landed since the last call (send to the scheduler side)."""
        committed, evicted = self.disk.drain() if self.disk else ([], [])
        with self._lock:
            report = StoreReport(self._saves, self._loads, committed, evicted, self._disk_failed)
            self._saves, self._loads, self._disk_failed = [], [], []
        return report

    def take_finished(self) -> tuple[set[str], set[str]]:
        """(requests whose saves were copied out, requests whose loads ended) since the last call."""
        with self._lock:
            saved, self._saved_requests = self._saved_requests, set()
            loaded, self._loaded_requests = self._loaded_requests, set()
        return saved, loaded

    def take_load_errors(self) -> set[int]:
        """vLLM block ids whose load failed (for ``get_block_ids_with_load_errors``)."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def take_failed_loads(self) -> set[str]:
        """Requests whose load left a block unloaded, since the last call (a connector that cannot
        name failed blocks to vLLM - several KV cache groups - fails the request's whole load)."""
        with self._lock:
            failed, self._failed_loads = self._failed_loads, set()
        return failed

    def close(self) -> None:
        if self.exchange is not None:
            self.exchange.close()
        self.wait_disk()
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()
