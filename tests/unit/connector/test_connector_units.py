"""Unit tests of the connector's pieces that need no vLLM engine."""

from __future__ import annotations

import time
from concurrent.futures import Future

import msgspec
import pytest
import torch

from tests.support.transport_harness import RecordingSink, make_regions
from tests.unit.connector.test_transfer_params import remote_prefill as _remote
from vllm_pd.connector.config import PDConnectorConfig, parse_size
from vllm_pd.connector.device.block_copies import BlockCopies
from vllm_pd.connector.device.kv_access import DirectAccess
from vllm_pd.connector.device.kv_device import HostDevice
from vllm_pd.connector.metadata import LoadSpec
from vllm_pd.connector.step_specs import LocalPrompt
from vllm_pd.connector.transport import create_transport
from vllm_pd.connector.transport.base import BlockBatch, MemoryRegion
from vllm_pd.connector.worker.load_job import LoadJob
from vllm_pd.connector.worker.outgoing import OutgoingTransfers
from vllm_pd.connector.worker.push_staging import PushStaging
from vllm_pd.errors import ConfigError, TransferTimeout
from vllm_pd.protocol.control import PrefillDoneMessage, ReleaseMessage, decode_control
from vllm_pd.protocol.transfer_params import prompt_hash


# ---- config ---------------------------------------------------------------------------------------
def test_config_defaults_and_values() -> None:
    cfg = PDConnectorConfig.from_extra_config(
        {"transport": "shm", "lease_s": 5, "staging_bytes": "64m", "load_mode": "layerwise"}
    )
    assert (cfg.transport, cfg.lease_s, cfg.staging_bytes, cfg.load_mode) == ("shm", 5.0, 64 << 20, "layerwise")
    assert PDConnectorConfig.from_extra_config(None) == PDConnectorConfig()


@pytest.mark.parametrize(
    "extra, names",
    [
        ({"transprot": "tcp"}, "transprot"),
        ({"transport": "udp"}, "transport"),
        ({"lease_s": 0}, "lease_s"),
        ({"lease_s": "long"}, "lease_s"),
        ({"checksum": "yes"}, "checksum"),
        ({"staging_bytes": "lots"}, "staging_bytes"),
        ({"default_mode": "teleport"}, "default_mode"),
        ({"store": 3}, "store"),
    ],
)
def test_config_errors_name_the_key(extra: dict, names: str) -> None:
    with pytest.raises(ConfigError, match=names):
        PDConnectorConfig.from_extra_config(extra)


def test_parse_size() -> None:
    assert parse_size("k", "2G") == 2 << 30
    assert parse_size("k", "512mib") == 512 << 20
    assert parse_size("k", 1000) == 1000
    with pytest.raises(ConfigError):
        parse_size("k", -1)


def test_control_messages() -> None:
    assert decode_control(ReleaseMessage("t1").encode()) == ReleaseMessage("t1")
    with pytest.raises(msgspec.DecodeError):
        decode_control(b"\x00garbage")


# ---- prefill: held transfers --------------------------------------------------------------------
def test_outgoing_held_until_released_and_pushes_done() -> None:
    out = OutgoingTransfers(lease_s=60)
    fut: Future[None] = Future()
    out.add_push("t", fut)
    out.mark_computed("t")
    assert out.take_reportable() == []
    out.finish("t", "req-t", held=True)
    out.release("t")
    assert out.take_reportable() == []  # a push still reads the blocks
    fut.set_result(None)
    [t] = out.take_reportable()
    assert t.transfer_id == "t" and t.granted
    assert t.request_id == "req-t"  # what the worker reports to vLLM, which knows requests, not transfers
    assert out.pending() == 0


def test_outgoing_release_before_finish_waits_for_the_scheduler() -> None:
    out = OutgoingTransfers(lease_s=60)
    out.release("t")  # decode was fast: its release beat the scheduler's finish
    assert out.take_reportable() == []
    out.finish("t", "req-t", held=True)
    assert [t.transfer_id for t in out.take_reportable()] == ["t"]


def test_outgoing_lease_expiry_and_abort() -> None:
    out = OutgoingTransfers(lease_s=0.05)
    out.finish("held", "req-held", held=True)
    out.finish("aborted", "req-aborted", held=False)
    assert [t.transfer_id for t in out.take_reportable()] == ["aborted"]
    time.sleep(0.06)
    assert [t.transfer_id for t in out.take_reportable()] == ["held"]
    assert out.expired_total == 1


