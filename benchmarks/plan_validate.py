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
how a and b slow each other (`--neighbour-url` a). It is taken in slices: before the replays
(benchmarks/plan_profile.json: the profile a user of `vllm-pd plan` has) and after each round; every
slice's samples pooled (as `vllm-pd profile --merge` pools them) are the profile over the run
(benchmarks/plan_profile_run.json), the machine's drift over the run averaged into one fit; every slice is
also kept as a profile of its own (benchmarks/plan_profile_slices.json), and their simulations pooled keep
that drift (each slice is the machine at its minutes, as each round's replays are).

Seeded traces (LOADS: benchmarks/plan_trace.jsonl at ~1.1 req/s, plan_trace_3x.jsonl at ~3.6,
plan_trace_8x.jsonl at ~10.7) are replayed open-loop in ``--repeats`` rounds; each round replays every
trace once per deployment (their order flips every round), so drift lands on every load and deployment
alike. Prompts are unique token ids of the trace's lengths (a seed per replay: the prefix caches outlive
a replay), outputs forced to the trace's lengths (ignore_eos). A speed probe (a lone prefill and a lone
decode step of b) runs before each replay. --results keeps each request's TTFT and TPOT (token gaps and
the proxies' request logs: --log-dir's plan_validate_full.json). --report simulates both deployments on
each trace (5 seeds of the decode spread, pooled, as the rounds are) with each profile and prints the
comparison.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import aiohttp
import msgspec
from pd_e2e import machine_busy, own_cpu, proxy_process

from vllm_pd.planner.deployment_search import percentile
from vllm_pd.planner.instance_profiler import InstanceProfiler, ProfilePlan, UniquePrompts, stream_completion
from vllm_pd.planner.latency_profile import InstanceProfile, LatencyProfile, load_profile, merge_samples, save_profile
from vllm_pd.planner.pd_simulator import Deployment, simulate
from vllm_pd.planner.workload import TraceRequest, load_trace, parse_distributions, write_trace
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.small_model import ensure_default_model

HERE = Path(__file__).resolve().parent
DEPLOYMENTS = {"1p1d": Deployment(1, 1), "colocated2": Deployment(0, 2)}
TRACE_SPEC = "poisson:1.5,in=uniform:64:1024,out=16"
# load name: (trace file, requests, rate, seed) - a missing file is sampled from TRACE_SPEC
LOADS = {
    "1x": ("plan_trace.jsonl", 40, 1.5, 16),
    "3x": ("plan_trace_3x.jsonl", 100, 3.3, 17),
    "8x": ("plan_trace_8x.jsonl", 100, 9.0, 18),
}


async def replay(
    url: str, model: str, trace: list[TraceRequest], seed: int, vocab_size: int = 4000
) -> list[dict[str, float]]:
    """Open loop; every replay needs a ``seed`` of its own: the pair's prefix caches outlive a replay. Prompt ids
    are drawn below ``vocab_size`` (the served model's: the default model's is 4096)."""
    prompts = UniquePrompts(vocab_size, seed=seed)

    async def one(session: aiohttp.ClientSession, req: TraceRequest, t_start: float) -> dict[str, float]:
        await asyncio.sleep(max(0.0, t_start + req.arrival - time.perf_counter()))
        s = await stream_completion(session, url, model, prompts.make(req.input_tokens), req.output_tokens)
        n = len(s.stamps)
        return {
            "arrival": req.arrival,
            "input_tokens": req.input_tokens,
            "ttft": s.ttft,
            "tpot": (s.stamps[-1] - s.stamps[0]) / (n - 1) if n > 1 else 0.0,
            "tokens": n,
            "gaps_ms": [round((b - a) * 1e3, 2) for a, b in zip(s.stamps, s.stamps[1:])],
        }

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        t_start = time.perf_counter()
        return list(await asyncio.gather(*(one(session, r, t_start) for r in trace)))


