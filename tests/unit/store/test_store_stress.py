"""Random saves and loads under tight CPU and disk bounds: every block that is
served carries exactly the bytes saved under its key, and the bounds hold."""

import random

import pytest
import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.protocol.block_keys import KeySalt

pytestmark = pytest.mark.slow

BS, LAYERS, NBLOCKS = 4, 2, 64
SALT = KeySalt("stress", "bfloat16", "cpu", BS, LAYERS)
SLOT = LAYERS * 2 * BS * 8 * 2


def pattern(key: bytes) -> torch.Tensor:
    """The bytes a block with this key must hold (one layer)."""
    raw = torch.frombuffer(bytearray(key * (2 * BS * 8 * 2 // len(key))), dtype=torch.uint8)
    return raw.view(torch.bfloat16).view(2, BS, 8)


def test_random_traffic_never_serves_wrong_bytes(tmp_path):
    rng = random.Random(7)
    cfg = StoreConfig(cpu_bytes=10 * SLOT, disk_path=str(tmp_path), disk_bytes=14 * (SLOT + 96))
    kv = [torch.zeros(NBLOCKS, 2, BS, 8, dtype=torch.bfloat16) for _ in range(LAYERS)]
    sched = StoreScheduler(cfg, SALT, SLOT)
    worker = StoreWorker(cfg, SALT, kv)
    # conversations: a few shared roots, growing by turns
    convs = [[rng.randrange(5) * 100 + i for i in range(8)] for _ in range(6)]
    served = errors = from_disk = 0
    for step in range(100):
        conv = rng.randrange(len(convs))
        toks = convs[conv] = convs[conv] + [rng.randrange(1000, 9999) for _ in range(rng.choice([4, 8]))]
        keys = sched.block_keys(toks)
        matched = sched.match(toks[:-1]) // BS
        block_ids = rng.sample(range(NBLOCKS), len(keys))
        if matched:
            for layer in kv:
                layer[block_ids[:matched]] = 0
            op, missing = sched.plan_load(f"l{step}", toks, 0, matched * BS, block_ids[:matched])
            from_disk += sum(op.from_disk) if op else 0
        for i, key in enumerate(keys[matched:], start=matched):  # "compute" the rest
            for layer in kv:
                layer[block_ids[i]] = pattern(key)
        worker.execute(sched.build_plan())
        for layer in range(LAYERS):
            worker.wait_layer(layer)
        bad = worker.take_load_errors() | set(missing if matched else [])
        for i in range(matched):
            if block_ids[i] in bad:
                errors += 1
                for layer in kv:  # vLLM recomputes the failed blocks
                    layer[block_ids[i]] = pattern(keys[i])
                continue
            served += 1
            for layer in kv:
                assert torch.equal(layer[block_ids[i]].view(torch.uint8), pattern(keys[i]).view(torch.uint8)), (
                    f"wrong KV at step {step}"
                )
        sched.on_worker_report(worker.report())
        sched.plan_save(f"s{step}", toks, block_ids)
        worker.execute(sched.build_plan())
        worker.wait_disk()
        sched.on_worker_report(worker.report())
        used = sched.slots.num_slots - sched.slots.free_count
        assert len(sched.cache) == used <= sched.slots.num_slots
        assert worker.disk.used_bytes <= cfg.disk_bytes
        if step % 50 == 49:  # a corrupt file now and then
            files = [p for p in tmp_path.rglob("*") if p.is_file()]
            if files:
                victim = rng.choice(files)
                data = bytearray(victim.read_bytes())
                data[-1] ^= 0xFF
                victim.write_bytes(bytes(data))
    print("served", served, "errors", errors, "from disk", from_disk, sched.stats)
    assert served > 50  # the store really served blocks, from memory and disk
    assert sched.stats["evicted_blocks"] > 0 and from_disk > 0
    worker.close()
