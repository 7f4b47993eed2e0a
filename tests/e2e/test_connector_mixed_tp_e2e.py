"""Prefill and decode of different tensor-parallel sizes on real vLLM CPU servers.

Two kv_both instances of the default model (2 KV heads): one TP 1, one TP 2 (its ranks on
cores 0 and 1), serving each other's prefill legs. P TP 1 -> D TP 2: each decode rank takes
its one head from prefill's one rank (a window of each block); P TP 2 -> D TP 1: decode's rank
takes a head from each prefill rank. The promises: greedy output == a plain instance of
decode's TP size, token for token; decode computes only the prompt's last token; every
prefill rank that held a share is released (nothing held afterwards); no shape refused.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_prefill_served
from tests.e2e.test_connector_tp_e2e import tp_spec
from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES

pytestmark = pytest.mark.e2e

KEYS = ("ids17", "ids129", "ids640", "ids1500", "text3", "chat2")


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


# The TP 1 instance is left unbound beside the TP 2 one, as a prefill must be on a host where it shares
# cores with a decode TP rank: a TP 2 rank whose KV arrived first waits for its partner spinning in vLLM
# CPU's shared-memory all-reduce, and on its core that spin starved a prefill bound there for up to the 30 s
# transfer timeout - the partner's KV is the prefill's to send (docs/benchmarks/transfer.md, "P1 -> D2").
UNBOUND = "nobind"


def _spec(model: Path, tp: int, ktc: dict | None) -> ec.VllmServerSpec:
    return tp_spec(model, ktc) if tp == 2 else ec.server_spec(model, "0-1" if ktc is None else UNBOUND, ktc)


@pytest.fixture(scope="module")
def plain_by_tp(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[int]]]:
    """Greedy outputs of a plain TP 1 and a plain TP 2 instance, each started alone."""
    out = {}
    for tp in (1, 2):
        [plain] = ec.start_all([(_spec(small_model_dir, tp, None), None)], tmp_path_factory.mktemp("vllm-mtp-logs"))
        try:
            with httpx.Client() as client:
                out[tp] = {key: ec.output_tokens(ec.post(client, plain.url, CONNECTOR_CASES[key])) for key in KEYS}
        finally:
            ec.stop_all([plain])
    return out


@pytest.fixture(scope="module")
def mixed_pair(plain_by_tp, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """{TP size: instance}: a kv_both TP 1 and a kv_both TP 2 instance."""
    specs = []
    for tp in (1, 2):
        kv_port = ec.free_port()
        specs.append((_spec(small_model_dir, tp, ec.connector_config("kv_both", kv_port, lease_s=60.0)), kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp("vllm-mtp-logs"))
    yield {1: instances[0], 2: instances[1]}
    ec.stop_all(instances)


@pytest.mark.parametrize(
    "tps, mode, sources",
    [
        ((1, 2), "pull", ("fetch",)),
        ((2, 1), "pull", ("fetch",)),
        ((1, 2), "push-beside", ("push",)),
        ((2, 1), "push-beside", ("push",)),
    ],
    ids=["p1-d2-pull", "p2-d1-pull", "p1-d2-push-beside", "p2-d1-push-beside"],
)
def test_other_tp_takes_its_heads(
    tps: tuple[int, int], mode: str, sources: tuple[str, ...], mixed_pair, plain_by_tp, client
) -> None:
    prefill, decode = mixed_pair[tps[0]], mixed_pair[tps[1]]
    assert_prefill_served(client, prefill, decode, KEYS, mode, plain_by_tp[tps[1]], sources)
    assert ec.metric(client, decode.url, "vllm:pd_shape_refused_total") == 0
