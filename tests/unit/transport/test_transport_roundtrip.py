"""push / fetch / notify between two real transports on 127.0.0.1, for every
transport: bytes arrive intact, in order, for many layers at once."""

from __future__ import annotations

import concurrent.futures as cf
import functools
import tempfile
from pathlib import Path

import pytest
import torch

from tests.support.tls_certs import issue, make_ca
from tests.support.transport_harness import make_regions, started
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.errors import TransferRejected, TransferTimeout
from vllm_pd.protocol.auth_handshake import DeploymentSecret

# shm moves block bytes by reading the peer's memory where the kernel allows it (here it
# does), else through its rings: both paths run every test. nixl: UCX over tcp + cma on this host.
TRANSPORTS = {
    "tcp": ("tcp", {}),
    "shm": ("shm", {}),
    "shm-rings": ("shm", {"cross_memory": False}),
    "nixl": ("nixl", {}),
}
# and each with a deployment secret: authenticated connections, sealed frames, keyed block checks
SECRET = DeploymentSecret(b"roundtrip-test-secret-0123456789", "test")
TRANSPORTS.update({f"{k}+secret": (name, {**opts, "secret": SECRET}) for k, (name, opts) in list(TRANSPORTS.items())})
# tcp with TLS (certificates made when the case runs), without and with the secret inside it
TRANSPORTS.update({"tcp+tls": ("tcp", {"tls": "pki"}), "tcp+tls+secret": ("tcp", {"tls": "pki", "secret": SECRET})})


@functools.cache
def _tls_settings():
    folder = Path(tempfile.mkdtemp(prefix="vllm-pd-tls-"))
    make_ca(folder)
    return issue(folder, "node")


@pytest.fixture(params=list(TRANSPORTS))
def pair(request):
    name, options = TRANSPORTS[request.param]
    if options.get("tls") == "pki":
        options = {**options, "tls": _tls_settings()}
    src_regions = make_regions(4, 64, seed=1)
    dst_regions = make_regions(4, 64, seed=None)
    a, a_sink, a_ep = started(name, src_regions, **options)
    b, b_sink, b_ep = started(name, dst_regions, **options)
    yield name, (a, a_sink, a_ep, src_regions), (b, b_sink, b_ep, dst_regions)
    a.close()
    b.close()


def test_push_lands_exact_bytes_at_sink_destinations(pair) -> None:
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[2].block_nbytes
    fut = a.push(b_ep, BlockBatch("req1", 2, (5, 6, 7), nbytes, last=True), [10, 11, 12], timeout=10)
    assert fut.result(10) is None
    assert torch.equal(dst[2].tensor[5:8], src[2].tensor[10:13])
    ((batch, ok),) = b_sink.wait_landed(1)
    assert ok and batch.transfer_id == "req1" and batch.positions == (5, 6, 7) and batch.last
    assert not torch.equal(dst[1].tensor[5:8], src[1].tensor[10:13])  # other layers untouched


def test_many_pushes_land_in_order(pair) -> None:
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[0].block_nbytes
    futs = [a.push(b_ep, BlockBatch(f"t{i}", 0, (i % 64,), nbytes), [i % 64], timeout=20) for i in range(300)]
    for f in futs:
        f.result(20)
    calls = b_sink.wait_landed(300)
    assert [c[0].transfer_id for c in calls] == [f"t{i}" for i in range(300)]
    assert all(ok for _, ok in calls)
    assert torch.equal(dst[0].tensor, src[0].tensor)


def test_all_layers_concurrently_both_directions(pair) -> None:
    _, (a, a_sink, a_ep, src), (b, _, b_ep, dst) = pair
    nbytes = src[0].block_nbytes
    ids = list(range(0, 64, 2))
    pushes = [a.push(b_ep, BlockBatch("x", layer, tuple(ids), nbytes), ids, timeout=20) for layer in range(4)]
    # meanwhile b pushes its (still zero) odd blocks back at a's even positions... of a copy layer
    a.allow_fetch("y", list(range(64)))
    fetches = [
        b.fetch(a_ep, "y", layer, list(range(1, 64, 2)), list(range(1, 64, 2)), timeout=20) for layer in range(4)
    ]
    for f in cf.as_completed(pushes + fetches, timeout=20):
        assert f.result() is None
    for layer in range(4):
        assert torch.equal(dst[layer].tensor, src[layer].tensor)


