"""The KV block store on real vLLM CPU servers (one at a time: 2 cores).

Phase 1: a plain server (no connector, no prefix cache) gives reference outputs.
Phase 2: a colocated server (kv_both) with the store (CPU + disk), vLLM's own
prefix cache off so every reused token comes from the store: turn 2 of a
conversation loads turn 1's prefix (cached_tokens) and answers exactly like
the reference. Phase 3: the same server restarted on the same disk directory
(empty CPU pool): the prefix comes back from disk; a corrupted block file is
detected, recomputed, and the answer is still exact.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import httpx
import pytest

from tests.e2e_cluster import completion_body, connector_config, output_tokens, post, server_spec
from vllm_pd.vllm_server import VllmServer, free_port

pytestmark = pytest.mark.e2e

BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
THINK_TIME_S = 2.0
rng = random.Random(5)
TURN1 = [rng.randrange(300, 3000) for _ in range(150)]
TURN2 = TURN1 + [rng.randrange(300, 3000) for _ in range(60)]  # turn 1 + reply + next user message
OTHER = [rng.randrange(300, 3000) for _ in range(100)]


def cached(resp) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def run_server(model: Path, log_dir: Path, ktc, name: str) -> VllmServer:
    spec = server_spec(model, "0-1", ktc)
    spec.extra_args += ["--no-enable-prefix-caching", "--block-size", str(BLOCK)]
    server = VllmServer(spec, log_dir / f"{name}.log").start()
    try:
        server.wait_healthy(timeout=900)
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def phases(small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("store-e2e-logs")
    disk = tmp_path_factory.mktemp("store-disk")
    client = httpx.Client()
    out: dict[str, object] = {"disk": disk}
    server = run_server(small_model_dir, log_dir, None, "plain")
    try:
        out["ref1"] = output_tokens(post(client, server.url, completion_body(TURN1)))
        out["ref2"] = output_tokens(post(client, server.url, completion_body(TURN2)))
        out["ref_other"] = output_tokens(post(client, server.url, completion_body(OTHER)))
    finally:
        server.stop()
    store = {"cpu_bytes": "64m", "disk_path": str(disk), "disk_bytes": "256m"}
    ktc = connector_config("kv_both", free_port(), store=store)
    server = run_server(small_model_dir, log_dir, ktc, "store")
    try:
        r1 = post(client, server.url, completion_body(TURN1))
        # the user's think time: turn 1's blocks are saved after it finishes (asynchronously,
        # committed a step or two later); a turn 2 arriving within milliseconds would miss them
        time.sleep(THINK_TIME_S)
        r2 = post(client, server.url, completion_body(TURN2))
        out["turn1"], out["turn2"] = r1, r2
        post(client, server.url, completion_body(OTHER))  # saved too, for the corruption phase
    finally:
        server.stop()
    # corrupt the most recently written block file (one of OTHER's blocks)
    files = sorted((p for p in Path(disk).rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
    out["files"] = len(files)
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    server = run_server(small_model_dir, log_dir, ktc, "store-restarted")
    try:
        out["turn2_disk"] = post(client, server.url, completion_body(TURN2))
        out["other_disk"] = post(client, server.url, completion_body(OTHER))
    finally:
        server.stop()
        client.close()
    return out


def test_turn2_loads_turn1_prefix_from_the_store_and_matches(phases):
    assert cached(phases["turn1"]) == 0
    assert output_tokens(phases["turn1"]) == phases["ref1"]
    # turn 1's full blocks (prompt + generated tokens with KV) came from the store
    assert cached(phases["turn2"]) >= (len(TURN1) // BLOCK) * BLOCK
    assert output_tokens(phases["turn2"]) == phases["ref2"]


def test_after_restart_prefix_comes_from_disk(phases):
    assert phases["files"] > 0
    assert cached(phases["turn2_disk"]) >= (len(TURN1) // BLOCK) * BLOCK
    assert output_tokens(phases["turn2_disk"]) == phases["ref2"]


def test_corrupt_disk_block_is_recomputed_and_output_is_exact(phases):
    # whichever chain the corrupted file belonged to, every answer stays exact
    assert output_tokens(phases["other_disk"]) == phases["ref_other"]
    assert output_tokens(phases["turn2_disk"]) == phases["ref2"]
