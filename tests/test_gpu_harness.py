"""The GPU harness (tests/gpu_harness.py): the connector's data path between two processes.

Marked ``gpu``: on a machine whose torch sees a GPU it runs on CUDA (``pytest -m gpu``
on the GPU machine, which has no vLLM); everywhere it also runs on the CPU (vLLM's
CPU case) and on the asynchronous stand-in device (the GPU's staging and ordering,
mocked on CPU threads because CI has no GPU). Every case checks decode's blocks byte
for byte against what prefill wrote, for a pushed and a pulled request.
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu_harness import HarnessSpec, run

pytestmark = pytest.mark.gpu

CASES = [
    ("cpu", "tcp", "cpu"),
    ("cpu", "shm", "cpu"),
    ("standin", "tcp", "flash"),
    ("standin", "shm", "flash"),
    ("standin", "tcp", "mla"),
    ("cpu", "nixl", "cpu"),
    ("standin", "nixl", "flash"),  # NIXL registers the "device" KV itself: no staging, sends gated by events
]
if torch.cuda.is_available():
    CASES += [("cuda", t, layout) for t in ("tcp", "shm", "nixl") for layout in ("flash", "mla")]


@pytest.mark.parametrize(("device", "transport", "layout"), CASES)
def test_decode_blocks_equal_what_prefill_wrote(device: str, transport: str, layout: str) -> None:
    result = run(HarnessSpec(device=device, transport=transport, layout=layout, timeout_s=30))
    assert not result.errors, result.errors[0]
    assert [r.mode for r in result.requests] == ["push", "pull"]
    n = result.spec.blocks_per_request * result.spec.layers
    for r in result.requests:
        assert r.exact and r.load_ok, r
        # a push lands every block from what was pushed; a pull reads every block
        assert (r.from_push, r.fetched) == ((n, 0) if r.mode == "push" else (0, n)), r
