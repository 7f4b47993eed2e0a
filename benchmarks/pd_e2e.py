"""End to end on real vLLM CPU servers: 1P1D behind the vllm-pd proxy vs one colocated instance.

    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/pd_e2e.py --config colocated
    flock /tmp/vllm-pd-heavy.lock python3 benchmarks/pd_e2e.py --config 1p1d
    python3 benchmarks/pd_e2e.py --report                 # table + benchmarks/pd_e2e_{ttft,tpot,itl}.svg

Each configuration runs in its own invocation (never both at once; each stays
under the heavy lock's 5-minute budget) and merges its figures into --results.
Both get the same 2 cores of this machine:

- 1p1d: prefill on core 0, decode on core 1 (each instance's whole process
  tree pinned, as in benchmarks/pd_latency.py), our connector (--kv-mode pull
  by default: it beat push on 1-core instances there), our proxy in front.
- colocated: one plain instance given both cores (OpenMP threads on 0-1).

Load: the same seeded open-loop schedule for both - Poisson arrivals at each
rate, a mix of long and short unique prompts (no prefix-cache hits), a fixed
output length (ignore_eos). The proxy and this load generator float over both
cores in both configurations. TTFT = request sent -> first streamed token as
the client sees it; TPOT = (last token - first token) / (tokens - 1); ITL p99 =
the 99th percentile of all gaps between consecutive tokens (where a prefill
stalling a colocated decode batch shows; a per-request TPOT averages it away).
The CPU other processes used during each rate is printed: the heavy lock only
serialises lock-takers, and this machine is shared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
from cpu_meter import CpuMeter
from pd_latency import BENCH_MODEL, Prompts, ours_ktc, spec, start, stop
from svg_chart import BarChart

from vllm_pd.small_model import ensure_model
from vllm_pd.vllm_server import free_port

HERE = Path(__file__).resolve().parent


@dataclass
class Outcome:
    rate: float
    long: bool
    ttft: float  # seconds
    tpot: float  # seconds
    ok: bool
    gaps: tuple[float, ...] = ()  # seconds between consecutive tokens (a prefill stalling decode shows here)


async def one_request(
    session: aiohttp.ClientSession, url: str, prompt: list[int], tokens: int, long: bool, rate: float
) -> Outcome:
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    t0 = time.perf_counter()
    stamps: list[float] = []
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                print(f"    HTTP {r.status}: {(await r.text())[:200]}", flush=True)
                return Outcome(rate, long, 0.0, 0.0, False)
            async for line in r.content:
                if line.startswith(b"data: {"):  # one event per token (ignore_eos, no usage event)
                    stamps.append(time.perf_counter())
    except aiohttp.ClientError as e:
        print(f"    {e!r}", flush=True)
        return Outcome(rate, long, 0.0, 0.0, False)
    if not stamps:
        return Outcome(rate, long, 0.0, 0.0, False)
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1) if len(stamps) > 1 else 0.0
    gaps = tuple(b - a for a, b in zip(stamps, stamps[1:]))
    return Outcome(rate, long, stamps[0] - t0, tpot, True, gaps)


async def poisson_load(
    url: str, rate: float, seconds: float, args: argparse.Namespace, prompts: Prompts
) -> list[Outcome]:
    rng = random.Random(int(rate * 1000))  # the same schedule for every configuration
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        tasks = []
        t = 0.0
        t_start = time.perf_counter()
        while True:
            t += rng.expovariate(rate)
            if t > seconds:
                break
            long = rng.random() < args.long_fraction
            prompt = prompts.make(args.long if long else args.short)
            await asyncio.sleep(max(0.0, t_start + t - time.perf_counter()))
            tasks.append(asyncio.create_task(one_request(session, url, prompt, args.output_tokens, long, rate)))
        return list(await asyncio.gather(*tasks))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def summarise(outcomes: list[Outcome]) -> dict[str, float]:
    ok = [o for o in outcomes if o.ok]
    ttft = [o.ttft * 1e3 for o in ok]
    tpot = [o.tpot * 1e3 for o in ok]
    return {
        "requests": len(outcomes),
        "ok": len(ok),
        "ttft_p50": pct(ttft, 0.5),
        "ttft_p99": pct(ttft, 0.99),
        "tpot_p50": pct(tpot, 0.5),
        "tpot_p99": pct(tpot, 0.99),
        "itl_p99": pct([g * 1e3 for o in ok for g in o.gaps], 0.99),
        "ttft_p50_long": pct([o.ttft * 1e3 for o in ok if o.long], 0.5),
        "ttft_p50_short": pct([o.ttft * 1e3 for o in ok if not o.long], 0.5),
    }


def machine_busy() -> float:
    """CPU seconds the whole machine spent busy (all cores)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq


