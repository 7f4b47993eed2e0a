"""The decode step measured per batch size (no vLLM, no servers).

On a CPU, a 2-request decode step ran 20 % slower than a 1-, 3- or 4-request one (every point of two profiles
and a probe, benchmarks/decode_step_probe.py); a line ``a + b*batch`` through such points comes out flat and
predicts the pairs a bursty load decodes most 10-15 % fast. These tests hold the fit and the simulator to
each batch's own level.
"""

from __future__ import annotations

import msgspec
import pytest

from vllm_pd.planner.latency_profile import (
    InstanceProfile,
    LatencyProfile,
    Poly,
    decode_fit,
    decode_level,
    fit_instance,
    fit_poly,
    load_profile,
    refit,
    save_profile,
)
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.profile_spread import scaled
from vllm_pd.planner.workload import TraceRequest

LEVEL = {1: 33.0, 2: 40.0, 4: 32.0}  # ms at no context: batch 2 dearer than 1 and 4, as measured on a CPU
CONTEXT_MS = 0.002  # per context token
POINTS = [
    (n, n * ctx, LEVEL[n] + CONTEXT_MS * n * ctx + noise) for n in LEVEL for ctx in (64, 512) for noise in (-0.3, 0.3)
]


def test_each_batch_measured_keeps_its_own_level_where_a_line_cannot() -> None:
    line, levels, notes = decode_fit(POINTS)
    assert dict(levels) == pytest.approx(LEVEL, abs=0.01)
    assert line.c == pytest.approx(CONTEXT_MS, rel=1e-6)
    inst = fit_instance(1, [(16, 1, 3.0), (256, 1, 9.0)], POINTS, [(128, 1.0)], spread_window_ms=50.0)
    for n, k, ms in POINTS:
        assert inst.decode_ms(n, k) == pytest.approx(ms, abs=0.31)
    assert max(inst.decode_spread) < 1.01 and min(inst.decode_spread) > 0.99  # the bump is not noise
    assert any("batch 2 40.0 ms" in note for note in inst.fit_notes)
    # negative control: the line alone (the fit before the levels) is 10 % fast at batch 2
    flat = fit_poly(POINTS)
    assert flat.at(2, 2 * 300) < 0.9 * inst.decode_ms(2, 2 * 300)


def test_batches_between_and_beyond_the_measured_follow_the_line() -> None:
    levels = [(1, 10.0), (2, 14.0), (4, 12.0)]
    assert decode_level(levels, 0.5, 3) == pytest.approx(13.0)  # between 2 and 4
    assert decode_level(levels, 0.5, 8) == pytest.approx(14.0)  # the largest measured plus the line's slope
    assert decode_level([(2, 10.0), (4, 12.0)], 0.5, 1) == pytest.approx(9.5)  # below the smallest
    assert decode_level([(2, 10.0)], 30.0, 1) == 0.0  # never below nothing


def test_the_context_cost_is_taken_within_each_batch() -> None:
    # each batch measured at two contexts; the batches' levels differ a lot, so a fit across batches would
    # blame the context for them (its summed context grows with the batch)
    levels = {1: 10.0, 2: 30.0, 8: 31.0}
    points = [(n, n * ctx, levels[n] + 0.001 * n * ctx) for n in levels for ctx in (100, 900)]
    line, fitted, _ = decode_fit(points)
    assert line.c == pytest.approx(0.001) and dict(fitted) == pytest.approx(levels)


def test_one_batch_or_one_context_is_the_line_alone() -> None:
    one_batch = [(4, 4 * ctx, 20 + 0.01 * 4 * ctx) for ctx in (64, 512)]
    assert decode_fit(one_batch)[1:] == ([], [])
    one_context = [(n, n * 64, 20.0 + n) for n in (1, 2, 4)]
    line, levels, _ = decode_fit(one_context)
    assert levels == [] and line.at(4, 0) == pytest.approx(24.0, abs=1e-6)


def test_a_profile_without_levels_steps_on_its_line_and_a_refit_gains_them(tmp_path) -> None:
    inst = fit_instance(1, [(16, 1, 3.0), (256, 1, 9.0)], POINTS, [(128, 1.0)])
    old = msgspec.structs.replace(inst, decode_levels=[])  # a profile written before the levels
    assert old.decode_ms(2, 600) == pytest.approx(old.decode.at(2, 600))
    assert refit(old).decode_levels == inst.decode_levels
    save_profile(LatencyProfile("m", [inst]), tmp_path / "p.json")
    assert load_profile(tmp_path / "p.json").for_tp(1) == inst


def test_a_step_with_prompt_chunks_adds_the_lines_decode_part_not_a_small_batchs_level() -> None:
    inst = fit_instance(1, [(16, 1, 3.0), (256, 1, 9.0)], POINTS, [(128, 1.0)])
    assert inst.mixed_ms([], 2, 600) == pytest.approx(inst.decode_ms(2, 600))
    assert inst.mixed_ms([256], 2, 600) == pytest.approx(inst.prefill_ms(256) + inst.decode.b * 2 + inst.decode.c * 600)


def test_the_band_scales_the_levels_with_the_line() -> None:
    inst = fit_instance(1, [(16, 1, 3.0), (256, 1, 9.0)], POINTS, [(128, 1.0)])
    slow = scaled(inst, 1.0, 1.2)
    assert slow.decode_ms(2, 600) == pytest.approx(1.2 * inst.decode_ms(2, 600))


def test_two_requests_decoding_together_step_at_batch_twos_level() -> None:
    # 1P1D: B arrives while A decodes; while both decode, the steps are batch 2's (40 ms), alone batch 1's
    inst = InstanceProfile(
        1, Poly(50.0, 0, 0), Poly(33.0, 0, 0), Poly(40.0, 0), decode_levels=[(1, 33.0), (2, 40.0), (4, 32.0)]
    )
    reqs = [TraceRequest(0.0, 100, 200), TraceRequest(1.0, 100, 50)]
    a, b = simulate(LatencyProfile("m", [inst]), Deployment(1, 1), reqs)
    assert b.tpot == pytest.approx(0.040, rel=0.02)  # it decoded beside A from its second token on
    line = InstanceProfile(1, Poly(50.0, 0, 0), Poly(33.0, 0, 0), Poly(40.0, 0))  # negative control
    _, b_line = simulate(LatencyProfile("m", [line]), Deployment(1, 1), reqs)
    assert b_line.tpot == pytest.approx(0.033, rel=0.02)
    assert a.tpot > 0.033
