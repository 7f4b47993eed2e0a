"""How sure a profile is of itself: its drift over its own run, its scatter, how far its instances differ.

A profile is one run of a few minutes on a machine whose speed moves (10-20 % within minutes on a shared VM,
a fresh instance on another core 15-35 % faster or slower). What it saw of that is kept in it: each
instance's speed checks (the same lone prefill and lone decode stream at the run's start, midway and end)
and its prefill samples' scatter around their fit. From them, :func:`speed_range` gives the speeds the
instance ran at during the profile, relative to its fit, and :func:`band_profiles` the profile at the slow
and the fast end of that range: what the plan simulates as its prediction's band.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from vllm_pd.planner.fit_noise import robust_sigma
from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, Poly

MAX_FACTOR = 2.0  # a check further off its fit than this is a broken measurement, not the machine's speed
UNSURE = 0.15  # a profile whose speed moved more than this over its own run says its figures are as unsure


@dataclass(frozen=True)
class SpeedRange:
    """The speeds an instance ran at during its profile, as factors on its fitted times (1.0 = the fit)."""

    prefill_lo: float = 1.0
    prefill_hi: float = 1.0
    decode_lo: float = 1.0
    decode_hi: float = 1.0

    @property
    def noise(self) -> float:
        """The range's half-width, as a share (0.05: +-5 %)."""
        return max(self.prefill_hi - self.prefill_lo, self.decode_hi - self.decode_lo) / 2


def check_ratios(inst: InstanceProfile) -> tuple[list[float], list[float]]:
    """Each speed check over what the fit predicts for it: (prefill ratios, decode ratios)."""
    prefill, decode = [], []
    for _, tokens, prefill_ms, context, decode_ms in inst.speed_checks:
        if inst.prefill_ms(tokens) > 0:
            prefill.append(prefill_ms / inst.prefill_ms(tokens))
        if inst.decode_ms(1, context) > 0:
            decode.append(decode_ms / inst.decode_ms(1, context))
    return prefill, decode


def drift(inst: InstanceProfile) -> tuple[float, float]:
    """(prefill, decode): the last speed check over the first, less 1 (0.0 with fewer than two checks)."""
    checks = inst.speed_checks
    if len(checks) < 2:
        return 0.0, 0.0
    first, last = checks[0], checks[-1]
    return (last[2] / first[2] - 1 if first[2] > 0 else 0.0, last[4] / first[4] - 1 if first[4] > 0 else 0.0)


def speed_range(inst: InstanceProfile) -> SpeedRange:
    """The checks' ratios to the fit, with the fit itself; the prefill range at least as wide as its samples'
    robust scatter around the fit (what one moment's measurement of it can be off by)."""
    prefill, decode = check_ratios(inst)
    scatter = robust_sigma(inst.prefill_spread)
    p = [1.0, 1.0 - scatter, 1.0 + scatter] + prefill
    d = [1.0] + decode
    return SpeedRange(_clamp(min(p)), _clamp(max(p)), _clamp(min(d)), _clamp(max(d)))


def _clamp(f: float) -> float:
    return round(min(MAX_FACTOR, max(1 / MAX_FACTOR, f)), 3)


def _times(p: Poly, f: float) -> Poly:
    return Poly(p.a * f, p.b * f, p.c * f, p.d * f)


def scaled(inst: InstanceProfile, prefill_f: float, decode_f: float) -> InstanceProfile:
    """``inst`` running ``prefill_f`` x slower on prompts (its wake-ups and hand-over with them) and ``decode_f``
    x on decode steps (with their first steps and joins). The samples are left as measured."""

    def wake(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [(idle, ms * prefill_f) for idle, ms in points]

    return msgspec.structs.replace(
        inst,
        prefill=_times(inst.prefill, prefill_f),
        decode=_times(inst.decode, decode_f),
        decode_levels=[(n, ms * decode_f) for n, ms in inst.decode_levels],
        kv=_times(inst.kv, prefill_f),
        join=_times(inst.join, decode_f),
        first_step_ms=inst.first_step_ms * decode_f,
        first_step_samples=[ms * decode_f for ms in inst.first_step_samples],
        wake_after_idle=wake(inst.wake_after_idle),
        pd_wake_after_idle=wake(inst.pd_wake_after_idle),
    )


def band_profiles(profile: LatencyProfile) -> tuple[LatencyProfile, LatencyProfile]:
    """(fast, slow): every instance at the fast and at the slow end of its :func:`speed_range`."""

    def at(end: str) -> LatencyProfile:
        out = []
        for inst in profile.instances:
            r = speed_range(inst)
            out.append(
                scaled(inst, r.prefill_lo, r.decode_lo) if end == "fast" else scaled(inst, r.prefill_hi, r.decode_hi)
            )
        return msgspec.structs.replace(profile, instances=out)

    return at("fast"), at("slow")


def profile_noise(profile: LatencyProfile) -> float:
    """The widest :attr:`SpeedRange.noise` of the profile's instances."""
    return max(speed_range(i).noise for i in profile.instances)


def describe(profile: LatencyProfile) -> list[str]:
    """What a profile says of itself, one line each: every instance's speed, drift and scatter, how far the
    instances differ, and the fits that came out 0 or flat from noise."""
    lines: list[str] = []
    seen: set[str] = set()  # the pair's terms are kept in both its instances: their notes once
    for tp in profile.tps():
        members = profile.members(tp)
        ref = profile.for_tp(tp)
        for inst in members:
            role = f" ({inst.role})" if inst.role else ""
            p_drift, d_drift = drift(inst)
            r = speed_range(inst)
            text = (
                f"tp={tp} {inst.url or 'instance'}{role}: a lone 512-token prefill {inst.prefill_ms(512):.1f} ms, "
                f"a decode step of 1 x 512 {inst.decode_ms(1, 512):.2f} ms"
            )
            if inst is not ref:
                text += (
                    f" ({inst.prefill_ms(512) / ref.prefill_ms(512):.2f} x and "
                    f"{inst.decode_ms(1, 512) / ref.decode_ms(1, 512):.2f} x {ref.url or 'the other'}'s)"
                )
            if inst.speed_checks:
                span = inst.speed_checks[-1][0] - inst.speed_checks[0][0]
                text += (
                    f"; over its run ({len(inst.speed_checks)} checks in {span:.0f} s) prefill drifted "
                    f"{p_drift * 100:+.0f} %, decode {d_drift * 100:+.0f} %"
                )
            text += (
                f"; speeds seen x{r.prefill_lo:.2f}-{r.prefill_hi:.2f} (prefill), "
                f"x{r.decode_lo:.2f}-{r.decode_hi:.2f} (decode) of the fit"
            )
            lines.append(text)
            lines += [f"tp={tp} {inst.url or 'instance'}: {note}" for note in inst.fit_notes if note not in seen]
            seen.update(inst.fit_notes)
    noise = profile_noise(profile)
    if noise > UNSURE:
        lines.append(
            f"this profile's speed moved +-{noise * 100:.0f} % over its own run (other work on the machine, "
            "or drift): every figure from it is as unsure - profile again on a quiet machine, or pool "
            "several profiles (--merge)"
        )
    return lines
