"""kv_aware with the store master as a location source: the proxy's StoreLocations against a real
master process (nodes publishing through the store's own MasterClient), master down / restarted /
stale, the policy's choice with store holdings, the flow's store_fetch hint and its decode bypass
(mock vLLM backends), and the flag."""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.router_harness import harness, run, wait_for
from vllm_pd.connector.store.master_client import MasterClient
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.protocol.block_keys import KeySalt, chain_keys
from vllm_pd.protocol.store_index import NodeInfo
from vllm_pd.protocol.transfer_params import StoreFetch
from vllm_pd.router.cli import command_proxy
from vllm_pd.router.config import ConfigError, InstanceConfig, ProxyConfig, load_yaml
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.request.block_hashes import PromptBlocks, VllmBlockHasher
from vllm_pd.router.request.request_body import CHAT, COMPLETIONS, parse_body
from vllm_pd.router.request.store_prompt import StoreHit, StorePrompt
from vllm_pd.router.routing.kv_locations import KvLocations
from vllm_pd.router.routing.policies import KvAware, held_tokens
from vllm_pd.router.routing.store_locations import StoreLocations
from vllm_pd.vllm_server import free_port

BS = 16
SALT = KeySalt("m@", "bfloat16/auto", "cpu:4096B/block", BS, 2)
IDS = list(range(1000, 1000 + 5 * BS + 3))  # 5 full blocks + 3 tokens


@pytest.fixture
def master() -> Iterator[tuple[object, str, int]]:
    port = free_port()
    proc, address = spawn_master(port)
    yield proc, address, port
    proc.kill()
    proc.wait()


def node(
    address: str,
    name: str,
    url: str,
    blocks: int,
    ids: list[int] = IDS,
    salt: KeySalt = SALT,
    endpoint: str | None = None,
) -> MasterClient:
    """A store node that holds the first ``blocks`` blocks of ``ids``, published as the store does."""
    keys = chain_keys(ids, salt)[:blocks]
    chain = [(k, keys[i - 1] if i else None) for i, k in enumerate(keys)]
    client = MasterClient(
        address, name, endpoint or f"tcp://{name}:7000", lambda: chain, timeout_s=2.0, salt=salt, instance_url=url
    )
    assert client.flush()
    return client


def test_locate_counts_each_instances_store_and_hints_the_best_other_node(master) -> None:
    _, address, _ = master
    nodes = [
        node(address, "n-p0", "http://p0:1", 2),
        node(address, "n-p1", "http://p1:1", 4),
        node(address, "n-x", "", 5),  # not an instance the proxy routes to, but fetchable
        node(address, "n-d0", "http://d0:1", 5, salt=KeySalt("other-model", "bf16", "cpu", BS, 2)),
    ]
    loc = StoreLocations(address, timeout_s=2.0)
    try:
        got = loc.locate(IDS)
        assert got is not None
        assert (got.tokens("http://p0:1"), got.tokens("http://p1:1"), got.tokens("http://p9:1")) == (32, 64, 0)
        # d0's store holds the prompt, but under another salt: keys of that salt, so d0 holds its own 5
        assert got.tokens("http://d0:1") == 5 * BS and got.holds_prompt("http://d0:1")
        assert not got.holds_prompt("http://p1:1")
        # p0 should fetch from the node of its salt holding the most (n-x), beyond what p0 holds
        assert got.fetch_hint("http://p0:1", 32) == StoreFetch("n-x", "tcp://n-x:7000", 5)
        assert got.fetch_hint("http://p0:1", 5 * BS) is None  # p0 holds as much itself (prefix cache)
        assert got.fetch_hint("http://d0:1", 0) is None  # nobody of d0's salt holds more than d0
        assert got.fetch_hint("http://unknown:1", 0) is None  # no salt known for it: no hint
        assert loc.locate(IDS[: BS - 1]) == StorePrompt(BS - 1, (), got.salts)  # no full block: nothing held
    finally:
        loc.close()
        for n in nodes:
            n.close()


