"""Decode side: land one request's remote KV in its blocks, layer by layer.

Push mode: the bytes are (or are arriving) in :class:`PushStaging`; copy them.
Whatever did not arrive in time is fetched (pulled) from prefill, which holds
its blocks until we release them. Pull mode: fetch every layer. A decode leg
sent beside its prefill leg (no ``RemotePrefill`` yet) first waits for
prefill's announcement and checks it is for this very prompt.

Prefill may be of another shape (``kv_geometry``): another TP size, another block size.
Then each layer's blocks come as *units*, one per piece of the rank plan - a run of heads
from one prefill rank: pushed as rows of that piece of prefill's blocks (under the plan's
staging key, placed into that part of our blocks, re-cut first where block sizes differ,
``block_recut``), or fetched: as spans straight into our blocks, or - where only the block
size differs - as prefill's whole blocks, landed back to back in our landing blocks and re-cut
from there as a push is (``kv_geometry.whole_block_reads``: a read per block, not one per head
and row of vLLM CPU's transposed K). A recurrent state's layer of another shape takes one unit
per prefill rank it reads: that rank's byte windows of its state block (``state_geometry``),
always fetched (vLLM runs no save hook for a recurrent layer, so its KV is never pushed). Of
equal shapes a layer is one unit of whole blocks, as
always. A hybrid model's layers each take their own KV cache group's blocks (``LoadSpec.group``).

The job always ends ``ok`` or failed - never pending forever - and always tells
prefill to release its copy, so neither side leaks blocks: every prefill rank this
rank read from (or is told to release, ``kv_geometry.releasers``), once it is done.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

import torch

from vllm_pd.connector.config import PROBE_PAUSED_PUSHES_S
from vllm_pd.connector.device.block_copies import Run, byte_blocks
from vllm_pd.connector.device.block_recut import recut_rows
from vllm_pd.connector.device.kv_access import KVAccess, union
from vllm_pd.connector.device.kv_device import COMPLETED, DeviceEvent
from vllm_pd.connector.device.kv_geometry import (
    GroupPlan,
    Piece,
    RankPlan,
    Span,
    WholeBlockReads,
    incompatibility,
    piece_spans,
    plan_rank,
    remote_positions,
    whole_block_reads,
    window_positions,
)
from vllm_pd.connector.device.state_geometry import StateWindow
from vllm_pd.connector.step_specs import LoadSpec
from vllm_pd.connector.transport.base import FetchSpans, MemoryRegion, Transport
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.connector.worker.release import DecodeRelease
from vllm_pd.errors import ProtocolError, TransferRejected
from vllm_pd.protocol.control import PingMessage
from vllm_pd.protocol.transfer_params import RemotePrefill
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# a prefill rank other than the one that announced a decode leg's KV may grant its share a little later
GRANT_WAIT_S = 2.0
GRANT_RETRY_S = 0.01


@dataclass(frozen=True)
class _Unit:
    """What one layer takes from one prefill rank: whole blocks (``piece`` None) or a piece."""

    group: int
    source: int  # prefill TP rank
    key: str  # what its pushes land under
    plan: GroupPlan | None = None
    piece: Piece | None = None
    windows: tuple[StateWindow, ...] = ()  # a state's windows of ``source``'s block (no piece)

    @property
    def whole(self) -> bool:
        return self.piece is None and not self.windows

    @property
    def counts_blocks(self) -> bool:
        """A block landed counts once, with its whole, its first piece or its first source's windows."""
        if self.plan is None:
            return True
        return self.piece == self.plan.pieces[0] if self.plan.pieces else self.source == self.plan.sources[0]


@dataclass(frozen=True)
class _Recut:
    """A unit's blocks read as prefill's whole blocks: landed back to back in ``landing_ids``
    (transport ids of ``block_ids``), re-cut into ``block_ids`` once the read is complete."""

    unit: _Unit
    reads: WholeBlockReads
    block_ids: tuple[int, ...]
    landing_ids: tuple[int, ...]


