"""Two store nodes (scheduler + worker facades on real tensors, their pools served on the real TCP
transport) through a real store master process: what tests/integration/test_store_peer*.py share."""

import pytest
import torch

from vllm_pd.connector.store.config import StoreConfig
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.connector.store.scheduler_side import StoreScheduler
from vllm_pd.connector.store.worker_side import StoreWorker
from vllm_pd.protocol.block_keys import KeySalt
from vllm_pd.vllm_server import free_port

LAYERS = 2
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
