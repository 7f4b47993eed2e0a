"""``vllm-pd plan``: simulate deployments on a workload and pick the most goodput per device."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from vllm_pd.errors import ConfigError
from vllm_pd.planner.deployment_search import Candidate, Slo, distributions_at, enumerate_deployments, search, trace_at
from vllm_pd.planner.deployment_yaml import proxy_yaml, up_command, up_runs_tp
from vllm_pd.planner.latency_profile import load_profile
from vllm_pd.planner.near_tie import near_tie
from vllm_pd.planner.profile_spread import describe, profile_noise
from vllm_pd.planner.workload import load_trace, parse_distributions


def parse_slo(text: str, attainment: float) -> Slo:
    """``ttft=2,tpot=0.1`` in seconds (or with an ``ms`` suffix: ``ttft=500ms``)."""
    values: dict[str, float] = {}
    for part in text.split(","):
        key, sep, raw = part.partition("=")
        if not sep or key not in ("ttft", "tpot"):
            raise ConfigError(f"slo: {part!r} is not ttft=SECONDS or tpot=SECONDS")
        scale = 1e-3 if raw.endswith("ms") else 1.0
        try:
            values[key] = float(raw.removesuffix("ms").removesuffix("s")) * scale
        except ValueError:
            raise ConfigError(f"slo.{key}: {raw!r} is not a number") from None
        if values[key] <= 0:
            raise ConfigError(f"slo.{key}: must be > 0")
    for key in ("ttft", "tpot"):
        if key not in values:
            raise ConfigError(f"slo.{key}: missing")
    return Slo(values["ttft"], values["tpot"], attainment)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", type=Path, required=True, help="a file from `vllm-pd profile`")
    p.add_argument(
        "--workload",
        required=True,
        help="a JSONL trace (arrival, input_tokens, output_tokens per line) or "
        "poisson:RATE,in=SPEC,out=SPEC (SPEC: N, uniform:LO:HI, lognormal:MEAN:SIGMA)",
    )
    p.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS (or 500ms)")
    p.add_argument("--attainment", type=float, default=0.9, help="share of requests that must meet both SLOs")
    p.add_argument("--devices", type=int, default=4, help="instance budget, in devices (instances x TP)")
    p.add_argument("--requests", type=int, default=400, help="requests simulated from a distribution")
    p.add_argument("--seed", type=int, default=0, help="seeds the sampled workload and the simulated decode spread")
    p.add_argument("--deployments", help="only these, comma-separated labels (e.g. 1P1D,colocated x2)")
    p.add_argument("--yaml", type=Path, default=Path("vllm-pd-plan.yaml"), help="proxy YAML for the winner")
    p.add_argument("--json", type=Path, help="also write every candidate's figures here")
    p.add_argument("--host", default="127.0.0.1", help="host in the YAML's instance URLs")


BAND_SHOWN = 0.1  # a band narrower than this share of its figure does not matter: the figure alone


def _figure(c: Candidate, key: str, scale: float, digits: int) -> str:
    """A latency figure, with its band (the profile at its fast and slow end) where the band matters."""
    point = getattr(c.at_workload, key) * scale
    text = f"{point:.{digits}f}"
    if c.at_workload_band is None:
        return text
    lo, hi = sorted(getattr(s, key) * scale for s in c.at_workload_band)
    return text + (f" ({lo:.{digits}f}-{hi:.{digits}f})" if hi - lo > BAND_SHOWN * point else "")


def _goodput(c: Candidate) -> str:
    if c.goodput_band is None:
        return f"{c.goodput:.3f}"
    lo, hi = sorted(c.goodput_band)
    return f"{c.goodput:.3f}" + (f" ({lo:.3f}-{hi:.3f})" if hi - lo > BAND_SHOWN * c.goodput else "")


def _table(cands: list[Candidate]) -> str:
    head = (
        "| deployment | devices | goodput (req/s) | per device | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) "
        "| SLO attainment |\n|---|---|---|---|---|---|---|\n"
    )
    return head + "".join(
        f"| {c.deployment.label} | {c.deployment.devices} | {_goodput(c)} | {c.per_device:.3f} "
        f"| {_figure(c, 'ttft_p50', 1e3, 0)} / {_figure(c, 'ttft_p90', 1e3, 0)} "
        f"| {_figure(c, 'tpot_p50', 1e3, 1)} / {_figure(c, 'tpot_p90', 1e3, 1)} "
        f"| {c.at_workload.attainment * 100:.0f} % |\n"
        for c in cands
    )


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo, args.attainment)
        profile = load_profile(args.profile)
        if args.workload.startswith("poisson:"):
            own, at = distributions_at(parse_distributions(args.workload), args.requests, args.seed)
        else:
            own, at = trace_at(load_trace(args.workload))
    except (ValueError, OSError) as e:  # ProfileError and WorkloadError are ValueErrors
        print(f"vllm-pd plan: {e}", file=sys.stderr)
        return 2
    deployments = enumerate_deployments(args.devices, profile.tps())
    if args.deployments:
        wanted = [w.strip() for w in args.deployments.split(",")]
        unknown = set(wanted) - {d.label for d in deployments}
        if unknown:
            print(
                f"vllm-pd plan: --deployments: {sorted(unknown)[0]!r} is not one of {[d.label for d in deployments]}",
                file=sys.stderr,
            )
            return 2
        deployments = [d for d in deployments if d.label in wanted]
    ranked = search(profile, deployments, at, own, slo, args.seed)
    best = ranked[0]
    noise = profile_noise(profile)
    print(
        f"workload at {own:.3f} req/s; SLO TTFT {slo.ttft * 1e3:.0f} ms, TPOT {slo.tpot * 1e3:.0f} ms, "
        f"{slo.attainment * 100:.0f} % attainment; figures at the workload's rate"
        + (
            f", in brackets where it matters with the profile at the fast and slow end of the speeds it saw of "
            f"itself (+-{noise * 100:.0f} %)"
            if noise > 0
            else ""
        )
        + "\n"
    )
    for line in describe(profile):
        print(line)
    print(_table(ranked))
    tie = near_tie(ranked, profile, at, own, slo, args.seed)
    if tie is not None:
        print(tie.describe() + "\n")
    args.yaml.write_text(proxy_yaml(best.deployment, args.host))
    print(
        f"best: {best.deployment.label} ({best.per_device:.3f} req/s per device)\n"
        f"proxy config: {args.yaml}\none machine: {up_command(best.deployment)}"
    )
    if not up_runs_tp(best.deployment):
        print("(vllm-pd up gives every server one TP size: start the TP servers yourself and use the proxy config)")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "rate": own,
                    "slo": asdict(slo),
                    "noise": noise,
                    "candidates": [
                        {
                            "label": c.deployment.label,
                            "deployment": asdict(c.deployment),
                            "goodput": c.goodput,
                            "per_device": c.per_device,
                            **asdict(c.at_workload),
                            "goodput_band": c.goodput_band,
                            "band": [asdict(s) for s in c.at_workload_band] if c.at_workload_band else None,
                        }
                        for c in ranked
                    ],
                    "near_tie": None
                    if tie is None
                    else {
                        "labels": [tie.best.deployment.label, tie.other.deployment.label],
                        "gap": tie.gap,
                        "binds": tie.binds,
                        "separators": tie.separators,
                    },
                },
                indent=1,
            )
            + "\n"
        )
    return 0
