"""The planner's cost model, online: predicted TTFT and TPOT of a prefill/decode split under its load.

The supervisor feeds it what the proxy sees right now (queued prompt tokens per side, running decode
requests and their context) and asks two things: how far each side is from its SLO, and whether the
side one ``kv_both`` instance would leave can spare it - so the supervisor does not move an instance
only to make the other side the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from vllm_pd.planner.latency_profile import InstanceProfile


@dataclass(frozen=True)
class SplitLoad:
    prefillers: int
    decoders: int
    queued_prompts: int  # requests in (or waiting for) a prefill leg
    queued_prompt_tokens: int
    decoding: int  # requests in a decode leg
    decoding_context_tokens: int  # their prompt tokens (the KV each decode step reads)


def predicted_ttft(profile: InstanceProfile, load: SplitLoad) -> float:
    """Seconds until a new prompt's first token: the queue ahead of it in chunks, then the hand-over (to an
    idle decode instance: ``kv_ms``; to a busy one: the async load and one decode step at this load)."""
    if load.prefillers < 1:
        return float("inf")
    per = load.queued_prompt_tokens / load.prefillers
    chunk = profile.max_num_batched_tokens
    full, rest = divmod(per, chunk)
    ms = full * profile.prefill_ms(chunk) + (profile.prefill_ms(int(rest)) if rest else 0.0)
    mean_prompt = load.queued_prompt_tokens / load.queued_prompts if load.queued_prompts else 0.0
    if load.decoding == 0:
        return (ms + profile.kv_ms(int(mean_prompt))) / 1e3
    return (ms + profile.transfer_ms(int(mean_prompt)) + predicted_tpot(profile, load) * 1e3) / 1e3


def predicted_tpot(profile: InstanceProfile, load: SplitLoad) -> float:
    """Seconds per decode step of one decoder's share of the running requests."""
    if load.decoders < 1:
        return float("inf")
    if load.decoding == 0:
        # nothing decoding is nothing late: one stream's step time over an SLO tighter than it would
        # otherwise read as pressure on an idle decode side (and move an instance there for nothing)
        return 0.0
    batch = max(1, round(load.decoding / load.decoders))
    return profile.decode_ms(batch, int(load.decoding_context_tokens / load.decoders)) / 1e3


def pressures(profile: InstanceProfile, load: SplitLoad, ttft_slo: float, tpot_slo: float) -> tuple[float, float]:
    """(prefill, decode): predicted TTFT / its SLO and TPOT / its SLO (> 1 = missing it)."""
    return predicted_ttft(profile, load) / ttft_slo, predicted_tpot(profile, load) / tpot_slo


def move_helps(
    profile: InstanceProfile,
    load: SplitLoad,
    to_role: str,
    ttft_slo: float,
    tpot_slo: float,
    receiving_pressure: float,
    dead_band: float = 1.2,
) -> bool:
    """Whether one instance may move to ``to_role``: the side it leaves must, by the model, still meet its
    SLO afterwards or stay below the pressure the receiving side is under now by ``dead_band`` (else the
    move only makes the other side the bottleneck)."""
    step = 1 if to_role == "prefill" else -1
    after = replace(load, prefillers=load.prefillers + step, decoders=load.decoders - step)
    if after.prefillers < 1:
        return True  # decode computes prompts itself then (the proxy's fallback): outside this model
    prefill_after, decode_after = pressures(profile, after, ttft_slo, tpot_slo)
    leaving = decode_after if to_role == "prefill" else prefill_after
    # over its SLO afterwards, the side it leaves must end clearly (the supervisor's dead band) below the
    # pressure that asks for the move: else the move only swaps which side misses, and the next tick moves
    # the instance back (seen on real servers: 16 streams on one decoder vs TTFT 1.1 x its target)
    return leaving < 1.0 or leaving * dead_band < receiving_pressure