def test_master_down_is_logged_once_retried_with_backoff_and_found_again_after_restart(
    master, caplog: pytest.LogCaptureFixture
) -> None:
    proc, address, port = master
    p1 = node(address, "n-p1", "http://p1:1", 3)
    loc = StoreLocations(address, timeout_s=0.3, retry_after_s=0.5, refresh_s=0.0)
    try:
        assert loc.locate(IDS).tokens("http://p1:1") == 3 * BS
        proc.kill()
        proc.wait()
        with caplog.at_level(logging.DEBUG, logger="vllm.plugins.vllm_pd.connector.store.master_client"):
            t0 = time.monotonic()
            assert loc.locate(IDS) is None  # bounded by the timeout
            assert time.monotonic() - t0 < 1.0
            t0 = time.monotonic()
            assert loc.locate(IDS) is None and time.monotonic() - t0 < 0.05  # backing off: not even asked
            time.sleep(0.6)
            assert loc.locate(IDS) is None  # retried, still down: back-off doubles
            warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
            assert len(warnings) == 1 and "kv_aware routes by KV events only" in warnings[0].getMessage()
        proc2, _ = spawn_master(port)  # a fresh master: knows no node until they resync
        try:
            p1.retry_after_s = p1.heartbeat_s = 0.0
            time.sleep(1.1)  # the proxy's back-off (1 s now) passes
            deadline = time.monotonic() + 10
            while True:  # the node heartbeats, learns the master lost it, republishes its snapshot
                p1.flush()
                got = loc.locate(IDS)
                if got is not None and got.tokens("http://p1:1") == 3 * BS:
                    break
                assert time.monotonic() < deadline, got
                time.sleep(0.2)
        finally:
            proc2.kill()
            proc2.wait()
    finally:
        loc.close()
        p1.close()


def test_stale_holdings_follow_evictions_and_the_node_list_refreshes(master) -> None:
    _, address, _ = master
    keys = chain_keys(IDS, SALT)
    p0 = node(address, "n-p0", "http://p0:1", 4)
    loc = StoreLocations(address, timeout_s=2.0, refresh_s=60.0)
    try:
        assert loc.locate(IDS).tokens("http://p0:1") == 4 * BS
        p0.removed(keys[1])  # evicted: the leading run ends at block 1
        assert p0.flush()
        assert loc.locate(IDS).tokens("http://p0:1") == BS
        p1 = node(address, "n-p1", "http://p1:1", 4)
        assert loc.locate(IDS).tokens("http://p1:1") == 0  # not in the node list yet (refreshed every 60 s)
        loc.refresh_s = 0.0
        assert loc.locate(IDS).tokens("http://p1:1") == 4 * BS
        assert [n.node for n in loc.nodes if n.salt is not None] == ["n-p0", "n-p1"]
        p1.close()
    finally:
        loc.close()
        p0.close()


