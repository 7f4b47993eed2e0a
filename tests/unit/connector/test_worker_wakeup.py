"""The worker's one wake-up event: prefill's sender and decode's loader both set the event the worker's
idle step waits on (worker.get_finished), an event the worker owns (the loader was handed the sender's
before). Negative control: a loader given an event of its own fails the test."""

from __future__ import annotations

from tests.support import vllm_kv_cache as replay
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.device.kv_layout import KVLayout
from vllm_pd.connector.worker.worker import PDConnectorWorker


def test_sender_and_loader_wake_the_same_idle_step() -> None:
    config = PDConnectorConfig.from_extra_config({"transport": "tcp", "host": "127.0.0.1", "bind_host": "127.0.0.1"})
    worker = PDConnectorWorker(config, block_size=16, tp_rank=0, base_port=0, is_producer=True, is_consumer=True)
    cache = replay.allocate(replay.model("llama3-8b", layers=2), replay.BACKENDS["FLASH_ATTN"], KVLayout.LBHNC, 4)
    try:
        worker.register_kv_caches(cache.views, 4, kv_layout="LBHNC")
        worker.get_finished()  # clears the event before it looks
        assert not worker.loader._changed.is_set()
        worker.sender.outgoing.release("transfer-1")  # a release reaches the prefill side
        assert worker.loader._changed.is_set()  # the event decode's loads set too: one for the idle step
    finally:
        worker.shutdown()
