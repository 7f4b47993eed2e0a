"""Node-to-node fetch: the pool exchange protocol over the real TCP transport,
then two store nodes (scheduler + worker facades, real tensors) and a real
master process: fetched through the master, stale master entries, dead master."""

import time

import pytest
import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.cpu_pool import CpuBlockPool
from vllm_pd.connector.store.master_client import MasterClient
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.connector.store.pool_exchange import PoolExchange, SlotDirectory
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, chain_keys
from vllm_pd.protocol.transfer_params import StoreFetch
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


# ---- two store nodes through a real master ----------------------------------------------------

BS, NBLOCKS = 4, 32
SALT = KeySalt("test-model", "bfloat16", "cpu", BS, LAYERS)
SLOT_NBYTES = LAYERS * 2 * BS * 8 * 2


class Node:
    """One scheduler + one worker (rank 0) serving its pool, stepping like vLLM."""

    def __init__(self, name: str, master: str, seed: int, host: str = "127.0.0.1", **cfg) -> None:
        g = torch.Generator().manual_seed(seed)
        self.kv = [torch.randn(NBLOCKS, 2, BS, 8, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]
        config = StoreConfig(
            cpu_bytes=cfg.pop("slots", 16) * SLOT_NBYTES,
            master=master,
            master_timeout_s=2.0,
            node_id=name,
            fetch_timeout_s=1.0,
            **cfg,
        )
        self.worker = StoreWorker(config, SALT, self.kv)
        endpoint = self.worker.serve_peers(host, host)
        self.sched = StoreScheduler(config, SALT, SLOT_NBYTES, endpoint=endpoint)

    def step(self) -> None:
        self.worker.execute(self.sched.build_plan())
        self.worker.wait_disk()
        for layer in range(LAYERS):
            self.worker.wait_layer(layer)
        self.sched.on_worker_report(self.worker.report())
        self.sched.build_plan()  # publishes what committed

    def close(self) -> None:
        self.worker.close()
        if self.sched.master is not None:
            self.sched.master.close()


@pytest.fixture
def master():
    proc, address = spawn_master(free_port())
    yield proc, address
    proc.kill()
    proc.wait()


@pytest.fixture
def nodes(master):
    proc, address = master
    a, b = Node("a", address, seed=1), Node("b", address, seed=2)
    yield a, b, proc
    a.close()
    b.close()


TOKS = list(range(100, 113))  # 3 full blocks + 1 token


def save_on(node: Node, block_ids=(3, 7, 9)) -> None:
    node.sched.plan_save("r-a", TOKS, list(block_ids))
    node.step()


def test_blocks_come_from_another_node_through_the_master(nodes):
    a, b, _ = nodes
    save_on(a)
    hit, remote = b.sched.match_with_remote(TOKS[:-1])
    assert hit == 12 and remote is not None and remote.node == "a" and remote.endpoint == a.worker.exchange.endpoint
    op, missing = b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    assert op is not None and not missing and op.from_peer == [True] * 3
    assert b.sched.match(TOKS) == 0  # reserved, not committed yet
    b.step()
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][[20, 21, 22]], a.kv[layer][[3, 7, 9]])
    assert b.worker.take_load_errors() == set()
    assert b.sched.match(TOKS) == 12  # two-phase put done: now a local hit on b
    assert b.sched.stats["remote_blocks"] == 3
    assert b.sched.match_with_remote(TOKS[:-1]) == (12, None)  # the master is not asked again


def test_local_prefix_then_the_rest_from_the_peer(nodes):
    a, b, _ = nodes
    save_on(a)
    b.sched.plan_save("r-b0", TOKS[:4], [5])  # b has the first block itself
    b.step()
    hit, remote = b.sched.match_with_remote(TOKS[:-1])
    assert hit == 12 and remote is not None
    op, _ = b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    assert op.from_peer == [False, True, True]
    b.step()
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][20], b.kv[layer][5])
        assert torch.equal(b.kv[layer][[21, 22]], a.kv[layer][[7, 9]])
    assert b.sched.match(TOKS) == 12


def test_stale_master_entry_is_recomputed_never_wrong(nodes):
    a, b, _ = nodes
    save_on(a)
    second_slot = a.worker.directory.leading(chain_keys(TOKS, SALT), NO_EXTRA_KEYS.scope(SALT))[1][0]
    a.worker.directory.drop_slots([second_slot])  # a evicted (and reused) its second block
    _, remote = b.sched.match_with_remote(TOKS[:-1])  # the master still says a has 3 blocks
    assert remote is not None and remote.blocks == 3
    before = [t.clone() for t in b.kv]
    b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    b.step()
    assert b.worker.take_load_errors() == {21, 22}  # vLLM recomputes these
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][20], a.kv[layer][3])
        assert torch.equal(b.kv[layer][[21, 22]], before[layer][[21, 22]])
    assert b.sched.match(TOKS) == 4  # only the verified block committed
    # the reserved slots of the failed blocks went back to the pool
    assert b.sched.slots.free_count == b.sched.slots.num_slots - 1


