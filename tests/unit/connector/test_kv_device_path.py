"""The connector's device data path on an asynchronous stand-in GPU (tests/support/async_device.py).

No GPU runs here, so the device is a stand-in - mocked - whose "kernels" and copies run
later on their streams' threads: a send that does not wait for the layer's write, or an
attention that does not wait for the layer's landing, reads stale bytes and fails byte
for byte. It also fails every operation that would make a real GPU's host wait (a copy
from pageable memory, a device value read on the host, an event waited for on the
forward's thread): the connector's hooks run under it as vLLM calls them, on the
"forward's thread". The KV is built as vLLM 0.32 allocates it for FlashAttention
(tests/support/vllm_kv_cache.py) in its default layout LBNHC - token-major pages, so a block's
bytes in memory order (what moves) are not its logical ``[H, N, C]`` order - and staged
through pinned host rows for the host transports, as on a GPU.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.support import vllm_kv_cache as replay
from tests.support.async_device import AsyncStandInDevice
from tests.support.transport_harness import RecordingSink, make_regions, started
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.host_staging import StagingArena
from vllm_pd.connector.device.kv_access import StagedAccess
from vllm_pd.connector.device.kv_device import COMPLETED, HostDevice
from vllm_pd.connector.device.kv_layout import KVLayout
from vllm_pd.connector.step_specs import LoadSpec, SendSpec, WorkerStep
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.worker.kv_loader import KVLoader
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.connector.worker.release import DecodeRelease
from vllm_pd.connector.worker.transfer_counters import TransferCounters
from vllm_pd.connector.worker.worker import PDConnectorWorker
from vllm_pd.protocol.transfer_params import RemotePrefill

LAYERS, NUM_BLOCKS, BS, HEADS, HEAD = 3, 8, 16, 2, 32
BLOCK_NBYTES = 2 * BS * HEADS * HEAD * 2  # bf16 K and V of one block
LAYOUT = KVLayout.LBNHC


def vllm_cache(dev: AsyncStandInDevice | None = None) -> dict[str, torch.Tensor]:
    """vLLM 0.32's per-layer ``[B, H, N, C]`` views (C: K and V side by side) in LAYOUT, in
    ``dev``'s device memory if given."""
    m = replay.KVModel("small", LAYERS, HEADS, HEAD, HEAD, torch.bfloat16, BS)
    cache = replay.allocate(m, replay.BACKENDS["FLASH_ATTN"], LAYOUT, NUM_BLOCKS)
    kv = {f"l{i}": t for i, t in enumerate(cache.views.values())}
    return {name: dev.adopt(t) for name, t in kv.items()} if dev is not None else kv


def standin(compute_delay_s: float = 0.02, copy_delay_s: float = 0.005) -> AsyncStandInDevice:
    """The stand-in GPU with its host-sync checks on."""
    return AsyncStandInDevice(compute_delay_s, copy_delay_s, checked=True)


def block_bytes(values: torch.Tensor, j: int) -> torch.Tensor:
    """Wire bytes of the j-th block of ``values`` [n, HEADS, BS, 2 * HEAD]: its bytes in LBNHC's
    memory order (token-major)."""
    return values[j].transpose(0, 1).contiguous().view(torch.uint8).flatten()


def random_kv(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, HEADS, BS, 2 * HEAD, generator=g).to(torch.bfloat16)


def write_layer(kv: torch.Tensor, block_ids: list[int], values: torch.Tensor):
    """The forward's KV write of one layer, as a kernel on the compute stream."""

    def kernel() -> None:
        kv[block_ids] = values

    return kernel


def test_stand_in_catches_a_copy_that_does_not_wait_for_the_write() -> None:
    """The negative control: without the event, the copy reads the blocks before the write."""
    dev = standin(compute_delay_s=0.05, copy_delay_s=0.0)
    kv = vllm_cache(dev)["l0"]
    copies = BlockCopies([MemoryRegion("l0", kv)], dev)
    values = random_kv(2, seed=1)
    rows_early = dev.host_empty(2 * BLOCK_NBYTES).view(2, BLOCK_NBYTES)
    rows_ordered = dev.host_empty(2 * BLOCK_NBYTES).view(2, BLOCK_NBYTES)
    dev.kernel(dev.compute, write_layer(kv, [3, 5], values))
    copies.to_rows(0, [([3, 5], rows_early)], after=COMPLETED).synchronize()
    copies.to_rows(0, [([3, 5], rows_ordered)], after=copies.record_compute()).synchronize()
    dev.finish()
    assert not torch.equal(rows_early[0], block_bytes(values, 0))
    assert torch.equal(rows_ordered[0], block_bytes(values, 0)) and torch.equal(rows_ordered[1], block_bytes(values, 1))


