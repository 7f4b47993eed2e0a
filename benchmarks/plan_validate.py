"""`vllm-pd plan`'s simulator against real vLLM CPU servers: TTFT/TPOT p50/p90, simulated vs measured.

    PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/plan_validate.py --config 1p1d colocated2
    PYTHONPATH=. python3 benchmarks/plan_validate.py --report

Both configurations use this machine's 2 cores, one per vLLM instance (whole process trees pinned),
the built-in small model (`vllm-pd up`'s default), and our proxy in front:

- 1p1d: a prefill and a decode instance with our connector (shm transport, kv_mode auto). This run
  also writes the profile: `vllm-pd profile` on the decode instance (a kv_consumer serves plain
  requests like any instance) with --pd-url on the proxy for the KV hand-over.
- colocated2: two plain instances behind the proxy (decode-only, least outstanding). This run profiles
  one of them too (benchmarks/plan_profile_colocated2.json): instances differ from launch to launch.

Profiles are measured through a proxy in front of the profiled instance alone (`--relay-url`), so the
proxy's hop and its relaying of every token count as in the deployments.

The same seeded traces are replayed open-loop against both, one per load (LOADS: benchmarks/
plan_trace.jsonl at ~1.1 req/s, plan_trace_3x.jsonl at ~3.6, plan_trace_8x.jsonl at ~10.7): prompts are
unique token ids of the trace's lengths, outputs forced to the trace's lengths (ignore_eos). Each request's
token arrival gaps are kept, and the proxy's request log (which instance served it) goes beside the results.
--report simulates both deployments on each trace with that profile and prints the comparison.
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
# load name: (trace file, requests, rate, seed) - a missing file is sampled from TRACE_SPEC
LOADS = {"1x": ("plan_trace.jsonl", 40, 1.5, 16), "3x": ("plan_trace_3x.jsonl", 100, 3.3, 17),
         "8x": ("plan_trace_8x.jsonl", 100, 9.0, 18)}


async def replay(url: str, model: str, trace: list[TraceRequest]) -> list[dict[str, float]]:
    prompts = UniquePrompts(4000, seed=11)

    async def one(session: aiohttp.ClientSession, req: TraceRequest, t_start: float) -> dict[str, float]:
        await asyncio.sleep(max(0.0, t_start + req.arrival - time.perf_counter()))
        s = await stream_completion(session, url, model, prompts.make(req.input_tokens), req.output_tokens)
        n = len(s.stamps)
        return {"arrival": req.arrival, "input_tokens": req.input_tokens, "ttft": s.ttft,
                "tpot": (s.stamps[-1] - s.stamps[0]) / (n - 1) if n > 1 else 0.0, "tokens": n,
                "gaps_ms": [round((b - a) * 1e3, 2) for a, b in zip(s.stamps, s.stamps[1:])]}

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t_start = time.perf_counter()
        return list(await asyncio.gather(*(one(session, r, t_start) for r in trace)))


def run_config(args: argparse.Namespace, config: str, traces: dict[str, list[TraceRequest]]) -> dict:
    model = str(ensure_default_model())
    both = config == "1p1d"
    cluster = LocalCluster(model=model, n_prefill=1 if both else 0, n_decode=1 if both else 2, transport="shm",
                           connector="PDConnector" if both else None, log_dir=args.log_dir)
    procs: list[subprocess.Popen] = []
    out: dict = {}
    try:
        t0 = time.monotonic()
        cluster.start()
        cluster.wait_healthy(600)
        inst = cluster.instances()
        flags = [f for i in inst for f in (f"--{i.role}", i.url + (f"@{i.kv_endpoint}" if i.kv_endpoint else ""))]
        request_log = args.log_dir / f"requests-{config}.jsonl"
        request_log.unlink(missing_ok=True)
        proxy, url = proxy_process(flags + ["--request-log", str(request_log)])
        procs.append(proxy)
        servers = [s.server for s in cluster.servers]
        print(f"{config}: up in {time.monotonic() - t0:.0f} s; proxy {url}; "
              f"instances {[(i.role, i.url) for i in inst]}", flush=True)
        # profile a decode instance through a proxy in front of it alone (its hop and token relaying count);
        # 1p1d also measures the KV hand-over through the pair's proxy
        decode_url = next(i.url for i in inst if i.role == "decode")
        relay, relay_url = proxy_process(["--decode", decode_url])
        procs.append(relay)
        path = args.profile if both else own_profile_path(args.profile, config)
        check = {"before profiling": asyncio.run(decode_check(url, decode_url, model))}
        busy0, ours0, t_p = machine_busy(), own_cpu(servers, procs), time.monotonic()
        name, prof = asyncio.run(InstanceProfiler(decode_url, ProfilePlan(repeats=3), pd_url=url if both else None,
                                                  relay_url=relay_url).run(1))
        out["profile_foreign_cpu_pct"] = foreign_cpu(busy0, ours0, t_p, servers, procs)
        source = f"{decode_url} (relay: {relay_url}" + (f", pd: {url})" if both else ")")
        save_profile(LatencyProfile(name, [prof], source=source), path)
        print(f"  profile written to {path}; other processes {out['profile_foreign_cpu_pct']:.0f} % of a core "
              f"meanwhile", flush=True)
        # warm-up: the proxy's and connector's first connections stay out of the figures
        asyncio.run(replay(url, model, [TraceRequest(0.0, 128, 4), TraceRequest(0.1, 512, 4)]))
        check["after profiling"] = asyncio.run(decode_check(url, decode_url, model))
        for load, trace in traces.items():
            busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
            rows = asyncio.run(replay(url, model, trace))
            foreign = foreign_cpu(busy0, ours0, t1, servers, procs)
            out[load] = {"requests": rows, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         "foreign_cpu_pct": foreign, "loadavg": os.getloadavg()[0]}
            print(f"  {load}: replayed {len(rows)} requests in {time.monotonic() - t1:.0f} s; other processes "
                  f"{foreign:.0f} % of a core", flush=True)
        check["after the replays"] = asyncio.run(decode_check(url, decode_url, model))
        out["decode_check"] = check
        print(f"  decode check (ms/step, batch 1, median of 6): {check}", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        cluster.stop()
    out["instances"] = {i.url: i.role for i in inst}
    if request_log.exists():
        out["proxy_log"] = [slim(json.loads(line)) for line in request_log.read_text().splitlines() if line.strip()]
    return out


async def decode_check(proxy_url: str, instance_url: str, model: str) -> dict[str, float]:
    """Lone requests' steady decode step, straight to a decode instance and through the proxy: the same
    numbers for both configurations tell apart the instance kind and the path."""
    prompts = UniquePrompts(4000, seed=12)
    out = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for name, url in (("direct", instance_url), ("proxy", proxy_url)):
            steps = []
            for _ in range(6):
                s = await stream_completion(session, url, model, prompts.make(512), 24)
                steps.append((s.stamps[-1] - s.stamps[12]) / (len(s.stamps) - 13) * 1e3)
            out[name] = round(sorted(steps)[3], 2)
    return out


def foreign_cpu(busy0: float, ours0: float, t0: float, servers: list, procs: list[subprocess.Popen]) -> float:
    """% of a core that processes outside this benchmark used since t0 (the e2e lock stops only lock-takers)."""
    return (machine_busy() - busy0 - (own_cpu(servers, procs) - ours0)) / (time.monotonic() - t0) * 100



PROXY_LOG_KEYS = ("ts", "decode_instance", "prefill_s", "decode_first_token_s", "prefill_to_decode_gap_s", "ttft_s",
                  "tpot_s", "events", "outcome")


def slim(line: dict) -> dict:
    """A proxy request-log line with what the analysis reads (ids and trace ids dropped)."""
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in line.items() if k in PROXY_LOG_KEYS}


def wait_quiet(limit_s: float, share: float = 0.1) -> float:
    """Wait (at most ``limit_s``) until the machine uses < ``share`` of a core over 5 s; returns the last share."""
    deadline = time.monotonic() + limit_s
    while True:
        busy0 = machine_busy()
        time.sleep(5)
        used = (machine_busy() - busy0) / 5
        if used < share or time.monotonic() > deadline:
            print(f"machine busy {used * 100:.0f} % of a core before starting", flush=True)
            return used


def own_profile_path(profile: Path, config: str) -> Path:
    """Where a configuration other than 1p1d keeps the profile of its own instance."""
    return profile.with_name(f"{profile.stem}_{config}{profile.suffix}")


def report(results: dict, profile: LatencyProfile, traces: dict[str, list[TraceRequest]],
           own: dict[str, LatencyProfile]) -> None:
    """One table per profile choice: 1p1d's profile for every deployment (as `vllm-pd plan` is used),
    then each deployment with the profile of its own instances (the instances differ from launch to launch)."""
    for title, pick in (("one profile (1P1D's decode instance) for both", lambda name: profile),
                        ("each deployment with its own instances' profile", lambda name: own.get(name, profile))):
        print(f"\n{title}:\n")
        report_table(results, pick, traces)


def report_table(results: dict, pick, traces: dict[str, list[TraceRequest]]) -> None:
    slo = Slo(1e9, 1e9)
    print("| deployment | load | metric | simulated (ms) | measured (ms) | error |\n|---|---|---|---|---|---|")
    for name, d in DEPLOYMENTS.items():
        for load, trace in traces.items():
            run = results.get(name, {}).get(load)
            if not run:
                continue
            sim = summarise(simulate(pick(name), d, trace), slo)
            rows = run["requests"]
            meas = {"ttft": [r["ttft"] for r in rows], "tpot": [r["tpot"] for r in rows if r["tokens"] > 1]}
            rate = (len(trace) - 1) / (trace[-1].arrival - trace[0].arrival)
            for metric in ("ttft", "tpot"):
                for q in (50, 90):
                    s, m = getattr(sim, f"{metric}_p{q}") * 1e3, percentile(meas[metric], q / 100) * 1e3
                    print(f"| {d.label} | {load} ({rate:.1f} req/s; {run['when']}, other processes "
                          f"{run['foreign_cpu_pct']:.0f} %) | {metric.upper()} p{q} | {s:.1f} | {m:.1f} "
                          f"| {(s - m) / m * 100:+.0f} % |")


def load_traces(names: list[str]) -> dict[str, list[TraceRequest]]:
    out = {}
    for name in names:
        file, n, rate, seed = LOADS[name]
        path = HERE / file
        if not path.exists():
            write_trace(parse_distributions(TRACE_SPEC).sample(n, seed=seed, rate=rate), path)
        out[name] = load_trace(path)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", nargs="+", choices=sorted(DEPLOYMENTS), default=[],
                    help="run these, one after the other (1p1d first: it writes the profile)")
    ap.add_argument("--load", nargs="+", choices=sorted(LOADS), default=sorted(LOADS),
                    help="replay these traces on each configuration (default: all)")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--profile", type=Path, default=HERE / "plan_profile.json")
    ap.add_argument("--results", type=Path, default=HERE / "plan_validate_results.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-plan-logs"))
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before the runs, wait at most this long for the machine to be quiet (s)")
    args = ap.parse_args()
    traces = load_traces(args.load)
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.config:
        wait_quiet(args.quiet_wait)
    for config in args.config:
        results[config] = run_config(args, config, traces)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    if args.report:
        own = {c: load_profile(own_profile_path(args.profile, c)) for c in DEPLOYMENTS
               if own_profile_path(args.profile, c).exists() and c != "1p1d"}
        report(results, load_profile(args.profile), traces, own)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