def test_fetch_lands_into_our_blocks(pair) -> None:
    _, (a, _, a_ep, src), (b, _, _, dst) = pair
    a.allow_fetch("req9", [3, 4, 9])
    b.fetch(a_ep, "req9", 3, [9, 3], [0, 63], timeout=10).result(10)
    assert torch.equal(dst[3].tensor[0], src[3].tensor[9])
    assert torch.equal(dst[3].tensor[63], src[3].tensor[3])
    assert not dst[3].tensor[1].any()


def test_fetch_needs_a_grant_of_exactly_those_blocks_and_revoke_works(pair) -> None:
    _, (a, _, a_ep, _), (b, _, _, dst) = pair
    with pytest.raises(TransferRejected, match="not granted"):
        b.fetch(a_ep, "never", 0, [1], [1], timeout=10).result(10)
    a.allow_fetch("g", [1, 2])
    with pytest.raises(TransferRejected, match=r"blocks \[3\]"):
        b.fetch(a_ep, "g", 0, [1, 3], [1, 3], timeout=10).result(10)
    b.fetch(a_ep, "g", 0, [1, 2], [1, 2], timeout=10).result(10)
    a.allow_fetch("g", None)
    dst[0].tensor[1].zero_()
    with pytest.raises(TransferRejected, match="not granted"):
        b.fetch(a_ep, "g", 0, [1], [1], timeout=10).result(10)
    assert not dst[0].tensor[1].any()  # a refused read writes nothing
    with pytest.raises(TransferRejected, match="out of range"):
        a.allow_fetch("big", [500])
        b.fetch(a_ep, "big", 0, [500], [1], timeout=10).result(10)


def test_notify_reply_and_none(pair) -> None:
    _, (a, _, a_ep, _), (b, _, b_ep, _) = pair
    assert a.notify(b_ep, b"release r1", timeout=10).result(10) == f"re:release r1 from {a_ep}".encode()
    assert a.notify(b_ep, b"none", timeout=10).result(10) is None
    assert b.notify(a_ep, b"x", timeout=10).result(10) == f"re:x from {b_ep}".encode()


def test_sink_rejection_fails_push_and_lands_nothing(pair) -> None:
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    b_sink.reject.add("nope")
    nbytes = src[0].block_nbytes
    with pytest.raises(TransferRejected, match="nope"):
        a.push(b_ep, BlockBatch("nope", 0, (1,), nbytes), [1], timeout=10).result(10)
    assert not dst[0].tensor[1].any()
    # the connection is still in sync: the next push works
    a.push(b_ep, BlockBatch("yes", 0, (2,), nbytes), [2], timeout=10).result(10)
    assert torch.equal(dst[0].tensor[2], src[0].tensor[2])
    assert [(c[0].transfer_id, c[1]) for c in b_sink.wait_landed(1)] == [("yes", True)]


def test_bad_arguments_raise_at_call(pair) -> None:
    _, (a, _, _, src), (_, _, b_ep, _) = pair
    nbytes = src[0].block_nbytes
    with pytest.raises(ValueError, match="out of range"):
        a.push(b_ep, BlockBatch("t", 0, (0,), nbytes), [64], timeout=1)
    with pytest.raises(ValueError, match="layer 7"):
        a.push(b_ep, BlockBatch("t", 7, (0,), nbytes), [0], timeout=1)
    with pytest.raises(ValueError, match="positions"):
        a.push(b_ep, BlockBatch("t", 0, (0, 1), nbytes), [0], timeout=1)
    with pytest.raises(ValueError, match="endpoint"):
        a.push("nonsense", BlockBatch("t", 0, (0,), nbytes), [0], timeout=1)


