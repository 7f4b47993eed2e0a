"""The decode scheduler's choice of load for a decode leg sent beside its prefill leg.

vLLM's scheduler and requests are stood in for by plain objects carrying just the fields the
connector reads (request id, prompt, kv_transfer_params, status; a block table); the real
engine path is covered by tests/e2e/test_connector_e2e.py.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

from vllm.v1.request import RequestStatus

from vllm_pd.connector.config import PDConnectorConfig
from vllm_pd.connector.metadata import FinishedSend, PDHandshake, RemoteRelease
from vllm_pd.connector.scheduler import PDConnectorScheduler
from vllm_pd.protocol.transfer_params import AwaitedPrefill, RemoteDecodeRequest, RemotePrefill, prompt_hash

BLOCK = 16


def make_scheduler(tp_size: int = 1, **extra: object) -> PDConnectorScheduler:
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK), parallel_config=SimpleNamespace(tensor_parallel_size=tp_size)
    )
    return PDConnectorScheduler(vllm_config, PDConnectorConfig.from_extra_config(extra), "engine-0")


def make_request(req_id: str, transfer_id: str, n: int = 40, **ask: object) -> SimpleNamespace:
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        num_prompt_tokens=n,
        kv_transfer_params={**AwaitedPrefill(transfer_id, "push").to_params(), **ask},
        status=RequestStatus.WAITING,
    )


def ask(sched: PDConnectorScheduler, request: SimpleNamespace) -> tuple[int | None, bool]:
    sched.note_request(request.request_id)
    return sched.get_num_new_matched_tokens(request, 0)


def alloc(sched: PDConnectorScheduler, request: SimpleNamespace, n_external: int) -> None:
    n_blocks = -(-request.num_prompt_tokens // BLOCK)
    blocks = SimpleNamespace(get_block_ids=lambda: ([100 + i for i in range(n_blocks)],))
    sched.update_state_after_alloc(request, blocks, n_external)


def step(sched: PDConnectorScheduler):
    return sched.build_connector_meta(
        SimpleNamespace(total_num_scheduled_tokens=0, preempted_req_ids=(), num_scheduled_tokens={})
    )


def test_alone_it_waits_for_the_announcement_then_loads_layer_wise() -> None:
    sched = make_scheduler()
    req = make_request("r1", "k1")
    assert ask(sched, req) == (None, False)  # unscheduled until prefill announces
    assert step(sched).awaited_transfers == ["k1"]  # an idle worker step waits for it
    sched.note_announced(frozenset({"k1"}))
    assert ask(sched, req) == (39, False)  # all but the last token, landed during this step's forward
    alloc(sched, req, 39)
    meta = step(sched)
    [load] = meta.loads
    assert load.layerwise and load.transfer_id == "k1" and load.remote is None
    assert load.local_block_ids == (100, 101, 102) and meta.awaited_transfers == []


def test_with_another_request_live_it_loads_async() -> None:
    sched = make_scheduler()
    ask(sched, SimpleNamespace(request_id="other", kv_transfer_params=None))
    req = make_request("r1", "k1")
    sched.note_announced(frozenset({"k1"}))
    assert ask(sched, req) == (40, True)  # off the batch: a layer-wise forward would stall "other"
    alloc(sched, req, 40)
    [load] = step(sched).loads
    assert not load.layerwise


def test_once_the_other_request_finished_it_is_alone_again() -> None:
    sched = make_scheduler()
    other = SimpleNamespace(request_id="other", kv_transfer_params=None, status=RequestStatus.FINISHED_STOPPED)
    ask(sched, other)
    sched.request_finished(other, [])
    sched.note_announced(frozenset({"k1"}))
    assert ask(sched, make_request("r1", "k1")) == (39, False)


def test_async_load_mode_does_not_wait_for_the_announcement() -> None:
    sched = make_scheduler(load_mode="async")
    assert ask(sched, make_request("r1", "k1")) == (40, True)
    sched = make_scheduler()
    assert ask(sched, make_request("r2", "k2", load_mode="async")) == (40, True)  # asked per request


def test_never_announced_recomputes_and_abandons_the_push() -> None:
    sched = make_scheduler(transfer_timeout_s=0.01)
    req = make_request("r1", "k1")
    assert ask(sched, req) == (None, False)
    time.sleep(0.02)
    assert ask(sched, req) == (0, False)  # decode computes the prompt itself
    alloc(sched, req, 0)
    meta = step(sched)
    assert meta.abandoned_pushes == ["k1"] and not meta.loads and meta.awaited_transfers == []


def test_aborted_while_waiting_abandons_the_push() -> None:
    sched = make_scheduler()
    req = make_request("r1", "k1")
    assert ask(sched, req) == (None, False)
    req.status = RequestStatus.FINISHED_ABORTED
    assert sched.request_finished(req, []) == (False, None)
    meta = step(sched)
    assert meta.abandoned_pushes == ["k1"] and meta.awaited_transfers == []


def test_announcements_nobody_claims_are_forgotten_after_the_lease() -> None:
    sched = make_scheduler(lease_s=0.01)
    sched.note_announced(frozenset({"k1"}))
    time.sleep(0.02)
    sched.note_announced(frozenset())
    assert ask(sched, make_request("r1", "k1")) == (None, False)


def test_only_the_last_token_missing_loads_nothing() -> None:
    """Decode's prefix cache holds all but the last token: the forward computes it, prefill is released."""
    sched = make_scheduler()
    req = make_request("r1", "k1", n=BLOCK + 1)
    sched.note_announced(frozenset({"k1"}))
    sched.note_request("r1")
    assert sched.get_num_new_matched_tokens(req, BLOCK) == (0, False)
    alloc(sched, req, 0)
    meta = step(sched)
    assert meta.abandoned_pushes == ["k1"] and not meta.loads


