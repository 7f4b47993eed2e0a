"""`vllm-pd plan`'s simulator against real vLLM CPU servers: TTFT/TPOT p50/p90, simulated vs measured.

    PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/plan_validate.py --config 1p1d colocated2
    PYTHONPATH=. python3 benchmarks/plan_validate.py --report

Both configurations use this machine's 2 cores, one per vLLM instance (whole process trees pinned),
the built-in small model (`vllm-pd up`'s default), and our proxy in front:

- 1p1d: a prefill and a decode instance with our connector (shm transport, kv_mode auto). This run
  also writes the profile: `vllm-pd profile` on the decode instance (a kv_consumer serves plain
  requests like any instance) with --pd-url on the proxy for the KV hand-over.
- colocated2: two plain instances behind the proxy (decode-only, least outstanding).

The same seeded trace (benchmarks/plan_trace.jsonl) is replayed open-loop against both: prompts are
unique token ids of the trace's lengths, outputs forced to the trace's lengths (ignore_eos).
--report simulates both deployments on that trace with that profile and prints the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from pd_e2e import machine_busy, own_cpu, proxy_process
from vllm_pd.planner.deployment_search import Slo, percentile, summarise
from vllm_pd.planner.instance_profiler import InstanceProfiler, ProfilePlan, UniquePrompts, stream_completion
from vllm_pd.planner.latency_profile import LatencyProfile, load_profile, save_profile
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.workload import TraceRequest, load_trace, parse_distributions, write_trace
from vllm_pd.router.local_cluster import LocalCluster
from vllm_pd.small_model import ensure_default_model

HERE = Path(__file__).resolve().parent
DEPLOYMENTS = {"1p1d": Deployment(1, 1), "colocated2": Deployment(0, 2)}
TRACE_SPEC = "poisson:1.5,in=uniform:64:1024,out=16"


async def replay(url: str, model: str, trace: list[TraceRequest]) -> list[dict[str, float]]:
    prompts = UniquePrompts(4000, seed=11)

    async def one(session: aiohttp.ClientSession, req: TraceRequest, t_start: float) -> dict[str, float]:
        await asyncio.sleep(max(0.0, t_start + req.arrival - time.perf_counter()))
        s = await stream_completion(session, url, model, prompts.make(req.input_tokens), req.output_tokens)
        n = len(s.stamps)
        return {"ttft": s.ttft, "tpot": (s.stamps[-1] - s.stamps[0]) / (n - 1) if n > 1 else 0.0, "tokens": n}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t_start = time.perf_counter()
        return list(await asyncio.gather(*(one(session, r, t_start) for r in trace)))


def run_config(args: argparse.Namespace, config: str, trace: list[TraceRequest]) -> dict:
    model = str(ensure_default_model())
    both = config == "1p1d"
    cluster = LocalCluster(model=model, n_prefill=1 if both else 0, n_decode=1 if both else 2, transport="shm",
                           connector="PDConnector" if both else None, log_dir=args.log_dir)
    procs: list[subprocess.Popen] = []
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.wait_healthy(600)
        inst = cluster.instances()
        flags = [f for i in inst for f in (f"--{i.role}", i.url + (f"@{i.kv_endpoint}" if i.kv_endpoint else ""))]
        proxy, url = proxy_process(flags)
        procs.append(proxy)
        servers = [s.server for s in cluster.servers]
        print(f"{config}: up in {time.monotonic() - t0:.0f} s; proxy {url}", flush=True)
        if both:
            decode_url = next(i.url for i in inst if i.role == "decode")
            busy0, ours0, t_p = machine_busy(), own_cpu(servers, procs), time.monotonic()
            name, prof = asyncio.run(InstanceProfiler(decode_url, ProfilePlan(repeats=3), pd_url=url).run(1))
            profile_foreign = foreign_cpu(busy0, ours0, t_p, servers, procs)
            save_profile(LatencyProfile(name, [prof], source=f"{decode_url} (pd: {url})"), args.profile)
            print(f"  profile written to {args.profile}", flush=True)
        # warm-up: the proxy's and connector's first connections stay out of the figures
        asyncio.run(replay(url, model, [TraceRequest(0.0, 128, 4), TraceRequest(0.1, 512, 4)]))
        busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
        rows = asyncio.run(replay(url, model, trace))
        foreign = foreign_cpu(busy0, ours0, t1, servers, procs)
        print(f"  replayed {len(rows)} requests in {time.monotonic() - t1:.0f} s; other processes "
              f"{foreign:.0f} % of a core", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        cluster.stop()
    out = {"requests": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "foreign_cpu_pct": foreign}
    if both:
        out["profile_foreign_cpu_pct"] = profile_foreign
        print(f"  while profiling, other processes used {profile_foreign:.0f} % of a core", flush=True)
    return out


def foreign_cpu(busy0: float, ours0: float, t0: float, servers: list, procs: list[subprocess.Popen]) -> float:
    """% of a core that processes outside this benchmark used since t0 (the e2e lock stops only lock-takers)."""
    return (machine_busy() - busy0 - (own_cpu(servers, procs) - ours0)) / (time.monotonic() - t0) * 100



def report(results: dict, profile: LatencyProfile, trace: list[TraceRequest]) -> None:
    slo = Slo(1e9, 1e9)
    print("| deployment | metric | simulated (ms) | measured (ms) | error |\n|---|---|---|---|---|")
    for name, d in DEPLOYMENTS.items():
        if name not in results:
            continue
        sim = summarise(simulate(profile, d, trace), slo)
        rows = results[name]["requests"]
        meas = {"ttft": [r["ttft"] for r in rows], "tpot": [r["tpot"] for r in rows if r["tokens"] > 1]}
        for metric in ("ttft", "tpot"):
            for q in (50, 90):
                s, m = getattr(sim, f"{metric}_p{q}") * 1e3, percentile(meas[metric], q / 100) * 1e3
                foreign = results[name].get("foreign_cpu_pct", float("nan"))
                print(f"| {d.label} ({results[name]['when']}, other processes {foreign:.0f} %) "
                      f"| {metric.upper()} p{q} | {s:.1f} | {m:.1f} | {(s - m) / m * 100:+.0f} % |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", choices=sorted(DEPLOYMENTS), default=[],
                    help="run these, one after the other (1p1d first: it writes the profile)")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--trace", type=Path, default=HERE / "plan_trace.jsonl")
    ap.add_argument("--profile", type=Path, default=HERE / "plan_profile.json")
    ap.add_argument("--results", type=Path, default=HERE / "plan_validate_results.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-plan-logs"))
    args = ap.parse_args()
    if not args.trace.exists():
        write_trace(parse_distributions(TRACE_SPEC).sample(40, seed=16), args.trace)
    trace = load_trace(args.trace)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    for config in args.config:
        results[config] = run_config(args, config, trace)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    if args.report:
        report(results, load_profile(args.profile), trace)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
