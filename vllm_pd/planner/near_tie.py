"""Whether the plan's pick is a near-tie, and what would separate the two deployments.

Two deployments whose goodputs per device are closer than the profile's own noise (how far its speed moved
over its own run, :func:`vllm_pd.planner.profile_spread.profile_noise`), or whose order flips at either end
of the profile's band, are a near-tie: the pick then rests on the profile's moment, not on the deployments.
What would separate them is found by moving one term of the profile at a time - prefill, decode, the KV
hand-over - by that noise (the hand-over, often not resolved, by half and double) and seeing which move
changes the order, with the SLO that binds each at its goodput.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from vllm_pd.planner.deployment_search import Candidate, RequestsAt, Slo, goodput
from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, Poly
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.profile_spread import profile_noise, scaled

MIN_STEP = 0.05  # the smallest move of a term tried: below it no profile on a shared machine is sure


@dataclass(frozen=True)
class NearTie:
    best: Candidate
    other: Candidate
    gap: float  # 1 - other's goodput per device / best's
    noise: float  # the profile's own (a share)
    binds: dict[str, str]  # deployment label -> the SLO most of its misses miss at its goodput
    separators: list[str]  # the moves of the profile that put the other first, described

    def describe(self) -> str:
        b, o = self.best.deployment.label, self.other.deployment.label
        text = (
            f"near-tie: {b} ({self.best.per_device:.3f} req/s per device) and {o} ({self.other.per_device:.3f}) "
            f"are {self.gap * 100:.0f} % apart, within the profile's own noise (+-{self.noise * 100:.0f} %: how "
            f"far its speed moved over its run) or swapped at an end of its band. At its goodput {b} misses on "
            f"{self.binds[b]}, {o} on {self.binds[o]}. "
        )
        if self.separators:
            text += f"{o} would lead with " + "; with ".join(self.separators) + ". "
        else:
            text += "No single term moved by that noise puts the other first. "
        return text + (
            "To separate them: profile again (vllm-pd profile --merge, on a quiet machine) until the "
            f"noise is under {self.gap * 100:.0f} %, or replay both on the real servers."
        )


def _with(profile: LatencyProfile, change: Callable[[InstanceProfile], InstanceProfile]) -> LatencyProfile:
    return msgspec.structs.replace(profile, instances=[change(i) for i in profile.instances])


def _kv_times(f: float) -> Callable[[InstanceProfile], InstanceProfile]:
    def change(i: InstanceProfile) -> InstanceProfile:
        return msgspec.structs.replace(i, kv=Poly(i.kv.a * f, i.kv.b * f))

    return change


def binding_slo(
    profile: LatencyProfile, d: Deployment, requests_at: RequestsAt, rate: float, slo: Slo, seed: int
) -> str:
    """Which SLO the requests missing theirs miss most, just above ``rate`` ("neither" if none miss)."""
    sims = simulate(profile, d, requests_at(max(rate, 1e-9) * 1.05), seed)
    ttft = sum(r.ttft > slo.ttft for r in sims)
    tpot = sum(r.tpot > slo.tpot for r in sims)
    if not ttft and not tpot:
        return "neither"
    return "TTFT" if ttft > 2 * tpot else "TPOT" if tpot > 2 * ttft else "TTFT and TPOT"


def near_tie(
    ranked: list[Candidate], profile: LatencyProfile, requests_at: RequestsAt, own_rate: float, slo: Slo, seed: int = 0
) -> NearTie | None:
    """The first two of ``ranked`` (from :func:`~vllm_pd.planner.deployment_search.search`) as a near-tie,
    or None when the first leads by more than the profile's noise at both ends of its band."""
    if len(ranked) < 2 or ranked[0].per_device <= 0:
        return None
    best, other = ranked[0], ranked[1]
    noise = profile_noise(profile)
    gap = 1 - other.per_device / best.per_device
    swapped = False
    if best.goodput_band and other.goodput_band:
        swapped = any(
            o / other.deployment.devices > b / best.deployment.devices
            for b, o in zip(best.goodput_band, other.goodput_band)
        )
    if gap > noise and not swapped:
        return None
    step = max(noise, MIN_STEP)
    moves: list[tuple[str, Callable[[InstanceProfile], InstanceProfile]]] = [
        (f"prefill {step * 100:.0f} % faster than profiled", lambda i: scaled(i, 1 - step, 1.0)),
        (f"prefill {step * 100:.0f} % slower", lambda i: scaled(i, 1 + step, 1.0)),
        (f"decode {step * 100:.0f} % faster", lambda i: scaled(i, 1.0, 1 - step)),
        (f"decode {step * 100:.0f} % slower", lambda i: scaled(i, 1.0, 1 + step)),
    ]
    if not (best.deployment.colocated and other.deployment.colocated):
        moves += [("the KV hand-over half as long", _kv_times(0.5)), ("the KV hand-over twice as long", _kv_times(2.0))]
    separators = []
    for what, change in moves:
        moved = _with(profile, change)
        g_best = goodput(moved, best.deployment, requests_at, slo, own_rate, seed=seed) / best.deployment.devices
        g_other = goodput(moved, other.deployment, requests_at, slo, own_rate, seed=seed) / other.deployment.devices
        if g_other > g_best:
            separators.append(f"{what} ({g_other:.3f} against {g_best:.3f} req/s per device)")
    binds = {
        c.deployment.label: binding_slo(profile, c.deployment, requests_at, c.goodput, slo, seed) for c in (best, other)
    }
    return NearTie(best, other, gap, noise, binds, separators)
