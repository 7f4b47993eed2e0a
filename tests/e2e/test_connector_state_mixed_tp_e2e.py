"""A model with a recurrent state (Mamba-2 beside attention) between prefill and decode of different TP
sizes, on real vLLM CPU servers.

The model: `vllm-pd make-model --arch nemotron_h` (one Mamba-2 group: B and C replicated on both ranks
of TP 2). Two kv_both instances, one TP 1, one TP 2 (its ranks on cores 0 and 1; the TP 1 one left
unbound, see test_connector_mixed_tp_e2e.py), serving each other's prefill legs. Decode takes its
attention heads as for any mixed TP, and its Mamba state as byte windows of prefill ranks' state blocks
(state_geometry): P TP 1 -> D TP 2, each decode rank reads its heads' x channels and SSM heads, and the
one group's B and C, from prefill's one rank; P TP 2 -> D TP 1, decode reads each prefill rank's x
channels and SSM heads, and B and C once, from prefill rank 0. The promises: greedy output == a plain
instance of decode's TP size, token for token (float32, no prefix caching: see
test_connector_state_e2e.py); decode computes only the prompt's last token; loads ok, none failed, no
shape refused; every prefill rank that held a share is released (nothing held afterwards).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_prefill_served
from tests.e2e.test_connector_mixed_tp_e2e import UNBOUND
from tests.e2e.test_connector_state_e2e import STATE_GROUP, STATE_SERVER_ARGS
from tests.e2e.test_connector_tp_e2e import tp_spec
from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.small_model import ModelSpec
from vllm_pd.small_model.cache import ensure_model

pytestmark = pytest.mark.e2e

KEYS = ("ids17", "ids129", "ids640", "ids1500", "text3", "chat2")
ARGS = [*STATE_SERVER_ARGS, "--no-enable-prefix-caching"]


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def state_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_model(ModelSpec(arch="nemotron_h"), cache_dir=tmp_path_factory.mktemp("vllm-pd-state-cache"))


def _spec(model: Path, tp: int, ktc: dict | None) -> ec.VllmServerSpec:
    spec = tp_spec(model, ktc) if tp == 2 else ec.server_spec(model, "0-1" if ktc is None else UNBOUND, ktc)
    spec.extra_args.extend(ARGS)
    return spec


@pytest.fixture(scope="module")
def plain_by_tp(state_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, list[int]]]:
    """Greedy outputs of a plain TP 1 and a plain TP 2 instance, each started alone."""
    out = {}
    for tp in (1, 2):
        [plain] = ec.start_all([(_spec(state_model, tp, None), None)], tmp_path_factory.mktemp("vllm-smtp-logs"))
        try:
            with httpx.Client() as client:
                out[tp] = {key: ec.output_tokens(ec.post(client, plain.url, CONNECTOR_CASES[key])) for key in KEYS}
        finally:
            ec.stop_all([plain])
    return out


@pytest.fixture(scope="module")
def mixed_pair(plain_by_tp, state_model: Path, tmp_path_factory: pytest.TempPathFactory):
    """{TP size: instance}: a kv_both TP 1 and a kv_both TP 2 instance."""
    specs = []
    for tp in (1, 2):
        kv_port = ec.free_port()
        specs.append((_spec(state_model, tp, ec.connector_config("kv_both", kv_port, lease_s=60.0)), kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp("vllm-smtp-logs"))
    yield {1: instances[0], 2: instances[1]}
    ec.stop_all(instances)


def test_both_sides_tell_their_state_layout(mixed_pair) -> None:
    """Each instance kept the Mamba state in a group of its own, and vllm-pd knows how it is sharded."""
    for inst in mixed_pair.values():
        log = inst.server.log_path.read_text(errors="replace") if inst.server.log_path else ""
        assert STATE_GROUP in log, f"{inst.url}: no state KV cache group in its log"
        assert "is moved between equal TP and block sizes only" not in log


@pytest.mark.parametrize(
    "tps, mode",
    [((1, 2), "pull"), ((2, 1), "pull"), ((1, 2), "push-beside"), ((2, 1), "push-beside")],
    ids=["p1-d2-pull", "p2-d1-pull", "p1-d2-push-beside", "p2-d1-push-beside"],
)
def test_other_tp_takes_its_share_of_the_state(
    tps: tuple[int, int], mode: str, mixed_pair, plain_by_tp, client
) -> None:
    """A push of a state model is resolved to a pull (vLLM runs no save hook for a recurrent layer)."""
    prefill, decode = mixed_pair[tps[0]], mixed_pair[tps[1]]
    assert_prefill_served(client, prefill, decode, KEYS, mode, plain_by_tp[tps[1]], sources=("fetch",))
    assert ec.metric(client, decode.url, "vllm:pd_shape_refused_total") == 0
