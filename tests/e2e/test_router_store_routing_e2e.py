"""End-to-end kv_aware routing by the KV store's master on real vLLM servers.

2 prefill + 1 decode, every server with the KV store and one store master, vLLM's prefix cache
off and no KV events: the store is the only place KV is reused and the master the proxy's only
source of where it lives. A conversation's second turn must go to the prefill whose store holds
its first turn (and load it from there); a third turn sent to the other prefill must carry a
store_fetch hint and be fetched from the holder's store; the first turn again, which decode's
store now holds whole, must skip prefill and be loaded from decode's store; and every answer must
equal a plain instance's (no connector, no store, the same vLLM flags).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.e2e.test_router_e2e import ProxyThread, _model_dir
from tests.support.e2e_cluster import metric
from vllm_pd.connector.store.master_command import spawn_master
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.router.request.request_body import CHAT, parse_body
from vllm_pd.router.routing.store_locations import StoreLocations
from vllm_pd.vllm_server import free_port

pytestmark = pytest.mark.e2e

SYSTEM = (
    "You are a careful assistant. Answer in short sentences, cite numbers exactly, never repeat the "
    "question, and keep every answer under twenty words unless asked for more detail. "
) * 5
# each follow-up adds more than a block (128 tokens): decode's store, which saved the previous turn,
# never holds every full block of the next one, so those turns need a prefill leg
DETAIL = " Think about it step by step, check each number twice, and say which rule you used and why." * 3
QUESTIONS = (
    "List the first five prime numbers.",
    "Now add them up and say the total." + DETAIL,
    "Is that total itself a prime number?" + DETAIL,
)
MAX_TOKENS = 8
EXTERNAL = "vllm:prompt_tokens_by_source_total"  # source="external_kv_transfer": loaded by the connector


@pytest.fixture(scope="module")
def master() -> Iterator[str]:
    proc, address = spawn_master(free_port())
    yield address
    proc.kill()
    proc.wait()


@pytest.fixture(scope="module")
def cluster(master: str) -> Iterator[LocalCluster]:
    c = LocalCluster(
        model=_model_dir(),
        n_prefill=2,
        n_decode=1,
        max_model_len=1024,
        extra_args=["--no-enable-prefix-caching"],
        connector_extra={"lease_s": 15.0, "store": {"cpu_bytes": "64m", "master": master}},
    )
    with c.running(600):
        yield c


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    # a copy: the conversation grows in place turn by turn, and a body sharing that list would later
    # read as the last turn (every body sent again, and every answer compared, would be turn 3's)
    return {"model": _model_dir(), "messages": list(messages), "max_tokens": MAX_TOKENS, "temperature": 0}


def _answer(client: httpx.Client, url: str, body: dict[str, Any]) -> str:
    r = client.post(url + CHAT, json=body)
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def _wait(pred: Any, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.3)
    return True


def _external(client: httpx.Client, url: str) -> float:
    return metric(client, url, EXTERNAL, source="external_kv_transfer")


def test_turns_follow_the_store_fetch_on_hint_and_skip_prefill_outputs_equal_plain(
    cluster: LocalCluster, master: str
) -> None:
    proxy = ProxyThread(
        cluster.instances(),
        prefill_policy="kv_aware",
        decode_policy="kv_aware",
        tokenizer=_model_dir(),
        store_master=master,
    )
    routing, flow = proxy.server.kv_routing, proxy.server.flow
    assert routing is not None and routing.store is not None and flow is not None
    chosen: list[str] = []
    excluded: set[str] = set()
    choose_for = flow.prefill_policy.choose_for  # type: ignore[attr-defined]

    def recording(candidates: Any, role: str, req: Any) -> Any:
        # the test's one hook: it keeps a prefill out of the choice, as a busy or draining one would be
        inst = choose_for([c for c in candidates if c.url not in excluded], role, req)
        chosen.append(inst.url)
        return inst

    flow.prefill_policy.choose_for = recording  # type: ignore[attr-defined]
    prefills = [s.server.url for s in cluster.servers if s.role == "prefill"]
    decode_url = next(s.server.url for s in cluster.servers if s.role == "decode")
    view = StoreLocations(master, timeout_s=2.0, refresh_s=0.0)  # the test's own look at the master
    sent: list[tuple[dict[str, Any], str]] = []

    def ids(body: dict[str, Any]) -> list[int]:
        got = routing.tokenizer.token_ids(parse_body(httpx.Request("POST", "/", json=body).content, CHAT))
        assert got is not None
        return got

    def stored(url: str, body: dict[str, Any], whole: bool) -> bool:
        got = view.locate(ids(body))
        return got is not None and (got.holds_prompt(url) if whole else got.tokens(url) > 0)

    def proxy_metric(name: str) -> float:
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in proxy.server.metrics.render().decode().splitlines()
            if line.startswith(name)
        )

    try:
        with httpx.Client(timeout=180) as client:
            messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
            turn1 = _body(messages)
            sent.append((turn1, _answer(client, proxy.url, turn1)))
            holder = chosen[-1]
            other = next(u for u in prefills if u != holder)
            assert _wait(lambda: stored(holder, turn1, whole=True)), "the prefill's store never published turn 1"
            time.sleep(1.2)  # the proxy's node list is refreshed at most once a second

            messages += [{"role": "assistant", "content": sent[-1][1]}, {"role": "user", "content": QUESTIONS[1]}]
            turn2 = _body(messages)
            before, n = _external(client, holder), len(chosen)
            sent.append((turn2, _answer(client, proxy.url, turn2)))
            assert chosen[n:] == [holder], "turn 2 did not go to the prefill whose store holds turn 1"
            # (the prefill's own answer, which updates its metrics, may come after decode's)
            assert _wait(lambda: _external(client, holder) > before), "the holder did not load turn 1 from its store"
            assert _wait(lambda: stored(holder, turn2, whole=True))

            # turn 3 on the other prefill: it holds nothing; the proxy names the node to fetch from
            messages += [{"role": "assistant", "content": sent[-1][1]}, {"role": "user", "content": QUESTIONS[2]}]
            turn3 = _body(messages)
            excluded.add(holder)
            hints, ext = proxy_metric("vllm_pd_proxy_store_fetch_hints_total"), _external(client, other)
            got = view.locate(ids(turn3))
            assert got is not None and got.tokens(other) == 0  # its own store holds none of it
            n = len(chosen)
            sent.append((turn3, _answer(client, proxy.url, turn3)))
            excluded.clear()
            assert chosen[n:] == [other]
            assert proxy_metric("vllm_pd_proxy_store_fetch_hints_total") == hints + 1
            # its store held nothing: what it loaded was fetched from another node's store (the holder's
            # vllm:pd_store_served_blocks_total counts it only at the holder's next engine step, which may
            # never come here: an idle holder does not step)
            assert _wait(lambda: _external(client, other) > ext), "the hinted prefill did not fetch the prompt"

            # turn 1 again: decode's store holds all of it (decode saved what it decoded): no prefill leg
            assert _wait(lambda: stored(decode_url, turn1, whole=True)), "decode's store never published turn 1"
            time.sleep(1.2)
            n, ext = len(chosen), _external(client, decode_url)
            sent.append((turn1, _answer(client, proxy.url, turn1)))
            assert len(chosen) == n, "prefill ran although decode's store held the prompt"
            assert proxy_metric('vllm_pd_proxy_decode_only_total{reason="decode_store_holds_prompt"}') == 1
            assert _wait(lambda: _external(client, decode_url) > ext), "decode did not load the prompt from its store"
    finally:
        view.close()
        proxy.close()
        cluster.stop()
    plain = LocalCluster(
        model=_model_dir(),
        n_prefill=0,
        n_decode=1,
        max_model_len=1024,
        connector=None,
        extra_args=["--no-enable-prefix-caching"],
    )
    try:
        plain.start()
        plain.wait_healthy(600)
        with httpx.Client(timeout=180) as client:
            plain_answers = [_answer(client, plain.servers[0].server.url, body) for body, _ in sent]
        steps = ("turn 1", "turn 2 (holder's store)", "turn 3 (fetched on hint)", "turn 1 again (decode's store)")
        assert [len(body["messages"]) for body, _ in sent] == [2, 4, 6, 2]  # four prompts, three distinct
        pairs = [(steps[i], sent[i][1], plain_answers[i]) for i in range(len(sent))]
        assert plain_answers == [a for _, a in sent], pairs
    finally:
        plain.stop()