def test_outgoing_failed_push_is_counted_not_fatal() -> None:
    out = OutgoingTransfers(lease_s=60)
    fut: Future[None] = Future()
    out.add_push("t", fut)
    fut.set_exception(RuntimeError("peer gone"))
    assert out.push_failures_total == 1
    out.finish("t", "req-t", held=False)
    assert [t.transfer_id for t in out.take_reportable()] == ["t"]


# ---- decode: push staging --------------------------------------------------------------------------
def _land(
    st: PushStaging, transfer_id: str, layer: int, positions: tuple[int, ...], fill: int, last: bool, ok: bool = True
) -> BlockBatch:
    batch = BlockBatch(transfer_id, layer, positions, 8, last=last)
    views = st.destinations(batch)
    assert views is not None
    for v in views:
        v[:] = bytes([fill]) * 8
    st.landed(batch, ok)
    return batch


def _landed(st: PushStaging, transfer_id: str, layer: int, position: int, nbytes: int = 8) -> bytes | None:
    """The landed bytes of one position, or None."""
    runs, missing = st.landed_runs(transfer_id, layer, [position], nbytes)
    return None if missing else bytes(runs[0][1][0].numpy())


def test_staging_complete_only_after_each_layers_last_batch() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    _land(st, "t", 0, (0, 1), fill=1, last=False)  # first chunk; block 1 partly filled
    assert not st.wait_layer("t", 0, deadline=time.monotonic())
    _land(st, "t", 0, (1, 2), fill=2, last=True)  # final chunk re-sends block 1
    assert st.wait_layer("t", 0, deadline=time.monotonic())
    assert not st.wait_layer("t", 1, deadline=time.monotonic())
    _land(st, "t", 1, (0, 1, 2), fill=3, last=True)
    assert st.wait_layer("t", 1, deadline=time.monotonic())
    assert _landed(st, "t", 0, 1) == b"\x02" * 8  # the final version
    assert _landed(st, "t", 0, 0) == b"\x01" * 8
    st.drop("t")
    assert st.used_bytes == 0 and len(st) == 0


def test_staging_lands_a_layer_as_runs_of_rows_placed_by_one_copy_each() -> None:
    """A layer pushed in one batch is one run of rows (one copy and one scatter on decode); a
    partial block re-sent by the next chunk comes from that chunk."""
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    _land(st, "t", 0, (0, 1, 2, 3), fill=1, last=True)
    runs, missing = st.landed_runs("t", 0, [0, 1, 2, 3], 8)
    assert missing == [] and [idxs for idxs, _ in runs] == [[0, 1, 2, 3]]
    assert runs[0][1].shape == (4, 8) and runs[0][1].is_contiguous()
    _land(st, "t", 1, (0, 1), fill=1, last=False)
    _land(st, "t", 1, (1, 2), fill=2, last=True)
    runs, missing = st.landed_runs("t", 1, [0, 1, 2, 5], 8)
    assert missing == [3] and [idxs for idxs, _ in runs] == [[0], [1, 2]]
    assert bytes(runs[1][1].flatten().numpy()) == b"\x02" * 16
    assert st.landed_runs("t", 1, [0], 16) == ([], [0])  # blocks of another size are not ours


def test_staging_drops_a_batch_a_newer_one_re_sends_whole() -> None:
    """Bounded memory: a batch whose every position a newer batch carries is freed at once."""
    st = PushStaging(capacity_bytes=32, ttl_s=60)
    _land(st, "t", 0, (0, 1), fill=1, last=False)
    _land(st, "t", 0, (1, 2), fill=2, last=False)  # position 0 still from the first: both kept
    assert st.used_bytes == 32
    assert st.destinations(BlockBatch("t", 0, (0, 1, 2), 8)) is not None  # fits: it frees both
    assert st.used_bytes == 24


def test_staging_failed_batch_is_not_landed() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    _land(st, "t", 0, (0,), fill=1, last=True, ok=False)
    assert _landed(st, "t", 0, 0) is None


