"""The planner's fitted models, workloads, simulator and deployment search (no vLLM, no servers)."""

from __future__ import annotations

import random

import msgspec
import pytest

from vllm_pd.planner.deployment_search import (
    Slo,
    distributions_at,
    enumerate_deployments,
    goodput,
    search,
    summarise,
    trace_at,
)
from vllm_pd.planner.latency_profile import (
    InstanceProfile,
    LatencyProfile,
    Poly,
    ProfileError,
    fit_instance,
    fit_poly,
    join_points,
    load_profile,
    merge_samples,
    neighbour_factor,
    refit,
    save_profile,
    spread_of,
)
from vllm_pd.planner.pd_simulator import Deployment, Simulation, simulate
from vllm_pd.planner.workload import TraceRequest, WorkloadError, load_trace, parse_distributions, write_trace
from vllm_pd.router.pool.instance_pool import Instance
from vllm_pd.router.routing.policies import LeastOutstanding

PREFILL, DECODE, KV = Poly(20.0, 0.1, 0.0), Poly(10.0, 0.5, 0.001), Poly(5.0, 0.01)


def make_profile(
    prefill: Poly = PREFILL,
    decode: Poly = DECODE,
    kv: Poly = KV,
    chunk: int = 2048,
    tp: int = 1,
    spread: list[float] | None = None,
    window_ms: float = 0.0,
    beside_prefill: float = 1.0,
    beside_decode: float = 1.0,
) -> LatencyProfile:
    return LatencyProfile(
        "m",
        [
            InstanceProfile(
                tp,
                prefill,
                decode,
                kv,
                max_num_batched_tokens=chunk,
                decode_spread=spread or [],
                decode_spread_window_ms=window_ms,
                beside_prefill=beside_prefill,
                beside_decode=beside_decode,
            )
        ],
    )


def test_fit_recovers_known_coefficients() -> None:
    rng = random.Random(1)
    rows = [(t, t * t, 12 + 0.05 * t + 2e-5 * t * t + rng.uniform(-0.01, 0.01)) for t in range(16, 2048, 97)]
    p = fit_poly(rows)
    assert p.a == pytest.approx(12, abs=0.05)
    assert p.b == pytest.approx(0.05, rel=0.01)
    assert p.c == pytest.approx(2e-5, rel=0.01)


def test_fit_drops_a_term_that_would_be_negative() -> None:
    # z falls slightly with y: noise; the fit must not predict shrinking cost
    rows = [(x, y, 5 + 2 * x - 0.001 * y) for x in (1, 2, 4, 8) for y in (10, 100, 1000)]
    p = fit_poly(rows)
    assert p.c == 0.0 and p.a >= 0 and p.b > 0
    assert p.b == pytest.approx(2, rel=0.05)


def test_fit_with_one_sample_is_a_constant_and_with_none_an_error() -> None:
    assert fit_poly([(100, 0, 7.0)]) == Poly(7.0, 0.0, 0.0)
    with pytest.raises(ProfileError, match="no samples"):
        fit_poly([])


def test_fit_separates_the_per_prompt_cost_from_the_per_step_one() -> None:
    # a step of n prompts of t tokens: 6 + 0.05*T + 1e-5*sum(t^2) + 2.5*n, measured at batches 1, 2, 4
    truth = Poly(6.0, 0.05, 1e-5, 2.5)
    samples = [(t, b, truth.at(t * b, t * t * b, b)) for t in (32, 128, 512, 1024) for b in (1, 2, 4) if t * b <= 2048]
    inst = fit_instance(1, samples, [(1, 64, 5.0), (2, 128, 6.0)], [(128, 1.0)])
    assert inst.prefill.d == pytest.approx(2.5, rel=1e-3) and inst.prefill.a == pytest.approx(6.0, rel=1e-3)
    # four 32-token prompts cost more than one 128-token prompt: three more prompts, less attention
    assert inst.prefill_ms(128, 4) - inst.prefill_ms(128) == pytest.approx(3 * 2.5 - 1e-5 * (128**2 - 4 * 32**2))
    assert inst.mixed_ms([32] * 4, 0, 0) == pytest.approx(inst.prefill_ms(128, 4))


