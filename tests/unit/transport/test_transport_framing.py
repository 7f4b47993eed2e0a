"""The wire format: round trips and rejection of malformed headers."""

from __future__ import annotations

import socket
import struct
import threading

import pytest

from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.checksum import block_digest, parse_checksum
from vllm_pd.connector.transport.frame_io import FrameReader, read_frame, recv_exact, send_buffers
from vllm_pd.errors import ConfigError, PeerClosed, TransferCorrupted
from vllm_pd.protocol.frames import (
    HEADER_NBYTES,
    MAGIC,
    MAX_COUNT,
    Checksum,
    Frame,
    Kind,
    Status,
    decode_frame,
    decode_header,
)


@pytest.mark.parametrize(
    "frame",
    [
        Frame(Kind.HELLO, payload=b'{"endpoint":"tcp://h:1"}'),
        Frame(
            Kind.PUSH,
            req_id=2**63 + 5,
            checksum=Checksum.BLAKE3,
            flags=1,
            layer=31,
            block_nbytes=262144,
            transfer_id="req-ü-1",
            ids=(0, 1, 7),
            lengths=(262144,) * 3,
        ),
        Frame(Kind.FETCH, req_id=9, layer=3, block_nbytes=4096, transfer_id="t", ids=(5, 2**32 - 1)),
        Frame(Kind.ACK, req_id=9, status=Status.REJECTED, payload=b"no such transfer"),
        Frame(Kind.DATA, req_id=1, checksum=Checksum.CRC32, block_nbytes=8, ids=(1,), lengths=(8,)),
        Frame(Kind.REPLY, req_id=3, flags=1, payload=b""),
    ],
)
def test_round_trip(frame: Frame) -> None:
    assert decode_frame(frame.encode()) == frame


def test_data_nbytes_counts_blocks_and_trailer() -> None:
    f = Frame(Kind.PUSH, ids=(0, 1), lengths=(100, 100), block_nbytes=100)
    assert f.data_nbytes == 200 + 2 * 8
    assert Frame(Kind.FETCH, ids=(0, 1)).data_nbytes == 0


def _header(**over) -> bytes:
    fields = dict(
        magic=MAGIC,
        kind=int(Kind.ACK),
        status=0,
        checksum=0,
        flags=0,
        req_id=1,
        layer=0,
        count=0,
        bnb=0,
        transfer_id_len=0,
        payload=0,
    )
    fields.update(over)
    return struct.pack("<4sBBBBQIIQII", *fields.values())


@pytest.mark.parametrize(
    "bad, match",
    [
        (dict(magic=b"HTTP"), "bad magic"),
        (dict(kind=99), "bad header field"),
        (dict(status=42), "bad header field"),
        (dict(checksum=7), "bad header field"),
        (dict(count=MAX_COUNT + 1), "out of bounds"),
        (dict(transfer_id_len=5000), "out of bounds"),
        (dict(bnb=1 << 40), "out of bounds"),
    ],
)
def test_bad_header_rejected(bad: dict, match: str) -> None:
    with pytest.raises(TransferCorrupted, match=match):
        decode_header(_header(**bad))


def test_short_header_and_wrong_variable_part_rejected() -> None:
    with pytest.raises(TransferCorrupted):
        decode_header(_header()[:-1])
    enc = Frame(Kind.FETCH, transfer_id="abc", ids=(1, 2)).encode()
    with pytest.raises(TransferCorrupted, match="variable part"):
        decode_frame(enc[:-1])
    with pytest.raises(TransferCorrupted, match="utf-8"):
        decode_frame(enc[:HEADER_NBYTES] + b"\xff\xfe\xfd" + enc[HEADER_NBYTES + 3 :])


def test_send_buffers_many_views_and_read_frame_over_a_socket() -> None:
    a, b = socket.socketpair()
    try:
        frame = Frame(Kind.PUSH, transfer_id="x", ids=tuple(range(1500)), lengths=(3,) * 1500, block_nbytes=3)
        views = [memoryview(bytes([i % 256] * 3)) for i in range(1500)]  # > IOV_MAX buffers
        t = threading.Thread(target=send_buffers, args=(a, [frame.encode(), *views]))
        t.start()
        got = read_frame(b)
        body = recv_exact(b, 3 * 1500)
        t.join()
        assert got == frame
        assert bytes(body) == b"".join(bytes(v) for v in views)
        a.close()
        with pytest.raises(PeerClosed):
            read_frame(b)
    finally:
        b.close()


