"""Workloads for the planner: a trace (JSONL) or seeded distributions with an arrival rate.

A trace line is ``{"arrival": seconds, "input_tokens": n, "output_tokens": m}``. A distribution
spec is ``poisson:RATE,in=SPEC,out=SPEC`` where SPEC is ``N`` (fixed), ``uniform:LO:HI`` or
``lognormal:MEAN:SIGMA`` (tokens; SIGMA is the log-space standard deviation).
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

from vllm_pd.errors import PlannerError


class WorkloadError(PlannerError, ValueError):
    """A bad trace line or distribution spec; the message names the key."""


@dataclass(frozen=True)
class TraceRequest:
    arrival: float  # seconds from the trace's start
    input_tokens: int
    output_tokens: int


@dataclass(frozen=True)
class LengthDist:
    kind: str  # fixed | uniform | lognormal
    p1: float
    p2: float = 0.0

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.p1)
        if self.kind == "uniform":
            return rng.randint(int(self.p1), int(self.p2))
        # a lognormal with the given mean: mu = ln(mean) - sigma^2/2
        return max(1, round(rng.lognormvariate(math.log(self.p1) - self.p2**2 / 2, self.p2)))


@dataclass(frozen=True)
class Distributions:
    rate: float  # requests per second (Poisson)
    input_tokens: LengthDist
    output_tokens: LengthDist

    def sample(self, n: int, seed: int = 0, rate: float | None = None) -> list[TraceRequest]:
        """``n`` requests at ``rate`` (default: the spec's); the same seed gives the same lengths."""
        rate = self.rate if rate is None else rate
        lengths, gaps = random.Random(seed), random.Random(seed + 1)
        t, out = 0.0, []
        for _ in range(n):
            t += gaps.expovariate(rate)
            out.append(TraceRequest(t, self.input_tokens.sample(lengths), max(1, self.output_tokens.sample(lengths))))
        return out


def load_trace(path: str | Path) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(float(row["arrival"]), int(row["input_tokens"]), int(row["output_tokens"]))
        except (ValueError, TypeError) as e:
            raise WorkloadError(f"{path}:{n}: {e}") from None
        except KeyError as e:
            raise WorkloadError(f"{path}:{n}: {e.args[0]}: missing") from None
        if req.input_tokens < 1 or req.output_tokens < 1 or req.arrival < 0:
            raise WorkloadError(f"{path}:{n}: input_tokens/output_tokens must be >= 1, arrival >= 0")
        out.append(req)
    if not out:
        raise WorkloadError(f"{path}: empty trace")
    return sorted(out, key=lambda r: r.arrival)


def write_trace(requests: list[TraceRequest], path: str | Path) -> None:
    Path(path).write_text(
        "".join(
            json.dumps(
                {"arrival": round(r.arrival, 6), "input_tokens": r.input_tokens, "output_tokens": r.output_tokens}
            )
            + "\n"
            for r in requests
        )
    )


def parse_length(spec: str, key: str) -> LengthDist:
    kind, _, rest = spec.partition(":")
    dist: LengthDist | None
    try:
        if not rest:
            dist = LengthDist("fixed", float(int(kind)))
        elif kind == "uniform":
            lo, hi = (int(v) for v in rest.split(":"))
            dist = LengthDist("uniform", lo, hi) if 1 <= lo <= hi else None
        elif kind == "lognormal":
            mean, sigma = (float(v) for v in rest.split(":"))
            dist = LengthDist("lognormal", mean, sigma) if mean >= 1 and sigma >= 0 else None
        else:
            dist = None
    except ValueError:
        dist = None
    if dist is None or dist.p1 < 1:
        raise WorkloadError(f"{key}: {spec!r} is not N, uniform:LO:HI or lognormal:MEAN:SIGMA")
    return dist


def parse_distributions(spec: str) -> Distributions:
    """``poisson:RATE,in=SPEC,out=SPEC``."""
    head, *parts = spec.split(",")
    kind, _, rate = head.partition(":")
    if kind != "poisson":
        raise WorkloadError(f"workload: {spec!r} does not start with poisson:RATE")
    try:
        r = float(rate)
    except ValueError:
        r = -1.0
    if r <= 0:
        raise WorkloadError(f"rate: {rate!r} is not a positive number")
    fields = dict(p.split("=", 1) for p in parts if "=" in p)
    bad = [p for p in parts if "=" not in p] + sorted(set(fields) - {"in", "out"})
    if bad:
        raise WorkloadError(f"{bad[0]}: unknown workload key (known: in, out)")
    for key in ("in", "out"):
        if key not in fields:
            raise WorkloadError(f"{key}: missing in workload {spec!r}")
    return Distributions(r, parse_length(fields["in"], "in"), parse_length(fields["out"], "out"))
