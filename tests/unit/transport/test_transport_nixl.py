"""What only the nixl transport has: NIXL descriptors for vLLM 0.32's layouts (one per block, or
per run of adjacent blocks, where the layout keeps a block of a layer together; one per head
where it does not), pushes READ into unregistered sink buffers, fetches WRITTEN by the owner
(revoke waits for them, a late fetch is cancelled instead of dropped), checksums over
NIXL-moved bytes, a sender killed before its blocks were read, UCX settings that never touch
the user's environment. The generic round trips and faults run on nixl in
test_transport_roundtrip.py and test_transport_faults.py."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time

import numpy as np
import pytest
import torch

from tests.support import vllm_kv_cache as replay
from tests.support.transport_harness import make_regions, spawn_peer, started
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.kv_layout import KVLayout, manager_blocks
from vllm_pd.connector.transport import create_transport, nixl_agent
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.transport.nixl_regions import NixlRegions, block_pairs, merge_pairs, region_layout
from vllm_pd.errors import ConfigError, PeerClosed, TransferCorrupted, TransferRejected, TransferTimeout
from vllm_pd.protocol.frames import Checksum

HEADS = 4  # KV heads of the small Llama-like model of these tests


def vllm_regions(
    layout: KVLayout,
    num_blocks: int,
    seed: int | None,
    model: str = "llama3-8b",
    backend: str = "FLASH_ATTN",
    block_size: int = 0,
    layers: int = 2,
) -> list[MemoryRegion]:
    """One worker's KV as vLLM 0.32 allocates it in ``layout`` (tests/support/vllm_kv_cache.py), as the
    connector registers it; random bytes, or zeros where ``seed`` is None."""
    m = replay.model(model, layers=layers, block_size=block_size, kv_heads=HEADS if model == "llama3-8b" else 1)
    cache = replay.allocate(m, replay.BACKENDS[backend], layout, num_blocks)
    if seed is not None:
        raw = cache.raw.view(torch.uint8).numpy()
        raw[:] = np.random.default_rng(seed).integers(0, 256, size=raw.shape, dtype=np.uint8)
    return [MemoryRegion(name, manager_blocks(t, num_blocks)) for name, t in cache.views.items()]


def wire_bytes(region: MemoryRegion, block: int) -> bytes:
    """A block's bytes in wire (= memory) order."""
    return bytes(region.blocks[block].contiguous().view(-1).view(torch.uint8).numpy())


class StagingSink:
    """A sink like the connector's push staging: a fresh buffer per pushed block, not
    inside any registered region (so the receiver registers it for the READ)."""

    def __init__(self) -> None:
        self.blocks: dict[tuple[int, int], torch.Tensor] = {}
        self.landed_calls: list[tuple[BlockBatch, bool]] = []
        self.cond = threading.Condition()

    def destinations(self, batch: BlockBatch):
        views = []
        for p in batch.positions:
            buf = self.blocks[(batch.layer, p)] = torch.zeros(batch.block_nbytes, dtype=torch.uint8)
            views.append(memoryview(buf.numpy()))
        return views

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        with self.cond:
            self.landed_calls.append((batch, ok))
            self.cond.notify_all()

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        return None

    def wait_landed(self, n: int, timeout: float = 10.0) -> list[tuple[BlockBatch, bool]]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.landed_calls) >= n, timeout), self.landed_calls
            return list(self.landed_calls)


def staged(regions: list[MemoryRegion]):
    t = create_transport("nixl")
    t.register_regions(regions)
    sink = StagingSink()
    return t, sink, t.start(sink, "127.0.0.1", 0)


# -- layouts and descriptors --------------------------------------------------------------


def test_layout_gives_every_block_the_spans_of_memory_region() -> None:
    for region in (vllm_regions(KVLayout.LHBNC, 9, seed=None)[1], make_regions(1, 9, seed=None)[0]):
        lay = region_layout(region)
        ids = np.arange(9)
        spans = lay.spans(ids)
        for b in ids:
            assert [(int(spans[j, b]), n) for j, n in enumerate(lay.lengths)] == region.block_spans(int(b))
        start, _ = lay.extent
        assert start == region.tensor.data_ptr()
    assert region_layout(make_regions(1, 9, seed=None)[0]).extent[1] == 9 * make_regions(1, 1)[0].block_nbytes
    assert len(region_layout(vllm_regions(KVLayout.LHBNC, 4, seed=None)[0]).lengths) == HEADS  # heads apart
    with pytest.raises(ValueError, match="cpu or cuda"):
        region_layout(MemoryRegion("m", torch.empty((4, 8), device="meta")))


