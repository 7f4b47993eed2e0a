"""A bounded KV plane: oversized or malformed frames, peers that ask without reading, silent
connections and pushing floods cost the peer its connection or its share, never the process's
memory or the other peers'; a peer that vanishes mid-transfer leaves nothing behind."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time

import pytest

from tests.support.transport_harness import make_regions, raw_dial, spawn_peer, started
from vllm_pd.connector.transport import serve_session, stream
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.transport.frame_io import send_buffers
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.protocol.auth_handshake import DeploymentSecret
from vllm_pd.protocol.frames import MAGIC, MAX_DATA_NBYTES, Checksum, Frame, Kind

SECRET = DeploymentSecret(b"bounds-test-secret-0123456789abc", "test")


def _wait(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _closed(s: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the peer closed ``s`` within ``timeout``."""
    s.settimeout(timeout)
    try:
        while s.recv(1 << 16):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


@pytest.fixture
def receiver():
    regions = make_regions(1, 64, seed=1)
    t, sink, ep = started("tcp", regions)
    t.allow_fetch("held", list(range(64)))
    yield t, sink, ep, regions
    t.close()


def test_an_oversized_frame_closes_the_connection_with_a_log_line(receiver, caplog) -> None:
    t, sink, ep, _ = receiver
    s = raw_dial(ep)
    half = MAX_DATA_NBYTES // 2 + 1
    send_buffers(
        s,
        [
            Frame(
                Kind.PUSH,
                req_id=1,
                checksum=Checksum.CRC32,
                layer=0,
                block_nbytes=half,
                transfer_id="x",
                ids=(0, 1),
                lengths=(half, half),
            ).encode()
        ],
    )
    assert _closed(s)
    assert _wait(lambda: t.broken_connections == 1)
    assert "oversized PUSH frame" in caplog.text and sink.landed_calls == []
    t.notify(ep, b"still serving", timeout=10).result(timeout=15)  # the others' connections are fine


def test_a_malformed_frame_closes_the_connection(receiver, caplog) -> None:
    t, sink, ep, _ = receiver
    s = raw_dial(ep)
    s.sendall(struct.pack("<4sBBBBQIIQII", MAGIC, 99, 0, 0, 0, 1, 0, 0, 0, 0, 0))  # no such frame kind
    assert _closed(s)
    assert _wait(lambda: t.broken_connections == 1)
    assert "bad header field" in caplog.text and sink.notified == []


def test_a_peer_that_never_reads_its_answers_is_cut_off(receiver, monkeypatch) -> None:
    monkeypatch.setattr(serve_session, "MAX_QUEUED_JOBS", 16)
    t, _, ep, regions = receiver
    s = raw_dial(ep)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    fetch = Frame(
        Kind.FETCH, req_id=1, layer=0, block_nbytes=regions[0].block_nbytes, transfer_id="held", ids=tuple(range(64))
    )
    try:
        for _ in range(200):  # 200 x 512 KiB asked for, nothing read
            s.sendall(fetch.encode())
    except OSError:
        pass  # already cut off
    assert _wait(lambda: t.broken_connections == 1)
    assert _wait(lambda: not t._sessions)
    s.close()


