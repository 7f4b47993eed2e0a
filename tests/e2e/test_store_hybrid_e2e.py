"""The KV store for a hybrid model (sliding-window layers beside full attention: several KV cache
groups, vLLM's hybrid KV cache manager on) on real vLLM CPU servers.

The model is test_connector_hybrid_e2e's (``--sliding-window 128 --full-attention-every 4``). A
plain instance (no connector) answers every prompt first; a ``kv_both`` instance with the store
(CPU tier and disk, vLLM's own prefix cache off, so every reused token comes from the store)
answers them after it. A 1500-token prompt computed once is served from the store when it comes
again and to the conversation's second turn (its first turn, the answer and a new question):
prompt tokens computed drop to the tail, every group's KV comes from the store (vLLM counts them
as external tokens), and the answers are the plain instance's token for token. Another tenant
(``cache_salt``) gets nothing. Then the store instance is started again on the same disk
directory: the first turn comes back from disk with the same answer. Nothing is held afterwards.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tests.e2e.test_connector_e2e import assert_nothing_held, prompt_sources
from tests.e2e.test_connector_hybrid_e2e import HYBRID_GROUPS, hybrid_model  # noqa: F401 (a fixture)
from tests.support import e2e_cluster as ec
from tests.support.prompt_catalogue import CONNECTOR_CASES
from vllm_pd.vllm_server import VllmServerSpec

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU default; the window is one block: cdiv(128 - 1, 128)
TURN1: list[int] = list(CONNECTOR_CASES["ids1500"]["prompt"])
QUESTION = [(i * 97) % 3000 + 11 for i in range(200)]
SAVED_S = 2.0  # a finished request's blocks are saved asynchronously
STORE_LOG = "KV store: "  # the scheduler side's start line names the KV cache groups


def store_spec(model: Path, cores: str, disk: Path) -> VllmServerSpec:
    store = {"cpu_bytes": "64m", "disk_path": str(disk), "disk_bytes": "256m"}
    spec = ec.server_spec(model, cores, ec.connector_config("kv_both", ec.free_port(), store=store))
    spec.extra_args += ["--no-enable-prefix-caching"]
    return spec


def ask(client: httpx.Client, inst: ec.Instance, ids: list[int], **kw: object) -> tuple[list[int], tuple[float, ...]]:
    """The answer to ``ids`` and how its prompt tokens were found (external, computed, local cache)."""
    before = prompt_sources(client, inst)
    out = ec.output_tokens(ec.post(client, inst.url, ec.completion_body(ids, **kw)))
    return out, tuple(a - b for a, b in zip(prompt_sources(client, inst), before))


@pytest.fixture(scope="module")
def runs(hybrid_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:  # noqa: F811
    logs, disk = tmp_path_factory.mktemp("store-hybrid-logs"), tmp_path_factory.mktemp("store-hybrid-disk")
    out: dict[str, object] = {}
    client = httpx.Client()
    try:
        plain, node = ec.start_all(
            [(ec.server_spec(hybrid_model, "0", None), None), (store_spec(hybrid_model, "1", disk), None)], logs
        )
        try:
            ref1, _ = ask(client, plain, TURN1)
            turn2 = TURN1 + ref1 + QUESTION
            out["turn2_len"] = len(turn2)
            out["reference"] = {"turn1": ref1, "turn2": ask(client, plain, turn2)[0]}
            out["turn1"] = ask(client, node, TURN1)
            time.sleep(SAVED_S)
            out["turn1_again"] = ask(client, node, TURN1)
            out["turn2"] = ask(client, node, turn2)
            out["other_tenant"] = ask(client, node, TURN1, cache_salt="another-tenant")
            out["log"] = node.server.log_path.read_text(errors="replace") if node.server.log_path else ""
            assert_nothing_held(client, [node])
        finally:
            ec.stop_all([plain, node])
        [again] = ec.start_all([(store_spec(hybrid_model, "0-1", disk), None)], logs)
        try:
            out["from_disk"] = ask(client, again, TURN1)
            assert_nothing_held(client, [again])
        finally:
            ec.stop_all([again])
    finally:
        client.close()
    return out


def test_the_store_keeps_every_kv_cache_group(runs) -> None:
    log = str(runs["log"])
    assert HYBRID_GROUPS in log and "Turning off hybrid kv cache manager" not in log
    assert "the KV store is off" not in log
    assert STORE_LOG + "4 KV cache groups (" in log, "the store did not start with every group"


def test_a_repeated_prompt_is_served_from_the_store(runs) -> None:
    ref = runs["reference"]["turn1"]  # type: ignore[index]
    first, (ext, computed, _) = runs["turn1"]  # type: ignore[misc]
    assert first == ref and ext == 0 and computed == len(TURN1)
    again, (ext, computed, cached) = runs["turn1_again"]  # type: ignore[misc]
    hit = (len(TURN1) - 1) // BLOCK * BLOCK
    assert again == ref, "the store's KV changed the answer"
    assert (ext, computed, cached) == (hit, len(TURN1) - hit, 0)


def test_the_second_turn_is_served_from_the_store(runs) -> None:
    out, (ext, computed, _) = runs["turn2"]  # type: ignore[misc]
    n = int(runs["turn2_len"])  # type: ignore[call-overload]
    assert out == runs["reference"]["turn2"]  # type: ignore[index]
    # turn 1's computed tokens (prompt and answer but the last) in whole blocks
    hit = (len(TURN1) + len(runs["reference"]["turn1"]) - 1) // BLOCK * BLOCK  # type: ignore[index]
    assert (ext, computed) == (hit, n - hit)


def test_another_tenant_gets_nothing(runs) -> None:
    out, (ext, computed, _) = runs["other_tenant"]  # type: ignore[misc]
    assert out == runs["reference"]["turn1"] and (ext, computed) == (0, len(TURN1))  # type: ignore[index]


def test_a_restarted_instance_serves_the_prompt_from_disk(runs) -> None:
    out, (ext, computed, _) = runs["from_disk"]  # type: ignore[misc]
    hit = (len(TURN1) - 1) // BLOCK * BLOCK
    assert out == runs["reference"]["turn1"] and (ext, computed) == (hit, len(TURN1) - hit)  # type: ignore[index]