ADJACENT = (np.arange(4, 12), np.arange(20, 28))  # 8 blocks in a run on both sides
SCATTERED = (np.array([0, 3, 6, 9, 13, 17, 22, 30]), np.array([1, 5, 2, 8, 12, 31, 27, 16]))
# NIXL descriptors per layer for a request of 8 blocks, both sides in the same layout
DESCRIPTORS = {  # layout: (adjacent ids, scattered ids)
    KVLayout.LBHNC: (1, 8),
    KVLayout.LBNHC: (1, 8),
    KVLayout.BLHNC: (8, 8),  # other layers' pages lie between a layer's blocks
    KVLayout.BLNHC: (8, 8),
    KVLayout.LHBNC: (HEADS, 8 * HEADS),  # a block's heads lie apart: one run per head
    KVLayout.BHLNC: (8 * HEADS, 8 * HEADS),
}


def descriptors(local: MemoryRegion, remote: MemoryRegion, ids: tuple[np.ndarray, np.ndarray]) -> int:
    return len(block_pairs(region_layout(local), ids[0], region_layout(remote), ids[1])[0])


@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda m: m.name)
def test_descriptors_per_block_in_each_of_vllms_layouts(layout: KVLayout) -> None:
    """No NIXL agent needed: the descriptor list is what block_pairs gives the agent."""
    here, there = vllm_regions(layout, 32, seed=None), vllm_regions(layout, 32, seed=None)
    for layer in range(2):
        got = (descriptors(here[layer], there[layer], ADJACENT), descriptors(here[layer], there[layer], SCATTERED))
        assert got == DESCRIPTORS[layout], layer


@pytest.mark.parametrize(
    ("model", "backend", "layout"),
    [
        ("llama3-8b", "FLASHINFER", KVLayout.LBHNC),
        ("deepseek-v3", "FLASHMLA", KVLayout.LBNHC),
        ("deepseek-v3", "FLASHMLA", KVLayout.LHBNC),
    ],
)
def test_split_kernel_blocks_move_as_one_descriptor_per_block(model: str, backend: str, layout: KVLayout) -> None:
    here, there = (vllm_regions(layout, 32, None, model=model, backend=backend, block_size=128) for _ in range(2))
    assert here[0].tensor.shape[1] == 2  # two kernel blocks per block
    assert (descriptors(here[0], there[0], ADJACENT), descriptors(here[0], there[0], SCATTERED)) == (1, 8)