def test_profile_file_round_trip_and_bad_file(tmp_path) -> None:
    inst = fit_instance(
        1,
        [(t, 1, 3 + 0.1 * t) for t in (16, 256, 1024)],
        [(n, n * k, 8 + n + 0.01 * n * k) for n in (1, 4) for k in (64, 512)],
        [(128, 4.0)],
    )
    prof = LatencyProfile("m", [inst], source="http://x")
    save_profile(prof, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back == prof and back.for_tp(1).prefill_ms(100) == pytest.approx(13, rel=1e-6)
    with pytest.raises(ProfileError, match="tp=2"):
        back.for_tp(2)
    (tmp_path / "bad.json").write_text('{"model": "m", "instances": [{"tp": "one"}]}')
    with pytest.raises(ProfileError, match="bad.json"):
        load_profile(tmp_path / "bad.json")
    (tmp_path / "new.json").write_text('{"format": 3, "model": "m", "instances": []}')
    with pytest.raises(ProfileError, match="format: 3 is not one this vllm-pd reads"):
        load_profile(tmp_path / "new.json")


FORMAT_1 = """{"model": "m", "instances": [{"tp": 1, "prefill": {"a": 10.0, "b": 0.05, "c": 1e-6},
  "decode": {"a": 5.0, "b": 0.5, "c": 0.001}, "kv": {"a": 0.5, "b": 0.0, "c": 0.0},
  "max_num_batched_tokens": 2048, "max_num_seqs": 128, "prefill_samples": [[128, 17.0], [512, 36.0]],
  "decode_samples": [[1, 82, 4.9]], "kv_samples": [[128, 0.5]]}], "source": "http://x"}"""


def test_a_format_1_profile_reads_as_format_2(tmp_path) -> None:
    (tmp_path / "v1.json").write_text(FORMAT_1)
    inst = load_profile(tmp_path / "v1.json").for_tp(1)
    # the same prefill and decode costs; kv now ends at the first token, so it holds format 1's decode step
    assert inst.prefill_ms(512) == pytest.approx(10 + 0.05 * 512 + 1e-6 * 512**2)
    assert inst.kv_ms(128) == pytest.approx(0.5 + inst.decode_ms(1, 128))
    assert inst.transfer_ms(128) == pytest.approx(0.5)
    assert inst.prefill_samples == [(128, 1, 17.0), (512, 1, 36.0)] and inst.decode_spread == []
    assert inst.kv_samples == [(128, pytest.approx(0.5 + inst.decode_ms(1, 128)))]


def test_distributions_parse_and_sample_with_seed() -> None:
    d = parse_distributions("poisson:2.5,in=uniform:10:20,out=lognormal:50:0.5")
    a, b = d.sample(200, seed=3), d.sample(200, seed=3)
    assert a == b and all(10 <= r.input_tokens <= 20 for r in a)
    assert 40 < sum(r.output_tokens for r in a) / len(a) < 60
    assert 2.0 < len(a) / a[-1].arrival < 3.1
    fast = d.sample(200, seed=3, rate=25)
    assert [r.input_tokens for r in fast] == [r.input_tokens for r in a]
    assert fast[-1].arrival == pytest.approx(a[-1].arrival / 10)
    for bad, key in (
        ("uniform:1,in=5,out=5", "poisson"),
        ("poisson:0,in=5,out=5", "rate"),
        ("poisson:1,in=5", "out"),
        ("poisson:1,in=5,out=5,x=1", "x"),
        ("poisson:1,in=uniform:5,out=5", "in"),
    ):
        with pytest.raises(WorkloadError, match=key):
            parse_distributions(bad)


def test_trace_round_trip_and_errors(tmp_path) -> None:
    reqs = [TraceRequest(0.5, 10, 3), TraceRequest(0.1, 20, 4)]
    write_trace(reqs, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == sorted(reqs, key=lambda r: r.arrival)
    (tmp_path / "bad.jsonl").write_text('{"arrival": 0, "input_tokens": 5}\n')
    with pytest.raises(WorkloadError, match="bad.jsonl:1: output_tokens: missing"):
        load_trace(tmp_path / "bad.jsonl")


def test_single_request_latencies_are_the_profiles_costs() -> None:
    prof = make_profile()
    inst = prof.for_tp(1)
    req = [TraceRequest(1.0, 500, 5)]
    (pd,) = simulate(prof, Deployment(1, 1), req)
    # an idle decode instance loads layer-wise: the first token comes kv_ms after prefill's end
    assert pd.ttft * 1e3 == pytest.approx(inst.prefill_ms(500) + inst.kv_ms(500))
    # later steps read one more token of context each
    steps = [inst.decode_ms(1, 500 + i) for i in range(1, 5)]
    assert pd.tpot * 1e3 == pytest.approx(sum(steps) / 4)
    (co,) = simulate(prof, Deployment(0, 1), req)
    assert co.ttft * 1e3 == pytest.approx(inst.prefill_ms(500))
    # a prompt longer than the chunk budget takes two steps
    (chunked,) = simulate(make_profile(chunk=300), Deployment(0, 1), req)
    assert chunked.ttft * 1e3 == pytest.approx(inst.prefill_ms(300) + inst.prefill_ms(200))


def test_a_busy_decode_instance_loads_async_and_takes_the_request_at_a_step() -> None:
    # the first request decodes 200 long steps; the second's KV arrives mid-step and waits for the next
    prof = make_profile(prefill=Poly(50.0, 0, 0), decode=Poly(30.0, 0, 0), kv=Poly(40.0, 0))
    inst = prof.for_tp(1)
    first, second = simulate(prof, Deployment(1, 1), [TraceRequest(0.0, 100, 200), TraceRequest(0.5, 100, 3)])
    assert first.ttft * 1e3 == pytest.approx(90.0)  # 50 prefill + 40 layer-wise hand-over
    kv_at = 0.5 + (50.0 + inst.transfer_ms(100)) / 1e3  # transfer = 40 - 30: kv less the step it included
    steps = [0.09 + 0.03 * k for k in range(1, 40)]  # the first request's step ends
    joins = next(t for t in steps if t >= kv_at)
    assert second.ttft == pytest.approx(joins + 0.03 - 0.5)
    # announced while the decode instance is held by another's layer-wise load: async, then a step
    a, b = simulate(prof, Deployment(1, 1), [TraceRequest(0.0, 100, 2), TraceRequest(0.01, 100, 2)])
    assert a.ttft == pytest.approx(0.09) and a.finish == pytest.approx(0.12)
    # b's KV is there at 0.11, during a's last step (0.09-0.12); b's first step is 0.12-0.15
    assert b.ttft == pytest.approx(0.15 - 0.01)


def test_decode_spread_is_seeded_and_its_window_makes_the_tpot_tail() -> None:
    # alone on the instance (no prefill in a step): a TPOT differs from another only by the spread
    reqs = parse_distributions("poisson:0.2,in=100,out=20").sample(200, seed=3)
    spread = [0.9] * 8 + [1.4, 1.5]

    def tpot(window_ms: float, seed: int = 1) -> list[float]:
        prof = make_profile(decode=Poly(10.0, 0, 0), spread=spread, window_ms=window_ms)
        return [r.tpot for r in simulate(prof, Deployment(0, 1), reqs, seed=seed)]

    slo = Slo(10.0, 10.0)
    assert tpot(1000.0) == tpot(1000.0) and tpot(1000.0, seed=2) != tpot(1000.0)
    base = summarise(simulate(make_profile(decode=Poly(10.0, 0, 0)), Deployment(0, 1), reqs), slo).tpot_p90
    assert base == pytest.approx(0.010)

    def p90(xs: list[float]) -> float:
        return sorted(xs)[int(0.9 * len(xs))]

    # drawn every step, 19 draws average out near the mean (1.01); held for a request's life they do not
    assert p90(tpot(0.0)) < 0.0112
    assert p90(tpot(1000.0)) > 0.0135


def test_spread_is_each_point_over_the_fit() -> None:
    assert spread_of(Poly(4.0, 1.0), [(1, 10, 10.0), (2, 10, 3.0), (1, 5, 5.0)]) == [0.5, 1.0, 2.0]


def test_queueing_raises_ttft_with_rate() -> None:
    prof = make_profile(prefill=Poly(50.0, 0.2, 0.0))
    _, at = trace_at(parse_distributions("poisson:1,in=400,out=4").sample(300, seed=4))
    slo = Slo(10.0, 10.0)
    p90 = [summarise(simulate(prof, Deployment(1, 1), at(rate)), slo).ttft_p90 for rate in (1, 3, 5, 6.5)]
    assert all(b > a for a, b in zip(p90, p90[1:])) and p90[-1] > 2 * p90[0]


def test_prefill_queue_matches_md1_mean_wait() -> None:
    # one prompt per step (chunk = prompt), deterministic service S: the prefill queue is M/D/1,
    # mean wait = rho*S / (2(1-rho)) (Pollaczek-Khinchine)
    service_ms = 100.0
    prof = make_profile(prefill=Poly(service_ms, 0, 0), decode=Poly(1.0, 0, 0), kv=Poly(0, 0), chunk=100)
    rho = 0.7
    reqs = [
        TraceRequest(r.arrival, 100, 1)
        for r in parse_distributions(f"poisson:{rho / (service_ms / 1e3)},in=100,out=1").sample(20000, seed=5)
    ]
    sims = simulate(prof, Deployment(1, 1), reqs)
    mean_wait = sum(r.ttft for r in sims) / len(sims) - service_ms / 1e3
    expected = rho * service_ms / 1e3 / (2 * (1 - rho))
    assert mean_wait == pytest.approx(expected, rel=0.1)


def test_enumeration_respects_the_device_budget() -> None:
    ds = enumerate_deployments(4, [1, 2])
    labels = {d.label for d in ds}
    assert {"colocated x4", "colocated x2 tp2", "3P1D", "1P3D", "1P1D tp2/2", "2P1D tp1/2"} <= labels
    assert all(d.devices <= 4 for d in ds) and "2P2D tp2/1" not in labels


def test_goodput_is_the_rate_where_attainment_crosses() -> None:
    prof = make_profile(prefill=Poly(100.0, 0, 0), chunk=100)
    dist = parse_distributions("poisson:1,in=100,out=2")
    own, at = distributions_at(dist, 400, seed=1)
    slo = Slo(ttft=0.5, tpot=1.0)
    g = goodput(prof, Deployment(1, 1), at, slo, own)
    assert 0 < g < 10  # one prefill server at 100 ms/request saturates below 10 req/s

    def attained(rate: float) -> float:
        return summarise(simulate(prof, Deployment(1, 1), at(rate)), slo).attainment

    assert attained(g) >= 0.9 and attained(g * 1.2) < 0.9


def test_search_picks_disaggregation_when_prefill_stalls_decode() -> None:
    # long prefills (500 ms) inside a colocated decode batch blow a 40 ms TPOT SLO; apart they cannot
    prof = make_profile(prefill=Poly(500.0, 0, 0), decode=Poly(10.0, 0, 0), kv=Poly(5.0, 0))
    _, at = distributions_at(parse_distributions("poisson:0.5,in=1000,out=100"), 200, seed=2)
    ranked = search(prof, [Deployment(0, 2), Deployment(1, 1)], at, 0.5, Slo(ttft=3.0, tpot=0.04))
    assert ranked[0].deployment == Deployment(1, 1)
    assert ranked[0].per_device > ranked[1].per_device


def test_search_picks_colocation_when_kv_transfer_is_slow() -> None:
    prof = make_profile(prefill=Poly(50.0, 0, 0), decode=Poly(10.0, 0, 0), kv=Poly(2000.0, 0))
    _, at = distributions_at(parse_distributions("poisson:1,in=100,out=10"), 200, seed=2)
    ranked = search(prof, [Deployment(0, 2), Deployment(1, 1)], at, 1.0, Slo(ttft=1.0, tpot=0.2))
    assert ranked[0].deployment == Deployment(0, 2) and ranked[1].goodput == 0.0


def test_fit_ignores_a_sample_far_off_the_rest() -> None:
    rows = [(t, 0.0, 2 + 0.01 * t) for t in (32, 128, 256, 512, 1024)] + [(1536, 0.0, 60.0)]
    p = fit_poly(rows)
    assert p.a == pytest.approx(2, abs=1e-6) and p.b == pytest.approx(0.01, rel=1e-6)
    # without an outlier every sample counts
    assert fit_poly(rows[:-1] + [(1536, 0.0, 18.0)]) != p


def test_refit_uses_the_stored_samples() -> None:
    decode = [(n, k, (8.0 + n) * f) for n in (1, 4) for k in (64, 512) for f in (0.9, 1.1)]
    inst = fit_instance(
        1,
        [(t, b, 3 + 0.1 * t * b + b) for t in (16, 256, 1024) for b in (1, 2)],
        decode,
        [(128, 4.0)],
        spread_window_ms=60.0,
    )
    assert inst.decode.at(4, 0) == pytest.approx(12.0) and inst.decode_spread == [0.9] * 4 + [1.1] * 4
    stale = msgspec.structs.replace(inst, prefill=Poly(0, 0, 0))
    assert refit(stale) == inst


FORMAT_2_NO_NEIGHBOURS = """{"format": 2, "model": "m", "instances": [{"tp": 1, "prefill": {"a": 10.0, "b": 0.05},
  "decode": {"a": 5.0, "b": 0.5, "c": 0.001}, "kv": {"a": 3.0, "b": 0.01}}]}"""


def test_neighbour_factors_default_to_one_and_a_file_without_them_loads(tmp_path) -> None:
    (tmp_path / "old.json").write_text(FORMAT_2_NO_NEIGHBOURS)
    inst = load_profile(tmp_path / "old.json").for_tp(1)
    assert (inst.beside_prefill, inst.beside_decode, inst.neighbour_samples) == (1.0, 1.0, [])
    assert fit_instance(1, [(16, 1, 3.0)], [(1, 64, 5.0)], [(128, 1.0)]).beside_prefill == 1.0
    # the factors: median beside / median alone per kind, floored at 1.0, and they survive a round trip
    samples = [
        ("decode", 10.0, 12.0),
        ("decode", 11.0, 14.0),
        ("decode", 9.0, 13.0),
        ("prefill", 100.0, 95.0),
        ("prefill", 100.0, 99.0),
    ]
    assert neighbour_factor(samples, "decode") == pytest.approx(1.3) and neighbour_factor(samples, "prefill") == 1.0
    measured = fit_instance(1, [(16, 1, 3.0)], [(1, 64, 5.0)], [(128, 1.0)], neighbour=samples)
    assert (measured.beside_prefill, measured.beside_decode) == (pytest.approx(1.3), 1.0)
    save_profile(LatencyProfile("m", [measured]), tmp_path / "new.json")
    assert load_profile(tmp_path / "new.json").for_tp(1) == measured
    # refit keeps them: recomputed from the samples, or as set where there are none
    assert refit(measured) == measured
    by_hand = msgspec.structs.replace(measured, beside_decode=1.2, neighbour_samples=samples[:3])
    assert refit(by_hand) == by_hand


def test_mixed_step_scales_each_part_by_its_neighbour_factor() -> None:
    inst = make_profile().for_tp(1)
    decode_part = DECODE.b * 2 + DECODE.c * 300
    assert inst.mixed_ms([100], 2, 300, 1.1, 1.3, 1.5) == pytest.approx(
        inst.prefill_ms(100) * 1.5 + decode_part * 1.1 * 1.3
    )
    assert inst.mixed_ms([], 2, 300, 1.0, 1.3, 1.5) == pytest.approx(inst.decode_ms(2, 300) * 1.3)
    assert inst.mixed_ms([100], 0, 0, 1.0, 1.3, 1.5) == pytest.approx(inst.prefill_ms(100) * 1.5)


NEIGHBOURS = dict(prefill=Poly(50.0, 0, 0), decode=Poly(30.0, 0, 0), kv=Poly(40.0, 0))


def test_decode_steps_beside_a_prefill_are_slower() -> None:
    # A decodes 30 ms steps from 0.09 on; B's prefill runs 0.5-0.55 on the prefill instance
    reqs = [TraceRequest(0.0, 100, 40), TraceRequest(0.5, 100, 3)]
    a, _ = simulate(make_profile(**NEIGHBOURS), Deployment(1, 1), reqs)
    slow_a, _ = simulate(make_profile(**NEIGHBOURS, beside_prefill=1.3), Deployment(1, 1), reqs)
    assert a.tpot == pytest.approx(0.030)
    # the steps starting at 0.51 and 0.549 (B's prefill running) take 39 ms; none other does
    assert slow_a.finish - a.finish == pytest.approx(2 * 0.3 * 0.030)
    assert slow_a.ttft == a.ttft
    # a lone request never has a neighbour at work: unchanged, disaggregated or colocated
    lone = [TraceRequest(1.0, 500, 5)]
    for d in (Deployment(1, 1), Deployment(0, 2)):
        (base,) = simulate(make_profile(), d, lone)
        (beside,) = simulate(make_profile(beside_prefill=1.3, beside_decode=1.5), d, lone)
        assert (beside.ttft, beside.tpot) == (base.ttft, base.tpot)


def test_a_prefill_beside_a_decoding_neighbour_is_slower() -> None:
    reqs = [TraceRequest(0.0, 100, 40), TraceRequest(0.5, 100, 3)]
    # colocated x2: B lands on the idle instance; its prefill starts while A's instance decodes
    a, b = simulate(make_profile(**NEIGHBOURS), Deployment(0, 2), reqs)
    slow_a, slow_b = simulate(make_profile(**NEIGHBOURS, beside_decode=1.5), Deployment(0, 2), reqs)
    assert b.ttft == pytest.approx(0.050) and slow_b.ttft == pytest.approx(0.075)
    assert (slow_a.ttft, slow_a.finish) == (a.ttft, a.finish)  # decode is not what beside_decode scales
    # 1P1D: the prefill ends at 0.575 instead of 0.55; KV 10 ms later, B joins A's step at 0.60, not 0.57
    _, b = simulate(make_profile(**NEIGHBOURS), Deployment(1, 1), reqs)
    _, slow_b = simulate(make_profile(**NEIGHBOURS, beside_decode=1.5), Deployment(1, 1), reqs)
    assert b.ttft == pytest.approx(0.10) and slow_b.ttft == pytest.approx(0.13)


def test_a_requests_first_decode_step_costs_first_step_ms_more() -> None:
    # a lone stream's first gap less its steady step: the median of the samples, never negative
    inst = fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0), (2, 128, 6.0)], [(128, 1.0)], first_step=[1.0, 1.4, 9.0])
    assert inst.first_step_ms == pytest.approx(1.4)
    assert fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)], first_step=[-0.5]).first_step_ms == 0.0
    assert refit(inst).first_step_ms == pytest.approx(1.4)
    # colocated x1, one request of 11 tokens: its 10 gaps are 10 steps, the first of them first_step_ms longer
    req = [TraceRequest(0.0, 100, 11)]
    base = make_profile()
    slow = LatencyProfile("m", [msgspec.structs.replace(base.instances[0], first_step_ms=5.0)])
    (a,), (b,) = simulate(base, Deployment(0, 1), req), simulate(slow, Deployment(0, 1), req)
    assert a.ttft == pytest.approx(b.ttft)
    assert (b.tpot - a.tpot) * 10 == pytest.approx(0.005)
    # 1P1D: the same on the decode instance
    (a,), (b,) = simulate(base, Deployment(1, 1), req), simulate(slow, Deployment(1, 1), req)
    assert (b.tpot - a.tpot) * 10 == pytest.approx(0.005)


