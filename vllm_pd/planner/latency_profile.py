"""The latency profile of vLLM instances: fitted prefill, decode and KV hand-over cost models.

A profile file is JSON (msgspec) holding an :class:`InstanceProfile` per instance measured, for each
tensor-parallel size it covers: one, or a PD pair's two, each with its ``url`` and ``role`` ("prefill" /
"decode"; "" for the one instance profiled) - instances on other cores or hosts differ by 10-35 %, so
the plan takes each role's fit from the instance measured in it (:meth:`LatencyProfile.for_role`). Each
keeps the raw samples it was fitted from, so a profile can be re-fitted or inspected; with them its
``speed_checks`` (the same lone prefill and decode stream at the start, middle and end of its run: its
drift), ``prefill_spread`` (each prefill sample over the fit) and ``fit_notes`` (terms that came out 0 or
flat from noisy samples, and what stands in: see :func:`kv_fit` and :func:`wake_fit`).

- prefill: the time of one engine step that prefills ``n`` prompts of ``t_i`` tokens (``T`` in all),
  ``a + b*T + c*sum(t_i^2) + d*n`` ms (the square term is attention over each prompt; ``d`` is what
  every prompt costs on its own - its own sampling, output and HTTP work).
- decode: the time of one decode step of ``n`` running requests whose contexts sum to ``k`` tokens,
  ``L(n) + c*k`` ms (``c*k`` is attention reading the KV of every request; ``L(n)`` the step at no context,
  measured per batch size: ``decode_levels``, see :func:`decode_fit`), times a factor that
  holds for ``decode_spread_window_ms`` and is then drawn again from ``decode_spread``: each measured
  point (the mean step over a window of that length) over the fit. Step times drift - the proxy, the
  client and the API server take turns on the same cores - and slow windows, not single slow steps,
  are what make one request's TPOT differ from another's. A step's cost is not linear in its batch on
  every machine: on a CPU the GEMMs of a 2-row step took a slower kernel path than those of 1, 3 or 4 rows
  (batch 2 +20 %, batch 4 no dearer than batch 1, in every point of two profiles and a probe), and a line
  ``a + b*n`` through them came out flat, 10-15 % low for the pairs of requests a bursty load decodes
  most. So each batch measured keeps its own level, the line ``decode`` (``a + b*n + c*k``) runs between
  and beyond them, and a step holding prompt chunks (many more GEMM rows) adds the line's ``b*n + c*k``.
- kv: prefill's end to the first token on an idle decode instance, for ``t`` prompt tokens, ``a + b*t``
  ms (the layer-wise load overlaps decode's first forward with prefill's, so this is the tail of the
  transfer, the last layer's forward and the proxy's second hop, and what pushing the KV costs the
  prefill instance's own forward): the pair's TTFT less the prefill instance's own.
- first steps: a request's first decode steps (its second token most, the next two a little) take
  longer than its later ones (~1-1.7 ms in all here, in PD and colocated alike, varying from request to
  request): the simulator adds to a step, per request taking its first decode step, a draw from
  ``first_step_samples`` (a lone stream's gaps in its first half less as many of its steady steps);
  ``first_step_ms`` is their median. TPOT spans every gap, so leaving it out made short outputs' TPOT ~4 %
  low, and a constant made requests' TPOTs too alike (p90 low).
- wake-up after idle: a request reaching an instance that has been idle waits for the processes on its
  path (and, on a VM, their cores) to wake: ~2-4 ms here on a lone 128-token prefill of 7 ms after 0.3 s
  idle, about nothing back to back, and more again after a second or more (vLLM's executor spins for a
  second after each message, then blocks: +5 ms at 0.3-1 s, +7 at 2.5 s, +8.5 at 5 s on a 10 ms prefill
  of a slower VM; a colocated x2 at 1.1 req/s idles each instance ~1.8 s on average).
  ``wake_after_idle`` holds (idle ms, extra ms) points, each the median lone prefill after that much
  idleness less the median back to back (``wake_samples``: (idle ms, back to back ms, after idle ms));
  :meth:`InstanceProfile.wake_ms` interpolates them (0 at no idleness, the last point's beyond it).
  Profiles measure back to back, so without it every request of a light load came out 2-5 ms early. The
  curve is made non-decreasing (a longer idleness cannot wake faster: a dip is noise).
  Through a PD pair the path wakes differently (the proxy's two legs, the prefill instance's connector, the
  decode instance beside it): ``pd_wake_after_idle`` (``pd_wake_samples``) is the same measurement of a
  lone request's TTFT through the pair, used for prefill instances of a disaggregated deployment
  (:meth:`InstanceProfile.pd_wake_ms`; the relay's curve when not measured). On a slow VM the relay's
  wake-up grew from +5 ms at 0.3 s to +10 ms at 3 s idle while 1P1D's replays grew ~2-3 ms less.
- neighbours: instances on one host slow each other (shared memory bandwidth and caches), so
  ``beside_prefill`` is the factor on this instance's decode step time while another instance on the
  same host runs a prefill, and ``beside_decode`` the factor on its prefill time while another instance
  on the same host decodes. Each is the median of the measurements beside the neighbour over the median
  alone (``neighbour_samples``: (``"decode"`` or ``"prefill"``, alone ms, beside ms)), floored at 1.0.
  1.0 = not measured, or instances on separate hosts (or GPUs) that do not share those.
- joins: a request's decode leg arriving at a decode instance that is decoding others costs their steps
  time of its own - its HTTP leg, the scheduling, its KV's intake (the layer plan's reads, copies and
  checks) on the instance's core - ~2-4 of its steps per request here, far more than the beside-prefill
  factor (the neighbour's plain prefills push nothing). ``join`` (``a + b*t`` ms, ``t`` prompt tokens) is
  fitted from ``join_samples``: a lone stream's step beside the neighbour's plain prefills and beside
  back-to-back PD requests of ``t`` tokens, with the joins per second of that window; per join, the
  steps' extra share over the joins per second (:func:`join_points`). Zero: not measured.

Format 2 (this one) replaced format 1's prefill model (``a + b*T + c*T^2`` over the whole step) and its
kv (the hand-over before a full decode step); :func:`load_profile` reads format 1 files as format 2.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_pd.errors import PlannerError
from vllm_pd.planner.fit_noise import RESOLVED_SE, difference_se, median_se, non_decreasing, resolved, robust_sigma

PROFILE_FORMAT = 2


class ProfileError(PlannerError, ValueError):
    """A bad profile file or a fit with too few samples."""


class Poly(msgspec.Struct, frozen=True):
    """``a + b*x + c*y + d*w`` with non-negative coefficients, in milliseconds."""

    a: float = 0.0
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0

    def at(self, x: float, y: float = 0.0, w: float = 0.0) -> float:
        return self.a + self.b * x + self.c * y + self.d * w


class InstanceProfile(msgspec.Struct, frozen=True):
    tp: int
    prefill: Poly  # x = batched prompt tokens, y = the sum of each prompt's tokens squared, w = prompts
    decode: Poly  # x = running requests, y = the sum of their context lengths
    kv: Poly  # x = prompt tokens: prefill's end -> first token on an idle decode instance
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    decode_spread: list[float] = []  # measured decode point / its fit, sorted; empty = no spread
    # (batch, a pure decode step at no context, ms) per batch measured; empty: the line ``decode`` alone
    decode_levels: list[tuple[int, float]] = []
    decode_spread_window_ms: float = 0.0  # how long one factor holds (0: a new one every step)
    prefill_samples: list[tuple[int, int, float]] = []  # (tokens per prompt, prompts, ms)
    decode_samples: list[tuple[int, int, float]] = []  # (batch, summed context, mean ms per step)
    kv_samples: list[tuple[int, float]] = []  # (prompt tokens, ms)
    beside_prefill: float = 1.0  # decode step time x this while a same-host neighbour prefills
    beside_decode: float = 1.0  # prefill time x this while a same-host neighbour decodes
    neighbour_samples: list[tuple[str, float, float]] = []  # ("decode" | "prefill", alone ms, beside ms)
    join: Poly = Poly()  # x = prompt tokens: what a request joining this decode instance costs its running steps
    # (prompt tokens, a lone stream's step ms beside the neighbour's plain prefills, beside PD joins, joins per s)
    join_samples: list[tuple[int, float, float, float]] = []
    first_step_ms: float = 0.0  # what a step adds per request taking its first decode step (its second token)
    first_step_samples: list[float] = []  # a lone stream's first-half gaps less as many steady steps (ms)
    wake_after_idle: list[tuple[float, float]] = []  # (idle ms, what a prefill step then takes longer, ms)
    wake_samples: list[tuple[float, float, float]] = []  # (idle ms, back to back ms, after idle ms)
    pd_wake_after_idle: list[tuple[float, float]] = []  # the same through a PD pair (its prefill instance's steps)
    pd_wake_samples: list[tuple[float, float, float]] = []
    url: str = ""  # the instance measured
    role: str = ""  # what it was measured as: "prefill" or "decode" of a PD pair, "" (any: the one instance profiled)
    prefill_spread: list[float] = []  # each prefill sample over its fit, sorted (3 decimals)
    # (s since the profile run's start, prompt tokens, a lone prefill ms, context, a lone decode step ms): the
    # same two requests at the run's start, between its phases and at its end - its drift
    speed_checks: list[tuple[float, int, float, int, float]] = []
    pd_wake_floor: list[tuple[float, float]] = []  # the prefill instance's own wake-up, where the pair's is noise
    fit_notes: list[str] = []  # fits that came out 0 or flat from noisy samples, and what stands in for them

    def prefill_ms(self, tokens: int, prompts: int = 1, square: int | None = None) -> float:
        """``prompts`` prompts, ``tokens`` in all; ``square`` = the sum of their squares (default: equal)."""
        if tokens <= 0:
            return 0.0
        sq = square if square is not None else tokens * tokens // max(1, prompts)
        return self.prefill.at(tokens, sq, prompts)

    def decode_ms(self, batch: int, context: int) -> float:
        """A pure decode step: the batch's measured level (:func:`decode_level`) and its contexts' attention."""
        if not self.decode_levels:
            return self.decode.at(batch, context)
        return decode_level(self.decode_levels, self.decode.b, batch) + self.decode.c * context

    def wake_ms(self, idle_ms: float) -> float:
        """What a step with prompt work takes longer after the instance idled ``idle_ms``
        (:func:`wake_at` of :attr:`wake_after_idle`)."""
        return wake_at(self.wake_after_idle, idle_ms)

    def pd_wake_ms(self, idle_ms: float) -> float:
        """The same for a prefill instance of a PD pair: :attr:`pd_wake_after_idle`, else the relay's curve."""
        return wake_at(self.pd_wake_after_idle or self.wake_after_idle, idle_ms)

    def mixed_ms(
        self,
        chunks: Sequence[int],
        batch: int,
        context: int,
        spread: float = 1.0,
        beside_prefill: float = 1.0,
        beside_decode: float = 1.0,
    ) -> float:
        """One step: prompt chunks of these sizes and a decode batch in one forward (one fixed cost).

        With chunks, the decode part is the line's ``b*batch + c*context`` (the step's GEMMs have the chunks'
        rows too: a small batch's own kernel level, :attr:`decode_levels`, is not theirs); without, the
        step is :meth:`decode_ms`. ``spread`` scales the decode part (a factor from ``decode_spread``), and so
        does ``beside_prefill``
        (pass :attr:`beside_prefill` while a neighbour prefills, else 1.0); ``beside_decode`` scales the
        prefill part (pass :attr:`beside_decode` while a neighbour decodes, else 1.0).
        """
        tokens = sum(chunks)
        prefill = self.prefill_ms(tokens, len(chunks), sum(t * t for t in chunks)) * beside_decode
        if batch == 0:
            return prefill
        if tokens == 0:
            return self.decode_ms(batch, context) * spread * beside_prefill
        return prefill + (self.decode.b * batch + self.decode.c * context) * spread * beside_prefill

    def join_ms(self, tokens: int) -> float:
        """What a decode leg of ``tokens`` prompt tokens arriving here costs the steps of requests decoding here."""
        return self.join.at(tokens)

    def kv_ms(self, tokens: int) -> float:
        """Prefill's end to the first token on an idle decode instance (layer-wise load)."""
        return self.kv.at(tokens)

    def transfer_ms(self, tokens: int) -> float:
        """Prefill's end to the KV being usable on a busy decode instance (an async load, no forward)."""
        return max(0.0, self.kv_ms(tokens) - self.decode_ms(1, tokens))


