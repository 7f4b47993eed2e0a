"""kv_aware routing keys on what vLLM keys KV on: the LoRA adapter (its name and the path from its
/v1/models card) and cache_salt. The proxy's hashes and store keys of such requests equal vLLM's
and the store's own (computed here from vLLM's real Request objects); a request whose extra keys
the proxy cannot name (an unknown model, which may be an adapter) claims no hit and is routed by
load (mock vLLM backends for the flow: the decision under test is the proxy's)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import sha256, sha256_cbor
from vllm.v1.core import kv_cache_utils
from vllm.v1.request import Request

from tests.integration.test_router_store_locations import master, node  # noqa: F401 - the master fixture
from tests.support.router_harness import harness, run, wait_for
from tests.unit.router.test_router_kv_aware import CONVERSATION, _batch, _stored
from vllm_pd.connector.store.request_keys import RequestKeys
from vllm_pd.connector.store_bridge import request_extra_keys as engine_extra_keys
from vllm_pd.protocol.block_keys import NO_EXTRA_KEYS, KeySalt, RequestExtraKeys
from vllm_pd.router.config import InstanceConfig, ProxyConfig
from vllm_pd.router.pool.instance_pool import InstancePool
from vllm_pd.router.request.block_hashes import PromptBlocks, VllmBlockHasher
from vllm_pd.router.request.request_body import CHAT, COMPLETIONS, parse_body
from vllm_pd.router.routing.kv_extra_keys import ServedModels, request_extra_keys
from vllm_pd.router.routing.store_locations import StoreLocations

BS = 16
IDS = list(range(3000, 3000 + 4 * BS + 5))
ADAPTER = ("sql", "/adapters/sql")
SERVED = ServedModels(frozenset({"small"}), {"sql": "/adapters/sql"})


def body(**kw: object) -> bytes:
    return json.dumps({"prompt": IDS, **kw}).encode()


@pytest.mark.parametrize("algo,fn", [("sha256", sha256), ("sha256_cbor", sha256_cbor)])
@pytest.mark.parametrize("lora,salt", [(ADAPTER, None), (None, "tenant-a"), (ADAPTER, "tenant-a")])
def test_proxy_hashes_of_adapter_and_salted_requests_are_vllms_own(algo, fn, lora, salt) -> None:
    kv_cache_utils.init_none_hash(fn)
    req = Request(
        "r",
        IDS,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        block_hasher=kv_cache_utils.get_request_block_hasher(BS, fn),
    )
    extra = RequestExtraKeys(lora=lora, cache_salt=salt)
    mine = VllmBlockHasher(algo).hashes(IDS, BS, extra_keys=extra.blocks(0, len(IDS) // BS, BS))
    assert mine == [bytes(h) for h in req.block_hashes]
    assert mine != VllmBlockHasher(algo).hashes(IDS, BS)
    # and the store keys the proxy asks the master about are the connector's
    salt_ = KeySalt("m", "bfloat16", "cpu", BS, 2)
    assert RequestKeys(salt_).get(IDS, extra_keys=extra) == RequestKeys(salt_).get(
        IDS, extra_keys=engine_extra_keys(req)
    )


def test_extra_keys_named_from_model_and_cache_salt() -> None:
    def named(raw: bytes, path: str = COMPLETIONS) -> RequestExtraKeys | None:
        return request_extra_keys(parse_body(raw, path), SERVED)

    assert named(body()) is NO_EXTRA_KEYS  # no model: vLLM serves the base model
    assert named(body(model="small")) is NO_EXTRA_KEYS
    assert named(body(model="sql")) == RequestExtraKeys(lora=ADAPTER)
    assert named(body(model="small", cache_salt="A")) == RequestExtraKeys(cache_salt="A")
    assert named(body(model="sql", cache_salt="A")) == RequestExtraKeys(lora=ADAPTER, cache_salt="A")
    chat = json.dumps({"model": "sql", "messages": CONVERSATION, "cache_salt": "A"}).encode()
    assert named(chat, CHAT) == RequestExtraKeys(lora=ADAPTER, cache_salt="A")
    # what cannot be named exactly: no keys at all (routed by load)
    assert named(body(model="loaded-later")) is None  # maybe an adapter the cards did not list
    assert named(body(model="small", cache_salt=7)) is None


def test_served_models_from_the_instances_cards() -> None:
    pool = InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://p{i}:1", "prefill") for i in range(2)]))
    p0, p1 = pool.get("http://p0:1"), pool.get("http://p1:1")
    p0.models, p0.adapters = ["small", "sql"], {"sql": "/adapters/sql"}
    p1.models = ["small"]
    served = ServedModels.of(pool.all())
    assert served.base == frozenset({"small"}) and served.adapters == {"sql": "/adapters/sql"}
    assert ServedModels.of([]).base == frozenset()


def test_flow_routes_salted_and_adapter_requests_by_their_own_blocks_and_unknown_models_by_load(
    small_model_dir: Path,
) -> None:
    """p1 holds the plain prompt, p0 the same tokens salted "A", and (later) the adapter's: each
    request goes where its own blocks are; a model the proxy cannot name goes by load alone, even
    though p1 holds its tokens (its KV may be an adapter's)."""

    async def go() -> None:
        async with harness(
            n_prefill=2, n_decode=1, prefill_policy="kv_aware", decode_policy="kv_aware", tokenizer=str(small_model_dir)
        ) as h:
            routing = h.proxy.kv_routing
            assert routing is not None
            await wait_for(lambda: all(i.models for i in h.proxy.pool.all()))
            hasher = routing.locations.hasher
            n = len(IDS) // BS
            p0, p1 = h.backend_urls["p0"], h.backend_urls["p1"]
            salted = RequestExtraKeys(cache_salt="A")
            routing.locations.apply_message(p1, 0, _batch(_stored(hasher.hashes(IDS, BS), IDS[: n * BS])))
            routing.locations.apply_message(
                p0,
                0,
                _batch(
                    _stored(
                        hasher.hashes(IDS, BS, extra_keys=salted.blocks(0, n, BS)),
                        IDS[: n * BS],
                        extra_keys=[("A",)] + [None] * (n - 1),
                    )
                ),
            )

            async def prefill_of(**kw: object) -> str:
                before = [len(p.seen) for p in h.prefills]
                status, _ = await h.post(COMPLETIONS, {"model": "mock-model", "prompt": IDS, "max_tokens": 2, **kw})
                assert status == 200
                [i] = [i for i, p in enumerate(h.prefills) if len(p.seen) > before[i]]
                return h.prefills[i].name

            assert await prefill_of() == "p1"
            assert await prefill_of(cache_salt="A") == "p0"
            for inst in h.proxy.pool.all():  # the cards now list an adapter (as vLLM's /v1/models does)
                inst.models, inst.adapters = ["mock-model", "sql"], {"sql": "/adapters/sql"}
            lora = RequestExtraKeys(lora=("sql", "/adapters/sql"))
            routing.locations.apply_message(
                p0,
                1,
                _batch(
                    _stored(
                        hasher.hashes(IDS, BS, extra_keys=lora.blocks(0, n, BS)),
                        IDS[: n * BS],
                        extra_keys=[("sql",)] * n,
                    )
                ),
            )
            assert await prefill_of(model="sql") == "p0"
            req = parse_body(json.dumps({"model": "unknown", "prompt": IDS}).encode(), COMPLETIONS)
            await routing.annotate(req)
            assert req.blocks is None  # no hit claimed: routed by load
            # a plain PromptBlocks of the same tokens would have claimed p1's blocks
            assert routing.locations.cached_tokens(p1, PromptBlocks(IDS, hasher, {})) == n * BS

    run(go)


def test_store_locations_ask_for_the_requests_own_keys(master) -> None:  # noqa: F811 - fixture
    _, address, _ = master
    salt = KeySalt("m@", "bfloat16/auto", "cpu:4096B/block", BS, 2)
    ids = IDS[: 4 * BS]
    plain = node(address, "n-p0", "http://p0:1", 4, ids, salt)  # holds the plain prompt only
    loc = StoreLocations(address, timeout_s=2.0)
    try:
        assert loc.locate(ids).tokens("http://p0:1") == 4 * BS
        assert loc.locate(ids, RequestExtraKeys(cache_salt="A")).tokens("http://p0:1") == 0
        assert loc.locate(ids, RequestExtraKeys(lora=ADAPTER)).tokens("http://p0:1") == 0
    finally:
        loc.close()
        plain.close()