def test_staging_capacity_rejects_and_expiry_frees() -> None:
    st = PushStaging(capacity_bytes=16, ttl_s=0.05)
    _land(st, "a", 0, (0, 1), fill=1, last=True)
    assert st.destinations(BlockBatch("b", 0, (0,), 8)) is None  # full
    assert st.rejected_total == 1
    time.sleep(0.06)
    st.expire()
    assert st.used_bytes == 0
    assert st.destinations(BlockBatch("b", 0, (0,), 8)) is not None


def test_staging_views_write_into_its_buffers() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    batch = BlockBatch("t", 0, (0,), 4, last=True)
    [view] = st.destinations(batch)
    view[:] = b"abcd"
    st.landed(batch, True)
    assert _landed(st, "t", 0, 0, nbytes=4) == b"abcd"


# ---- decode leg sent beside the prefill leg (awaited push) -----------------------------------------
def test_push_done_message_round_trip() -> None:
    msg = PrefillDoneMessage("k1", _remote(transfer_id="k1").to_params())
    assert decode_control(msg.encode()) == msg


def test_staging_announcement_and_abandoned_pushes() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    assert st.wait_announced("k", deadline=time.monotonic()) is None
    assert st.announce("k", {"x": 1}) is False
    assert st.wait_announced("k", deadline=time.monotonic()) == {"x": 1}
    # abandoned after the announcement: handed back for release at once, bytes dropped
    _land(st, "k", 0, (0,), fill=1, last=True)
    assert st.abandon("k") == {"x": 1}
    assert st.used_bytes == 0 and len(st) == 0
    # abandoned before: later pushes are refused, the announcement is to be released
    assert st.abandon("j") is None
    assert st.destinations(BlockBatch("j", 0, (0,), 8)) is None
    assert st.announce("j", {"y": 2}) is True
    assert len(st) == 0


class _RecordingTransport:
    """Stands in for the TCP transport: a LoadJob of an awaited push only notifies (release);
    fetches are tested over real sockets in test_transport_*."""

    def __init__(self) -> None:
        self.notified: list[tuple[str, bytes]] = []

    def notify(self, peer: str, message: bytes, timeout: float) -> Future:
        self.notified.append((peer, message))
        fut: Future = Future()
        fut.set_result(b"ok")
        return fut

    def fetch(self, *args, **kwargs) -> Future:
        raise AssertionError("everything was pushed: nothing to fetch")


def _awaited_job(st: PushStaging, prompt: list[int], timeout_s: float = 2.0, rank: int = 0, tp_size: int = 1):
    regions = [MemoryRegion(f"l{i}", torch.zeros(4, 8, dtype=torch.uint8)) for i in range(2)]
    spec = LoadSpec(
        request_id="d-1",
        transfer_id="k",
        remote=None,
        first_position=0,
        local_block_ids=(3, 1),
        prompt=LocalPrompt(prompt_hash(prompt), len(prompt), block_size=2, tp_size=tp_size),
    )
    transport = _RecordingTransport()
    access = DirectAccess(BlockCopies(regions, HostDevice()))
    job = LoadJob(
        spec, transport, regions, st, access, rank=rank, timeout_s=timeout_s, push_wait_s=1.0, tp_size=tp_size
    )
    return job, regions, transport


def test_load_job_of_awaited_push_checks_the_announcement_then_copies_and_releases() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, regions, transport = _awaited_job(st, [5, 6, 7])
    for layer in range(2):
        _land(st, "k", layer, (0, 1), fill=10 + layer, last=True)
    st.announce(
        "k",
        _remote(
            mode="push",
            transfer_id="k",
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash([5, 6, 7]),
        ).to_params(),
    )
    job.run()
    assert job.ok and job.blocks_from_push == 4
    assert bytes(regions[1].tensor[3].numpy()) == b"\x0b" * 8 and bytes(regions[0].tensor[1].numpy()) == b"\x0a" * 8
    assert transport.notified == [("tcp://10.0.0.1:5000", ReleaseMessage("k").encode())]
    assert len(st) == 0


class _UnansweredOnceTransport(_RecordingTransport):
    """The first release goes unanswered (a prefill rank too busy to answer in time)."""

    def notify(self, peer: str, message: bytes, timeout: float) -> Future:
        fut = super().notify(peer, message, timeout)
        if len(self.notified) == 1:
            fut = Future()
            fut.set_exception(TransferTimeout(f"NOTIFY to {peer} timed out"))
        return fut