def test_an_instances_salt_outlives_its_nodes_expiry() -> None:
    """An idle instance's node stops publishing and the master drops it; the proxy still knows its
    salt, so that instance can still be told where to fetch from."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from vllm_pd.connector.store.master import serve; serve('tcp://127.0.0.1:{port}', node_ttl_s=0.5)",
        ]
    )
    address = f"tcp://127.0.0.1:{port}"
    loc = StoreLocations(address, timeout_s=2.0, refresh_s=0.0, retry_after_s=0.1)
    idle = holder = None
    try:
        deadline = time.monotonic() + 20
        while loc.locate(IDS) is None:  # the master process starting
            assert time.monotonic() < deadline
            time.sleep(0.2)
        idle = node(address, "n-p0", "http://p0:1", 0)
        assert "http://p0:1" in loc.locate(IDS).salts
        time.sleep(0.8)  # p0 silent beyond the master's node TTL
        holder = node(address, "n-p1", "http://p1:1", 4)
        got = loc.locate(IDS)
        assert [n.node for n in loc.nodes if n.salt is not None] == ["n-p1"]
        assert got.fetch_hint("http://p0:1", 0) == StoreFetch("n-p1", "tcp://n-p1:7000", 4)
    finally:
        loc.close()
        for n in (idle, holder):
            if n is not None:
                n.close()
        proc.kill()
        proc.wait()


def _prompt(ids: list[int]) -> PromptBlocks:
    return PromptBlocks(ids, VllmBlockHasher(), {})


def _hit(name: str, url: str, blocks: int) -> StoreHit:
    return StoreHit(NodeInfo(name, f"tcp://{name}:1", url, SALT), SALT, blocks)


def test_policy_counts_the_longer_of_prefix_cache_and_own_store() -> None:
    pool = InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://p{i}:1", "prefill") for i in range(3)]))
    locations = KvLocations(VllmBlockHasher())
    policy = KvAware(locations, load_weight=1.0)
    req = parse_body(json.dumps({"prompt": IDS}).encode(), COMPLETIONS)
    req.blocks = _prompt(IDS)
    salts = {f"http://p{i}:1": SALT for i in range(3)}
    req.store = StorePrompt(len(IDS), (_hit("a", "http://p0:1", 1), _hit("b", "http://p2:1", 4)), salts)
    cands = pool.eligible("prefill")
    assert held_tokens(locations, "http://p2:1", req) == 4 * BS
    assert policy.choose_for(cands, "prefill", req).url == "http://p2:1"
    pool.get("http://p2:1").outstanding_tokens["prefill"] = 3 * BS + 1  # its queue now outweighs 3 blocks
    assert policy.choose_for(cands, "prefill", req).url == "http://p0:1"
    req.store = None  # master down (no KV events either): the least loaded, rotating among equals
    assert {policy.choose_for(cands, "prefill", req).url for _ in range(4)} == {"http://p0:1", "http://p1:1"}


def test_flow_hints_the_prefill_leg_and_skips_prefill_when_decodes_store_holds_the_prompt(
    master, small_model_dir: Path
) -> None:
    _, address, _ = master
    body = {
        "model": "mock-model",
        "messages": [{"role": "user", "content": "Name three primes. " * 20}],
        "max_tokens": 3,
    }

    async def go() -> None:
        async with harness(
            n_prefill=2,
            n_decode=1,
            prefill_policy="kv_aware",
            decode_policy="kv_aware",
            tokenizer=str(small_model_dir),
            store_master=address,
        ) as h:
            routing = h.proxy.kv_routing
            assert routing is not None and routing.store is not None
            # the model must be known as a base model (its /v1/models card) before a hit is claimed
            await wait_for(lambda: all(i.models for i in h.proxy.pool.all()))
            ids = routing.tokenizer.token_ids(parse_body(json.dumps(body).encode(), CHAT))
            assert ids is not None and len(ids) > 4 * BS
            full = len(ids) // BS
            u = h.backend_urls
            nodes = [
                node(address, "n-p0", u["p0"], 1, ids),
                node(address, "n-p1", u["p1"], 2, ids),
                node(address, "n-d0", u["d0"], full - 1, ids),
            ]
            try:
                status, _ = await h.post(CHAT, body)
                assert status == 200
                assert len(h.prefills[1].seen) == 1 and not h.prefills[0].seen  # p1's store holds the most
                params = h.prefills[1].seen[0].body["kv_transfer_params"]
                # decode's store holds more than p1: p1's store is told to fetch from there
                assert StoreFetch.from_params(params) == StoreFetch("n-d0", "tcp://n-d0:7000", full - 1)
                nodes.append(node(address, "n-d0", u["d0"], full, ids))  # now decode's store holds it all
                status, _ = await h.post(CHAT, body)
                assert status == 200
                assert len(h.prefills[0].seen) + len(h.prefills[1].seen) == 1  # no second prefill leg
                assert "kv_transfer_params" not in h.decodes[0].seen[1].body
                metrics = h.proxy.metrics.render().decode()
                assert 'vllm_pd_proxy_decode_only_total{reason="decode_store_holds_prompt"} 1.0' in metrics
                assert "vllm_pd_proxy_store_fetch_hints_total 1.0" in metrics
            finally:
                for n in nodes:
                    n.close()

    run(go)


def test_store_master_from_flag_and_yaml_validated_naming_the_key(tmp_path: Path, small_model_dir: Path) -> None:
    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    base = ["--prefill", "http://p:1", "--decode", "http://d:1", "--tokenizer", str(small_model_dir)]
    cfg = command_proxy.config_from_args(
        p.parse_args(base + ["--prefill-policy", "kv_aware", "--store-master", "tcp://10.0.0.9:7700"])
    )
    assert cfg.store_master == "tcp://10.0.0.9:7700"
    for bad in ("10.0.0.9:7700", "tcp://10.0.0.9", "http://10.0.0.9:7700"):
        with pytest.raises(ConfigError, match="store_master"):
            command_proxy.config_from_args(p.parse_args(base + ["--prefill-policy", "kv_aware", "--store-master", bad]))
    with pytest.raises(ConfigError, match="store_master: only the kv_aware policy"):
        command_proxy.config_from_args(p.parse_args(base + ["--store-master", "tcp://h:1"]))
    yml = tmp_path / "proxy.yaml"
    yml.write_text(
        f"prefill_policy: kv_aware\ntokenizer: {small_model_dir}\nstore_master: tcp://m:7700\n"
        "instances:\n  - {url: 'http://p:1', role: prefill}\n"
    )
    assert load_yaml(yml)["store_master"] == "tcp://m:7700"
