"""Wire format shared by the stream transports (tcp, shm).

Every message is a fixed 40-byte header, a variable part whose size the header
gives, and - for messages that carry blocks (PUSH, DATA) - the block bytes
followed by a trailer of one 8-byte digest per block::

    header   magic "VPD5", kind, status, checksum kind, flags, request id, layer,
             block count, block_nbytes, transfer-id length, payload length
    variable transfer id (utf-8) | ids (u32 x count) | lengths (u64 x count,
             data messages only) | payload (a FETCH of parts of blocks: the parts'
             offsets and lengths, u64 x count each)
    blocks   count x block_nbytes bytes                (data messages only)
    trailer  count x 8-byte digest                     (data messages only)

The digests trail the bytes so that each side hashes a block right next to the
copy that moves it (the block is still in cache), and the lengths lead them so
the receiver rejects a wrong-sized block before writing a byte of it.

On a connection that authenticated with the deployment secret (and runs without TLS),
every frame's header and variable part are followed by a 16-byte seal (protocol/auth_handshake.py,
``StreamSeal``): a frame injected, replayed or altered on the path fails it and ends the
connection. Its blocks are checked with a key of the session instead (transport/checksum.py).

The flags (one namespace, :data:`KIND_FLAGS`: each bit means something for one kind of frame),
the checksum kinds and the FETCH payload of parts of blocks are here too. Reading and writing
frames on a socket: transport/frame_io.py; the HELLO payload: hello_frame.py; the PLAN payload:
layer_plan.py; NIXL's payloads: nixl_messages.py.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

from vllm_pd.errors import TransferCorrupted
from vllm_pd.protocol.auth_handshake import HANDSHAKE_MAGIC

# VPD5: PLAN (a step's layers read from the sender's memory as each is ready). VPD4: shm ring
# credits counted in shared memory (CREDIT = a bare wake-up, ACK carries no
# slots). VPD3: quiet PUSHes (answered only on failure). VPD2: crc32c checksum kind, shm trailer
# READY carrying the last slot, ACK carrying credits. An older peer fails the handshake with
# "bad magic" instead of stalling on an answer it will never send.
MAGIC = b"VPD5"
MAX_COUNT = 1 << 20
MAX_TRANSFER_ID = 1024
MAX_PAYLOAD = 16 << 20
MAX_BLOCK_NBYTES = 1 << 32
# block bytes one PUSH / DATA frame may carry (a layer of a ~1M-token request at 4 KiB per token):
# a larger announcement is a broken or hostile peer, and its connection is closed
MAX_DATA_NBYTES = 4 << 30

_HEADER = struct.Struct("<4sBBBBQIIQII")
HEADER_NBYTES = _HEADER.size

# One digest per block, in the trailer of a data message (and of shm's last READY).
DIGEST_NBYTES = 8


class Checksum(IntEnum):
    """The header's checksum kind: the algorithm of the frame's block digests (transport/checksum.py)."""

    NONE = 0
    CRC32 = 1
    BLAKE3 = 2
    CRC32C = 3
    BLAKE3_KEYED = 4  # keyed by the connection's session; set by a deployment secret (auth_handshake.py)


# The header's flags: one namespace for every kind of frame. A bit means something for one kind
# only (KIND_FLAGS), so bits of different kinds may share a value; within a kind they never do.
FLAG_LAST = 1  # PUSH: BlockBatch.last
FLAG_QUIET = 2  # PUSH: answer only a failure; the next answer on the connection covers it
FLAG_CANCEL = 4  # FETCH (nixl): withdraw the FETCH with this req_id
FLAG_HAS_REPLY = 1  # REPLY: the sink returned bytes (not None)
FLAG_TRAILER = 1  # READY (shm): the batch's last; payload = the digests (ids: its last slot, if any)


class Kind(IntEnum):
    HELLO = 1  # first message of a connection; payload = the dialler's endpoint
    PUSH = 2  # blocks for the peer's sink; ids = positions
    FETCH = 3  # read request; ids = the server's block ids
    NOTIFY = 4  # control message; payload = message
    ACK = 5  # status of a PUSH, or a refused FETCH; payload = error text
    DATA = 6  # blocks answering a FETCH
    REPLY = 7  # answer to a NOTIFY; payload = reply
    CREDIT = 8  # shm: wake-up of a sender waiting for ring slots (the count is in the ring)
    READY = 9  # shm: ids = ring slots the sender has filled (sizes in lengths)
    # blocks of several layers the peer reads from the sender's memory as each layer is
    # ready (transport/layer_plan.py); ids = positions, payload = where (layers, addresses)
    PLAN = 10


# the flags each kind of frame may carry. FLAG_CANCEL is a bit of its own (4), not 1: a link reads
# FLAG_QUIET off every request it has out, a FETCH's too (transport/peer_link.py's PendingOp.quiet)
KIND_FLAGS: dict[Kind, tuple[int, ...]] = {
    Kind.PUSH: (FLAG_LAST, FLAG_QUIET),
    Kind.FETCH: (FLAG_CANCEL,),
    Kind.REPLY: (FLAG_HAS_REPLY,),
    Kind.READY: (FLAG_TRAILER,),
}

DATA_KINDS = frozenset({Kind.PUSH, Kind.DATA})
LENGTH_KINDS = frozenset({Kind.PUSH, Kind.DATA, Kind.READY})


def encode_fetch_spans(src_offsets: Sequence[int], lengths: Sequence[int]) -> bytes:
    """A FETCH frame's payload asking for parts of blocks: per id, where its part starts and
    how long it is (the requester keeps where each lands)."""
    n = len(lengths)
    return struct.pack(f"<{2 * n}Q", *src_offsets, *lengths)


def decode_fetch_spans(payload: bytes, count: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(offsets, lengths) of a FETCH payload for ``count`` ids; TransferCorrupted if malformed."""
    if len(payload) != 16 * count:
        raise TransferCorrupted(f"FETCH payload of {len(payload)} bytes for {count} spans")
    values = struct.unpack(f"<{2 * count}Q", payload)
    return values[:count], values[count:]