def test_load_job_retries_its_release_when_prefill_does_not_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """One lost answer must not leave prefill holding the blocks (and stepping) for its whole lease."""
    from vllm_pd.connector.worker import release

    monkeypatch.setattr(release, "RELEASE_BACKOFF_S", 0.05)
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, _, _ = _awaited_job(st, [5, 6, 7])
    transport = job._transport = _UnansweredOnceTransport()
    job._release = release.DecodeRelease(transport, 0, 1)
    for layer in range(2):
        _land(st, "k", layer, (0, 1), fill=1, last=True)
    st.announce(
        "k",
        _remote(
            mode="push",
            transfer_id="k",
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash([5, 6, 7]),
        ).to_params(),
    )
    job.run()
    deadline = time.monotonic() + 5
    while len(transport.notified) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert transport.notified == [("tcp://10.0.0.1:5000", ReleaseMessage("k").encode())] * 2


@pytest.mark.parametrize(
    "transfer_id, prompt, problem",
    [
        ("k", [5, 6, 8], "not for this request: prompt differs"),
        ("other", [5, 6, 7], "not for this request: prefill's answer names transfer other"),
    ],
)
def test_load_job_of_awaited_push_refuses_kv_of_another_prompt_or_transfer(
    transfer_id: str, prompt: list[int], problem: str
) -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, regions, transport = _awaited_job(st, [5, 6, 7])
    for layer in range(2):
        _land(st, "k", layer, (0, 1), fill=1, last=True)
    st.announce(
        "k",
        _remote(
            mode="push",
            transfer_id=transfer_id,
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash(prompt),
        ).to_params(),
    )
    job.run()
    assert not job.ok and problem in job.error
    assert not regions[0].tensor.any()  # not one byte of it used
    # prefill still told to release, under the name its answer gave
    assert transport.notified == [("tcp://10.0.0.1:5000", ReleaseMessage(transfer_id).encode())]


def test_load_job_of_awaited_push_never_announced_fails_and_abandons() -> None:
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, _, transport = _awaited_job(st, [5, 6, 7], timeout_s=0.05)
    job.run()
    assert not job.ok and "never announced" in job.error and transport.notified == []
    assert st.announce("k", {"late": True}) is True  # the late announcement gets released by the worker


# ---- releases reach every prefill TP rank -----------------------------------------------------------
PREFILL_TP2 = dict(tp_size=2, endpoints=("tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"))


def _announce_tp(st: PushStaging, **tp) -> None:
    for layer in range(2):
        _land(st, "k", layer, (0, 1), fill=10 + layer, last=True)
    st.announce(
        "k",
        _remote(
            mode="push",
            transfer_id="k",
            block_ids=(8, 9),
            num_tokens=3,
            block_size=2,
            prompt_hash=prompt_hash([5, 6, 7]),
            **tp,
        ).to_params(),
    )


def test_load_job_of_equal_tp_releases_only_the_rank_it_loaded_from() -> None:
    """Decode rank 1 of 2 took prefill rank 1's shard (pushed to it): it releases rank 1 only."""
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, _, transport = _awaited_job(st, [5, 6, 7], rank=1, tp_size=2)
    _announce_tp(st, **PREFILL_TP2)
    job.run()
    assert job.ok
    assert transport.notified == [("tcp://10.0.0.1:5001", ReleaseMessage("k").encode())]


def test_load_job_of_another_prefill_tp_refuses_the_kv_and_releases_every_prefill_rank() -> None:
    """Prefill TP 2, decode TP 1: rank r of one holds another shard of the heads than rank r of the
    other, so nothing is loaded (decode recomputes) and decode's one rank frees both prefill ranks."""
    st = PushStaging(capacity_bytes=1 << 20, ttl_s=60)
    job, regions, transport = _awaited_job(st, [5, 6, 7], rank=0, tp_size=1)
    _announce_tp(st, **PREFILL_TP2)
    job.run()
    assert not job.ok and "prefill TP 2 != ours 1" in job.error
    assert not regions[0].tensor.any()
    assert [peer for peer, _ in transport.notified] == ["tcp://10.0.0.1:5000", "tcp://10.0.0.1:5001"]


