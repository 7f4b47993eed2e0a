"""Decode's load gives up on a prefill that stopped answering (a partition, a paused host) once its
pushes stall, after peer_probe_s - not at the transfer's deadline - so decode recomputes at once.
Over real TCP: the silent prefill is a socket that accepts connections and never answers."""

from __future__ import annotations

import socket
import time

import torch

from tests.support.transport_harness import RecordingSink, make_regions
from tests.unit.connector.test_connector_units import _land
from tests.unit.connector.test_transfer_params import remote_prefill
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.kv_access import DirectAccess
from vllm_pd.connector.device.kv_device import HostDevice
from vllm_pd.connector.metadata import LoadSpec
from vllm_pd.connector.step_specs import LocalPrompt
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.protocol.control import PingMessage, decode_control
from vllm_pd.protocol.transfer_params import prompt_hash

PROMPT = [5, 6, 7]
TIMEOUT_S = 30.0  # the transfer's deadline: what a load waited for a silent prefill before


class _PingSink(RecordingSink):
    """A live prefill rank's endpoint: answers pings (it holds no KV, so fetches fail)."""

    def __init__(self) -> None:
        super().__init__(make_regions(1, 4))
        self.pings = 0

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        if isinstance(decode_control(message), PingMessage):
            self.pings += 1
        return b"ok"


def _stalled_push_job(endpoint: str, push_wait_s: float = 0.2) -> tuple[LoadJob, PushStaging]:
    """A decode load whose announced push landed layer 0 only: layer 1's bytes never come."""
    regions = [MemoryRegion(f"l{i}", torch.zeros(4, 8, dtype=torch.uint8)) for i in range(2)]
    spec = LoadSpec(
        request_id="d-1",
        remote=None,
        first_position=0,
        local_block_ids=(3, 1),
        transfer_id="k",
        prompt=LocalPrompt(prompt_hash(PROMPT), len(PROMPT), block_size=2, tp_size=1),
    )
    staging = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    # a connect as slow as the transfer's deadline: without the probe the load would wait that long
    transport = create_transport("tcp", connect_timeout=TIMEOUT_S)
    transport.register_regions(regions)
    transport.start(RecordingSink(regions), "127.0.0.1", 0)
    job = LoadJob(
        spec,
        transport,
        regions,
        staging,
        DirectAccess(BlockCopies(regions, HostDevice())),
        rank=0,
        timeout_s=TIMEOUT_S,
        push_wait_s=push_wait_s,
        probe_s=0.5,
    )
    _land(staging, "k", 0, (0, 1), fill=1, last=True)
    staging.announce(
        "k",
        remote_prefill(
            mode="push",
            transfer_id="k",
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash(PROMPT),
            endpoint=endpoint,
        ).to_params(),
    )
    return job, staging


def test_a_silent_prefill_fails_the_stalled_load_after_the_probe() -> None:
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts (backlog), never answers
        endpoint = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        job, _ = _stalled_push_job(endpoint)
        try:
            t0 = time.monotonic()
            job.run()
            elapsed = time.monotonic() - t0
        finally:
            job._transport.close()
    assert not job.ok and "did not answer within 0.5s" in job.error
    assert not job.layer_ok[1] and job.layer_done[1].is_set()  # a layer-wise forward is let go, to recompute
    assert elapsed < TIMEOUT_S / 3  # bounded by push_wait_s + probe_s, not the transfer's deadline


def test_a_live_prefill_answers_the_probe_and_the_load_fetches_from_it() -> None:
    sink = _PingSink()
    prefill = create_transport("tcp")
    prefill.register_regions(sink.regions)
    endpoint = prefill.start(sink, "127.0.0.1", 0)
    job, _ = _stalled_push_job(endpoint)
    try:
        job.run()
    finally:
        job._transport.close()
        prefill.close()
    assert sink.pings == 1
    # it went on to fetch layer 1 (refused here: this prefill granted nothing)
    assert not job.ok and job.error.startswith("fetch of layer 1 failed")


def test_peer_probe_s_is_validated() -> None:
    import pytest

    from vllm_pd.errors import ConfigError

    assert PDConnectorConfig.from_extra_config({"peer_probe_s": 1}).peer_probe_s == 1.0
    with pytest.raises(ConfigError, match="peer_probe_s"):
        PDConnectorConfig.from_extra_config({"peer_probe_s": 0})


def test_pushes_that_keep_landing_are_waited_for_and_stalled_ones_are_not() -> None:
    """push_wait_s counts from the last push that landed, not from the load's start: a slow prefill
    whose layers keep coming is waited for, a stalled one is given up push_wait_s after its last."""
    import threading

    staging = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    _land(staging, "k", 0, (0,), fill=1, last=False)
    t0 = time.monotonic()

    def trickle() -> None:  # a push every 0.15 s for 0.6 s, the final one after that
        for i in range(4):
            time.sleep(0.15)
            _land(staging, "k", 0, (0,), fill=2 + i, last=i == 3)

    threading.Thread(target=trickle).start()
    assert staging.wait_layer("k", 0, deadline=t0 + 30, stall_s=0.3, since=t0)  # 0.6 s > stall_s: still waited
    t1 = time.monotonic()
    assert not staging.wait_layer("k", 1, deadline=t1 + 30, stall_s=0.3, since=t1)  # nothing more comes
    assert 0.25 < time.monotonic() - t1 < 5