def own_cpu(servers: list[Any], procs: list[subprocess.Popen]) -> float:
    """CPU seconds of this benchmark's processes: the servers' trees, the proxy, this load generator."""
    trees = CpuMeter([s.pid for s in servers] + [p.pid for p in procs])
    return trees.seconds() + CpuMeter([None], tree=False).seconds()


def start_proxy(prefill: str, decode: str, kv_mode: str) -> tuple[subprocess.Popen, str]:
    return proxy_process(["--prefill", prefill, "--decode", decode, "--kv-mode", kv_mode])


def proxy_process(flags: list[str]) -> tuple[subprocess.Popen, str]:
    """The vllm-pd proxy in a process of its own with these instance flags, once healthy."""
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(HERE.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    p = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "vllm_pd.router.cli.command_proxy",
            "--port",
            str(port),
            *flags,
            "--log-level",
            "WARNING",
        ],
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return p, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    p.terminate()
    raise TimeoutError("proxy did not become healthy")


def run_config(args: argparse.Namespace) -> dict[str, Any]:
    model = ensure_model(BENCH_MODEL)
    prompts = Prompts(seed=7)
    extra: dict[str, Any] = {}
    procs: list[subprocess.Popen] = []
    t_boot = time.monotonic()
    if args.config == "colocated":
        servers = start([spec(model, "0-1", None)], args.log_dir)
        url = servers[0].url
    else:
        pk, dk = free_port(), free_port()
        servers = start(
            [spec(model, "0", ours_ktc("kv_producer", pk)), spec(model, "1", ours_ktc("kv_consumer", dk))], args.log_dir
        )
        proxy, url = start_proxy(servers[0].url, f"{servers[1].url}@tcp://127.0.0.1:{dk}", args.kv_mode)
        procs.append(proxy)
    print(f"{args.config}: servers up in {time.monotonic() - t_boot:.0f} s", flush=True)
    rows = {}
    try:
        # warm-up: first-request costs (and the connector's first connection) stay out of the figures
        asyncio.run(
            poisson_load(url, 2.0, 1.0, argparse.Namespace(**{**vars(args), "long_fraction": 0.5}), Prompts(seed=99))
        )
        for rate in args.rates:
            busy0, ours0 = machine_busy(), own_cpu(servers, procs)
            t0 = time.monotonic()
            outcomes = asyncio.run(poisson_load(url, rate, args.seconds, args, prompts))
            foreign = (machine_busy() - busy0 - (own_cpu(servers, procs) - ours0)) / (time.monotonic() - t0)
            rows[str(rate)] = summarise(outcomes)
            rows[str(rate)]["foreign_cpu_pct"] = foreign * 100
            r = rows[str(rate)]
            print(
                f"  {args.config:10s} {rate:4.1f} req/s  {r['ok']:3d}/{r['requests']:3d} ok  "
                f"TTFT p50 {r['ttft_p50']:7.1f} p99 {r['ttft_p99']:7.1f} ms (long {r['ttft_p50_long']:.0f}, "
                f"short {r['ttft_p50_short']:.0f})  TPOT p50 {r['tpot_p50']:6.1f} p99 {r['tpot_p99']:6.1f} ms  "
                f"ITL p99 {r['itl_p99']:6.1f} ms  other processes {r['foreign_cpu_pct']:.0f} % of a core",
                flush=True,
            )
        if args.config == "1p1d":
            text = httpx.get(servers[1].url + "/metrics", timeout=10).text
            extra["decode_loads"] = {
                res: sum(
                    float(line.rsplit(" ", 1)[1])
                    for line in text.splitlines()
                    if line.startswith("vllm:pd_loads_total{") and f'result="{res}"' in line
                )
                for res in ("ok", "failed")
            }
            print(f"  decode KV loads: {extra['decode_loads']}", flush=True)
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)
        stop(servers)
    return {
        "rows": rows,
        "extra": extra,
        "kv_mode": args.kv_mode if args.config == "1p1d" else None,
        "load": {k: getattr(args, k) for k in ("rates", "seconds", "long", "short", "long_fraction", "output_tokens")},
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def report(results: dict[str, Any], svg_prefix: Path) -> None:
    names = [n for n in ("colocated", "1p1d") if n in results]
    rates = results[names[0]]["rows"].keys()
    label = {"colocated": "colocated (1 instance, 2 cores)", "1p1d": "1P1D (vllm-pd proxy + connector)"}
    print(
        "| config | rate (req/s) | TTFT p50 / p99 (ms) | TTFT p50 long / short (ms) | TPOT p50 / p99 (ms) "
        "| ITL p99 (ms) | other processes (% of a core) | ok |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for n in names:
        for rate, r in results[n]["rows"].items():
            print(
                f"| {label[n]} | {rate} | {r['ttft_p50']:.0f} / {r['ttft_p99']:.0f} | {r['ttft_p50_long']:.0f} / "
                f"{r['ttft_p50_short']:.0f} | {r['tpot_p50']:.1f} / {r['tpot_p99']:.1f} "
                f"| {r.get('itl_p99', float('nan')):.0f} "
                f"| {r.get('foreign_cpu_pct', float('nan')):.0f} | {r['ok']}/{r['requests']} |"
            )
    groups = [f"{r} req/s" for r in rates]
    for metric_name, title, qs in (
        ("ttft", "TTFT", ("p50", "p99")),
        ("tpot", "TPOT", ("p50", "p99")),
        ("itl", "Inter-token latency", ("p99",)),
    ):
        series = {f"{n} {q}": [results[n]["rows"][r][f"{metric_name}_{q}"] for r in rates] for n in names for q in qs}
        path = BarChart(
            f"{title}, mixed long/short prompts, 1P1D vs colocated (2 cores)", f"{title} (ms)", groups, series
        ).write(f"{svg_prefix}_{metric_name}.svg")
        print(f"wrote {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=("colocated", "1p1d"))
    ap.add_argument("--report", action="store_true", help="print the table and write the plots")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0])
    ap.add_argument("--seconds", type=float, default=20.0, help="arrival window per rate")
    ap.add_argument("--long", type=int, default=2048, help="long prompt, tokens")
    ap.add_argument("--short", type=int, default=128, help="short prompt, tokens")
    ap.add_argument("--long-fraction", type=float, default=0.25)
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--kv-mode", choices=("pull", "push"), default="pull")
    ap.add_argument("--results", type=Path, default=HERE / "pd_e2e_results.json")
    ap.add_argument("--svg-prefix", type=Path, default=HERE / "pd_e2e")
    ap.add_argument("--log-dir", type=Path, default=Path("/tmp/vllm-pd-bench-logs"))
    args = ap.parse_args()
    results = json.loads(args.results.read_text()) if args.results.exists() else {}
    if args.config:
        args.log_dir.mkdir(parents=True, exist_ok=True)
        results[args.config] = run_config(args)
        args.results.write_text(json.dumps(results, indent=1) + "\n")
    if args.report:
        report(results, args.svg_prefix)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