class LoadJob:
    def __init__(
        self,
        spec: LoadSpec,
        transport: Transport,
        regions: list[MemoryRegion],
        staging: PushStaging,
        access: KVAccess,
        rank: int,
        timeout_s: float,
        push_wait_s: float,
        tp_size: int = 1,
        probe_s: float = 2.0,
        groups: LayerGroups | None = None,
        host_alloc: Callable[[int], torch.Tensor] | None = None,
        release: DecodeRelease | None = None,
    ) -> None:
        self.spec = spec
        self.remote: RemotePrefill | None = spec.remote
        self._transport = transport
        self._regions = regions
        self._staging = staging
        self._access = access
        self._rank = rank
        self._release = release or DecodeRelease(transport, rank, tp_size)
        self._timeout_s = timeout_s
        self._push_wait_s = push_wait_s
        self._probe_s = probe_s
        self._groups = groups or LayerGroups(None, len(regions), 1)
        self._host_alloc = host_alloc
        self._plan: RankPlan | None = None
        self.layer_done = [threading.Event() for _ in regions]
        # set before layer_done: the device copy that placed the layer in our blocks
        self.layer_events: list[DeviceEvent] = [COMPLETED] * len(regions)
        self.layer_ok = [False] * len(regions)
        # settled: ok and error are final (a layer-wise forward's thread waits for this much only);
        # done: also every copy into our blocks is complete and the staging they read is free
        self.settled = threading.Event()
        self.done = threading.Event()
        self.ok = False
        self.error: str | None = None
        self.refused = False  # prefill's KV is of a shape we cannot take (counted, recomputed)
        self.bytes_landed = 0
        self.blocks_from_push = 0
        self.blocks_fetched = 0
        self.started = time.monotonic()
        self.finished_at: float | None = None
        self.cancelled = False  # set before run(): the request is gone, do not wait for prefill
        self._peer_seen_at = 0.0  # when prefill last answered a probe
        # set before run(): vLLM zeroed the request's new blocks on the compute stream up to
        # here; our copies into them wait for it
        self.blocks_ready: DeviceEvent = COMPLETED

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:
            logger.exception("KV load for request %s failed", self.spec.request_id)
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self.ok = self.error is None and all(self.layer_ok)
            for ev in self.layer_done:
                ev.set()
            self.settled.set()
            # done means in our blocks (async loads are reported on it), and the staging
            # the copies read from is free once they are
            for event in self.layer_events:
                event.synchronize()
            self._access.release_landing(self.spec.request_id)
            self.finished_at = time.monotonic()
            self.done.set()
            if self.remote is None:
                # never announced: whenever prefill announces it, it is released
                announced = self._staging.abandon(self.spec.transfer_id)
                self.remote = RemotePrefill.from_params(announced) if announced else None
            else:
                for key in self._staging_keys():
                    self._staging.drop(key)
            if self.remote is not None:
                self._release_remote(self.remote)

    # ---- the plan ---------------------------------------------------------------------------------
    def _staging_keys(self) -> list[str]:
        if self._plan is None or self._plan.identity:
            return [self.spec.transfer_id]
        # the announcement stays under the transfer id itself, beside the ranks' keys
        keys = [self._plan.staging_key(self.spec.transfer_id, p) for p in self._plan.sources]
        return list(dict.fromkeys([self.spec.transfer_id, *keys]))

    def _make_plan(self, remote: RemotePrefill) -> bool:
        """This rank's plan for ``remote`` (None for equal shapes told by no shape); False (the
        error set) where prefill's KV is of a shape we cannot take."""
        local = self._groups.shape
        if remote.shape is None or local is None:
            return True
        try:
            self._plan = plan_rank(remote.shape, local, self._rank)
        except ValueError as e:
            self.refused = True
            self.error = f"prefill's KV cannot be taken here: {e}"
            return False
        return True

    def _units(self, layer: int) -> list[_Unit]:
        group = self._groups.group(layer)
        plan = self._plan
        if plan is None or plan.groups[group].identity:
            return [
                _Unit(
                    group,
                    self._rank if plan is None else plan.groups[group].pieces[0].source,
                    self.spec.transfer_id
                    if plan is None
                    else plan.staging_key(self.spec.transfer_id, plan.groups[group].pieces[0].source),
                )
            ]
        gp = plan.groups[group]
        if gp.windows:
            return [
                _Unit(
                    group,
                    source,
                    plan.staging_key(self.spec.transfer_id, source),
                    gp,
                    windows=tuple(w for w in gp.windows if w.source == source),
                )
                for source in gp.sources
            ]
        return [_Unit(group, p.source, plan.staging_key(self.spec.transfer_id, p.source), gp, p) for p in gp.pieces]

    def _peer(self, remote: RemotePrefill, source: int) -> str:
        return remote.endpoint_for_rank(source)

    # ---- the load ---------------------------------------------------------------------------------
    def _run(self) -> None:
        spec = self.spec
        deadline = self.started + self._timeout_s  # a job parked for prefill's announcement counts too
        remote = self.remote or self._await_announcement(deadline)
        if remote is None or (self.spec.remote is not None and not self._make_plan(remote)):
            return
        missing: dict[int, list[tuple[_Unit, list[int]]]] = {}  # layer -> (unit, local indexes to fetch)
        if remote.mode == "push":
            # layer by layer: announced as prefill's forward starts, the pushes land while we copy
            since = time.monotonic()
            for layer in range(len(self._regions)):
                miss = self._land_layer_pushed(remote, layer, deadline, since)
                if miss is None:
                    return
                if miss:
                    missing[layer] = miss
            if missing:
                logger.info(
                    "request %s: %d layer(s) incomplete after push; fetching them from prefill",
                    spec.request_id,
                    len(missing),
                )
                sources = {u.source for units in missing.values() for u, _ in units}
                if time.monotonic() - self._peer_seen_at > PROBE_PAUSED_PUSHES_S and not self._peers_answer(
                    remote, sources
                ):
                    return
        else:
            for layer in range(len(self._regions)):
                missing[layer] = [(u, list(range(len(spec.group(u.group)[1])))) for u in self._units(layer)]
        if missing:
            self._fetch(remote, missing, deadline)

    def _fetch(self, remote: RemotePrefill, missing: dict[int, list[tuple[_Unit, list[int]]]], deadline: float) -> None:
        spec = self.spec
        local_ids = union([spec.group(g)[1] for g in range(self._groups.num_groups)])
        landing_ids = self._access.landing_ids(spec.request_id, local_ids)
        if landing_ids is None:
            self.error = "no host staging room to land the KV read from prefill"
            return
        landing = dict(zip(local_ids, landing_ids))
        self.blocks_ready.synchronize()  # a transport writing our blocks itself must come after the zeroing
        futures: list[tuple[int, list[tuple[Future[None], int, int, _Unit, list[int]]], list[_Recut]]] = []
        for layer, units in missing.items():
            fetches, recuts = [], []
            for unit, idxs in units:
                fut, nbytes, recut = self._fetch_unit(remote, layer, unit, idxs, landing, deadline)
                fetches.append((fut, nbytes, len(idxs) if unit.counts_blocks else 0, unit, idxs))
                recuts += [recut] if recut is not None else []
            futures.append((layer, fetches, recuts))
        for layer, fetches, recuts in futures:
            ok = True
            for fut, nbytes, blocks, unit, idxs in fetches:
                try:
                    self._finish_read(fut, remote, layer, unit, idxs, landing, deadline)
                except Exception as e:
                    self.error = self.error or f"fetch of layer {layer} failed: {type(e).__name__}: {e}"
                    ok = False
                    continue
                self.blocks_fetched += blocks
                self.bytes_landed += nbytes
            if not ok:
                self._layer_landed(layer, False)
                continue
            # blocks re-cut from prefill's whole blocks are placed from the re-cut, not from their landing
            recut_ids = {b for r in recuts for b in r.block_ids}
            _, ids = spec.group(self._groups.group(layer))
            placed = self._access.land_read(
                spec.request_id, layer, [b for b in ids if b not in recut_ids], self.blocks_ready
            )
            for recut in recuts:
                placed = self._place_recut(layer, recut)
            self._layer_landed(layer, True, placed)

    def _finish_read(
        self,
        fut: Future[None],
        remote: RemotePrefill,
        layer: int,
        unit: _Unit,
        idxs: list[int],
        landing: dict[int, int],
        deadline: float,
    ) -> None:
        """Wait for a read of ``unit``. A decode leg sent beside its prefill leg heard that prefill's KV is
        granted from one prefill rank (``kv_geometry.announced_ranks``); another prefill rank it reads (a
        recurrent state is always read, from every rank holding a share) grants its share on its own send
        thread, a moment after their forward ends together: a read it rejects is tried again, for up to
        GRANT_WAIT_S."""
        until = min(deadline, time.monotonic() + GRANT_WAIT_S)
        while True:
            try:
                fut.result(timeout=max(0.1, deadline - time.monotonic() + 1.0))
                return
            except TransferRejected:
                announcer = self._rank % remote.tp_size
                if self.spec.remote is not None or unit.source == announcer or time.monotonic() >= until:
                    raise
            time.sleep(GRANT_RETRY_S)
            fut, _, _ = self._fetch_unit(remote, layer, unit, idxs, landing, deadline)

    def _fetch_unit(
        self, remote: RemotePrefill, layer: int, unit: _Unit, idxs: list[int], landing: dict[int, int], deadline: float
    ) -> tuple[Future[None], int, _Recut | None]:
        """Start reading ``unit``'s part of our blocks at indexes ``idxs`` of its group; (the read, its
        bytes, what of it is re-cut once landed)."""
        first, ids = self.spec.group(unit.group)
        remote_ids = remote.group_blocks(unit.group)
        timeout = max(0.1, deadline - time.monotonic())
        peer = self._peer(remote, unit.source)
        if unit.whole:
            src = [remote_ids[first + i] for i in idxs]
            dst = [landing[ids[i]] for i in idxs]
            fut = self._transport.fetch(peer, remote.transfer_id, layer, src, dst, timeout=timeout)
            return fut, len(idxs) * self._regions[layer].block_nbytes, None
        if unit.windows:
            fut, nbytes = self._fetch_state_windows(remote, layer, unit, idxs, landing, timeout)
            return fut, nbytes, None
        assert unit.plan is not None and unit.piece is not None
        reads = self._whole_block_reads(remote, layer, unit, idxs)
        spans: list[Span] = list(reads.spans) if reads is not None else []
        by_span = [i for i in idxs if reads is None or first + i not in reads.local]
        for i in by_span:  # our block i, from the spans of prefill's blocks that hold its tokens
            spans += [
                replace(s, dst_index=i) for s in piece_spans(unit.plan, unit.piece, first + i, 1, remote.num_tokens)
            ]
        if any(s.src_index >= len(remote_ids) for s in spans):
            raise ProtocolError(f"prefill's {len(remote_ids)} blocks of group {unit.group} do not hold our tokens")
        src = [remote_ids[s.src_index] for s in spans]
        dst = [landing[ids[s.dst_index]] for s in spans]
        parts = FetchSpans(
            tuple(s.src_offset for s in spans), tuple(s.dst_offset for s in spans), tuple(s.nbytes for s in spans)
        )
        fut = self._transport.fetch(peer, remote.transfer_id, layer, src, dst, timeout=timeout, spans=parts)
        recut = None
        if reads is not None:
            local = [ids[j - first] for j in reads.local]
            recut = _Recut(unit, reads, tuple(local), tuple(landing[b] for b in local))
        return fut, sum(parts.lengths), recut

    def _whole_block_reads(
        self, remote: RemotePrefill, layer: int, unit: _Unit, idxs: list[int]
    ) -> WholeBlockReads | None:
        """How ``unit``'s blocks are read as prefill's whole blocks and re-cut here, or None (read by
        spans): only every block of its group at once, of only another block size, landing in
        host memory of our block's size (the re-cut reads it there)."""
        assert unit.plan is not None and unit.piece is not None
        first, ids = self.spec.group(unit.group)
        region = self._access.transport_regions[layer]
        if (
            idxs != list(range(len(ids)))
            or region.tensor.device.type != "cpu"
            or region.block_nbytes != unit.plan.local_format.block_nbytes
        ):
            return None
        num = len(ids)
        if self.spec.layerwise and self._access.lands_in_kv:
            # This step's forward writes its tokens into our last block while we load: vLLM writes a
            # layer's new KV before it waits for the layer's load. Prefill's blocks landed there as
            # they are would be written over before the re-cut reads them; that block goes by spans.
            num -= 1
        return whole_block_reads(unit.plan, unit.piece, first, num, remote.num_tokens)

    def _place_recut(self, layer: int, recut: _Recut) -> DeviceEvent:
        """Re-cut prefill's whole blocks, landed back to back in ``recut``'s landing blocks, into our
        block size and place them in our blocks (as a push of another block size is)."""
        plan, reads = recut.unit.plan, recut.reads
        assert plan is not None
        fmt = plan.remote_format
        landed = byte_blocks(self._access.transport_regions[layer])[torch.tensor(recut.landing_ids)]
        rows = landed.reshape(-1)[: len(reads.remote) * fmt.block_nbytes].view(len(reads.remote), -1)
        rows = recut_rows(
            list(rows),
            fmt.heads,
            plan.remote.block_size,
            plan.local.block_size,
            reads.local.start * plan.local.block_size,
            len(reads.local),
            fmt.runs or (),
            self._host_alloc,
        )
        return self._access.land_pushed(layer, [(recut.block_ids, rows)], self.blocks_ready)

    def _fetch_state_windows(
        self, remote: RemotePrefill, layer: int, unit: _Unit, idxs: list[int], landing: dict[int, int], timeout: float
    ) -> tuple[Future[None], int]:
        """Read ``unit``'s windows of prefill's state block into ours: the state after the same token,
        in the last block of each side's own block size."""
        assert unit.plan is not None
        _, ids = self.spec.group(unit.group)
        remote_ids = remote.group_blocks(unit.group)
        position = window_positions(unit.plan.remote, remote.num_tokens)
        if position >= len(remote_ids):
            raise ProtocolError(f"prefill's {len(remote_ids)} blocks of group {unit.group} hold no state block")
        src, dst, src_off, dst_off, lengths = [], [], [], [], []
        for i in idxs:
            for w in unit.windows:
                src.append(remote_ids[position])
                dst.append(landing[ids[i]])
                src_off.append(w.src_offset)
                dst_off.append(w.dst_offset)
                lengths.append(w.nbytes)
        parts = FetchSpans(tuple(src_off), tuple(dst_off), tuple(lengths))
        peer = self._peer(remote, unit.source)
        fut = self._transport.fetch(peer, remote.transfer_id, layer, src, dst, timeout=timeout, spans=parts)
        return fut, sum(parts.lengths)

    def _land_layer_pushed(
        self, remote: RemotePrefill, layer: int, deadline: float, since: float
    ) -> list[tuple[_Unit, list[int]]] | None:
        """Place what was pushed of ``layer`` in our blocks; per unit, the indexes (into its group's
        blocks) still missing (None: a prefill rank is gone, the error set)."""
        missing = []
        for unit in self._units(layer):
            if not self._wait_pushes(remote, unit, layer, deadline, since):
                return None
            miss = self._copy_staged(remote, layer, unit)
            if miss:
                missing.append((unit, miss))
        if not missing:
            self._layer_landed(layer, True)
        return missing

    def _wait_pushes(self, remote: RemotePrefill, unit: _Unit, layer: int, deadline: float, since: float) -> bool:
        """Wait for ``layer``'s pushes of ``unit`` while they keep landing. Once they pause for a second, its
        prefill rank is probed: gone (cut off, paused) - False, the error set, at once rather than after
        push_wait_s; there - waited for on, until push_wait_s passed without a push (the rest is then fetched)."""
        quiet = min(PROBE_PAUSED_PUSHES_S, self._push_wait_s)
        probed = since
        while not self._staging.wait_layer(unit.key, layer, deadline, stall_s=quiet, since=probed):
            if time.monotonic() >= deadline or not self._peers_answer(remote, {unit.source}):
                return self.error is None
            probed = time.monotonic()
            # a rank none of whose pushes came yet is waited for from the load's start, not from
            # "never": its first layer may take longer than the pause that gets it probed
            last = max(self._staging.last_push(unit.key), since)
            if probed - last >= self._push_wait_s:
                logger.debug(
                    "request %s: no push of %s for %.1fs; layer %d of prefill rank %d is fetched",
                    self.spec.request_id,
                    unit.key,
                    probed - last,
                    layer,
                    unit.source,
                )
                return True
        return True

    def _peers_answer(self, remote: RemotePrefill, sources: set[int]) -> bool:
        """Whether the prefill ranks answer a probe within probe_s (else the error is set). Pushes that
        stall may mean prefill is cut off: fetching from it would hold this load - and a
        layer-wise load's forward - until the transfer's deadline, for bytes that won't come."""
        for source in sorted(sources):
            peer = self._peer(remote, source)
            try:
                self._transport.notify(peer, PingMessage().encode(), timeout=self._probe_s).result(
                    timeout=self._probe_s + 1.0
                )
            except Exception as e:
                self.error = (
                    f"prefill {peer} did not answer within {self._probe_s:.1f}s after its pushes "
                    f"stalled ({type(e).__name__}: {e})"
                )
                return False
        self._peer_seen_at = time.monotonic()
        return True

    def _await_announcement(self, deadline: float) -> RemotePrefill | None:
        """The decode leg came first: wait for prefill to say what it pushed (None: error set)."""
        spec = self.spec
        params = self._staging.wait_announced(spec.transfer_id, time.monotonic() if self.cancelled else deadline)
        if params is None:
            self.error = (
                "request aborted before prefill announced transfer " + spec.transfer_id
                if self.cancelled
                else f"prefill never announced transfer {spec.transfer_id} within {self._timeout_s:.0f}s"
            )
            return None
        remote = RemotePrefill.from_params(params)
        if remote is None:
            self.error = f"prefill announced transfer {spec.transfer_id} with unusable params"
            return None
        self.remote = remote  # from here on it is released whatever happens
        problem = spec.prompt.mismatch(remote) if spec.prompt is not None else "no local prompt to check"
        if problem is None and remote.transfer_id != spec.transfer_id:
            problem = f"prefill's answer names transfer {remote.transfer_id}"
        if problem is not None:
            local = spec.prompt.shape if spec.prompt is not None else None
            self.refused = (
                local is not None and remote.shape is not None and incompatibility(remote.shape, local) is not None
            )
            self.error = f"announced KV of transfer {spec.transfer_id} is not for this request: {problem}"
            return None
        if not self._make_plan(remote):
            return None
        short = self._uncovered(remote)
        if short is not None:
            self.error = f"announced KV of transfer {spec.transfer_id} is not for this request: {short}"
            return None
        return remote

    def _uncovered(self, remote: RemotePrefill) -> str | None:
        """Why prefill's blocks do not hold the tokens we load, or None."""
        for g in range(self._groups.num_groups):
            first, ids = self.spec.group(g)
            plan = self._plan.groups[g] if self._plan is not None else None
            need = (
                remote_positions(plan, first, len(ids), remote.num_tokens).stop
                if plan is not None
                else first + len(ids)
            )
            if len(remote.group_blocks(g)) < need:
                return f"prefill computed {remote.num_tokens} tokens, fewer than this prompt's"
        return None

    def _copy_staged(self, remote: RemotePrefill, layer: int, unit: _Unit) -> list[int]:
        """Place what was pushed of ``unit`` of ``layer`` in our blocks; the indexes (into its
        group's blocks) that did not land."""
        first, ids = self.spec.group(unit.group)
        region = self._regions[layer]
        if unit.whole:
            runs, missing = self._staging.landed_runs(
                unit.key, layer, range(first, first + len(ids)), region.block_nbytes
            )
            if runs:
                self._place(layer, [([ids[i] for i in idxs], rows) for idxs, rows in runs], None)
                n = sum(len(idxs) for idxs, _ in runs)
                self.blocks_from_push += n
                self.bytes_landed += n * region.block_nbytes
            return missing
        if unit.windows:
            return list(range(len(ids)))  # never pushed (no save hook for a recurrent layer): read
        assert unit.plan is not None and unit.piece is not None
        plan, piece = unit.plan, unit.piece
        src_nbytes = piece.src_window(plan.remote_format)[1]
        dst_window = piece.dst_window(plan.local_format)
        counted = int(unit.counts_blocks)
        if plan.remote.block_size == plan.local.block_size:
            runs, missing = self._staging.landed_runs(unit.key, layer, range(first, first + len(ids)), src_nbytes)
            if runs:
                self._place(layer, [([ids[i] for i in idxs], rows) for idxs, rows in runs], dst_window)
                n = sum(len(idxs) for idxs, _ in runs)
                self.blocks_from_push += n * counted
                self.bytes_landed += n * src_nbytes
            return missing
        positions = remote_positions(plan, first, len(ids), remote.num_tokens)
        runs, lost = self._staging.landed_runs(unit.key, layer, positions, src_nbytes)
        if lost or not runs:
            return list(range(len(ids)))  # re-cut needs every row: read the piece instead
        rows = [r for _, chunk in runs for r in chunk]
        fmt = plan.local_format
        recut = recut_rows(
            rows,
            piece.heads,
            plan.remote.block_size,
            plan.local.block_size,
            first * plan.local.block_size,
            len(ids),
            fmt.runs or (),
            self._host_alloc,
        )
        self._place(layer, [(list(ids), recut)], dst_window)
        self.blocks_from_push += len(ids) * counted
        self.bytes_landed += len(rows) * src_nbytes
        return []

    def _place(self, layer: int, runs: list[Run], window: tuple[int, int] | None) -> None:
        placed = self._access.land_pushed(layer, runs, self.blocks_ready, window)
        # the layer's copies run on one stream in order: the last one covers the earlier ones
        self.layer_events[layer] = placed

    def _layer_landed(self, layer: int, ok: bool, placed: DeviceEvent | None = None) -> None:
        if placed is not None:
            self.layer_events[layer] = placed
        self.layer_ok[layer] = ok
        self.layer_done[layer].set()

    def _release_remote(self, remote: RemotePrefill) -> None:
        # Retried: one lost answer from a busy prefill rank would hold its blocks - and keep its
        # engine stepping - for the whole lease.
        self._release.done_reading(remote, self._groups.shape if self._plan is not None else None)
