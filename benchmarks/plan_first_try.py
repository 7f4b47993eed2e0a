"""`vllm-pd profile` and `vllm-pd plan` as a new user runs them, checked on real vLLM CPU servers (issue 28).

    PYTHONPATH=. flock /tmp/vllm-pd-heavy.lock python3 benchmarks/plan_first_try.py --run    # ~25 min
    PYTHONPATH=. python3 benchmarks/plan_first_try.py --report

A model of the user's kind: a vocabulary of 2,048 token ids (below the 4,000 the profiler once drew from)
and 1-4 s prefills of 400-1,500 tokens on one CPU core (`vllm-pd make-model` shape: --layers 16 --hidden
1024 --intermediate 2816). A pair of kv_both vLLM instances serves both deployments (a on core 0, b on core
1, our connector over shm), each behind a proxy of its own: 1P1D (prefill on a, decode on b) and colocated
x2 (every request whole on a or b, least outstanding), as in plan_validate.py.

ONE `vllm-pd profile` is taken before the replays, with the command line a user of the pair would give:
b in full through a relay proxy in front of it alone, the pair's prefill instance a (through its own relay),
the hand-over through the 1P1D proxy, a as b's neighbour. Then `vllm-pd plan` on each trace, and the
replays: bursty traces from benchmarks/plan_bursty_trace.py (bursts of ~6 s at 0.9 req/s between quiet
spells at 0.1 req/s; lognormal prompts 100-1,500 tokens, 16-64 out) with seeds the planner was never run on
before this benchmark, each replayed open loop once per deployment (the deployments' order flips from one
trace to the next). Before each replay a speed probe of b (a lone 512-token prefill and decode step), and
the machine's load: the CPU other processes used during the replay and the load average.

--report simulates each deployment on each trace with that one profile (5 seeds of the decode spread,
pooled) and at both ends of the profile's own band, and prints measured against simulated TTFT and TPOT
p50/p90.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec
from pd_e2e import machine_busy, own_cpu, proxy_process
from plan_bursty_trace import BurstyTrace
from plan_validate import foreign_cpu, replay, speed_probe, wait_quiet

from vllm_pd import cli
from vllm_pd.planner.completion_stream import model_name, served_vocabulary
from vllm_pd.planner.deployment_search import percentile
from vllm_pd.planner.latency_profile import LatencyProfile, load_profile, refit
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.profile_spread import band_profiles
from vllm_pd.planner.workload import TraceRequest, write_trace
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.small_model.cache import ensure_model
from vllm_pd.small_model.spec import ModelSpec

HERE = Path(__file__).resolve().parent
MODEL = ModelSpec(layers=16, hidden=1024, heads=16, kv_heads=4, head_dim=64, intermediate=2816, vocab=2048)
DEPLOYMENTS = {"1p1d": Deployment(1, 1), "colocated2": Deployment(0, 2)}
SEEDS = range(5)  # the simulator's decode-spread draws, pooled
SLO = "ttft=6,tpot=300ms"
# the profile's points, fewer than the defaults: a 1,536-token prefill takes ~4 s here
PROFILE_FLAGS = [
    "--decode-batches",
    "1,2,3,4",
    "--decode-contexts",
    "64,512",
    "--decode-repeats",
    "2",
    "--wake-repeats",
    "4",
    "--join-repeats",
    "3",
    "--max-num-seqs",
    "64",
]


def traces(seeds: list[int], duration: float) -> dict[int, list[TraceRequest]]:
    return {seed: BurstyTrace().sample(duration, seed) for seed in seeds}


def cli_output(argv: list[str]) -> tuple[int, str]:
    """``vllm-pd ARGV`` in this process (its CPU is this benchmark's), its stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = cli.main(argv)
    print(out.getvalue(), flush=True)
    return rc, out.getvalue()


def run(args: argparse.Namespace, by_seed: dict[int, list[TraceRequest]]) -> dict:
    model = str(ensure_model(dataclasses.replace(MODEL, layers=args.layers)))
    cluster = LocalCluster(
        model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector", log_dir=args.log_dir
    )
    procs: list[subprocess.Popen] = []
    out: dict = {"model": model, "replays": {}, "loadavg": []}
    t0 = time.monotonic()
    with cluster.running(900):
        a, b = cluster.instances()
        servers = [s.server for s in cluster.servers]
        urls = {}
        for name, flags in (
            ("1p1d", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"]),
            ("colocated2", ["--decode", a.url, "--decode", b.url]),
            ("relay_b", ["--decode", b.url]),
            ("relay_a", ["--decode", a.url]),
        ):
            proxy, urls[name] = proxy_process(flags)
            procs.append(proxy)
        print(f"pair up in {time.monotonic() - t0:.0f} s; a={a.url} b={b.url}; proxies {urls}", flush=True)
        try:
            served = asyncio.run(_served(b.url))
            profile_argv = [
                "profile",
                b.url,
                "--relay-url",
                urls["relay_b"],
                "--pd-url",
                urls["1p1d"],
                "--neighbour-url",
                a.url,
                "--prefill-relay-url",
                urls["relay_a"],
                "--out",
                str(args.profile),
                *PROFILE_FLAGS,
            ]
            out["profile_command"] = "vllm-pd " + " ".join(profile_argv)
            busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
            rc, text = cli_output(profile_argv)
            out["profile"] = {
                "rc": rc,
                "output": text,
                "seconds": round(time.monotonic() - t1),
                "foreign_cpu_pct": foreign_cpu(busy0, ours0, t1, servers, procs),
                "loadavg": os.getloadavg(),
            }
            if rc != 0:
                raise SystemExit(f"vllm-pd profile failed (rc {rc})")
            out["plans"] = {}
            for seed, trace in by_seed.items():
                path = args.log_dir / f"trace_{seed}.jsonl"
                write_trace(trace, path)
                _, out["plans"][seed] = cli_output(
                    [
                        "plan",
                        "--profile",
                        str(args.profile),
                        "--workload",
                        str(path),
                        "--slo",
                        SLO,
                        "--devices",
                        "2",
                        "--deployments",
                        "1P1D,colocated x2",
                        "--yaml",
                        str(args.log_dir / "plan.yaml"),
                    ]
                )
            for seed, url in enumerate((urls["1p1d"], urls["colocated2"]), start=9000):  # first connections
                asyncio.run(
                    replay(url, served[0], [TraceRequest(0.0, 128, 4), TraceRequest(0.1, 512, 4)], seed, served[1])
                )
            out["replays"] = replays(urls, served, by_seed, servers, procs)
            out["speed_after"] = asyncio.run(speed_probe(urls["relay_b"], served[0], vocab_size=served[1]))
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    return out


async def _served(url: str) -> tuple[str, int]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        model = await model_name(session, url)
        return model, await served_vocabulary(session, url, model)


def replays(
    urls: dict[str, str],
    served: tuple[str, int],
    by_seed: dict[int, list[TraceRequest]],
    servers: list,
    procs: list[subprocess.Popen],
) -> dict[str, dict[str, dict]]:
    model, vocab = served
    out: dict[str, dict[str, dict]] = {}
    names = list(DEPLOYMENTS)
    for i, (seed, trace) in enumerate(by_seed.items()):
        out[str(seed)] = {}
        for name in names if i % 2 == 0 else list(reversed(names)):
            speed = asyncio.run(speed_probe(urls["relay_b"], model, n=2, vocab_size=vocab))
            load0 = os.getloadavg()
            busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
            rows = asyncio.run(replay(urls[name], model, trace, 20000 + 10 * seed + len(out[str(seed)]), vocab))
            foreign = foreign_cpu(busy0, ours0, t1, servers, procs)
            out[str(seed)][name] = {
                # each request's gaps kept: the decode instance's steps can be rebuilt from them
                "requests": [{**r, "gaps_ms": [round(g, 1) for g in r["gaps_ms"]]} for r in rows],
                "speed": speed,
                "foreign_cpu_pct": round(foreign, 1),
                "loadavg": [load0, os.getloadavg()],
                "seconds": round(time.monotonic() - t1),
                "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            }
            print(
                f"  trace {seed} {name}: {len(rows)} requests in {time.monotonic() - t1:.0f} s; speed probe "
                f"{speed}; other processes {foreign:.0f} % of a core; load {os.getloadavg()[0]:.2f}",
                flush=True,
            )
            time.sleep(2.0)
    return out


def simulated(profiles: list[LatencyProfile], d: Deployment, trace: list[TraceRequest]) -> dict[str, list[float]]:
    sims = [r for p in profiles for seed in SEEDS for r in simulate(p, d, trace, seed=seed)]
    return {"ttft": [r.ttft for r in sims], "tpot": [r.tpot for r in sims if r.spec.output_tokens > 1]}


def report(results: dict, profile: LatencyProfile, by_seed: dict[int, list[TraceRequest]]) -> None:
    fast, slow = band_profiles(profile)
    print(
        "| deployment | trace | metric | measured (ms) | simulated (ms) | error | band (ms) | in band |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    within = total = in_band = 0
    for name, d in DEPLOYMENTS.items():
        for seed, trace in by_seed.items():
            run = results["replays"].get(str(seed), {}).get(name)
            if not run:
                continue
            rows = run["requests"]
            meas = {"ttft": [r["ttft"] for r in rows], "tpot": [r["tpot"] for r in rows if r["tokens"] > 1]}
            sim, lo, hi = (simulated([p], d, trace) for p in (profile, fast, slow))
            where = (
                f"seed {seed} ({len(trace)} req; other processes {run['foreign_cpu_pct']:.0f} % of a core, "
                f"load {run['loadavg'][0][0]:.1f}-{run['loadavg'][1][0]:.1f})"
            )
            for metric in ("ttft", "tpot"):
                for q in (50, 90):
                    m = percentile(meas[metric], q / 100) * 1e3
                    s = percentile(sim[metric], q / 100) * 1e3
                    b = sorted(percentile(x[metric], q / 100) * 1e3 for x in (lo, hi))
                    ok, inside = abs(s - m) / m <= 0.15, b[0] <= m <= b[1]
                    within, in_band, total = within + ok, in_band + inside, total + 1
                    print(
                        f"| {d.label} | {where} | {metric.upper()} p{q} | {m:.0f} | {s:.0f} "
                        f"| {(s - m) / m * 100:+.0f} % | {b[0]:.0f}-{b[1]:.0f} | {'yes' if inside else 'no'} |"
                    )
    print(f"\nwithin 15 %: {within} of {total}; measured inside the profile's band: {in_band} of {total}")
    prof = results.get("profile", {})
    print(
        f"profile: {prof.get('seconds')} s, other processes {prof.get('foreign_cpu_pct', 0):.0f} % of a core, "
        f"load {prof.get('loadavg')}"
    )
    speeds = [(seed, name, run["speed"]) for seed, runs in results["replays"].items() for name, run in runs.items()]
    for seed, name, sp in speeds:
        print(f"speed probe before trace {seed} {name}: {sp}")
    print(f"speed probe after the replays: {results.get('speed_after')}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="store_true", help="start the pair, profile it once, plan and replay")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--seeds", default="301,302", help="trace seeds (fresh ones: the planner never saw them)")
    ap.add_argument("--duration", type=float, default=150.0, help="seconds of arrivals per trace")
    ap.add_argument("--layers", type=int, default=MODEL.layers, help="the model's layers (fewer: a quick try)")
    ap.add_argument(
        "--refit",
        action="store_true",
        help="--report from the profile's samples fitted again by this code (a refit, not a validation)",
    )
    ap.add_argument("--profile", type=Path, default=HERE / "plan_first_try_profile.json")
    ap.add_argument("--results", type=Path, default=HERE / "plan_first_try_results.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-plan-first-try"))
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="before the run, wait at most this long for the machine to be quiet (s)",
    )
    args = ap.parse_args()
    args.log_dir.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    by_seed = traces(seeds, args.duration)
    if args.run:
        quiet = wait_quiet(args.quiet_wait)
        full = run(args, by_seed)
        full.update(seeds=seeds, duration=args.duration, busy_before=quiet, layers=args.layers)
        args.results.write_text(json.dumps(full, indent=1) + "\n")
    if args.report:
        results = json.loads(args.results.read_text())
        profile = load_profile(args.profile)
        if args.refit:
            profile = msgspec.structs.replace(profile, instances=[refit(i) for i in profile.instances])
            print(
                f"refit: {args.profile}'s samples fitted again by this code (the replays it is set against are "
                "the ones it was first fitted for: not a validation)"
            )
        report(results, profile, traces(results["seeds"], results["duration"]))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
