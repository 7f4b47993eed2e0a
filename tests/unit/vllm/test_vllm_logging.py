"""Our code inside vLLM's processes logs through vLLM's own handler (vllm_pd.vllm_logging)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import vllm_pd

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
from vllm_pd.connector.worker import PDConnectorWorker

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
    assert "('vllm.plugins.vllm_pd.connector.worker', 'PD connector worker 0: 1 layers of 4 blocks" in out.stdout
    # printed by vLLM's handler (to its stream, stdout by default) in vLLM's format:
    # "INFO <date> <time> [worker.py:NN] PD connector worker 0: ..."
    assert re.search(
        r"INFO .*\[worker\.py:\d+\] PD connector worker 0: .* KV endpoint tcp://127\.0\.0\.1:\d+", out.stdout
    ), out.stdout[-3000:]


def test_code_running_inside_vllm_takes_its_loggers_from_vllm_logging() -> None:
    """connector/**, ops/** and the plugin hook run in vLLM's processes: a plain logging.getLogger there
    has no handler (vLLM's "vllm" logger does not propagate), so its lines would never show."""
    root = Path(vllm_pd.__file__).parent
    sources = [*root.glob("connector/**/*.py"), *root.glob("ops/**/*.py"), root / "__init__.py"]
    plain = [str(p.relative_to(root)) for p in sources if "logging.getLogger(" in p.read_text()]
    assert plain == []
    assert any("vllm_logger(__name__)" in p.read_text() for p in sources)