def test_a_silent_prefill_is_found_at_the_first_pause_of_its_pushes_not_after_push_wait_s() -> None:
    """Pushes that pause for a second get prefill probed at once: a layer-wise forward waits that
    second and one probe for a lost prefill, not push_wait_s; a live one is waited for on."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        job, _ = _stalled_push_job(f"tcp://127.0.0.1:{silent.getsockname()[1]}", push_wait_s=20.0)
        try:
            t0 = time.monotonic()
            job.run()
            elapsed = time.monotonic() - t0
        finally:
            job._transport.close()
    assert not job.ok and "did not answer within 0.5s" in job.error
    assert elapsed < 5.0  # ~1 s pause + 0.5 s probe; push_wait_s is 20


def test_two_prefill_ranks_pushes_that_start_after_the_probe_pause_are_waited_for() -> None:
    """P TP 2 -> D TP 1: decode's block takes a head from each prefill rank, pushed under a staging
    key per rank (``k#src0``, ``k#src1``). Nothing but those pushes touches such a key - the
    announcement lands under ``k`` - so a rank whose first layer lands after the pause that gets it
    probed (a slow first layer) must be waited for from the load's start, up to push_wait_s. Before,
    a key never pushed under counted as silent since time 0: every layer of both ranks was given up
    to fetches after the first probe (seen in the mixed-TP e2e: 176 blocks pushed, none loaded)."""
    import threading

    from tests.unit.connector.test_kv_geometry import shape
    from vllm_pd.connector.device.kv_geometry import plan_rank
    from vllm_pd.connector.worker.layer_groups import LayerGroups

    prefill_shape, decode_shape = shape(2, 2, 2), shape(1, 2, 2)
    plan = plan_rank(prefill_shape, decode_shape, 0)
    sink = _PingSink()
    prefill = create_transport("tcp")
    prefill.register_regions(sink.regions)
    endpoint = prefill.start(sink, "127.0.0.1", 0)
    piece_nbytes = plan.groups[0].pieces[0].src_window(plan.groups[0].remote_format)[1]
    regions = [MemoryRegion("l0", torch.zeros(4, 2 * piece_nbytes, dtype=torch.uint8))]
    spec = LoadSpec(
        request_id="d-1",
        remote=None,
        first_position=0,
        local_block_ids=(3, 1),
        transfer_id="k",
        prompt=LocalPrompt(prompt_hash(PROMPT), len(PROMPT), block_size=2, tp_size=1, shape=decode_shape),
    )
    staging = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    transport = create_transport("tcp")
    transport.register_regions(regions)
    transport.start(RecordingSink(regions), "127.0.0.1", 0)
    job = LoadJob(
        spec,
        transport,
        regions,
        staging,
        DirectAccess(BlockCopies(regions, HostDevice())),
        rank=0,
        timeout_s=TIMEOUT_S,
        push_wait_s=3.0,
        probe_s=0.5,
        groups=LayerGroups(decode_shape, 1, 2),
    )
    staging.announce(
        "k",
        remote_prefill(
            mode="push",
            transfer_id="k",
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash(PROMPT),
            endpoint=endpoint,
            shape=prefill_shape,
            tp_size=2,
            endpoints=(endpoint, endpoint),
        ).to_params(),
    )

    def ranks_push() -> None:  # their one layer lands 1.6 s after the load started: past the 1 s pause
        time.sleep(1.6)
        for source in (0, 1):
            batch = BlockBatch(plan.staging_key("k", source), 0, (0, 1), piece_nbytes, last=True)
            views = staging.destinations(batch)
            assert views is not None
            for v in views:
                v[:] = bytes([7 + source]) * piece_nbytes
            staging.landed(batch, True)

    pushes = threading.Thread(target=ranks_push)
    pushes.start()
    try:
        job.run()
    finally:
        pushes.join()
        transport.close()
        prefill.close()
    assert {plan.staging_key("k", s) for s in (0, 1)} == {"k#src0", "k#src1"}
    assert sink.pings >= 1  # the pause got prefill probed; it answered, so its pushes were waited for
    assert job.ok, job.error
    assert (job.blocks_from_push, job.blocks_fetched) == (2, 0)
    landed = regions[0].tensor[[3, 1]]
    assert sorted(set(landed.flatten().tolist())) == [7, 8]  # a head from each rank
    assert len(staging) == 0  # the ranks' pushes and the announcement are let go once loaded