def _prefill_worker(transport: str, dev: AsyncStandInDevice) -> tuple[PDConnectorWorker, dict[str, torch.Tensor]]:
    config = PDConnectorConfig.from_extra_config(
        {"transport": transport, "host": "127.0.0.1", "host_staging_bytes": 64 * BLOCK_NBYTES * LAYERS}
    )
    worker = PDConnectorWorker(config, block_size=BS, tp_rank=0, base_port=0, is_producer=True, is_consumer=False)
    kv = vllm_cache(dev)
    worker.register_kv_caches(kv, NUM_BLOCKS, device=dev, kv_layout=LAYOUT.name)
    assert isinstance(worker.access, StagedAccess)
    return worker, kv


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_prefill_pushes_each_layer_only_after_its_write_and_holds_it_for_reads(transport: str) -> None:
    dev = standin()
    prefill, kv = _prefill_worker(transport, dev)
    decode_regions = make_regions(LAYERS, NUM_BLOCKS, seed=None, block_shape=(2, BS, HEADS * HEAD))
    decode, sink, decode_endpoint = started(transport, decode_regions)
    reader_regions = make_regions(LAYERS, NUM_BLOCKS, seed=None, block_shape=(2, BS, HEADS * HEAD))
    reader, _, _ = started(transport, reader_regions)
    block_ids = [5, 2, 7]
    spec = SendSpec(
        transfer_id="t1",
        block_ids=tuple(block_ids),
        first_token=0,
        end_token=3 * BS,
        num_prompt_tokens=3 * BS,
        push_endpoint=decode_endpoint,
    )
    try:
        written = [random_kv(3, seed=10 + i) for i in range(LAYERS)]
        with dev.forward():
            prefill.begin_step(WorkerStep(sends=[spec]))
            for i in range(LAYERS):
                dev.kernel(dev.compute, write_layer(kv[f"l{i}"], block_ids, written[i]))
                prefill.save_kv_layer(f"l{i}")
            prefill.wait_for_save()
        landed = sink.wait_landed(LAYERS, timeout=20)
        assert all(ok for _, ok in landed)
        for i in range(LAYERS):  # RecordingSink lands position p at its block p
            for p in range(3):
                got = decode_regions[i].tensor[p].view(torch.uint8).flatten()
                assert torch.equal(got, block_bytes(written[i], p)), f"layer {i} block {p}"
        assert prefill.sender.sends.drain(20)  # the grant follows the copy of every layer
        for i in range(LAYERS):
            reader.fetch(prefill.endpoint, "t1", i, block_ids, [4, 0, 6], timeout=10).result(timeout=15)
            for p, local in enumerate([4, 0, 6]):
                assert torch.equal(
                    reader_regions[i].tensor[local].view(torch.uint8).flatten(), block_bytes(written[i], p)
                )
    finally:
        prefill.shutdown()
        decode.close()
        reader.close()
        dev.finish()


class _AnnouncedSink(RecordingSink):
    def __init__(self, regions: list[MemoryRegion]) -> None:
        super().__init__(regions)
        self.announced = threading.Event()

    def on_notify(self, peer: str, message: bytes) -> bytes:
        self.announced.set()
        return b"ok"


def test_prefill_announces_pulled_kv_only_once_it_is_staged_for_reads() -> None:
    dev = standin(compute_delay_s=0.03)
    prefill, kv = _prefill_worker("tcp", dev)
    reader_regions = make_regions(LAYERS, NUM_BLOCKS, seed=None, block_shape=(2, BS, HEADS * HEAD))
    reader = create_transport("tcp")
    reader.register_regions(reader_regions)
    sink = _AnnouncedSink(reader_regions)
    reader_endpoint = reader.start(sink, "127.0.0.1", 0)
    block_ids = [1, 6]
    spec = SendSpec(
        transfer_id="t2",
        block_ids=tuple(block_ids),
        first_token=0,
        end_token=2 * BS,
        num_prompt_tokens=2 * BS,
        push_endpoint=None,
        announcement={"do_remote_prefill": True},
        announce_endpoint=reader_endpoint,
    )
    try:
        written = [random_kv(2, seed=30 + i) for i in range(LAYERS)]
        with dev.forward():
            prefill.begin_step(WorkerStep(sends=[spec]))
            for i in range(LAYERS):
                dev.kernel(dev.compute, write_layer(kv[f"l{i}"], block_ids, written[i]))
                prefill.save_kv_layer(f"l{i}")
            prefill.wait_for_save()
        assert sink.announced.wait(20)
        for i in range(LAYERS):  # decode reads as soon as it hears: the bytes must be final by then
            reader.fetch(prefill.endpoint, "t2", i, block_ids, [0, 1], timeout=10).result(timeout=15)
            for p in range(2):
                assert torch.equal(reader_regions[i].tensor[p].view(torch.uint8).flatten(), block_bytes(written[i], p))
    finally:
        prefill.shutdown()
        reader.close()
        dev.finish()


