"""kv_aware routing: vLLM-identical tokens and block hashes, the index fed by real KV-event
bytes (vLLM's own msgspec classes encode them), the policy's choices, and the flow's
decode-holds-prompt bypass against mock backends."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from tests.support.router_harness import harness, run, wait_for
from vllm_pd.protocol.block_keys import RequestExtraKeys
from vllm_pd.router.cli import command_proxy
from vllm_pd.router.config import ConfigError, InstanceConfig, ProxyConfig, load_yaml
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.request.block_hashes import PromptBlocks, VllmBlockHasher, external_hash
from vllm_pd.router.request.prompt_tokens import PromptTokenizer
from vllm_pd.router.request.request_body import CHAT, COMPLETIONS, parse_body
from vllm_pd.router.routing.kv_events_feed import KvEventsFeed
from vllm_pd.router.routing.kv_locations import KvLocations
from vllm_pd.router.routing.policies import KvAware, make_policy

BS = 16
CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "Name three prime numbers and explain why each is prime. " * 3},
    {"role": "assistant", "content": "2, 3 and 5: each has no divisor but 1 and itself."},
    {"role": "user", "content": [{"type": "text", "text": "And three more?"}, {"type": "text", "text": "Briefly."}]},
]


@pytest.fixture(scope="module")
def vllm_hashing():
    kv_cache_utils = pytest.importorskip("vllm.v1.core.kv_cache_utils")
    from vllm.utils.hashing import sha256, sha256_cbor

    return kv_cache_utils, {"sha256": sha256, "sha256_cbor": sha256_cbor}


def _vllm_hashes(vllm_hashing, algo: str, ids: list[int]) -> list[bytes]:
    utils, fns = vllm_hashing
    utils.init_none_hash(fns[algo])
    out, parent = [], None
    for start in range(0, len(ids) // BS * BS, BS):
        parent = utils.hash_block_tokens(fns[algo], parent, ids[start : start + BS])
        out.append(bytes(parent))
    return out


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_block_hashes_equal_vllms_own(vllm_hashing, algo: str) -> None:
    ids = [7, 0, 65535, 2**20, *range(100, 190)]  # 94 tokens: 5 full blocks, a partial tail without a hash
    mine = VllmBlockHasher(algo).hashes(ids, BS)
    assert len(mine) == 5
    assert mine == _vllm_hashes(vllm_hashing, algo, ids)
    assert VllmBlockHasher(algo, seed="other").hashes(ids, BS) != mine  # the seed is part of the chain


def test_unsupported_hash_algo_is_a_named_error() -> None:
    with pytest.raises(ValueError, match="kv_hash_algo"):
        VllmBlockHasher("xxhash")
    with pytest.raises(ConfigError, match="kv_hash_algo"):
        ProxyConfig(kv_hash_algo="builtin")
    with pytest.raises(ConfigError, match="tokenizer"):
        ProxyConfig(prefill_policy="kv_aware")


def test_tokens_equal_transformers_chat_template_and_encode(small_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(small_model_dir))
    tok = PromptTokenizer(small_model_dir, VllmBlockHasher())
    chat = parse_body(json.dumps({"messages": CONVERSATION}).encode(), CHAT)
    as_strings = [
        {**m, "content": "And three more?\nBriefly."} if isinstance(m["content"], list) else m for m in CONVERSATION
    ]
    text = ref.apply_chat_template(as_strings, add_generation_prompt=True, tokenize=False)
    assert tok.token_ids(chat) == ref(text, add_special_tokens=False)["input_ids"]
    prompt = "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1)"
    completion = parse_body(json.dumps({"prompt": prompt}).encode(), COMPLETIONS)
    assert tok.token_ids(completion) == ref(prompt)["input_ids"]
    ids = parse_body(json.dumps({"prompt": [5, 6, 7]}).encode(), COMPLETIONS)
    assert tok.token_ids(ids) == [5, 6, 7]
    # what is not reproduced exactly gives no blocks (routing by load), never a guess
    image = parse_body(
        json.dumps(
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}]}
        ).encode(),
        CHAT,
    )
    assert tok.blocks(image) is None


def _batch(*events: object) -> bytes:
    kv_events = pytest.importorskip("vllm.distributed.kv_events")
    return msgspec.msgpack.encode(kv_events.KVEventBatch(ts=time.time(), events=list(events)))


def _stored(hashes: list[bytes], ids: list[int], parent: bytes | None = None, **kw: object) -> object:
    from vllm.distributed.kv_events import BlockStored

    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=ids,
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
        **kw,
    )


def _prompt(ids: list[int]) -> PromptBlocks:
    return PromptBlocks(ids, VllmBlockHasher(), {})


def test_index_follows_stored_removed_cleared_and_gaps() -> None:
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved

    hasher = VllmBlockHasher()
    ids = list(range(1000, 1064))  # 4 blocks
    h = hasher.hashes(ids, BS)
    index = KvLocations(hasher)
    index.apply_message("a", 0, _batch(_stored(h[:3], ids[:48])))
    prompt = _prompt(ids + [1, 2, 3])
    assert index.cached_tokens("a", prompt) == 48
    assert index.cached_tokens("b", prompt) == 0
    assert not index.holds_prompt("a", prompt)
    index.apply_message("a", 1, _batch(_stored(h[3:], ids[48:], parent=h[2])))
    assert index.holds_prompt("a", prompt) and not index.hash_mismatch
    index.apply_message("a", 2, _batch(BlockRemoved(block_hashes=[h[1]], medium="GPU")))
    assert index.cached_tokens("a", prompt) == 16  # the chain breaks at the removed block
    index.apply_message("a", 3, _batch(_stored([h[1]], ids[16:32], parent=h[0]), AllBlocksCleared()))
    assert index.cached_tokens("a", prompt) == 0
    index.apply_message("a", 4, _batch(_stored(h, ids)))
    index.apply_message("a", 9, _batch())  # seq 5..8 lost: what a missed BlockRemoved said is unknown
    assert index.cached_tokens("a", prompt) == 0
    # int hashes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES) index the same
    index.apply_message("b", 0, _batch(_stored([external_hash(x) for x in h[:2]], ids[:32])))
    assert index.cached_tokens("b", prompt) == 32
    # a salted block is a salted prompt's, never a plain one's: its hash carries the salt
    salted = RequestExtraKeys(cache_salt="s")
    hs = hasher.hashes(ids, BS, extra_keys=salted.blocks(0, 4, BS))
    index.apply_message("c", 0, _batch(_stored(hs[:1], ids[:16], extra_keys=[("s",)])))
    assert index.cached_tokens("c", prompt) == 0
    assert index.cached_tokens("c", PromptBlocks(ids, hasher, {}, salted)) == 16
    # blocks of multimodal inputs are not kept: the proxy never hashes such requests
    index.apply_message("d", 0, _batch(_stored(h[:1], ids[:16], extra_keys=[(("img-hash", 0),)])))
    assert index.block_size("d") is None
    index.apply_message("c", 1, b"\xc1 not msgpack")  # dropped with a warning, nothing breaks
    assert index.cached_tokens("a", prompt) == 0


def test_index_notices_servers_hashing_differently() -> None:
    ids = list(range(BS))
    theirs = VllmBlockHasher("sha256_cbor").hashes(ids, BS)
    index = KvLocations(VllmBlockHasher("sha256"))
    index.apply_message("a", 0, _batch(_stored(theirs, ids)))
    assert index.hash_mismatch


def test_feed_subscribes_over_zmq() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    hasher = VllmBlockHasher()
    ids = list(range(2 * BS))
    index = KvLocations(hasher)
    feed = KvEventsFeed(index)
    feed.add("http://a", f"tcp://127.0.0.1:{port}")
    feed.start()
    try:
        payload = _batch(_stored(hasher.hashes(ids, BS), ids))
        deadline = time.monotonic() + 10
        seq = 0
        while index.cached_tokens("http://a", _prompt(ids)) == 0:  # a SUB joins late: publish until seen
            assert time.monotonic() < deadline, "no event arrived"
            pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
            seq += 1
            time.sleep(0.05)
        assert index.cached_tokens("http://a", _prompt(ids)) == 2 * BS
    finally:
        feed.stop()
        pub.close(linger=0)


def _pool(n: int) -> InstancePool:
    return InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://p{i}:1", "prefill") for i in range(n)]))


def test_policy_prefers_the_holder_until_its_queue_costs_more() -> None:
    hasher = VllmBlockHasher()
    ids = list(range(5000, 5000 + 10 * BS))
    index = KvLocations(hasher)
    index.apply_message("http://p1:1", 0, _batch(_stored(hasher.hashes(ids, BS)[:8], ids[: 8 * BS])))
    pool = _pool(3)
    policy = make_policy("kv_aware", index, load_weight=1.0)
    assert isinstance(policy, KvAware)
    req = parse_body(json.dumps({"prompt": ids + [1]}).encode(), COMPLETIONS)
    req.blocks = _prompt(req.body["prompt"])
    cands = pool.eligible("prefill")
    assert policy.choose_for(cands, "prefill", req).url == "http://p1:1"
    # 8 blocks saved = 128 tokens; a queue of 200 prompt tokens ahead outweighs them
    pool.get("http://p1:1").outstanding_tokens["prefill"] = 200
    assert policy.choose_for(cands, "prefill", req).url != "http://p1:1"
    # without blocks (not tokenizable exactly): least outstanding, rotating among equals
    req.blocks = None
    picked = {policy.choose_for(cands, "prefill", req).url for _ in range(4)}
    assert picked == {"http://p0:1", "http://p2:1"}


def test_flow_routes_to_holder_and_skips_prefill_when_decode_holds_prompt(small_model_dir: Path) -> None:
    async def go() -> None:
        async with harness(
            n_prefill=2, n_decode=1, prefill_policy="kv_aware", decode_policy="kv_aware", tokenizer=str(small_model_dir)
        ) as h:
            routing = h.proxy.kv_routing
            assert routing is not None
            body = {"model": "mock-model", "messages": CONVERSATION, "max_tokens": 3}
            # the model must be known as a base model (its /v1/models card) before a hit is claimed
            await wait_for(lambda: all(i.models for i in h.proxy.pool.all()))
            ids = routing.tokenizer.token_ids(parse_body(json.dumps(body).encode(), CHAT))
            assert ids is not None and len(ids) > 3 * BS
            full = routing.locations.hasher.hashes(ids, BS)
            p1, d0 = h.backend_urls["p1"], h.backend_urls["d0"]
            routing.locations.apply_message(p1, 0, _batch(_stored(full[:2], ids[: 2 * BS])))
            status, _ = await h.post("/v1/chat/completions", body)
            assert status == 200
            assert len(h.prefills[1].seen) == 1 and not h.prefills[0].seen
            # the prefill leg's load counts what it computes: the held blocks are not work
            req = parse_body(json.dumps(body).encode(), CHAT)
            req.blocks, req.prompt_tokens = routing.tokenizer.blocks(req), len(ids)
            assert h.proxy.flow._prefill_work(req, h.proxy.pool.get(p1)) == len(ids) - 2 * BS
            assert h.proxy.flow._prefill_work(req, h.proxy.pool.get(h.backend_urls["p0"])) == len(ids)
            routing.locations.apply_message(d0, 0, _batch(_stored(full, ids[: len(full) * BS])))
            status, _ = await h.post("/v1/chat/completions", body)
            assert status == 200
            assert len(h.prefills[0].seen) + len(h.prefills[1].seen) == 1  # no second prefill leg
            assert len(h.decodes[0].seen) == 2
            assert "kv_transfer_params" not in h.decodes[0].seen[1].body

    run(go)


def test_kv_events_from_flags_and_yaml(tmp_path: Path, small_model_dir: Path) -> None:
    p = argparse.ArgumentParser()
    command_proxy.add_arguments(p)
    cfg = command_proxy.config_from_args(
        p.parse_args(
            [
                "--prefill",
                "http://p:1",
                "--decode",
                "http://d:1",
                "--prefill-policy",
                "kv_aware",
                "--tokenizer",
                str(small_model_dir),
                "--kv-events",
                "http://p:1=tcp://p:5557",
                "--kv-hash-algo",
                "sha256_cbor",
                "--kv-load-weight",
                "0.5",
            ]
        )
    )
    assert [ic.kv_events for ic in cfg.instances] == ["tcp://p:5557", None]
    assert (cfg.kv_hash_algo, cfg.kv_load_weight) == ("sha256_cbor", 0.5)
    with pytest.raises(ConfigError, match="kv_events"):
        command_proxy.config_from_args(p.parse_args(["--prefill", "http://p:1", "--kv-events", "http://x:1=tcp://x:1"]))
    with pytest.raises(ConfigError, match="kv_events"):
        command_proxy.config_from_args(p.parse_args(["--prefill", "http://p:1", "--kv-events", "http://p:1=p:5557"]))
    yml = tmp_path / "proxy.yaml"
    yml.write_text("instances:\n  - {url: 'http://p:1', role: prefill, kv_events: 'tcp://p:5557'}\n")
    assert load_yaml(yml)["instances"][0].kv_events == "tcp://p:5557"


def test_kv_aware_tokenizes_off_the_event_loop_only(small_model_dir: Path) -> None:
    """With kv_aware the exact count comes from KvRouting's worker thread; the loop keeps the estimate
    (tokenizing a 33K-token prompt there would stall every other request ~10 ms)."""
    from vllm_pd.router.request.request_body import estimate_tokens
    from vllm_pd.router.server.app import ProxyServer

    tok = str(small_model_dir)
    assert ProxyServer(ProxyConfig(prefill_policy="kv_aware", tokenizer=tok)).count_tokens is estimate_tokens
    assert ProxyServer(ProxyConfig(decode_policy="kv_aware", tokenizer=tok)).count_tokens is estimate_tokens
    exact = ProxyServer(ProxyConfig(tokenizer=tok)).count_tokens  # other policies: exact, as configured
    assert exact is not estimate_tokens and exact("hello world") > 0
