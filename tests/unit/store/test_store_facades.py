"""Scheduler + worker facades together, on real tensors shaped like vLLM's CPU KV cache."""

import logging
import os

import pytest
import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.errors import ConfigError
from vllm_pd.protocol.block_keys import KeySalt

BS, LAYERS, NBLOCKS = 4, 2, 64
SALT = KeySalt("test-model", "bfloat16", "cpu", BS, LAYERS)
SLOT_NBYTES = LAYERS * 2 * BS * 8 * 2  # heads=2, 2*head=8, bf16


def kv_caches(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NBLOCKS, 2, BS, 8, generator=g).to(torch.bfloat16) for _ in range(LAYERS)]


class Node:
    """One scheduler + one worker (one rank), stepping like vLLM does."""

    def __init__(self, cfg, seed=0, world_size=1, caches=None):
        self.kv = caches if caches is not None else kv_caches(seed)
        self.sched = StoreScheduler(cfg, SALT, SLOT_NBYTES, world_size=world_size)
        self.worker = StoreWorker(cfg, SALT, self.kv)
        assert self.worker.slot_nbytes == SLOT_NBYTES

    def step(self):
        self.worker.execute(self.sched.build_plan())
        self.worker.wait_disk()
        for layer in range(LAYERS):
            self.worker.wait_layer(layer)
        self.sched.on_worker_report(self.worker.report())

    def close(self):
        self.worker.close()


def tokens(n, base=0):
    return [base + i for i in range(n)]


def blocks(kv, ids):
    return [layer[ids].clone() for layer in kv]


def test_two_phase_put_then_layerwise_load_restores_bytes():
    node = Node(StoreConfig(cpu_bytes=32 * SLOT_NBYTES))
    toks = tokens(10)  # 2 full blocks + a partial one (not stored)
    op = node.sched.plan_save("r1", toks, [5, 9, 11])
    assert op is not None and op.keys and len(op.slots) == 2
    assert node.sched.match(toks) == 0  # reserved, not committed: not a hit
    node.step()
    assert node.sched.match(toks) == 8
    assert node.sched.match(toks[:7]) == 4 and node.sched.match(tokens(10, base=1)) == 0
    want = blocks(node.kv, [5, 9])
    for layer in node.kv:
        layer[20:22] = 0
    op, missing = node.sched.plan_load("r2", toks, 0, 8, [20, 21])
    assert missing == [] and op.from_disk == [False, False]
    node.step()
    assert all(torch.equal(a, b) for a, b in zip(blocks(node.kv, [20, 21]), want))
    assert node.worker.take_load_errors() == set()
    assert node.sched.plan_save("r3", toks, [5, 9]) is None  # already stored
    node.close()


def test_memory_pressure_keeps_bounds_and_never_serves_evicted_blocks():
    cap = 6
    node = Node(StoreConfig(cpu_bytes=cap * SLOT_NBYTES))
    chains = [tokens(12, base=1000 * i) for i in range(8)]  # 3 blocks each, 24 blocks >> 6 slots
    for i, toks in enumerate(chains):
        node.sched.plan_save(f"s{i}", toks, [3 * i % NBLOCKS, (3 * i + 1) % NBLOCKS, (3 * i + 2) % NBLOCKS])
        node.step()
        assert len(node.sched.cache) <= cap and node.sched.slots.free_count >= 0
        nodes = (node.sched.index.get(k) for k in node.sched.index.keys())
        slots = [n.value.slot for n in nodes if n.value.slot is not None]
        assert len(slots) == len(set(slots)) <= cap
    assert node.sched.match(chains[-1]) == 12
    assert node.sched.match(chains[0]) == 0  # evicted long ago
    op, missing = node.sched.plan_load("l0", chains[0], 0, 12, [40, 41, 42])
    assert op is None and missing == [40, 41, 42]
    node.close()


def test_tp_commit_needs_every_rank():
    node = Node(StoreConfig(cpu_bytes=16 * SLOT_NBYTES), world_size=2)
    node.sched.plan_save("r", tokens(8), [1, 2])
    node.step()  # only one rank reported
    assert node.sched.match(tokens(8)) == 0
    # the second rank's identical report (same plan, its own shard of the heads)
    from vllm_pd.connector.store.plans import SaveResult, StoreReport

    keys = node.sched.block_keys(tokens(8))
    node.sched.on_worker_report(StoreReport(saves=[SaveResult("r", keys, [])]))
    assert node.sched.match(tokens(8)) == 8
    node.close()


