"""`vllm-pd plan`'s simulator against real vLLM CPU servers: TTFT/TPOT p50/p90, simulated vs measured.

    PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/plan_validate.py --run
    PYTHONPATH=. python3 benchmarks/plan_validate.py --report

One pair of kv_both vLLM instances (the built-in small model, `vllm-pd up`'s default; a on core 0, b on
core 1, whole process trees pinned; our connector over shm) serves both deployments, each behind a proxy
of its own:

- 1P1D: prefill on a, decode on b (push, layer-wise).
- colocated x2: every request whole on a or b (the proxy's decode-only path, least outstanding; the
  connector is idle for requests that carry no KV parameters).

Why one pair: instances relaunched step 10-20 % faster or slower, and this machine's speed drifts by
more than 15 % within minutes (session 9's runs); with one pair and the deployments taking turns,
both deployments are measured on the same instances in the same minutes.

`vllm-pd profile` measures b through a proxy in front of b alone (`--relay-url`: the proxy's hop and its
relaying of every token count, as in the deployments), the KV hand-over through the 1P1D proxy, and
how a and b slow each other (`--neighbour-url` a). It is taken before the replays (the figure a user of
`vllm-pd plan` has) and again after them (benchmarks/plan_profile_end.json), bracketing the drift.

Seeded traces (LOADS: benchmarks/plan_trace.jsonl at ~1.1 req/s, plan_trace_3x.jsonl at ~3.6,
plan_trace_8x.jsonl at ~10.7) are replayed open-loop, ``--repeats`` times per deployment, the
deployments alternating: prompts are unique token ids of the trace's lengths, outputs forced to the
trace's lengths (ignore_eos). Each request's token gaps and both proxies' request logs are kept in
--results. --report simulates both deployments on each trace (5 seeds of the decode spread, pooled, as
the repeats are) and prints the comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgspec

from pd_e2e import machine_busy, own_cpu, proxy_process
from vllm_pd.planner.deployment_search import percentile
from vllm_pd.planner.instance_profiler import InstanceProfiler, ProfilePlan, UniquePrompts, stream_completion
from vllm_pd.planner.latency_profile import LatencyProfile, Poly, load_profile, save_profile
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


async def replay(url: str, model: str, trace: list[TraceRequest], seed: int) -> list[dict[str, float]]:
    """Open loop; every replay needs a ``seed`` of its own: the pair's prefix caches outlive a replay."""
    prompts = UniquePrompts(4000, seed=seed)

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