def test_wake_points_are_the_median_difference_per_idle_time_and_interpolate() -> None:
    # (idle ms, back to back ms, after idle ms): medians per idle time, their difference (+0.9 after 30 ms,
    # -1.0 after 100, +3.0 after 300) made non-decreasing - a longer idleness cannot wake faster: the 100 ms
    # dip is pooled with 30 ms's, weighted by their pairs (2 and 1) - and never negative
    samples = [
        (30.0, 7.0, 8.0),
        (300.0, 7.0, 10.0),
        (30.0, 7.2, 8.0),
        (300.0, 7.4, 11.0),
        (300.0, 6.8, 9.9),
        (100.0, 8.0, 7.0),
    ]
    inst = fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)], wake=samples)
    pooled = (2 * 0.9 - 1.0) / 3
    assert inst.wake_after_idle == [
        (30.0, pytest.approx(pooled, abs=1e-3)),
        (100.0, pytest.approx(pooled, abs=1e-3)),
        (300.0, pytest.approx(3.0)),
    ]
    assert inst.wake_ms(0) == 0.0 and inst.wake_ms(15) == pytest.approx(pooled / 2, abs=1e-3)
    assert inst.wake_ms(200) == pytest.approx((pooled + 3.0) / 2, abs=1e-3) and inst.wake_ms(5000) == pytest.approx(3.0)
    assert fit_instance(
        1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)], wake=[(30.0, 7.0, 6.0), (100.0, 7.0, 6.5)]
    ).wake_after_idle == [(30.0, 0.0), (100.0, 0.0)]
    assert refit(inst).wake_after_idle == inst.wake_after_idle
    assert merge_samples(inst, inst).wake_samples == samples + samples
    assert fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)]).wake_ms(1000) == 0.0
    # through a PD pair: a curve of its own, pooled and refitted alike; without one, the relay's
    assert inst.pd_wake_ms(5000) == pytest.approx(3.0)
    pd = fit_instance(
        1,
        [(128, 1, 10.0)],
        [(1, 64, 5.0)],
        [(128, 1.0)],
        wake=samples,
        pd_wake=[(1000.0, 20.0, 21.0), (3000.0, 20.0, 22.5)],
    )
    assert pd.pd_wake_after_idle == [(1000.0, 1.0), (3000.0, 2.5)] and pd.wake_ms(3000) == pytest.approx(3.0)
    assert pd.pd_wake_ms(500) == pytest.approx(0.5) and pd.pd_wake_ms(2000) == pytest.approx(1.75)
    assert refit(pd) == pd and merge_samples(pd, pd).pd_wake_samples == pd.pd_wake_samples * 2


