"""KV of another shape over every transport, on real vLLM CPU servers: block sizes 32 -> 64.

The shape e2e tests (tests/e2e/test_connector_shapes_e2e.py, _hybrid_, _mixed_tp_) run over the suite's
transport (shm, or VLLM_PD_TEST_TRANSPORT). This one representative mixed-shape case runs over
the others: a prefill of 32-token blocks (core 0) and a decode of 64-token blocks (core 1), one
pair per transport. Pull reads spans of prefill's blocks over the transport (two of prefill's
blocks make one of decode's); push-beside lands prefill's blocks in decode's staging memory, re-cut
on decode's host. The promises are the shape tests': greedy output == the plain instance's,
decode computes only the prompt's last token, blocks counted by source, nothing held, no shape
refused. NIXL moves its bytes by UCX on this host (shared memory, cma, tcp), not by RDMA.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_prefill_served
from tests.support import e2e_cluster as ec

pytestmark = pytest.mark.e2e

KEYS = ("ids17", "ids129", "ids640", "ids1500", "chat2")
TRANSPORTS = [t for t in ("shm", "tcp", "nixl") if t != ec.TRANSPORT]


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module", params=TRANSPORTS)
def p32_d64(
    request: pytest.FixtureRequest,
    reference_outputs: dict[str, list[int]],
    small_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
):
    """(prefill of 32-token blocks, decode of 64-token blocks), their KV over transport ``request.param``."""
    specs = []
    for cores, role, block_size in (("0", "kv_producer", 32), ("1", "kv_consumer", 64)):
        kv_port = ec.free_port()
        spec = ec.server_spec(
            small_model_dir, cores, ec.connector_config(role, kv_port, transport=request.param, lease_s=20.0)
        )
        spec.block_size = block_size
        specs.append((spec, kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp(f"vllm-shapes-{request.param}-logs"))
    yield instances
    ec.stop_all(instances)


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
def test_other_block_size_over_transport(mode: str, p32_d64, reference_outputs, client) -> None:
    prefill, decode = p32_d64
    assert prefill.transport == decode.transport != ec.TRANSPORT
    assert_prefill_served(client, prefill, decode, KEYS, mode, reference_outputs)
