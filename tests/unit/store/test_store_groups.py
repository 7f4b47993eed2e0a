"""The KV store for a model with several attention KV cache groups (store/groups.py,
connector/store_group_bridge.py), on vLLM's real group layout: vLLM 0.32's own KVCacheManager
(its HybridKVCacheCoordinator, a full-attention group and sliding-window groups) allocates
the blocks, nulls a window's freed ones and hands them to the store's hooks as it does in a
server; the KV tensors are plain CPU tensors written with a value per layer and position.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec
from vllm.v1.request import Request

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.groups import NULL_BLOCK, StoreGroup, agreed_hit, why_not_stored
from vllm_pd.connector.store_bridge import make_salt
from vllm_pd.connector.store_group_bridge import GroupStoreBridgeScheduler, GroupStoreBridgeWorker
from vllm_pd.protocol.kv_shape import KVGroup

BS, WINDOW, NUM_BLOCKS = 16, 64, 96
WINDOW_BLOCKS = 4  # cdiv(WINDOW - 1, BS): what vLLM's SlidingWindowManager needs at a hit's end
ROW = 64  # bytes of one layer's block
GROUPS = (
    StoreGroup("full", BS, 0, ("layers.3",)),
    StoreGroup("window", BS, WINDOW, ("layers.0",)),
    StoreGroup("window", BS, WINDOW, ("layers.1",)),
)
LAYERS = [name for g in GROUPS for name in g.layers]
VLLM_CONFIG = SimpleNamespace(
    model_config=SimpleNamespace(model="m", revision=None, dtype="bfloat16"),
    cache_config=SimpleNamespace(block_size=BS, cache_dtype="auto"),
    parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
)


def kv_value(layer: int, position: int, tag: int) -> int:
    return (layer * 37 + position * 5 + tag * 11) % 251 + 1


class Engine:
    """vLLM's KV cache manager, the KV tensors, and the store's two sides, stepped by hand."""

    def __init__(self, cpu_slots: int = 40) -> None:
        spec = dict(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float16)
        groups = [KVCacheGroupSpec(list(GROUPS[0].layers), FullAttentionSpec(**spec))] + [
            KVCacheGroupSpec(list(g.layers), SlidingWindowSpec(**spec, sliding_window=WINDOW)) for g in GROUPS[1:]
        ]
        config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        self.mgr = KVCacheManager(
            config, max_model_len=4096, scheduler_block_size=BS, hash_block_size=BS, enable_caching=False
        )
        self.kv = {name: torch.zeros(NUM_BLOCKS, ROW, dtype=torch.uint8) for name in LAYERS}
        store = StoreConfig(cpu_bytes=cpu_slots * ROW * len(LAYERS))
        self.sched = GroupStoreBridgeScheduler(VLLM_CONFIG, store, GROUPS)
        self.sched.on_handshake(len(LAYERS), ROW, "", kv_format="u8")
        self.worker = GroupStoreBridgeWorker(store, VLLM_CONFIG, 0, GROUPS)
        self.worker.register_kv_caches(dict(self.kv), "127.0.0.1", "127.0.0.1", kv_format="u8")

    def close(self) -> None:
        self.worker.shutdown()

    def step(self) -> tuple[set[str], set[str], set[str]]:
        """One engine step of the store: (saves done, loads ended, loads failed)."""
        self.worker.begin_step(self.sched.build_meta())
        self.worker.start()
        for name in LAYERS:  # the forward's waits
            self.worker.wait_for_layer_load(name)
        for store in self.worker.group_stores:
            store.wait_saves()
        saved = self.worker.merge_finished(set())
        ended, failed = self.worker.finished_loads()
        self.sched.loads_finished(ended)  # the connector hands vLLM's finished_recving back
        self.sched.update_connector_output(self.worker.worker_meta())
        return saved, ended, failed

    def compute(
        self, req_id: str, prompt: list[int], tag: int, outputs: int = 1, cache_salt: str | None = None
    ) -> None:
        """Run a request as vLLM would (prefill, ``outputs`` decode steps) writing KV of ``tag``, and
        save it when it finishes."""
        req = Request(req_id, prompt, SamplingParams(max_tokens=outputs), None, cache_salt=cache_salt)
        assert self.mgr.allocate_slots(req, len(prompt)) is not None
        for _ in range(outputs):
            self.write(req_id, req.num_tokens, tag)
            req.num_computed_tokens = req.num_tokens
            req.append_output_token_ids(7)
            assert self.mgr.allocate_slots(req, 1) is not None  # frees the blocks behind each window
        assert self.sched.request_finished(req, self.mgr.get_block_ids(req_id), pd_holds=False)
        saved, _, _ = self.step()
        assert saved == {req_id}
        self.mgr.free(req)

    def write(self, req_id: str, num_tokens: int, tag: int) -> None:
        for g, ids in enumerate(self.mgr.get_block_ids(req_id)):
            for p, block in enumerate(ids[: num_tokens // BS]):
                if block != NULL_BLOCK:
                    for name in GROUPS[g].layers:
                        self.kv[name][block] = kv_value(LAYERS.index(name), p, tag)

    def ask(self, req_id: str, prompt: list[int], cache_salt: str | None = None) -> tuple[Request, int]:
        req = Request(req_id, prompt, SamplingParams(max_tokens=1), None, cache_salt=cache_salt)
        return req, self.sched.get_num_new_matched_tokens(req, 0)

    def load(self, req: Request, hit: int) -> tuple[set[str], set[str]]:
        """vLLM allocates the request's blocks with ``hit`` external tokens (an async load), the
        store loads them; (loads ended, loads failed)."""
        assert self.mgr.allocate_slots(req, len(req.prompt_token_ids or []) - hit, num_external_computed_tokens=hit)
        self.sched.update_state_after_alloc(req, self.mgr.get_block_ids(req.request_id), hit)
        _, ended, failed = self.step()
        return ended, failed

    def loaded_positions(self, req_id: str, tag: int) -> list[list[int]]:
        """Per group, the positions whose blocks hold KV of ``tag``."""
        out = []
        for g, ids in enumerate(self.mgr.get_block_ids(req_id)):
            name = GROUPS[g].layers[0]
            layer = LAYERS.index(name)
            out.append([p for p, b in enumerate(ids) if b and int(self.kv[name][b][0]) == kv_value(layer, p, tag)])
        return out


@pytest.fixture
def engine() -> Iterator[Engine]:
    e = Engine()
    yield e
    e.close()


PROMPT = [(i * 7919) % 5000 + 1 for i in range(300)]
TURN2 = PROMPT + [7] + [(i * 31) % 4000 + 3 for i in range(40)]  # turn 1, its answer, a new question


def test_hit_rule_matches_vllms_sliding_window_manager() -> None:
    """A full group needs every block up to the hit, a window group the last cdiv(window - 1, bs)."""
    full, window = GROUPS[0], GROUPS[1]
    assert window.window_blocks == WINDOW_BLOCKS and list(window.needed(18)) == [14, 15, 16, 17]
    assert list(window.needed(3)) == [0, 1, 2]  # a partial window: every block from the start
    assert list(window.needed(18, first_block=16)) == [16, 17] and list(full.needed(18, 16)) == [16, 17]
    have = [True] * 18
    ring = [False] * 14 + [True] * 4  # a window's blocks: the ones behind it were freed
    assert agreed_hit((full, window), [have, ring]) == 18
    holed = ring[:16] + [False, True]
    assert agreed_hit((full, window), [have, holed]) == 0  # no window ends where all its blocks are
    two_windows = [False] * 8 + [True] * 4 + [False] * 2 + [True, True, False, True]
    assert agreed_hit((full, window), [have, two_windows]) == 12  # a missing block: the shorter hit
    assert agreed_hit((full, window), [have[:10] + [False] * 8, ring]) == 0  # full stops before the window
    assert agreed_hit((full, window), [have[:3] + [False] * 15, [True] * 3 + [False] * 15]) == 3  # partial
    assert agreed_hit((full, window), [have, ring], first_block=18) == 18  # vLLM has it all: no hit


def test_group_keys_differ_by_group_and_are_stable(engine: Engine) -> None:
    """A group's keys name its kind, window and layers: same on every instance, apart between groups."""
    salts = [make_salt(VLLM_CONFIG, len(g.layers), ROW, "u8", g.identity) for g in GROUPS]
    assert len({s.digest() for s in salts}) == len(GROUPS)
    assert [s.salt for s in engine.sched.group_stores] == salts == [s.salt for s in Engine().sched.group_stores]
    one_group = make_salt(VLLM_CONFIG, len(GROUPS[0].layers), ROW, "u8")
    assert one_group.digest() not in {s.digest() for s in salts}  # the one-group store's keys are its own
    keys = [s.block_keys(PROMPT) for s in engine.sched.group_stores]
    assert not set(keys[0]) & set(keys[1]) and not set(keys[1]) & set(keys[2])


