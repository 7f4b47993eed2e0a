"""How far a measured difference stands above its own noise, and a monotone curve through noisy points.

The profile's small terms (the KV hand-over, the wake-up after idleness) are differences of two latencies
that are each much longer than the term itself on a slow instance (a 1-4 s prefill against a few ms of
hand-over); fitted from a handful of samples they come out 0 or flat from noise alone. These helpers say
whether a term is resolved: its value over twice its standard error, the error of a median taken from the
samples' robust spread (1.4826 x their median absolute deviation).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

RESOLVED_SE = 2.0  # a term is resolved when it stands this many standard errors above 0


def robust_sigma(xs: Sequence[float]) -> float:
    """A standard deviation that one stray sample does not inflate, from five samples on (1.4826 x their median
    absolute deviation); below five the sample standard deviation (the median deviation of three or four
    samples can be near 0 by chance: a group weighed by it swamped every other); 0 below two."""
    if len(xs) < 2:
        return 0.0
    if len(xs) < 5:
        return statistics.stdev(xs)
    mid = statistics.median(xs)
    return 1.4826 * statistics.median(abs(x - mid) for x in xs)


def median_se(xs: Sequence[float]) -> float:
    """The standard error of the median of ``xs`` (normal samples: 1.253 sigma / sqrt(n))."""
    return 1.253 * robust_sigma(xs) / math.sqrt(len(xs)) if xs else 0.0


def difference_se(a: Sequence[float], b: Sequence[float]) -> float:
    """The standard error of median(a) - median(b), independent samples."""
    return math.hypot(median_se(a), median_se(b))


def resolved(value: float, se: float) -> bool:
    return value > RESOLVED_SE * se


def non_decreasing(values: Sequence[float], weights: Sequence[float]) -> list[float]:
    """The weighted least-squares non-decreasing sequence nearest ``values`` (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return [m for m, _, n in blocks for _ in range(int(n))]