def test_block_pairs_cut_blocks_where_either_sides_span_ends() -> None:
    """A head-major page here, heads apart there (the same bytes in the same order, so the same
    block format): each block's pieces pair up in wire order. Checked by doing the copies."""
    here, there = vllm_regions(KVLayout.LBHNC, 32, seed=None), vllm_regions(KVLayout.LHBNC, 32, seed=7)
    local, remote, lengths = block_pairs(region_layout(here[1]), SCATTERED[0], region_layout(there[1]), SCATTERED[1])
    assert len(local) == 8 * HEADS and set(lengths.tolist()) == {here[1].block_nbytes // HEADS}
    for dst, src, n in zip(local.tolist(), remote.tolist(), lengths.tolist(), strict=True):
        ctypes.memmove(dst, src, n)  # what NIXL's READ would do
    for mine, theirs in zip(*SCATTERED, strict=True):
        assert wire_bytes(here[1], int(mine)) == wire_bytes(there[1], int(theirs))
    assert not here[0].tensor.any()  # the other layer untouched
    with pytest.raises(ValueError, match="bytes here"):
        block_pairs(region_layout(here[0]), ADJACENT[0], region_layout(make_regions(1, 32)[0]), ADJACENT[1])


@pytest.mark.parametrize("layout", list(KVLayout), ids=lambda m: m.name)
def test_one_registration_holds_every_layer_of_vllms_buffer(layout: KVLayout) -> None:
    regions = vllm_regions(layout, 8, seed=None, layers=3)
    ((mem, _, start, nbytes),) = NixlRegions(regions).registrations
    raw = regions[0].tensor.untyped_storage()
    assert (mem, start, nbytes) == ("DRAM", raw.data_ptr(), raw.nbytes())


def test_consecutive_blocks_merge_into_one_descriptor_per_span() -> None:
    src, dst = (
        region_layout(vllm_regions(KVLayout.LHBNC, 32, None)[0]),
        region_layout(vllm_regions(KVLayout.LHBNC, 32, None)[0]),
    )
    n = np.repeat(np.asarray(src.lengths), 8)
    # blocks 4..11 into 20..27: a run on both sides -> one descriptor per head
    local, remote, lengths = merge_pairs(
        src.spans(np.arange(4, 12)).reshape(-1), dst.spans(np.arange(20, 28)).reshape(-1), n
    )
    assert len(local) == HEADS and list(lengths) == [8 * src.lengths[0]] * HEADS
    # a run here, scattered there: nothing merges
    local, _, _ = merge_pairs(src.spans(np.arange(4, 12)).reshape(-1), dst.spans(np.arange(0, 16, 2)).reshape(-1), n)
    assert len(local) == 8 * HEADS
    # two runs, and a registration boundary between contiguous halves
    local, _, lengths = merge_pairs(
        np.arange(6) * 10, np.arange(6) * 10, np.full(6, 10), segment=np.array([0, 0, 0, -1, -1, -1])
    )
    assert list(local) == [0, 30] and list(lengths) == [30, 30]


def test_host_segments_find_the_region_a_buffer_lies_in() -> None:
    regions = make_regions(2, 4, seed=None)
    kv = NixlRegions(regions)
    nbytes = regions[0].block_nbytes
    base0, base1 = regions[0].tensor.data_ptr(), regions[1].tensor.data_ptr()
    outside = torch.zeros(nbytes, dtype=torch.uint8).data_ptr()
    addresses = np.array([base0, base1 + 3 * nbytes, base0 + 3 * nbytes + 1, outside])
    got = kv.host_segments(addresses, nbytes)
    assert list(got[2:]) == [-1, -1]  # the third one runs past region 0's end
    for k, address in zip(got[:2], addresses[:2]):  # the registration each buffer lies in
        _, _, start, n = kv.registrations[k]
        assert start <= address and address + nbytes <= start + n


# -- bytes over NIXL ----------------------------------------------------------------------


def test_head_split_blocks_push_into_staging_and_fetch_into_another_layout_byte_exact() -> None:
    """The sender's blocks lie in one span per head (LHBNC), the receiver's in one (LBHNC): the
    same bytes in the same order, moved by real NIXL (UCX over host memory)."""
    src, dst = vllm_regions(KVLayout.LHBNC, 32, seed=1), vllm_regions(KVLayout.LBHNC, 32, seed=None)
    a, _, a_ep = staged(src)
    b, b_sink, b_ep = staged(dst)
    try:
        nbytes = region_layout(src[1]).block_nbytes
        ids = [3, 4, 5, 6, 17, 30]  # a run and two strays
        quiet = a.push(b_ep, BlockBatch("lh", 0, (0, 1), nbytes), [8, 9], timeout=10, answer=False)
        a.push(b_ep, BlockBatch("lh", 1, tuple(range(6)), nbytes, last=True), ids, timeout=10).result(10)
        assert quiet.result(0) is None
        calls = b_sink.wait_landed(2)
        assert [(c[0].layer, c[1]) for c in calls] == [(0, True), (1, True)]
        for pos, block in enumerate(ids):
            assert bytes(b_sink.blocks[(1, pos)].numpy()) == wire_bytes(src[1], block)
        assert bytes(b_sink.blocks[(0, 1)].numpy()) == wire_bytes(src[0], 9)
        a.allow_fetch("g", ids)
        b.fetch(a_ep, "g", 1, ids, [10, 11, 12, 13, 0, 31], timeout=10).result(10)
        for mine, theirs in zip([10, 11, 12, 13, 0, 31], ids, strict=True):
            assert wire_bytes(dst[1], mine) == wire_bytes(src[1], theirs)
        assert not dst[1].blocks[14].any() and not dst[0].tensor.any()  # nothing else written
    finally:
        a.close()
        b.close()


def test_checksums_catch_a_block_that_does_not_match_its_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender's (owner's) digests are made wrong on the way out: the receiver's verifier
    must refuse the landed bytes - landed(ok=False) for a push, TransferCorrupted for both."""
    src, dst = make_regions(1, 8, seed=1), make_regions(1, 8, seed=None)
    a, _, a_ep = started("nixl", src)
    b, b_sink, b_ep = started("nixl", dst)
    try:
        nbytes = src[0].block_nbytes
        a.push(b_ep, BlockBatch("ok", 0, (0,), nbytes), [0], timeout=10).result(10)  # connected, fine
        owner = a._side.regions
        real = owner.digests

        def flipped(layer: int, ids: np.ndarray, checksum: Checksum) -> bytes:
            d = bytearray(real(layer, ids, checksum))
            d[0] ^= 1
            return bytes(d)

        monkeypatch.setattr(owner, "digests", flipped)  # a's digests only: b verifies with the real ones
        with pytest.raises(TransferCorrupted, match="checksum"):
            a.push(b_ep, BlockBatch("bad", 0, (1, 2), nbytes), [1, 2], timeout=10).result(10)
        assert [(c[0].transfer_id, c[1]) for c in b_sink.wait_landed(2)] == [("ok", True), ("bad", False)]
        a.allow_fetch("f", [3])
        with pytest.raises(TransferCorrupted, match="checksum"):
            b.fetch(a_ep, "f", 0, [3], [5], timeout=10).result(10)
    finally:
        a.close()
        b.close()


def test_without_checksum_no_digests_travel() -> None:
    src, dst = make_regions(1, 8, seed=1), make_regions(1, 8, seed=None)
    a, _, a_ep = started("nixl", src, checksum="none")
    b, _, b_ep = started("nixl", dst, checksum="none")
    try:
        a.allow_fetch("n", [1, 2])
        b.fetch(a_ep, "n", 0, [1, 2], [6, 7], timeout=10).result(10)
        assert torch.equal(dst[0].tensor[6:8], src[0].tensor[1:3])
    finally:
        a.close()
        b.close()


# -- fetches the owner writes ----------------------------------------------------------------


class StalledWrites:
    """The owner's NIXL transfers wait for ``go`` (a NIC that stalls mid-transfer cannot be
    had here): what revoke and a late fetch must cope with."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, owner_agent: nixl_agent.LocalAgent) -> None:
        self.go = threading.Event()
        self.entered = threading.Event()
        real = nixl_agent.LocalAgent.transfer

        def transfer(agent, op, *args, **kwargs):
            if agent is owner_agent and op == "WRITE":
                self.entered.set()
                self.go.wait(30)
            return real(agent, op, *args, **kwargs)

        monkeypatch.setattr(nixl_agent.LocalAgent, "transfer", transfer)


