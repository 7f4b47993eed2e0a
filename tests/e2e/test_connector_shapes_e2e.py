"""Prefill and decode of different KV shapes on real vLLM CPU servers: block sizes.

Two kv_both instances, one with 32-token blocks (core 0), one with 64-token blocks (core 1),
serve each other's prefill legs in both directions. The promises: greedy output == the plain
instance's, token for token; decode computes only the prompt's last token (the rest was
loaded from prefill, its blocks re-cut into decode's block size - never recomputed); and
afterwards neither side holds a block.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_prefill_served
from tests.support import e2e_cluster as ec

pytestmark = pytest.mark.e2e

BLOCK_SIZES = (32, 64)
KEYS = ("ids17", "ids100", "ids129", "ids640", "ids1500", "text3", "chat2")


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def block_pair(
    reference_outputs: dict[str, list[int]], small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
):
    """{block size: instance}: two kv_both instances of 32- and 64-token blocks."""
    specs = []
    for cores, block_size in zip(("0", "1"), BLOCK_SIZES, strict=True):
        kv_port = ec.free_port()
        spec = ec.server_spec(small_model_dir, cores, ec.connector_config("kv_both", kv_port, lease_s=20.0))
        spec.block_size = block_size
        specs.append((spec, kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp("vllm-shapes-logs"))
    yield dict(zip(BLOCK_SIZES, instances, strict=True))
    ec.stop_all(instances)


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
@pytest.mark.parametrize("sizes", [(32, 64), (64, 32)], ids=["p32-d64", "p64-d32"])
def test_other_block_size_is_recut_not_recomputed(
    sizes: tuple[int, int], mode: str, block_pair, reference_outputs, client
) -> None:
    prefill, decode = block_pair[sizes[0]], block_pair[sizes[1]]
    assert_prefill_served(client, prefill, decode, KEYS, mode, reference_outputs)
