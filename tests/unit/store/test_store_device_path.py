"""The store's data path with the KV cache on a GPU - mocked: no GPU runs here.

The GPU is the asynchronous stand-in of tests/support/async_device.py: "kernels" and copies
run later on their streams' threads and events complete only when reached, so a save
that copies before the forward's write, a block committed before its copy completed,
or an attention that does not wait for its layer's load reads stale bytes and fails
byte for byte; and anything that would make a real GPU's host wait - on the forward's
thread, where the store's hooks run, or inside launched copies - fails the test. The KV
is vLLM 0.32's, for FlashAttention in its default layout LBNHC (tests/unit/connector/test_kv_device_path.py
``vllm_cache``: a block's bytes in memory order are not its logical order).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.support.async_device import AsyncStandInDevice
from tests.unit.connector.test_kv_device_path import (
    BLOCK_NBYTES,
    BS,
    LAYERS,
    block_bytes,
    random_kv,
    vllm_cache,
    write_layer,
)
from vllm_pd.connector.device.kv_device import COMPLETED, HostDevice, KVDevice
from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.connector.store_bridge import StoreBridgeWorker, make_salt
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt

SLOT = LAYERS * BLOCK_NBYTES
SALT = KeySalt("m", "bfloat16", "cuda:flash-attn", BS, LAYERS)
PLAIN = NO_EXTRA_KEYS.scope(SALT)  # what plain requests' blocks are written for
SAVED, LOADED = [5, 2, 7], [0, 1, 3]  # vLLM block ids: a finished request's, a new request's
TOKENS = list(range(3 * BS + 1))  # three full blocks (and one token vLLM computes)


class WatchedStandIn(AsyncStandInDevice):
    """The stand-in GPU with its host-sync checks on: the forward's thread may only make
    streams wait, launched copies never make the host wait."""

    def __init__(self, compute_delay_s: float = 0.02, copy_delay_s: float = 0.005) -> None:
        super().__init__(compute_delay_s, copy_delay_s, checked=True)


class Node:
    """One rank: the store's scheduler side, and its worker side behind the connector's bridge."""

    def __init__(self, dev: KVDevice, bounce_blocks: int = 8) -> None:
        self.dev = dev
        self.cfg = StoreConfig(cpu_bytes=16 * SLOT, host_bounce_bytes=bounce_blocks * SLOT)
        self.kv = vllm_cache(dev if isinstance(dev, AsyncStandInDevice) else None)
        self.sched = StoreScheduler(self.cfg, SALT, SLOT)
        self.bridge = StoreBridgeWorker(self.cfg, vllm_config=None, tp_rank=0)
        self.bridge.store = StoreWorker(self.cfg, SALT, list(self.kv.values()), device=dev)
        self.bridge._layer_index = {name: i for i, name in enumerate(self.kv)}
        self.worker = self.bridge.store

    @contextmanager
    def forward_thread(self) -> Iterator[None]:
        """The calling thread is the forward's (vLLM calls the connector's hooks on it)."""
        if isinstance(self.dev, AsyncStandInDevice):
            with self.dev.forward():
                yield
        else:
            yield

    def kernel(self, work: Callable[[], None]) -> None:
        """Fake compute on the compute stream (the forward's KV writes, attention)."""
        if isinstance(self.dev, AsyncStandInDevice):
            self.dev.kernel(self.dev.compute_stream(), work)
        else:
            self.dev.launch(self.dev.compute_stream(), work)

    def forward_writes(self, block_ids: list[int], seed: int) -> list[torch.Tensor]:
        """The forward's KV writes of every layer, launched on the compute stream (not yet run)."""
        written = [random_kv(len(block_ids), seed + i) for i in range(LAYERS)]
        for name, values in zip(self.kv, written):
            self.kernel(write_layer(self.kv[name], block_ids, values))
        return written

    def save(self) -> None:
        """vLLM finished the request: its blocks go to the pool (started in the next step's start_load_kv)."""
        assert self.sched.plan_save("r1", TOKENS, SAVED) is not None
        with self.forward_thread():
            self.worker.execute(self.sched.build_plan())

    def commit(self) -> None:
        self.worker.wait_saves()
        self.sched.on_worker_report(self.worker.report())
        assert self.sched.match(TOKENS[:-1]) == 3 * BS

    def load_and_attend(self) -> list[torch.Tensor]:
        """A new request hits the store: its layers land while "attention kernels", launched on the
        compute stream after ``wait_for_layer_load``, read them. Returns what each kernel read."""
        op, missing = self.sched.plan_load("r2", TOKENS, 0, 3 * BS, LOADED)
        assert op is not None and not missing
        for kv in self.kv.values():  # vLLM zeroes the step's new blocks before start_load_kv
            self.kernel(write_layer(kv, LOADED, torch.zeros_like(kv[LOADED])))
        with self.forward_thread():
            self.worker.execute(self.sched.build_plan())
        seen: list[torch.Tensor] = [torch.empty(0)] * LAYERS
        for i, name in enumerate(self.kv):
            with self.forward_thread():
                self.bridge.wait_for_layer_load(name)

            def attention(i: int = i, kv: torch.Tensor = self.kv[name]) -> None:
                seen[i] = kv[LOADED].clone()

            self.kernel(attention)
        self.dev.record(self.dev.compute_stream()).synchronize()
        assert self.bridge.load_errors() == set()
        return seen

    def close(self) -> None:
        self.worker.close()
        if isinstance(self.dev, AsyncStandInDevice):
            self.dev.finish()


def same_blocks(seen: torch.Tensor, written: torch.Tensor) -> bool:
    return all(torch.equal(block_bytes(seen, p), block_bytes(written, p)) for p in range(written.shape[0]))


@pytest.mark.parametrize(
    "make_device, bounce_blocks",
    [
        (WatchedStandIn, 8),  # the whole save, and each layer of the load, in one pass
        (WatchedStandIn, 1),  # one block per pass: bounce rows reused while copies are queued
        (HostDevice, 1),  # vLLM's CPU backend: inline copies (the bounce is not used)
    ],
    ids=["standin-gpu", "standin-gpu-small-bounce", "cpu"],
)
def test_save_then_load_round_trip_is_byte_exact(make_device: type[KVDevice], bounce_blocks: int) -> None:
    node = Node(make_device(), bounce_blocks)
    try:
        written = node.forward_writes(SAVED, seed=10)
        node.save()
        node.commit()
        seen = node.load_and_attend()
        for i in range(LAYERS):
            assert same_blocks(seen[i], written[i]), f"layer {i}"
    finally:
        node.close()


def test_a_save_is_committed_only_once_its_copy_completed() -> None:
    """Readers (peers through the slot directory, the scheduler through the report) see a block
    only after its device-to-host copy completed, and then with the forward's bytes."""
    node = Node(WatchedStandIn(compute_delay_s=0.05, copy_delay_s=0.05))
    try:
        written = node.forward_writes(SAVED, seed=20)
        node.save()
        keys = node.sched.block_keys(TOKENS)[:3]
        visible: set[int] = set()
        deadline = time.monotonic() + 20
        while len(visible) < len(keys) and time.monotonic() < deadline:
            reported = {k for r in node.worker.report().saves for k in r.committed}
            for p, key in enumerate(keys):
                entry = node.worker.directory.get(key, PLAIN)
                if entry is None and key not in reported:
                    continue
                assert entry is not None  # reported only after the directory has it
                for i in range(LAYERS):
                    pool_bytes = node.worker.pool.data[entry[0], i]
                    assert torch.equal(pool_bytes, block_bytes(written[i], p)), f"block {p} layer {i}"
                visible.add(p)
            time.sleep(0.001)
        assert visible == {0, 1, 2}
    finally:
        node.close()


def test_the_stand_in_catches_a_save_that_does_not_wait_for_the_write() -> None:
    """Negative control: saves not ordered after the forward copy the blocks before the write."""
    node = Node(WatchedStandIn(compute_delay_s=0.05, copy_delay_s=0.0))
    node.worker.copies.mark_forward = lambda: COMPLETED  # the missing event
    try:
        written = node.forward_writes(SAVED, seed=30)
        node.save()
        node.worker.wait_saves()
        slot = node.worker.directory.get(node.sched.block_keys(TOKENS)[0], PLAIN)[0]
        assert not torch.equal(node.worker.pool.data[slot, 0], block_bytes(written[0], 0))
    finally:
        node.close()


@pytest.mark.parametrize("stream_wait", [True, False], ids=["waits", "negative-control-no-stream-wait"])
def test_attention_reads_a_loaded_layer_only_after_its_copy(stream_wait: bool) -> None:
    """The copies to the device are slow, the attention kernels fast: only the compute stream's
    wait on the copy's event (wait_for_layer_load) makes them read the loaded bytes."""
    node = Node(WatchedStandIn(compute_delay_s=0.005, copy_delay_s=0.2))
    try:
        written = node.forward_writes(SAVED, seed=40)
        node.save()
        node.commit()
        if not stream_wait:
            node.worker.copies.wait = lambda event: None  # the host still waits for the launch
        seen = node.load_and_attend()
        assert all(same_blocks(seen[i], written[i]) for i in range(LAYERS)) == stream_wait
    finally:
        node.close()


def test_settings_that_cannot_work_with_device_kv_stop_the_start() -> None:
    too_small = StoreConfig(cpu_bytes=16 * SLOT, host_bounce_bytes=SLOT - 1)
    dev = AsyncStandInDevice(checked=True)
    kv = list(vllm_cache(dev).values())
    try:
        with pytest.raises(ConfigError, match="store.host_bounce_bytes"):
            StoreWorker(too_small, SALT, kv, device=dev)
    finally:
        dev.finish()
    StoreWorker(too_small, SALT, kv).close()  # CPU KV: no bounce needed
    assert StoreConfig.from_dict({"host_bounce_bytes": "1m"}).host_bounce_bytes == 1 << 20
    on_gpu = [torch.empty(t.shape, dtype=t.dtype, device="meta") for t in kv]  # stands for CUDA tensors
    with pytest.raises(ValueError, match="host device"):
        StoreWorker(StoreConfig(cpu_bytes=16 * SLOT), SALT, on_gpu, device=HostDevice())


def test_the_bridge_takes_the_connectors_block_format_and_device(tmp_path: Path) -> None:
    """connector.register_kv_caches hands the store vLLM's views grouped into blocks, the worker's
    KVDevice and its block format; the worker's salt (its disk directory) is the scheduler side's,
    made from the handshake's block size and format."""
    vllm_config = SimpleNamespace(
        model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
        cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    bridge = StoreBridgeWorker(StoreConfig(cpu_bytes=16 * SLOT, disk_path=str(tmp_path)), vllm_config, tp_rank=0)
    dev = WatchedStandIn()
    kv = vllm_cache()
    try:
        bridge.register_kv_caches(kv, "127.0.0.1", "127.0.0.1", device=dev, kv_format="bfloat16:N16.H2.C64")
        assert bridge.store is not None and bridge.store.device is dev
        assert bridge.store.slot_nbytes == SLOT
        assert bridge.store.disk is not None
        assert bridge.store.disk.salt == make_salt(vllm_config, LAYERS, BLOCK_NBYTES, "bfloat16:N16.H2.C64").digest()
        assert bridge.store.disk.salt != make_salt(vllm_config, LAYERS, BLOCK_NBYTES, "bfloat16:H2.N16.C64").digest()
    finally:
        bridge.shutdown()
        dev.finish()
