"""No KV across adapters or cache salts, on real vLLM CPU servers with the KV store on.

A plain instance serving the built-in model and its LoRA adapter (small_model/lora.py) gives
the expected outputs, alone, and is stopped. Then two instances with our connector, the store
(a master process, node P on core 0, node D on core 1) and the same adapter; vLLM's own prefix
cache is off, so every ``cached_tokens`` is a store hit (the local store, or the other node's
fetched through the master).

(a) identity: a request through the PD pair (prefill on P, decode on D, the KV transferred)
    answers exactly like the plain instance, with the adapter and without.
(b) no hit across adapters or salts: the base model after the adapter with the same token ids,
    the adapter after the base model (locally, and on the other node through the master),
    cache_salt B after A, no salt after A: all miss and answer exactly like the plain instance.
(c) the same adapter, or the same salt, still hits: locally and from the other node.

Three server starts in all (the pair side by side). Without the extra keys in the store's keys,
(b)'s requests hit and the base model answers with the adapter's KV (wrong tokens).
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.e2e_cluster import (
    completion_body,
    connector_config,
    disagg,
    output_tokens,
    post,
    server_spec,
    start_all,
    stop_all,
)
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.small_model import ModelSpec, ensure_lora
from vllm_pd.vllm_server import free_port

pytestmark = pytest.mark.e2e

BLOCK = 128  # vLLM's CPU default
ADAPTER = "sql"  # served model name of the adapter
THINK_TIME_S = 2.0  # blocks are saved after the answer, then published to the master
_rng = random.Random(25)
# token-id prompts of 2 full blocks and a tail, one per case (ids clear of the special tokens)
X = {
    name: [_rng.randrange(300, 4000) for _ in range(2 * BLOCK + 40)]
    for name in ("pd", "pd_base", "lora_first", "base_first", "base_first_too", "salted")
}
FULL = 2 * BLOCK


def body(prompt: str, model: str = "small", **kw: Any) -> dict[str, Any]:
    return dict(completion_body(X[prompt]), model=model, **kw)


def cached(resp: dict[str, Any]) -> int:
    details = resp["usage"].get("prompt_tokens_details") or {}
    return int(details.get("cached_tokens") or 0)


def with_adapter(spec: Any, adapter: Path) -> Any:
    spec.extra_args += ["--enable-lora", "--lora-modules", f"{ADAPTER}={adapter}"]
    return spec


@pytest.fixture(scope="module")
def adapter(small_model_dir: Path) -> Path:
    return ensure_lora(ModelSpec(), cache_dir=small_model_dir.parent)


@pytest.fixture(scope="module")
def expected(small_model_dir: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """(prompt, model) -> greedy output tokens of a plain instance serving the adapter."""
    log_dir = tmp_path_factory.mktemp("isolation-plain")
    [plain] = start_all([(with_adapter(server_spec(small_model_dir, "0-1", None), adapter), None)], log_dir)
    try:
        with httpx.Client() as client:
            return {(p, m): output_tokens(post(client, plain.url, body(p, m))) for p in X for m in ("small", ADAPTER)}
    finally:
        stop_all([plain])


@pytest.fixture(scope="module")
def runs(expected, small_model_dir: Path, adapter: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Every request of the module, in order, on the store pair: name -> response."""
    log_dir = tmp_path_factory.mktemp("isolation-pair")
    master, address = spawn_master(free_port())
    out: dict[str, Any] = {}
    try:
        specs = []
        for node, cores in (("P", "0"), ("D", "1")):
            kv_port = free_port()
            store = {"cpu_bytes": "16m", "master": address, "node_id": node}
            spec = server_spec(small_model_dir, cores, connector_config("kv_both", kv_port, store=store))
            spec.extra_args += ["--no-enable-prefix-caching"]
            specs.append((with_adapter(spec, adapter), kv_port))
        p, d = start_all(specs, log_dir)
        try:
            with httpx.Client() as client:

                def ask(name: str, inst: Any, prompt: str, model: str = "small", **kw: Any) -> None:
                    out[name] = post(client, inst.url, body(prompt, model, **kw))

                # (a) through the pair: prefill on P, decode on D
                out["pd_lora"] = disagg(client, p, d, body("pd", ADAPTER), "pull")[1]
                out["pd_base"] = disagg(client, p, d, body("pd_base"), "pull")[1]
                # (b, c) the adapter first, then the base model, on the same tokens
                ask("lora_first", p, "lora_first", ADAPTER)
                time.sleep(THINK_TIME_S)
                ask("base_after_lora", p, "lora_first")
                ask("lora_again", p, "lora_first", ADAPTER)
                # the base model first; the adapter after it on the same node, and (other tokens: what
                # one node computed for the adapter is a legitimate hit for the other) on the other node
                ask("base_first", p, "base_first")
                ask("base_first_too", p, "base_first_too")
                time.sleep(THINK_TIME_S)
                ask("lora_after_base", p, "base_first", ADAPTER)
                ask("lora_after_base_other_node", d, "base_first_too", ADAPTER)
                time.sleep(THINK_TIME_S)
                ask("base_again_other_node", d, "base_first")
                # cache salts
                ask("salt_a", p, "salted", cache_salt="tenant-a")
                time.sleep(THINK_TIME_S)
                ask("salt_b", p, "salted", cache_salt="tenant-b")
                ask("no_salt", p, "salted")
                ask("salt_a_other_node", d, "salted", cache_salt="tenant-a")
                ask("salt_a_again", p, "salted", cache_salt="tenant-a")
        finally:
            stop_all([p, d])
    finally:
        master.kill()
        master.wait()
    return out


# every request of ``runs``: (prompt, model) it was asked with
ASKED = {
    "pd_lora": ("pd", ADAPTER),
    "pd_base": ("pd_base", "small"),
    "lora_first": ("lora_first", ADAPTER),
    "base_after_lora": ("lora_first", "small"),
    "lora_again": ("lora_first", ADAPTER),
    "base_first": ("base_first", "small"),
    "base_first_too": ("base_first_too", "small"),
    "lora_after_base": ("base_first", ADAPTER),
    "lora_after_base_other_node": ("base_first_too", ADAPTER),
    "base_again_other_node": ("base_first", "small"),
    "salt_a": ("salted", "small"),
    "salt_b": ("salted", "small"),
    "no_salt": ("salted", "small"),
    "salt_a_other_node": ("salted", "small"),
    "salt_a_again": ("salted", "small"),
}


def test_the_adapter_changes_the_answer(expected):
    assert all(expected[(p, "small")] != expected[(p, ADAPTER)] for p in X)


@pytest.mark.parametrize("name", list(ASKED))
def test_every_answer_equals_a_plain_instance_serving_the_adapter(runs, expected, name):
    """(a) for pd_lora / pd_base (through the pair); for the others: whatever the store served was
    the request's own KV."""
    assert output_tokens(runs[name]) == expected[ASKED[name]]


@pytest.mark.parametrize(
    "name", ["base_after_lora", "lora_after_base", "lora_after_base_other_node", "salt_b", "no_salt"]
)
def test_no_store_hit_across_adapters_or_salts(runs, name):
    assert cached(runs[name]) == 0, f"{name} was served KV stored for another adapter or salt"


@pytest.mark.parametrize("name", ["lora_again", "base_again_other_node", "salt_a_other_node", "salt_a_again"])
def test_same_adapter_or_salt_still_hits(runs, name):
    assert cached(runs[name]) >= FULL, f"{name} missed the store"


def test_first_requests_computed_everything(runs):
    for name in ("lora_first", "base_first", "base_first_too", "salt_a"):
        assert cached(runs[name]) == 0
