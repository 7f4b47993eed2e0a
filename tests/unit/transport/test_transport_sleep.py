"""vLLM's sleep mode (0.33+: ``unregister_kv_caches`` / ``restore_kv_caches``) on every transport.

Sleep frees the KV cache's pages and maps new ones at the same addresses on wake-up. What runs here
is the transport's and the worker's side of it on CPU memory: between unregister and restore nothing
is served from or moved into the regions (control messages still go), nixl deregisters them and
registers them again, and after restore transfers work again with the new contents, nixl's with the
new registration (peers that had loaded the old one were disconnected). The page swap itself needs
vLLM's CuMem allocator on a GPU: here the "new pages" are the same memory, rewritten."""

from __future__ import annotations

import pytest
import torch

from tests.support.transport_harness import make_regions, started
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.transport.base import BlockBatch
from vllm_pd.connector.worker.worker import PDConnectorWorker
from vllm_pd.errors import TransferRejected

TRANSPORTS = ("tcp", "shm", "nixl")
TIMEOUT = 10.0


def blocks(regions, layer: int, ids: list[int]) -> list[bytes]:
    t = regions[layer].tensor
    return [bytes(t[i].contiguous().view(-1).view(torch.uint8).numpy()) for i in ids]


@pytest.fixture(params=TRANSPORTS)
def pair(request):
    """a (the side that sleeps) and b, each serving random regions."""
    if request.param == "nixl":
        pytest.importorskip("nixl")
    ra, rb = make_regions(2, 8, seed=1), make_regions(2, 8, seed=2)
    a, sink_a, ep_a = started(request.param, ra)
    b, sink_b, ep_b = started(request.param, rb)
    yield request.param, (a, ra, ep_a), (b, rb, ep_b)
    a.close()
    b.close()


def test_nothing_moves_while_unregistered_and_everything_after_restore(pair) -> None:
    name, (a, ra, ep_a), (b, rb, ep_b) = pair
    b.allow_fetch("t1", [0, 1])
    a.fetch(ep_b, "t1", 0, [0, 1], [4, 5], TIMEOUT).result(TIMEOUT)  # a dials b; nixl: b WRITEs a's memory
    assert blocks(ra, 0, [4, 5]) == blocks(rb, 0, [0, 1])
    a.allow_fetch("mine", [3])

    a.unregister_regions()
    a.unregister_regions()  # idempotent
    with pytest.raises(TransferRejected):  # our own transfers are refused
        a.fetch(ep_b, "t1", 0, [0], [6], TIMEOUT).result(TIMEOUT)
    with pytest.raises(TransferRejected):
        a.push(ep_b, BlockBatch("p", 0, (0,), ra[0].block_nbytes), [1], TIMEOUT).result(TIMEOUT)
    with pytest.raises(TransferRejected):  # grants made before the sleep are gone
        b.fetch(ep_a, "mine", 0, [3], [7], TIMEOUT).result(TIMEOUT)
    assert a.notify(ep_b, b"release", TIMEOUT).result(TIMEOUT) is not None  # control still goes
    if name == "nixl":
        assert a._side.region_handles == []  # type: ignore[attr-defined]

    for r in ra:  # wake-up: the same addresses hold other bytes now
        r.tensor.copy_(make_regions(1, 8, seed=3)[0].tensor)
    a.restore_regions()
    a.restore_regions()  # idempotent
    if name == "nixl":
        assert len(a._side.region_handles) == len(ra)  # type: ignore[attr-defined]
    a.allow_fetch("mine", [3])
    b.fetch(ep_a, "mine", 0, [3], [7], TIMEOUT).result(TIMEOUT)  # b dials a: a serves its new pages
    assert blocks(rb, 0, [7]) == blocks(ra, 0, [3])
    b.allow_fetch("t2", [2, 3])
    a.fetch(ep_b, "t2", 1, [2, 3], [0, 1], TIMEOUT).result(TIMEOUT)  # a dials b again: the new registration
    assert blocks(ra, 1, [0, 1]) == blocks(rb, 1, [2, 3])


def test_nixl_peers_never_keep_a_handshake_from_while_unregistered(monkeypatch) -> None:
    """A connection ``a`` dials while unregistered (a release on the way to sleep) hands ``b`` an
    agent without the regions; restore must close it. Negative control: kept open, NIXL's transfer
    into a's memory fails. (The other stale case, b keeping a's registration from before the sleep,
    fails on RDMA and GPU memory, whose keys name the old pages; UCX's same-host cma/shm keys name
    addresses and pass here, so on CPU it cannot be shown.)"""
    pytest.importorskip("nixl")
    ra, rb = make_regions(2, 8, seed=1), make_regions(2, 8, seed=2)
    a, _, ep_a = started("nixl", ra)
    b, _, ep_b = started("nixl", rb)
    try:
        b.allow_fetch("t1", [1])
        a.unregister_regions()
        a.notify(ep_b, b"release", TIMEOUT).result(TIMEOUT)  # dials b: a's agent as it is now
        monkeypatch.setattr(a, "_close_links", lambda: None)
        a.restore_regions()
        with pytest.raises(TransferRejected, match="memory not registered"):
            a.fetch(ep_b, "t1", 0, [1], [5], TIMEOUT).result(TIMEOUT)
        monkeypatch.undo()
        a._unregistered = True  # type: ignore[attr-defined]  # restore again, closing the link this time
        a.restore_regions()
        a.fetch(ep_b, "t1", 0, [1], [5], TIMEOUT).result(TIMEOUT)
        assert blocks(ra, 0, [5]) == blocks(rb, 0, [1])
    finally:
        a.close()
        b.close()


def test_a_worker_refuses_pushes_into_its_kv_while_unregistered() -> None:
    config = PDConnectorConfig.from_extra_config({"transport": "tcp", "host": "127.0.0.1", "bind_host": "127.0.0.1"})
    worker = PDConnectorWorker(config, block_size=16, tp_rank=0, base_port=0, is_producer=True, is_consumer=True)
    kv = {f"layer.{i}": r.tensor for i, r in enumerate(make_regions(2, 8))}
    worker.register_kv_caches(kv)
    try:
        batch = BlockBatch("t", 0, (0,), worker.regions[0].block_nbytes)
        worker.unregister_kv_caches()
        assert worker.destinations(batch) is None
        worker.restore_kv_caches()
        worker.restore_kv_caches()
        assert not worker._unregistered  # type: ignore[attr-defined]
    finally:
        worker.shutdown()
