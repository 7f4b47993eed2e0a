"""Ask Linux for the AMX tile state before vLLM's CPU attention uses it.

On x86 with AMX a process must request the tile data state once (``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``) before its first tile instruction, or the kernel kills it with SIGILL. vLLM's
CPU attention picks its "amx" kernels on such hosts (bf16, block size a multiple of 32) without
asking; oneDNN asks as its first AMX GEMM runs, so a plain instance gets away with it - its first
forward is a prefill. A decode instance fed by our connector can start with a step of one token per
request over loaded KV, where no AMX GEMM runs before the attention: both TP=2 decode ranks died so
on their first request on an Intel Xeon VM with AMX (tests/e2e/test_connector_tp_e2e.py).
"""

from __future__ import annotations

import torch

from vllm_pd.vllm_logging import vllm_logger

logger = vllm_logger(__name__)


def request_amx_tiles() -> bool:
    """Request the tile state for this process where the CPU has AMX (idempotent); True once granted."""
    if not torch.cpu._is_amx_tile_supported():
        return False
    granted = bool(torch.cpu._init_amx())
    if not granted:
        logger.warning(
            "this CPU has AMX but Linux did not grant this process its tile state: "
            "vLLM's AMX attention kernels will fault"
        )
    return granted
