"""The KV block store on real vLLM CPU servers; expected outputs come from the
session's plain reference instance (``reference_outputs``; the prompts are
tests/support/prompt_catalogue.STORE_CASES).

Phase 1: a store master process and two colocated store nodes (kv_both), A on
core 0 and B on core 1, vLLM's own prefix cache off so every reused token
comes from the store. A serves turn 1; B serves turn 2 with turn 1's prefix
fetched from A through the master (cached_tokens on B, which never saw turn 1)
and answers exactly like the reference. B has a CPU tier of a few blocks and
no disk: under that memory pressure it evicts, never serves an evicted block,
and answers exactly. A has a CPU tier of a few blocks too: a prompt A computed
and then pushed to its disk (later traffic filled its CPU tier) is fetched by
B from A's disk (A stages it for the fetch) with exact output. Then the master
is killed while requests run: they all succeed with exact output (local
lookups / recompute).
Phase 2: A restarted on the same disk directory (empty CPU pool): the prefix
comes back from disk; a corrupted block file is detected, recomputed, and the
answer is still exact.
Three server starts in all (two of them side by side).
The nodes and the master share a deployment secret (the suite's store path with one; the TP and
router suites run without): an outsider with our client code reads nothing of the index and
publishes nothing into it while the nodes work as without one.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.support.e2e_cluster import (
    completion_body,
    connector_config,
    metric,
    output_tokens,
    post,
    server_spec,
    start_all,
    stop_all,
    write_secret,
)
from tests.support.prompt_catalogue import (
    STORE_FROM_DISK,
    STORE_LATE,
    STORE_OTHER,
    STORE_PRESSURE,
    STORE_TURN1,
    STORE_TURN2,
)
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.vllm_server import free_port

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU default (the reference instance uses it too)
B_SLOTS = 6  # node B's CPU tier, in blocks: memory pressure
A_SLOTS = 6  # node A's CPU tier: STORE_FROM_DISK's blocks leave it for A's disk
THINK_TIME_S = 2.0
TURN1, TURN2, OTHER = STORE_TURN1, STORE_TURN2, STORE_OTHER
PRESSURE = STORE_PRESSURE  # 2 full blocks saved each: 8 > B_SLOTS
LATE = STORE_LATE[:3]  # sent to A and B while the master is killed
LATE_EXT = STORE_LATE[3]  # extends LATE[0] (computed on A), asked on B once the master is dead


def cached(resp) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def store_spec(model: Path, cores: str, store: dict, secret_file: str):
    ktc = connector_config("kv_both", free_port(), store=store, secret_file=secret_file)
    spec = server_spec(model, cores, ktc)
    spec.extra_args += ["--no-enable-prefix-caching"]
    return spec, None


@pytest.fixture(scope="module")
def phases(reference_outputs, small_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log_dir = tmp_path_factory.mktemp("store-e2e-logs")
    disk = tmp_path_factory.mktemp("store-disk")
    client = httpx.Client()
    out: dict[str, object] = {}
    secret_file = write_secret(log_dir)
    master, address = spawn_master(free_port(), secret_file=secret_file)
    store_a = {
        "cpu_bytes": f"{A_SLOTS * 256}k",
        "disk_path": str(disk),
        "disk_bytes": "256m",
        "master": address,
        "node_id": "A",
    }
    store_b = {"cpu_bytes": f"{B_SLOTS * 256}k", "master": address, "node_id": "B"}  # 256 KiB per block
    try:
        node_a, node_b = start_all(
            [
                store_spec(small_model_dir, "0", store_a, secret_file),
                store_spec(small_model_dir, "1", store_b, secret_file),
            ],
            log_dir,
        )
        try:
            a, b = node_a.url, node_b.url
            out["turn1"] = post(client, a, completion_body(TURN1))
            time.sleep(THINK_TIME_S)  # turn 1's blocks are saved asynchronously, then published
            out["outsider"] = outsider_attacks(address, secret_file)
            out["turn2"] = post(client, b, completion_body(TURN2))  # on the other node
            out["pressure"] = [post(client, b, completion_body(p)) for p in PRESSURE]
            time.sleep(THINK_TIME_S)  # the last one's blocks commit after its answer
            out["pressure_again"] = [post(client, b, completion_body(p)) for p in reversed(PRESSURE)]
            out["from_disk_on_a"] = post(client, a, completion_body(STORE_FROM_DISK))
            for p in PRESSURE:  # 8 more blocks through A's 6-slot CPU tier: FROM_DISK's go to disk only
                post(client, a, completion_body(p))
            time.sleep(THINK_TIME_S)
            out["from_disk_on_b"] = post(client, b, completion_body(STORE_FROM_DISK))
            out["late"] = late_requests_while_the_master_dies(a, b, master)
            post(client, a, completion_body(OTHER))  # A's last blocks on disk, for the corruption phase
            time.sleep(THINK_TIME_S)
            out["served_by_a"] = {
                tier: metric(client, a, "vllm:pd_store_served_blocks_total", tier=tier) for tier in ("cpu", "disk")
            }
        finally:
            stop_all([node_a, node_b])
    finally:
        master.kill()
        master.wait()
        client.close()
    # corrupt the most recently written block file (one of OTHER's blocks)
    files = sorted((p for p in Path(disk).rglob("*") if p.is_file()), key=lambda p: p.stat().st_mtime)
    out["files"] = len(files)
    victim = files[-1]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    [restarted] = start_all([store_spec(small_model_dir, "0-1", store_a, secret_file)], log_dir)
    client = httpx.Client()
    try:
        out["turn2_disk"] = post(client, restarted.url, completion_body(TURN2))
        out["other_disk"] = post(client, restarted.url, completion_body(OTHER))
    finally:
        stop_all([restarted])
        client.close()
    return out


def outsider_attacks(address: str, secret_file: str) -> dict[str, object]:
    """An outsider (our client code, no secret) asks the live master for its nodes and who holds
    turn 1, and publishes a node claiming turn 2's blocks; then a member lists the nodes."""
    from vllm_pd.connector.deployment_secret import load_secret
    from vllm_pd.connector.store.master_client import MasterLink
    from vllm_pd.protocol.block_keys import KeySalt, chain_keys
    from vllm_pd.protocol.store_index import Holders, Nodes, Publish

    outsider = MasterLink(address, timeout_s=2.0, retry_after_s=0.0)
    member = MasterLink(address, timeout_s=2.0, retry_after_s=0.0, secret=load_secret(secret_file, env={}))
    try:
        guess = KeySalt("small", "bfloat16", "cpu", BLOCK, 1)  # what the salt may be: the outsider cannot ask
        answers = {
            "nodes": outsider.call(Nodes()),
            "holders": outsider.call(Holders(chain_keys(list(TURN1), guess))),
            "publish": outsider.call(
                Publish(
                    "Z",
                    "tcp://127.0.0.1:1",
                    [(k, None) for k in chain_keys(list(TURN2), guess)],
                    snapshot=True,
                    salt=guess,
                    instance_url="http://127.0.0.1:1",
                )
            ),
        }
        nodes = member.call(Nodes())
        return {**answers, "member_nodes": None if nodes is None else sorted(n.node for n in nodes.nodes)}
    finally:
        outsider.close()
        member.close()


