"""Node-to-node fetch: the pool exchange protocol over the real TCP transport; a client of a dead master.
(Two store nodes, scheduler + worker facades on real tensors, through a real master process: fetched through
the master, stale master entries, dead master, the proxy's hint: tests/integration/test_store_peer_master.py.)"""

import time

import pytest
import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.master_client import MasterClient
from vllm_pd.connector.store.pool_exchange import PoolExchange, SlotDirectory
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, chain_keys
from vllm_pd.vllm_server import free_port

# ---- the protocol: two pools on the TCP transport -------------------------------------------

SLOTS, LAYERS, LAYER_NBYTES = 8, 2, 64
KEYS = chain_keys(list(range(16)), KeySalt("m", "bf16", "cpu", 4, LAYERS))
SCOPE = NO_EXTRA_KEYS.scope(KeySalt("m", "bf16", "cpu", 4, LAYERS))  # plain requests'


def exchange(seed: int) -> PoolExchange:
    pool = CpuBlockPool(SLOTS, LAYERS, LAYER_NBYTES)
    pool.data.copy_(
        torch.randint(0, 256, pool.data.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    )
    ex = PoolExchange(pool, SlotDirectory(), timeout_s=1.0)
    ex.start("127.0.0.1", "127.0.0.1")
    return ex


@pytest.fixture
def pair():
    a, b = exchange(1), exchange(2)
    for i, key in enumerate(KEYS):  # a holds the chain in slots 4..7
        a.directory.put(key, 4 + i, a.pool.checksum(4 + i), SCOPE)
    yield a, b
    a.close()
    b.close()


def eventually(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.02)
    return bool(fn())


def test_fetch_lands_verified_blocks_and_releases_the_grant(pair):
    a, b = pair
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert len(sums) == 4
    assert torch.equal(b.pool.data[0:4], a.pool.data[4:8])
    assert sums == [a.pool.checksum(s) for s in range(4, 8)]
    assert a.stats["served_blocks"] == 4 and b.stats["fetched_blocks"] == 4
    assert eventually(lambda: a.live_grants == 0)  # released right after the fetch
    # a grant covers exactly the granted slots: a read of anything else is refused
    from vllm_pd.errors import TransferRejected

    with pytest.raises(TransferRejected):
        b.transport.fetch(a.endpoint, "store-made-up", 0, [4], [5], 1.0).result(timeout=5)


def test_fetched_blocks_are_rehashed_before_they_count(pair):
    """A holder whose bytes are not what its checksums claim (broken, or forged by someone who
    published it) gets the run before the mismatch counted, nothing after: the asker never
    commits or advertises a peer's word. Negative control: its claims are true for slots 4, 5."""
    a, b = pair
    a.pool.data[6].fill_(0)  # slot 6's bytes changed after its checksum was taken
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert sums == [a.pool.checksum(4), a.pool.checksum(5)]
    assert b.stats["fetched_blocks"] == 2


def test_grant_covers_only_the_leading_blocks_still_held(pair):
    a, b = pair
    a.directory.drop_slots([6])  # KEYS[2] evicted on a (stale master entry)
    before = b.pool.data.clone()
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert len(sums) == 2
    assert torch.equal(b.pool.data[0:2], a.pool.data[4:6])
    assert torch.equal(b.pool.data[2:], before[2:])  # nothing else written


def test_block_overwritten_after_its_grant_is_rejected(pair):
    a, b = pair
    held_of = a._held

    def grant_then_reuse_slot(keys, scope):
        held = held_of(keys, scope)
        a.directory.drop_slots([5])  # a save reuses KEYS[1]'s slot right after the grant ...
        a.pool.data[5].add_(1)  # ... and writes it while it is being sent
        return held

    a._held = grant_then_reuse_slot
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert len(sums) == 1  # KEYS[0] only: never a wrong block, not the ones after it either
    assert eventually(lambda: a.live_grants == 0)


def test_release_of_an_unknown_or_expired_grant_counts_nothing(pair):
    a, _ = pair
    from vllm_pd.connector.store.pool_exchange import _decoder, _encoder
    from vllm_pd.protocol.store_peer import ReleaseBlocks, Released

    assert _decoder.decode(a.on_notify("x", _encoder.encode(ReleaseBlocks("store-nope")))) == Released(0)


def test_gone_peer_fetches_nothing_within_the_timeout(pair):
    a, b = pair
    endpoint = a.endpoint
    a.close()
    t0 = time.monotonic()
    assert b.fetch(endpoint, KEYS, [0, 1], SCOPE) == []
    assert time.monotonic() - t0 < 3.0
    assert b.fetch("tcp://127.0.0.1:1", KEYS, [0], SCOPE) == []  # nobody listening there at all


def test_a_block_of_another_scope_is_not_granted_under_its_key(pair):
    """The holder's directory records each block's scope (adapter, cache salt); a grant for another
    scope stops at it (a key collision or a bug that dropped extra keys), the blocks before it
    are still served. Negative control: asked for their own scope, all four are."""
    a, b = pair
    other = NO_EXTRA_KEYS.scope(KeySalt("other-model", "bf16", "cpu", 4, LAYERS))
    a.directory.put(KEYS[2], 6, a.pool.checksum(6), other)
    assert len(b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)) == 2
    a.directory.put(KEYS[2], 6, a.pool.checksum(6), SCOPE)
    assert len(b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)) == 4
    assert b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], other) == []


def test_directory_forgets_a_slot_before_it_is_rewritten():
    d = SlotDirectory()
    d.put(KEYS[0], 3, b"x", SCOPE)
    d.put(KEYS[1], 4, b"y", SCOPE)
    assert d.leading(KEYS, SCOPE) == [(3, b"x"), (4, b"y")]
    d.put(KEYS[2], 3, b"z", SCOPE)  # slot 3 reused for another key
    assert d.leading(KEYS, SCOPE) == [] and d.leading(KEYS[1:], SCOPE) == [(4, b"y"), (3, b"z")]
    d.drop_slots([4])
    assert d.leading(KEYS[1:], SCOPE) == [] and len(d) == 1


def test_fetch_timeout_is_validated():
    from vllm_pd.errors import ConfigError

    assert StoreConfig.from_dict({"fetch_timeout_s": 0.5}).fetch_timeout_s == 0.5
    with pytest.raises(ConfigError, match="fetch_timeout_s"):
        StoreConfig.from_dict({"fetch_timeout_s": 0})


def test_a_dead_master_is_retried_ever_more_rarely():
    client = MasterClient(f"tcp://127.0.0.1:{free_port()}", "n", "", lambda: [], timeout_s=0.05, retry_after_s=1.0)
    try:
        assert client.lookup(KEYS) is None and not client.available  # nobody there: down for 1 s
        time.sleep(1.1)
        assert client.available
        assert client.lookup(KEYS) is None  # fails again: down for 2 s now
        time.sleep(1.1)
        assert not client.available
    finally:
        client.close()
