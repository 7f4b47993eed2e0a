"""Two store nodes through a real master process (moved from tests/unit/store/test_store_peer.py: the
master is a process of its own): fetched through the master, stale master entries, a dead master, the
proxy's store_fetch hint. The nodes: tests/support/store_nodes.py."""

import time

import torch

from tests.support.store_nodes import LAYERS, SALT, TOKS, Node, master, nodes, save_on  # noqa: F401 - fixtures
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, chain_keys
from vllm_pd.protocol.transfer_params import StoreFetch


def test_blocks_come_from_another_node_through_the_master(nodes):  # noqa: F811
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


def test_local_prefix_then_the_rest_from_the_peer(nodes):  # noqa: F811
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


def test_stale_master_entry_is_recomputed_never_wrong(nodes):  # noqa: F811
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


def test_gone_node_is_recomputed(nodes):  # noqa: F811
    a, b, _ = nodes
    save_on(a)
    _, remote = b.sched.match_with_remote(TOKS[:-1])
    a.worker.exchange.close()  # node a dies; the master has not noticed yet
    b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    b.step()
    assert b.worker.take_load_errors() == {20, 21, 22}
    assert b.sched.match(TOKS) == 0 and b.sched.slots.free_count == b.sched.slots.num_slots


def test_dead_master_means_local_lookups_only(nodes):  # noqa: F811
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


def test_without_disk_serving_the_master_advertises_only_blocks_in_cpu_slots(master, tmp_path):  # noqa: F811
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


# ---- the proxy's store_fetch hint (kv_aware routing with --store-master) ----------------------------


def test_hint_fetches_without_asking_the_master(nodes):  # noqa: F811
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


def test_hint_no_longer_than_the_local_prefix_or_naming_this_node_is_not_used(nodes):  # noqa: F811
    a, b, _ = nodes
    save_on(a)
    b.sched.plan_save("r-b0", TOKS[:8], [5, 6])
    b.step()
    assert b.sched.match_with_remote(TOKS[:-1], fetch=StoreFetch("a", a.worker.exchange.endpoint, 2)) == (8, None)
    assert b.sched.match_with_remote(TOKS[:-1], fetch=StoreFetch("b", "tcp://b:1", 3)) == (8, None)


def test_stale_hint_costs_a_failed_verified_fetch_then_a_recompute(nodes):  # noqa: F811
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
