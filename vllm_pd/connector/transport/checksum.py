"""Per-block checksums of the stream transports, and copies that compute them on the way.

Each block travels with one 8-byte digest (protocol/frames.py's trailer); the frame names the
algorithm (``frames.Checksum``), so the receiver verifies with the one its sender used. Algorithms:

* ``crc32c`` (default) - CRC32C (Castagnoli) from vllm_pd._C: the SSE4.2 crc32 instruction
  over three interleaved streams, fused with the copy that moves the bytes (the shm ring), so
  copy + checksum costs about one memcpy. Needs the C++ extension: without it ``parse``
  refuses the value at start-up (no Python fallback computes the same value fast enough).
* ``blake3`` - the first 8 bytes of BLAKE3 (cryptographic; ~4-7 GB/s per core here).
* ``crc32`` - zlib.crc32 (~2-5 GB/s).
* ``none``  - no check (the digest slots carry zeros).
* ``blake3_keyed`` - not configured: chosen where a deployment secret is set and TLS is not
  (protocol/auth_handshake.py). The first 8 bytes of BLAKE3 keyed with the connection's block key over the
  block's frame (its hash), the block's index in the frame and its bytes (:class:`BlockCheck`):
  a block changed on the path - by an attacker that can write the stream or the ring, not only
  by a fault - fails its check, and so does a genuine block moved to another frame or position.

Why crc32c is strong enough (docs/benchmarks/transfer.md): it is the integrity check of
iSCSI, SCTP, ext4 metadata and NVMe/TCP; it catches every error burst up to 32 bits and any
other corruption (a stale ring slot, a torn or misplaced block) with probability 1 - 2^-32.
Unkeyed, the digest guards against a broken path, not an attacker: a deployment with a
secret uses ``blake3_keyed`` on the paths an outsider could write.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from vllm_pd.errors import ConfigError, TransferCorrupted
from vllm_pd.protocol.frames import DIGEST_NBYTES, Checksum

# Buffers accepted by the copy/update methods: memoryviews or uint8 numpy arrays, C-contiguous.
Bytes = Any


_NATIVE: Any = None


def _native() -> Any:
    """vllm_pd._C, or ImportError naming why it is not available."""
    global _NATIVE
    if _NATIVE is None:
        from vllm_pd.ops import native  # imports torch first: _C links against libc10

        error = native.load_error()
        if error is not None:
            raise ImportError(error)
        from vllm_pd import _C  # type: ignore[attr-defined]  # the compiled extension has no stub

        _NATIVE = _C
    return _NATIVE


class RunningDigest:
    """One block's digest; this base class is the ``none`` algorithm (zeros)."""

    def copy(self, dst: Bytes, src: Bytes) -> None:
        """Copy ``src`` into ``dst`` (same length) and fold the bytes into the digest."""
        np.copyto(np.frombuffer(dst, dtype=np.uint8), np.frombuffer(src, dtype=np.uint8))
        self.update(src)

    def update(self, data: Bytes) -> None:
        pass

    def digest(self) -> bytes:
        return bytes(DIGEST_NBYTES)


class _Crc32cDigest(RunningDigest):
    def __init__(self, native: Any) -> None:
        self._native, self._value = native, 0

    def copy(self, dst: Bytes, src: Bytes) -> None:
        # One pass: read src, fold into the CRC, write dst (GIL released inside).
        self._value = self._native.copy_crc32c(dst, src, self._value)

    def update(self, data: Bytes) -> None:
        self._value = self._native.crc32c(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(DIGEST_NBYTES, "little")


class _Crc32Digest(RunningDigest):
    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Bytes) -> None:
        self._value = zlib.crc32(data, self._value)

    def digest(self) -> bytes:
        return self._value.to_bytes(DIGEST_NBYTES, "little")


class _Blake3Digest(RunningDigest):
    def __init__(self) -> None:
        # imported here, not at the top: only checksum "blake3" needs it, and a bare GPU machine
        # (benchmarks/gpu_check.py) has none; after the first block this is a sys.modules lookup
        import blake3

        self._hasher = blake3.blake3()

    def update(self, data: Bytes) -> None:
        self._hasher.update(data)  # releases the GIL on large buffers

    def digest(self) -> bytes:
        return self._hasher.digest(DIGEST_NBYTES)


class _KeyedDigest(RunningDigest):
    def __init__(self, key: bytes, context: bytes, index: int) -> None:
        import blake3  # here: a bare GPU machine (benchmarks/gpu_check.py) has none and sets no secret

        self._hasher = blake3.blake3(context, key=key)
        self._hasher.update(_INDEX.pack(index))

    def update(self, data: Bytes) -> None:
        self._hasher.update(data)

    def digest(self) -> bytes:
        return self._hasher.digest(DIGEST_NBYTES)


def parse_checksum(name: str) -> Checksum:
    """The configured algorithm; ConfigError naming the key if unknown or not available."""
    try:
        checksum = Checksum[name.upper()]
    except KeyError:
        raise ConfigError(
            f"checksum: unknown value {name!r} (one of: {', '.join(c.name.lower() for c in Checksum)})"
        ) from None
    if checksum is Checksum.BLAKE3_KEYED:
        raise ConfigError(
            "checksum: 'blake3_keyed' is not configured: a deployment secret (VLLM_PD_SECRET "
            "or secret_file) makes every connection without TLS use it"
        )
    if checksum is Checksum.CRC32C:
        try:
            _native()
        except ImportError as e:
            raise ConfigError(
                f"checksum 'crc32c' needs the C++ extension: {e}; build it "
                "(bash install.sh) or set checksum to 'blake3'"
            ) from None
    return checksum


