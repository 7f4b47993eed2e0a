"""A block only on the holder's disk tier, fetched by another node through a real master process (moved
from tests/unit/store/test_store_peer_disk.py: the master is a process of its own): the holder's CPU tier
full, the holder restarted. The nodes: tests/support/store_nodes.py."""

import torch

from tests.support.store_nodes import LAYERS, SALT, TOKS, Node, master, save_on  # noqa: F401 - the master fixture
from vllm_pd.protocol.block_keys import chain_keys


def evict_toks_to_disk(a: Node) -> None:
    save_on(a)
    a.sched.plan_save("r-a2", list(range(500, 513)), [1, 2, 4])  # needs all 3 slots
    a.step()
    assert all(a.sched.placement.location(k).slot is None for k in chain_keys(TOKS, SALT)[:3])


def fetch_toks_on(b: Node, expected: list[torch.Tensor]) -> None:
    hit, remote = b.sched.match_with_remote(TOKS[:-1])
    assert hit == 12 and remote is not None
    op, missing = b.sched.plan_load("r-b", TOKS[:-1], 0, 12, [20, 21, 22], remote=remote)
    assert op is not None and not missing and op.from_peer == [True] * 3
    b.step()
    assert b.worker.take_load_errors() == set()
    for layer in range(LAYERS):
        assert torch.equal(b.kv[layer][[20, 21, 22]], expected[layer])
    assert b.sched.match(TOKS) == 12


def test_a_block_only_on_the_holders_disk_is_fetched_through_the_master(master, tmp_path):  # noqa: F811
    _, address = master
    a = Node("a", address, seed=1, slots=3, disk_path=str(tmp_path))
    b = Node("b", address, seed=2)
    try:
        evict_toks_to_disk(a)
        fetch_toks_on(b, [kv[[3, 7, 9]] for kv in a.kv])
        assert a.worker.exchange.stats["served_from_disk"] == 3
        assert all(a.sched.placement.location(k).slot is None for k in chain_keys(TOKS, SALT)[:3])  # not promoted
    finally:
        a.close()
        b.close()


def test_a_restarted_holder_serves_what_it_finds_on_disk(master, tmp_path):  # noqa: F811
    _, address = master
    a = Node("a", address, seed=1, disk_path=str(tmp_path))
    save_on(a)
    expected = [kv[[3, 7, 9]].clone() for kv in a.kv]
    a.close()
    a = Node("a", address, seed=3, disk_path=str(tmp_path))  # empty CPU pool, other KV: only the disk has it
    b = Node("b", address, seed=2)
    try:
        a.sched.build_plan()  # publishes what the restart indexed
        fetch_toks_on(b, expected)
        assert a.worker.exchange.stats["served_from_disk"] == 3
    finally:
        a.close()
        b.close()
