"""A peer's fetch finds blocks on the holder's disk tier too: the holder stages
them (read + verified) into spare pool rows and serves them like pool slots.
The protocol over the real TCP transport with a real disk tier. (Two store nodes through a real master
process, the holder's CPU tier full or the holder restarted: tests/integration/test_store_peer_disk_master.py.)"""

import pytest
import torch

from tests.support.store_nodes import SALT
from tests.unit.store.test_store_peer import KEYS, LAYER_NBYTES, LAYERS, SCOPE, SLOTS, eventually
from vllm_pd.connector.store.cpu_pool import CpuBlockPool, checksum
from vllm_pd.connector.store.disk_staging import DiskStaging
from vllm_pd.connector.store.disk_tier import DiskTier
from vllm_pd.connector.store.pool_exchange import PoolExchange, SlotDirectory, _decoder, _encoder
from vllm_pd.protocol.block_keys import chain_keys
from vllm_pd.protocol.store_peer import GrantBlocks, ReleaseBlocks

SPARE = 4


def holder(tmp_path, spare: int = SPARE, ttl: float = 30.0) -> PoolExchange:
    """Pool slots 4, 5 hold KEYS[0:2]; KEYS[2:4] are only on disk; ``spare`` staging rows."""
    pool = CpuBlockPool(SLOTS + spare, LAYERS, LAYER_NBYTES)
    pool.data.copy_(
        torch.randint(0, 256, pool.data.shape, generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    )
    disk = DiskTier(tmp_path, SALT.digest(), 0, capacity_bytes=1 << 20)
    for i in (2, 3):  # written from slots 6, 7, which are then reused for something else
        disk.write(KEYS[i], KEYS[i - 1], pool.slot_view(4 + i), SCOPE).result()
    ex = PoolExchange(
        pool,
        SlotDirectory(),
        timeout_s=1.0,
        grant_ttl_s=ttl,
        staging=DiskStaging(pool, disk, range(SLOTS, SLOTS + spare)),
    )
    for i in (0, 1):
        ex.directory.put(KEYS[i], 4 + i, pool.checksum(4 + i), SCOPE)
    ex.start("127.0.0.1", "127.0.0.1")
    return ex


def asker() -> PoolExchange:
    ex = PoolExchange(CpuBlockPool(SLOTS, LAYERS, LAYER_NBYTES), SlotDirectory(), timeout_s=1.0)
    ex.start("127.0.0.1", "127.0.0.1")
    return ex


@pytest.fixture
def exchanges(tmp_path):
    made: list[PoolExchange] = []

    def make(**kw):
        a, b = holder(tmp_path, **kw), asker()
        made.extend([a, b])
        return a, b

    yield make
    for ex in made:
        ex.close()
        if ex.staging is not None:
            ex.staging.disk.close()


def test_blocks_on_the_holders_disk_are_fetched_after_its_cpu_blocks(exchanges):
    a, b = exchanges()
    expected = a.pool.data[4:8].clone()
    a.pool.data[6:8].zero_()  # the disk blocks' old slots now hold something else
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert len(sums) == 4 and a.stats["served_from_disk"] == 2
    assert torch.equal(b.pool.data[0:4], expected)
    assert sums == [checksum(memoryview(expected[i].numpy()).cast("B")) for i in range(4)]
    assert eventually(lambda: a.live_grants == 0 and a.staging.free_count == SPARE)  # rows given back
    assert len(a.directory) == 2  # the holder's own slots are untouched: nothing promoted
    assert a.take_served() == (2, 2) and a.take_served() == (0, 0)  # (from CPU, from disk), for /metrics


def test_served_blocks_reach_the_connectors_counters():
    from vllm_pd.connector.stats import PDConnectorStats

    stats = PDConnectorStats()
    stats.record_store_served(3, 2)
    out = stats.take()
    assert out is not None and out.reduce()["store_served_blocks_cpu"] == 3
    assert out.reduce()["store_served_blocks_disk"] == 2
    assert stats.take() is None  # counted once


def test_corrupt_disk_block_ends_the_run_and_is_dropped(exchanges):
    a, b = exchanges()
    path = next(p for p in a.staging.disk.dir.rglob(KEYS[3].hex()))
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    before = b.pool.data[3].clone()
    sums = b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)
    assert len(sums) == 3  # never the corrupt block
    assert torch.equal(b.pool.data[3], before)  # not a byte of it sent
    assert not a.staging.holds(KEYS[3]) and not path.exists()
    assert eventually(lambda: a.staging.free_count == SPARE)


def test_staging_rows_bound_what_is_served_from_disk(exchanges):
    a, b = exchanges(spare=1)
    assert len(b.fetch(a.endpoint, KEYS, [0, 1, 2, 3], SCOPE)) == 3  # 2 from CPU, 1 row for the disk part
    assert eventually(lambda: a.staging.free_count == 1)


def test_a_granted_row_stays_owned_until_release_or_expiry(exchanges):
    a, _ = exchanges(spare=2, ttl=0.3)
    grant = _decoder.decode(a.on_notify("x", _encoder.encode(GrantBlocks(KEYS, SCOPE))))
    assert len(grant.slots) == 4 and a.staging.free_count == 0
    again = _decoder.decode(a.on_notify("x", _encoder.encode(GrantBlocks(KEYS, SCOPE))))
    assert len(again.slots) == 2  # the rows are taken: only the CPU part
    assert _decoder.decode(a.on_notify("x", _encoder.encode(ReleaseBlocks(grant.transfer_id)))).intact == 4
    assert a.staging.free_count == 2
    _decoder.decode(a.on_notify("x", _encoder.encode(GrantBlocks(KEYS, SCOPE))))  # never released ...
    assert a.staging.free_count == 0
    assert eventually(lambda: (a._expire_grants(), a.staging.free_count)[1] == 2)  # ... rows back after the ttl


def test_nothing_on_disk_or_in_cpu_means_an_empty_grant(exchanges):
    a, b = exchanges()
    other = chain_keys(list(range(900, 916)), SALT)
    assert b.fetch(a.endpoint, other, [0, 1], SCOPE) == [] and a.staging.free_count == SPARE