def run_pair(args: argparse.Namespace, traces: dict[str, list[TraceRequest]]) -> dict:
    """One pair of kv_both instances serves both deployments, each behind a proxy of its own; the replays
    alternate between them, so the same instances and the same minutes of this machine's drift are in both."""
    model = str(ensure_default_model())
    cluster = LocalCluster(
        model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector", log_dir=args.log_dir
    )
    procs: list[subprocess.Popen] = []
    out: dict = {"loads": {}}
    t0 = time.monotonic()
    with cluster.running(600):
        a, b = cluster.instances()
        servers = [s.server for s in cluster.servers]
        urls, logs = {}, {}
        for name, flags in (
            ("1p1d", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"]),
            ("colocated2", ["--decode", a.url, "--decode", b.url]),
        ):
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
            profile = Profiling(b.url, urls["1p1d"], relay_url, a.url, servers, procs)
            first = profile.slice("before the replays")
            save_profile(LatencyProfile(profile.model, [first], source=profile.source), args.profile)
            # warm-up: the proxies' and connector's first connections stay out of the figures
            for seed, url in enumerate(urls.values(), start=1000):
                asyncio.run(replay(url, model, [TraceRequest(0.0, 128, 4), TraceRequest(0.1, 512, 4)], seed))
            out["speed_at_profile"] = asyncio.run(speed_probe(relay_url, model))
            out["loads"] = replay_rounds(
                urls,
                relay_url,
                model,
                traces,
                args.repeats,
                servers,
                procs,
                lambda i: profile.slice(f"after round {i + 1}"),
            )
            over_run = functools.reduce(merge_samples, profile.slices)
            save_profile(
                LatencyProfile(profile.model, [over_run], source=profile.source), run_profile_path(args.profile)
            )
            slices = [LatencyProfile(profile.model, [inst], source=profile.source) for inst in profile.slices]
            slices_path(args.profile).write_bytes(msgspec.json.encode(slices))
            out["profile_slices"] = profile.summaries
        finally:
            for p in procs:
                p.terminate()
                p.wait(10)
    out["instances"] = {"a (prefill in 1P1D)": a.url, "b (decode in 1P1D, profiled)": b.url}
    out["proxy_log"] = {
        name: [slim(json.loads(line)) for line in log.read_text().splitlines() if line.strip()]
        for name, log in logs.items()
        if log.exists()
    }
    return out


class Profiling:
    """`vllm-pd profile` of the pair's instance b, taken in slices: before the replays and after each round."""

    def __init__(
        self, url: str, pd_url: str, relay_url: str, neighbour_url: str, servers: list, procs: list[subprocess.Popen]
    ) -> None:
        self.profiler = InstanceProfiler(
            url, ProfilePlan(repeats=3), pd_url=pd_url, relay_url=relay_url, neighbour_url=neighbour_url
        )
        self.source = f"{url} (relay: {relay_url}, pd: {pd_url}, neighbour: {neighbour_url})"
        self.servers, self.procs = servers, procs
        self.model = ""
        self.slices: list[InstanceProfile] = []
        self.summaries: list[dict] = []

    def slice(self, when: str) -> InstanceProfile:
        busy0, ours0, t0 = machine_busy(), own_cpu(self.servers, self.procs), time.monotonic()
        self.model, inst = asyncio.run(self.profiler.run(1))
        foreign = foreign_cpu(busy0, ours0, t0, self.servers, self.procs)
        self.slices.append(inst)
        self.summaries.append(
            {
                "when": when,
                "foreign_cpu_pct": foreign,
                "decode_ms_1x512": inst.decode_ms(1, 512),
                "prefill_ms_512": inst.prefill_ms(512),
                "beside_prefill": inst.beside_prefill,
                "beside_decode": inst.beside_decode,
                "wake_after_idle": inst.wake_after_idle,
                "pd_wake_after_idle": inst.pd_wake_after_idle,
                "first_step_ms": inst.first_step_ms,
                "join_ms_640": inst.join_ms(640),
            }
        )
        print(
            f"  profile {when} in {time.monotonic() - t0:.0f} s: a lone decode step {inst.decode_ms(1, 512):.2f} ms, "
            f"a lone 512-token prefill {inst.prefill_ms(512):.1f} ms; other processes {foreign:.0f} % of a core",
            flush=True,
        )
        return inst


def replay_rounds(
    urls: dict[str, str],
    relay_url: str,
    model: str,
    traces: dict[str, list[TraceRequest]],
    repeats: int,
    servers: list,
    procs: list[subprocess.Popen],
    after_round: Callable[[int], object],
) -> dict[str, dict[str, list[dict]]]:
    """``repeats`` rounds; each replays every trace once per deployment (the deployments' order flips every
    round), so the machine's drift is spread over every load and deployment alike. Before each replay a
    speed probe of the profiled instance."""
    runs: dict[str, dict[str, list[dict]]] = {load: {name: [] for name in urls} for load in traces}
    seeds = itertools.count(2000)
    for i in range(repeats):
        for load, trace in traces.items():
            for name in list(urls) if i % 2 == 0 else list(reversed(urls)):
                speed = asyncio.run(speed_probe(relay_url, model))
                busy0, ours0, t1 = machine_busy(), own_cpu(servers, procs), time.monotonic()
                rows = asyncio.run(replay(urls[name], model, trace, next(seeds)))
                foreign = foreign_cpu(busy0, ours0, t1, servers, procs)
                runs[load][name].append(
                    {
                        "requests": rows,
                        "speed": speed,
                        "foreign_cpu_pct": foreign,
                        "when": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                        "loadavg": os.getloadavg()[0],
                    }
                )
                print(
                    f"  round {i + 1} {load} {name}: {len(rows)} requests in {time.monotonic() - t1:.0f} s; "
                    f"speed probe {speed}; other processes {foreign:.0f} % of a core",
                    flush=True,
                )
                time.sleep(1.0)  # let the last streams' teardown settle before the next replay
        after_round(i)
    return runs


async def speed_probe(url: str, model: str, n: int = 3, vocab_size: int = 4000) -> dict[str, float]:
    """The machine's speed now: a lone 512-token prefill (TTFT) and a lone request's steady decode step,
    medians of ``n``, back to back (ms)."""
    prompts = UniquePrompts(vocab_size, seed=next(CHECK_SEEDS))
    prefill, decode = [], []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        for _ in range(n):
            s = await stream_completion(session, url, model, prompts.make(512), 24)
            prefill.append(s.ttft * 1e3)
            decode.append((s.stamps[-1] - s.stamps[12]) / (len(s.stamps) - 13) * 1e3)
    return {"prefill_ms": round(statistics.median(prefill), 2), "decode_ms": round(statistics.median(decode), 3)}


def foreign_cpu(busy0: float, ours0: float, t0: float, servers: list, procs: list[subprocess.Popen]) -> float:
    """% of a core that processes outside this benchmark used since t0 (the e2e lock stops only lock-takers)."""
    return (machine_busy() - busy0 - (own_cpu(servers, procs) - ours0)) / (time.monotonic() - t0) * 100


PROXY_LOG_KEYS = (
    "ts",
    "decode_instance",
    "prefill_s",
    "decode_first_token_s",
    "prefill_to_decode_gap_s",
    "ttft_s",
    "tpot_s",
    "events",
    "outcome",
)


def slim(line: dict) -> dict:
    """A proxy request-log line with what the analysis reads (ids and trace ids dropped)."""
    return {k: round(v, 5) if isinstance(v, float) else v for k, v in line.items() if k in PROXY_LOG_KEYS}


def without_raw(results: dict) -> dict:
    """The results less each request's token gaps and the proxies' logs (they stay in --log-dir's
    plan_validate_full.json): what --report reads, small enough to keep in the repository."""
    out = {k: v for k, v in results.items() if k != "proxy_log"}
    out["loads"] = {
        load: {
            name: [
                {**run, "requests": [{k: v for k, v in r.items() if k != "gaps_ms"} for r in run["requests"]]}
                for run in runs
            ]
            for name, runs in d.items()
        }
        for load, d in results["loads"].items()
    }
    return out


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


def run_profile_path(profile: Path) -> Path:
    """Where the profile over the run goes: the samples of every slice (before the replays, after each round)."""
    return profile.with_name(f"{profile.stem}_run{profile.suffix}")


def slices_path(profile: Path) -> Path:
    """Where every slice goes as a profile of its own (a JSON list of profiles)."""
    return profile.with_name(f"{profile.stem}_slices{profile.suffix}")


def load_slices(path: Path) -> list[LatencyProfile]:
    return msgspec.json.decode(path.read_bytes(), type=list[LatencyProfile]) if path.exists() else []


CHECK_SEEDS = itertools.count(100)
SEEDS = range(5)  # the simulator's decode-spread draws: every seed's requests are pooled, as the repeats are


def simulated(
    profiles: list[LatencyProfile], deployment: Deployment, trace: list[TraceRequest]
) -> dict[str, list[float]]:
    """Every profile's simulation with every seed, pooled."""
    sims = [r for profile in profiles for seed in SEEDS for r in simulate(profile, deployment, trace, seed=seed)]
    return {"ttft": [r.ttft for r in sims], "tpot": [r.tpot for r in sims if r.spec.output_tokens > 1]}


def measured(runs: list[dict]) -> dict[str, list[float]]:
    rows = [r for run in runs for r in run["requests"]]
    return {"ttft": [r["ttft"] for r in rows], "tpot": [r["tpot"] for r in rows if r["tokens"] > 1]}


def report(
    results: dict,
    before: LatencyProfile,
    over_run: LatencyProfile | None,
    slices: list[LatencyProfile],
    traces: dict[str, list[TraceRequest]],
) -> None:
    """Simulated vs measured (every round's requests pooled) per deployment, load and metric: with the
    profile taken before the replays (what a user of `vllm-pd plan` has); with the profile over the run
    (the samples of every slice fitted together: the machine's drift over the run, averaged into one fit);
    and with every slice's own profile, their simulations pooled (the drift kept: each slice is the
    machine at its minutes, as each round's replays are)."""
    profiles = {"profile before the replays": [before]}
    if over_run:
        profiles["profile over the run"] = [over_run]
    if slices:
        profiles["slices pooled"] = slices
    columns = " | ".join(f"simulated, {k} (ms) | error" for k in profiles)
    print(f"| deployment | load | metric | measured (ms) | {columns} |\n|---|---|---|---|" + "---|---|" * len(profiles))
    within = dict.fromkeys(profiles, 0)
    total = 0
    for name, d in DEPLOYMENTS.items():
        for load, trace in traces.items():
            runs = results["loads"].get(load, {}).get(name)
            if not runs:
                continue
            meas = measured(runs)
            sims = {k: simulated(prof, d, trace) for k, prof in profiles.items()}
            rate = (len(trace) - 1) / (trace[-1].arrival - trace[0].arrival)
            foreign = max(run["foreign_cpu_pct"] for run in runs)
            where = f"{load} ({rate:.1f} req/s, {len(runs)} x {len(trace)}; other processes <= {foreign:.0f} %)"
            for metric in ("ttft", "tpot"):
                for q in (50, 90):
                    m = percentile(meas[metric], q / 100) * 1e3
                    cells = []
                    for k, sim in sims.items():
                        s = percentile(sim[metric], q / 100) * 1e3
                        within[k] += abs(s - m) / m <= 0.15
                        cells.append(f"{s:.1f} | {(s - m) / m * 100:+.0f} %")
                    total += 1
                    print(f"| {d.label} | {where} | {metric.upper()} p{q} | {m:.1f} | " + " | ".join(cells) + " |")
    print("\nwithin 15 %: " + ", ".join(f"{n} of {total} with the {k}" for k, n in within.items()))
    ttft_by_gap(results, over_run or before, traces)
    for sl in results.get("profile_slices", []):
        print(
            f"profile slice {sl['when']}: a lone decode step {sl['decode_ms_1x512']:.2f} ms, a lone 512-token "
            f"prefill {sl['prefill_ms_512']:.1f} ms, beside a neighbour x{sl['beside_prefill']} (decode) / "
            f"x{sl['beside_decode']} (prefill), after idle {wake_text(sl.get('wake_after_idle', []))} "
            f"(through the pair {wake_text(sl.get('pd_wake_after_idle', []))}), first "
            f"decode steps +{sl.get('first_step_ms', 0.0):.2f} ms, a 640-token join "
            f"{sl.get('join_ms_640', 0.0):.1f} ms of decode's steps; other processes {sl['foreign_cpu_pct']:.0f} % "
            "of a core"
        )
    speeds = [run["speed"] for d in results["loads"].values() for runs in d.values() for run in runs]
    reference = results["speed_at_profile"]
    for key in ("prefill_ms", "decode_ms"):
        xs = sorted(sp[key] for sp in speeds)
        print(
            f"speed probe {key}: {reference[key]} after the first profile, {xs[0]}-{xs[-1]} before the replays "
            f"(median {xs[len(xs) // 2]})"
        )


GAPS_S = (0.0, 0.3, 0.6, 1.0, 2.0, float("inf"))


def ttft_by_gap(results: dict, profile: LatencyProfile, traces: dict[str, list[TraceRequest]]) -> None:
    """Per request of the lightest load, measured (median of the rounds) less simulated (mean of the seeds)
    TTFT, by the gap since the trace's previous arrival: what idleness costs that the profile's wake-up
    curves do not give (a trend with the gap is a wake-up the simulation misses or overcharges)."""
    load = next(iter(traces))
    trace = traces[load]
    for name, d in DEPLOYMENTS.items():
        runs = results["loads"].get(load, {}).get(name)
        if not runs:
            continue
        sims = [simulate(profile, d, trace, seed=seed) for seed in SEEDS]
        by_gap: dict[int, list[float]] = {}
        for i, req in enumerate(trace):
            gap = req.arrival - trace[i - 1].arrival if i else float("inf")
            diff = statistics.median(run["requests"][i]["ttft"] for run in runs) - statistics.mean(
                sim[i].ttft for sim in sims
            )
            by_gap.setdefault(min(bisect.bisect_right(GAPS_S, gap), len(GAPS_S) - 1) - 1, []).append(diff * 1e3)
        cells = [
            f"{GAPS_S[k]:g}-{GAPS_S[k + 1]:g} s {statistics.median(v):+.1f} ms (n={len(v)})"
            for k, v in sorted(by_gap.items())
        ]
        print(f"{d.label} {load}, measured - simulated TTFT by the gap since the previous arrival: " + ", ".join(cells))


def wake_text(points: list) -> str:
    return ", ".join(f"+{ms:.1f} ms ({idle:.0f} ms)" for idle, ms in points) or "not measured"


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
    ap.add_argument(
        "--load", nargs="+", choices=sorted(LOADS), default=sorted(LOADS), help="replay these traces (default: all)"
    )
    ap.add_argument(
        "--repeats",
        type=int,
        default=3,
        help="rounds: replays of each trace per deployment, a profile slice after each (default 3)",
    )
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--profile", type=Path, default=HERE / "plan_profile.json")
    ap.add_argument("--results", type=Path, default=HERE / "plan_validate_results.json")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-plan-logs"))
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=60.0,
        help="before the run, wait at most this long for the machine to be quiet (s)",
    )
    args = ap.parse_args()
    traces = load_traces(args.load)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    if args.run:
        wait_quiet(args.quiet_wait)
        full = run_pair(args, traces)
        (args.log_dir / "plan_validate_full.json").write_text(json.dumps(full) + "\n")
        args.results.write_text(json.dumps(without_raw(full), indent=1) + "\n")
    if args.report:
        over_run = run_profile_path(args.profile)
        report(
            json.loads(args.results.read_text()),
            load_profile(args.profile),
            load_profile(over_run) if over_run.exists() else None,
            load_slices(slices_path(args.profile)),
            traces,
        )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
