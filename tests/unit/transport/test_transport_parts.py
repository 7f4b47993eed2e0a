"""Parts of blocks between two real transports on 127.0.0.1, for every transport: a push of a
window of each block (a run of heads, when prefill and decode shard heads differently) and a
fetch of spans (per head a run of tokens, when their block sizes differ) land exactly those
bytes where asked, and nothing around them."""

from __future__ import annotations

import pytest
import torch

from tests.support.transport_harness import make_regions, started
from vllm_pd.connector.transport.base import BlockBatch, BlockWindow, FetchSpans
from vllm_pd.errors import TransferRejected
from vllm_pd.protocol.auth_handshake import DeploymentSecret

SECRET = DeploymentSecret(b"parts-test-secret-0123456789abcd", "test")
TRANSPORTS = {
    "tcp": ("tcp", {}),
    "shm": ("shm", {}),
    "shm-rings": ("shm", {"cross_memory": False}),
    "nixl": ("nixl", {}),
    "tcp+secret": ("tcp", {"secret": SECRET}),
    "shm+secret": ("shm", {"secret": SECRET}),
}


@pytest.fixture(params=list(TRANSPORTS))
def pair(request):
    name, options = TRANSPORTS[request.param]
    src_regions = make_regions(2, 16, seed=1)
    dst_regions = make_regions(2, 16, seed=None)
    a, a_sink, a_ep = started(name, src_regions, **options)
    b, b_sink, b_ep = started(name, dst_regions, **options)
    yield (a, a_sink, a_ep, src_regions), (b, b_sink, b_ep, dst_regions)
    a.close()
    b.close()


def _bytes(region, block: int) -> torch.Tensor:
    return region.tensor[block].reshape(-1).view(torch.uint8)


def test_push_of_a_window_sends_those_bytes_of_each_block(pair) -> None:
    (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[1].block_nbytes
    window = BlockWindow(nbytes // 4, nbytes // 2)  # the middle half: heads 1 and 2 of 4, say
    b_sink.windows = True
    fut = a.push(b_ep, BlockBatch("w", 1, (3, 4), window.nbytes, last=True), [7, 9], timeout=10, window=window)
    assert fut.result(10) is None
    for pos, blk in ((3, 7), (4, 9)):
        got, want = _bytes(dst[1], pos), _bytes(src[1], blk)
        assert torch.equal(got[: window.nbytes], want[window.offset : window.offset + window.nbytes])
        assert not got[window.nbytes :].any()  # nothing beyond the window's bytes
    ((batch, ok),) = b_sink.wait_landed(1)  # the sink lands a window's row at the start of the block
    assert ok and batch.block_nbytes == window.nbytes


def test_push_window_outside_the_block_or_of_another_size_raises(pair) -> None:
    (a, _, _, src), (_, _, b_ep, _) = pair
    nbytes = src[0].block_nbytes
    with pytest.raises(ValueError, match="not inside"):
        a.push(b_ep, BlockBatch("w", 0, (0,), 64), [0], timeout=10, window=BlockWindow(nbytes - 32, 64))
    with pytest.raises(ValueError, match="bytes sent per block"):
        a.push(b_ep, BlockBatch("w", 0, (0,), nbytes), [0], timeout=10, window=BlockWindow(0, 64))


def test_fetch_of_spans_lands_each_part_at_its_offset(pair) -> None:
    (a, _, a_ep, src), (b, _, _, dst) = pair
    nbytes = src[0].block_nbytes
    quarter = nbytes // 4
    a.allow_fetch("s", [2, 5])
    # block 5's second quarter -> the start of our block 0; block 2's last quarter -> the end of
    # our block 0; block 2's first quarter -> the middle of our block 1 (ids repeat per span)
    spans = FetchSpans(
        src_offsets=(quarter, 3 * quarter, 0),
        dst_offsets=(0, 3 * quarter, quarter),
        lengths=(quarter, quarter, quarter),
    )
    b.fetch(a_ep, "s", 0, [5, 2, 2], [0, 0, 1], timeout=10, spans=spans).result(10)
    d0, d1 = _bytes(dst[0], 0), _bytes(dst[0], 1)
    s2, s5 = _bytes(src[0], 2), _bytes(src[0], 5)
    assert torch.equal(d0[:quarter], s5[quarter : 2 * quarter])
    assert torch.equal(d0[3 * quarter :], s2[3 * quarter :])
    assert not d0[quarter : 3 * quarter].any()
    assert torch.equal(d1[quarter : 2 * quarter], s2[:quarter])
    assert not d1[:quarter].any() and not d1[2 * quarter :].any()


def test_fetch_of_spans_needs_the_grant_and_parts_inside_the_blocks(pair) -> None:
    (a, _, a_ep, src), (b, _, _, dst) = pair
    nbytes = src[0].block_nbytes
    a.allow_fetch("g", [1])
    with pytest.raises(TransferRejected, match="not granted"):
        b.fetch(a_ep, "g", 0, [3], [0], timeout=10, spans=FetchSpans((0,), (0,), (64,))).result(10)
    with pytest.raises(TransferRejected):
        b.fetch(a_ep, "g", 0, [1], [0], timeout=10, spans=FetchSpans((nbytes - 32,), (0,), (64,))).result(10)
    assert not _bytes(dst[0], 0).any()
    with pytest.raises(ValueError, match="not inside"):
        b.fetch(a_ep, "g", 0, [1], [0], timeout=10, spans=FetchSpans((0,), (nbytes - 32,), (64,)))


@pytest.mark.parametrize("transport", [t for t in TRANSPORTS if t != "nixl"])
def test_two_fetchers_of_different_windows_read_one_server_at_once(transport: str) -> None:
    """Mixed TP, P TP 1 -> D TP 2 pull: each decode rank (a transport of its own) reads its head - its
    half of every block - of every layer from prefill's one rank, both at once and under one transfer
    id. Each gets exactly its half of each block and every read is answered: neither reader's reads
    wait for, or settle, the other's."""
    name, options = TRANSPORTS[transport]
    src = make_regions(4, 16, seed=1)
    a, _, a_ep = started(name, src, **options)
    readers = [started(name, make_regions(4, 16, seed=None), **options)[0] for _ in range(2)]
    try:
        half = src[0].block_nbytes // 2
        ids = list(range(16))
        a.allow_fetch("p1d2", ids)
        spans = [FetchSpans((rank * half,) * 16, (0,) * 16, (half,) * 16) for rank in range(2)]
        reads = [
            t.fetch(a_ep, "p1d2", layer, ids, ids, timeout=10, spans=spans[rank])
            for layer in range(4)
            for rank, t in enumerate(readers)
        ]
        for f in reads:
            assert f.result(10) is None
        for rank, t in enumerate(readers):
            landed = t._require_regions()
            for layer in range(4):
                for blk in ids:
                    want = _bytes(src[layer], blk)[rank * half : (rank + 1) * half]
                    assert bytes(landed.views(layer, [blk])[0][:half]) == want.numpy().tobytes()
        a.allow_fetch("p1d2", None)
    finally:
        for t in (a, *readers):
            t.close()