class Status(IntEnum):
    OK = 0
    REJECTED = 1
    CORRUPTED = 2
    ERROR = 3


@dataclass(frozen=True)
class Frame:
    """One message without its block bytes and trailer."""

    kind: Kind
    req_id: int = 0
    status: Status = Status.OK
    checksum: Checksum = Checksum.NONE
    flags: int = 0
    layer: int = 0
    block_nbytes: int = 0
    transfer_id: str = ""
    ids: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()
    payload: bytes = b""

    @property
    def count(self) -> int:
        return len(self.ids)

    @property
    def data_nbytes(self) -> int:
        """Bytes that follow the frame on the stream (blocks + trailer)."""
        if self.kind not in DATA_KINDS:
            return 0
        return sum(self.lengths) + DIGEST_NBYTES * self.count

    def encode(self) -> bytes:
        encoded_id = self.transfer_id.encode()
        if self.kind in LENGTH_KINDS and len(self.lengths) != len(self.ids):
            raise ValueError("lengths must give one length per id")
        n = len(self.ids)
        parts = [
            _HEADER.pack(
                MAGIC,
                int(self.kind),
                int(self.status),
                int(self.checksum),
                self.flags,
                self.req_id,
                self.layer,
                n,
                self.block_nbytes,
                len(encoded_id),
                len(self.payload),
            ),
            encoded_id,
            struct.pack(f"<{n}I", *self.ids),
        ]
        if self.kind in LENGTH_KINDS:
            parts.append(struct.pack(f"<{n}Q", *self.lengths))
        parts.append(self.payload)
        return b"".join(parts)


@dataclass(frozen=True)
class _HeaderFields:
    kind: Kind
    status: Status
    checksum: Checksum
    flags: int
    req_id: int
    layer: int
    count: int
    block_nbytes: int
    transfer_id_len: int
    payload_len: int

    @property
    def rest_nbytes(self) -> int:
        per_id = 12 if self.kind in LENGTH_KINDS else 4
        return self.transfer_id_len + per_id * self.count + self.payload_len


def decode_header(buf: bytes | bytearray | memoryview) -> _HeaderFields:
    """Parse and validate the fixed header; TransferCorrupted on anything odd."""
    if len(buf) != HEADER_NBYTES:
        raise TransferCorrupted(f"header is {len(buf)} bytes, expected {HEADER_NBYTES}")
    magic, kind, status, checksum, flags, req_id, layer, count, bnb, transfer_id_len, plen = _HEADER.unpack(buf)
    if magic == HANDSHAKE_MAGIC:
        raise TransferCorrupted(
            "the peer opened with an authentication handshake, but this side has no "
            "deployment secret (set VLLM_PD_SECRET or secret_file on both)"
        )
    if magic != MAGIC:
        raise TransferCorrupted(f"bad magic {magic!r} (not a vllm-pd transport stream)")
    try:
        fields = _HeaderFields(
            Kind(kind),
            Status(status),
            Checksum(checksum),
            flags,
            req_id,
            layer,
            count,
            bnb,
            transfer_id_len,
            plen,
        )
    except ValueError as e:
        raise TransferCorrupted(f"bad header field: {e}") from None
    if count > MAX_COUNT or transfer_id_len > MAX_TRANSFER_ID or plen > MAX_PAYLOAD:
        raise TransferCorrupted(f"header out of bounds: count={count} transfer_id_len={transfer_id_len} payload={plen}")
    if bnb > MAX_BLOCK_NBYTES:
        raise TransferCorrupted(f"header out of bounds: block_nbytes={bnb}")
    return fields


def decode_rest(h: _HeaderFields, rest: bytes | bytearray | memoryview) -> Frame:
    """Build the Frame from a decoded header and its variable part."""
    rest = memoryview(rest)
    if len(rest) != h.rest_nbytes:
        raise TransferCorrupted(f"variable part is {len(rest)} bytes, expected {h.rest_nbytes}")
    off = h.transfer_id_len
    try:
        transfer_id = bytes(rest[:off]).decode()
    except UnicodeDecodeError:
        raise TransferCorrupted("transfer id is not utf-8") from None
    ids = struct.unpack_from(f"<{h.count}I", rest, off)
    off += 4 * h.count
    lengths: tuple[int, ...] = ()
    if h.kind in LENGTH_KINDS:
        lengths = struct.unpack_from(f"<{h.count}Q", rest, off)
        off += 8 * h.count
        if h.kind in DATA_KINDS and sum(lengths) > MAX_DATA_NBYTES:
            raise TransferCorrupted(
                f"oversized {h.kind.name} frame: {sum(lengths)} bytes of blocks (at most {MAX_DATA_NBYTES})"
            )
    return Frame(
        kind=h.kind,
        req_id=h.req_id,
        status=h.status,
        checksum=h.checksum,
        flags=h.flags,
        layer=h.layer,
        block_nbytes=h.block_nbytes,
        transfer_id=transfer_id,
        ids=ids,
        lengths=lengths,
        payload=bytes(rest[off:]),
    )


def decode_frame(buf: bytes) -> Frame:
    """Decode a whole encoded frame (tests, tools)."""
    h = decode_header(buf[:HEADER_NBYTES])
    return decode_rest(h, buf[HEADER_NBYTES:])
