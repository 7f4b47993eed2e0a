"""Worker side of the PD connector (runs in each vLLM worker process): a thin facade.

It owns what both sides share - the transport, the KV cache as regions on its
device, and how the transport reaches them (:mod:`kv_access`) - and routes the
rest: prefill's sends to :class:`~vllm_pd.connector.worker.kv_sender.KVSender`, decode's
loads to :class:`~vllm_pd.connector.worker.kv_loader.KVLoader`. The transport's
``BlockSink`` calls land here and go to the side they belong to. vLLM-free.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Sequence

import msgspec
import torch

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.deployment_secret import INSECURE_WARNING, SECRET_ENV, is_loopback
from vllm_pd.connector.device.amx_tiles import request_amx_tiles
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.host_staging import StagingArena
from vllm_pd.connector.device.kv_access import DirectAccess, KVAccess, StagedAccess
from vllm_pd.connector.device.kv_device import KVDevice, kv_device_for
from vllm_pd.connector.device.kv_geometry import kernel_format
from vllm_pd.connector.device.kv_layout import KVLayout, block_format, manager_blocks, memory_order_mismatch
from vllm_pd.connector.step_specs import WorkerStep
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.worker.kv_loader import KVLoader
from vllm_pd.connector.worker.kv_sender import KVSender
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.connector.worker.release import DecodeRelease
from vllm_pd.connector.worker.transfer_counters import TransferCounters
from vllm_pd.protocol.control import PingMessage, ReleaseMessage, decode_control
from vllm_pd.protocol.kv_shape import KVGroup, KVShape, ShapeQuery, encode_shape
from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)

# An idle engine keeps stepping while transfers are pending; waiting this long for
# a transfer event in such an empty step keeps the idle CPU near zero.
IDLE_WAIT_S = 0.005


def advertised_host(config: PDConnectorConfig) -> str:
    if config.host != "auto":
        return config.host
    if is_loopback(config.bind_host):  # nothing but this host can reach it (no deployment secret)
        return "127.0.0.1" if config.bind_host == "localhost" else config.bind_host
    env = os.environ.get("VLLM_HOST_IP")
    if env:
        return env
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))  # no packet is sent: this only picks the route
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


class PDConnectorWorker:
    def __init__(
        self,
        config: PDConnectorConfig,
        block_size: int,
        tp_rank: int,
        base_port: int,
        is_producer: bool,
        is_consumer: bool,
        tp_size: int = 1,
        stats: TransferCounters | None = None,
        kv_heads: int = 0,
        groups: tuple[KVGroup, ...] = (),
        layer_groups: dict[str, int] | None = None,
        kernel: str = "",
    ) -> None:
        """``kv_heads`` (the model's KV heads; 1 for MLA), ``groups`` (vLLM's KV cache groups, their
        block formats filled in at registration) and ``layer_groups`` (each layer's group, by name)
        make this worker's :class:`KVShape`, which lets it take KV from a prefill of another TP or
        block size and move a hybrid model's groups; without them (0): one group, equal shapes only.
        ``kernel``: how the attention kernel packs a head's tokens in a block
        (``kv_geometry.kernel_format``; "": as the tensor's dims say)."""
        self.config = config
        self._kv_heads = kv_heads
        self._group_specs = groups
        self._layer_group_names = layer_groups or {}
        self._kernel = kernel
        self.block_size = block_size
        self.tp_rank = tp_rank
        self.tp_size = tp_size
        self.base_port = base_port
        self.is_producer = is_producer
        self.is_consumer = is_consumer
        # the transport's default checksum (crc32c, fused with the copies) unless turned off; with a
        # deployment secret every connection authenticates, and blocks get the session's keyed check
        self.transport = create_transport(
            config.transport,
            secret=config.secret,
            **({"tls": config.tls} if config.tls is not None else {}),
            **({} if config.checksum else {"checksum": "none"}),
        )
        self.stats = stats if stats is not None else TransferCounters()
        self.regions: list[MemoryRegion] = []
        self.kv_format = ""  # what a block's bytes mean (kv_layout.block_format), once registered
        self.shape: KVShape | None = None  # this rank's KV shape, once registered (None: not known)
        self._layer_index: dict[str, int] = {}
        self._idle = False
        # set by either side (sender: a push done, a release; loader: a load done) when a transfer
        # may have become reportable: wakes an idle step's wait in get_finished
        self._changed = threading.Event()
        self._unregistered = False  # vLLM's sleep mode freed the KV's pages (unregister_kv_caches)
        self.endpoint = ""
        self.host = ""
        self.port = 0

    # ---- set-up ---------------------------------------------------------------------------------
    def register_kv_caches(
        self,
        kv_caches: dict[str, torch.Tensor],
        num_blocks: int | None = None,
        device: KVDevice | None = None,
        kv_layout: str | None = None,
    ) -> None:
        """``kv_caches``: vLLM's per-layer views (0.32: ``[num_blocks * ratio, H, N, C]`` in any
        layout, see :mod:`kv_layout`); ``num_blocks``: the blocks the scheduler hands out
        (default: dim 0's size); ``device``: where the tensors live (default: read from them);
        ``kv_layout``: the layout vLLM resolved, checked against the strides (which rule)."""
        n = num_blocks or (int(next(iter(kv_caches.values())).shape[0]) if kv_caches else 0)
        self.regions = [MemoryRegion(name, manager_blocks(t, n)) for name, t in kv_caches.items()]
        self.kv_format = "|".join(dict.fromkeys(block_format(r.tensor) for r in self.regions))
        self._check_layout(kv_caches, kv_layout)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        self.shape = self._shape(list(kv_caches))
        groups = LayerGroups(self.shape, len(self.regions), self.block_size)
        self.device = device or kv_device_for([r.tensor for r in self.regions])
        if self.regions and self.regions[0].tensor.device.type == "cpu":
            request_amx_tiles()  # before this worker's first forward, which may be a step of loaded KV
        self.access = self._access()
        self.sender = KVSender(
            self.config,
            self.transport,
            self.access,
            len(self.regions),
            self.block_size,
            self.tp_rank,
            self.stats,
            self._changed,
            groups,
        )
        self.loader = KVLoader(
            self.config,
            self.transport,
            self.access,
            self.device,
            self.regions,
            self.tp_rank,
            self.tp_size,
            self.stats,
            DecodeRelease(self.transport, self.tp_rank, self.tp_size),
            self._changed,
            groups,
        )
        self.transport.register_regions(self.access.transport_regions)
        port = self.base_port + self.tp_rank if self.base_port else 0
        if self.config.insecure:
            logger.warning(INSECURE_WARNING, "the KV endpoint", self.config.bind_host, "insecure_network", SECRET_ENV)
        self.endpoint = self.transport.start(self, self.config.bind_host, port)
        self.host = advertised_host(self.config)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        # peers reach us by the advertised host, not the bind address
        self.endpoint = f"{self.endpoint.split('://', 1)[0]}://{self.host}:{self.port}"
        r0 = self.regions[0]
        logger.info(
            "PD connector worker %d: %d layers of %d blocks x %d bytes (%s, %s, %d span(s) a block) on "
            "%s (%s), KV endpoint %s, %s",
            self.tp_rank,
            len(self.regions),
            r0.num_blocks,
            r0.block_nbytes,
            kv_layout or "layout not given",
            self.kv_format,
            len(r0.block_spans(0)),
            r0.tensor.device,
            type(self.access).__name__,
            self.endpoint,
            f"TP {self.tp_size} of {self.shape.kv_heads} KV heads, groups "
            + ", ".join(f"{g.kind}/{g.block_size}" for g in self.shape.groups)
            if self.shape is not None
            else "shape not known (equal shapes only)",
        )

    def _shape(self, names: list[str]) -> KVShape | None:
        """This rank's KV shape: the groups vLLM told us of, each with its layers' block format."""
        if not self._kv_heads or not self._group_specs:
            return None
        try:
            layer_groups = tuple(self._layer_group_names[name] for name in names)
        except KeyError as e:
            logger.warning("PD connector: layer %s is in no KV cache group; KV moves between equal shapes only", e)
            return None
        groups = []
        for g, spec in enumerate(self._group_specs):
            formats = {
                self.regions[i].name: self._group_format(self.regions[i].tensor)
                for i, lg in enumerate(layer_groups)
                if lg == g
            }
            if len(set(formats.values())) != 1:
                logger.warning(
                    "PD connector: KV cache group %d's layers have blocks %s; KV moves between equal shapes only",
                    g,
                    sorted(set(formats.values())) or "(none)",
                )
                return None
            groups.append(msgspec.structs.replace(spec, block_format=next(iter(formats.values()))))
        return KVShape(self.tp_size, self._kv_heads, tuple(groups), layer_groups)

    def _group_format(self, blocks: torch.Tensor) -> str:
        """A layer's block format as kv_geometry cuts it: packed as the attention kernel packs it."""
        return kernel_format(block_format(blocks), self._kernel)

    def _check_layout(self, kv_caches: dict[str, torch.Tensor], kv_layout: str | None) -> None:
        """Warn where the strides are not those of the layout vLLM says it resolved: the
        strides still say where each byte is (and what ``kv_format`` reports to peers)."""
        if kv_layout is None or not kv_caches:
            return
        name, t = next(iter(kv_caches.items()))
        try:
            why = memory_order_mismatch(t, KVLayout.named(kv_layout))
        except ValueError as e:
            why = str(e)
        if why is not None:
            logger.warning(
                "PD connector: KV cache layer %s is not in vLLM's %s layout: %s; moving its blocks by their strides",
                name,
                kv_layout,
                why,
            )

    def unregister_kv_caches(self) -> None:
        """vLLM's sleep mode is about to free the KV cache's pages (their contents are lost; the
        addresses come back, with new pages, at :meth:`restore_kv_caches`): the transport lets go of
        them and pushes into them are refused meanwhile. Host staging is our own pinned memory,
        which sleep leaves alone. Idempotent."""
        if not self.regions or self._unregistered:
            return
        self._unregistered = True
        self.transport.unregister_regions()
        logger.info("PD connector worker %d: KV cache unregistered (sleep)", self.tp_rank)

    def restore_kv_caches(self) -> None:
        """The KV cache is mapped again, at the same addresses: register it again. Idempotent."""
        if not self._unregistered:
            return
        self.transport.restore_regions()
        self._unregistered = False
        logger.info("PD connector worker %d: KV cache registered again (wake-up)", self.tp_rank)

    def _access(self) -> KVAccess:
        """Direct where the transport can read the KV itself, else through pinned host staging;
        sends and landings copy on a stream each."""
        sends, landings = BlockCopies(self.regions, self.device), BlockCopies(self.regions, self.device)
        if self.transport.device_memory or (
            self.device.host_accessible and all(r.block_contiguous for r in self.regions)
        ):
            return DirectAccess(sends, landings)
        arena = StagingArena(self.device, [r.block_nbytes for r in self.regions], self.config.host_staging_bytes)
        return StagedAccess(sends, arena, landings)

    @property
    def staging(self) -> PushStaging:
        return self.loader.staging

    # ---- BlockSink (transport threads) ----------------------------------------------------------
    def destinations(self, batch: BlockBatch) -> Sequence[memoryview] | None:
        if not self.is_consumer or self._unregistered or not 0 <= batch.layer < len(self.regions):
            return None
        ours = self.regions[batch.layer].block_nbytes
        if batch.block_nbytes <= 0 or (self.shape is None and batch.block_nbytes != ours):
            # of another shape, a push carries parts of blocks or blocks of another size: its load checks them
            logger.warning(
                "push of transfer %s has %d-byte blocks, ours are %d: rejected",
                batch.transfer_id,
                batch.block_nbytes,
                ours,
            )
            return None
        return self.loader.staging.destinations(batch)

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        self.loader.staging.landed(batch, ok)

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        try:
            msg = decode_control(message)
        except msgspec.MsgspecError:
            logger.warning("unknown control message from %s ignored", peer)
            return b"unknown"
        if isinstance(msg, ReleaseMessage):
            self.sender.release(msg.transfer_id, msg.releaser, msg.of)
        elif isinstance(msg, PingMessage):
            pass  # the answer itself is what was asked for
        elif isinstance(msg, ShapeQuery):
            return encode_shape(self.shape) if self.shape is not None else b""
        elif self.is_consumer:
            self.loader.announce(msg.transfer_id, msg.params)
        return b"ok"

    # ---- each step ------------------------------------------------------------------------------
    def begin_step(self, meta: WorkerStep) -> None:
        """Bookkeeping of a step's metadata, before its forward writes any block."""
        self._idle = meta.idle
        if self.is_producer:
            self.sender.begin_step(meta)
        else:
            self.sender.begin_step(
                WorkerStep(finished_sends=meta.finished_sends, preempted_transfers=meta.preempted_transfers)
            )
        self.loader.begin_step(meta)

    def start_loads(self) -> None:
        self.loader.start_loads()

    def wait_for_layer_load(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is not None:
            self.loader.wait_for_layer(i)

    def save_kv_layer(self, layer_name: str) -> None:
        i = self._layer_index.get(layer_name)
        if i is not None:
            self.sender.save_kv_layer(i)

    def wait_for_save(self) -> None:
        self.sender.wait_for_save()

    def get_finished(self) -> tuple[set[str], set[str], set[str]]:
        """(finished sending, finished receiving, failed receiving)."""
        sent, recvd, failed = self._collect()
        if self._idle and not (sent or recvd) and (self.sender.pending() or self.loader.busy):
            self._changed.wait(IDLE_WAIT_S)
            sent, recvd, failed = self._collect()
        self.stats.set_gauges(
            held=self.sender.outgoing.held(), loading=self.loader.loading, staged_bytes=self.loader.staging.used_bytes
        )
        self.stats.record_connections(self.transport.refused_connections, self.transport.broken_connections)
        return sent, recvd, failed

    def _collect(self) -> tuple[set[str], set[str], set[str]]:
        self._changed.clear()  # before looking: what happens after wakes the next wait
        recvd, failed = self.loader.collect()
        return self.sender.collect(), recvd, failed

    def take_announced(self) -> frozenset[str]:
        return self.loader.take_announced()

    def block_ids_with_load_errors(self) -> set[int]:
        return self.loader.block_ids_with_load_errors()

    def shutdown(self) -> None:
        if self.regions:
            self.sender.close()
            self.loader.close()
        self.transport.close()