class _ReleaseSink(RecordingSink):
    """A prefill rank's KV endpoint: records the release messages it gets."""

    def __init__(self) -> None:
        super().__init__(make_regions(1, 4))
        self.releases: list[str] = []

    def on_notify(self, peer: str, message: bytes) -> bytes | None:
        msg = decode_control(message)
        assert isinstance(msg, ReleaseMessage)
        self.releases.append(msg.transfer_id)
        return b"ok"


def test_proxy_side_release_reaches_every_prefill_rank_over_tcp() -> None:
    from vllm_pd.connector.worker.release import release_remote_kv

    ranks = [_ReleaseSink() for _ in range(2)]
    transports = [create_transport("tcp") for _ in ranks]
    try:
        endpoints = []
        for t, sink in zip(transports, ranks):
            t.register_regions(sink.regions)
            endpoints.append(t.start(sink, "127.0.0.1", 0))
        params = _remote(tp_size=2, endpoints=tuple(endpoints), endpoint=endpoints[0]).to_params()
        assert release_remote_kv(params)
        assert [sink.releases for sink in ranks] == [["cmpl-1-0-abc"], ["cmpl-1-0-abc"]]
        # a rank that is gone: the others are still told; False says the lease frees the rest
        transports[1].close()
        assert not release_remote_kv(params, timeout=0.5)
        assert ranks[0].releases == ["cmpl-1-0-abc"] * 2
    finally:
        for t in transports:
            t.close()


def test_gauges_are_kept_per_tp_rank_through_the_engines_aggregation() -> None:
    """vLLM aggregates the workers' stats into one object per step: a rank still holding KV must not
    be hidden by another rank's 0 (nor by a rank that reported nothing new this interval)."""
    from vllm_pd.connector.stats import PDConnectorStats

    ranks = [PDConnectorStats(rank=r) for r in range(2)]
    ranks[0].set_gauges(held=0, loading=0, staged_bytes=0)
    ranks[1].set_gauges(held=1, loading=0, staged_bytes=64)
    step1 = ranks[0].take().aggregate(ranks[1].take())
    assert step1.data["gauges"] == {
        "0": {"held_transfers": 0, "loading_requests": 0, "staged_bytes": 0},
        "1": {"held_transfers": 1, "loading_requests": 0, "staged_bytes": 64},
    }
    assert step1.reduce()["held_transfers"] == 1 and step1.reduce()["staged_bytes"] == 64
    ranks[1].set_gauges(held=0, loading=0, staged_bytes=0)  # released; rank 0 has nothing new
    assert ranks[0].take() is None
    step2 = ranks[1].take()
    assert step2 is not None and step2.data["gauges"] == {
        "1": {"held_transfers": 0, "loading_requests": 0, "staged_bytes": 0}
    }
    assert step1.aggregate(step2).reduce()["held_transfers"] == 0  # the engine's running view: all ranks 0


def test_decode_release_is_retried_until_the_prefill_rank_answers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill rank that does not answer (here: not listening yet) still gets decode's release."""
    from vllm_pd.connector.worker import release
    from vllm_pd.vllm_server import free_port

    monkeypatch.setattr(release, "RELEASE_BACKOFF_S", 0.2)
    port = free_port()
    sink, prefill, decode = _ReleaseSink(), create_transport("tcp"), create_transport("tcp")
    try:
        release.send_release(decode, f"tcp://127.0.0.1:{port}", "cmpl-late-0")  # refused: retried
        prefill.register_regions(sink.regions)
        prefill.start(sink, "127.0.0.1", port)
        deadline = time.monotonic() + 10
        while not sink.releases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.releases == ["cmpl-late-0"]
    finally:
        prefill.close()
        decode.close()


def test_decode_release_gives_up_after_its_attempts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from vllm_pd.connector.worker import release
    from vllm_pd.vllm_server import free_port

    monkeypatch.setattr(release, "RELEASE_BACKOFF_S", 0.05)
    decode = create_transport("tcp")
    try:
        with caplog.at_level("WARNING"):
            release.send_release(decode, f"tcp://127.0.0.1:{free_port()}", "cmpl-gone-0")
            deadline = time.monotonic() + 10
            while "failed 4 times" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
        assert "release of cmpl-gone-0" in caplog.text and f"failed {release.RELEASE_ATTEMPTS} times" in caplog.text
    finally:
        decode.close()