def test_disk_restart_rebuild_and_corrupt_block_is_recomputed(tmp_path):
    cfg = StoreConfig(cpu_bytes=16 * SLOT_NBYTES, disk_path=str(tmp_path), disk_bytes=1 << 20)
    node = Node(cfg)
    toks = tokens(16)
    node.sched.plan_save("r1", toks, [1, 2, 3, 4])
    node.step()
    node.step()  # disk commits reported
    want = blocks(node.kv, [1, 2, 3, 4])
    node.close()

    # restart: fresh processes' objects, empty pool, index rebuilt from disk
    node = Node(cfg, seed=1)
    assert node.sched.match(toks) == 16  # indexed from disk before the first step
    node.step()
    assert node.sched.match(toks) == 16
    op, missing = node.sched.plan_load("r2", toks, 0, 16, [30, 31, 32, 33])
    assert op.from_disk == [True] * 4 and not missing
    node.step()
    assert all(torch.equal(a, b) for a, b in zip(blocks(node.kv, [30, 31, 32, 33]), want))
    node.close()

    # corrupt block 3's file on disk, restart: header fine, payload wrong
    node = Node(cfg, seed=2)
    node.step()
    key3 = node.sched.block_keys(toks)[2]
    path = next(p for p in tmp_path.rglob(key3.hex()))
    with open(path, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        f.write(b"\xff\x00\xff\x00\xff")
    assert node.sched.match(toks) == 16
    op, missing = node.sched.plan_load("r3", toks, 0, 16, [40, 41, 42, 43])
    node.step()
    assert node.worker.take_load_errors() == {42, 43}  # the bad block and everything after it
    assert all(torch.equal(a[:2], b[:2]) for a, b in zip(blocks(node.kv, [40, 41]), want))
    assert node.sched.match(toks) == 8  # dropped from the index, never served
    assert not path.exists()
    node.close()


def test_per_request_keys_are_extended_not_recomputed():
    sched = StoreScheduler(StoreConfig(cpu_bytes=8 * SLOT_NBYTES), SALT, SLOT_NBYTES)
    toks = tokens(30)
    assert sched.block_keys(toks[:9], request_id="r") == sched.block_keys(toks[:9])
    assert sched.block_keys(toks, request_id="r") == sched.block_keys(toks)
    assert sched.block_keys(toks, max_blocks=3, request_id="r") == sched.block_keys(toks)[:3]
    sched.forget("r")
    assert "r" not in sched.keys


def test_config_is_validated():
    with pytest.raises(ConfigError, match="cpu_byts"):
        StoreConfig.from_dict({"cpu_byts": "1g"})
    with pytest.raises(ConfigError, match="pin_ttl_s"):
        StoreConfig.from_dict({"pin_ttl_s": -1})
    assert StoreConfig.from_dict({"cpu_bytes": "512m"}).cpu_bytes == 512 << 20


def test_the_old_name_of_pin_ttl_s_still_works_with_a_warning_naming_both(caplog):
    with caplog.at_level(logging.WARNING):
        assert StoreConfig.from_dict({"lease_s": 7}).pin_ttl_s == 7
    assert "store.lease_s is deprecated" in caplog.text and "store.pin_ttl_s" in caplog.text
    with pytest.raises(ConfigError, match="pin_ttl_s"):
        StoreConfig.from_dict({"lease_s": -1})  # validated under its new name
    with pytest.raises(ConfigError, match="store.lease_s and store.pin_ttl_s are both set"):
        StoreConfig.from_dict({"lease_s": 7, "pin_ttl_s": 8})


def test_cache_shadows_see_each_request_once_and_every_save():
    node = Node(StoreConfig(cpu_bytes=32 * SLOT_NBYTES))
    toks = tokens(12)
    node.sched.plan_save("a", toks, [1, 2, 3])
    node.step()
    lru_shadow = node.sched.cache.shadows[0]
    assert len(lru_shadow.policy) == 3  # the save reached the shadows
    for _ in range(3):  # vLLM asks every step while the request waits: one observation
        assert node.sched.match_with_remote(toks + [99], request_id="b")[0] == 12
    assert node.sched.cache.scores[0] == 3.0
    node.sched.forget("b")
    node.sched.match_with_remote(toks + [99], request_id="b")  # asked again after it finished: a new request
    assert node.sched.cache.scores[0] > 3.0
