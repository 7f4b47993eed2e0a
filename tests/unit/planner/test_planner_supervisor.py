"""The supervisor with the planner's cost model (role_pressure) against the same pool without it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, Poly, save_profile
from vllm_pd.planner.role_pressure import SplitLoad, move_helps, predicted_tpot, predicted_ttft
from vllm_pd.router.config import ConfigError, InstanceConfig, ProxyConfig
from vllm_pd.router.pool.instance_pool import InFlightLeg, InstancePool
from vllm_pd.router.pool.supervisor import REVERSAL_CONFIRM, REVERSAL_MEMORY, Supervisor, supervisor_profile

# 1 ms per prompt token, decode steps 10 ms + 10 ms per running request
PROFILE = InstanceProfile(
    1, prefill=Poly(0.0, 1.0, 0.0), decode=Poly(10.0, 10.0, 0.0), kv=Poly(0.0, 0.0), max_num_batched_tokens=2048
)


def _pool(n: int) -> InstancePool:
    return InstancePool(ProxyConfig(instances=[InstanceConfig(f"http://b{i}:1", "both") for i in range(n)]))


def test_predictions_follow_the_profile() -> None:
    load = SplitLoad(
        prefillers=2, decoders=1, queued_prompts=4, queued_prompt_tokens=8000, decoding=3, decoding_context_tokens=300
    )
    # 4000 tokens each: one full 2048 chunk + 1952, then the first decode step (3 running: 40 ms)
    assert predicted_ttft(PROFILE, load) == pytest.approx((2048 + 1952 + 40) / 1e3)
    assert predicted_tpot(PROFILE, load) == pytest.approx(0.040)
    # moving the only decoder away is impossible; moving a prefiller to decode leaves TTFT at 8 s + a step
    assert not move_helps(PROFILE, load, "prefill", 1.0, 0.1, receiving_pressure=5.0)
    assert not move_helps(PROFILE, load, "decode", 1.0, 0.1, receiving_pressure=2.0)
    assert not move_helps(PROFILE, load, "decode", 1.0, 0.1, receiving_pressure=9.0)  # 8.04 x 1.2 > 9
    assert move_helps(PROFILE, load, "decode", 1.0, 0.1, receiving_pressure=10.0)


def test_a_queued_backlog_moves_an_instance_only_with_the_model() -> None:
    states = {}
    for profile in (None, PROFILE):
        pool = _pool(3)
        sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1, profile=profile)
        sup.rebalance()  # decode, prefill, decode
        prefiller = next(i for i in pool.all() if i.active_role == "prefill")
        for _ in range(4):
            InFlightLeg(prefiller, "prefill", 3000)  # 12 s of prefill queued, no TTFT reported yet
        sup.rebalance()
        states[profile is not None] = Counter(i.active_role for i in pool.all())["prefill"]
    assert states == {False: 1, True: 2}


def test_the_model_keeps_a_decoder_that_decode_cannot_spare() -> None:
    moved = {}
    for profile in (None, PROFILE):
        pool = _pool(3)
        sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1, profile=profile)
        sup.rebalance()
        for _ in range(20):
            pool.recent_ttft.add(2.0)  # TTFT at twice its target...
        for inst in (i for i in pool.all() if i.active_role == "decode"):
            for _ in range(10):
                # ...but one decoder would take 210 ms a step: TPOT at 2.1x
                InFlightLeg(inst, "decode", 100).first_token()
        sup.rebalance()
        moved[profile is not None] = sup.moves
    assert moved == {False: 1, True: 0}


def test_supervisor_profile_file(tmp_path: Path) -> None:
    assert supervisor_profile(None) is None
    path = tmp_path / "p.json"
    save_profile(LatencyProfile("m", [PROFILE]), path)
    assert supervisor_profile(str(path)) == PROFILE
    path.write_text("{}")
    with pytest.raises(ConfigError, match="supervisor_profile"):
        supervisor_profile(str(path))


def test_proxy_config_takes_the_profile_from_yaml_and_flag() -> None:
    from vllm_pd import cli
    from vllm_pd.router.cli.command_proxy import config_from_args
    from vllm_pd.router.config import config_from_mapping

    assert config_from_mapping({"supervisor_profile": "p.json"}) == {"supervisor_profile": "p.json"}
    with pytest.raises(ConfigError, match="supervisor_profile"):
        config_from_mapping({"supervisor_profile": 3})
    args = cli.build_parser().parse_args(
        ["proxy", "--both", "http://b:1", "--supervisor", "--supervisor-profile", "p.json"]
    )
    assert config_from_args(args).supervisor_profile == "p.json"


def _all_decoding(n: int, profile: InstanceProfile | None) -> tuple[InstancePool, Supervisor]:
    pool = _pool(n)
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1, profile=profile)
    sup.rebalance()
    for inst in pool.all():
        inst.active_role = "decode"  # every instance decoding: the proxy's decode-only fallback computes prompts
    return pool, sup


def test_no_prefill_instance_is_no_prefill_backlog() -> None:
    # the model has no prefill instance to predict TTFT on (it once said "infinite", and the supervisor
    # pulled a decoder to prefill every interval, to move it back on the next: 0P4D <-> 1P3D flapping)
    for profile in (None, PROFILE):
        pool, sup = _all_decoding(4, profile)
        for _ in range(20):
            pool.recent_ttft.add(0.1)  # TTFT a tenth of its target
            pool.recent_tpot.add(0.05)
        for inst in pool.all():
            InFlightLeg(inst, "decode", 400).first_token()
        sup.rebalance()
        sup.rebalance()
        assert sup.moves == 0, profile
        assert all(i.active_role == "decode" for i in pool.all())


def test_prompts_computed_between_decode_steps_are_not_decode_pressure_with_the_model() -> None:
    # all decoding under long prompts: TTFT 3x its target, and TPOT 5x - the prompts each instance computes
    # between its decode steps. Decode's own work (2 streams each: 30 ms a step by the profile) is light.
    prefillers = {}
    for profile in (None, PROFILE):
        pool, sup = _all_decoding(2, profile)
        for _ in range(20):
            pool.recent_ttft.add(3.0)
            pool.recent_tpot.add(0.5)
        for inst in pool.all():
            for _ in range(2):
                InFlightLeg(inst, "decode", 1000).first_token()
        sup.rebalance()
        prefillers[profile is not None] = sum(1 for i in pool.all() if i.active_role == "prefill")
        # the next tick: the TPOT observed before the move (prompts between steps) no longer counts - it
        # once moved the instance straight back to decode
        sup.rebalance()
        assert sum(1 for i in pool.all() if i.active_role == "prefill") == prefillers[profile is not None]
    # observed TPOT alone keeps both decoding; the model sees that one decoder carries the 4 streams
    # (50 ms a step, TPOT at 0.5 x) and gives the other to prefill
    assert prefillers == {False: 0, True: 1}


def test_after_a_move_observed_latency_counts_from_new_samples() -> None:
    pool = _pool(2)
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1)
    sup.rebalance()
    for _ in range(20):
        pool.recent_tpot.add(0.5)
    sup.rebalance()
    assert sup.moves == 1 and sup.pressures() == (0.0, 0.0)  # 1P1D -> 0P2D; the old TPOT is forgotten
    for _ in range(2):
        pool.recent_ttft.add(7.0)
    assert sup.pressures() == (0.0, 0.0)  # two samples are not yet a signal
    pool.recent_ttft.add(7.0)
    assert sup.pressures() == (pytest.approx(7.0), 0.0)
    # TTFT 7 x its target outweighs the TPOT 5 x that made the last move (by the dead band): on the
    # REVERSAL_CONFIRM-th interval in a row it moves back
    for _ in range(REVERSAL_CONFIRM - 1):
        sup.rebalance()
    assert sup.moves == 1
    sup.rebalance()
    assert sup.moves == 2 and Counter(i.active_role for i in pool.all()) == {"prefill": 1, "decode": 1}


def test_a_move_back_needs_a_greater_pressure_than_made_the_move() -> None:
    # both sides miss whichever split is in place (16 streams on two single-core servers): 1P1D misses TPOT
    # by 5 x, 0P2D TTFT by 3 x. Moving back on the TTFT alone alternated the split every few seconds.
    pool = _pool(2)
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1)
    sup.rebalance()
    for _ in range(20):
        pool.recent_tpot.add(0.5)
    sup.rebalance()
    assert sup.moves == 1  # 1P1D -> 0P2D
    for _ in range(20):
        pool.recent_ttft.add(3.0)
    for _ in range(REVERSAL_MEMORY - 1):
        sup.rebalance()
    assert sup.moves == 1 and all(i.active_role == "decode" for i in pool.all())
    sup.rebalance()  # the last move is REVERSAL_MEMORY intervals old: what made it no longer counts
    assert sup.moves == 2 and Counter(i.active_role for i in pool.all()) == {"prefill": 1, "decode": 1}
    # a burst that outweighs the last move's pressure for fewer than REVERSAL_CONFIRM intervals in a row
    for _ in range(20):
        pool.recent_ttft.add(0.0)
        pool.recent_tpot.add(0.5)
    sup.rebalance()  # TPOT 5 x again: back to 0P2D (the memory of the TTFT 3 x move: 5 > 1.2 x 3 - confirm)
    sup.rebalance()
    sup.rebalance()
    assert sup.moves == 3 and all(i.active_role == "decode" for i in pool.all())
    for burst in (8.0, 1.0, 8.0, 1.0, 8.0):  # never 3 intervals in a row over 1.2 x 5
        for _ in range(20):
            pool.recent_ttft.add(burst)
        sup.rebalance()
    assert sup.moves == 3
    # a move on in the same direction is never held back: only undoing one is
    pool3 = _pool(3)
    sup3 = Supervisor(pool3, ttft_slo=1.0, tpot_slo=0.1)
    sup3.rebalance()  # decode, prefill, decode
    for _ in range(20):
        pool3.recent_ttft.add(3.0)
    sup3.rebalance()
    for _ in range(20):
        pool3.recent_ttft.add(2.0)
    sup3.rebalance()
    assert Counter(i.active_role for i in pool3.all()) == {"prefill": 2, "decode": 1}


def test_an_idle_pool_stays_put_under_an_slo_tighter_than_one_step() -> None:
    # one stream takes 20 ms a step by the profile, the TPOT target is 15 ms: with nothing decoding the
    # model once predicted 20 ms anyway, and the first tick moved the prefill instance to decode
    for profile in (None, PROFILE):
        pool = _pool(2)
        sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.015, profile=profile)
        sup.rebalance()
        sup.rebalance()
        assert sup.moves == 0, profile
        assert sorted(i.active_role or "" for i in pool.all()) == ["decode", "prefill"]


def test_decode_legs_waiting_for_their_prompt_are_not_decoding() -> None:
    # both legs at once: a request's decode leg is out while its prompt is still queued on prefill
    profile = InstanceProfile(1, prefill=Poly(0.0, 1.0, 0.0), decode=Poly(10.0, 10.0, 0.05), kv=Poly(0.0, 0.0))
    pool = _pool(3)
    sup = Supervisor(pool, ttft_slo=2.0, tpot_slo=0.1, profile=profile)
    sup.rebalance()  # decode, prefill, decode
    prefiller = next(i for i in pool.all() if i.active_role == "prefill")
    decoders = [i for i in pool.all() if i.active_role == "decode"]
    legs = []
    for n in range(4):  # 4 prompts of 1000 tokens queued: 4 s predicted TTFT, 2 x its target
        InFlightLeg(prefiller, "prefill", 1000)
        legs.append(InFlightLeg(decoders[n % 2], "decode", 1000))
    assert sup.split_load().decoding == 0
    # counted as decoding, the 4 waiting legs made one decoder's step 250 ms (TPOT 2.5 x) and vetoed the move
    sup.rebalance()
    assert Counter(i.active_role for i in pool.all()) == {"prefill": 2, "decode": 1}
    legs[0].first_token()
    legs[0].first_token()  # once only
    assert (sup.split_load().decoding, sup.split_load().decoding_context_tokens) == (1, 1000)
    legs[0].finish()
    legs[1].finish()  # released before its first token (an error, a client gone)
    assert (sup.split_load().decoding, sup.split_load().decoding_context_tokens) == (0, 0)
    assert [i.awaiting_first for i in decoders] == [[1, 1000], [1, 1000]]  # legs 2 and 3 still wait


def test_no_move_that_only_swaps_which_side_misses() -> None:
    # all decoding, 8 streams each; TTFT 1.3 x its target. One decoder with all 16 would be 1.13 x its
    # TPOT target: under the TTFT's 1.3 but not by the dead band - moved, the next tick moved it back
    # (real servers, output-heavy load: 0P2D -> 1P1D -> 0P2D)
    pool, sup = _all_decoding(2, PROFILE)
    sup.tpot_slo = 0.15
    for _ in range(5):
        pool.recent_ttft.add(1.3)
        pool.recent_tpot.add(0.09)
    for inst in pool.all():
        for _ in range(8):
            InFlightLeg(inst, "decode", 0).first_token()
    sup.rebalance()
    assert sup.moves == 0
    for _ in range(20):
        pool.recent_ttft.add(1.5)  # 1.13 x 1.2 < 1.5: now the move is worth it
    sup.rebalance()
    assert sup.moves == 1


def test_requests_sent_before_a_move_do_not_count_after_it() -> None:
    pool = _pool(2)
    sent_before = 0.0
    pool.restart_recent()
    pool.observe(pool.recent_tpot, sent_before, 0.5)  # a stream that started under the old split
    assert pool.recent_tpot.count == 0
    pool.observe(pool.recent_tpot, pool.recent_since, 0.02)
    assert (pool.recent_tpot.count, pool.recent_tpot.value) == (1, 0.02)


def test_a_changed_traffic_mix_lifts_the_reversal_memory() -> None:
    # output-heavy (16-token prompts in flight): 1P1D misses TPOT 5 x, the move to 0P2D is remembered. Then the
    # traffic turns prompt-heavy (1200-token prompts): TTFT 3 x is a new situation, not a flap - it moves back
    # at once, though 3 < 1.2 x 5
    pool = _pool(2)
    sup = Supervisor(pool, ttft_slo=1.0, tpot_slo=0.1)
    sup.rebalance()
    decoder = next(i for i in pool.all() if i.active_role == "decode")
    short = [InFlightLeg(decoder, "decode", 16) for _ in range(8)]
    for _ in range(20):
        pool.recent_tpot.add(0.5)
    sup.rebalance()
    assert sup.moves == 1
    for _ in range(20):
        pool.recent_ttft.add(3.0)
    sup.rebalance()
    sup.rebalance()
    assert sup.moves == 1  # the same mix: held back
    for leg in short:
        leg.finish()
    for inst in pool.all():
        for _ in range(4):
            InFlightLeg(inst, "decode", 1200)
    sup.rebalance()
    # the short prompts' latencies said nothing of the long ones': forgotten, nothing moves on them
    assert sup.moves == 1 and pool.recent_ttft.count == 0
    for _ in range(20):
        pool.recent_ttft.add(3.0)
    sup.rebalance()
    assert sup.moves == 2 and Counter(i.active_role for i in pool.all()) == {"prefill": 1, "decode": 1}
