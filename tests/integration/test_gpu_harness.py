"""The GPU harness (tests/support/gpu_harness.py): the connector's data path between two processes, on
KV built exactly as vLLM 0.32 allocates it for its attention backends (tests/support/vllm_kv_cache.py).

Marked ``gpu``: on a machine whose torch sees a GPU it runs on CUDA (``pytest -m gpu``
on the GPU machine, which has no vLLM); everywhere it also runs on the CPU (vLLM's
CPU case) and on the asynchronous stand-in device (the GPU's staging and ordering,
mocked on CPU threads because CI has no GPU). Every case checks decode's blocks byte
for byte against what prefill wrote, for a pushed and a pulled request.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.gpu_harness import HarnessSpec, run

pytestmark = pytest.mark.gpu

CPU_CASE = dict(backend="CPU_ATTN", block_size=32)  # vLLM's CPU backend: LBHNC, multiples of 32 tokens
LLAMA = dict(backend="FLASH_ATTN")  # LBHNC: what vLLM resolves with this connector
DEEPSEEK = dict(backend="FLASHMLA", model="deepseek-v3")  # LBNHC, vLLM's first choice for MLA
SPLIT_MLA = dict(backend="FLASHMLA", model="deepseek-v3", block_size=128)  # two 64-token kernel blocks a block
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("cpu", "tcp", CPU_CASE),
    ("cpu", "shm", CPU_CASE),
    ("cpu", "nixl", CPU_CASE),
    ("cpu", "tcp", dict(LLAMA, kv_layout="BLHNC")),  # blocks not back to back: staged on the host
    ("standin", "tcp", LLAMA),
    ("standin", "shm", dict(LLAMA, kv_layout="LBNHC")),
    ("standin", "tcp", DEEPSEEK),
    ("standin", "tcp", SPLIT_MLA),
    # NIXL registers the "device" KV itself: no staging, sends gated by events
    ("standin", "nixl", LLAMA),
    ("standin", "nixl", dict(LLAMA, kv_layout="LHBNC")),  # one span per head
    ("standin", "nixl", dict(backend="FLASHINFER", block_size=128)),  # LBHNC, two kernel blocks a block
]
if torch.cuda.is_available():
    CASES += [("cuda", t, case) for t in ("tcp", "shm", "nixl") for case in (LLAMA, DEEPSEEK, SPLIT_MLA)]


def _id(case: tuple[str, str, dict[str, Any]]) -> str:
    device, transport, kv = case
    return "-".join([device, transport, *(str(v) for v in kv.values())])


@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_decode_blocks_equal_what_prefill_wrote(case: tuple[str, str, dict[str, Any]]) -> None:
    device, transport, kv = case
    result = run(HarnessSpec(device=device, transport=transport, timeout_s=30, **kv))
    assert not result.errors, result.errors[0]
    assert [r.mode for r in result.requests] == ["push", "pull"]
    n = result.spec.blocks_per_request * result.spec.layers
    for r in result.requests:
        assert r.exact and r.load_ok, r
        # a push lands every block from what was pushed; a pull reads every block
        assert (r.from_push, r.fetched) == ((n, 0) if r.mode == "push" else (0, n)), r
        assert r.nbytes == result.spec.request_nbytes()
