"""How sure the plain instance was of each greedy token, and output comparisons that allow for a near tie.

A greedy answer computed another way - decode computing a prompt itself after a fault, in chunks beside
other requests, or recomputing part of it after a failed load - sums the same numbers in another order.
On some CPUs (other SIMD widths, other kernels) that moves a logit by a few hundredths, and where the
plain instance's two best tokens were that close, the other one may win: a different answer that is not a
wrong one. A wrong KV moves logits by whole units. So an answer must equal the plain instance's up to the
first step whose top-2 log-probabilities were within NEAR_TIE of each other; from that step on it may
differ. Where no step is that close (most prompts: margins of 2-20 nats with the built-in model) the
comparison is exact.
"""

from __future__ import annotations

from typing import Any

NEAR_TIE = 1.0  # nats between the plain instance's best and second-best token
MARGINS: dict[str, list[float]] = {}  # catalogue key -> top-2 margin per greedy step (the reference fixture)


def with_top2(body: dict[str, Any]) -> dict[str, Any]:
    """``body`` asking for the two best tokens' log-probabilities (greedy sampling is unchanged)."""
    if "messages" in body:
        return {**body, "logprobs": True, "top_logprobs": 2}
    return {**body, "logprobs": 2}


def top2_margins(resp: dict[str, Any]) -> list[float]:
    """Best minus second-best log-probability at each generated step of an answer to ``with_top2``."""
    logprobs = resp["choices"][0].get("logprobs") or {}
    if "content" in logprobs:  # chat
        steps = [[t["logprob"] for t in step["top_logprobs"]] for step in logprobs["content"] or []]
    else:
        steps = [list(top.values()) for top in logprobs.get("top_logprobs") or []]
    return [max(s) - min(s) if len(s) > 1 else float("inf") for s in (sorted(s, reverse=True)[:2] for s in steps)]


def divergence(
    tokens: list[int] | None, reference: list[int], margins: list[float] | None, near_tie: float = NEAR_TIE
) -> str | None:
    """None if ``tokens`` is the reference answer, or equal to it up to a near tie of the reference;
    else where and how it differs."""
    if tokens == reference:
        return None
    tokens = tokens or []
    first = next((i for i, (a, b) in enumerate(zip(tokens, reference)) if a != b), min(len(tokens), len(reference)))
    tie = next((i for i, m in enumerate(margins or []) if m < near_tie), None)
    if tie is not None and first >= tie:
        return None
    margin = margins[first] if margins and first < len(margins) else float("nan")
    return f"differs at step {first} (the reference's top-2 margin there: {margin:.2f} nats; first near tie: {tie})"