def _prefills_answer(n: int, tp_size: int) -> RemotePrefill:
    return RemotePrefill(
        transfer_id="p-1",
        engine_id="p",
        endpoint="tcp://p:5000",
        host="p",
        port=5000,
        block_ids=tuple(range(-(-n // BLOCK))),
        num_tokens=n,
        block_size=BLOCK,
        mode="pull",
        tp_size=tp_size,
        endpoints=tuple(f"tcp://p:{5000 + r}" for r in range(tp_size)),
        prompt_hash=prompt_hash(list(range(n))),
    )


def test_prefill_of_another_tp_size_is_refused_and_every_rank_released() -> None:
    """Each TP rank holds its own shard of the heads: KV of another TP size would be wrong KV."""
    for prefill_tp, decode_tp in ((2, 1), (1, 2), (2, 2)):
        sched = make_scheduler(tp_size=decode_tp)
        remote = _prefills_answer(40, prefill_tp)
        req = SimpleNamespace(
            request_id="r1",
            prompt_token_ids=list(range(40)),
            num_prompt_tokens=40,
            kv_transfer_params=remote.to_params(),
            status=RequestStatus.WAITING,
        )
        if prefill_tp == decode_tp:
            assert ask(sched, req) == (39, False)  # loaded (layer-wise: decode is idle)
            continue
        assert ask(sched, req) == (0, False)  # decode computes the prompt
        alloc(sched, req, 0)
        meta = step(sched)
        # each decode worker tells its share (RemotePrefill.release_endpoints): together all prefill ranks
        assert meta.remote_releases == [RemoteRelease(remote)] and not meta.loads


def test_prefill_answers_with_its_workers_block_format_and_decode_refuses_another() -> None:
    """The format comes from the workers' handshake; KV laid out otherwise is recomputed (logged)."""
    prefill = make_prefill_scheduler(kv_format="bfloat16:N16.H8.C256")
    req = prefill_leg("cmpl-1")
    compute_prompt(prefill, req)
    answer = RemotePrefill.parse(prefill.request_finished(req, [7, 8, 9])[1])
    assert answer is not None and answer.kv_format == "bfloat16:N16.H8.C256"
    for decode_format, loads in (("bfloat16:N16.H8.C256", True), ("bfloat16:H8.N16.C256", False)):
        decode = make_scheduler()
        decode.set_handshake(
            {0: PDHandshake("tcp://d:6000", "d", 6000, num_layers=2, block_nbytes=64, kv_format=decode_format)}
        )
        leg = SimpleNamespace(
            request_id="d1",
            prompt_token_ids=list(range(40)),
            num_prompt_tokens=40,
            kv_transfer_params=answer.to_params(),
            status=RequestStatus.WAITING,
        )
        assert (ask(decode, leg)[0] > 0) is loads


def test_a_malformed_prefill_leg_is_computed_but_not_held() -> None:
    sched = make_scheduler()
    # a transfer_id but nowhere to announce it: refused (TransferParamsError), logged
    req = SimpleNamespace(
        request_id="p1",
        prompt_token_ids=list(range(40)),
        num_prompt_tokens=40,
        kv_transfer_params={"do_remote_decode": True, "transfer_id": "k"},
        status=RequestStatus.FINISHED_STOPPED,
        num_computed_tokens=40,
    )
    alloc(sched, req, 0)
    assert sched.request_finished(req, [100, 101, 102]) == (False, None)  # freed now, nothing announced


# ---- prefill side: the transfer's one name ---------------------------------------------------------
def make_prefill_scheduler(kv_format: str = "") -> PDConnectorScheduler:
    sched = make_scheduler()
    sched.bind_kv_cache_manager(SimpleNamespace(get_block_ids=lambda req_id: ([7, 8, 9],)))
    sched.set_handshake({0: PDHandshake("tcp://p:5000", "p", 5000, num_layers=2, block_nbytes=64, kv_format=kv_format)})
    return sched


def prefill_leg(req_id: str, transfer_id: str = "", n: int = 40) -> SimpleNamespace:
    ask = RemoteDecodeRequest("push", "tcp://d:6000", transfer_id) if transfer_id else RemoteDecodeRequest()
    return SimpleNamespace(
        request_id=req_id,
        prompt_token_ids=list(range(n)),
        num_prompt_tokens=n,
        kv_transfer_params=ask.to_params(),
        status=RequestStatus.RUNNING,
        num_computed_tokens=0,
    )


def compute_prompt(sched: PDConnectorScheduler, req: SimpleNamespace):
    alloc(sched, req, 0)
    meta = sched.build_connector_meta(
        SimpleNamespace(
            total_num_scheduled_tokens=req.num_prompt_tokens,
            preempted_req_ids=(),
            num_scheduled_tokens={req.request_id: req.num_prompt_tokens},
        )
    )
    req.num_computed_tokens = req.num_prompt_tokens
    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
    return meta


def test_the_proxys_transfer_id_is_prefills_name_of_the_transfer_everywhere() -> None:
    sched = make_prefill_scheduler()
    req = prefill_leg("cmpl-1", transfer_id="t-proxy")
    [send] = compute_prompt(sched, req).sends
    assert send.transfer_id == "t-proxy" and send.announce_endpoint == "tcp://d:6000"
    assert RemotePrefill.parse(send.announcement).transfer_id == "t-proxy"  # decode's announcement
    held, params = sched.request_finished(req, [7, 8, 9])
    assert held and RemotePrefill.parse(params).transfer_id == "t-proxy"  # decode releases it by that name
    assert step(sched).finished_sends == [FinishedSend("t-proxy", "cmpl-1", held=True)]


def test_without_a_proxy_name_the_transfer_is_named_by_prefills_request_id() -> None:
    sched = make_prefill_scheduler()
    req = prefill_leg("cmpl-2")
    [send] = compute_prompt(sched, req).sends
    assert send.transfer_id == "cmpl-2" and send.announcement is None
    assert RemotePrefill.parse(sched.request_finished(req, [7, 8, 9])[1]).transfer_id == "cmpl-2"


def test_a_transfer_id_in_use_is_refused_until_vllm_freed_its_blocks() -> None:
    sched = make_prefill_scheduler()
    first = prefill_leg("cmpl-1", transfer_id="t-1")
    compute_prompt(sched, first)
    assert sched.request_finished(first, [7, 8, 9])[0]  # held: its worker still pushes, grants, awaits release
    second = prefill_leg("cmpl-2", transfer_id="t-1")
    meta = compute_prompt(sched, second)
    assert meta.sends == []  # computed, but nothing sent under another request's transfer
    assert sched.request_finished(second, [7, 8, 9]) == (False, None)
    sched.note_sent({"cmpl-1"})  # the workers reported t-1 finished: vLLM freed cmpl-1's blocks
    third = prefill_leg("cmpl-3", transfer_id="t-1")
    [send] = compute_prompt(sched, third).sends
    assert send.transfer_id == "t-1"


def _awaiting(sched: PDConnectorScheduler, endpoint: str) -> SimpleNamespace:
    req = make_request("r1", "k1")
    req.kv_transfer_params = AwaitedPrefill("k1", "push", (endpoint,)).to_params()
    return req


def test_a_late_announcement_whose_prefill_does_not_answer_is_given_up_on() -> None:
    """A one-way cut between prefill and decode (or a paused prefill) the proxy cannot see: the
    announcement never comes. Past push_wait_s decode pings the prefill the proxy named; unanswered
    within peer_probe_s, decode computes the prompt - not after transfer_timeout_s. Over real TCP:
    the silent prefill is a socket that accepts connections and never answers."""
    import socket

    with socket.create_server(("127.0.0.1", 0)) as silent:
        sched = make_scheduler(push_wait_s=0.2, peer_probe_s=0.3, transfer_timeout_s=30)
        req = _awaiting(sched, f"tcp://127.0.0.1:{silent.getsockname()[1]}")
        t0 = time.monotonic()
        while (matched := ask(sched, req)) == (None, False):
            assert time.monotonic() - t0 < 10, "still waiting for an announcement from a silent prefill"
            time.sleep(0.02)
        assert matched == (0, False) and 0.45 < time.monotonic() - t0 < 10  # push_wait_s + one ping's wait
        alloc(sched, req, 0)
        assert step(sched).abandoned_pushes == ["k1"]  # released whenever prefill announces it after all


def test_a_late_announcement_from_a_prefill_that_answers_is_still_waited_for() -> None:
    from tests.unit.connector.test_connector_peer_probe import _PingSink
    from vllm_pd.connector.transport import create_transport

    sink = _PingSink()
    prefill = create_transport("tcp")
    prefill.register_regions(sink.regions)
    endpoint = prefill.start(sink, "127.0.0.1", 0)
    try:
        sched = make_scheduler(push_wait_s=0.2, peer_probe_s=0.3, transfer_timeout_s=30)
        req = _awaiting(sched, endpoint)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.5:  # five probe periods: a busy prefill, not a lost one
            assert ask(sched, req) == (None, False)
            time.sleep(0.02)
        assert sink.pings >= 2
        sched.note_announced(frozenset({"k1"}))
        assert ask(sched, req) == (39, False)
    finally:
        prefill.close()


# ---- a model with a recurrent state (Mamba, linear attention) ---------------------------------------
def make_state_scheduler() -> PDConnectorScheduler:
    """vLLM's groups of a Mamba hybrid (attention beside a Mamba state, both of BLOCK tokens, as in
    vLLM's 'align' mamba cache mode), built from vLLM's own spec classes."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    specs = (
        FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.bfloat16),
        MambaSpec(block_size=BLOCK, shapes=((4, 16),), dtypes=(torch.float32,), mamba_cache_mode="align"),
    )
    vllm_config = SimpleNamespace(
        cache_config=SimpleNamespace(block_size=BLOCK), parallel_config=SimpleNamespace(tensor_parallel_size=1)
    )
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in specs])
    sched = PDConnectorScheduler(vllm_config, PDConnectorConfig.from_extra_config({}), "engine-0", kv_cache_config)
    assert [g.kind for g in sched.groups] == ["full", "state"]
    return sched


def state_prefill_leg(n: int = 40, skip_prefix_cache: bool = False) -> SimpleNamespace:
    req = prefill_leg("p1", transfer_id="t-1", n=n)  # asks for a push
    req._all_token_ids = list(req.prompt_token_ids)
    req.max_tokens = 16
    req.get_skip_reading_prefix_cache = lambda: skip_prefix_cache
    return req


def test_a_state_models_prefill_leg_stops_one_token_short_once() -> None:
    """The state after the whole prompt cannot take its last token in again: prefill computes all
    but the last token and decode computes that one (as vLLM's NixlConnector does)."""
    sched = make_state_scheduler()
    req = state_prefill_leg(40)
    sched.on_new_request(req)
    assert (req.num_prompt_tokens, len(req.prompt_token_ids), len(req._all_token_ids)) == (39, 39, 39)
    assert req.prompt_token_ids == list(range(39)) and req.max_tokens == 1
    sched.on_new_request(req)  # never cut twice
    assert req.num_prompt_tokens == 39
    # not cut: a request that reads no prefix cache (decode computes it whole), a one-token prompt,
    # a decode leg, and any request of a model without a state
    for other, n in ((state_prefill_leg(40, skip_prefix_cache=True), 40), (state_prefill_leg(1), 1)):
        sched.on_new_request(other)
        assert other.num_prompt_tokens == n
    decode_leg = make_request("d1", "t-1")
    decode_leg.get_skip_reading_prefix_cache = lambda: False
    sched.on_new_request(decode_leg)
    plain = state_prefill_leg(40)
    make_scheduler().on_new_request(plain)
    assert decode_leg.num_prompt_tokens == 40 and plain.num_prompt_tokens == 40


def test_a_state_models_prefill_is_pulled_and_holds_only_the_last_state_block() -> None:
    """vLLM runs no save hook for a recurrent layer: its KV is pulled once the forward is done
    (a push is resolved to a pull); the state held is the one block of the last computed token."""
    sched = make_state_scheduler()
    sched.bind_kv_cache_manager(
        SimpleNamespace(get_block_ids=lambda req_id: ([7, 8, 9], [0, 0, 21]))  # 'align': earlier states nulled
    )
    sched.set_handshake({0: PDHandshake("tcp://p:5000", "p", 5000, num_layers=2, block_nbytes=64)})
    req = state_prefill_leg(40)
    sched.on_new_request(req)
    [send] = compute_prompt(sched, req).sends
    assert send.push_endpoint is None and send.num_prompt_tokens == 39
    held, params = sched.request_finished(req, ([7, 8, 9], [0, 0, 21]))
    answer = RemotePrefill.parse(params)
    assert held and answer is not None and answer.mode == "pull" and answer.num_tokens == 39
    assert answer.prompt_hash == prompt_hash(list(range(39)))


def test_a_state_models_decode_loads_all_but_the_last_token_async_into_the_states_block() -> None:
    sched = make_state_scheduler()
    remote = _prefills_answer(39, 1)  # prefill's answer for its cut prompt of 39 of our 40 tokens
    leg = SimpleNamespace(
        request_id="d1",
        prompt_token_ids=list(range(40)),
        num_prompt_tokens=40,
        kv_transfer_params=remote.to_params(),
        status=RequestStatus.WAITING,
    )
    assert ask(sched, leg) == (39, True)  # async: vLLM waits for no load before a recurrent layer
    blocks = SimpleNamespace(get_block_ids=lambda: ([100, 101, 102], [0, 0, 202]))
    sched.update_state_after_alloc(leg, blocks, 39)
    [load] = step(sched).loads
    # attention: every block of the 39 tokens; the state: only token 38's block (position 2)
    assert load.group_loads == ((0, (100, 101, 102)), (2, (202,)))
    # KV of the whole prompt (a prefill that did not stop short) is for another prompt: recomputed
    uncut = SimpleNamespace(**vars(leg))
    uncut.request_id, uncut.kv_transfer_params = "d2", _prefills_answer(40, 1).to_params()
    assert ask(sched, uncut) == (0, False)