def test_revoke_waits_for_a_write_in_flight_and_then_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    src, dst = make_regions(1, 8, seed=1), make_regions(1, 8, seed=None)
    a, _, a_ep = started("nixl", src)
    b, _, _ = started("nixl", dst)
    try:
        stall = StalledWrites(monkeypatch, a._side.agent)
        a.allow_fetch("r", [0, 1])
        fut = b.fetch(a_ep, "r", 0, [0, 1], [4, 5], timeout=30)
        assert stall.entered.wait(10)
        revoked = threading.Event()
        threading.Thread(target=lambda: (a.allow_fetch("r", None), revoked.set()), daemon=True).start()
        assert not revoked.wait(0.5)  # the WRITE is still going: revoke must not return
        stall.go.set()
        assert revoked.wait(10)
        assert fut.result(10) is None  # granted when it began: it completes
        assert torch.equal(dst[0].tensor[4:6], src[0].tensor[0:2])
        with pytest.raises(TransferRejected, match="not granted"):
            b.fetch(a_ep, "r", 0, [0], [6], timeout=10).result(10)
        assert not dst[0].tensor[6].any()
    finally:
        stall.go.set()
        a.close()
        b.close()


def test_fetch_past_its_deadline_is_cancelled_and_settles_only_when_the_owner_answers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, dst = make_regions(1, 8, seed=1), make_regions(1, 8, seed=None)
    a, _, a_ep = started("nixl", src)
    b, _, _ = started("nixl", dst, revoke_wait=20.0)
    try:
        stall = StalledWrites(monkeypatch, a._side.agent)
        a.allow_fetch("c", list(range(8)))
        writing = b.fetch(a_ep, "c", 0, [0], [4], timeout=0.3)  # its WRITE stalls at the owner
        queued = b.fetch(a_ep, "c", 0, [1], [5], timeout=0.3)  # waits behind it, never starts
        assert stall.entered.wait(10)
        time.sleep(1.0)  # both deadlines (and the timer's slack) have passed
        assert not writing.done()  # the owner may still write our block 4: not settled yet
        stall.go.set()
        assert writing.result(10) is None  # it landed after all (late, but whole)
        assert torch.equal(dst[0].tensor[4], src[0].tensor[0])
        with pytest.raises(TransferTimeout, match="cancelled"):
            queued.result(10)
        assert not dst[0].tensor[5].any()  # the cancelled fetch wrote nothing
        a.allow_fetch("c", None)  # no serve left behind
    finally:
        stall.go.set()
        a.close()
        b.close()


# -- processes dying, closing ---------------------------------------------------------------


