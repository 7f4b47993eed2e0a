"""Isolation by construction: the store's keys carry vLLM's extra keys (LoRA adapter, cache
salt, multimodal inputs, prompt embeddings), derived by vLLM's own function from vLLM's own
Request objects (real ones, not stand-ins), so requests differing only in those never share
a block, and requests equal in them still do."""

from __future__ import annotations

import blake3
import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys
from vllm.v1.request import Request

from vllm_pd.connector.store.request_keys import RequestKeys
from vllm_pd.connector.store_bridge import request_extra_keys
from vllm_pd.protocol.block_keys import (
    KEY_BYTES,
    NO_EXTRA_KEYS,
    KeySalt,
    RequestExtraKeys,
    chain_keys,
    extra_key_bytes,
    token_bytes,
)

B = 4
SALT = KeySalt("m", "bfloat16", "cpu", B, 2)
TOKENS = list(range(100, 100 + 6 * B))
N = len(TOKENS) // B


def vllm_request(
    request_id: str = "r",
    tokens: list[int] = TOKENS,
    lora: tuple[str, str] | None = None,
    cache_salt: str | None = None,
    images: list[tuple[str, int, int]] = (),  # type: ignore[assignment]
    embeds: torch.Tensor | None = None,
) -> Request:
    """vLLM's own Request; ``images``: (identifier, offset, length) of each multimodal input."""
    mm = [
        MultiModalFeatureSpec(
            data=None, modality="image", identifier=ident, mm_position=PlaceholderRange(offset=off, length=n)
        )
        for ident, off, n in images
    ]
    return Request(
        request_id,
        list(tokens),
        SamplingParams(max_tokens=1),
        None,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        cache_salt=cache_salt,
        mm_features=mm or None,
        prompt_embeds=embeds,
    )


def store_keys(request: Request) -> list[bytes]:
    """The store's keys of the request's prompt, as the connector computes them."""
    return RequestKeys(SALT).get(request.prompt_token_ids or [], extra_keys=request_extra_keys(request))


def test_plain_request_keys_are_the_token_chain_unchanged():
    """No extra keys: the keys of every deployment so far (stores on disk stay valid)."""
    prev, expected = SALT.digest(), []
    data = token_bytes(TOKENS)
    for i in range(N):
        prev = blake3.blake3(prev + data[i * 4 * B : (i + 1) * 4 * B]).digest(length=KEY_BYTES)
        expected.append(prev)
    assert store_keys(vllm_request()) == expected == chain_keys(TOKENS, SALT)
    assert request_extra_keys(vllm_request()) is NO_EXTRA_KEYS


def test_vllm_has_no_extra_keys_for_a_plain_request():
    """request_extra_keys skips vLLM's function for such requests: if vLLM ever keys blocks of plain
    requests on something new, this fails and the skip must go."""
    req = vllm_request()
    assert all(generate_block_hash_extra_keys(req, i * B, (i + 1) * B, 0)[0] is None for i in range(N))


@pytest.mark.parametrize(
    "variant",
    [
        dict(lora=("sql", "/adapters/sql")),
        dict(cache_salt="tenant-a"),
        dict(lora=("sql", "/adapters/sql"), cache_salt="tenant-a"),
    ],
)
def test_extra_keys_are_vllms_own(variant):
    """Block by block, the connector's extra keys are what vLLM's prefix cache hashes; so are
    the proxy's, derived from the body's model (adapter) and cache_salt alone."""
    req = vllm_request(**variant)
    vllm = [generate_block_hash_extra_keys(req, i * B, (i + 1) * B, 0)[0] for i in range(N)]
    assert vllm[0] is not None
    assert request_extra_keys(req).blocks(0, N, B) == vllm
    proxy = RequestExtraKeys(lora=variant.get("lora"), cache_salt=variant.get("cache_salt"))
    assert proxy.blocks(0, N, B) == vllm
    assert RequestKeys(SALT).get(TOKENS, extra_keys=proxy) == store_keys(req)