def test_gone_node_is_recomputed(nodes):
    a, b, _ = nodes
    save_on(a)
    _, remote = b.sched.match_with_remote(TOKS[:-1])
    a.worker.exchange.close()  # node a dies; the master has not noticed yet
    b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    b.step()
    assert b.worker.take_load_errors() == {20, 21, 22}
    assert b.sched.match(TOKS) == 0 and b.sched.slots.free_count == b.sched.slots.num_slots


def test_dead_master_means_local_lookups_only(nodes):
    a, b, proc = nodes
    save_on(a)
    b.sched.plan_save("r-b0", TOKS[:4], [5])
    b.step()
    proc.kill()
    proc.wait()
    t0 = time.monotonic()
    assert b.sched.match_with_remote(TOKS[:-1]) == (4, None)  # its own block, bounded by the timeout
    assert time.monotonic() - t0 < 3.0
    assert b.sched.match_with_remote(TOKS[:-1]) == (4, None)  # backs off: no wait at all now
    op, missing = b.sched.plan_load("r-b", TOKS[:-1], 0, 4, [20])
    b.step()
    assert op is not None and not missing and b.worker.take_load_errors() == set()


def test_fetch_timeout_is_validated():
    from vllm_pd.errors import ConfigError

    assert StoreConfig.from_dict({"fetch_timeout_s": 0.5}).fetch_timeout_s == 0.5
    with pytest.raises(ConfigError, match="fetch_timeout_s"):
        StoreConfig.from_dict({"fetch_timeout_s": 0})


def test_without_disk_serving_the_master_advertises_only_blocks_in_cpu_slots(master, tmp_path):
    _, address = master
    a = Node("a", address, seed=1, slots=3, disk_path=str(tmp_path), disk_serve_bytes=0)
    b = Node("b", address, seed=2)
    try:
        save_on(a)
        assert b.sched.match_with_remote(TOKS[:-1])[1].blocks == 3
        other = list(range(500, 513))
        a.sched.plan_save("r-a2", other, [1, 2, 4])  # needs all 3 slots: TOKS's blocks stay on disk only
        a.step()
        assert a.sched.match(TOKS) == 12  # still a local (disk) hit on a ...
        assert b.sched.match_with_remote(TOKS[:-1]) == (0, None)  # ... but nothing a peer could fetch
        op, _ = a.sched.plan_load("r-a3", TOKS[:-1], 0, 12, [20, 21, 22])  # a reads them back into slots
        assert op is not None and all(op.from_disk)
        a.step()
        assert b.sched.match_with_remote(TOKS[:-1])[1].blocks == 3  # servable again
    finally:
        a.close()
        b.close()


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


# ---- the proxy's store_fetch hint (kv_aware routing with --store-master) ----------------------------


def test_hint_fetches_without_asking_the_master(nodes):
    a, b, proc = nodes
    save_on(a)
    proc.kill()  # with the master gone, only the hint can say where the blocks are
    proc.wait()
    hint = StoreFetch("a", a.worker.exchange.endpoint, 4)  # the prompt's 4th block is never asked for: capped
    t0 = time.monotonic()
    hit, remote = b.sched.match_with_remote(TOKS[:-1], fetch=hint)
    assert time.monotonic() - t0 < 0.5  # no master call (its timeout is 2 s here)
    assert hit == 12 and remote is not None and (remote.node, remote.blocks) == ("a", 3)
    op, missing = b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    assert op is not None and not missing and op.from_peer == [True] * 3
    b.step()
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][[20, 21, 22]], a.kv[layer][[3, 7, 9]])
    assert b.worker.take_load_errors() == set() and b.sched.match(TOKS) == 12


def test_hint_no_longer_than_the_local_prefix_or_naming_this_node_is_not_used(nodes):
    a, b, _ = nodes
    save_on(a)
    b.sched.plan_save("r-b0", TOKS[:8], [5, 6])
    b.step()
    assert b.sched.match_with_remote(TOKS[:-1], fetch=StoreFetch("a", a.worker.exchange.endpoint, 2)) == (8, None)
    assert b.sched.match_with_remote(TOKS[:-1], fetch=StoreFetch("b", "tcp://b:1", 3)) == (8, None)


def test_stale_hint_costs_a_failed_verified_fetch_then_a_recompute(nodes):
    """The proxy's hint names a node that meanwhile lost the blocks: its grant covers none of them
    (the holder's directory decides, not the hint), the fetch fails, vLLM recomputes them, and
    nothing lands or commits. (A block overwritten after its grant fails the checksum instead:
    test_block_overwritten_after_its_grant_is_rejected.)"""
    a, b, _ = nodes
    save_on(a)
    hint = StoreFetch("a", a.worker.exchange.endpoint, 3)
    held = a.worker.directory.leading(chain_keys(TOKS, SALT), NO_EXTRA_KEYS.scope(SALT))
    a.worker.directory.drop_slots([s for s, _ in held])
    before = [t.clone() for t in b.kv]
    hit, remote = b.sched.match_with_remote(TOKS[:-1], fetch=hint)
    assert hit == 12 and remote is not None  # believed: the hint is all b has
    b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    b.step()
    assert b.worker.take_load_errors() == {20, 21, 22}  # vLLM recomputes them
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][[20, 21, 22]], before[layer][[20, 21, 22]])
    assert b.sched.match(TOKS) == 0 and b.sched.slots.free_count == b.sched.slots.num_slots