class LatencyProfile(msgspec.Struct, frozen=True):
    model: str
    instances: list[InstanceProfile]
    source: str = ""  # the URL(s) it was measured on
    format: int = PROFILE_FORMAT

    def for_tp(self, tp: int) -> InstanceProfile:
        """The instance profiled in full for ``tp`` (the decode instance of a measured pair)."""
        members = self.members(tp)
        return next((i for i in members if i.role != "prefill"), members[0])

    def members(self, tp: int) -> list[InstanceProfile]:
        """Every instance measured at ``tp``, in the file's order (a pair: its prefill instance first)."""
        members = [i for i in self.instances if i.tp == tp]
        if not members:
            raise ProfileError(f"instances: no profile for tp={tp} (have {self.tps()})")
        return members

    def for_role(self, tp: int, role: str) -> list[InstanceProfile]:
        """The instances measured as ``role`` ("prefill" or "decode") at ``tp``; none: the one profiled in full."""
        return [i for i in self.members(tp) if i.role == role] or [self.for_tp(tp)]

    def tps(self) -> list[int]:
        return sorted({i.tp for i in self.instances})


class _InstanceV1(msgspec.Struct, frozen=True):
    tp: int
    prefill: Poly
    decode: Poly
    kv: Poly
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    prefill_samples: list[tuple[int, float]] = []  # (batched tokens, ms): the prompts per step were not kept
    decode_samples: list[tuple[int, int, float]] = []
    kv_samples: list[tuple[int, float]] = []