def test_a_prefill_after_idle_takes_the_wake_up_longer() -> None:
    base = make_profile()
    woken = LatencyProfile("m", [msgspec.structs.replace(base.instances[0], wake_after_idle=[(100.0, 4.0)])])
    # colocated x1: A reaches an instance idle since the start: the whole wake-up, on its TTFT only
    (a,) = simulate(woken, Deployment(0, 1), [TraceRequest(0.0, 100, 3)])
    assert a.ttft == pytest.approx(0.034) and a.finish is not None
    # B 50 ms after A's last step: half of it; C while B decodes (no idling: none of its own, only B's 2 ms
    # shift of the step it joins)
    reqs = [TraceRequest(0.0, 100, 3), TraceRequest(a.finish + 0.05, 100, 40), TraceRequest(a.finish + 0.09, 100, 2)]
    plain, wake = simulate(base, Deployment(0, 1), reqs), simulate(woken, Deployment(0, 1), reqs)
    assert [w.ttft - p.ttft for p, w in zip(plain, wake)] == pytest.approx([0.004, 0.002, 0.002])
    assert [w.tpot for w in wake] == pytest.approx([p.tpot for p in plain])
    # 1P1D: on the prefill instance only (the decode instance wakes as the request arrives, beside the prefill)
    (p1,), (w1,) = simulate(base, Deployment(1, 1), reqs[:1]), simulate(woken, Deployment(1, 1), reqs[:1])
    assert w1.ttft - p1.ttft == pytest.approx(0.004) and w1.tpot == pytest.approx(p1.tpot)
    # the pair's own curve, where measured, for 1P1D's prefill; colocated keeps the relay's
    pair = LatencyProfile("m", [msgspec.structs.replace(woken.instances[0], pd_wake_after_idle=[(100.0, 1.0)])])
    (w2,) = simulate(pair, Deployment(1, 1), reqs[:1])
    assert w2.ttft - p1.ttft == pytest.approx(0.001)
    assert [w.ttft for w in simulate(pair, Deployment(0, 1), reqs)] == pytest.approx([w.ttft for w in wake])


