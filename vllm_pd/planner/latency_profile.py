"""The latency profile of one vLLM instance: fitted prefill, decode and KV-transfer cost models.

A profile file is JSON (msgspec) holding one :class:`InstanceProfile` per tensor-parallel size it
covers. Each keeps the raw samples it was fitted from, so a profile can be re-fitted or inspected.

- prefill: the time of one engine step that prefills ``t`` batched tokens, ``a + b*t + c*t^2`` ms
  (the square term is attention over the prompt).
- decode: the time of one decode step of ``n`` running requests whose contexts sum to ``k`` tokens,
  ``a + b*n + c*k`` ms (``c*k`` is attention reading the KV of every request).
- kv: the time from prefill's end until decode can start a request of ``t`` prompt tokens,
  ``a + b*t`` ms (the transfer plus the proxy's second hop).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import msgspec


class ProfileError(ValueError):
    """A bad profile file or a fit with too few samples."""


class Poly(msgspec.Struct, frozen=True):
    """``a + b*x + c*y`` with non-negative coefficients, in milliseconds."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0

    def at(self, x: float, y: float = 0.0) -> float:
        return self.a + self.b * x + self.c * y


class InstanceProfile(msgspec.Struct, frozen=True):
    tp: int
    prefill: Poly  # x = batched prompt tokens, y = x^2
    decode: Poly  # x = running requests, y = the sum of their context lengths
    kv: Poly  # x = prompt tokens (c unused)
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_samples: list[tuple[int, float]] = []  # (batched tokens, ms)
    decode_samples: list[tuple[int, int, float]] = []  # (batch, summed context, ms)
    kv_samples: list[tuple[int, float]] = []  # (prompt tokens, ms)

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill.at(tokens, tokens * tokens)

    def decode_ms(self, batch: int, context: int) -> float:
        return self.decode.at(batch, context)

    def mixed_ms(self, prefill_tokens: int, batch: int, context: int) -> float:
        """A colocated step: a prefill chunk and a decode batch in one forward pass (one fixed cost)."""
        if batch == 0:
            return self.prefill_ms(prefill_tokens)
        if prefill_tokens == 0:
            return self.decode_ms(batch, context)
        return self.prefill_ms(prefill_tokens) + self.decode.b * batch + self.decode.c * context

    def kv_ms(self, tokens: int) -> float:
        return self.kv.at(tokens)


class LatencyProfile(msgspec.Struct, frozen=True):
    model: str
    instances: list[InstanceProfile]
    source: str = ""  # the URL(s) it was measured on

    def for_tp(self, tp: int) -> InstanceProfile:
        for inst in self.instances:
            if inst.tp == tp:
                return inst
        raise ProfileError(f"instances: no profile for tp={tp} (have {self.tps()})")

    def tps(self) -> list[int]:
        return sorted(i.tp for i in self.instances)


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")


def load_profile(path: str | Path) -> LatencyProfile:
    try:
        profile = msgspec.json.decode(Path(path).read_bytes(), type=LatencyProfile)
    except OSError as e:
        raise ProfileError(f"profile {path}: {e}") from None
    except msgspec.ValidationError as e:
        raise ProfileError(f"profile {path}: {e}") from None
    if not profile.instances:
        raise ProfileError(f"profile {path}: instances: empty")
    return profile


def fit_poly(rows: Sequence[tuple[float, float, float]]) -> Poly:
    """:func:`fit_terms` without the samples far off what the others predict.

    A sample whose leave-one-out residual is over 4 x the median one (and over 1 ms) was hit by
    something else on the machine; left in, one such sample at a long prompt drags the whole fit.
    """
    if len(rows) < 5:
        return fit_terms(rows)
    loo = [abs(z - fit_terms([r for j, r in enumerate(rows) if j != i]).at(x, y)) for i, (x, y, z) in enumerate(rows)]
    limit = max(1.0, 4 * sorted(loo)[len(loo) // 2])
    return fit_terms([row for row, r in zip(rows, loo) if r <= limit])


def fit_terms(rows: Sequence[tuple[float, float, float]]) -> Poly:
    """Least squares ``z = a + b*x + c*y`` over (x, y, z) rows, dropping any term that fits negative.

    A negative coefficient is noise (a cost cannot shrink with more work) and would make the
    simulator predict negative step times far outside the measured range.
    """
    terms = [0, 1, 2]
    while terms:
        coef = _least_squares(rows, terms)
        if coef is not None and all(v >= 0 for v in coef.values()):
            return Poly(coef.get(0, 0.0), coef.get(1, 0.0), coef.get(2, 0.0))
        if coef is None:
            terms.pop()  # singular: the samples do not vary this term
        else:
            terms.remove(min(terms, key=lambda t: coef[t]))
    raise ProfileError("fit: no non-negative fit")


def _least_squares(rows: Sequence[tuple[float, float, float]], terms: list[int]) -> dict[int, float] | None:
    if not rows:
        raise ProfileError("fit: no samples")
    if len(rows) < len(terms):
        return None
    feats = [[(1.0, x, y)[t] for t in terms] for x, y, _ in rows]
    # normal equations: (F^T F) w = F^T z, solved by Gaussian elimination with partial pivoting
    n = len(terms)
    m = [[sum(f[i] * f[j] for f in feats) for j in range(n)] + [sum(f[i] * r[2] for f, r in zip(feats, rows))]
         for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12 * max(1.0, max(abs(v) for row in m for v in row[:n])):
            return None
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                k = m[r][col] / m[col][col]
                m[r] = [v - k * w for v, w in zip(m[r], m[col])]
    return {t: m[i][n] / m[i][i] for i, t in enumerate(terms)}


def refit(inst: InstanceProfile) -> InstanceProfile:
    """The same instance fitted again from its stored samples (after a change to the fit)."""
    return fit_instance(inst.tp, inst.prefill_samples, inst.decode_samples, inst.kv_samples,
                        inst.max_num_batched_tokens, inst.max_num_seqs)


def fit_instance(tp: int, prefill: list[tuple[int, float]], decode: list[tuple[int, int, float]],
                 kv: list[tuple[int, float]], max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256) -> InstanceProfile:
    """Fit the three models from raw samples (kv: at least one sample, or a fixed model in ``kv``)."""
    return InstanceProfile(
        tp=tp,
        prefill=fit_poly([(t, t * t, ms) for t, ms in prefill]),
        decode=fit_poly([(n, k, ms) for n, k, ms in decode]),
        kv=fit_poly([(t, 0.0, ms) for t, ms in kv]),
        max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
        prefill_samples=list(prefill), decode_samples=list(decode), kv_samples=list(kv))
