"""A connector worker on CPU asks Linux for the AMX tile state (vllm_pd.connector.device.amx_tiles).

Without it, vLLM's AMX attention killed both TP=2 decode ranks with SIGILL on their first request
on an AMX host: their first forward was a step of loaded KV, so oneDNN had not asked yet. Each
check runs in a fresh process (the permission is per process and lasts its life).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_pd.connector.device.amx_tiles import request_amx_tiles

_PERMISSION_AROUND_REGISTER = """
import ctypes
import torch
from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.worker.worker import PDConnectorWorker

libc = ctypes.CDLL(None, use_errno=True)

def tiles_granted() -> bool:
    features = ctypes.c_uint64(0)
    assert libc.syscall(158, 0x1022, ctypes.byref(features)) == 0  # SYS_arch_prctl, ARCH_GET_XCOMP_PERM
    return bool(features.value & (1 << 18))  # XFEATURE_XTILEDATA

before = tiles_granted()
worker = PDConnectorWorker(PDConnectorConfig.from_extra_config({"host": "127.0.0.1", "bind_host": "127.0.0.1"}),
                           block_size=32, tp_rank=0, base_port=0, is_producer=False, is_consumer=True)
worker.register_kv_caches({"layer0": torch.zeros(4, 2, 32, 16, dtype=torch.bfloat16)})
after = tiles_granted()
worker.shutdown()
print(before, after)
"""


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="no AMX on this CPU: no tile state to ask for")
def test_a_cpu_worker_holds_the_tile_state_once_its_kv_caches_are_registered() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _PERMISSION_AROUND_REGISTER], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "True"]  # not granted to a fresh process; granted after


def test_the_request_is_granted_exactly_where_the_cpu_has_amx() -> None:
    assert request_amx_tiles() is torch.cpu._is_amx_tile_supported()
    assert request_amx_tiles() is torch.cpu._is_amx_tile_supported()  # again: idempotent