class _ProfileV1(msgspec.Struct, frozen=True):
    model: str
    instances: list[_InstanceV1]
    source: str = ""


def _from_v1(old: _ProfileV1) -> LatencyProfile:
    """Format 1 as format 2: each prefill sample one prompt (its ``T^2`` is then the sum of squares),
    no per-prompt term, no decode spread; kv gains the decode step format 1 added after it."""

    def convert(i: _InstanceV1) -> InstanceProfile:
        kv = Poly(i.kv.a + i.decode.a + i.decode.b, i.kv.b + i.decode.c)
        kv_samples = [(t, ms + i.decode.at(1, t)) for t, ms in i.kv_samples]
        return InstanceProfile(
            i.tp,
            i.prefill,
            i.decode,
            kv,
            i.max_num_batched_tokens,
            i.max_num_seqs,
            prefill_samples=[(t, 1, ms) for t, ms in i.prefill_samples],
            decode_samples=list(i.decode_samples),
            kv_samples=kv_samples,
        )

    return LatencyProfile(old.model, [convert(i) for i in old.instances], old.source)


def save_profile(profile: LatencyProfile, path: str | Path) -> None:
    Path(path).write_bytes(msgspec.json.format(msgspec.json.encode(profile)) + b"\n")


def load_profile(path: str | Path) -> LatencyProfile:
    """A profile file of format 2, or of format 1 converted (:func:`_from_v1`)."""
    try:
        raw = Path(path).read_bytes()
        head = json.loads(raw)
        version = head.get("format", 1) if isinstance(head, dict) else PROFILE_FORMAT
        if version not in (1, PROFILE_FORMAT):
            raise ProfileError(
                f"profile {path}: format: {version!r} is not one this vllm-pd reads (1, "
                f"{PROFILE_FORMAT}); profile the instance again with this version"
            )
        if version == 1:
            profile = _from_v1(msgspec.json.decode(raw, type=_ProfileV1))
        else:
            profile = msgspec.json.decode(raw, type=LatencyProfile)
    except OSError as e:
        raise ProfileError(f"profile {path}: {e}") from None
    except (msgspec.ValidationError, ValueError) as e:
        if isinstance(e, ProfileError):
            raise
        raise ProfileError(f"profile {path}: {e}") from None
    if not profile.instances:
        raise ProfileError(f"profile {path}: instances: empty")
    return profile


