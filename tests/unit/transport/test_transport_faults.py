"""Failures are failed futures, never hangs or silently wrong KV: corrupt and
truncated streams (raw sockets speaking the framing), a peer killed with -9,
timeouts, close, unreachable peers."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.support.transport_harness import RawFetchServer, RecordingSink, make_regions, raw_dial, spawn_peer, started
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.checksum import block_digest
from vllm_pd.connector.transport.frame_io import read_frame, send_buffers
from vllm_pd.connector.transport.wire import Wire
from vllm_pd.errors import (
    PeerClosed,
    PeerUnreachable,
    TransferCorrupted,
    TransferTimeout,
)
from vllm_pd.protocol.frames import Checksum, Frame, Kind, Status
from vllm_pd.vllm_server import free_port


@pytest.fixture
def receiver():
    regions = make_regions(2, 16, seed=None)
    t, sink, ep = started("tcp", regions)
    yield t, sink, ep, regions
    t.close()


def _raw_push(sock, nbytes: int, blocks: list[bytes], digests_of: list[bytes], transfer_id: str = "raw") -> Frame:
    frame = Frame(
        Kind.PUSH,
        req_id=7,
        checksum=Checksum.BLAKE3,
        layer=1,
        block_nbytes=nbytes,
        transfer_id=transfer_id,
        ids=tuple(range(len(blocks))),
        lengths=tuple(len(b) for b in blocks),
    )
    trailer = b"".join(block_digest(Checksum.BLAKE3, memoryview(d)) for d in digests_of)
    send_buffers(sock, [frame.encode(), *blocks, trailer])
    return frame


def test_flipped_byte_in_push_is_detected(receiver) -> None:
    _, sink, ep, regions = receiver
    nbytes = regions[1].block_nbytes
    good = [os.urandom(nbytes) for _ in range(3)]
    bad = list(good)
    bad[1] = bad[1][:100] + bytes([bad[1][100] ^ 0x10]) + bad[1][101:]
    with raw_dial(ep) as s:
        _raw_push(s, nbytes, bad, good)
        ack = read_frame(s)
        assert ack.kind is Kind.ACK and ack.status is Status.CORRUPTED and b"checksum" in ack.payload
        ((batch, ok),) = sink.wait_landed(1)
        assert not ok and batch.transfer_id == "raw"
        # the stream stays in sync: a correct push on the same connection lands
        _raw_push(s, nbytes, good, good, transfer_id="raw2")
        assert read_frame(s).status is Status.OK
    assert sink.wait_landed(2)[1][1] is True
    assert bytes(regions[1].tensor[1].view(-1).view(torch.uint8).numpy()) == good[1]


def test_wrong_block_length_is_refused_before_landing(receiver) -> None:
    _, sink, ep, regions = receiver
    nbytes = regions[1].block_nbytes
    short = os.urandom(nbytes - 2)
    with raw_dial(ep) as s:
        _raw_push(s, nbytes, [short], [short])  # header says nbytes, block is shorter
        ack = read_frame(s)
        assert ack.status is Status.CORRUPTED and b"lengths" in ack.payload
        _raw_push(s, nbytes - 2, [short], [short])  # consistent, but not the sink's block size
        ack = read_frame(s)
        assert ack.status is Status.REJECTED and b"does not fit" in ack.payload
    assert not regions[1].tensor.any()
    assert sink.landed_calls == []


def test_truncated_push_fails_the_batch(receiver) -> None:
    _, sink, ep, regions = receiver
    nbytes = regions[1].block_nbytes
    frame = Frame(
        Kind.PUSH,
        req_id=1,
        checksum=Checksum.BLAKE3,
        layer=1,
        block_nbytes=nbytes,
        transfer_id="cut",
        ids=(0, 1),
        lengths=(nbytes, nbytes),
    )
    with raw_dial(ep) as s:
        send_buffers(s, [frame.encode(), os.urandom(nbytes + nbytes // 2)])
    ((batch, ok),) = sink.wait_landed(1)
    assert batch.transfer_id == "cut" and not ok


def test_corrupt_and_truncated_fetch_fail() -> None:
    regions = make_regions(1, 4, seed=None)
    t, _, _ = started("tcp", regions)
    try:
        nbytes = regions[0].block_nbytes
        good = os.urandom(nbytes)
        flipped = bytes([good[0] ^ 1]) + good[1:]
        srv = RawFetchServer([flipped], [good])
        with pytest.raises(TransferCorrupted, match="checksum"):
            t.fetch(srv.endpoint, "r", 0, [0], [2], timeout=10).result(10)
        srv.close()
        srv = RawFetchServer([good], [good], truncate=True)
        with pytest.raises(PeerClosed):
            t.fetch(srv.endpoint, "r", 0, [0], [2], timeout=10).result(10)
        srv.close()
        srv = RawFetchServer([good[:-1]], [good[:-1]])
        with pytest.raises(TransferCorrupted, match="lengths"):
            t.fetch(srv.endpoint, "r", 0, [0], [2], timeout=10).result(10)
        srv.close()
        srv = RawFetchServer([good], [good])
        t.fetch(srv.endpoint, "r", 0, [0], [2], timeout=10).result(10)
        assert bytes(regions[0].tensor[2].view(-1).view(torch.uint8).numpy()) == good
        srv.close()
    finally:
        t.close()


@pytest.mark.parametrize("name", ["tcp", "shm", "nixl"])
def test_peer_killed_mid_transfer_fails_with_peer_closed(name: str) -> None:
    # The peer's sink never hands out destinations, so a 32 MiB push fills both
    # socket buffers and blocks mid-send (nixl: waits for the peer's READ); then the
    # peer is SIGKILLed.
    peer, peer_ep = spawn_peer(name, num_layers=1, num_blocks=256, hold=True)
    regions = make_regions(1, 256, seed=2)
    t, _, _ = started(name, regions)
    try:
        nbytes = regions[0].block_nbytes
        ids = list(range(256))
        big = t.push(peer_ep, BlockBatch("big", 0, tuple(ids), nbytes), ids, timeout=60)
        behind = t.push(peer_ep, BlockBatch("behind", 0, (0,), nbytes), [0], timeout=60)
        time.sleep(0.5)
        assert not big.done()
        os.kill(peer.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for f in (big, behind):
            with pytest.raises(PeerClosed):
                f.result(10)
        assert time.monotonic() - t0 < 5
        # and a new request to the dead endpoint fails fast instead of hanging
        with pytest.raises((PeerUnreachable, PeerClosed)):
            t.fetch(peer_ep, "granted", 0, [0], [0], timeout=10).result(10)
    finally:
        peer.kill()
        peer.join(10)
        t.close()


@pytest.mark.parametrize("name", ["tcp", "nixl"])
def test_fetch_from_peer_process_then_kill(name: str) -> None:
    peer, peer_ep = spawn_peer(name, num_layers=2, num_blocks=8, hold=False)
    regions = make_regions(2, 8, seed=None)
    t, _, _ = started(name, regions)
    try:
        t.fetch(peer_ep, "granted", 1, [0, 1], [0, 1], timeout=10).result(10)
        assert torch.equal(regions[1].tensor[:2], make_regions(2, 8, seed=1)[1].tensor[:2])
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        with pytest.raises((PeerClosed, PeerUnreachable)):
            t.notify(peer_ep, b"x", timeout=10).result(10)
    finally:
        peer.kill()
        t.close()


def test_timeouts(receiver) -> None:
    b, sink, ep, regions = receiver
    a, _, _ = started("tcp", make_regions(2, 16, seed=3))
    try:
        nbytes = regions[0].block_nbytes
        sink.notify_delay = 1.0
        t0 = time.monotonic()
        with pytest.raises(TransferTimeout):
            a.notify(ep, b"slow", timeout=0.2).result(5)
        assert time.monotonic() - t0 < 0.9
        sink.hold.clear()
        with pytest.raises(TransferTimeout):
            a.push(ep, BlockBatch("held", 0, (0,), nbytes), [0], timeout=0.3).result(5)
        sink.hold.set()
        # a fetch to an endpoint that accepts but never answers
        with pytest.raises(TransferTimeout):
            mute = socket.create_server(("127.0.0.1", 0))
            a.fetch(f"tcp://127.0.0.1:{mute.getsockname()[1]}", "r", 0, [0], [0], timeout=0.5).result(8)
        mute.close()
    finally:
        a.close()


def test_close_fails_pending_futures_and_unreachable_peer(receiver) -> None:
    b, sink, ep, regions = receiver
    a, _, _ = started("tcp", make_regions(2, 16, seed=3))
    nbytes = regions[0].block_nbytes
    sink.hold.clear()
    fut = a.push(ep, BlockBatch("pending", 0, (0,), nbytes), [0], timeout=30)
    assert sink.entered.wait(5)
    a.close()
    with pytest.raises(PeerClosed):
        fut.result(5)
    with pytest.raises(PeerClosed):
        a.notify(ep, b"after close", timeout=1).result(1)
    sink.hold.set()
    c, _, _ = started("tcp", make_regions(1, 1))
    try:
        with pytest.raises(PeerUnreachable):
            c.notify(f"tcp://127.0.0.1:{free_port()}", b"x", timeout=5).result(5)
    finally:
        c.close()


def test_revoke_cuts_a_stalled_reader_instead_of_hanging() -> None:
    # A reader that requests 80 MiB and never reads: the serving send blocks once
    # the socket buffers are full; revoke must give up waiting and cut it.
    regions = make_regions(1, 80, seed=None, block_shape=(2, 256, 1024))  # 1 MiB blocks
    t = create_transport("tcp", revoke_wait=0.3)
    t.register_regions(regions)
    ep = t.start(RecordingSink(regions), "127.0.0.1", 0)
    try:
        t.allow_fetch("big", list(range(80)))
        with raw_dial(ep) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
            send_buffers(
                s,
                [
                    Frame(
                        Kind.FETCH,
                        req_id=1,
                        layer=0,
                        block_nbytes=regions[0].block_nbytes,
                        transfer_id="big",
                        ids=tuple(range(80)),
                    ).encode()
                ],
            )
            time.sleep(0.5)
            t0 = time.monotonic()
            t.allow_fetch("big", None)
            assert time.monotonic() - t0 < 3
            s.settimeout(5)
            got = 0
            try:
                while chunk := s.recv(1 << 20):
                    got += len(chunk)
            except ConnectionResetError:
                pass
            assert got < 80 << 20  # cut (EOF or reset), not served to the end
    finally:
        t.close()


def test_a_control_frame_stalled_past_its_deadline_fails_alone(receiver, monkeypatch) -> None:
    """A NOTIFY whose sending thread is held up past the deadline (a starved core: seen on the TP=2
    e2e pair) times out by itself; the connection and the fetch queued behind it carry on."""
    b, sink, ep, regions = receiver  # b's blocks are zeros
    mine = make_regions(2, 16, seed=3)
    a, _, _ = started("tcp", mine)
    try:
        b.allow_fetch("held", [3, 5])
        a.fetch(ep, "held", 1, [3, 5], [0, 1], timeout=5).result(5)  # connected
        channel = a._link(ep).channel
        send_frame = Wire.send_frame

        def stalled(wire: Wire, frame: Frame) -> None:
            if frame.kind is Kind.NOTIFY:
                time.sleep(0.8)
            send_frame(wire, frame)

        monkeypatch.setattr(Wire, "send_frame", stalled)
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(a.notify, ep, b"late", 0.2)
            time.sleep(0.1)  # the NOTIFY's thread holds the link's send lock now
            assert mine[0].tensor[2].any()
            fetch = a.fetch(ep, "held", 0, [3, 5], [2, 3], timeout=5)
            with pytest.raises(TransferTimeout):
                sent.result(5).result(5)
        fetch.result(5)
        assert not mine[0].tensor[2].any() and not mine[0].tensor[3].any()
        assert a._link(ep).channel is channel, "the connection was torn down for a control frame"
    finally:
        a.close()