def test_sender_killed_before_its_blocks_were_read_fails_the_batch() -> None:
    dst = make_regions(1, 16, seed=None)
    b, b_sink, b_ep = started("nixl", dst)
    b_sink.hold.clear()  # its reader waits in destinations(): the push is not read yet
    peer, _ = spawn_peer("nixl", num_layers=1, num_blocks=16, hold=False, push_to=b_ep)
    try:
        assert b_sink.entered.wait(30)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        b_sink.hold.set()
        ((batch, ok),) = b_sink.wait_landed(1, timeout=20)
        assert batch.transfer_id == "from-peer" and not ok
        # and the transport still serves others
        a, _, _ = started("nixl", make_regions(1, 16, seed=3))
        try:
            a.push(b_ep, BlockBatch("next", 0, (0,), dst[0].block_nbytes), [2], timeout=10).result(10)
        finally:
            a.close()
    finally:
        peer.kill()
        b.close()


def test_close_fails_pending_futures_and_leaves_the_reader_unstuck() -> None:
    src, dst = make_regions(1, 8, seed=1), make_regions(1, 8, seed=None)
    a, _, _ = started("nixl", src)
    b, b_sink, b_ep = started("nixl", dst)
    try:
        b_sink.hold.clear()
        fut = a.push(b_ep, BlockBatch("pending", 0, (0,), src[0].block_nbytes), [0], timeout=30)
        assert b_sink.entered.wait(10)
        a.close()
        with pytest.raises(PeerClosed):
            fut.result(5)
        b_sink.hold.set()  # b now reads from a transport that is gone (its process is not)
        ((batch, ok),) = b_sink.wait_landed(1, timeout=20)
        # the batch ends either way; if cross-memory attach still reached the memory, the
        # checksum vouches for what landed
        assert batch.transfer_id == "pending"
        assert not ok or torch.equal(dst[0].tensor[0], src[0].tensor[0])
        with pytest.raises(PeerClosed):
            a.notify(b_ep, b"after close", timeout=1).result(1)
    finally:
        b.close()


def test_a_client_without_regions_notifies_and_the_pump_rests() -> None:
    b, _, b_ep = started("nixl", make_regions(1, 4, seed=None))
    client = create_transport("nixl")  # what release.py makes in the proxy: no regions, no NIXL agent
    try:
        assert client.notify(b_ep, b"hello", timeout=10).result(10).startswith(b"re:hello from nixl://")
        a, _, _ = started("nixl", make_regions(1, 4, seed=1))
        try:
            a.push(b_ep, BlockBatch("x", 0, (0,), a._kv().block_nbytes[0]), [1], timeout=10).result(10)
            assert a._side.pump._holds == 0  # nothing progresses the agent once answered
        finally:
            a.close()
    finally:
        client.close()
        b.close()


# -- configuration --------------------------------------------------------------------------


def test_missing_nixl_is_a_config_error_naming_the_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(__import__("sys").modules, "nixl", None)
    t = create_transport("nixl")
    try:
        with pytest.raises(ConfigError, match=r"pip install 'vllm-pd\[nixl\]'"):
            t.register_regions(make_regions(1, 2, seed=None))
    finally:
        t.close()


def test_options_and_config() -> None:
    assert PDConnectorConfig.from_extra_config({"transport": "nixl"}).transport == "nixl"
    with pytest.raises(ConfigError, match="target_progress"):
        create_transport("nixl", target_progress="sometimes")
    with pytest.raises(ConfigError, match="checksum"):
        create_transport("nixl", checksum="md5")


def test_ucx_settings_are_ours_only_where_the_user_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("UCX_TLS", raising=False)
    monkeypatch.delenv("UCX_KEEPALIVE_INTERVAL", raising=False)
    with nixl_agent.ucx_defaults(host_only=True) as tls:
        assert tls == "tcp,cma" and os.environ["UCX_KEEPALIVE_INTERVAL"] == "inf"
    assert "UCX_TLS" not in os.environ and "UCX_KEEPALIVE_INTERVAL" not in os.environ
    with nixl_agent.ucx_defaults(host_only=False) as tls:
        assert "UCX_TLS" not in os.environ and tls == "all"  # GPU memory: UCX's own choice
    monkeypatch.setenv("UCX_TLS", "rc,tcp")
    monkeypatch.setenv("UCX_KEEPALIVE_INTERVAL", "5s")
    with nixl_agent.ucx_defaults(host_only=True) as tls:
        assert tls == "rc,tcp" and os.environ["UCX_KEEPALIVE_INTERVAL"] == "5s"
    assert os.environ["UCX_TLS"] == "rc,tcp" and os.environ["UCX_KEEPALIVE_INTERVAL"] == "5s"
    assert [nixl_agent.ucx_allows_cma(v) for v in ("all", "tcp,cma", "sm", "tcp", "^cma", "^ib")] == [
        True,
        True,
        True,
        False,
        False,
        True,
    ]