def test_connections_that_never_authenticate_cannot_pile_up(monkeypatch) -> None:
    monkeypatch.setattr(stream, "MAX_PENDING_HANDSHAKES", 8)
    t, sink, ep = started("tcp", make_regions(1, 4, seed=1), secret=SECRET)
    host, port = ep.removeprefix("tcp://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(12)]
    try:
        # the oldest were cut at once, not after the handshake's timeout (5 s)
        assert _closed(silent[0], timeout=4) and _closed(silent[3], timeout=4)
        assert _wait(lambda: len(t._handshaking) <= 8)
        member, _, _ = started("tcp", make_regions(1, 4, seed=None), secret=SECRET)
        member.notify(ep, b"a member gets through", timeout=10).result(timeout=15)
        member.close()
        assert sink.notified == [b"a member gets through"]
    finally:
        for s in silent:
            s.close()
        t.close()


def test_each_cut_takes_a_different_connection_however_slow_the_handshake_threads(monkeypatch) -> None:
    """The bound holds on a busy host: a cut connection leaves the count at once, not when its
    handshake thread next runs (here it never does in time: the cut is only recorded)."""
    monkeypatch.setattr(stream, "MAX_PENDING_HANDSHAKES", 8)
    cut: list[socket.socket] = []
    monkeypatch.setattr(stream, "_cut", cut.append)
    t, _, ep = started("tcp", make_regions(1, 4, seed=1), secret=SECRET)
    host, port = ep.removeprefix("tcp://").rsplit(":", 1)
    silent = [socket.create_connection((host, int(port))) for _ in range(12)]
    try:
        assert _wait(lambda: len(cut) == 4)
        assert len(set(cut)) == 4  # four connections cut, not the oldest four times
        assert len(t._handshaking) == 8
    finally:
        for s in silent:
            s.close()
        t.close()


def test_pushes_carry_who_sent_them(receiver) -> None:
    t, sink, ep, regions = receiver
    pusher, _, pusher_ep = started("tcp", make_regions(1, 4, seed=2))
    try:
        pusher.push(ep, BlockBatch("t", 0, (0,), regions[0].block_nbytes), [0], timeout=10).result(timeout=15)
        [(batch, ok)] = sink.wait_landed(1)
        assert ok and batch.peer == pusher_ep
    finally:
        pusher.close()


def test_a_flooding_peer_cannot_take_the_others_staging() -> None:
    staging = PushStaging(capacity_bytes=8 * 100, ttl_s=60, peer_capacity_bytes=4 * 100)
    flood = [staging.destinations(BlockBatch(f"f{i}", 0, (0, 1), 100, peer="tcp://flooder:1")) for i in range(4)]
    assert [d is not None for d in flood] == [True, True, False, False]  # its share: 4 blocks
    assert staging.peer_bytes("tcp://flooder:1") == 400
    assert staging.destinations(BlockBatch("other", 0, (0, 1, 2, 3), 100, peer="tcp://prefill:1")) is not None
    # and no peer writes into another peer's transfer
    assert staging.destinations(BlockBatch("other", 1, (0,), 100, peer="tcp://flooder:1")) is None
    staging.drop("f0")
    assert staging.peer_bytes("tcp://flooder:1") == 200 and staging.used_bytes == 600


class _StagingSink:
    """The decode side's sink: pushes land in PushStaging; ``hold`` stalls the reader first."""

    def __init__(self, staging: PushStaging) -> None:
        self.staging, self.hold, self.entered = staging, threading.Event(), threading.Event()
        self.hold.set()

    def destinations(self, batch: BlockBatch):
        self.entered.set()
        self.hold.wait()
        return self.staging.destinations(batch)

    def landed(self, batch: BlockBatch, ok: bool) -> None:
        self.staging.landed(batch, ok)

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        return None


def test_a_pusher_that_vanishes_mid_transfer_leaves_nothing() -> None:
    from vllm_pd.connector.transport import create_transport

    staging = PushStaging(capacity_bytes=64 << 20, ttl_s=0.5)
    sink = _StagingSink(staging)
    sink.hold.clear()
    t = create_transport("tcp")
    regions = make_regions(1, 4, seed=None)
    t.register_regions(regions)
    ep = t.start(sink, "127.0.0.1", 0)
    peer, _ = spawn_peer("tcp", num_layers=1, num_blocks=4096, hold=False, push_to=ep)  # 32 MiB, one batch
    try:
        assert sink.entered.wait(30)
        time.sleep(0.3)  # the pusher fills the socket and blocks
        os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
        sink.hold.set()
        assert _wait(lambda: not t._sessions)  # its session ended
        runs, missing = staging.landed_runs("from-peer", 0, [0], regions[0].block_nbytes)
        assert (runs, missing) == ([], [0])  # nothing of it counts as landed
        time.sleep(0.6)
        staging.expire()
        assert staging.used_bytes == 0 and len(staging) == 0  # its bytes went with its lease
    finally:
        peer.kill()
        t.close()


def test_a_fetcher_that_vanishes_mid_transfer_does_not_hold_the_grant(receiver) -> None:
    t, _, ep, regions = receiver
    s = raw_dial(ep)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    for i in range(40):  # 20 MiB asked for, not read: the serving thread blocks mid-DATA
        s.sendall(
            Frame(
                Kind.FETCH,
                req_id=i + 1,
                layer=0,
                block_nbytes=regions[0].block_nbytes,
                transfer_id="held",
                ids=tuple(range(64)),
            ).encode()
        )
    time.sleep(0.5)
    s.close()  # the fetcher is gone (its unread bytes reset the connection)
    t0 = time.monotonic()
    t.allow_fetch("held", None)  # returns once nothing of it is being sent
    assert time.monotonic() - t0 < 2.0  # not the revoke_wait cut-off (5 s)
    assert _wait(lambda: not t._sessions)
