"""No host synchronisation on the forward's thread, anywhere on the KV path - mocked GPU.

No GPU runs here: the device is the checked stand-in of tests/support/async_device.py, which
fails every operation that would make a real GPU's host wait (a copy from pageable
memory, an index built with ``torch.tensor(list)``, a device value read on the host, an
event waited for on the forward's thread). First each rule of the detector on its own
(each a negative control: the detector must fail it), then the connector's paths under
it - prefill's per-layer sends and held copies, decode's landings, the store's copies -
with today's ``torch.tensor(list, device=...)`` put back to show the detector catches it.
Waits through another thread are not seen by the detector: the forward's ``get_finished``
and ``get_block_ids_with_load_errors`` are checked to return while the device is stalled.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from tests.support.async_device import AsyncStandInDevice, HostSyncError
from tests.support.transport_harness import make_regions, started
from tests.unit.connector.test_kv_device_path import (
    BLOCK_NBYTES,
    BS,
    LAYERS,
    _AnnouncedSink,
    _prefill_worker,
    _remote,
    _staged_decode,
    block_bytes,
    random_kv,
    standin,
    vllm_cache,
    write_layer,
)
from tests.unit.store.test_store_device_path import Node, WatchedStandIn
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device import block_copies
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.step_specs import FinishedSend, LoadSpec, SendSpec, WorkerStep
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.worker.kv_loader import KVLoader
from vllm_pd.connector.worker.release import DecodeRelease
from vllm_pd.connector.worker.transfer_counters import TransferCounters


@pytest.fixture
def dev() -> Iterator[AsyncStandInDevice]:
    device = standin(compute_delay_s=0.0, copy_delay_s=0.0)
    yield device
    device.violations.clear()  # the rules' tests raise them on purpose
    device.finish()


def _kv(dev: AsyncStandInDevice) -> torch.Tensor:
    return dev.adopt(torch.zeros(8, 4, dtype=torch.uint8))


# ---- the detector's rules ------------------------------------------------------------------------
def test_reading_a_device_value_on_the_host_fails(dev: AsyncStandInDevice) -> None:
    kv = _kv(dev)
    with dev.forward():
        for read in (
            lambda: kv[0, 0].item(),
            lambda: kv.tolist(),
            lambda: kv.numpy(),
            lambda: bool(kv[0, 0]),
            lambda: torch.equal(kv, kv),
        ):
            with pytest.raises(HostSyncError):
                read()
    assert kv.tolist()[0] == [0, 0, 0, 0]  # outside the forward's hooks: the test reads as it likes


def test_device_work_with_pageable_host_memory_fails(dev: AsyncStandInDevice) -> None:
    kv, pageable = _kv(dev), torch.zeros(2, 4, dtype=torch.uint8)
    cases: list[Callable[[], object]] = [
        lambda: pageable.copy_(kv[:2], non_blocking=True),  # device to pageable
        lambda: kv[:2].copy_(pageable, non_blocking=True),  # pageable to device
        lambda: kv.index_select(0, torch.tensor([1, 3])),  # today's index: torch.tensor(list) on the host
    ]
    for case in cases:
        with pytest.raises(HostSyncError, match="pageable"):
            dev.launch(dev.compute, case)


def test_copies_with_pinned_memory_must_not_block(dev: AsyncStandInDevice) -> None:
    kv, pinned = _kv(dev), dev.host_empty(8).view(2, 4)
    with pytest.raises(HostSyncError, match="non_blocking"):
        dev.launch(dev.compute, lambda: pinned.copy_(kv[:2]))
    with pytest.raises(HostSyncError, match="pinned"):
        dev.launch(dev.compute, lambda: kv[:2].add_(pinned))  # a kernel cannot read host memory


def test_waiting_for_an_event_on_the_forward_thread_or_in_launched_work_fails(dev: AsyncStandInDevice) -> None:
    with dev.forward(), pytest.raises(HostSyncError, match="forward's thread waited"):
        dev.record(dev.compute).synchronize()
    event = dev.record(dev.compute)
    with pytest.raises(HostSyncError, match="launched work waited"):
        dev.launch(dev.compute, event.synchronize)
    event.synchronize()  # another thread (here: outside the hooks) may wait


def test_the_forward_thread_touches_device_memory_only_through_launched_work(dev: AsyncStandInDevice) -> None:
    kv = _kv(dev)
    with dev.forward():
        view = kv[2:4].view(torch.int32)  # views read nothing: allowed
        with pytest.raises(HostSyncError, match="outside launched work"):
            kv.zero_()
    assert view.shape == (2, 1)


def test_launched_work_runs_later_in_stream_order_and_its_host_code_at_once() -> None:
    """The positive case: an ordered copy through pinned rows passes and moves the right bytes;
    launched host code ran at the launch, the device operations when the stream got there."""
    dev = standin(compute_delay_s=0.05, copy_delay_s=0.0)
    kv = vllm_cache(dev)["l0"]
    copies = BlockCopies([MemoryRegion("l0", kv)], dev)
    values = random_kv(2, seed=3)
    dev.kernel(dev.compute, write_layer(kv, [3, 5], values))
    rows = dev.host_empty(2 * BLOCK_NBYTES).view(2, BLOCK_NBYTES)
    ran_on: list[str] = []
    with dev.forward():
        dev.launch(copies.stream, lambda: ran_on.append(threading.current_thread().name))
        event = copies.to_rows(0, [([3, 5], rows)], after=copies.record_compute())
        assert not event.query()  # the compute stream still writes: the copy waits on its stream
    assert ran_on == [threading.current_thread().name]
    event.synchronize()
    dev.finish()
    assert torch.equal(rows[0], block_bytes(values, 0)) and torch.equal(rows[1], block_bytes(values, 1))


# ---- the connector's paths under the detector ------------------------------------------------------
def _todays_index(self: block_copies._IndexCache, block_ids: Sequence[int]) -> torch.Tensor:
    """What the copies did before: a pageable host index, copied with a stream synchronize on a GPU."""
    return torch.tensor(list(block_ids), dtype=torch.long, device=torch.device("cpu"))


def _push_one_step(
    transport: str, dev: AsyncStandInDevice, save_layers: bool = True
) -> tuple[list[torch.Tensor], list[MemoryRegion], list[int], object]:
    """Prefill pushes a 3-block prompt in one step, its hooks on the forward's thread; returns
    (what it wrote, decode's regions, the block ids, the decode sink)."""
    prefill, kv = _prefill_worker(transport, dev)
    decode_regions = make_regions(LAYERS, 8, seed=None, block_shape=(2, BS, 64))
    decode, sink, decode_endpoint = started(transport, decode_regions)
    block_ids = [5, 2, 7]
    spec = SendSpec(
        transfer_id="t1",
        block_ids=tuple(block_ids),
        first_token=0,
        end_token=3 * BS,
        num_prompt_tokens=3 * BS,
        push_endpoint=decode_endpoint,
    )
    written = [random_kv(3, seed=50 + i) for i in range(LAYERS)]
    try:
        with dev.forward():
            prefill.begin_step(WorkerStep(sends=[spec]))
            for i in range(LAYERS):
                dev.kernel(dev.compute, write_layer(kv[f"l{i}"], block_ids, written[i]))
                if save_layers:
                    prefill.save_kv_layer(f"l{i}")
            prefill.wait_for_save()
        assert all(ok for _, ok in sink.wait_landed(LAYERS, timeout=20))
        assert prefill.sender.sends.drain(20)
        copies = prefill.access.send_copies
        stats = (copies.indexes_built, dict(copies.stream.ops))
    finally:
        prefill.shutdown()
        decode.close()
    return written, decode_regions, block_ids, stats


def test_prefill_sends_each_layer_with_one_gather_and_one_copy_and_one_index_per_step() -> None:
    dev = standin()
    written, decode_regions, _, (indexes, ops) = _push_one_step("tcp", dev)
    dev.finish()
    for i in range(LAYERS):
        for p in range(3):
            assert torch.equal(decode_regions[i].tensor[p].view(torch.uint8).flatten(), block_bytes(written[i], p))
    # per layer one gather and one device-to-host copy; the step's block index once for all layers
    assert indexes == 1
    assert ops == {"aten.index_select.default": LAYERS, "aten.copy_.default": LAYERS + 1}


def test_negative_control_todays_pageable_index_fails_the_prefill_send(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copies._IndexCache, "get", _todays_index)
    dev = standin()
    with pytest.raises(HostSyncError, match="pageable"):
        _push_one_step("tcp", dev)
    dev.violations.clear()
    dev.finish()


def test_a_step_replayed_as_a_full_graph_pushes_its_layers_after_the_forward() -> None:
    """Under a FULL CUDA graph no save_kv_layer runs: the layers leave from wait_for_save,
    after the forward's writes, byte-exact (not after decode's push_wait_s and a fetch)."""
    dev = standin(compute_delay_s=0.03)
    written, decode_regions, _, (_, ops) = _push_one_step("tcp", dev, save_layers=False)
    dev.finish()
    for i in range(LAYERS):
        for p in range(3):
            assert torch.equal(decode_regions[i].tensor[p].view(torch.uint8).flatten(), block_bytes(written[i], p))
    assert ops["aten.index_select.default"] == LAYERS


def _decode_loader(dev: AsyncStandInDevice) -> tuple[KVLoader, list[MemoryRegion], list[torch.Tensor]]:
    regions, access = _staged_decode(dev)
    config = PDConnectorConfig.from_extra_config({"transfer_timeout_s": 5, "push_wait_s": 1})
    transport = create_transport("tcp")
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
    pushed = [random_kv(2, seed=60 + i) for i in range(LAYERS)]
    for i in range(LAYERS):  # prefill's pushes, landed in decode's push staging
        batch = BlockBatch("p-1", i, (0, 1), BLOCK_NBYTES, last=True)
        for p, view in enumerate(loader.staging.destinations(batch) or []):
            view[:] = block_bytes(pushed[i], p).numpy().tobytes()
        loader.staging.landed(batch, True)
    return loader, regions, pushed


def _land_layerwise(
    dev: AsyncStandInDevice, loader: KVLoader, gate: threading.Event | None = None
) -> tuple[set[int], bool]:
    """Decode's layer-wise load of the pushed KV, its hooks on the forward's thread (the compute
    stream held at ``gate`` if given): (the load's block errors, whether the forward learned them
    while the device was held)."""
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
        if gate is not None:
            dev.kernel(dev.compute, lambda: gate.wait(30) and None)
        loader.start_loads()
        for i in range(LAYERS):
            loader.wait_for_layer(i)
    errors: list[set[int]] = []

    def forward_learns_errors() -> None:
        with dev.forward():
            errors.append(loader.block_ids_with_load_errors())

    forward = threading.Thread(target=forward_learns_errors)
    forward.start()
    forward.join(10)
    while_held = gate is not None and bool(errors) and not gate.is_set()
    if gate is not None:
        gate.set()
    forward.join(30)
    return errors[0], while_held


def test_decode_lands_each_layer_with_one_copy_and_one_scatter_and_one_index() -> None:
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.01)
    loader, regions, pushed = _decode_loader(dev)
    assert _land_layerwise(dev, loader)[0] == set()
    copies = loader.access.land_copies
    indexes, ops = copies.indexes_built, dict(copies.stream.ops)
    loader.close()
    dev.finish()
    for i in range(LAYERS):
        for p, block in enumerate((6, 1)):
            assert torch.equal(
                regions[i].blocks[block].contiguous().view(torch.uint8).flatten(), block_bytes(pushed[i], p)
            )
    assert indexes == 1
    assert ops == {"aten.copy_.default": LAYERS + 1, "aten.index_copy_.default": LAYERS}