def test_vllm_nulls_what_the_hit_rule_leaves_out(engine: Engine) -> None:
    """vLLM's null block is id 0, and its hybrid manager gives a window group real blocks exactly at
    the positions ``needed`` names for external tokens (the others null)."""
    assert engine.mgr.block_pool.null_block.block_id == NULL_BLOCK
    req = Request("r", PROMPT, SamplingParams(max_tokens=1), None)
    assert engine.mgr.allocate_slots(req, len(PROMPT) - 160, num_external_computed_tokens=160)
    for group, ids in zip(GROUPS, engine.mgr.get_block_ids("r")):
        assert [p for p in range(10) if ids[p] != NULL_BLOCK] == list(group.needed(10))


def test_a_second_turn_is_served_from_every_group(engine: Engine) -> None:
    engine.compute("turn1", PROMPT, tag=1)
    saved = [len(s.index) for s in engine.sched.group_stores]
    assert saved == [18, WINDOW_BLOCKS, WINDOW_BLOCKS]  # a window: its blocks held at the end only
    req, hit = engine.ask("turn2", TURN2)
    assert hit == 18 * BS
    ended, failed = engine.load(req, hit)
    assert (ended, failed) == ({"turn2"}, set())
    got = engine.loaded_positions("turn2", tag=1)
    assert got == [list(range(18)), list(range(14, 18)), list(range(14, 18))]