def test_checksums_detect_a_flipped_byte() -> None:
    data = bytearray(range(256)) * 64
    for c in (Checksum.CRC32, Checksum.BLAKE3, Checksum.CRC32C):
        d = block_digest(c, memoryview(data))
        data[1000] ^= 1
        assert block_digest(c, memoryview(data)) != d
        data[1000] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        parse_checksum("md5")


def test_create_transport_names_unknown_name_and_option() -> None:
    with pytest.raises(ConfigError, match="'rdma'"):
        create_transport("rdma")
    with pytest.raises(ConfigError, match="checksum"):
        create_transport("tcp", checksum="md5")
    with pytest.raises(ConfigError, match="bogus"):
        create_transport("tcp", bogus=1)


def _frames_then_bytes() -> tuple[list[Frame], bytes]:
    frames = [
        Frame(Kind.PUSH, req_id=1, block_nbytes=4, transfer_id="t", ids=(0, 1), lengths=(4, 4)),
        Frame(Kind.READY, ids=(0,), lengths=(8,)),
        Frame(Kind.NOTIFY, req_id=2, payload=bytes(range(256)) * 300),  # > the reader's buffer
        Frame(Kind.ACK, req_id=3),
    ]
    return frames, bytes(range(200)) * 50  # 10000 bytes after the frames (tcp: block bytes)


@pytest.mark.parametrize("read_ahead", [True, False])
@pytest.mark.parametrize("chunk", [1, 7, 1 << 20])
def test_frame_reader_frames_and_following_bytes_in_any_split(chunk: int, read_ahead: bool) -> None:
    frames, tail = _frames_then_bytes()
    stream = (
        b"".join(f.encode() for f in frames[:2]) + tail[:100] + b"".join(f.encode() for f in frames[2:]) + tail[100:]
    )
    left, right = socket.socketpair()
    try:

        def write() -> None:
            for i in range(0, len(stream), chunk):
                left.sendall(stream[i : i + chunk])
            left.close()

        writer = threading.Thread(target=write)
        writer.start()
        reader = FrameReader(right, buffer_nbytes=4096, read_ahead=read_ahead, spin_s=0.001)
        assert [reader.read_frame(), reader.read_frame()] == frames[:2]
        head = bytearray(60)
        reader.read_into(memoryview(head))  # bytes already buffered behind the frames
        assert bytes(head) == tail[:60]
        reader.discard(40)
        assert [reader.read_frame(), reader.read_frame()] == frames[2:]
        reader.discard(5000)
        rest = bytearray(len(tail) - 5100)
        reader.read_into(memoryview(rest))
        assert bytes(rest) == tail[5100:]
        with pytest.raises(PeerClosed):
            reader.read_frame()
        writer.join(10)
    finally:
        left.close()
        right.close()


def test_one_flag_namespace() -> None:
    """Every frame flag is defined in protocol/frames.py and listed once, under the kind it belongs to;
    within a kind each is one bit of its own (across kinds bits repeat: a bit means something for one kind)."""
    from vllm_pd.protocol import frames

    defined = [value for name, value in vars(frames).items() if name.startswith("FLAG_")]
    listed = [flag for kind_flags in frames.KIND_FLAGS.values() for flag in kind_flags]
    assert sorted(listed) == sorted(defined)
    for kind, kind_flags in frames.KIND_FLAGS.items():
        assert all(f > 0 and f & (f - 1) == 0 for f in kind_flags), kind
        assert len(set(kind_flags)) == len(kind_flags), kind
    # a link reads FLAG_QUIET off every request it has out: no FETCH flag may be it
    assert frames.FLAG_QUIET not in frames.KIND_FLAGS[frames.Kind.FETCH]