def _staged_decode(dev: AsyncStandInDevice) -> tuple[list[MemoryRegion], StagedAccess]:
    regions = [MemoryRegion(name, t) for name, t in vllm_cache(dev).items()]
    arena = StagingArena(dev, [r.block_nbytes for r in regions], 16 * BLOCK_NBYTES * LAYERS)
    return regions, StagedAccess(BlockCopies(regions, dev), arena, BlockCopies(regions, dev))


def _attend_layer_by_layer(
    loader: KVLoader,
    job: LoadJob,
    dev: AsyncStandInDevice,
    regions: list[MemoryRegion],
    block_ids: list[int],
    stream_wait: bool,
) -> list[torch.Tensor]:
    """The decode forward: per layer, wait_for_layer_load, then attention reads the blocks.
    ``stream_wait=False`` is the bug to catch: only the host waits for the layer."""
    seen: list[torch.Tensor] = []
    for i, region in enumerate(regions):
        if stream_wait:
            with dev.forward():
                loader.wait_for_layer(i)
        else:
            assert job.layer_done[i].wait(20)
        out = torch.empty(len(block_ids), HEADS, BS, 2 * HEAD, dtype=torch.bfloat16)
        seen.append(out)
        dev.kernel(dev.compute, lambda out=out, t=region.tensor: out.copy_(t[block_ids]))
    return seen


def _remote(mode: str, endpoint: str, block_ids: list[int]) -> RemotePrefill:
    host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
    return RemotePrefill(
        transfer_id="p-1",
        engine_id="e",
        endpoint=endpoint,
        host=host,
        port=int(port),
        block_ids=tuple(block_ids),
        num_tokens=len(block_ids) * BS,
        block_size=BS,
        mode=mode,
    )


@pytest.mark.parametrize("wait", [True, False], ids=["stream-waits", "host-waits-only"])
def test_decode_attention_reads_pushed_kv_only_after_its_layer_landed(wait: bool) -> None:
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.03)
    regions, access = _staged_decode(dev)
    transport = create_transport("tcp")
    config = PDConnectorConfig.from_extra_config({"transfer_timeout_s": 5, "push_wait_s": 1})
    loader = KVLoader(
        config,
        transport,
        access,
        dev,
        regions,
        rank=0,
        tp_size=1,
        stats=TransferCounters(),
        release=DecodeRelease(transport, 0, 1),
        changed=threading.Event(),
    )
    pushed = [random_kv(2, seed=20 + i) for i in range(LAYERS)]
    for i in range(LAYERS):  # prefill's pushes, landed in decode's push staging
        batch = BlockBatch("p-1", i, (0, 1), BLOCK_NBYTES, last=True)
        for p, view in enumerate(loader.staging.destinations(batch) or []):
            view[:] = block_bytes(pushed[i], p).numpy().tobytes()
        loader.staging.landed(batch, True)
    spec = LoadSpec(
        request_id="d-1",
        transfer_id="p-1",
        remote=_remote("push", "tcp://127.0.0.1:1", [9, 9]),
        first_position=0,
        local_block_ids=(6, 1),
        layerwise=True,
    )
    with dev.forward():
        loader.begin_step(WorkerStep(loads=[spec]))
    # vLLM zeroes the step's new blocks on the compute stream just before start_load_kv; the
    # stand-in runs it late, so a landing that does not wait for it would be zeroed over
    dev.kernel(dev.compute, lambda: [r.tensor.index_fill_(0, torch.tensor([6, 1]), 0) for r in regions] and None)
    with dev.forward():
        loader.start_loads()
    job = loader.job("d-1")
    assert job is not None
    seen = _attend_layer_by_layer(loader, job, dev, regions, [6, 1], stream_wait=wait)
    with dev.forward():
        assert loader.block_ids_with_load_errors() == set()
    dev.finish()
    loader.close()
    transport.close()
    exact = all(
        torch.equal(block_bytes(seen[i], p), block_bytes(pushed[i], p)) for i in range(LAYERS) for p in range(2)
    )
    assert job.ok and job.blocks_from_push == 2 * LAYERS
    assert exact is wait  # forgetting the wait must show as wrong bytes