Row = Sequence[float]  # (x, z), (x, y, z) or (x, y, w, z): the features, then the measured ms


def fit_poly(rows: Sequence[Row], weights: Sequence[float] | None = None) -> Poly:
    """:func:`fit_terms` without the samples far off what the others predict.

    A sample whose leave-one-out residual is over 4 x the median one (and over 1 ms) was hit by
    something else on the machine; left in, one such sample at a long prompt drags the whole fit.
    """
    w = list(weights) if weights is not None else [1.0] * len(rows)
    if len(rows) < 5:
        return fit_terms(rows, w)
    loo = [
        abs(
            r[-1]
            - _predict(fit_terms([o for j, o in enumerate(rows) if j != i], [x for j, x in enumerate(w) if j != i]), r)
        )
        for i, r in enumerate(rows)
    ]
    limit = max(1.0, 4 * sorted(loo)[len(loo) // 2])
    keep = [i for i, r in enumerate(loo) if r <= limit]
    return fit_terms([rows[i] for i in keep], [w[i] for i in keep])


def _predict(p: Poly, row: Row) -> float:
    return p.at(*row[:-1])


def fit_terms(rows: Sequence[Row], weights: Sequence[float] | None = None) -> Poly:
    """Least squares ``z = a + b*x + c*y + d*w`` over the rows (each row weighted, default 1), dropping any
    term that fits negative.

    A negative coefficient is noise (a cost cannot shrink with more work) and would make the
    simulator predict negative step times far outside the measured range.
    """
    if not rows:
        raise ProfileError("fit: no samples")
    w = list(weights) if weights is not None else [1.0] * len(rows)
    terms = list(range(len(rows[0])))  # the constant and one per feature
    while terms:
        coef = _least_squares(rows, terms, w)
        if coef is not None and all(v >= 0 for v in coef.values()):
            return Poly(*(coef.get(t, 0.0) for t in range(4)))
        if coef is None:
            terms.pop()  # singular: the samples do not vary this term
        else:
            terms.remove(min(terms, key=lambda t: coef[t]))
    return Poly()  # every term fitted negative: within this model, the cost is nothing


def _least_squares(rows: Sequence[Row], terms: list[int], weights: Sequence[float]) -> dict[int, float] | None:
    if len(rows) < len(terms):
        return None
    feats = [[(1.0, *r[:-1])[t] for t in terms] for r in rows]
    # normal equations: (F^T W F) c = F^T W z, solved by Gaussian elimination with partial pivoting
    n = len(terms)
    m = [
        [sum(w * f[i] * f[j] for f, w in zip(feats, weights)) for j in range(n)]
        + [sum(w * f[i] * r[-1] for f, r, w in zip(feats, rows, weights))]
        for i in range(n)
    ]
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
    """The same instance fitted again from its stored samples (after a change to the fit).

    A neighbour factor with no samples of its kind (set by hand) is kept as it is.
    """
    new = fit_instance(
        inst.tp,
        inst.prefill_samples,
        inst.decode_samples,
        inst.kv_samples,
        inst.max_num_batched_tokens,
        inst.max_num_seqs,
        inst.decode_spread_window_ms,
        inst.neighbour_samples,
        inst.first_step_samples,
        inst.wake_samples,
        inst.join_samples,
        inst.pd_wake_samples,
        url=inst.url,
        role=inst.role,
        speed_checks=inst.speed_checks,
        pd_wake_floor=inst.pd_wake_floor,
    )
    kinds = {kind for kind, _, _ in inst.neighbour_samples}
    return msgspec.structs.replace(
        new,
        beside_prefill=new.beside_prefill if "decode" in kinds else inst.beside_prefill,
        beside_decode=new.beside_decode if "prefill" in kinds else inst.beside_decode,
    )


def merge_samples(old: InstanceProfile, new: InstanceProfile) -> InstanceProfile:
    """One instance profiled twice (or more): every sample of both, fitted again.

    A profile taken at one moment holds the machine's speed of that moment; on a shared host or VM,
    profiles taken minutes apart differ by 10-20 %, and their samples pooled describe it better.
    """
    if (old.tp, old.max_num_batched_tokens, old.max_num_seqs) != (new.tp, new.max_num_batched_tokens, new.max_num_seqs):
        raise ProfileError(
            f"instances: cannot merge tp={new.tp} (max_num_batched_tokens="
            f"{new.max_num_batched_tokens}, max_num_seqs={new.max_num_seqs}) into tp={old.tp} "
            f"({old.max_num_batched_tokens}, {old.max_num_seqs}): not the same instance kind"
        )
    windows = [w for w in (old.decode_spread_window_ms, new.decode_spread_window_ms) if w > 0]
    return fit_instance(
        old.tp,
        old.prefill_samples + new.prefill_samples,
        old.decode_samples + new.decode_samples,
        old.kv_samples + new.kv_samples,
        old.max_num_batched_tokens,
        old.max_num_seqs,
        sum(windows) / len(windows) if windows else 0.0,
        old.neighbour_samples + new.neighbour_samples,
        old.first_step_samples + new.first_step_samples,
        old.wake_samples + new.wake_samples,
        old.join_samples + new.join_samples,
        old.pd_wake_samples + new.pd_wake_samples,
        url=new.url or old.url,
        role=new.role,
        speed_checks=old.speed_checks + new.speed_checks,
        pd_wake_floor=new.pd_wake_floor or old.pd_wake_floor,
    )


def _wake_by_idle(samples: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float, int]]:
    """[(idle ms, median after idle - median back to back, its standard error, pairs)] per idle time, sorted."""
    by_idle: dict[float, list[tuple[float, float]]] = {}
    for idle, hot, cold in samples:
        by_idle.setdefault(idle, []).append((hot, cold))
    out = []
    for idle, pairs in sorted(by_idle.items()):
        hots, colds = [h for h, _ in pairs], [c for _, c in pairs]
        out.append((idle, statistics.median(colds) - statistics.median(hots), difference_se(colds, hots), len(pairs)))
    return out


def wake_points(samples: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """[(idle ms, extra ms)] per idle time measured, sorted: the median after idle less the median back to
    back, made non-decreasing with the idle time (a longer idleness cannot wake faster: a dip is noise,
    pooled with its neighbours, each weighted by its pairs) and floored at 0."""
    by_idle = _wake_by_idle(samples)
    curve = non_decreasing([v for _, v, _, _ in by_idle], [n for *_, n in by_idle])
    return [(idle, max(0.0, round(v, 3))) for (idle, *_), v in zip(by_idle, curve)]


def resolved_wake_points(samples: Sequence[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """:func:`wake_points` less those not resolved above their noise (what may stand in for another curve)."""
    return [
        (idle, value)
        for (idle, value), (_, _, se, _) in zip(wake_points(samples), _wake_by_idle(samples))
        if resolved(value, se)
    ]


def wake_fit(
    samples: Sequence[tuple[float, float, float]], name: str, floor: Sequence[tuple[float, float]] = ()
) -> tuple[list[tuple[float, float]], list[str]]:
    """:func:`wake_points`, and notes on the points not resolved above their noise; where ``floor`` (a curve
    measured otherwise: the prefill instance's own wake-up for the pair's) is higher there, it stands in."""
    points = wake_points(samples)
    if not points:
        return points, []
    notes, out, unresolved = [], [], []
    for (idle, value), (_, _, se, n) in zip(points, _wake_by_idle(samples)):
        if resolved(value, se):
            out.append((idle, value))
            continue
        stand_in = round(wake_at(floor, idle), 3) if floor else 0.0
        if stand_in > value:
            notes.append(
                f"{name} after {idle:.0f} ms idle: {value:+.1f} ms +- {se:.1f} ms ({n} pairs) is not resolved "
                f"above its noise: the prefill instance's own wake-up there, +{stand_in:.1f} ms, stands in"
            )
            out.append((idle, stand_in))
        else:
            unresolved.append(f"{idle:.0f} ms ({value:+.1f} +- {se:.1f})")
            out.append((idle, value))
    if unresolved:
        notes.append(f"{name}: not resolved above its noise after {', '.join(unresolved)} idle: kept as measured")
    # stand-ins can break the order: keep the curve non-decreasing
    values = non_decreasing([v for _, v in out], [1.0] * len(out))
    return [(idle, round(v, 3)) for (idle, _), v in zip(out, values)], notes


def kv_fit(samples: Sequence[tuple[int, float]]) -> tuple[Poly, list[str]]:
    """The KV hand-over ``a + b*t`` from its samples, and a note when it is not resolved above their noise.

    Each sample is the TTFT through the pair less the prefill instance's own TTFT of the same prompt, two
    latencies that on a slow instance are each far longer than the hand-over; prompt lengths measured
    several times weigh by their spread (a 1.5 s prefill's 20 ms noise must not drown a 32-token one's 0.5).
    Not resolved (under twice its standard error), the prompt length measured most sharply (its median's
    standard error the smallest: the shortest prompts, as a rule) still says what a hand-over takes at least
    there: its median stands in, flat, if larger than the fit (a fit through noise comes out 0; a decode
    step's fixed cost stood in once, 35 ms where the short prompts' hand-over measured 1-3 ms).
    """
    by_t: dict[int, list[float]] = {}
    for t, ms in samples:
        by_t.setdefault(t, []).append(ms)
    rows = [(t, ms) for t, ms in samples]
    if all(len(v) >= 2 for v in by_t.values()) and any(robust_sigma(v) > 0 for v in by_t.values()):
        # a few samples' spread is itself noisy: none weighs more than 10 x the median length's
        typical = statistics.median(robust_sigma(v) ** 2 for v in by_t.values())
        var = {t: max(robust_sigma(v) ** 2, 0.1 * typical, 0.01) for t, v in by_t.items()}
        weights = [1 / var[t] for t, _ in rows]
        se = math.sqrt(1 / sum(weights))
    else:
        weights = [1.0] * len(rows)
        fit = fit_poly(rows)
        se = median_se([ms - fit.at(t) for t, ms in rows]) if len(rows) >= 3 else 0.0
    fit = fit_poly(rows, weights)
    level = sum(w * fit.at(t) for (t, _), w in zip(rows, weights)) / sum(weights)
    if se == 0 or resolved(level, se):
        return fit, []
    sharpest = min(by_t, key=lambda t: (median_se(by_t[t]), t))
    stand_in = max(0.0, statistics.median(by_t[sharpest]))
    ts = sorted(by_t)
    note = (
        f"kv hand-over: {level:+.1f} ms +- {se:.1f} ms over {len(rows)} samples ({ts[0]}-{ts[-1]} tokens) is not "
        f"resolved above the noise of the prefills it is taken from: "
    )
    if stand_in > level:
        return Poly(round(stand_in, 3)), [
            note + f"{stand_in:.1f} ms stands in (the median at {sharpest} tokens, the length measured most sharply)"
        ]
    return fit, [note + "kept as fitted"]


def join_notes(join: Poly, samples: Sequence[tuple[int, float, float, float]]) -> list[str]:
    """What a join fit that came out 0 or flat does not say."""
    points = join_points(samples)
    if not points:
        return []
    ts = sorted({t for t, _ in points})
    spread = f"samples {min(ms for _, ms in points):.1f}-{max(ms for _, ms in points):.1f} ms per join"
    if join.a == join.b == 0:
        return [f"join: fitted 0 ({spread}): a join's cost is not resolved above the noise of the steps around it"]
    if join.b == 0 and len(ts) > 1:
        return [
            f"join: no growth with the prompt resolved over {ts[0]}-{ts[-1]} tokens ({spread}): flat {join.a:.1f} ms"
        ]
    return []


def wake_at(points: Sequence[tuple[float, float]], idle_ms: float) -> float:
    """The wake-up after ``idle_ms`` of idleness from sorted (idle ms, extra ms) points: linear between (0, 0)
    and the points, the last point's value beyond it (0 without points)."""
    x0, y0 = 0.0, 0.0
    for x, y in points:
        if idle_ms <= x:
            return y0 + (y - y0) * (idle_ms - x0) / (x - x0) if x > x0 else y
        x0, y0 = x, y
    return y0


def neighbour_factor(samples: Sequence[tuple[str, float, float]], kind: str) -> float:
    """median(beside) / median(alone) over the samples of ``kind``, floored at 1.0 (1.0 without any).

    ``"decode"``: a decode step beside a prefilling neighbour (:attr:`InstanceProfile.beside_prefill`);
    ``"prefill"``: a prefill beside a decoding neighbour (:attr:`InstanceProfile.beside_decode`).
    """
    alone = [a for k, a, _ in samples if k == kind]
    beside = [b for k, _, b in samples if k == kind]
    if not alone or statistics.median(alone) <= 0:
        return 1.0
    return max(1.0, round(statistics.median(beside) / statistics.median(alone), 3))


def join_points(samples: Sequence[tuple[int, float, float, float]]) -> list[tuple[int, float]]:
    """[(prompt tokens, decode ms per join)]: per sample, the share of each step the joins add over the
    neighbour's plain prefills, over the joins per second (floored at 0)."""
    return [
        (t, max(0.0, round((joins - plain) / joins / rate * 1e3, 3)) if joins > 0 and rate > 0 else 0.0)
        for t, plain, joins, rate in samples
    ]


def spread_of(
    decode: Poly, points: Sequence[tuple[int, int, float]], levels: Sequence[tuple[int, float]] = ()
) -> list[float]:
    """Each measured point over what ``decode`` (with its per-batch ``levels``) predicts for it, sorted (3
    decimals: a compact file)."""

    def fit(n: int, k: int) -> float:
        return decode_level(levels, decode.b, n) + decode.c * k if levels else decode.at(n, k)

    return sorted(round(ms / fit(n, k), 3) for n, k, ms in points if fit(n, k) > 0)


def decode_level(levels: Sequence[tuple[int, float]], slope: float, batch: int) -> float:
    """A pure decode step of ``batch`` at no context from sorted (batch, ms) ``levels``: a measured batch's
    own, linear between two measured batches, the nearest one's plus ``slope`` per request beyond them
    (less, floored at 0, below the smallest)."""
    lo_n, lo_ms = levels[0]
    if batch <= lo_n:
        return max(0.0, lo_ms - slope * (lo_n - batch))
    for hi_n, hi_ms in levels[1:]:
        if batch <= hi_n:
            return lo_ms + (hi_ms - lo_ms) * (batch - lo_n) / (hi_n - lo_n)
        lo_n, lo_ms = hi_n, hi_ms
    return lo_ms + slope * (batch - lo_n)


def decode_fit(points: Sequence[tuple[int, int, float]]) -> tuple[Poly, list[tuple[int, float]], list[str]]:
    """The decode step from its measured points (batch, summed context, ms): the line ``a + b*n + c*k``, each
    batch's own level at no context, and a note naming the batches whose level stands off the line.

    ``c`` is the context's cost within each batch (the points of one batch at different contexts: a batch's
    own level cannot leak into it), floored at 0; each batch's level is the median of its points less
    ``c*k``; the line is fitted through the points less ``c*k`` (:func:`fit_poly`: non-negative terms). With
    one batch measured, or no batch at two contexts, the line alone (:func:`fit_poly` over all three terms).
    """
    by_n: dict[int, list[tuple[int, float]]] = {}
    for n, k, ms in points:
        by_n.setdefault(n, []).append((k, ms))
    mean_k = {n: statistics.fmean(k for k, _ in v) for n, v in by_n.items()}
    mean_ms = {n: statistics.fmean(ms for _, ms in v) for n, v in by_n.items()}
    sxx = sum((k - mean_k[n]) ** 2 for n, v in by_n.items() for k, _ in v)
    if len(by_n) < 2 or sxx == 0:
        return fit_poly(points), [], []
    sxy = sum((k - mean_k[n]) * (ms - mean_ms[n]) for n, v in by_n.items() for k, ms in v)
    c = max(0.0, sxy / sxx)
    line = fit_poly([(n, ms - c * k) for n, k, ms in points])
    levels = [(n, round(statistics.median(ms - c * k for k, ms in by_n[n]), 3)) for n in sorted(by_n)]
    return Poly(line.a, line.b, c), levels, _level_notes(Poly(line.a, line.b, c), levels, by_n)


def _level_notes(line: Poly, levels: list[tuple[int, float]], by_n: dict[int, list[tuple[int, float]]]) -> list[str]:
    """A note when some batch's level stands off the line by over twice its standard error."""
    level_of = dict(levels)
    residuals = [ms - line.c * k - level_of[n] for n, v in by_n.items() for k, ms in v]
    free = len(residuals) - len(levels) - 1  # a level per batch and the context's cost
    if free < 1:
        return []
    sigma = math.sqrt(sum(r * r for r in residuals) / free)
    off = [
        (n, ms)
        for n, ms in levels
        if abs(ms - line.at(n)) > RESOLVED_SE * 1.253 * sigma / math.sqrt(len(by_n[n])) and line.at(n) > 0
    ]
    if not off:
        return []
    said = ", ".join(f"batch {n} {ms:.1f} ms ({ms / line.at(n):.2f} x)" for n, ms in off)
    return [
        f"decode: a step's cost is not linear in its batch: {said} at no context, against the line "
        f"{line.a:.1f} + {line.b:.2f}*batch ms (+- {sigma:.1f} ms a point): each batch measured steps at "
        "its own level, the line between and beyond them"
    ]


def prefill_spread_of(prefill: Poly, samples: Sequence[tuple[int, int, float]]) -> list[float]:
    """Each prefill sample over what ``prefill`` predicts for it, sorted (3 decimals)."""
    out = []
    for t, b, ms in samples:
        fit = prefill.at(t * b, t * t * b, b)
        if fit > 0:
            out.append(round(ms / fit, 3))
    return sorted(out)


def fit_instance(
    tp: int,
    prefill: list[tuple[int, int, float]],
    decode: list[tuple[int, int, float]],
    kv: list[tuple[int, float]],
    max_num_batched_tokens: int = 2048,
    max_num_seqs: int = 256,
    spread_window_ms: float = 0.0,
    neighbour: Sequence[tuple[str, float, float]] = (),
    first_step: Sequence[float] = (),
    wake: Sequence[tuple[float, float, float]] = (),
    join: Sequence[tuple[int, float, float, float]] = (),
    pd_wake: Sequence[tuple[float, float, float]] = (),
    *,
    url: str = "",
    role: str = "",
    speed_checks: Sequence[tuple[float, int, float, int, float]] = (),
    pd_wake_floor: Sequence[tuple[float, float]] = (),
) -> InstanceProfile:
    """Fit the models from raw samples (kv: at least one sample, or a fixed model in ``kv``).

    prefill: (tokens per prompt, prompts in the step, ms); decode: (batch, summed context, the mean ms
    per step over a window of ``spread_window_ms``; 0 = no spread: one sample per point is the fit's own);
    kv: (prompt tokens, ms), see :func:`kv_fit`; neighbour: (kind, alone ms, beside ms), see
    :func:`neighbour_factor` (none: factors 1.0); first_step: a lone stream's first-half gaps less as many
    steady steps, ms (none: 0); wake: (idle ms, back to back ms, after idle ms), see :func:`wake_fit` (none: no
    wake-up cost); join: see :func:`join_points` (none: no cost); pd_wake: as wake, through a PD pair (none:
    prefill instances of a pair wake as ``wake`` says), ``pd_wake_floor`` standing in where it is noise;
    speed_checks: kept as they are (the profile's drift). Fits that came out 0 or flat from noise are
    named in ``fit_notes``.
    """
    dec, levels, decode_notes = decode_fit(decode)
    pre = fit_poly([(t * b, t * t * b, b, ms) for t, b, ms in prefill])
    kv_poly, notes = kv_fit(kv)
    wake_after_idle, wake_notes = wake_fit(wake, "wake-up")
    pd_wake_after_idle, pd_notes = wake_fit(pd_wake, "the pair's wake-up", pd_wake_floor)
    join_poly = fit_poly(join_points(join)) if join else Poly()
    return InstanceProfile(
        tp=tp,
        prefill=pre,
        decode=dec,
        kv=kv_poly,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        decode_spread=spread_of(dec, decode, levels) if spread_window_ms > 0 else [],
        decode_levels=levels,
        decode_spread_window_ms=spread_window_ms,
        prefill_samples=list(prefill),
        decode_samples=list(decode),
        kv_samples=list(kv),
        beside_prefill=neighbour_factor(neighbour, "decode"),
        beside_decode=neighbour_factor(neighbour, "prefill"),
        neighbour_samples=list(neighbour),
        first_step_ms=max(0.0, round(statistics.median(first_step), 3)) if first_step else 0.0,
        first_step_samples=list(first_step),
        wake_after_idle=wake_after_idle,
        wake_samples=list(wake),
        pd_wake_after_idle=pd_wake_after_idle,
        pd_wake_samples=list(pd_wake),
        join=join_poly,
        join_samples=list(join),
        url=url,
        role=role,
        prefill_spread=prefill_spread_of(pre, prefill),
        speed_checks=list(speed_checks),
        pd_wake_floor=list(pd_wake_floor),
        fit_notes=decode_notes + notes + wake_notes + pd_notes + join_notes(join_poly, join),
    )