def test_requests_take_turns_among_equally_loaded_instances_as_the_proxy_does() -> None:
    sim = Simulation(make_profile(), Deployment(0, 2))
    lone = sim.run([TraceRequest(float(i), 100, 4) for i in range(4)])
    first, second = sim.decoders
    assert [r.decoder for r in lone] == [first, second, first, second]
    # not tied: the one with fewer outstanding requests, whoever's turn it is (C's turn is the first's, but
    # A still decodes there)
    sim = Simulation(make_profile(), Deployment(1, 2))
    a, b, c = sim.run([TraceRequest(0.0, 100, 400), TraceRequest(0.001, 100, 2), TraceRequest(1.0, 100, 4)])
    assert (a.decoder, b.decoder, c.decoder) == (sim.decoders[0], sim.decoders[1], sim.decoders[1])
    assert a.finish is not None and a.finish > 1.0


def test_among_instances_with_as_many_requests_the_one_with_fewer_tokens_takes_it_as_the_proxy_does() -> None:
    # colocated x2: a 1,500-token prompt on the first, a 100-token one on the second; the third request finds
    # one outstanding on each - the proxy (and now the simulator) sends it where fewer tokens are outstanding,
    # whoever's turn it is (the turn is the first's: turn-taking alone would queue it behind the long prompt)
    trace = [TraceRequest(0.0, 1500, 4), TraceRequest(0.001, 100, 400), TraceRequest(0.002, 100, 4)]
    sim = Simulation(make_profile(), Deployment(0, 2))
    long, short, third = sim.run(trace)
    assert (long.decoder, short.decoder, third.decoder) == (sim.decoders[0], sim.decoders[1], sim.decoders[1])
    assert third.ttft < long.ttft
    # the proxy's own policy on the same loads (a prefill leg's prompt, a decode leg's prompt + max_tokens)
    router = [Instance(f"http://{n}:1", "decode", None, breaker=None) for n in "ab"]  # type: ignore[arg-type]
    for inst, req in zip(router, trace[:2], strict=True):
        inst.outstanding["decode"], inst.outstanding_tokens["decode"] = 1, req.input_tokens + req.output_tokens
    policy = LeastOutstanding()
    next(policy._counter), next(policy._counter)  # two requests routed before, as in the simulation
    assert policy.choose(router, "decode", "", 100) is router[1]