def late_requests_while_the_master_dies(a: str, b: str, master: subprocess.Popen) -> dict:
    """LATE prompts go to A and B at once; the master is killed after the first
    answer, while the others run; then B gets an extension of what A computed."""
    results: dict[str, object] = {}

    def send(name: str, url: str, ids: list[int]) -> None:
        try:
            with httpx.Client() as own:  # one client per thread
                results[name] = post(own, url, completion_body(ids))
        except Exception as exc:
            results[name] = exc

    threads = [
        threading.Thread(target=send, args=(f"store_late{i}", a if i % 2 == 0 else b, ids))
        for i, ids in enumerate(LATE)
    ]
    threads[0].start()
    threads[0].join()
    master.kill()
    master.wait()
    for t in threads[1:]:
        t.start()
    for t in threads[1:]:
        t.join()
    time.sleep(THINK_TIME_S)
    send("store_late3", b, LATE_EXT)
    return results


def test_turn2_on_another_node_fetches_turn1_through_the_master(phases, reference_outputs):
    assert cached(phases["turn1"]) == 0
    assert output_tokens(phases["turn1"]) == reference_outputs["store_turn1"]
    # B never saw turn 1: its full blocks (prompt + generated tokens with KV) came from A
    assert cached(phases["turn2"]) >= (len(TURN1) // BLOCK) * BLOCK
    assert output_tokens(phases["turn2"]) == reference_outputs["store_turn2"]


def test_an_outsider_neither_reads_nor_publishes_the_index(phases):
    outsider = phases["outsider"]
    assert outsider["nodes"] is None and outsider["holders"] is None and outsider["publish"] is None
    assert outsider["member_nodes"] == ["A", "B"]  # the nodes, and no fake one


def test_memory_pressure_evicts_within_capacity_and_never_serves_evicted_blocks(phases, reference_outputs):
    first, again = phases["pressure"], list(reversed(phases["pressure_again"]))
    for i, (r1, r2) in enumerate(zip(first, again)):
        assert output_tokens(r1) == output_tokens(r2) == reference_outputs[f"store_pressure{i}"]
        assert cached(r1) == 0 and cached(r2) <= B_SLOTS * BLOCK
    full = (len(PRESSURE[0]) // BLOCK) * BLOCK
    hits = [cached(r) for r in again]
    assert max(hits) >= BLOCK  # the store still serves under pressure
    assert min(hits) < full  # and evicted: 8 blocks of these prompts never fit in 6 slots


def test_a_block_on_the_holders_disk_is_fetched_by_another_node(phases, reference_outputs):
    assert cached(phases["from_disk_on_a"]) == 0
    # B never saw this prompt; A holds its blocks on disk only by now
    assert cached(phases["from_disk_on_b"]) >= (len(STORE_FROM_DISK) // BLOCK) * BLOCK
    assert output_tokens(phases["from_disk_on_b"]) == output_tokens(phases["from_disk_on_a"])
    assert output_tokens(phases["from_disk_on_b"]) == reference_outputs["store_from_disk"]
    # A's counters: turn 1's blocks went from its CPU pool, this prompt's from its disk
    assert phases["served_by_a"]["cpu"] >= len(TURN1) // BLOCK
    assert phases["served_by_a"]["disk"] >= len(STORE_FROM_DISK) // BLOCK


def test_killing_the_master_mid_run_keeps_requests_exact(phases, reference_outputs):
    late = phases["late"]
    for name in ("store_late0", "store_late1", "store_late2", "store_late3"):
        resp = late[name]
        assert not isinstance(resp, Exception), f"{name}: {resp!r}"
        assert output_tokens(resp) == reference_outputs[name]
    # B would have fetched LATE[0]'s blocks from A through the master; with the master dead it recomputes
    assert cached(late["store_late3"]) == 0


def test_after_restart_prefix_comes_from_disk(phases, reference_outputs):
    assert phases["files"] > 0
    assert cached(phases["turn2_disk"]) >= (len(TURN1) // BLOCK) * BLOCK
    assert output_tokens(phases["turn2_disk"]) == reference_outputs["store_turn2"]


def test_corrupt_disk_block_is_recomputed_and_output_is_exact(phases, reference_outputs):
    # whichever chain the corrupted file belonged to, every answer stays exact
    assert output_tokens(phases["other_disk"]) == reference_outputs["store_other"]
    assert output_tokens(phases["turn2_disk"]) == reference_outputs["store_turn2"]