def run_pair(args: argparse.Namespace, traces: dict[str, list[TraceRequest]]) -> dict:
    """One pair of kv_both instances serves both deployments, each behind a proxy of its own; the replays
    alternate between them, so the same instances and the same minutes of this machine's drift are in both."""
    model = str(ensure_default_model())
    cluster = LocalCluster(model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm",
                           connector="PDConnector", log_dir=args.log_dir)
    procs: list[subprocess.Popen] = []
    out: dict = {"loads": {}}
    t0 = time.monotonic()
    with cluster.running(600):
        a, b = cluster.instances()
        servers = [s.server for s in cluster.servers]
        urls, logs = {}, {}
        for name, flags in (("1p1d", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"]),
                            ("colocated2", ["--decode", a.url, "--decode", b.url])):
            logs[name] = args.log_dir / f"requests-{name}.jsonl"
            logs[name].unlink(missing_ok=True)
            proxy, urls[name] = proxy_process(flags + ["--request-log", str(logs[name])])
            procs.append(proxy)
        # the profiled instance, b, through a proxy in front of it alone (its hop and token relaying count);
        # the KV hand-over through the pair's PD proxy
        relay, relay_url = proxy_process(["--decode", b.url])
        procs.append(relay)
        print(f"pair up in {time.monotonic() - t0:.0f} s; proxies {urls}; instances a={a.url} b={b.url}", flush=True)
        try:
            check = {"before profiling": asyncio.run(decode_check(urls["1p1d"], b.url, model))}
            out["profile_foreign_cpu_pct"] = profile_to(args.profile, b.url, urls["1p1d"], relay_url, a.url,
                                                        servers, procs)
            # warm-up: the proxies' and connector's first connections stay out of the figures
            for seed, url in enumerate(urls.values(), start=1000):
                asyncio.run(replay(url, model, [TraceRequest(0.0, 128, 4), TraceRequest(0.1, 512, 4)], seed))
            check["after profiling"] = asyncio.run(decode_check(urls["1p1d"], b.url, model))
            out["speed_at_profile"] = asyncio.run(speed_probe(relay_url, model))
            out["loads"] = replay_rounds(urls, relay_url, model, traces, args.repeats, servers, procs)
            check["after the replays"] = asyncio.run(decode_check(urls["1p1d"], b.url, model))
            out["decode_check"] = check
            print(f"  decode check (ms/step, batch 1, median of 6): {check}", flush=True)
            if args.profile_end:
                out["profile_end_foreign_cpu_pct"] = profile_to(end_profile_path(args.profile), b.url, urls["1p1d"],
                                                                relay_url, a.url, servers, procs)
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    out["instances"] = {"a (prefill in 1P1D)": a.url, "b (decode in 1P1D, profiled)": b.url}
    out["proxy_log"] = {name: [slim(json.loads(line)) for line in log.read_text().splitlines() if line.strip()]
                        for name, log in logs.items() if log.exists()}
    return out


def profile_to(path: Path, url: str, pd_url: str, relay_url: str, neighbour_url: str, servers: list,
               procs: list[subprocess.Popen]) -> float:
    """`vllm-pd profile` of ``url`` written to ``path``; returns the CPU share other processes took meanwhile."""
    busy0, ours0, t0 = machine_busy(), own_cpu(servers, procs), time.monotonic()
    profiler = InstanceProfiler(url, ProfilePlan(repeats=3), pd_url=pd_url, relay_url=relay_url,
                                neighbour_url=neighbour_url)
    name, prof = asyncio.run(profiler.run(1))
    foreign = foreign_cpu(busy0, ours0, t0, servers, procs)
    save_profile(LatencyProfile(name, [prof], source=f"{url} (relay: {relay_url}, pd: {pd_url}, neighbour: "
                                                     f"{neighbour_url})"), path)
    print(f"  profile written to {path} in {time.monotonic() - t0:.0f} s; other processes {foreign:.0f} % of a "
          f"core meanwhile", flush=True)
    return foreign


def replay_rounds(urls: dict[str, str], relay_url: str, model: str, traces: dict[str, list[TraceRequest]],
                  repeats: int, servers: list, procs: list[subprocess.Popen]) -> dict[str, dict[str, list[dict]]]:
    """``repeats`` rounds; each replays every trace once per deployment (the deployments' order flips every
    round), so the machine's drift is spread over every load and deployment alike. Before each replay a
    speed probe of the profiled instance."""
    runs: dict[str, dict[str, list[dict]]] = {load: {name: [] for name in urls} for load in traces}
    seeds = itertools.count(2000)
    for i in range(repeats):
        for load, trace in traces.items():
            for name in (list(urls) if i % 2 == 0 else list(reversed(urls))):
                speed = asyncio.run(speed_probe(relay_url, model))
                busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
                rows = asyncio.run(replay(urls[name], model, trace, next(seeds)))
                foreign = foreign_cpu(busy0, ours0, t1, servers, procs)
                runs[load][name].append({"requests": rows, "speed": speed, "foreign_cpu_pct": foreign,
                                         "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                                         "loadavg": os.getloadavg()[0]})
                print(f"  round {i + 1} {load} {name}: {len(rows)} requests in {time.monotonic() - t1:.0f} s; "
                      f"speed probe {speed}; other processes {foreign:.0f} % of a core", flush=True)
                time.sleep(1.0)  # let the last streams' teardown settle before the next replay
    return runs


async def speed_probe(url: str, model: str, n: int = 3) -> dict[str, float]:
    """The machine's speed now: a lone 512-token prefill (TTFT) and a lone request's steady decode step,
    medians of ``n``, back to back (ms)."""
    prompts = UniquePrompts(4000, seed=next(CHECK_SEEDS))
    prefill, decode = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(n):
            s = await stream_completion(session, url, model, prompts.make(512), 24)
            prefill.append(s.ttft * 1e3)
            decode.append((s.stamps[-1] - s.stamps[12]) / (len(s.stamps) - 13) * 1e3)
    return {"prefill_ms": round(statistics.median(prefill), 2), "decode_ms": round(statistics.median(decode), 3)}


async def decode_check(proxy_url: str, instance_url: str, model: str) -> dict[str, float]:
    """Lone requests' steady decode step, straight to a decode instance and through the proxy: the same
    numbers for both configurations tell apart the instance kind and the path."""
    prompts = UniquePrompts(4000, seed=next(CHECK_SEEDS))  # prompts of their own: no prefix-cache hit
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


def end_profile_path(profile: Path) -> Path:
    """Where the profile taken again after the replays goes (it brackets the machine's drift)."""
    return profile.with_name(f"{profile.stem}_end{profile.suffix}")


CHECK_SEEDS = itertools.count(100)
SEEDS = range(5)  # the simulator's decode-spread draws: every seed's requests are pooled, as the repeats are


def simulated(profile: LatencyProfile, deployment: Deployment, trace: list[TraceRequest]) -> dict[str, list[float]]:
    sims = [r for seed in SEEDS for r in simulate(profile, deployment, trace, seed=seed)]
    return {"ttft": [r.ttft for r in sims], "tpot": [r.tpot for r in sims if r.spec.output_tokens > 1]}


def at_speed(profile: LatencyProfile, speed: dict[str, float], reference: dict[str, float]) -> LatencyProfile:
    """``profile`` scaled to the machine's speed when ``speed`` was probed (``reference``: when profiled):
    prefill by the lone prefill's ratio, decode and the hand-over by the lone decode step's."""
    fp, fd = speed["prefill_ms"] / reference["prefill_ms"], speed["decode_ms"] / reference["decode_ms"]

    def scaled(p: Poly, f: float) -> Poly:
        return Poly(p.a * f, p.b * f, p.c * f, p.d * f)

    return msgspec.structs.replace(profile, instances=[
        msgspec.structs.replace(i, prefill=scaled(i.prefill, fp), decode=scaled(i.decode, fd), kv=scaled(i.kv, fd))
        for i in profile.instances])


def simulated_at_speed(profile: LatencyProfile, deployment: Deployment, trace: list[TraceRequest], runs: list[dict],
                       reference: dict[str, float]) -> dict[str, list[float]]:
    """Each replay simulated with the profile scaled to the speed probed just before it, pooled."""
    out: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for run in runs:
        for metric, values in simulated(at_speed(profile, run["speed"], reference), deployment, trace).items():
            out[metric] += values
    return out


def measured(runs: list[dict]) -> dict[str, list[float]]:
    rows = [r for run in runs for r in run["requests"]]
    return {"ttft": [r["ttft"] for r in rows], "tpot": [r["tpot"] for r in rows if r["tokens"] > 1]}


def report(results: dict, profile: LatencyProfile, end: LatencyProfile | None,
           traces: dict[str, list[TraceRequest]]) -> None:
    """Simulated vs measured (every repeat's requests pooled) per deployment, load and metric: with the
    profile as taken before the replays (what a user of `vllm-pd plan` has), and with it scaled to the
    speed probed before each replay (the model without the machine's drift)."""
    reference = results["speed_at_profile"]
    print("| deployment | load | metric | measured (ms) | simulated (ms) | error | simulated at the probed speed (ms) "
          "| error |\n|---|---|---|---|---|---|---|---|")
    within = {"profile": 0, "speed": 0}
    total = 0
    for name, d in DEPLOYMENTS.items():
        for load, trace in traces.items():
            runs = results["loads"].get(load, {}).get(name)
            if not runs:
                continue
            meas, sim = measured(runs), simulated(profile, d, trace)
            adjusted = simulated_at_speed(profile, d, trace, runs, reference)
            rate = (len(trace) - 1) / (trace[-1].arrival - trace[0].arrival)
            foreign = max(run["foreign_cpu_pct"] for run in runs)
            where = f"{load} ({rate:.1f} req/s, {len(runs)} x {len(trace)}; other processes <= {foreign:.0f} %)"
            for metric in ("ttft", "tpot"):
                for q in (50, 90):
                    m = percentile(meas[metric], q / 100) * 1e3
                    s, a = (percentile(v[metric], q / 100) * 1e3 for v in (sim, adjusted))
                    es, ea = (s - m) / m * 100, (a - m) / m * 100
                    within["profile"] += abs(es) <= 15
                    within["speed"] += abs(ea) <= 15
                    total += 1
                    print(f"| {d.label} | {where} | {metric.upper()} p{q} | {m:.1f} | {s:.1f} | {es:+.0f} % | {a:.1f} "
                          f"| {ea:+.0f} % |")
    print(f"\nwithin 15 %: {within['profile']} of {total} with the profile as taken, {within['speed']} of {total} "
          f"at the probed speed")
    speeds = [run["speed"] for d in results["loads"].values() for runs in d.values() for run in runs]
    for key in ("prefill_ms", "decode_ms"):
        xs = sorted(sp[key] for sp in speeds)
        print(f"speed probe {key}: at profiling {reference[key]}, before the replays {xs[0]}-{xs[-1]} "
              f"(median {xs[len(xs) // 2]})")
    if end is not None:
        start_i, end_i = profile.instances[0], end.instances[0]
        print(f"profile before / after the replays: a lone decode step {start_i.decode_ms(1, 512):.2f} / "
              f"{end_i.decode_ms(1, 512):.2f} ms, a lone 512-token prefill {start_i.prefill_ms(512):.1f} / "
              f"{end_i.prefill_ms(512):.1f} ms; neighbour factors {start_i.beside_prefill} / {end_i.beside_prefill} "
              f"(decode beside a prefill), {start_i.beside_decode} / {end_i.beside_decode} (prefill beside decode)")


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
    ap.add_argument("--run", action="store_true", help="start the pair, profile it and replay the traces")
    ap.add_argument("--load", nargs="+", choices=sorted(LOADS), default=sorted(LOADS),
                    help="replay these traces (default: all)")
    ap.add_argument("--repeats", type=int, default=3, help="replays of each trace per deployment (default 3)")
    ap.add_argument("--no-profile-end", dest="profile_end", action="store_false",
                    help="skip profiling again after the replays")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--profile", type=Path, default=HERE / "plan_profile.json")
    ap.add_argument("--results", type=Path, default=HERE / "plan_validate_results.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-plan-logs"))
    ap.add_argument("--quiet-wait", type=float, default=60.0,
                    help="before the run, wait at most this long for the machine to be quiet (s)")
    args = ap.parse_args()
    traces = load_traces(args.load)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.run:
        wait_quiet(args.quiet_wait)
        args.results.write_text(json.dumps(run_pair(args, traces), indent=1) + "\n")
    if args.report:
        end = end_profile_path(args.profile)
        report(json.loads(args.results.read_text()), load_profile(args.profile),
               load_profile(end) if end.exists() else None, traces)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