def test_each_requests_first_steps_are_a_draw_from_the_samples() -> None:
    # colocated x1, lone requests of 11 tokens (10 gaps): each one's first steps take a draw from the
    # samples (a negative one counts as 0), so their TPOTs differ by 0 or 3 ms / 10 gaps
    base = make_profile()
    drawn = LatencyProfile(
        "m", [msgspec.structs.replace(base.instances[0], first_step_samples=[-1.0, 3.0], first_step_ms=1.0)]
    )
    reqs = [TraceRequest(float(i), 100, 11) for i in range(40)]
    plain = simulate(base, Deployment(0, 1), reqs)
    extra = [round((d.tpot - p.tpot) * 10 * 1e3, 6) for p, d in zip(plain, simulate(drawn, Deployment(0, 1), reqs))]
    assert set(extra) == {0.0, 3.0}
    assert extra == [
        round((d.tpot - p.tpot) * 10 * 1e3, 6) for p, d in zip(plain, simulate(drawn, Deployment(0, 1), reqs))
    ]  # seeded: the same again


def test_join_points_are_the_steps_extra_share_over_the_joins_per_second() -> None:
    # beside 20 joins/s the lone stream's step went 4.0 -> 5.0 ms: a fifth of each step, 10 ms per join
    samples = [(128, 4.0, 5.0, 20.0), (640, 4.0, 6.0, 10.0), (640, 4.0, 3.9, 10.0), (128, 4.0, 4.5, 0.0)]
    assert join_points(samples) == [(128, 10.0), (640, pytest.approx(33.333)), (640, 0.0), (128, 0.0)]
    inst = fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)], join=samples[:2])
    assert inst.join_ms(128) == pytest.approx(10.0) and inst.join_ms(640) == pytest.approx(33.333, abs=1e-3)
    assert refit(inst).join == inst.join and merge_samples(inst, inst).join_samples == samples[:2] * 2
    assert fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)]).join_ms(640) == 0.0


def test_a_decode_leg_joining_a_busy_decode_instance_slows_its_running_steps() -> None:
    base = make_profile(prefill=Poly(50.0, 0, 0), decode=Poly(30.0, 0, 0), kv=Poly(40.0, 0))
    joined = LatencyProfile("m", [msgspec.structs.replace(base.instances[0], join=Poly(7.0, 0.01))])
    trace = [TraceRequest(0.0, 100, 50), TraceRequest(0.5, 200, 3)]
    (a1, _), (a2, _) = simulate(base, Deployment(1, 1), trace), simulate(joined, Deployment(1, 1), trace)
    # the first request was alone on decode when it arrived: its hand-over is as measured
    assert a2.ttft == pytest.approx(a1.ttft)
    # the second arrived while it decoded: one of its steps took 7 + 0.01 x 200 ms longer
    assert (a2.finish - a1.finish) * 1e3 == pytest.approx(9.0)
    # colocated: no decode legs, no joins
    assert [r.finish for r in simulate(joined, Deployment(0, 1), trace)] == [
        r.finish for r in simulate(base, Deployment(0, 1), trace)
    ]