def test_decode_pull_lands_through_staging_rows_into_device_blocks() -> None:
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.01)
    regions, access = _staged_decode(dev)
    prefill_regions = make_regions(LAYERS, NUM_BLOCKS, seed=3, block_shape=(2, BS, HEADS * HEAD))
    prefill, _, prefill_endpoint = started("tcp", prefill_regions)
    prefill.allow_fetch("p-1", [4, 2])
    decode = create_transport("tcp")
    decode.register_regions(access.transport_regions)
    decode.start(_NoSink(), "127.0.0.1", 0)
    spec = LoadSpec(
        request_id="d-1",
        transfer_id="p-1",
        remote=_remote("pull", prefill_endpoint, [4, 2]),
        first_position=0,
        local_block_ids=(7, 3),
        layerwise=False,
    )
    job = LoadJob(spec, decode, regions, PushStaging(1 << 20, ttl_s=60), access, rank=0, timeout_s=5, push_wait_s=1)
    started_at = time.monotonic()
    job.run()
    try:
        assert job.ok, job.error
        assert job.blocks_fetched == 2 * LAYERS and time.monotonic() - started_at < 10
        # an async load is reported done only with the bytes in the device blocks: read them at once
        for i in range(LAYERS):
            for remote, local in ((4, 7), (2, 3)):
                got = block_bytes(regions[i].tensor, local)
                assert torch.equal(got, prefill_regions[i].tensor[remote].view(torch.uint8).flatten())
        assert access.arena.free_rows == access.arena.rows  # the landing rows came back
    finally:
        prefill.close()
        decode.close()
        dev.finish()


class _NoSink:
    def destinations(self, batch: BlockBatch) -> None:
        return None

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        return None

    def on_notify(self, peer: str, message: bytes) -> bytes:
        return b"ok"


def test_staging_arena_takes_runs_first_fit_and_merges_them_back() -> None:
    arena = StagingArena(AsyncStandInDevice(), [8, 8], capacity_bytes=16 * 10)
    assert arena.rows == 10
    a, b, c = arena.take(4), arena.take(4), arena.take(2)
    assert (a, b, c) == (0, 4, 8) and arena.take(1) is None
    arena.give_back(4, 4)
    assert arena.take(5) is None
    arena.give_back(0, 4)
    assert arena.take(8) == 0 and arena.free_rows == 0


@pytest.mark.parametrize(
    "shape, dtype, block_dim",
    [
        ((2, 8, 4, 4), torch.bfloat16, 1),  # K and V apart, 8-byte rows: copied as int64
        ((2, 8, 4, 3), torch.bfloat16, 1),  # 6-byte rows: int16
        ((8, 3, 2), torch.bfloat16, 0),  # 12-byte blocks: int32
        ((8, 5), torch.uint8, 0),  # 5-byte blocks: bytes
    ],
)
@pytest.mark.parametrize("device", ["cpu", "standin"])
def test_block_copies_move_exact_bytes_whatever_element_width_the_layout_allows(
    shape: tuple[int, ...], dtype: torch.dtype, block_dim: int, device: str
) -> None:
    """Blocks are gathered and scattered as the widest integer elements their layout allows;
    runs of rows at any row offset land byte for byte."""
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.0) if device == "standin" else HostDevice()
    g = torch.Generator().manual_seed(7)
    if dtype == torch.uint8:
        src = torch.randint(0, 1 << 8, shape, generator=g, dtype=torch.uint8)
    else:
        src = torch.randn(shape, generator=g).to(dtype)
    dst = torch.zeros_like(src)
    if isinstance(dev, AsyncStandInDevice):
        dev.adopt(src)
        dev.adopt(dst)
    out = BlockCopies([MemoryRegion("s", src, block_dim)], dev)
    back = BlockCopies([MemoryRegion("d", dst, block_dim)], dev)
    nbytes = out.regions[0].block_nbytes
    rows = dev.host_empty(5 * nbytes).view(5, nbytes)
    out.to_rows(0, [([6, 1], rows[1:3]), ([3], rows[4:5])]).synchronize()
    back.from_rows(0, [([6, 1], rows[1:3]), ([3], rows[4:5])]).synchronize()
    if isinstance(dev, AsyncStandInDevice):
        dev.finish()
    for b in (6, 1, 3):
        assert torch.equal(dst.select(block_dim, b), src.select(block_dim, b))
    assert not dst.select(block_dim, 0).view(torch.uint8).any()