def test_quiet_pushes_settle_with_the_next_answer(pair) -> None:
    """A forward step's layers but the last go unanswered (one wake-up of the sender per
    step); the last's answer covers them, and every byte lands in order."""
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[0].block_nbytes
    for step in range(3):
        ids = [step * 8 + k for k in range(8)]
        quiet = [
            a.push(b_ep, BlockBatch(f"s{step}", layer, tuple(ids), nbytes), ids, timeout=20, answer=False)
            for layer in range(3)
        ]
        last = a.push(b_ep, BlockBatch(f"s{step}", 3, tuple(ids), nbytes, last=True), ids, timeout=20)
        assert last.result(20) is None
        assert all(f.done() and f.result() is None for f in quiet)  # settled by the same answer
    calls = b_sink.wait_landed(12)
    assert [(c[0].transfer_id, c[0].layer) for c in calls] == [(f"s{s}", lay) for s in range(3) for lay in range(4)]
    assert all(ok for _, ok in calls)
    for layer in range(4):
        assert torch.equal(dst[layer].tensor[:24], src[layer].tensor[:24])


def test_quiet_push_failure_is_answered_at_once(pair) -> None:
    _, (a, _, _, src), (_, b_sink, b_ep, _) = pair
    nbytes = src[0].block_nbytes
    b_sink.reject.add("refused")
    bad = a.push(b_ep, BlockBatch("refused", 0, (1,), nbytes), [1], timeout=20, answer=False)
    with pytest.raises(TransferRejected):
        bad.result(20)  # no later push needed: a failure is always answered
    good = a.push(b_ep, BlockBatch("fine", 0, (2,), nbytes), [2], timeout=20, answer=False)
    a.push(b_ep, BlockBatch("fine", 1, (2,), nbytes, last=True), [2], timeout=20).result(20)
    assert good.result(0) is None


def test_quiet_push_without_a_later_answer_times_out(pair) -> None:
    """The documented contract: a quiet push must be followed by an answered request."""
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[0].block_nbytes
    fut = a.push(b_ep, BlockBatch("alone", 0, (3,), nbytes), [3], timeout=0.5, answer=False)
    with pytest.raises(TransferTimeout):
        fut.result(10)
    ((batch, ok),) = b_sink.wait_landed(1)  # its bytes did land; only the answer never came
    assert ok and torch.equal(dst[0].tensor[3], src[0].tensor[3])


def test_small_push_behind_a_large_one_keeps_its_place(pair) -> None:
    """While the receiver stalls, pushes stop fitting the connection and go to the writer
    thread; a small push submitted after them must not overtake them by being sent from
    the caller's thread once it fits again."""
    _, (a, _, _, src), (_, b_sink, b_ep, dst) = pair
    nbytes = src[0].block_nbytes
    a.push(b_ep, BlockBatch("warm", 0, (0,), nbytes), [0], timeout=20).result(20)  # connected
    ids = list(range(64))
    b_sink.hold.clear()  # the receiver stops reading: socket buffers (or ring slots) fill up
    futs, want = [], []
    for rnd in range(16):  # 16 x 4 layers x 512 KiB: more than both kernels' buffers, or the ring
        for layer in range(4):
            futs.append(a.push(b_ep, BlockBatch(f"big{rnd}", layer, tuple(ids), nbytes), ids, timeout=60))
            want.append((f"big{rnd}", layer))
        futs.append(a.push(b_ep, BlockBatch(f"small{rnd}", 0, (5,), nbytes), [5], timeout=60))
        want.append((f"small{rnd}", 0))
    b_sink.hold.set()
    for f in futs:
        f.result(60)
    calls = b_sink.wait_landed(1 + len(futs), timeout=60)[1:]
    assert [(c[0].transfer_id, c[0].layer) for c in calls] == want
    assert all(ok for _, ok in calls)