# each pair differs in one extra key only; every extra key vLLM has must be here
ONE_EXTRA_KEY_APART = {
    "lora vs base": (dict(lora=("sql", "/a/sql")), dict()),
    "lora name": (dict(lora=("sql", "/a/sql")), dict(lora=("chat", "/a/sql"))),
    "lora path": (dict(lora=("sql", "/a/sql")), dict(lora=("sql", "/a/sql-v2"))),
    "cache_salt vs none": (dict(cache_salt="A"), dict()),
    "cache_salt": (dict(cache_salt="A"), dict(cache_salt="B")),
    "image vs none": (dict(images=[("img-1", 0, 2 * B)]), dict()),
    "image content": (dict(images=[("img-1", 0, 2 * B)]), dict(images=[("img-2", 0, 2 * B)])),
    "image offset": (dict(images=[("img-1", 0, 2 * B)]), dict(images=[("img-1", 1, 2 * B)])),
    "prompt embeds": (dict(embeds=torch.zeros(len(TOKENS), 8)), dict(embeds=torch.ones(len(TOKENS), 8))),
}


@pytest.mark.parametrize("name", list(ONE_EXTRA_KEY_APART))
def test_requests_one_extra_key_apart_share_no_block(name):
    """Fails if any extra key is dropped anywhere between vLLM's Request and the hashed bytes."""
    a, b = ONE_EXTRA_KEY_APART[name]
    ka, kb = store_keys(vllm_request("a", **a)), store_keys(vllm_request("b", **b))
    assert len(ka) == len(kb) == N
    assert not set(ka) & set(kb), name  # the first block differs, so the whole chain does


@pytest.mark.parametrize("name", list(ONE_EXTRA_KEY_APART))
def test_each_key_hashes_vllms_extra_keys_of_its_block(name):
    """The definition, block by block with vLLM's function (the store asks it twice per request
    when no block differs from the second, RequestExtraKeys.varies_by_block)."""
    for variant in ONE_EXTRA_KEY_APART[name]:
        req = vllm_request(**variant, cache_salt="s") if "cache_salt" not in variant else vllm_request(**variant)
        vllm = [extra_key_bytes(generate_block_hash_extra_keys(req, i * B, (i + 1) * B, 0)[0]) for i in range(N)]
        assert chain_keys(TOKENS, SALT, extra_keys=vllm) == store_keys(req)


@pytest.mark.parametrize("name", list(ONE_EXTRA_KEY_APART))
def test_requests_with_equal_extra_keys_share_every_block(name):
    a, _ = ONE_EXTRA_KEY_APART[name]
    assert store_keys(vllm_request("first", **a)) == store_keys(vllm_request("second", **a))


def test_an_image_later_in_the_prompt_keys_from_its_first_block_on():
    plain = store_keys(vllm_request())
    with_image = store_keys(vllm_request(images=[("img-1", 2 * B + 1, B)]))  # blocks 2 and 3
    assert with_image[:2] == plain[:2]
    assert not set(with_image[2:]) & set(plain)


def test_keys_extended_block_by_block_equal_keys_hashed_at_once():
    """The scheduler extends a waiting request's cached keys as it grows (per-block extra keys too)."""
    req = vllm_request(lora=("sql", "/a/sql"), cache_salt="A", images=[("img-1", B + 2, 2 * B)])
    keys = RequestKeys(SALT)
    extra = request_extra_keys(req)
    for n in range(B, len(TOKENS) + 1, 3):
        keys.get(TOKENS[:n], request_id="r", extra_keys=extra)
    assert keys.get(TOKENS, request_id="r", extra_keys=extra) == store_keys(req)


def test_extra_key_encoding_is_canonical_and_refuses_what_it_cannot_encode():
    extra = (("lora", "sql", "/a"), ("mm", "img", -3), ("cache_salt", "A"), ("prompt_embeds", b"\x00\x01"))
    assert extra_key_bytes(extra) == extra_key_bytes(tuple(extra))
    assert extra_key_bytes(None) == b""
    assert extra_key_bytes(extra) != extra_key_bytes(extra[:3])
    with pytest.raises(TypeError):
        extra_key_bytes((("x", object()),))


