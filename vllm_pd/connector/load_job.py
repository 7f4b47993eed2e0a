"""Decode side: land one request's remote KV in its blocks, layer by layer.

Push mode: the bytes are (or are arriving) in :class:`PushStaging`; copy them.
Whatever did not arrive in time is fetched (pulled) from prefill, which holds
its blocks until we release them. Pull mode: fetch every layer. A decode leg
sent beside its prefill leg (no ``RemotePrefill`` yet) first waits for
prefill's announcement and checks it is for this very prompt.

The job always ends ``ok`` or failed - never pending forever - and always tells
prefill to release its copy, so neither side leaks blocks.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future


from vllm_pd.connector.config import PROBE_PAUSED_PUSHES_S
from vllm_pd.connector.control import PingMessage
from vllm_pd.connector.release import release_rank_share
from vllm_pd.connector.kv_access import KVAccess
from vllm_pd.connector.kv_device import COMPLETED, DeviceEvent
from vllm_pd.connector.step_specs import LoadSpec
from vllm_pd.connector.push_staging import PushStaging
from vllm_pd.connector.transfer_params import RemotePrefill
from vllm_pd.connector.transport.base import MemoryRegion, Transport
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


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
    ) -> None:
        self.spec = spec
        self.remote: RemotePrefill | None = spec.remote
        self._transport = transport
        self._regions = regions
        self._staging = staging
        self._access = access
        self._rank = rank
        self._tp_size = tp_size
        self._timeout_s = timeout_s
        self._push_wait_s = push_wait_s
        self._probe_s = probe_s
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

    def _peer(self, remote: RemotePrefill) -> str:
        return remote.endpoint_for_rank(self._rank)

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # noqa: BLE001 - any failure means: recompute
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
                self._staging.drop(self.spec.transfer_id)
            if self.remote is not None:
                self._release_remote(self.remote)

    def _run(self) -> None:
        spec = self.spec
        deadline = self.started + self._timeout_s  # a job parked for prefill's announcement counts too
        remote = self.remote or self._await_announcement(deadline)
        if remote is None:
            return
        missing: dict[int, list[int]] = {}  # layer -> indexes into spec.positions
        if remote.mode == "push":
            # layer by layer: announced as prefill's forward starts, the pushes land while we copy
            since = time.monotonic()
            for layer, region in enumerate(self._regions):
                if not self._wait_pushes(remote, layer, deadline, since):
                    return
                miss = self._copy_staged(spec.transfer_id, layer, region)
                if miss:
                    missing[layer] = miss
                else:
                    self._layer_landed(layer, True)
            if missing:
                logger.info("request %s: %d layer(s) incomplete after push; fetching them from prefill",
                            spec.request_id, len(missing))
                if time.monotonic() - self._peer_seen_at > PROBE_PAUSED_PUSHES_S and not self._peer_answers(remote):
                    return
        else:
            missing = {layer: list(range(len(spec.positions))) for layer in range(len(self._regions))}
        futures: list[tuple[int, list[int], Future[None]]] = []
        remote_ids = spec.remote_block_ids(remote)
        landing = self._access.landing_ids(spec.request_id, spec.local_block_ids) if missing else []
        if landing is None:
            self.error = "no host staging room to land the KV read from prefill"
            return
        if missing:
            self.blocks_ready.synchronize()  # a transport writing our blocks itself must come after the zeroing
        for layer, idxs in missing.items():
            fut = self._transport.fetch(self._peer(remote), remote.transfer_id, layer,
                                        [remote_ids[i] for i in idxs], [landing[i] for i in idxs],
                                        timeout=max(0.1, deadline - time.monotonic()))
            futures.append((layer, idxs, fut))
        for layer, idxs, fut in futures:
            try:
                fut.result(timeout=max(0.1, deadline - time.monotonic() + 1.0))
            except Exception as e:  # noqa: BLE001 - run() turns any failure into "recompute"
                self.error = self.error or f"fetch of layer {layer} failed: {type(e).__name__}: {e}"
                self._layer_landed(layer, False)
                continue
            self.blocks_fetched += len(idxs)
            self.bytes_landed += len(idxs) * self._regions[layer].block_nbytes
            self._layer_landed(layer, True, self._access.land_read(
                spec.request_id, layer, [spec.local_block_ids[i] for i in idxs], self.blocks_ready))

    def _wait_pushes(self, remote: RemotePrefill, layer: int, deadline: float, since: float) -> bool:
        """Wait for ``layer``'s pushes while they keep landing. Once they pause for a second, prefill is
        probed: gone (cut off, paused) - False, the error set, at once rather than after push_wait_s;
        there - waited for on, until push_wait_s passed without a push (the rest is then fetched)."""
        quiet = min(PROBE_PAUSED_PUSHES_S, self._push_wait_s)
        transfer_id = self.spec.transfer_id
        while not self._staging.wait_layer(transfer_id, layer, deadline, stall_s=quiet, since=since):
            if time.monotonic() >= deadline or not self._peer_answers(remote):
                return self.error is None
            since = time.monotonic()
            if since - self._staging.last_push(transfer_id) >= self._push_wait_s:
                return True
        return True

    def _peer_answers(self, remote: RemotePrefill) -> bool:
        """Whether prefill answers a probe within probe_s (else the error is set). Pushes that
        stall may mean prefill is cut off: fetching from it would hold this load - and a
        layer-wise load's forward - until the transfer's deadline, for bytes that won't come."""
        peer = self._peer(remote)
        try:
            self._transport.notify(peer, PingMessage().encode(), timeout=self._probe_s).result(
                timeout=self._probe_s + 1.0)
            self._peer_seen_at = time.monotonic()
            return True
        except Exception as e:  # noqa: BLE001 - no answer, whatever the reason: recompute
            self.error = (f"prefill {peer} did not answer within {self._probe_s:.1f}s after its pushes "
                          f"stalled ({type(e).__name__}: {e})")
            return False

    def _await_announcement(self, deadline: float) -> RemotePrefill | None:
        """The decode leg came first: wait for prefill to say what it pushed (None: error set)."""
        spec = self.spec
        params = self._staging.wait_announced(spec.transfer_id, time.monotonic() if self.cancelled else deadline)
        if params is None:
            self.error = ("request aborted before prefill announced transfer " + spec.transfer_id if self.cancelled
                          else f"prefill never announced transfer {spec.transfer_id} within {self._timeout_s:.0f}s")
            return None
        remote = RemotePrefill.from_params(params)
        if remote is None:
            self.error = f"prefill announced transfer {spec.transfer_id} with unusable params"
            return None
        self.remote = remote  # from here on it is released whatever happens
        problem = spec.prompt.mismatch(remote) if spec.prompt is not None else "no local prompt to check"
        if problem is None and remote.transfer_id != spec.transfer_id:
            problem = f"prefill's answer names transfer {remote.transfer_id}"
        if problem is None and len(remote.block_ids) < spec.first_position + len(spec.local_block_ids):
            problem = f"prefill computed {remote.num_tokens} tokens, fewer than this prompt's"
        if problem is not None:
            self.error = f"announced KV of transfer {spec.transfer_id} is not for this request: {problem}"
            return None
        return remote

    def _copy_staged(self, transfer_id: str, layer: int, region: MemoryRegion) -> list[int]:
        """Place what was pushed of ``layer`` in our blocks (one scatter); the indexes into
        ``spec.positions`` that did not land."""
        runs, missing = self._staging.landed_runs(transfer_id, layer, self.spec.positions, region.block_nbytes)
        if runs:
            ids = self.spec.local_block_ids
            self.layer_events[layer] = self._access.land_pushed(
                layer, [([ids[i] for i in idxs], rows) for idxs, rows in runs], self.blocks_ready)
            n = sum(len(idxs) for idxs, _ in runs)
            self.blocks_from_push += n
            self.bytes_landed += n * region.block_nbytes
        return missing

    def _layer_landed(self, layer: int, ok: bool, placed: DeviceEvent | None = None) -> None:
        if placed is not None:
            self.layer_events[layer] = placed
        self.layer_ok[layer] = ok
        self.layer_done[layer].set()

    def _release_remote(self, remote: RemotePrefill) -> None:
        # With equal TP sizes our rank's share is the prefill rank we loaded from, released after the
        # load; with other sizes nothing was loaded (refused) and the shares together cover every
        # prefill rank. Retried: one lost answer from a busy prefill rank would hold its blocks - and
        # keep its engine stepping - for the whole lease.
        release_rank_share(self._transport, remote, self._rank, self._tp_size)
