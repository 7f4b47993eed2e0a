"""A bursty trace for `vllm-pd plan`, as a user's own traffic might be: one the planner was not tuned on.

    python3 benchmarks/plan_bursty_trace.py --seed 101 --out trace.jsonl [--duration 150]

Arrivals alternate between bursts (``--burst-s`` seconds each, uniformly 2/3-4/3 of it, Poisson at
``--burst-rate``) and quiet spells (``--quiet-s`` likewise, Poisson at ``--quiet-rate``), starting with a
quiet spell's first arrival. Prompts are lognormal (``--prompt-median`` tokens, ``--prompt-sigma`` in log
space) redrawn until within ``--prompt-min``-``--prompt-max``: heavy-tailed lengths; outputs uniform in
``--out-min``-``--out-max``. Every draw comes from ``--seed``: a fresh seed is a fresh trace of the same kind.
Written as `vllm-pd plan`'s JSONL (arrival, input_tokens, output_tokens per line).
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from dataclasses import dataclass
from pathlib import Path

from vllm_pd.planner.workload import TraceRequest, write_trace


@dataclass(frozen=True)
class BurstyTrace:
    burst_s: float = 6.0
    burst_rate: float = 0.9
    quiet_s: float = 12.0
    quiet_rate: float = 0.1
    prompt_median: float = 350.0
    prompt_sigma: float = 0.8
    prompt_min: int = 100
    prompt_max: int = 1500
    out_min: int = 16
    out_max: int = 64

    def sample(self, duration_s: float, seed: int) -> list[TraceRequest]:
        """Requests arriving within ``duration_s`` seconds."""
        rng = random.Random(seed)
        out: list[TraceRequest] = []
        t, burst = 0.0, False
        while t < duration_s:
            length = rng.uniform(2 / 3, 4 / 3) * (self.burst_s if burst else self.quiet_s)
            rate = self.burst_rate if burst else self.quiet_rate
            end = min(t + length, duration_s)
            at = t + rng.expovariate(rate)
            while at < end:
                out.append(TraceRequest(round(at, 3), self._prompt(rng), rng.randint(self.out_min, self.out_max)))
                at += rng.expovariate(rate)
            t, burst = end, not burst
        return out

    def _prompt(self, rng: random.Random) -> int:
        while True:
            n = round(rng.lognormvariate(math.log(self.prompt_median), self.prompt_sigma))
            if self.prompt_min <= n <= self.prompt_max:
                return n


def main(argv: list[str] | None = None) -> int:
    d = BurstyTrace()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of arrivals (default 150)")
    for name in ("burst_s", "burst_rate", "quiet_s", "quiet_rate", "prompt_median", "prompt_sigma"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(d, name))
    for name in ("prompt_min", "prompt_max", "out_min", "out_max"):
        ap.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(d, name))
    args = ap.parse_args(argv)
    spec = BurstyTrace(**{k: getattr(args, k) for k in BurstyTrace.__dataclass_fields__})
    trace = spec.sample(args.duration, args.seed)
    write_trace(trace, args.out)
    span = trace[-1].arrival - trace[0].arrival if len(trace) > 1 else 0.0
    print(
        f"wrote {args.out}: {len(trace)} requests over {span:.0f} s (seed {args.seed}); prompts "
        f"{min(r.input_tokens for r in trace)}-{max(r.input_tokens for r in trace)} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
