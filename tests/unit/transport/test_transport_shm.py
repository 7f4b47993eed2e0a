"""What is particular to the shm transport: corruption inside the ring, a
sender killed mid-stream, and /dev/shm left clean; block bytes read from the
peer's memory (cross-memory attach) where the kernel allows it, and the rings
where it does not. Tests of the rings turn the reads off (``cross_memory=False``):
on these machines the probe succeeds."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import struct
import time

import numpy as np
import pytest
import torch

from tests.support.transport_harness import make_regions, spawn_peer, started
from vllm_pd.connector.transport import create_transport, serve_session
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.cross_memory import PeerMemory
from vllm_pd.connector.transport.layer_plan import ReadyPacer
from vllm_pd.connector.transport.shm import SHM_DIR, ShmChannel
from vllm_pd.connector.transport.wire import Wire
from vllm_pd.errors import ConfigError, TransferCorrupted, TransportError
from vllm_pd.protocol.frames import FLAG_TRAILER, Checksum, Frame, Kind
from vllm_pd.protocol.shm_ring import SEGMENT_PREFIX


def _segments(pid: int | None = None) -> set[str]:
    prefix = SEGMENT_PREFIX + (f"{pid}-" if pid is not None else "")
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


@pytest.mark.parametrize("cross_memory", [False, True])
def test_blocks_larger_than_a_slot_and_many_slot_wraps(cross_memory: bool) -> None:
    src = make_regions(2, 32, seed=4)
    dst = make_regions(2, 32, seed=None)
    # 16 KiB blocks over 12 KiB slots
    opts = dict(slots=2, slot_nbytes=4096 * 3, cross_memory=cross_memory)
    a, _, a_ep = started("shm", src, **opts)
    b, _, b_ep = started("shm", dst, **opts)
    try:
        nbytes = src[0].block_nbytes
        futs = [a.push(b_ep, BlockBatch(f"t{i}", i % 2, (i,), nbytes), [i], timeout=20) for i in range(32)]
        b.allow_fetch("f", list(range(32)))
        a.fetch(b_ep, "f", 1, list(range(1, 32, 2)), list(range(1, 32, 2)), timeout=20).result(20)
        for f in futs:
            f.result(20)
        for i in range(32):
            assert torch.equal(dst[i % 2].tensor[i], src[i % 2].tensor[i])
    finally:
        a.close()
        b.close()
    assert not _segments(os.getpid())


@pytest.mark.parametrize("checksum", ["crc32c", "blake3", "crc32"])
def test_flipped_byte_in_the_ring_is_detected(monkeypatch: pytest.MonkeyPatch, checksum: str) -> None:
    src = make_regions(1, 8, seed=5)
    dst = make_regions(1, 8, seed=None)
    a, _, a_ep = started("shm", src, checksum=checksum, cross_memory=False)
    b, b_sink, b_ep = started("shm", dst, checksum=checksum, cross_memory=False)
    try:
        nbytes = src[0].block_nbytes

        def flip(slot_bytes) -> None:
            slot_bytes[len(slot_bytes) // 2] ^= 0x01

        monkeypatch.setattr(ShmChannel, "fault_hook", staticmethod(flip))
        with pytest.raises(TransferCorrupted, match="checksum"):
            a.push(b_ep, BlockBatch("bad", 0, (0, 1), nbytes), [0, 1], timeout=10).result(10)
        assert b_sink.wait_landed(1)[0][1] is False
        b.allow_fetch("g", [2])
        with pytest.raises(TransferCorrupted, match="checksum"):
            a.fetch(b_ep, "g", 0, [2], [2], timeout=10).result(10)
        monkeypatch.setattr(ShmChannel, "fault_hook", None)
        a.push(b_ep, BlockBatch("good", 0, (0, 1), nbytes), [0, 1], timeout=10).result(10)
        assert torch.equal(dst[0].tensor[:2], src[0].tensor[:2])
    finally:
        a.close()
        b.close()


def test_sender_killed_mid_stream_fails_the_batch_and_leaves_no_segments() -> None:
    # 512 blocks of 8 KiB = 4 MiB through a 4 x 256 KiB ring while our sink holds
    # the reader: the peer fills the ring and waits for credits; then it is killed.
    regions = make_regions(1, 512, seed=None)
    t, sink, ep = started("shm", regions, cross_memory=False)
    sink.hold.clear()
    peer, _ = spawn_peer(
        "shm", num_layers=1, num_blocks=512, hold=False, push_to=ep, slots=4, slot_nbytes=256 << 10, cross_memory=False
    )
    try:
        assert sink.entered.wait(30)
        time.sleep(0.3)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        sink.hold.set()
        ((batch, ok),) = sink.wait_landed(1, timeout=10)
        assert batch.transfer_id == "from-peer" and not ok
        time.sleep(0.2)
        assert not _segments(peer.pid), "killed peer left its ring in /dev/shm"
    finally:
        peer.kill()
        t.close()
    assert not _segments(os.getpid())


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="slots"):
        create_transport("shm", slots=1)
    with pytest.raises(ConfigError, match="slot_nbytes"):
        create_transport("shm", slot_nbytes=10)


def _count_credit_frames(monkeypatch: pytest.MonkeyPatch) -> list[Frame]:
    """Record every CREDIT frame a ShmChannel sends (both processes' sides are in this one)."""
    sent: list[Frame] = []
    real = Wire.send_frame

    def send_frame(self: Wire, frame: Frame) -> None:
        if frame.kind is Kind.CREDIT:
            sent.append(frame)
        real(self, frame)

    monkeypatch.setattr(Wire, "send_frame", send_frame)
    return sent


def test_ring_credits_wake_a_waiting_sender_only(monkeypatch: pytest.MonkeyPatch) -> None:
    credits = _count_credit_frames(monkeypatch)
    src = make_regions(1, 24, seed=6)
    dst = make_regions(1, 24, seed=None)
    opts = dict(slots=4, slot_nbytes=8192, cross_memory=False)  # one 8 KiB block per slot
    a, _, a_ep = started("shm", src, **opts)
    b, b_sink, b_ep = started("shm", dst, **opts)
    try:
        nbytes = src[0].block_nbytes
        for i in range(3):  # fewer than the ring's slots, one at a time: never waits
            a.push(b_ep, BlockBatch(f"q{i}", 0, (i,), nbytes), [i], timeout=10).result(10)
        assert credits == []
        # The receiver holds its reader: 20 one-slot pushes fill the ring, the sender waits
        # for half of it and a CREDIT wakes it once the receiver drains.
        b_sink.hold.clear()
        futs = [a.push(b_ep, BlockBatch(f"w{i}", 0, (i,), nbytes), [i], timeout=20) for i in range(3, 23)]
        assert b_sink.entered.wait(10)
        b_sink.hold.set()
        for f in futs:
            f.result(20)
        assert torch.equal(dst[0].tensor[:23], src[0].tensor[:23])
        assert credits, "a sender that found the ring full was never woken by a CREDIT"
        assert len(credits) < 20  # one per half ring, not one per slot
    finally:
        a.close()
        b.close()


def test_lost_credit_wake_up_is_recovered_by_the_bounded_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    # Drop every CREDIT (what a store/load reordering between the two cores can do to one):
    # the waiting sender must still see the ring's count and finish, not stall.
    real = Wire.send_frame
    monkeypatch.setattr(
        Wire, "send_frame", lambda self, frame: None if frame.kind is Kind.CREDIT else real(self, frame)
    )
    src = make_regions(1, 16, seed=7)
    dst = make_regions(1, 16, seed=None)
    opts = dict(slots=2, slot_nbytes=8192, cross_memory=False)
    a, _, a_ep = started("shm", src, **opts)
    b, _, b_ep = started("shm", dst, **opts)
    try:
        nbytes = src[0].block_nbytes
        futs = [a.push(b_ep, BlockBatch(f"l{i}", 0, (i,), nbytes), [i], timeout=20) for i in range(16)]
        for f in futs:
            f.result(20)
        assert torch.equal(dst[0].tensor, src[0].tensor)
    finally:
        a.close()
        b.close()


def test_ready_for_a_slot_out_of_ring_order_is_corruption() -> None:
    sender = ShmChannel(slots=2, slot_nbytes=4096)
    receiver = ShmChannel(slots=2, slot_nbytes=4096)
    left, right = socket.socketpair()
    try:
        receiver.attach(sender.local_info())
        data = np.arange(4096, dtype=np.uint8)
        push = Frame(Kind.PUSH, checksum=Checksum.NONE, ids=(0,), lengths=(4096,), block_nbytes=4096)
        # slot 1 announced while slot 0 is the next one the receiver empties
        Wire(left).send_frames([Frame(Kind.READY, flags=FLAG_TRAILER, ids=(1,), lengths=(4096,), payload=bytes(8))])
        with pytest.raises(TransferCorrupted, match="expected slot 0"):
            receiver.recv_blocks(Wire(right), push, [memoryview(np.zeros_like(data))])
    finally:
        left.close()
        right.close()
        sender.close()
        receiver.close()


# -- layer plans: the peer reads each layer from our memory once it is ready ----------------


def _connected(transport, peer: str, regions) -> None:
    """A first push opens the connection (a plan is offered on a connected link only)."""
    transport.push(peer, BlockBatch("hello", 0, (0,), regions[0].block_nbytes), [0], timeout=10).result(10)


def _ring_slots_used(transport, peer: str) -> int:
    return transport._links[peer].channel._produced


@contextlib.contextmanager
def _pair(layers: int, blocks: int, seed: int, name: str = "shm", **options):
    """Sender ``a`` (random blocks ``src``) and receiver at ``b_ep`` (zeroed ``dst``), closed after."""
    src = make_regions(layers, blocks, seed=seed)
    dst = make_regions(layers, blocks, seed=None)
    a, _, _ = started(name, src, **options)
    b, b_sink, b_ep = started(name, dst, **options)
    try:
        yield a, b_sink, b_ep, src, dst
    finally:
        a.close()
        b.close()


def test_layer_plan_lands_each_layer_once_it_is_ready() -> None:
    with _pair(3, 8, 8) as (a, b_sink, b_ep, src, dst):
        assert a.push_layers(b_ep, "p", [0, 1, 2], (0, 1), [5, 6], timeout=10) is None  # not connected
        _connected(a, b_ep, src)
        slots = _ring_slots_used(a, b_ep)
        plan = a.push_layers(b_ep, "p", [0, 1, 2], (0, 1), [5, 6], timeout=10, last=True)
        assert plan is not None and plan.future is not None
        time.sleep(0.2)
        assert [c for c in b_sink.landed_calls if c[0].transfer_id == "p"] == []  # nothing ready yet
        for k in range(3):
            plan.ready(k)
            landed = b_sink.wait_landed(2 + k)[1:]
            assert [(batch.layer, ok, batch.last) for batch, ok in landed] == [(i, True, True) for i in range(k + 1)]
        plan.future.result(10)
        for layer in range(3):
            assert torch.equal(dst[layer].tensor[0], src[layer].tensor[5])
            assert torch.equal(dst[layer].tensor[1], src[layer].tensor[6])
        assert _ring_slots_used(a, b_ep) == slots, "the plan's blocks went through the ring"


def test_block_changed_after_ready_is_caught_by_its_checksum() -> None:
    # A sender that reuses a block before the peer read it (the race reading its memory
    # opens): the digest taken by ready() no longer matches, the layer and the rest fail.
    with _pair(2, 4, 9) as (a, b_sink, b_ep, src, dst):
        _connected(a, b_ep, src)
        b_sink.entered.clear()
        b_sink.hold.clear()
        plan = a.push_layers(b_ep, "raced", [0, 1], (0,), [2], timeout=10)
        plan.ready(0)
        assert b_sink.entered.wait(10)  # the receiver saw layer 0 ready and asks for destinations
        src[0].tensor[2].view(-1).view(torch.uint8)[100] ^= 0x04
        b_sink.hold.set()
        with pytest.raises(TransferCorrupted, match="checksum"):
            plan.future.result(10)
        landed = [(batch.layer, ok) for batch, ok in b_sink.wait_landed(3)[1:]]
        assert landed == [(0, False), (1, False)]


def test_pacer_polls_from_the_start_until_it_knows_the_pace() -> None:
    pacer = ReadyPacer()
    assert pacer.quiet_until() is None
    pacer.seen(1.0)
    pacer.seen(1.010)  # one interval is not a pace yet
    assert pacer.quiet_until() is None
    pacer.seen(1.020)
    assert pacer.quiet_until() == pytest.approx(1.020 + ReadyPacer.EARLY * 0.010)


def test_pacer_is_never_late_by_one_slow_layer() -> None:
    pacer = ReadyPacer()
    for t in (0.0, 0.010, 0.020, 0.120):  # the sender was preempted before the last layer
        pacer.seen(t)
    # the shorter of the last two intervals sets the quiet time, not the 100 ms one
    assert pacer.quiet_until() == pytest.approx(0.120 + ReadyPacer.EARLY * 0.010)


def test_paced_plan_sleeps_between_layers_and_still_lands_every_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers ready every 40 ms: once the pace is known the receiver sleeps through most of
    each interval instead of reading the sender's progress all along.

    Checked on the sleeps the receiver asks for, not on how many reads it made: read counts
    follow the OS scheduler (they failed once on a loaded 2-core CI host), the sleeps it
    requests follow the pacing code alone."""
    progress = [0]  # the last progress value the receiver read: layers ready so far
    read_u64 = PeerMemory.read_u64

    def tracked(self: PeerMemory, address: int) -> int:
        progress[0] = read_u64(self, address)
        return progress[0]

    sleeps: dict[int, list[float]] = {}  # ready layers when asked -> sleeps asked for

    class RecordingTime:
        monotonic = staticmethod(time.monotonic)

        @staticmethod
        def sleep(seconds: float) -> None:
            sleeps.setdefault(progress[0], []).append(seconds)
            time.sleep(seconds)

    monkeypatch.setattr(PeerMemory, "read_u64", tracked)
    monkeypatch.setattr(serve_session, "time", RecordingTime)
    layers = 6
    with _pair(layers, 4, 10) as (a, b_sink, b_ep, src, dst):
        _connected(a, b_ep, src)
        plan = a.push_layers(b_ep, "paced", list(range(layers)), (0,), [3], timeout=30, last=True)
        assert plan is not None
        time.sleep(0.04)
        for k in range(layers):
            plan.ready(k)
            b_sink.wait_landed(2 + k)
            time.sleep(0.04)
        plan.future.result(10)
        landed = [(batch.layer, ok) for batch, ok in b_sink.wait_landed(1 + layers)[1:]]
        assert landed == [(k, True) for k in range(layers)]
        for layer in range(layers):
            assert torch.equal(dst[layer].tensor[0], src[layer].tensor[3])
    lazy, fine, slice_s = serve_session.PLAN_POLL_LAZY_S, serve_session.PLAN_POLL_S, serve_session.PLAN_QUIET_SLICE_S
    quiet = {k: [s for s in sleeps.get(k, []) if s not in (lazy, fine)] for k in range(layers)}
    # layers 0-2: fewer than two intervals known, so no quiet sleep; polled lazily throughout
    assert not any(quiet[k] for k in range(3)), sleeps
    # from then on the pace is known: the waits start with quiet sleeps (each at most one slice,
    # so a closed session is still noticed); a layer is skipped only if landing its predecessor
    # already took the whole quiet part of the interval (a preempted receiver)
    assert sum(1 for k in range(3, layers) if quiet[k]) >= 2, sleeps
    assert all(0 < s <= slice_s for k in range(layers) for s in quiet[k]), sleeps
    # the last layer, which decode's first token waits for, is polled finely; the others lazily
    assert set(sleeps.get(layers - 1, [])) - set(quiet[layers - 1]) <= {fine}, sleeps
    assert all(set(sleeps.get(k, [])) - set(quiet[k]) <= {lazy} for k in range(layers - 1)), sleeps


def test_layer_never_ready_fails_the_plan_at_its_timeout() -> None:
    with _pair(2, 4, 12) as (a, b_sink, b_ep, src, dst):
        _connected(a, b_ep, src)
        plan = a.push_layers(b_ep, "stuck", [0, 1], (0,), [1], timeout=0.5)
        plan.ready(0)
        with pytest.raises(TransportError):
            plan.future.result(10)
        landed = [(batch.layer, ok) for batch, ok in b_sink.wait_landed(3)[1:]]
        assert landed == [(0, True), (1, False)]
        # the connection is still good
        a.push(b_ep, BlockBatch("after", 1, (0,), src[1].block_nbytes), [3], timeout=10).result(10)


def _plan_peer(endpoint: str, conn) -> None:
    regions = make_regions(2, 4, seed=13)
    t, _, _ = started("shm", regions)
    _connected(t, endpoint, regions)
    plan = t.push_layers(endpoint, "from-peer", [0, 1], (0,), [1], timeout=60)
    plan.ready(0)
    conn.send(plan is not None)
    time.sleep(60)


def test_sender_killed_mid_plan_fails_the_layers_not_read() -> None:
    import multiprocessing as mp

    regions = make_regions(2, 4, seed=None)
    t, sink, ep = started("shm", regions)
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe()
    peer = ctx.Process(target=_plan_peer, args=(ep, child), daemon=True)
    peer.start()
    try:
        assert parent.poll(60) and parent.recv() is True
        assert sink.wait_landed(2)[1][1] is True  # layer 0 was ready and landed
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        (batch, ok) = sink.wait_landed(3, timeout=10)[2]
        assert (batch.transfer_id, batch.layer, ok) == ("from-peer", 1, False)
    finally:
        peer.kill()
        t.close()
    assert not _segments(os.getpid())


def test_no_plan_where_memory_cannot_be_read(monkeypatch: pytest.MonkeyPatch) -> None:
    # What another host's boot id, a pid namespace, seccomp or Yama do to the probe
    from vllm_pd.connector.transport import shm

    monkeypatch.setattr(shm.PeerMemory, "probe", classmethod(lambda cls, info: None))
    with _pair(1, 4, 10) as (a, b_sink, b_ep, src, dst):
        _connected(a, b_ep, src)
        assert torch.equal(dst[0].tensor[0], src[0].tensor[0])
        assert a.push_layers(b_ep, "x", [0], (1,), [1], timeout=10) is None


@pytest.mark.parametrize(
    "name, options", [("shm", {"checksum": "none"}), ("shm", {"cross_memory": False}), ("tcp", {})]
)
def test_no_plan_without_checksum_cross_memory_or_on_tcp(name: str, options: dict) -> None:
    with _pair(1, 4, 11, name, **options) as (a, b_sink, b_ep, src, dst):
        _connected(a, b_ep, src)
        assert a.push_layers(b_ep, "n", [0], (1,), [1], timeout=10) is None


def test_probe_rejects_another_boot_a_wrong_token_and_no_process() -> None:
    from vllm_pd.connector.transport.cross_memory import PeerMemory, local_info

    info = local_info()
    assert PeerMemory.probe(info) is not None  # this process reads itself
    assert PeerMemory.probe(dict(info, boot="another-host")) is None
    assert PeerMemory.probe(dict(info, token="00" * 16)) is None
    assert PeerMemory.probe(dict(info, pid=2**22 + 12345)) is None  # no such process
    assert PeerMemory.probe({"pid": "x"}) is None and PeerMemory.probe(None) is None


def test_bad_plan_payload_is_refused_and_the_stream_stays_usable() -> None:
    from vllm_pd.protocol.layer_plan import PlanFrame

    with pytest.raises(TransferCorrupted):
        PlanFrame.parse(b"\0" * 10, 1)
    with pytest.raises(TransferCorrupted):
        PlanFrame.parse(struct.pack("<QII", 1, 1000, 2) + struct.pack("<2I", 0, 1) + bytes(8), 1)
    plan = PlanFrame.parse(struct.pack("<QII", 64, 1500, 1) + struct.pack("<I", 3) + struct.pack("<2Q", 7, 9), 2)
    assert (plan.progress, plan.timeout_s, plan.layers, plan.addresses) == (64, 1.5, (3,), ((7, 9),))
