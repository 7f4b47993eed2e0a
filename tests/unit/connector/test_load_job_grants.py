"""A decode leg sent beside its prefill leg, reading from several prefill ranks: the announcement comes
from one of them, after its own grant; another rank grants its share a moment later (its own send
thread). The load reads that rank again until it grants, within load_job.GRANT_WAIT_S - seen in the
mixed-TP state e2e (P2 -> D1 push-beside, a recurrent state is always read: 1 of 6 loads rejected).
Two real tcp transports stand in for the two prefill ranks (no vLLM)."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.support.transport_harness import RecordingSink
from tests.unit.connector.test_kv_geometry import shape
from tests.unit.connector.test_transfer_params import remote_prefill
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.kv_access import DirectAccess
from vllm_pd.connector.device.kv_device import HostDevice
from vllm_pd.connector.metadata import LoadSpec
from vllm_pd.connector.step_specs import LocalPrompt
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import MemoryRegion
from vllm_pd.connector.worker import load_job
from vllm_pd.connector.worker.layer_groups import LayerGroups
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.protocol.transfer_params import prompt_hash

PROMPT = [5, 6, 7]
LATE_S = 0.3  # prefill rank 1 grants this long after rank 0 announced


def _run(late_s: float) -> LoadJob:
    prefill_shape, decode_shape = shape(2, 2, 2), shape(1, 2, 2)  # P TP 2 -> D TP 1, blocks of 2 tokens
    ranks, endpoints = [], []
    for source in (0, 1):  # each rank's one head of blocks 1 and 2, 32 bytes a block, filled with its rank's mark
        regions = [MemoryRegion("l0", torch.full((4, 32), 10 + source, dtype=torch.uint8))]
        t = create_transport("tcp")
        t.register_regions(regions)
        endpoints.append(t.start(RecordingSink(regions), "127.0.0.1", 0))
        ranks.append(t)
    regions = [MemoryRegion("l0", torch.zeros(4, 64, dtype=torch.uint8))]
    decode = create_transport("tcp")
    decode.register_regions(regions)
    decode.start(RecordingSink(regions), "127.0.0.1", 0)
    spec = LoadSpec(
        request_id="d-1",
        remote=None,  # sent beside its prefill leg: waits for the announcement
        first_position=0,
        local_block_ids=(3, 1),
        transfer_id="k",
        prompt=LocalPrompt(prompt_hash(PROMPT), len(PROMPT), block_size=2, tp_size=1, shape=decode_shape),
    )
    staging = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job = LoadJob(
        spec,
        decode,
        regions,
        staging,
        DirectAccess(BlockCopies(regions, HostDevice())),
        rank=0,
        timeout_s=10.0,
        push_wait_s=1.0,
        groups=LayerGroups(decode_shape, 1, 2),
    )
    ranks[0].allow_fetch("k", [1, 2])
    late = threading.Timer(late_s, ranks[1].allow_fetch, ("k", [1, 2]))
    late.start()
    staging.announce(
        "k",
        remote_prefill(
            mode="pull",
            transfer_id="k",
            block_ids=(1, 2),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash(PROMPT),
            endpoint=endpoints[0],
            shape=prefill_shape,
            tp_size=2,
            endpoints=tuple(endpoints),
        ).to_params(),
    )
    try:
        job.run()
    finally:
        late.join()
        for t in (*ranks, decode):
            t.close()
    return job


def test_a_share_granted_after_the_announcement_is_read_once_granted() -> None:
    job = _run(LATE_S)
    assert job.ok, job.error
    block = job._regions[0].tensor
    for b in (3, 1):  # head 0 from prefill rank 0, head 1 from rank 1
        assert block[b, :32].eq(10).all() and block[b, 32:].eq(11).all()


def test_without_the_wait_the_late_share_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Negative control: the same load without re-reads fails (decode would recompute the prompt)."""
    monkeypatch.setattr(load_job, "GRANT_WAIT_S", 0.0)
    job = _run(LATE_S)
    assert not job.ok and "not granted" in (job.error or "")