def test_negative_control_todays_pageable_index_fails_the_decode_landing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copies._IndexCache, "get", _todays_index)
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.0)
    loader, _, _ = _decode_loader(dev)
    # the load thread's copy fails: the job fails, its blocks are recomputed
    assert _land_layerwise(dev, loader)[0] == {6, 1}
    loader.close()
    with pytest.raises(HostSyncError, match="pageable"):
        dev.finish()


def test_the_forward_learns_a_layerwise_loads_errors_without_waiting_for_its_copies() -> None:
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.0)
    loader, _, _ = _decode_loader(dev)
    assert _land_layerwise(dev, loader, gate=threading.Event()) == (set(), True)
    loader.close()
    dev.finish()


def test_the_forward_reports_finished_sends_without_waiting_for_queued_copies() -> None:
    """A released transfer is revoked behind the sends queued before it (its grant) on the send
    thread: get_finished returns while the device is stalled, and reports it once it ran."""
    dev = standin(compute_delay_s=0.0, copy_delay_s=0.0)
    prefill, kv = _prefill_worker("tcp", dev)
    reader_regions = make_regions(LAYERS, 8, seed=None, block_shape=(2, BS, 64))
    reader = create_transport("tcp")
    reader.register_regions(reader_regions)
    sink = _AnnouncedSink(reader_regions)
    reader_endpoint = reader.start(sink, "127.0.0.1", 0)
    spec = SendSpec(
        transfer_id="t3",
        block_ids=(1, 6),
        first_token=0,
        end_token=2 * BS,
        num_prompt_tokens=2 * BS,
        push_endpoint=None,
        announcement={"do_remote_prefill": True},
        announce_endpoint=reader_endpoint,
    )
    gate = threading.Event()
    try:
        with dev.forward():
            prefill.begin_step(WorkerStep(sends=[spec]))
            dev.kernel(dev.compute, lambda: gate.wait(30) and None)  # the GPU is busy with the forward
            prefill.wait_for_save()  # the held copy and its grant queue behind it
            prefill.begin_step(WorkerStep(finished_sends=[FinishedSend("t3", "r3", held=True)]))
        prefill.sender.release("t3")  # decode's release (it will not read)
        reported: list[set[str]] = []

        def get_finished() -> None:
            with dev.forward():
                reported.append(prefill.get_finished()[0])

        forward = threading.Thread(target=get_finished)
        forward.start()
        forward.join(10)
        assert not forward.is_alive() and reported == [set()]  # returned while the device is stalled
        gate.set()
        assert sink.announced.wait(20)  # the grant ran, then the release behind it
        assert prefill.sender.sends.drain(20)
        with dev.forward():
            assert prefill.get_finished()[0] == {"r3"}
        with pytest.raises(Exception, match="t3"):  # its reads were revoked after the grant
            reader.fetch(prefill.endpoint, "t3", 0, [1, 6], [0, 1], timeout=5).result(timeout=10)
    finally:
        gate.set()
        prefill.shutdown()
        reader.close()
        dev.finish()


@pytest.mark.parametrize("bounce_blocks", [8, 1])
def test_the_stores_copies_pass_the_detector(bounce_blocks: int) -> None:
    node = Node(WatchedStandIn(), bounce_blocks)
    try:
        written = node.forward_writes([5, 2, 7], seed=70)
        node.save()
        node.commit()
        seen = node.load_and_attend()
        assert all(
            torch.equal(block_bytes(seen[i], p), block_bytes(written[i], p)) for i in range(LAYERS) for p in range(3)
        )
        ops = node.worker.copies._load_copies.stream.ops  # type: ignore[attr-defined]
        passes = -(-3 // bounce_blocks)
        assert ops["aten.index_copy_.default"] == LAYERS * passes  # one scatter per layer and pass
    finally:
        node.close()


def test_negative_control_todays_pageable_index_fails_the_store(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(block_copies._IndexCache, "get", _todays_index)
    node = Node(WatchedStandIn(), 8)
    node.forward_writes([5, 2, 7], seed=80)
    node.save()
    node.worker.wait_saves()  # the save thread's copy failed: reported, not committed
    assert node.worker.report().saves[0].committed == []
    with pytest.raises(HostSyncError, match="pageable"):
        node.close()
