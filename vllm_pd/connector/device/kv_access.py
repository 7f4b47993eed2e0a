"""How the transport reaches this worker's KV cache: directly, or through pinned staging.

* :class:`DirectAccess` - the transport registers the KV cache itself: vLLM's CPU
  cache with any transport, or device memory with a transport that takes it (NIXL
  registers VRAM). A send may leave once the forward's write is complete.
* :class:`StagedAccess` - device KV over a host transport (tcp, shm): the transport
  registers a :class:`StagingArena`; a send first copies its blocks device-to-host
  on the copy stream (after the forward's write), a landing copies host-to-device.

Both hand out *transport ids* (the block ids the transport reads or writes) and the
event after which those bytes are final, so the sender and the loader never ask
which kind they have. Sends and landings copy on streams of their own
(``send_copies``, ``land_copies``): a layer's send never queues behind landings.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm_pd.connector.device.block_copies import BlockCopies, Run
from vllm_pd.connector.device.host_staging import StagingArena
from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent
from vllm_pd.connector.transport.base import MemoryRegion


def union(block_ids_by_layer: Sequence[Sequence[int]]) -> list[int]:
    """Every block id named, once, in order of first appearance."""
    return list(dict.fromkeys(b for ids in block_ids_by_layer for b in ids))


class KVAccess(abc.ABC):
    #: a read lands in the KV cache itself: its landing blocks are our blocks
    lands_in_kv = False

    def __init__(self, send_copies: BlockCopies, land_copies: BlockCopies | None = None) -> None:
        self.send_copies = send_copies
        self.land_copies = land_copies or BlockCopies(send_copies.regions, send_copies.device)

    @property
    def regions(self) -> list[MemoryRegion]:
        """The KV cache, one region per layer."""
        return self.send_copies.regions

    def record_compute(self) -> DeviceEvent:
        """An event after everything the forward launched so far."""
        return self.send_copies.record_compute()

    @property
    @abc.abstractmethod
    def transport_regions(self) -> list[MemoryRegion]:
        """What the transport registers, one region per layer."""

    # ---- prefill ------------------------------------------------------------------------------
    @abc.abstractmethod
    def send_ids(self, transfer_id: str, block_ids: Sequence[int]) -> list[int] | None:
        """Transport ids ``block_ids`` will be sent from (before any copy); None: no room."""

    @abc.abstractmethod
    def stage_send(
        self, transfer_id: str, layer: int, block_ids: Sequence[int], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        """Transport ids of ``block_ids`` of ``layer`` and the event after which they may
        leave; ``after`` marks the forward's write. None: no room (do not send)."""

    @abc.abstractmethod
    def stage_hold(
        self, transfer_id: str, block_ids_by_layer: Sequence[Sequence[int]], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        """As ``stage_send`` for every layer, each its own blocks (a hybrid model's groups hold
        different ones): the blocks decode may read (pull). The transport ids come in the order of
        :func:`union` of the blocks."""

    def release(self, transfer_id: str) -> None:
        """The transfer is over: its staging, if any, is free again."""

    # ---- decode -------------------------------------------------------------------------------
    @abc.abstractmethod
    def landing_ids(self, key: str, block_ids: Sequence[int]) -> list[int] | None:
        """Transport ids a read of ``block_ids`` (every layer) lands at; None: no room."""

    @abc.abstractmethod
    def land_read(self, key: str, layer: int, block_ids: Sequence[int], after: DeviceEvent) -> DeviceEvent:
        """A read into ``landing_ids(key, ...)`` of ``layer`` is complete: place it in
        ``block_ids`` once ``after`` is (vLLM's zeroing of new blocks); the event marks them final."""

    def land_pushed(
        self, layer: int, runs: Sequence[Run], after: DeviceEvent, window: tuple[int, int] | None = None
    ) -> DeviceEvent:
        """Place runs of host rows (pushed KV) into their blocks of ``layer`` once ``after`` is
        complete (``window``: (offset, nbytes) - the rows are that part of each block); the rows
        stay untouched until the returned event."""
        return self.land_copies.from_rows(layer, runs, after, window)

    def release_landing(self, key: str) -> None:
        """The load ``key`` is over and its events complete."""


class DirectAccess(KVAccess):
    lands_in_kv = True

    @property
    def transport_regions(self) -> list[MemoryRegion]:
        return self.regions

    def send_ids(self, transfer_id: str, block_ids: Sequence[int]) -> list[int] | None:
        return list(block_ids)

    def stage_send(
        self, transfer_id: str, layer: int, block_ids: Sequence[int], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        return list(block_ids), after

    def stage_hold(
        self, transfer_id: str, block_ids_by_layer: Sequence[Sequence[int]], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        return union(block_ids_by_layer), after

    def landing_ids(self, key: str, block_ids: Sequence[int]) -> list[int] | None:
        return list(block_ids)

    def land_read(self, key: str, layer: int, block_ids: Sequence[int], after: DeviceEvent) -> DeviceEvent:
        return after  # the transport wrote the blocks themselves, after start_load_kv


@dataclass
class _Staged:
    rows: dict[int, int] = field(default_factory=dict)  # block id -> arena row
    runs: list[tuple[int, int]] = field(default_factory=list)  # (first row, count) taken
    copied: dict[int, set[int]] = field(default_factory=dict)  # layer -> block ids copied out


class StagedAccess(KVAccess):
    def __init__(self, send_copies: BlockCopies, arena: StagingArena, land_copies: BlockCopies | None = None) -> None:
        super().__init__(send_copies, land_copies)
        self.arena = arena
        self._lock = threading.Lock()
        self._sends: dict[str, _Staged] = {}
        self._landings: dict[str, _Staged] = {}

    @property
    def transport_regions(self) -> list[MemoryRegion]:
        return self.arena.regions

    def send_ids(self, transfer_id: str, block_ids: Sequence[int]) -> list[int] | None:
        with self._lock:
            st = self._sends.setdefault(transfer_id, _Staged())
            return [st.rows[b] for b in block_ids] if self._map(st, block_ids) else None

    def stage_send(
        self, transfer_id: str, layer: int, block_ids: Sequence[int], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        return self._stage(transfer_id, {layer: block_ids}, block_ids, after)

    def stage_hold(
        self, transfer_id: str, block_ids_by_layer: Sequence[Sequence[int]], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        return self._stage(transfer_id, dict(enumerate(block_ids_by_layer)), union(block_ids_by_layer), after)

    def _stage(
        self, transfer_id: str, layers: dict[int, Sequence[int]], block_ids: Sequence[int], after: DeviceEvent
    ) -> tuple[list[int], DeviceEvent] | None:
        with self._lock:
            st = self._sends.setdefault(transfer_id, _Staged())
            if not self._map(st, block_ids):
                return None
            rows = [st.rows[b] for b in block_ids]
            for layer, layer_ids in layers.items():
                done = st.copied.setdefault(layer, set())
                todo = [b for b in layer_ids if b not in done]
                if todo:
                    self.send_copies.to_rows(layer, self._arena_runs(layer, todo, st), after)
                done.update(todo)
            # also covers blocks an earlier send copied out and whose copy may still run
            return rows, self.send_copies.fence()

    def _map(self, st: _Staged, block_ids: Sequence[int]) -> bool:
        new = [b for b in dict.fromkeys(block_ids) if b not in st.rows]
        if not new:
            return True
        first = self.arena.take(len(new))
        if first is None:
            return False
        st.runs.append((first, len(new)))
        st.rows.update((b, first + i) for i, b in enumerate(new))
        return True

    def release(self, transfer_id: str) -> None:
        with self._lock:
            st = self._sends.pop(transfer_id, None)
        self._give_back(st)

    def landing_ids(self, key: str, block_ids: Sequence[int]) -> list[int] | None:
        with self._lock:
            st = self._landings.setdefault(key, _Staged())
            if not self._map(st, block_ids):
                return None
            return [st.rows[b] for b in block_ids]

    def land_read(self, key: str, layer: int, block_ids: Sequence[int], after: DeviceEvent) -> DeviceEvent:
        with self._lock:
            runs = self._arena_runs(layer, block_ids, self._landings[key])
        return self.land_copies.from_rows(layer, runs, after) if runs else COMPLETED

    def _arena_runs(self, layer: int, block_ids: Sequence[int], st: _Staged) -> list[Run]:
        """``block_ids`` with their arena rows of ``layer``, cut where the rows stop being consecutive."""
        rows = self.arena.tensors[layer]
        return [(ids, rows[first : first + len(ids)]) for first, ids in _runs(block_ids, st.rows)]

    def release_landing(self, key: str) -> None:
        with self._lock:
            st = self._landings.pop(key, None)
        self._give_back(st)

    def _give_back(self, st: _Staged | None) -> None:
        for first, n in st.runs if st is not None else ():
            self.arena.give_back(first, n)


def _runs(block_ids: Sequence[int], rows: dict[int, int]) -> list[tuple[int, list[int]]]:
    """``block_ids`` split where their rows stop being consecutive: (first row, ids) each."""
    out: list[tuple[int, list[int]]] = []
    for b in block_ids:
        if out and rows[b] == out[-1][0] + len(out[-1][1]):
            out[-1][1].append(b)
        else:
            out.append((rows[b], [b]))
    return out
