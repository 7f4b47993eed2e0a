"""What is particular to the shm transport: corruption inside the ring, a
sender killed mid-stream, and /dev/shm left clean."""

from __future__ import annotations

import os
import signal
import socket
import time

import numpy as np
import pytest
import torch
from tests.transport_harness import make_regions, spawn_peer, started

from vllm_pd.connector.exceptions import ConfigError, TransferCorrupted
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.framing import Checksum, Frame, Kind
from vllm_pd.connector.transport.shm import FLAG_TRAILER, SEGMENT_PREFIX, SHM_DIR, ShmChannel
from vllm_pd.connector.transport.wire import Wire


def _segments(pid: int | None = None) -> set[str]:
    prefix = SEGMENT_PREFIX + (f"{pid}-" if pid is not None else "")
    return {n for n in os.listdir(SHM_DIR) if n.startswith(prefix)}


def test_blocks_larger_than_a_slot_and_many_slot_wraps() -> None:
    src = make_regions(2, 32, seed=4)
    dst = make_regions(2, 32, seed=None)
    opts = dict(slots=2, slot_nbytes=4096 * 3)  # 16 KiB blocks over 12 KiB slots
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
    a, _, a_ep = started("shm", src, checksum=checksum)
    b, b_sink, b_ep = started("shm", dst, checksum=checksum)
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
    t, sink, ep = started("shm", regions)
    sink.hold.clear()
    peer, _ = spawn_peer("shm", num_layers=1, num_blocks=512, hold=False, push_to=ep,
                         slots=4, slot_nbytes=256 << 10)
    try:
        assert sink.entered.wait(30)
        time.sleep(0.3)
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        sink.hold.set()
        (batch, ok), = sink.wait_landed(1, timeout=10)
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
    opts = dict(slots=4, slot_nbytes=8192)  # one 8 KiB block per slot
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
    monkeypatch.setattr(Wire, "send_frame",
                        lambda self, frame: None if frame.kind is Kind.CREDIT else real(self, frame))
    src = make_regions(1, 16, seed=7)
    dst = make_regions(1, 16, seed=None)
    opts = dict(slots=2, slot_nbytes=8192)
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
        Wire(left).send_frames([Frame(Kind.READY, flags=FLAG_TRAILER, ids=(1,), lengths=(4096,),
                                      payload=bytes(8))])
        with pytest.raises(TransferCorrupted, match="expected slot 0"):
            receiver.recv_blocks(Wire(right), push, [memoryview(np.zeros_like(data))])
    finally:
        left.close()
        right.close()
        sender.close()
        receiver.close()
