"""Pick the deployment with the most goodput per device under TTFT/TPOT SLOs (DistServe's measure).

Goodput is the highest request rate at which at least ``attainment`` (default 90 %) of requests
meet both SLOs; per device it is that rate over the devices the deployment uses (instances x TP).
Rates are searched by bisection: a distribution is re-sampled at each rate (same seed), a trace is
replayed with its arrival times compressed or stretched.

Every figure is also simulated with the profile at the fast and the slow end of the speeds it saw of itself
(vllm_pd.planner.profile_spread): the prediction's band. Goodput's band is searched for the candidates
within reach of the best (the others cannot change the pick; a bisection costs a few dozen simulations).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace

from vllm_pd.planner.latency_profile import LatencyProfile
from vllm_pd.planner.pd_simulator import Deployment, SimRequest, simulate
from vllm_pd.planner.profile_spread import band_profiles, profile_noise
from vllm_pd.planner.workload import Distributions, TraceRequest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Slo:
    ttft: float  # seconds
    tpot: float  # seconds per output token
    attainment: float = 0.9

    def met(self, req: SimRequest) -> bool:
        return req.ttft <= self.ttft and req.tpot <= self.tpot


@dataclass(frozen=True)
class LatencySummary:
    ttft_p50: float
    ttft_p90: float
    tpot_p50: float
    tpot_p90: float
    attainment: float


@dataclass(frozen=True)
class Candidate:
    deployment: Deployment
    goodput: float  # requests/s meeting the SLO attainment
    at_workload: LatencySummary  # at the workload's own rate
    # the same with the profile at the fast and the slow end of its own speeds (None: not simulated)
    at_workload_band: tuple[LatencySummary, LatencySummary] | None = None
    goodput_band: tuple[float, float] | None = None

    @property
    def per_device(self) -> float:
        return self.goodput / self.deployment.devices


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..1), the definition benchmarks/ uses too."""
    xs = sorted(values)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(requests: list[SimRequest], slo: Slo) -> LatencySummary:
    ttft = [r.ttft for r in requests]
    tpot = [r.tpot for r in requests if r.spec.output_tokens > 1]
    return LatencySummary(
        percentile(ttft, 0.5),
        percentile(ttft, 0.9),
        percentile(tpot, 0.5),
        percentile(tpot, 0.9),
        sum(slo.met(r) for r in requests) / len(requests),
    )


def enumerate_deployments(devices: int, tps: list[int]) -> list[Deployment]:
    """Every colocated N and nP x mD deployment with TP sizes from ``tps`` using at most ``devices``."""
    out: list[Deployment] = []
    for tp in tps:
        out += [Deployment(0, n, tp, tp) for n in range(1, devices // tp + 1)]
    for tp_p in tps:
        for tp_d in tps:
            for n_p in range(1, devices // tp_p + 1):
                out += [Deployment(n_p, n_d, tp_p, tp_d) for n_d in range(1, (devices - n_p * tp_p) // tp_d + 1)]
    return out


RequestsAt = Callable[[float], list[TraceRequest]]


def trace_at(trace: list[TraceRequest]) -> tuple[float, RequestsAt]:
    """(the trace's own rate, requests at any rate): arrivals scaled, lengths kept."""
    span = max(trace[-1].arrival - trace[0].arrival, 1e-9)
    own = (len(trace) - 1) / span if len(trace) > 1 else 1.0
    t0 = trace[0].arrival
    return own, lambda rate: [replace(r, arrival=(r.arrival - t0) * own / rate) for r in trace]


def distributions_at(dist: Distributions, n: int, seed: int) -> tuple[float, RequestsAt]:
    return dist.rate, lambda rate: dist.sample(n, seed, rate)


def goodput(
    profile: LatencyProfile,
    deployment: Deployment,
    requests_at: RequestsAt,
    slo: Slo,
    start_rate: float,
    iterations: int = 12,
    seed: int = 0,
) -> float:
    """The highest rate whose simulated SLO attainment is >= ``slo.attainment`` (0 if none)."""

    def ok(rate: float) -> bool:
        sims = simulate(profile, deployment, requests_at(rate), seed)
        return sum(slo.met(r) for r in sims) / len(sims) >= slo.attainment

    lo, hi = 0.0, start_rate
    while ok(hi):
        lo, hi = hi, hi * 2
        if hi > start_rate * 1e4:
            return hi  # unloaded at any sensible rate: the SLO never binds
    probe = start_rate / 2
    while lo == 0.0 and probe > start_rate * 1e-4:
        if ok(probe):
            lo = probe
            break
        hi, probe = probe, probe / 2
    if lo == 0.0:
        return 0.0
    for _ in range(iterations):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def search(
    profile: LatencyProfile,
    deployments: list[Deployment],
    requests_at: RequestsAt,
    own_rate: float,
    slo: Slo,
    seed: int = 0,
) -> list[Candidate]:
    """Every deployment's goodput, best goodput per device first (fewer devices break ties), with bands.

    ``seed`` seeds the simulated decode spread (the same draws for every deployment and rate).
    """
    out = []
    noise = profile_noise(profile)
    ends = band_profiles(profile) if noise > 0 else None
    for d in deployments:
        g = goodput(profile, d, requests_at, slo, own_rate, seed=seed)
        at = summarise(simulate(profile, d, requests_at(own_rate), seed), slo)
        band = (
            None
            if ends is None
            else (
                summarise(simulate(ends[0], d, requests_at(own_rate), seed), slo),
                summarise(simulate(ends[1], d, requests_at(own_rate), seed), slo),
            )
        )
        logger.info("%s: goodput %.3f req/s (%.3f per device)", d.label, g, g / d.devices)
        out.append(Candidate(d, g, at, band))
    ranked = sorted(out, key=lambda c: (-c.per_device, c.deployment.devices, c.deployment.label))
    if ends is None or not ranked:
        return ranked
    best = ranked[0].per_device
    return [
        replace(
            c,
            goodput_band=(
                goodput(ends[0], c.deployment, requests_at, slo, own_rate, seed=seed),
                goodput(ends[1], c.deployment, requests_at, slo, own_rate, seed=seed),
            ),
        )
        if c.per_device >= best * (1 - 2 * noise) - 1e-12
        else c
        for c in ranked
    ]
