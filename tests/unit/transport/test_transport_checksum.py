"""The transports' per-block checksums: CRC32C from vllm_pd._C (known answers, every code
path of the 3-stream kernel, unaligned buffers, the fused copies) and BlockStream, which
moves blocks through ring slots with one digest per block, for every algorithm."""

from __future__ import annotations

import random

import numpy as np
import pytest

from vllm_pd.connector.transport import checksum as checksum_module
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.checksum import BlockCheck, BlockStream, block_digest, parse_checksum
from vllm_pd.errors import ConfigError, TransferCorrupted
from vllm_pd.ops import native
from vllm_pd.protocol.frames import Checksum

if native.load_error() is not None:  # the CI builds it (install.sh); say so rather than pass
    pytest.fail(f"vllm_pd._C is needed for these tests: {native.load_error()}", pytrace=False)

from vllm_pd import _C

# Lengths around every boundary of the kernel: the 8-byte words, the short rounds (3 x 256)
# and the long rounds (3 x 8192).
LENGTHS = [
    0,
    1,
    7,
    8,
    9,
    63,
    767,
    768,
    769,
    3 * 256 + 8,
    3 * 8192 - 1,
    3 * 8192,
    3 * 8192 + 1,
    3 * 8192 + 3 * 256 + 13,
    2 * 3 * 8192 + 5,
    100_003,
]


def crc32c_reference(data: bytes, value: int = 0) -> int:
    """Bit-at-a-time CRC32C straight from the definition (reflected poly 0x82F63B78)."""
    crc = value ^ 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def test_known_answers() -> None:
    assert _C.crc32c(b"123456789") == 0xE3069283  # the CRC catalogue's check value
    # RFC 3720 (iSCSI) appendix B.4
    assert _C.crc32c(bytes(32)) == 0x8A9136AA
    assert _C.crc32c(b"\xff" * 32) == 0x62A8AB43
    assert _C.crc32c(bytes(range(32))) == 0x46DD794E
    assert _C.crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert _C.crc32c(b"") == 0
    assert _C.crc32c_hardware() in (True, False)


def test_matches_the_definition_at_every_length_and_misalignment() -> None:
    rnd = random.Random(7)
    for n in LENGTHS:
        data = rnd.randbytes(n + 16)
        # The reference is slow in Python: check the long lengths on a few offsets only.
        offsets = (0, 1, 3, 5) if n < 30_000 else (3,)
        for off in offsets:
            piece = data[off : off + n]
            want = crc32c_reference(piece)
            assert _C.crc32c(memoryview(data)[off : off + n]) == want, (n, off)
            k = rnd.randrange(n + 1)  # chaining, as a running digest does
            assert _C.crc32c(piece[k:], _C.crc32c(piece[:k])) == want, (n, off, k)


def test_copy_writes_exactly_the_destination_and_returns_the_crc() -> None:
    rnd = random.Random(8)
    for n in LENGTHS:
        src = rnd.randbytes(n + 7)
        dst = bytearray(b"\xa5" * (n + 11))
        for s_off, d_off in ((0, 0), (1, 6), (7, 3)):
            got = _C.copy_crc32c(memoryview(dst)[d_off : d_off + n], src[s_off : s_off + n])
            assert got == _C.crc32c(src[s_off : s_off + n])
            assert dst[d_off : d_off + n] == src[s_off : s_off + n]
            assert dst[:d_off] == b"\xa5" * d_off and dst[d_off + n :] == b"\xa5" * (11 - d_off)
            dst[:] = b"\xa5" * len(dst)
    with pytest.raises(ValueError, match="destination"):
        _C.copy_crc32c(bytearray(3), b"abcd")
    with pytest.raises(TypeError):
        _C.copy_crc32c(b"read-only", b"read-only")


def test_any_single_flipped_bit_or_swapped_words_changes_the_crc() -> None:
    data = bytearray(random.Random(9).randbytes(3 * 8192 + 300))
    good = _C.crc32c(data)
    for pos in (0, 1, 8191, 8192, 16384 + 77, 3 * 8192 + 5, len(data) - 1):
        for bit in (0, 7):
            data[pos] ^= 1 << bit
            assert _C.crc32c(data) != good, (pos, bit)
            data[pos] ^= 1 << bit
    swapped = data[8:16] + data[:8] + data[16:]  # reordered bytes, same sum: a CRC sees it
    assert _C.crc32c(swapped) != good


