"""The connector-side joins of the store: a finished request's blocks are given
back to vLLM only when both the store's copy and the PD transfer are done."""

import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.connector.store_bridge import StoreBridgeWorker, StoreStepMeta, StoreWorkerMeta
from vllm_pd.protocol.block_keys import KeySalt

SALT = KeySalt("m", "bfloat16", "cpu", 4, 2)
SLOT = 2 * 2 * 4 * 8 * 2


def make():
    cfg = StoreConfig(cpu_bytes=16 * SLOT)
    kv = [torch.randn(16, 2, 4, 8).to(torch.bfloat16) for _ in range(2)]
    sched = StoreScheduler(cfg, SALT, SLOT)
    bridge = StoreBridgeWorker(cfg, vllm_config=None, tp_rank=0)
    bridge.store = StoreWorker(cfg, SALT, kv)
    bridge._layer_index = {"l0": 0, "l1": 1}
    return sched, bridge


def test_blocks_released_only_when_store_and_pd_are_both_done():
    sched, bridge = make()
    sched.plan_save("both", list(range(8)), [1, 2])
    sched.plan_save("store-only", list(range(100, 108)), [3, 4])
    meta = StoreStepMeta(plan=sched.build_plan(), held={"both": ("store", "pd"), "store-only": ("store",)})
    bridge.begin_step(meta)
    assert bridge.merge_finished({"both", "pd-only"}) == {"pd-only"}  # the store still copies "both"
    bridge.start()
    bridge.store.wait_saves()
    assert bridge.merge_finished(set()) == {"both", "store-only"}
    # the worker's report reaches the scheduler side through KVConnectorWorkerMetadata
    agg = bridge.worker_meta().aggregate(StoreWorkerMeta(bridge.store.report()))
    sched.on_worker_report(agg.report)
    assert sched.match(list(range(8))) == 8
    bridge.shutdown()


def test_missing_blocks_become_load_errors():
    sched, bridge = make()
    bridge.begin_step(StoreStepMeta(missing_block_ids=[7, 9]))
    assert bridge.load_errors() == {7, 9} and bridge.load_errors() == set()
    bridge.shutdown()


def test_prefill_legs_store_fetch_hint_reaches_the_store_once_per_request():
    """The hint rides in the request's kv_transfer_params (of vLLM's own Request); with it the store
    does not ask its master, which is down here and would cost the scheduler its timeout."""
    import time

    from vllm import SamplingParams
    from vllm.v1.request import Request

    from vllm_pd.connector.store_bridge import StoreBridgeScheduler
    from vllm_pd.protocol.transfer_params import StoreFetch
    from vllm_pd.vllm_server import free_port

    cfg = StoreConfig(cpu_bytes=16 * SLOT, master=f"tcp://127.0.0.1:{free_port()}", master_timeout_s=1.0, node_id="p0")
    bridge = StoreBridgeScheduler(vllm_config=None, config=cfg)
    bridge.store = StoreScheduler(cfg, SALT, SLOT, endpoint="tcp://127.0.0.1:1")
    hint = StoreFetch("d0", "tcp://127.0.0.1:2", 3)
    req = Request("r1", list(range(13)), SamplingParams(max_tokens=1), None)
    req.kv_transfer_params = {"do_remote_decode": True, **hint.to_params()}
    t0 = time.monotonic()
    assert bridge.get_num_new_matched_tokens(req, 0) == 12
    assert time.monotonic() - t0 < 0.5
    assert bridge._matched["r1"][1].node == "d0"
    req.kv_transfer_params = {"do_remote_decode": True}  # parsed once: vLLM asks again while it waits
    assert bridge.get_num_new_matched_tokens(req, 0) == 12
    bridge.store.master.close()


def test_a_second_handshake_keeps_the_store():
    """vLLM >= 0.33 hands the workers' handshake to the scheduler again after a sleep mode wake-up:
    the store's index of its pool, which outlived the sleep, stays (make_salt is not reached)."""
    from vllm_pd.connector.store_bridge import StoreBridgeScheduler

    cfg = StoreConfig(cpu_bytes=16 * SLOT)
    bridge = StoreBridgeScheduler(vllm_config=None, config=cfg)
    store = bridge.store = StoreScheduler(cfg, SALT, SLOT)
    bridge.on_handshake(2, SLOT // 2, "")
    assert bridge.store is store