def test_scope_names_adapter_and_cache_salt_only():
    base = NO_EXTRA_KEYS.scope(SALT)
    lora = RequestExtraKeys(lora=("sql", "/a")).scope(SALT)
    salted = RequestExtraKeys(cache_salt="A").scope(SALT)
    assert len({base, lora, salted, RequestExtraKeys(cache_salt="B").scope(SALT)}) == 4
    assert request_extra_keys(vllm_request(images=[("img", 0, B)])).scope(SALT) == base  # content, not scope
    assert request_extra_keys(vllm_request(lora=("sql", "/a"))).scope(SALT) == lora
    assert base != NO_EXTRA_KEYS.scope(KeySalt("other", "bfloat16", "cpu", B, 2))


# ---- the store itself: keys and the recorded scope ----------------------------------------------
from tests.unit.store.test_store_facades import SLOT_NBYTES, Node  # noqa: E402
from tests.unit.store.test_store_facades import tokens as prompt  # noqa: E402
from vllm_pd.connector.store.config import StoreConfig  # noqa: E402
from vllm_pd.connector.store.scheduler_side import StoreScheduler  # noqa: E402

LORA = RequestExtraKeys(lora=("sql", "/a/sql"))
SALT_A, SALT_B = RequestExtraKeys(cache_salt="A"), RequestExtraKeys(cache_salt="B")


def test_a_store_serves_blocks_only_to_requests_with_the_same_extra_keys(tmp_path):
    node = Node(StoreConfig(cpu_bytes=32 * SLOT_NBYTES, disk_path=str(tmp_path), disk_bytes=1 << 20))
    toks = prompt(12)
    for rid, extra in (("base", NO_EXTRA_KEYS), ("lora", LORA), ("a", SALT_A)):
        node.sched.plan_save(rid, toks, [1, 2, 3], extra_keys=extra)
        node.step()
    assert node.sched.match(toks) == 12
    assert node.sched.match(toks, extra_keys=LORA) == 12 and node.sched.match(toks, extra_keys=SALT_A) == 12
    assert node.sched.match(toks, extra_keys=SALT_B) == 0
    assert node.sched.match(toks, extra_keys=RequestExtraKeys(lora=("sql", "/a/sql-v2"))) == 0
    op, missing = node.sched.plan_load("again", toks, 0, 12, [4, 5, 6], extra_keys=LORA)
    assert op is not None and not missing and op.scope == LORA.scope(node.sched.salt)
    node.close()
    # restarted on the same disk: every block is back with its scope
    again = Node(StoreConfig(cpu_bytes=32 * SLOT_NBYTES, disk_path=str(tmp_path), disk_bytes=1 << 20))
    assert again.sched.match(toks, extra_keys=LORA) == 12 and again.sched.match(toks, extra_keys=SALT_B) == 0
    op, _ = again.sched.plan_load("after-restart", toks, 0, 12, [4, 5, 6], extra_keys=SALT_A)
    assert op is not None and all(op.from_disk)
    again.step()
    assert again.worker.take_load_errors() == set()
    again.close()


def test_a_block_written_for_another_scope_is_never_served_under_its_key(monkeypatch):
    """A bug that drops the extra keys (stood in by extra keys whose blocks hash as plain ones)
    makes an adapter's request find a plain request's blocks under their very keys: the scope
    each block records stops the load. Negative control: without the check they would be served."""
    node = Node(StoreConfig(cpu_bytes=32 * SLOT_NBYTES))
    toks = prompt(12)
    node.sched.plan_save("base", toks, [1, 2, 3])
    node.step()
    dropped = RequestExtraKeys(lora=("sql", "/a/sql"), per_block=lambda start, end: None)
    assert node.sched.block_keys(toks, extra_keys=dropped) == node.sched.block_keys(toks)
    op, missing = node.sched.plan_load("lora", toks, 0, 12, [4, 5, 6], extra_keys=dropped)
    assert op is None and missing == [4, 5, 6]
    assert node.sched.stats["scope_mismatches"] == 1
    monkeypatch.setattr(StoreScheduler, "_in_scope", lambda self, keys, start, end, scope: end)
    op, missing = node.sched.plan_load("lora-unchecked", toks, 0, 12, [4, 5, 6], extra_keys=dropped)
    assert op is not None and missing == []  # what the check prevents
    node.close()
