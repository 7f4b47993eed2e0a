"""Prefill and decode with tensor parallelism 2 on real vLLM CPU servers.

Each TP rank holds its own shard of every transfer's KV (its half of the heads) and
its own KV endpoint: rank r of prefill feeds rank r of decode. The promises here:
disaggregated greedy output == a plain TP=2 instance's, and once decode is done (or
the proxy releases KV that no decode will take) every prefill rank frees its shard
at once - the lease is set far beyond the test, so only a release can free it.

Two cores: the plain reference instance runs alone first (one core per rank), then
the pair, each instance's ranks on cores 0 and 1.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.connector.worker.release import release_remote_kv
from vllm_pd.protocol.transfer_params import RemotePrefill

pytestmark = pytest.mark.e2e

TP = 2
RANKS = tuple(str(r) for r in range(TP))
CORES = "|".join(str(r) for r in range(TP))  # VLLM_CPU_OMP_THREADS_BIND: one core per rank
LEASE_S = 600.0  # far beyond the test: held KV is freed by a release or not at all
RELEASED_WITHIN_S = 15.0
KEYS = ("ids17", "ids129", "ids640", "ids1500", "text3", "chat2")


def tp_spec(model: Path, ktc: dict | None) -> ec.VllmServerSpec:
    spec = ec.server_spec(model, CORES, ktc)
    spec.extra_args += ["--tensor-parallel-size", str(TP)]
    # With TP > 1 vLLM torch.compiles its vocab-parallel embedding mask (inductor, a C++ build)
    # in each worker on the first forward, even with --enforce-eager. On two cores, with the
    # other instance's workers spinning beside it, a cold build took over vLLM's 5-minute step
    # timeout and killed the engine; eager gives the same integer mask.
    spec.env["TORCHDYNAMO_DISABLE"] = "1"
    return spec


@pytest.fixture(scope="module")
def client():
    with httpx.Client() as c:
        yield c


@pytest.fixture(scope="module")
def tp_reference(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    """Greedy outputs of a plain TP=2 instance (no connector), started alone and stopped after."""
    [plain] = ec.start_all([(tp_spec(small_model_dir, None), None)], tmp_path_factory.mktemp("vllm-tp-logs"))
    try:
        with httpx.Client() as client:
            return {key: ec.output_tokens(ec.post(client, plain.url, CONNECTOR_CASES[key])) for key in KEYS}
    finally:
        ec.stop_all([plain])


@pytest.fixture(scope="module")
def tp_pair(tp_reference: dict[str, list[int]], small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """A TP=2 prefill (kv_producer) and a TP=2 decode (kv_consumer); rank r listens on kv_port + r."""
    specs = []
    for role in ("kv_producer", "kv_consumer"):
        kv_port = ec.free_port()
        specs.append((tp_spec(small_model_dir, ec.connector_config(role, kv_port, lease_s=LEASE_S)), kv_port))
    instances = ec.start_all(specs, tmp_path_factory.mktemp("vllm-tp-logs"))
    yield instances
    ec.stop_all(instances)


def held(client: httpx.Client, prefill: ec.Instance) -> dict[str, float]:
    """Transfers each prefill rank holds for decode (its own gauge sample, label tp_rank)."""
    return {r: ec.metric(client, prefill.url, "vllm:pd_held_transfers", tp_rank=r) for r in RANKS}


def assert_every_rank_released(client: httpx.Client, prefill: ec.Instance) -> None:
    assert ec.wait_until(
        lambda: (
            held(client, prefill) == {r: 0.0 for r in RANKS}
            and ec.metric(client, prefill.url, "vllm:kv_cache_usage_perc") == 0
        ),
        timeout=RELEASED_WITHIN_S,
    ), (
        f"prefill still holds KV {RELEASED_WITHIN_S:.0f}s after the release (lease {LEASE_S:.0f}s): "
        f"per rank {held(client, prefill)}, usage {ec.metric(client, prefill.url, 'vllm:kv_cache_usage_perc')}"
    )
    assert ec.metric(client, prefill.url, "vllm:pd_lease_expired_total") == 0


@pytest.mark.parametrize("mode", ["pull", "push-beside"])
def test_tp2_disaggregated_output_equals_plain_tp2(mode: str, tp_pair, tp_reference, client) -> None:
    """pull: vLLM's standard flow (prefill's answer carried to decode); push-beside: our proxy's
    (decode leg first, each prefill rank pushing its shard to its decode rank)."""
    prefill, decode = tp_pair
    ok_before = ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok")
    mismatches = []
    for key in KEYS:
        p, d = ec.disagg(client, prefill, decode, CONNECTOR_CASES[key], mode)
        if mode == "pull":
            remote = RemotePrefill.parse(p["kv_transfer_params"])
            assert remote is not None and remote.tp_size == TP and len(set(remote.rank_endpoints)) == TP
        if ec.output_tokens(d) != tp_reference[key]:
            mismatches.append(key)
    assert not mismatches, f"{mode}: outputs differ from the plain TP=2 instance for {mismatches}"
    # the KV came from prefill: loads are counted once per request, when every rank's load is done
    assert ec.metric(client, decode.url, "vllm:pd_loads_total", result="ok") - ok_before >= len(KEYS) // 2
    assert_every_rank_released(client, prefill)


def test_tp2_proxy_side_release_frees_every_prefill_rank(tp_pair, client) -> None:
    """The client went away between the legs: the proxy releases what prefill holds, on every rank."""
    prefill, decode = tp_pair
    p = ec.post(client, prefill.url, ec.prefill_leg(CONNECTOR_CASES["ids1000"], "pull", decode))
    assert ec.wait_until(lambda: held(client, prefill) == {r: 1.0 for r in RANKS}, timeout=10), held(client, prefill)
    # the proxy's first release dials every prefill rank; with four TP workers spinning on two
    # cores that handshake alone took over the default 2 s here once
    assert release_remote_kv(p["kv_transfer_params"], timeout=10.0)
    assert_every_rank_released(client, prefill)
