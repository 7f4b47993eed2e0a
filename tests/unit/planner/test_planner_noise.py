"""What a profile knows of its own noise: small terms fitted from noisy samples, the profile's drift and
scatter, the plan's bands and near-ties (no vLLM, no servers)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import msgspec
import pytest

from vllm_pd import cli
from vllm_pd.planner.deployment_search import Candidate, LatencySummary, Slo, trace_at
from vllm_pd.planner.latency_profile import (
    InstanceProfile,
    LatencyProfile,
    Poly,
    fit_instance,
    join_notes,
    kv_fit,
    resolved_wake_points,
    save_profile,
    wake_fit,
)
from vllm_pd.planner.near_tie import near_tie
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.profile_spread import band_profiles, drift, profile_noise, scaled, speed_range
from vllm_pd.planner.workload import TraceRequest, write_trace

DECODE = Poly(4.0, 0.5, 0.001)


def test_a_hand_over_resolved_above_its_noise_is_kept_as_fitted() -> None:
    rng = random.Random(3)
    samples = [(t, 5.0 + 0.01 * t + rng.gauss(0, 0.2)) for t in (32, 128, 512) for _ in range(3)]
    kv, notes = kv_fit(samples)
    assert notes == [] and kv.at(0) == pytest.approx(5.0, abs=0.5) and kv.b == pytest.approx(0.01, abs=0.002)
    # the fixed model (no PD proxy measured): two exact points, nothing to say
    assert kv_fit([(0, 5.0), (1000, 10.0)]) == (Poly(5.0, 0.005), [])


def test_short_prompts_weigh_more_than_long_ones_when_their_spread_is_smaller() -> None:
    # 32 and 512 tokens: the hand-over within +-0.2 ms; 1536 tokens: +-40 ms of a 4 s prefill's noise
    samples = [
        (32, 5.0),
        (32, 5.2),
        (32, 4.8),
        (512, 7.0),
        (512, 7.2),
        (512, 6.8),
        (1536, 80.0),
        (1536, -20.0),
        (1536, 40.0),
    ]
    kv, notes = kv_fit(samples)
    assert notes == [] and kv.at(32) == pytest.approx(5.0, abs=0.1) and kv.at(512) == pytest.approx(7.0, abs=0.1)
    # unweighted, the long prompts' noise would take the line off both
    unweighted = Poly(*_unweighted(samples))
    assert abs(unweighted.at(32) - 5.0) > 2 and abs(unweighted.at(512) - 7.0) > 2


def _unweighted(samples: list[tuple[int, float]]) -> tuple[float, float]:
    n = len(samples)
    mx, my = sum(t for t, _ in samples) / n, sum(ms for _, ms in samples) / n
    b = sum((t - mx) * (ms - my) for t, ms in samples) / sum((t - mx) ** 2 for t, _ in samples)
    return my - b * mx, b


def test_a_hand_over_lost_in_noise_says_so_and_takes_its_sharpest_measurement() -> None:
    # the pair's TTFT less the prefill instance's, 1-4 s prefills: +-50-80 ms around a few ms at 1,536 and
    # 512 tokens; at 32 tokens the hand-over measured +1-3 ms (the shape of this session's quiet run)
    samples = [
        (32, 1.1),
        (32, 2.9),
        (32, 1.6),
        (512, -45.0),
        (512, -84.0),
        (512, -42.0),
        (1536, -77.0),
        (1536, 84.0),
        (1536, 78.0),
    ]
    kv, notes = kv_fit(samples)
    assert kv == Poly(1.6) and len(notes) == 1
    assert "not resolved above the noise" in notes[0] and "1.6 ms stands in (the median at 32 tokens" in notes[0]
    # in the profile: the same, named in fit_notes
    inst = fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0), (2, 128, 6.0), (4, 512, 8.0)], samples)
    assert inst.kv == Poly(1.6) and inst.fit_notes == notes
    # the sharpest length's median below the fit (or below 0): kept as fitted, and said
    _, notes = kv_fit([(32, -3.0), (32, -2.0), (32, -2.5), (1536, 60.0), (1536, -50.0), (1536, -30.0)])
    assert notes[0].endswith("kept as fitted")


def test_the_pairs_wake_up_lost_in_noise_takes_the_prefill_instances_own() -> None:
    # through the pair after 300 ms: +0.5 ms +- ~3; after 3 s: +9 ms, clearly
    rng = random.Random(5)
    pd = [(300.0, 20 + rng.gauss(0, 3), 20.5 + rng.gauss(0, 3)) for _ in range(6)]
    pd += [(3000.0, 20 + rng.gauss(0, 0.3), 29 + rng.gauss(0, 0.3)) for _ in range(6)]
    floor = [(300.0, 4.0), (3000.0, 6.0)]
    points, notes = wake_fit(pd, "the pair's wake-up", floor)
    assert points[0] == (300.0, 4.0) and points[1][1] == pytest.approx(9.0, abs=1.0)
    assert len(notes) == 1 and "after 300 ms idle" in notes[0] and "+4.0 ms, stands in" in notes[0]
    # without a floor it is said, and kept as measured
    bare, notes = wake_fit(pd, "the pair's wake-up")
    assert bare[0][1] < 4.0 and "kept as measured" in notes[0]
    # only resolved points may stand in for another curve
    assert [idle for idle, _ in resolved_wake_points(pd)] == [3000.0]


def test_a_join_fit_that_came_out_flat_or_zero_says_so() -> None:
    flat = [(128, 4.0, 4.5, 20.0), (640, 4.0, 4.4, 20.0), (128, 4.0, 4.6, 20.0), (640, 4.0, 4.5, 20.0)]
    inst = fit_instance(1, [(128, 1, 10.0)], [(1, 64, 5.0)], [(128, 1.0)], join=flat)
    assert inst.join.b == 0 and any(
        "no growth with the prompt resolved over 128-640 tokens" in n for n in inst.fit_notes
    )
    assert join_notes(Poly(), [(128, 4.0, 3.9, 20.0)])[0].startswith("join: fitted 0")
    assert join_notes(Poly(3.0, 0.01), flat) == []


def _checked(prefill_ms: list[float], decode_ms: list[float], spread: list[float] | None = None) -> InstanceProfile:
    inst = InstanceProfile(1, Poly(2.0, 0.04, 0.0), Poly(4.0, 0.0, 0.0), Poly(3.0), prefill_spread=spread or [])
    checks = [(60.0 * i, 512, p, 530, d) for i, (p, d) in enumerate(zip(prefill_ms, decode_ms))]
    return msgspec.structs.replace(inst, speed_checks=checks)


def test_a_profile_knows_its_drift_and_the_speeds_it_saw() -> None:
    inst = _checked([20.0, 22.0, 24.0], [4.0, 4.2, 4.4])  # the fit: a 512-token prefill 22.48 ms, a step 4 ms
    assert drift(inst) == (pytest.approx(0.2), pytest.approx(0.1))
    r = speed_range(inst)
    assert (r.prefill_lo, r.prefill_hi) == (pytest.approx(20 / 22.48, abs=1e-3), pytest.approx(1.068, abs=1e-3))
    assert (r.decode_lo, r.decode_hi) == (1.0, pytest.approx(1.1))
    assert r.noise == pytest.approx((1.068 - 20 / 22.48) / 2, abs=1e-3)
    # a profile without checks (an older file) has no noise of its own; scatter alone widens the prefill range
    assert speed_range(InstanceProfile(1, Poly(1.0), Poly(1.0), Poly(1.0))).noise == 0.0
    wide = speed_range(_checked([], [], spread=[0.8, 0.9, 1.0, 1.1, 1.2]))
    assert wide.prefill_lo == pytest.approx(1 - 0.1483, abs=1e-3) and wide.prefill_hi == pytest.approx(1.148, abs=1e-3)


def test_the_band_is_the_profile_at_the_ends_of_its_speeds() -> None:
    inst = _checked([20.0, 24.0], [4.0, 4.4])
    profile = LatencyProfile("m", [inst])
    fast, slow = band_profiles(profile)
    r = speed_range(inst)
    assert fast.instances[0] == scaled(inst, r.prefill_lo, r.decode_lo)
    assert slow.instances[0].prefill_ms(512) == pytest.approx(inst.prefill_ms(512) * r.prefill_hi)
    assert slow.instances[0].decode_ms(1, 10) == pytest.approx(4.4)
    assert profile_noise(profile) == r.noise
    # a lone request's TTFT and TPOT move with it
    reqs = [TraceRequest(0.0, 512, 8)]
    (lo,), (mid,), (hi,) = (simulate(p, Deployment(0, 1), reqs) for p in (fast, profile, slow))
    assert lo.ttft < mid.ttft < hi.ttft and lo.tpot <= mid.tpot < hi.tpot


def _summary(ttft: float = 0.1) -> LatencySummary:
    return LatencySummary(ttft, ttft, 0.01, 0.01, 1.0)


def _near_tie_inputs(noise_ms: float) -> tuple[LatencyProfile, object, float]:
    # speed checks +-noise around the fit's 512-token prefill (22.48 ms)
    inst = _checked([22.48 - noise_ms, 22.48 + noise_ms], [4.0, 4.0])
    trace = [TraceRequest(i * 0.5, 300, 8) for i in range(40)]
    own, at = trace_at(trace)
    return LatencyProfile("m", [inst]), at, own


def test_a_pick_within_the_profiles_noise_is_a_near_tie_and_says_what_would_separate_them() -> None:
    profile, at, own = _near_tie_inputs(noise_ms=2.0)  # +-9 %
    slo = Slo(ttft=0.05, tpot=0.02)
    best = Candidate(Deployment(0, 2), 20.0, _summary())
    close = Candidate(Deployment(1, 1), 19.0, _summary())  # 5 % behind
    tie = near_tie([best, close], profile, at, own, slo)
    assert tie is not None and tie.gap == pytest.approx(0.05) and tie.noise == pytest.approx(profile_noise(profile))
    text = tie.describe()
    assert text.startswith("near-tie: colocated x2 (10.000 req/s per device) and 1P1D (9.500)")
    assert "within the profile's own noise (+-9 %" in text and "To separate them" in text
    assert set(tie.binds) == {"colocated x2", "1P1D"} and all(
        v in ("TTFT", "TPOT", "TTFT and TPOT", "neither") for v in tie.binds.values()
    )
    # further apart than the noise, and the same order at both ends of the band: no tie
    far = Candidate(Deployment(1, 1), 10.0, _summary(), goodput_band=(12.0, 8.0))
    assert near_tie([msgspec_free(best, (22.0, 18.0)), far], profile, at, own, slo) is None
    # further apart than the noise, but swapped at the band's fast end: a tie
    swapped = Candidate(Deployment(1, 1), 10.0, _summary(), goodput_band=(46.0, 8.0))
    assert near_tie([msgspec_free(best, (22.0, 18.0)), swapped], profile, at, own, slo) is not None


def msgspec_free(c: Candidate, band: tuple[float, float]) -> Candidate:
    from dataclasses import replace

    return replace(c, goodput_band=band)


def test_plan_prints_bands_and_a_near_tie(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    # a profile whose speed moved +-30 % over its run: every figure has a band; colocated x1 and x2 are
    # each as good per device on a light load (x2 twice x1's goodput) - a near-tie
    inst = _checked([22.48 * 0.7, 22.48 * 1.3], [4.0 * 0.7, 4.0 * 1.3])
    save_profile(LatencyProfile("m", [inst]), tmp_path / "p.json")
    write_trace([TraceRequest(i * 0.5, 300, 8) for i in range(40)], tmp_path / "t.jsonl")
    rc = cli.main(
        [
            "plan",
            "--profile",
            str(tmp_path / "p.json"),
            "--workload",
            str(tmp_path / "t.jsonl"),
            "--slo",
            "ttft=40ms,tpot=8ms",
            "--devices",
            "2",
            "--deployments",
            "colocated x1,colocated x2",
            "--yaml",
            str(tmp_path / "y.yaml"),
            "--json",
            str(tmp_path / "c.json"),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "slow end of the speeds it saw of itself (+-30 %)" in out
    row = next(line for line in out.splitlines() if line.startswith("| colocated x1 |"))
    assert row.count("(") >= 3  # goodput and the latencies, each with its band
    assert "near-tie: " in out and "To separate them" in out
    assert "this profile's speed moved +-30 % over its own run" in out
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["noise"] == pytest.approx(0.3, abs=0.01) and data["near_tie"]["labels"]
    assert all(c["band"] and c["goodput_band"] for c in data["candidates"])