def running_digest(checksum: Checksum) -> RunningDigest:
    """A digest of one block fed piecewise (``copy`` / ``update``)."""
    if checksum is Checksum.CRC32C:
        try:
            return _Crc32cDigest(_native())
        except ImportError as e:  # a peer sent crc32c; this side cannot verify it
            raise TransferCorrupted(f"cannot verify a crc32c block: {e}") from None
    if checksum is Checksum.BLAKE3:
        return _Blake3Digest()
    if checksum is Checksum.CRC32:
        return _Crc32Digest()
    if checksum is Checksum.BLAKE3_KEYED:
        raise TransferCorrupted("a keyed block check needs its connection's key (BlockCheck)")
    return RunningDigest()


def block_digest(checksum: Checksum, data: Bytes) -> bytes:
    """One block's digest (``data``: all its bytes)."""
    d = running_digest(checksum)
    d.update(data)
    return d.digest()


_INDEX = struct.Struct("<I")


@dataclass(frozen=True, repr=False)
class BlockCheck:
    """How the blocks of one frame are checked: the algorithm and, for ``BLAKE3_KEYED``, the
    connection's block key and the frame they belong to (the hash of its encoding)."""

    checksum: Checksum
    key: bytes | None = None
    context: bytes = b""

    @classmethod
    def keyed(cls, key: bytes, frame_encoding: bytes) -> BlockCheck:
        import blake3  # here: a bare GPU machine (benchmarks/gpu_check.py) has none and sets no secret

        return cls(Checksum.BLAKE3_KEYED, key, blake3.blake3(frame_encoding).digest())

    def running(self, index: int) -> RunningDigest:
        """A digest of the frame's ``index``-th block, fed piecewise."""
        if self.checksum is Checksum.BLAKE3_KEYED:
            if self.key is None:
                raise TransferCorrupted("a keyed block check without its connection's key")
            return _KeyedDigest(self.key, self.context, index)
        return running_digest(self.checksum)

    def digest(self, index: int, data: Bytes) -> bytes:
        d = self.running(index)
        d.update(data)
        return d.digest()


class BlockStream:
    """The bytes of a sequence of blocks, moved in order through contiguous spans (the ring
    slots of shm), each block's digest computed by the copy that moves it.

    ``fill(span)`` copies the next bytes of the blocks into ``span``; ``drain(span)`` copies
    ``span`` into the next bytes of the blocks. Both return the bytes moved (less than
    ``len(span)`` only when the blocks end). With crc32c (and none, when the extension is
    built) one native call per span moves every block piece of it.
    """

    def __init__(self, check: BlockCheck | Checksum, blocks: Sequence[Bytes]) -> None:
        self._check = check if isinstance(check, BlockCheck) else BlockCheck(check)
        checksum = self._checksum = self._check.checksum
        self._blocks = blocks
        self._index, self._offset = 0, 0  # next byte: blocks[index][offset]
        self._digests: list[bytes] = []
        self._native: Any = None
        if checksum is Checksum.CRC32C or checksum is Checksum.NONE:
            try:
                self._native = _native()
            except ImportError:
                if checksum is Checksum.CRC32C:
                    raise TransferCorrupted("cannot verify a crc32c block: vllm_pd._C is not built") from None
        self._value = 0  # native: CRC32C of blocks[index][:offset]
        self._running = self._check.running(0) if self._native is None else None

    @property
    def done(self) -> bool:
        return self._index == len(self._blocks)

    def digests(self) -> bytes:
        """The trailer: one digest per block, once ``done``."""
        if not self.done:
            raise ValueError(f"block stream at block {self._index} of {len(self._blocks)}")
        return b"".join(self._digests)

    def fill(self, span: Bytes) -> int:
        return self._move(span, to_span=True)

    def drain(self, span: Bytes) -> int:
        return self._move(span, to_span=False)

    def _move(self, span: Bytes, to_span: bool) -> int:
        if self._native is not None:
            moved, self._index, self._offset, self._value, digests = self._native.copy_blocks_crc32c(
                span, self._blocks, self._index, self._offset, self._value, to_span
            )
            # none: the CRC came for free with the copy, but the slots carry zeros
            self._digests.append(digests if self._checksum is Checksum.CRC32C else bytes(len(digests)))
            return int(moved)
        return self._move_python(np.frombuffer(span, dtype=np.uint8), to_span)

    def _move_python(self, span: np.ndarray, to_span: bool) -> int:
        assert self._running is not None
        pos = 0
        while self._index < len(self._blocks):
            block = np.frombuffer(self._blocks[self._index], dtype=np.uint8)
            take = min(len(span) - pos, len(block) - self._offset)
            if take == 0 and self._offset < len(block):
                break  # span full
            a, b = span[pos : pos + take], block[self._offset : self._offset + take]
            if to_span:
                self._running.copy(a, b)
            else:
                self._running.copy(b, a)
            pos += take
            self._offset += take
            if self._offset == len(block):
                self._digests.append(self._running.digest())
                self._index, self._offset = self._index + 1, 0
                self._running = self._check.running(self._index)
        return pos


__all__ = ["DIGEST_NBYTES", "BlockCheck", "BlockStream", "Checksum", "RunningDigest"]