def _blocks(rnd: random.Random, sizes: list[int]) -> list[np.ndarray]:
    return [np.frombuffer(bytearray(rnd.randbytes(n)), dtype=np.uint8) for n in sizes]


CHECKS = [BlockCheck(c) for c in Checksum if c is not Checksum.BLAKE3_KEYED] + [
    BlockCheck.keyed(bytes(range(32)), b"a frame's encoding")
]


@pytest.mark.parametrize("checksum", CHECKS, ids=lambda c: c.checksum.name)
@pytest.mark.parametrize("span_nbytes", [5, 4096, 10_000, 1 << 20])
def test_block_stream_through_spans_lands_bytes_and_per_block_digests(checksum, span_nbytes) -> None:
    rnd = random.Random(span_nbytes)
    sizes = [4096, 1, 10_000, 0, 24_581, 4096]
    src = _blocks(rnd, sizes)
    dst = [np.zeros(n, dtype=np.uint8) for n in sizes]
    sender, receiver = BlockStream(checksum, src), BlockStream(checksum, dst)
    span = np.zeros(span_nbytes, dtype=np.uint8)
    total = 0
    while not sender.done:
        n = sender.fill(span)
        assert n == min(span_nbytes, sum(sizes) - total)
        assert receiver.drain(span[:n]) == n
        total += n
    assert total == sum(sizes) and receiver.done
    for a, b in zip(src, dst, strict=True):
        assert np.array_equal(a, b)
    want = b"".join(checksum.digest(i, memoryview(b)) for i, b in enumerate(src))
    assert sender.digests() == want == receiver.digests()


def test_block_stream_digest_sees_a_byte_changed_in_the_span() -> None:
    rnd = random.Random(3)
    for checksum in (Checksum.CRC32C, Checksum.BLAKE3, Checksum.CRC32):
        src = _blocks(rnd, [8192, 8192])
        dst = [np.zeros(8192, dtype=np.uint8) for _ in range(2)]
        sender, receiver = BlockStream(checksum, src), BlockStream(checksum, dst)
        span = np.zeros(1 << 16, dtype=np.uint8)
        n = sender.fill(span)
        span[9000] ^= 0x10  # in block 1
        receiver.drain(span[:n])
        got, sent = receiver.digests(), sender.digests()
        assert got[:8] == sent[:8] and got[8:] != sent[8:], checksum


def test_keyed_check_depends_on_key_frame_and_position() -> None:
    """A forger without the session's block key cannot make a block pass, and a genuine block
    moved to another frame or another position in its frame fails too."""
    block = memoryview(bytearray(random.Random(5).randbytes(4096)))
    check = BlockCheck.keyed(b"k" * 32, b"frame 1")
    digest = check.digest(0, block)
    assert digest == check.digest(0, block)
    assert BlockCheck.keyed(b"K" * 32, b"frame 1").digest(0, block) != digest  # another key
    assert BlockCheck.keyed(b"k" * 32, b"frame 2").digest(0, block) != digest  # another frame
    assert check.digest(1, block) != digest  # another position
    assert block_digest(Checksum.BLAKE3, block) != digest  # the unkeyed hash anyone can compute
    with pytest.raises(TransferCorrupted):
        block_digest(Checksum.BLAKE3_KEYED, block)  # never without a key
    with pytest.raises(ValueError, match="deployment secret"):
        parse_checksum("blake3_keyed")


def test_crc32c_without_the_extension_is_refused_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(native, "load_error", lambda: "vllm_pd._C is not built (test)")
    monkeypatch.setattr(checksum_module, "_NATIVE", None)  # as in a process that never loaded it
    with pytest.raises(ConfigError, match="crc32c.*C\\+\\+ extension"):
        create_transport("shm", checksum="crc32c")
    create_transport("tcp", checksum="blake3").close()  # the others need nothing built


def test_parse_names_the_choices() -> None:
    assert parse_checksum("CRC32C") is Checksum.CRC32C
    with pytest.raises(ValueError, match="crc32c"):
        parse_checksum("xxh3")