def test_a_window_group_missing_a_block_gives_the_shorter_hit(engine: Engine) -> None:
    engine.compute("short", PROMPT[:200], tag=1)  # its window ends at block 12
    engine.compute("long", PROMPT, tag=1)  # its window ends at block 18
    window = engine.sched.group_stores[2]
    window.placement.remove_subtree(window.block_keys(PROMPT)[16])  # one block of the longer window
    req, hit = engine.ask("again", TURN2)
    assert hit == 12 * BS
    assert engine.load(req, hit) == ({"again"}, set())
    assert engine.loaded_positions("again", tag=1) == [list(range(12)), [8, 9, 10, 11], [8, 9, 10, 11]]


def test_a_block_gone_between_lookup_and_load_fails_the_whole_load(engine: Engine) -> None:
    """Never a partial load: the request is reported failed (vLLM recomputes it), not by block id."""
    engine.compute("turn1", PROMPT, tag=1)
    req, hit = engine.ask("turn2", TURN2)
    window = engine.sched.group_stores[1]
    window.placement.remove_subtree(window.block_keys(PROMPT)[17])
    assert engine.load(req, hit) == ({"turn2"}, {"turn2"})
    assert engine.worker.load_errors() == set()  # vLLM 0.32 raises on block ids with several groups
    # vLLM asks again for the request it now computes: no second try (a failure may repeat)
    assert engine.sched.get_num_new_matched_tokens(req, 0) == 0


def test_a_request_aborted_while_loading_saves_nothing(engine: Engine) -> None:
    """vLLM keeps its blocks until the load ends, but they are not its KV: none is saved."""
    engine.compute("turn1", PROMPT, tag=1)
    req, hit = engine.ask("turn2", TURN2)
    assert engine.mgr.allocate_slots(req, len(TURN2) - hit, num_external_computed_tokens=hit)
    ids = engine.mgr.get_block_ids("turn2")
    engine.sched.update_state_after_alloc(req, ids, hit)
    window = engine.sched.group_stores[1]
    window.placement.remove_subtree(window.block_keys(PROMPT)[17])  # would be saved again from turn2's blocks
    req.num_computed_tokens = hit
    assert not engine.sched.request_finished(req, ids, pd_holds=False)
    assert engine.step()[1] == {"turn2"}
    assert window.block_keys(PROMPT)[17] not in window.index


def test_blocks_vllm_gives_beyond_the_checked_window_fail_the_load(engine: Engine) -> None:
    engine.compute("turn1", PROMPT, tag=1)
    req, hit = engine.ask("turn2", TURN2)
    assert engine.mgr.allocate_slots(req, len(TURN2) - hit, num_external_computed_tokens=hit)
    ids = [list(g) for g in engine.mgr.get_block_ids("turn2")]
    ids[1][13] = 90  # a block the hit did not check
    engine.sched.update_state_after_alloc(req, ids, hit)
    assert engine.step()[1:] == ({"turn2"}, {"turn2"})


def test_other_tenants_get_nothing(engine: Engine) -> None:
    engine.compute("a", PROMPT, tag=1, cache_salt="tenant-a")
    assert engine.ask("b", TURN2, cache_salt="tenant-b")[1] == 0
    assert engine.ask("none", TURN2)[1] == 0
    assert engine.ask("a2", TURN2, cache_salt="tenant-a")[1] == 18 * BS


def test_state_groups_and_mixed_block_sizes_are_not_stored() -> None:
    full, window = KVGroup("full", BS, ""), KVGroup("window", BS, "", WINDOW)
    assert why_not_stored((full, window, window)) == ""
    assert "recurrent state" in why_not_stored((full, KVGroup("state", BS, "")))
    assert "block sizes" in why_not_stored((full, KVGroup("window", 2 * BS, "", WINDOW)))


def test_the_connector_keeps_the_store_local_for_several_groups(caplog: pytest.LogCaptureFixture) -> None:
    """PDConnector's choice: the groups with their layer names and no master (warned), or no store
    for a state group (warned, saying why)."""
    from vllm_pd.connector.connector import groups_store

    config = SimpleNamespace(
        kv_cache_groups=[SimpleNamespace(layer_names=list(g.layers)) for g in GROUPS]  # vLLM's KVCacheGroupSpec
    )
    kv_groups = (KVGroup("full", BS, ""), KVGroup("window", BS, "", WINDOW), KVGroup("window", BS, "", WINDOW))
    store = StoreConfig(master="tcp://127.0.0.1:1")
    with caplog.at_level("WARNING"):
        kept, groups = groups_store(store, kv_groups, config)
    assert groups == GROUPS and kept is not None and kept.master is None
    assert "master tcp://127.0.0.1:1 not used" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        off, none = groups_store(StoreConfig(), (kv_groups[0], KVGroup("state", BS, "")), config)
    assert off is None and none == () and "the KV store is off" in caplog.text and "recurrent state" in caplog.text
