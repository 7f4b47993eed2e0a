"""A connector worker inside vLLM's logging configuration logs through vLLM's own handler (moved from
tests/unit/vllm/test_vllm_logging.py: it runs a Python process of its own, some 6 s on two cores)."""

from __future__ import annotations

import re
import subprocess
import sys

# Under vLLM's real logging configuration (what each vLLM process applies as it starts), a connector
# worker registers its KV caches: its "KV endpoint" line must reach a handler on the "vllm" logger
# and vLLM's stderr.
_WORKER_LOGS = """
import logging
import torch
from vllm.config.logging import LoggingConfig
from vllm.logger import configure_logging
configure_logging(LoggingConfig(log_level="INFO"))
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.worker.worker import PDConnectorWorker

seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append((record.name, record.getMessage()))
logging.getLogger("vllm").addHandler(Keep())
worker = PDConnectorWorker(PDConnectorConfig.from_extra_config({"host": "127.0.0.1", "bind_host": "127.0.0.1"}),
                           block_size=16, tp_rank=0, base_port=0, is_producer=True, is_consumer=True)
worker.register_kv_caches({"layer0": torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)})
worker.shutdown()
print(seen)
"""


def test_connector_worker_line_reaches_vllms_handler_and_log() -> None:
    out = subprocess.run([sys.executable, "-c", _WORKER_LOGS], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "('vllm.plugins.vllm_pd.connector.worker.worker', 'PD connector worker 0: 1 layers of 4 blocks" in out.stdout
    # printed by vLLM's handler (to its stream, stdout by default) in vLLM's format:
    # "INFO <date> <time> [worker.py:NN] PD connector worker 0: ..."
    assert re.search(
        r"INFO .*\[worker\.py:\d+\] PD connector worker 0: .* KV endpoint tcp://127\.0\.0\.1:\d+", out.stdout
    ), out.stdout[-3000:]
