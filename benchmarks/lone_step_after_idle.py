"""Lone requests' TTFT and decode steps by path, idle time and output length (plan_validate's replays run
slower than its profile and probes)

    PYTHONPATH=. flock /tmp/e2e.lock python3 benchmarks/lone_step_after_idle.py

The pair plan_validate.py uses (two kv_both instances of the built-in small model, one core each, our
connector over shm). Paths: straight to b; a proxy in front of b alone (as the profile and the speed probe
use it); the colocated x2 proxy (a and b, least outstanding, a request log, as the replays run it); the
1P1D proxy (prefill on a, decode on b, push). Blocks of 12 lone requests (unique prompts of 128 or 768
tokens) one after the other, back to back or after a pause; 16 tokens out, and 1 (a prefill alone, as the
profile measures prefill) through the relay proxy. Every round runs every block once, in an order of its
own (this machine drifts by minutes). Per block: median TTFT, steady step (gaps 6-15), first gap and
TPOT; the medians of the rounds' block medians are printed against the relay proxy back to back (how
profiles and probes run), same prompt length.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import random
import statistics
import sys
import time
from collections import defaultdict

import aiohttp
from pd_e2e import proxy_process

from vllm_pd.planner.instance_profiler import UniquePrompts, stream_completion
from vllm_pd.router.cli.local_cluster import LocalCluster
from vllm_pd.small_model import ensure_default_model

PAUSES_S = (0.0, 0.3)
PROMPTS = (128, 768)
ROUNDS = 4
SEEDS = itertools.count(3000)


async def lone_requests(
    url: str, model: str, pause: float, out_tokens: int, prompt: int = 512, n: int = 12
) -> dict[str, float]:
    prompts = UniquePrompts(4000, seed=next(SEEDS))
    ttft, steady, first, tpot = [], [], [], []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            await asyncio.sleep(pause)
            s = await stream_completion(session, url, model, prompts.make(prompt), out_tokens)
            ttft.append(s.ttft * 1e3)
            gaps = [(b - a) * 1e3 for a, b in zip(s.stamps, s.stamps[1:])]
            if len(gaps) > 5:
                steady.append(statistics.mean(gaps[5:]))
                first.append(gaps[0])
                tpot.append(statistics.mean(gaps))
    row = {"ttft_ms": statistics.median(ttft)}
    if steady:
        row |= {
            "steady_ms": statistics.median(steady),
            "first_gap_ms": statistics.median(first),
            "tpot_ms": statistics.median(tpot),
        }
    return row


def describe(r: dict[str, float], ref: dict[str, float]) -> str:
    out = f"TTFT {r['ttft_ms']:5.1f} ms (= {r['ttft_ms'] / ref['ttft_ms']:.2f} x)"
    if "steady_ms" in r:
        out += (
            f", steady step {r['steady_ms']:.3f} ms (= {r['steady_ms'] / ref['steady_ms']:.2f} x), "
            f"first gap {r['first_gap_ms']:.2f} ms, TPOT {r['tpot_ms']:.3f} ms"
        )
    return out


def main() -> int:
    model = str(ensure_default_model())
    cluster = LocalCluster(model=model, n_prefill=0, n_decode=0, n_both=2, transport="shm", connector="PDConnector")
    procs = []
    with cluster.running(600):
        a, b = cluster.instances()
        try:
            paths = {"straight to b": b.url}
            for name, flags in (
                ("relay proxy", ["--decode", b.url]),
                (
                    "colocated x2 proxy",
                    ["--decode", a.url, "--decode", b.url, "--request-log", "/tmp/lone-step-colocated.jsonl"],
                ),
                ("1P1D proxy", ["--prefill", a.url, "--decode", f"{b.url}@{b.kv_endpoint}"]),
            ):
                proc, paths[name] = proxy_process(flags)
                procs.append(proc)
            for url in paths.values():
                asyncio.run(lone_requests(url, model, 0.0, 16, 512, 4))  # warm-up
            blocks = [
                (name, pause, out, prompt)
                for name in paths
                for pause in PAUSES_S
                for prompt in PROMPTS
                for out in (1, 16)
                if out == 16 or name == "relay proxy"
            ]
            results: dict[tuple[str, float, int, int], list[dict[str, float]]] = defaultdict(list)
            rng = random.Random(0)
            for rnd in range(ROUNDS):
                rng.shuffle(blocks)
                for name, pause, out, prompt in blocks:
                    results[name, pause, out, prompt].append(
                        asyncio.run(lone_requests(paths[name], model, pause, out, prompt))
                    )
                print(f"round {rnd + 1} done {time.strftime('%H:%M:%S UTC', time.gmtime())}", flush=True)
        finally:
            for proc in procs:
                proc.terminate()
                proc.wait(10)
    medians = {key: {k: statistics.median(r[k] for r in rows) for k in rows[0]} for key, rows in results.items()}
    print(
        f"medians of {ROUNDS} rounds' block medians; x: against the relay proxy back to back, 16 tokens out, "
        "same prompt"
    )
    for (name, pause, out, prompt), med in sorted(medians.items(), key=lambda kv: (kv[0][3], kv[0][0], kv[0][1:])):
        spread = ", ".join(f"{r['ttft_ms']:.1f}" for r in results[name, pause, out, prompt])
        print(
            f"{prompt:4d} tokens {name:19s} pause {pause:.1f} s, {out:2d} out: "
            f"{describe(med, medians['relay proxy', 0.0, 16, prompt])}; TTFT per round {spread}"
        )
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
