"""A pull from prefill of another block size (same TP): decode reads prefill's whole blocks and
re-cuts them on its host (``kv_geometry.whole_block_reads``, ``block_recut``) instead of a span
per head and row. Over the real TCP transport, between a prefill's KV and a decode's of another
block size (host memory: vLLM CPU's KV read directly, or a GPU's through pinned landing rows,
the GPU a stand-in that runs every copy at once - no GPU here): the blocks a load places must be
byte for byte those the span path places, for vLLM CPU attention's packing (K transposed) and
the plain ``H.N.C`` one, a partial last block and a first position past decode's own prefix hit.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from tests.support.transport_harness import make_regions, started
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.host_staging import StagingArena
from vllm_pd.connector.device.kv_access import DirectAccess, KVAccess, StagedAccess
from vllm_pd.connector.device.kv_device import HostDevice
from vllm_pd.connector.device.kv_geometry import CPU_VEC_KERNEL, BlockFormat, kernel_format
from vllm_pd.connector.step_specs import LoadSpec
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.connector.worker import load_job as load_job_module
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.protocol.kv_shape import KVGroup, KVShape
from vllm_pd.protocol.transfer_params import RemotePrefill

LAYERS, NUM_BLOCKS, HEADS, C = 2, 24, 2, 8  # C: bf16 K and V of head size 4 side by side


def kv_shape(block_size: int, kernel: str) -> KVShape:
    fmt = kernel_format(f"bfloat16:H{HEADS}.N{block_size}.C{C}", kernel)
    return KVShape(1, HEADS, (KVGroup("full", block_size, fmt),), (0,) * LAYERS)


def decode_access(kind: str, regions: list[MemoryRegion]) -> KVAccess:
    dev = HostDevice()
    if kind == "direct":  # vLLM CPU: the transport writes our KV cache itself
        return DirectAccess(BlockCopies(regions, dev))
    arena = StagingArena(dev, [r.block_nbytes for r in regions], NUM_BLOCKS * sum(r.block_nbytes for r in regions))
    for t in arena.tensors:
        t.fill_(0xA5)  # landing rows hold old bytes
    return StagedAccess(BlockCopies(regions, dev), arena, BlockCopies(regions, dev))


def write_token(
    src: torch.Tensor, dst: torch.Tensor, token: int, nr: int, nl: int, kernel: str, local_ids: list[int], first: int
) -> None:
    """What a forward computing ``token`` writes: its K and V (here prefill's, the same values) into
    our block that holds it, at that token's place of each head and row (``BlockFormat.runs``)."""
    runs = BlockFormat.parse(kv_shape(nl, kernel).groups[0].block_format).runs
    assert runs is not None
    s, d = src.view(torch.uint8).flatten(1), dst.view(torch.uint8).flatten(1)
    k, j = token // nr, token // nl
    head_r, head_l = s.shape[1] // HEADS, d.shape[1] // HEADS
    at = 0
    for rows, e in runs:
        for h, row in itertools.product(range(HEADS), range(rows)):
            a = h * head_r + at * nr + row * nr * e + (token - k * nr) * e
            b = h * head_l + at * nl + row * nl * e + (token - j * nl) * e
            d[local_ids[j - first], b : b + e] = s[k, a : a + e]
        at += rows * e


def pull(
    kind: str,
    nr: int,
    nl: int,
    kernel: str,
    first: int,
    num_tokens: int,
    fetch_spans: list[int],
    layerwise: bool = False,
    forward_writes: bool = False,
) -> tuple[list[torch.Tensor], list[int]]:
    """Decode's KV after pulling a prompt of ``num_tokens`` from a prefill of block size ``nr``
    into blocks of ``nl`` from position ``first``; (each layer's blocks, our block ids). The
    number of spans of each fetch is appended to ``fetch_spans``. ``forward_writes``: once a
    layer's read landed (before the load places it), the step's forward writes the prompt's last
    token into that layer, as vLLM does before it waits for a layer-wise load."""
    prefill_regions = make_regions(LAYERS, NUM_BLOCKS, seed=7, block_shape=(HEADS, nr, C))
    remote_ids = [NUM_BLOCKS - 1 - 2 * k % NUM_BLOCKS for k in range(-(-num_tokens // nr))]  # not in order
    local_ids = [(5 * j + 3) % NUM_BLOCKS for j in range(-(-num_tokens // nl) - first)]
    prefill, _, endpoint = started("tcp", prefill_regions)
    prefill.allow_fetch("p-1", remote_ids)
    regions = [
        MemoryRegion(f"l{i}", torch.zeros(NUM_BLOCKS, HEADS, nl, C, dtype=torch.bfloat16)) for i in range(LAYERS)
    ]
    access = decode_access(kind, regions)
    decode = create_transport("tcp")
    decode.register_regions(access.transport_regions)
    decode.start(_NoSink(), "127.0.0.1", 0)
    fetch = decode.fetch

    def counted(*args, spans=None, **kwargs):  # type: ignore[no-untyped-def]
        fetch_spans.append(len(spans) if spans is not None else len(args[3]))
        fut = fetch(*args, spans=spans, **kwargs)
        if forward_writes:
            fut.result(timeout=10)
            layer = args[2]
            src, dst = prefill_regions[layer].tensor, regions[layer].tensor
            write_token(src, dst, num_tokens - 1, nr, nl, kernel, local_ids, first)
        return fut

    decode.fetch = counted  # type: ignore[method-assign]
    host, port = endpoint.split("://", 1)[1].rsplit(":", 1)
    remote = RemotePrefill(
        transfer_id="p-1",
        engine_id="e",
        endpoint=endpoint,
        host=host,
        port=int(port),
        block_ids=tuple(remote_ids),
        num_tokens=num_tokens,
        block_size=nr,
        mode="pull",
        shape=kv_shape(nr, kernel),
    )
    spec = LoadSpec("d-1", "p-1", remote, first, tuple(local_ids), layerwise=layerwise)
    groups = LayerGroups(kv_shape(nl, kernel), LAYERS, nl)
    job = LoadJob(
        spec, decode, regions, PushStaging(1 << 20, ttl_s=60), access, 0, 5, 1, groups=groups, host_alloc=None
    )
    try:
        job.run()
        assert job.ok, job.error
        assert job.blocks_fetched == len(local_ids) * LAYERS
    finally:
        prefill.close()
        decode.close()
    return [r.tensor.view(torch.uint8).clone() for r in regions], local_ids


def by_span_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(load_job_module, "whole_block_reads", lambda *args: None)


CASES = [
    (32, 64, 0, 300),  # P32 -> D64: two prefill blocks per block of ours, the last partial
    (32, 64, 2, 300),  # decode's own prefix-cache hit: the load starts at position 2
    (64, 32, 0, 300),  # P64 -> D32: one prefill block feeds two of ours
    (64, 32, 3, 270),  # prefill's blocks straddle our first and last block: those two by spans
]


@pytest.mark.parametrize("nr, nl, first, num_tokens", CASES)
@pytest.mark.parametrize("kernel", ["", CPU_VEC_KERNEL], ids=["plain", "cpu-vec"])
@pytest.mark.parametrize("kind", ["direct", "staged"])
def test_pulled_whole_blocks_recut_as_the_spans_place_them(
    monkeypatch: pytest.MonkeyPatch, kind: str, kernel: str, nr: int, nl: int, first: int, num_tokens: int
) -> None:
    whole_spans: list[int] = []
    recut, ids = pull(kind, nr, nl, kernel, first, num_tokens, whole_spans)
    with monkeypatch.context() as m:
        by_span_path(m)
        span_spans: list[int] = []
        spans, _ = pull(kind, nr, nl, kernel, first, num_tokens, span_spans)
    for layer in range(LAYERS):
        assert torch.equal(recut[layer], spans[layer]), layer  # every block, ours and the others
        assert recut[layer][ids].any()
    # the switch took: each prefill block read whole (cut where it straddles two of ours), not per head
    assert all(w < s for w, s in zip(whole_spans, span_spans, strict=True)), (whole_spans, span_spans)


def test_a_wrong_recut_shows_as_other_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: one byte of the re-cut off, and the comparison with the span path fails."""
    with monkeypatch.context() as m:
        by_span_path(m)
        expected, _ = pull("direct", 32, 64, CPU_VEC_KERNEL, 0, 300, [])
    recut_rows: Callable[..., torch.Tensor] = load_job_module.recut_rows

    def off_by_a_byte(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = recut_rows(*args, **kwargs)
        out[0, 5] ^= 1
        return out

    monkeypatch.setattr(load_job_module, "recut_rows", off_by_a_byte)
    got, _ = pull("direct", 32, 64, CPU_VEC_KERNEL, 0, 300, [])
    assert not all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))


@pytest.mark.parametrize("nr, nl", [(32, 64), (64, 32)])
@pytest.mark.parametrize("kernel", ["", CPU_VEC_KERNEL], ids=["plain", "cpu-vec"])
def test_a_layerwise_forward_writing_its_token_mid_load_is_not_recut_over(
    monkeypatch: pytest.MonkeyPatch, kernel: str, nr: int, nl: int
) -> None:
    """vLLM writes a layer's new KV (the prompt's last token, in our last block) before it waits for
    that layer's load. Where a read lands in the KV itself (vLLM CPU), prefill's blocks landed as
    they are in that block would be written over before the re-cut reads them: it goes by spans,
    and the KV is the span path's."""
    whole_spans: list[int] = []
    got, ids = pull("direct", nr, nl, kernel, 0, 300, whole_spans, layerwise=True, forward_writes=True)
    with monkeypatch.context() as m:
        by_span_path(m)
        span_spans: list[int] = []
        want, _ = pull("direct", nr, nl, kernel, 0, 300, span_spans, layerwise=True, forward_writes=True)
    for layer in range(LAYERS):
        assert torch.equal(got[layer], want[layer]), layer
    assert all(w < s for w, s in zip(whole_spans, span_spans, strict=True)), (whole_spans, span_spans)


class _NoSink:
    def destinations(self, batch: object) -> None:
        return None

    def landed(self, batch: object, ok: bool) -> None:
        return None

    def on_notify(self, peer: str, message: bytes) -> bytes:
        return b"ok"
